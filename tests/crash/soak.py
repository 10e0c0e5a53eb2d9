"""Random soak: a trainer with the Checkpointer in process mode, SIGKILLed at random moments (and its
writer SIGKILLed at random moments), restarted, many times. Every restart checks the invariant and that
training resumed from LATEST's step.

    python tests/crash/soak.py STORE_DIR --seconds 1800 [--seed N]    # the long run
The test suite runs a short one (tests/crash/test_soak.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field


import ckptstore
from ckptstore.writer.process import wait_gone as _gone
from ckptstore.writer.shm import leftover_segments

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "soak_trainer.py")
sys.path.insert(0, HERE)
from soak_trainer import check_state  # noqa: E402  (the trainer's own check of a loaded state)


@dataclass
class SoakReport:
    restarts: int = 0
    writer_kills: int = 0
    committed: int = 0
    resumed_steps: list[int] = field(default_factory=list)


def check_store(root: str, committed_max: int | None, many: int = 0) -> int | None:
    """The invariant after a kill; returns LATEST's step."""
    with ckptstore.Store.open(root, readonly=True) as reader:
        cls = reader.classify()
        assert cls.latest_problem is None, cls.latest_problem
        latest = reader.latest()
        assert reader.verify().ok, [f.message for f in reader.verify().errors]
    step = latest.step if latest else None
    if committed_max is not None:
        assert step is not None and step >= committed_max, f"committed step {committed_max} lost (LATEST {step})"
    if step is not None:
        check_state(ckptstore.load(root), step, many)
    return step


def run_once(root: str, rng: random.Random, report: SoakReport, *, max_run: float, extra: list[str],
             many: int) -> int:
    """One trainer run killed at a random moment; returns the step it resumed from."""
    proc = subprocess.Popen([sys.executable, TRAINER, root, *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    # The random kill moment counts from the trainer's first "writer" line (its Checkpointer is up and
    # its loop began), so a slow start (a loaded machine: the writer process's start took over 2 s in a
    # CI run, and six runs committed nothing) never turns into a kill before the run began.
    run_for = rng.uniform(0.3, max_run)
    writer_after = rng.uniform(0.1, max_run) if rng.random() < 0.4 else None
    kill_at = time.monotonic() + 120.0
    writer_kill_at = None
    writer_pid = None
    committed_max = None
    resumed = None
    buf = ""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    while time.monotonic() < kill_at and proc.poll() is None:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 1 << 16).decode()
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                ev = json.loads(line)
                if ev["event"] == "resumed":
                    resumed = ev["step"]
                elif ev["event"] == "writer":
                    if writer_pid is None:
                        kill_at = time.monotonic() + run_for
                        if writer_after is not None:
                            writer_kill_at = time.monotonic() + writer_after
                    writer_pid = ev["pid"]
                elif ev["event"] == "committed":
                    committed_max = ev["step"]
                    report.committed += 1
        if writer_kill_at is not None and time.monotonic() >= writer_kill_at and writer_pid:
            try:
                os.kill(writer_pid, signal.SIGKILL)
                report.writer_kills += 1
            except ProcessLookupError:
                pass
            writer_kill_at = None
    assert proc.poll() is None, f"trainer exited on its own with {proc.returncode}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # read what the trainer printed before it died
    os.set_blocking(fd, True)
    for line in (buf + proc.stdout.read()).splitlines():
        ev = json.loads(line)
        if ev["event"] == "committed":
            committed_max = ev["step"]
        elif ev["event"] == "writer":
            writer_pid = ev["pid"]
    report.restarts += 1
    assert resumed is not None, "the trainer was killed before it resumed"
    report.resumed_steps.append(resumed)
    # the writer notices its parent's death and leaves no shared memory behind
    if writer_pid:
        assert _gone(writer_pid, 15), f"writer {writer_pid} outlived its trainer"
    assert leftover_segments(proc.pid) == [], leftover_segments(proc.pid)
    check_store(root, committed_max, many)
    return resumed


def soak(root: str, *, seconds: float, seed: int = 0, max_run: float = 2.0, many: int = 0,
         use_torch: bool = False, min_restarts: int = 0) -> SoakReport:
    """Kills and restarts the trainer for ``seconds``, and on until ``min_restarts`` runs were killed
    (a loaded machine starts trainers slowly: a count a test asserts must not depend on the clock, at
    most ten times ``seconds`` in all); ``many`` and ``use_torch`` are soak_trainer's ``--many`` and
    ``--torch`` (a state of many small arrays)."""
    rng = random.Random(seed)
    report = SoakReport()
    extra = ["--many", str(many)] + (["--torch"] if use_torch else []) if many else []
    start = time.monotonic()
    deadline, bound = start + seconds, start + 10 * seconds
    while time.monotonic() < deadline or (report.restarts < min_restarts and time.monotonic() < bound):
        before = check_store(root, None, many) if os.path.exists(os.path.join(root, "STORE.json")) else None
        expected_resume = before if before is not None else 0
        resumed = run_once(root, rng, report, max_run=max_run, extra=extra, many=many)
        assert resumed == expected_resume, f"resumed at {resumed}, LATEST was {expected_resume}"
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--seconds", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--many", type=int, default=0, help="small arrays in the state (soak_trainer --many)")
    ap.add_argument("--torch", action="store_true", help="the small arrays as torch tensors")
    args = ap.parse_args()
    rep = soak(args.store, seconds=args.seconds, seed=args.seed, many=args.many, use_torch=args.torch)
    print(json.dumps(rep.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
