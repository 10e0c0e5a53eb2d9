"""The short soak (about a minute) and the kill sweep over the commit thread's protocol phases with the
writer in process mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ckptstore
from ckptstore.protocol import SAVE_PHASES
from ckptstore.writer.shm import leftover_segments

from .soak import TRAINER, _gone, check_store, soak


def test_short_soak(tmp_path):
    rep = soak(str(tmp_path / "store"), seconds=30, seed=1234, max_run=2.0, min_restarts=5)
    assert rep.restarts >= 5
    assert rep.committed > 0
    assert len(rep.resumed_steps) == rep.restarts
    assert max(rep.resumed_steps) > 0  # later runs really resumed from committed cuts


def _kill_at_phase_and_resume(root: str, phase: str, *, size: int, many: int = 0) -> None:
    """Runs soak_trainer (``--size``, ``--many``) until its 3rd ``phase`` (the first cuts commit, then it
    dies inside a later one); checks that no writer outlived it, the invariant and recovery; then a
    second run resumes from LATEST and ends with a final cut whose every array is the state of its step."""
    args = ["--size", str(size)] + (["--many", str(many)] if many else [])
    proc = subprocess.run([sys.executable, TRAINER, root, "--steps", "50", *args, "--busy", "wait",
                           "--kill-at", f"{phase}:3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    committed = [e["step"] for e in events if e["event"] == "committed"]
    writers = [e["pid"] for e in events if e["event"] == "writer" and e["pid"]]
    assert writers and all(_gone(pid, 15) for pid in writers)  # no orphan writer
    latest = check_store(root, max(committed) if committed else None, many)
    with ckptstore.Store.open(root) as store:  # recovery
        assert store.classify().leftovers == []
        assert store.latest().step == latest
    # the next run resumes from LATEST and continues into the same store
    out = subprocess.run([sys.executable, TRAINER, root, "--steps", str((latest or 0) + 3), *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ev = [json.loads(line) for line in out.stdout.splitlines()]
    assert ev[0] == {"event": "resumed", "step": latest or 0}
    assert ckptstore.Store.open(root, readonly=True).latest().final
    check_store(root, (latest or 0) + 4, many)  # the final cut, every array checked


# "shard-written" fires where shards are written: in the writer process here (its deaths are covered
# by the writer's fault tests and the soak), so the trainer-side sweep takes every other phase of a
# cut of one rank ("rank-written" is a phase of cuts of several: tests/ranks and the crash table).
@pytest.mark.parametrize("phase", [p for p in SAVE_PHASES if p not in ("shard-written", "rank-written")]
                         + ["prune-uncommitted", "prune-files-deleted"])
def test_kill_trainer_at_each_phase_of_a_background_cut(tmp_path, phase):
    _kill_at_phase_and_resume(str(tmp_path / "store"), phase, size=20000)


def test_short_soak_of_many_small_tensors(tmp_path):
    """Issue 23's paths under random kills of the trainer and its writer: 1,500 small torch tensors of
    five dtypes updated in place (the batched capture's layout cache is warm from the second cut),
    written in gathered batches, committed as a v4 table. Every restart loads LATEST and checks each
    tensor against its step (soak_trainer.check_state)."""
    rep = soak(str(tmp_path / "store"), seconds=20, seed=23, max_run=3.0, many=1500, use_torch=True,
               min_restarts=3)
    assert rep.restarts >= 3
    assert rep.committed > 0
    assert max(rep.resumed_steps) > 0
    with ckptstore.Store.open(str(tmp_path / "store"), readonly=True) as store:
        assert store.manifest().format_version == 4  # the table manifest was what the kills hit


@pytest.mark.parametrize("phase", ["mark-written", "shards-synced", "manifest-written", "latest-written",
                                   "prune-files-deleted"])
def test_kill_trainer_mid_cut_of_many_small_arrays(tmp_path, phase):
    """The kill sweep's phases with 3,000 small numpy arrays in the state (in place from the second cut)."""
    _kill_at_phase_and_resume(str(tmp_path / "store"), phase, size=1000, many=3000)


def test_no_shared_memory_left_by_killed_trainers():
    assert leftover_segments(os.getpid()) == []
    _ = np  # the kill sweeps' states are numpy-only, so their subprocesses start without torch
