"""The two integration examples run as their docstrings say: kill -9 mid-run, the same command again, and
the run finishes, verified and marked finished, bit-identical to an uninterrupted run.

Each example is run as shipped (its default steps) three times, each a process of its own: an
uninterrupted reference, and a victim SIGKILLed as soon as its first checkpoint is in the store (the
store's LATEST for the Hugging Face example; the ``last.ckpt`` label the Lightning example resumes
from), started together; then the victim's command again. The kill lands wherever the run is at that
moment (the trainer only: the Hugging Face example's writer process finishes a cut it holds, and the
test waits for it to exit before the rerun, as the store's writer lock would make a user wait).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import ckptstore
from ckptstore.cli import main as cli
from statekit import assert_bitwise, resume_info

from prockit import wait_gone

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_TIMEOUT = 120  # seconds for one run of an example; a bound on a hang, not a clock


def _latest(store: str) -> ckptstore.CutInfo | None:
    try:
        with ckptstore.Store.open(store, readonly=True) as s:
            return s.latest()
    except ckptstore.StoreNotFound:
        return None


def _labelled_last(store: str) -> bool:
    try:
        with ckptstore.Store.open(store, readonly=True) as s:
            return "last.ckpt" in s.labels()
    except ckptstore.StoreNotFound:
        return False


def _hf_end(store: str) -> dict[str, Any]:
    state = ckptstore.load(store, keys=["model", "optimizer", "scheduler", "trainer_state"])
    history = json.loads(state.pop("trainer_state"))["log_history"]
    return {**state, "losses": [(h["step"], h["loss"]) for h in history if "loss" in h]}


def _lightning_end(store: str) -> dict[str, Any]:
    from ckptstore.integrations.lightning import load_checkpoint

    ckpt = load_checkpoint(os.path.join(store, "last.ckpt"))
    return {k: ckpt[k] for k in ("state_dict", "optimizer_states", "global_step")}


#: name: (script, the checkpoint the rerun resumes from is in the store (truthy), what the rerun prints,
#: end state)
CASES: dict[str, tuple[str, Callable[[str], Any], str, Callable[[str], dict[str, Any]]]] = {
    # Polled while the example writes: a reader never sees a commit half-made (recovery.classify_now).
    "hf": ("hf_example.py", _latest, "resuming from step", _hf_end),
    "lightning": ("lightning_example.py", _labelled_last, "resumed from", _lightning_end),
}


def _start(script: str, store: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(EXAMPLES / script), store], stdout=out, stderr=subprocess.STDOUT,
                                cwd=str(EXAMPLES.parent))


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out.update(int(p) for p in f.read().split())
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_killed_after_its_first_checkpoint_and_run_again_finishes_exactly(name, tmp_path):
    pytest.importorskip("transformers" if name == "hf" else "lightning")
    script, has_checkpoint, resumed_says, end_state = CASES[name]
    ref_store, store = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = _start(script, ref_store, tmp_path / "ref.log")
    victim = _start(script, store, tmp_path / "victim.log")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT  # a bound on a hang, not a clock being measured
        while not has_checkpoint(store) and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        children = _children(victim.pid) if victim.poll() is None else set()
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(RUN_TIMEOUT) == -signal.SIGKILL, (
            "the run ended before its first checkpoint was seen:\n" + (tmp_path / "victim.log").read_text()[-3000:])
        for pid in children:
            wait_gone(pid)  # a writer finishing a handed-over cut holds the store's lock until it exits
        at_kill = _latest(store)
        assert at_kill is not None and not at_kill.final  # killed mid-run

        again = subprocess.run([sys.executable, str(EXAMPLES / script), store], capture_output=True, text=True,
                               timeout=RUN_TIMEOUT, cwd=str(EXAMPLES.parent))
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert resumed_says in again.stdout, again.stdout[-3000:]
        assert ref.wait(RUN_TIMEOUT) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    finally:
        for p in (ref, victim):
            if p.poll() is None:
                p.kill()
                p.wait()

    assert cli(["verify", store]) == 0
    code, doc = resume_info(store)
    assert code == 0 and doc["finished"] is True and doc["healthy"] is True, doc
    assert doc["resume_step"] == _latest(ref_store).step
    assert_bitwise(end_state(ref_store), end_state(store), name)
