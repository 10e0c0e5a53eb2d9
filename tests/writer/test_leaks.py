"""Nothing leaks (failure-modes S18): after many cuts memory is flat and the block count constant; after
close() no shared-memory block, thread, child process or file descriptor is left."""

from __future__ import annotations

import os
import threading

import pytest

from ckptstore import KeepLast
from ckptstore.writer import Checkpointer
from ckptstore.writer.shm import leftover_segments
from writerkit import (inject_fault, BOUND, check_store, child_pids, fd_count, has_exited, mutate_in_place, rss_bytes,
                       small_state, wait_until)

MB = 1 << 20


def _proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _snapshot() -> dict:
    return {
        "threads": sorted(t.ident for t in threading.enumerate()),
        "fds": fd_count(),
        "children": child_pids(),
        "shm": leftover_segments(os.getpid()),
    }


def _warm_up(tmp_path, mode: str) -> None:
    """One full life cycle first, so one-time lazy allocations (imports, buffers) are not counted."""
    with Checkpointer(str(tmp_path / f"warm-{mode}"), every=1, mode=mode) as ck:
        ck.cut(1, small_state()).wait(BOUND)


def test_100_cuts_in_process_mode_leak_nothing(url, tmp_path):
    _warm_up(tmp_path, "process")
    base = _snapshot()
    state = small_state(numel=16 * 1024)
    writers = []
    ck = Checkpointer(url, every=1, keep=KeepLast(2))
    try:
        writers.append(ck.writer_pid)
        for step in range(1, 101):
            mutate_in_place(state)
            if step == 50:
                inject_fault(ck, "sigkill-mid-shard")  # a writer death and respawn on the way
            h = ck.cut(step, state)
            h.wait(BOUND)
            if ck.writer_pid is not None and ck.writer_pid not in writers:
                writers.append(ck.writer_pid)
            assert len(leftover_segments(os.getpid())) == len(base["shm"]) + 1  # one block, reused
            if step == 10:
                rss10, fds10, wrss10 = rss_bytes(), fd_count(), _proc_rss(ck.writer_pid)
        assert h.fallback is None and len(writers) == 2, writers
        rss100, fds100, wrss100 = rss_bytes(), fd_count(), _proc_rss(ck.writer_pid)
        assert rss100 - rss10 < 50 * MB, f"trainer RSS grew {(rss100 - rss10) / MB:.1f} MB from cut 10 to 100"
        assert wrss100 - wrss10 < 50 * MB, f"writer RSS grew {(wrss100 - wrss10) / MB:.1f} MB"
        # Steady state; a small margin for a prune that may still hold a directory open right now.
        assert fds100 <= fds10 + 3, (fds10, fds100)
        assert len(child_pids() - base["children"]) == 1  # just the current writer; the dead one reaped
    finally:
        ck.close()
    for pid in writers:
        wait_until(lambda: has_exited(pid), what=f"writer {pid} gone")
    assert _snapshot() == base
    store = check_store(url)
    assert [c.step for c in store.cuts()] == [99, 100]


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_close_leaves_nothing_behind_in_other_modes(url, tmp_path, mode):
    _warm_up(tmp_path, mode)
    base = _snapshot()
    state = small_state()
    with Checkpointer(url, every=1, mode=mode, keep=KeepLast(1)) as ck:
        assert ck.writer_pid is None and not child_pids() - base["children"]  # no writer process here
        for step in range(1, 11):
            mutate_in_place(state)
            ck.cut(step, state)
    assert _snapshot() == base
    check_store(url)
