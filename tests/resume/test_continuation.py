"""The acceptance test of resume: bitwise continuation across a SIGKILL and a new process.

A run of 2N steps in one process must end with exactly the parameters, optimizer and scheduler state,
RNG states (torch, numpy, python), shuffle-generator state and per-step losses of a run that trained N
steps, committed a cut, was SIGKILLed, and was resumed for N more steps in a new process. Both the
synchronous ``Store.save`` path and the background ``Checkpointer`` (writer process) path are run; the
reference is the uninterrupted synchronous run, so the background path must also leave training
untouched. The trainer is ``tests/resume/trainer.py`` (see its docstring).

The five trainer processes (each imports torch: about 3 s of CPU) run two phases at a time: the
reference and both killed runs together, then both resumed runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import Store
from statekit import assert_bitwise, resume_info

TRAINER = Path(__file__).with_name("trainer.py")
N = 7  # kill after step 7: inside the second epoch (5 batches each), between StepLR boundaries
TOTAL = 2 * N
EVERY = 3
PATHS = ("sync", "checkpointer")
RUN_TIMEOUT = 300  # seconds; a bound on a hang, not a clock
GRACE_S = 60  # a cluster's grace period between the preemption notice and SIGKILL (SLURM's default KillWait is 30 s)


class Run:
    """One trainer process: started at once, finished (output parsed) on demand."""

    def __init__(self, url: str, out: str, path: str, kill_after: int | None, *more: str) -> None:
        cmd = [sys.executable, str(TRAINER), url, "--steps", str(TOTAL), "--path", path, "--every", str(EVERY),
               "--out", out, *more]
        if kill_after is not None:
            cmd += ["--kill-after", str(kill_after)]
        self.out = out
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.PIPE if more else subprocess.DEVNULL,
                                     cwd=str(TRAINER.parent.parent.parent))
        self.pid = self.proc.pid
        self.returncode: int | None = None
        self.events: list[dict[str, Any]] = []
        self.stderr = ""
        self._read = ""

    def preempt(self, signals: tuple[signal.Signals, ...]) -> float:
        """For a run with --preempt-at: waits until it pauses inside that step, sends ``signals`` to the
        trainer and its writer process (as SLURM signals every process of a job step), lets the step end,
        and returns the seconds from the first signal until the trainer exited (bounded: the grace period)."""
        lines = []
        while True:
            line = self.proc.stdout.readline()
            assert line, f"trainer ended before pausing: {''.join(lines)}"
            lines.append(line)
            if line.startswith("{") and json.loads(line)["event"] == "paused":
                paused = json.loads(line)
                break
        self._read = "".join(lines)
        t0 = time.monotonic()
        for sig in signals:
            for pid in (paused["pid"], paused["writer_pid"]):
                os.kill(pid, sig)
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=GRACE_S)
        return time.monotonic() - t0

    def finish(self) -> "Run":
        if self.returncode is None:
            try:
                stdout, self.stderr = self.proc.communicate(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                stdout, self.stderr = self.proc.communicate()
                raise AssertionError(f"trainer hung:\n{stdout}\n{self.stderr}") from None
            self.returncode = self.proc.returncode
            stdout = self._read + stdout
            self.events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        return self

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def final_state(self) -> dict[str, Any]:
        assert self.returncode == 0, self.stderr
        return torch.load(self.out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("continuation")
    started: list[Run] = []
    try:
        return _run_all(root, started)
    finally:
        for r in started:  # only after a failure: a run still going is ended, not left behind
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


def _run_all(root: Path, started: list[Run]) -> dict[str, Any]:
    ref = Run(str(root / "ref-store"), str(root / "ref.pt"), "sync", None)
    killed = {p: Run(str(root / f"{p}-store"), str(root / f"{p}-killed.pt"), p, N) for p in PATHS}
    preempted = Run(str(root / "preempt-store"), str(root / "preempt.pt"), "checkpointer", None, "--preempt-at", str(N))
    started += [ref, *killed.values(), preempted]
    exit_s = preempted.preempt((signal.SIGUSR1, signal.SIGTERM))
    for r in (ref, *killed.values(), preempted):
        r.finish()
    # What the kill left, read before anything resumes.
    after_kill: dict[str, Any] = {}
    for p, r in killed.items():
        with Store.open(str(root / f"{p}-store"), readonly=True) as s:
            after_kill[p] = {"latest": s.latest(), "cuts": s.cuts()}
        after_kill[p]["resume_info"] = resume_info(str(root / f"{p}-store"))
    with Store.open(str(root / "preempt-store"), readonly=True) as s:
        after_kill["preempt"] = {"latest": s.latest(), "cuts": s.cuts()}
    resumed = {p: Run(str(root / f"{p}-store"), str(root / f"{p}-resumed.pt"), p, None) for p in PATHS}
    resumed["preempt"] = Run(str(root / "preempt-store"), str(root / "preempt-resumed.pt"), "checkpointer", None)
    started += resumed.values()
    for r in resumed.values():
        r.finish()
    return {"ref": ref, "killed": killed, "after_kill": after_kill, "resumed": resumed, "root": root,
            "preempted": preempted, "preempt_exit_s": exit_s}


@pytest.mark.parametrize("path", PATHS)
def test_killed_run_dies_right_after_the_kill_steps_cut_commits(runs, path):
    killed = runs["killed"][path]
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.of("fresh") and not killed.of("done")
    assert killed.events[-1]["event"] == "kill" and killed.events[-1]["step"] == N
    cut_events = killed.of("cut")
    assert cut_events[-1]["step"] == N and cut_events[-1]["final"] is False
    after = runs["after_kill"][path]
    assert after["latest"].id == cut_events[-1]["cut"] and after["latest"].final is False
    assert max(c.step for c in after["cuts"]) == N  # nothing of a later step was committed
    code, doc = after["resume_info"]  # what a launcher sees: an interrupted run to resume
    assert code == 0
    assert doc["resume_step"] == N and doc["cut"] == after["latest"].id
    assert doc["finished"] is False and doc["healthy"] is True and doc["skipped"] == []


@pytest.mark.parametrize("path", PATHS)
def test_resumed_run_continues_from_the_kill_cut_in_a_new_process(runs, path):
    killed, resumed = runs["killed"][path], runs["resumed"][path]
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.pid != killed.pid
    (ev,) = resumed.of("resumed")
    assert ev["step"] == N and ev["cut"] == killed.of("cut")[-1]["cut"]
    cuts = resumed.of("cut")
    assert cuts[-1]["step"] == TOTAL and cuts[-1]["final"] is True
    assert all(c["step"] > N for c in cuts)
    with Store.open(str(runs["root"] / f"{path}-store"), readonly=True) as s:
        latest = s.latest()
    assert latest.step == TOTAL and latest.final is True
    code, doc = resume_info(str(runs["root"] / f"{path}-store"))
    assert code == 0 and doc["resume_step"] == TOTAL and doc["finished"] is True and doc["healthy"] is True


def test_reference_run_is_uninterrupted(runs):
    ref = runs["ref"]
    assert ref.returncode == 0, ref.stderr
    assert ref.of("fresh") and not ref.of("resumed") and not ref.of("kill")
    assert sorted(ref.final_state()["losses"]) == list(range(1, TOTAL + 1))


def test_preemption_signals_end_the_run_with_a_cut_of_that_step(runs):
    """SIGUSR1 then SIGTERM, sent to the trainer and its writer while step N runs (as a cluster does at
    the start of the grace period): the Checkpointer's handlers only raise a flag (and chain to the
    trainer's own SIGTERM handler), maybe_cut(N) takes a cut of step N though N % every != 0, through
    the writer process (which ignored the signals), waits for its commit, and the run exits 0 within
    the grace period with LATEST at step N, tagged "preempted"."""
    run = runs["preempted"]
    assert run.returncode == 0, run.stderr
    assert runs["preempt_exit_s"] < GRACE_S
    (pre,) = run.of("preempted")
    assert pre == {"event": "preempted", "step": N, "chained": [int(signal.SIGTERM)], "fallback": None}, pre
    cuts = [e["step"] for e in run.of("cut")]  # a periodic cut may be skipped while one is in flight
    assert N % EVERY != 0 and cuts[-1] == N and set(cuts[:-1]) <= {3, 6}, cuts
    latest = runs["after_kill"]["preempt"]["latest"]
    assert latest.step == N and "preempted" in latest.tags and not latest.final
    assert run.of("done") == []


@pytest.mark.parametrize("path", [*PATHS, "preempt"])
def test_resumed_run_ends_bitwise_identical_to_the_uninterrupted_run(runs, path):
    ref = runs["ref"].final_state()
    got = runs["resumed"][path].final_state()
    # The second half's losses are the same floats, step by step (the data order, dropout masks and
    # noise were replayed exactly, not only the end state).
    assert got["losses"] == {s: ref["losses"][s] for s in range(N + 1, TOTAL + 1)}
    for key in ("model", "optimizer", "scheduler", "shuffle_gen", "position"):
        assert_bitwise(ref[key], got[key], key)
    assert set(ref["rng"]) == set(got["rng"]) >= {"torch", "numpy", "python"}
    assert torch.equal(ref["rng"]["torch"], got["rng"]["torch"])
    np_a, np_b = ref["rng"]["numpy"], got["rng"]["numpy"]
    assert np_a[0] == np_b[0] and np.array_equal(np_a[1], np_b[1]) and np_a[2:] == np_b[2:]
    assert ref["rng"]["python"] == got["rng"]["python"]


def test_the_second_half_changes_the_state(runs):
    """Guards the comparison above: the cut at the kill step differs from the end state, so a resumed
    run that trained nothing (or restored the end state from somewhere) could not pass."""
    import ckptstore

    ref = runs["ref"].final_state()
    killed = runs["killed"]["sync"]
    at_kill = ckptstore.load(str(runs["root"] / "sync-store"), killed.of("cut")[-1]["cut"])
    assert at_kill["step"] == N
    assert not all(torch.equal(v, ref["model"][k]) for k, v in at_kill["model"].items())
    assert not torch.equal(at_kill["rng"]["torch"], ref["rng"]["torch"])
    assert at_kill["rng"]["python"] != ref["rng"]["python"]


def test_killed_trainers_writer_process_exits_and_unlinks_its_block(runs):
    """SIGKILL gives the trainer no chance to clean up: its writer process must notice, unlink the
    shared block and exit on its own."""
    from ckptstore.writer.shm import leftover_segments

    killed = runs["killed"]["checkpointer"]
    writer_pid = killed.of("kill")[0]["writer_pid"]
    assert isinstance(writer_pid, int) and writer_pid != killed.pid
    deadline = time.monotonic() + 60  # a bound on waiting for its exit, not a clock being measured
    while _alive(writer_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(writer_pid), f"writer {writer_pid} outlived its SIGKILLed trainer"
    assert leftover_segments(killed.pid) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
