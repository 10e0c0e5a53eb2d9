"""The writer process dies, hangs or fails (failure-modes S1, S12, S13, S14).

A writer that dies or hangs is replaced: the commit thread writes that cut itself from the same block
(event ``fallback``, with the reason), the cut commits and verifies, and a new writer process serves the
next cut. A writer that *fails* (an ordinary error) fails the cut: nothing of it stays on disk, the
previous cut stays LATEST, and the error reaches the caller at its next call.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from ckptstore import CkptStoreError, StorageError
from ckptstore.writer import Checkpointer
from writerkit import (inject_fault, BOUND, EventLog, assert_state_equal, check_store, child_pids, clone_state,
                       has_exited, mutate_in_place, small_state, wait_until)


def _assert_served_by_new_writer(ck: Checkpointer, log: EventLog, old_pid: int, step: int, state) -> None:
    snap = clone_state(state)
    h = ck.cut(step, state)
    h.wait(BOUND)
    assert h.fallback is None and not log.of("fallback", step=step)
    assert ck.writer_pid is not None and ck.writer_pid != old_pid
    assert not has_exited(ck.writer_pid)
    assert_state_equal(ck.store.load(h.id), snap)


@pytest.mark.parametrize("fault,reason", [
    ("sigkill-mid-shard", "killed by signal 9 (SIGKILL)"),
    ("exit-mid-shard", "exit code 17"),
])
def test_writer_dies_mid_shard_cut_commits_by_fallback(url, fault, reason):
    log = EventLog()
    state = small_state(3.0)
    with Checkpointer(url, every=1, on_event=log) as ck:
        prev = ck.cut(1, state).wait(BOUND)
        inject_fault(ck, fault)
        old_pid = ck.writer_pid
        mutate_in_place(state)
        snap = clone_state(state)
        h = ck.cut(2, state)
        mutate_in_place(state)
        info = h.wait(BOUND)
        assert h.state == "committed" and info.step == 2
        fb = log.of("fallback", step=2)
        assert len(fb) == 1 and fb[0]["error_type"] == "WriterDied" and fb[0]["cut"] == h.id
        assert reason in fb[0]["reason"] and str(old_pid) in fb[0]["reason"]
        assert h.fallback == fb[0]["reason"]
        assert log.of("written", step=2)[0]["fallback"] == fb[0]["reason"]
        assert log.of("committed", step=2)[0]["fallback"] == fb[0]["reason"]
        # The dead writer was reaped, not left a zombie; the cut verifies and holds its snapshot.
        wait_until(lambda: has_exited(old_pid), what="old writer gone")
        assert ck.writer_pid is None  # a new one starts with the next cut
        report = ck.store.verify(h.id)
        assert report.ok, report
        assert_state_equal(ck.store.load(h.id), snap)
        assert ck.store.classify().leftovers == []
        _assert_served_by_new_writer(ck, log, old_pid, 3, state)
    store = check_store(url)
    assert [c.id for c in store.cuts()][:2] == [prev.id, h.id]


def test_writer_killed_while_idle_next_cut_commits_by_fallback(url):
    log = EventLog()
    state = small_state(4.0)
    with Checkpointer(url, every=1, on_event=log) as ck:
        ck.cut(1, state).wait(BOUND)
        old_pid = ck.writer_pid
        os.kill(old_pid, signal.SIGKILL)  # from outside (an OOM killer, an operator), between cuts
        wait_until(lambda: has_exited(old_pid), what="writer killed")
        mutate_in_place(state)
        snap = clone_state(state)
        h = ck.cut(2, state)
        mutate_in_place(state)
        h.wait(BOUND)
        fb = log.of("fallback", step=2)
        assert len(fb) == 1 and fb[0]["error_type"] == "WriterDied"
        assert "killed by signal 9" in fb[0]["reason"] and str(old_pid) in fb[0]["reason"]
        assert ck.store.verify(h.id).ok
        assert_state_equal(ck.store.load(h.id), snap)
        wait_until(lambda: old_pid not in child_pids(), what="dead writer reaped")
        _assert_served_by_new_writer(ck, log, old_pid, 3, state)
    check_store(url)


def test_hung_writer_turns_into_fallback_within_bounded_time(url):
    log = EventLog()
    timeout = 2.0
    state = small_state(5.0)
    with Checkpointer(url, every=1, on_event=log, write_timeout=timeout) as ck:
        ck.cut(1, state).wait(BOUND)
        inject_fault(ck, "hang-mid-shard")
        old_pid = ck.writer_pid
        snap = clone_state(state)
        t0 = time.monotonic()
        h = ck.cut(2, state)
        mutate_in_place(state)
        h.wait(timeout + BOUND)
        took = time.monotonic() - t0
        assert timeout * 0.9 <= took < timeout + BOUND
        fb = log.of("fallback", step=2)
        assert len(fb) == 1 and fb[0]["error_type"] == "WriterTimeout"
        assert "no progress" in fb[0]["reason"] and "killed it" in fb[0]["reason"]
        assert has_exited(old_pid)  # the hung writer was killed, not left hanging
        assert ck.store.verify(h.id).ok
        assert_state_equal(ck.store.load(h.id), snap)
        _assert_served_by_new_writer(ck, log, old_pid, 3, state)
    check_store(url)


def _cut_failed_cleanly(ck: Checkpointer, log: EventLog, url: str, prev_id: str, step: int) -> dict:
    failed = log.wait_for("failed", step=step)
    assert not log.of("fallback", step=step) and not log.of("committed", step=step)
    cls = ck.store.classify()
    assert cls.leftovers == [], cls.leftovers  # no partial shard, no mark, no temp file
    assert cls.latest is not None and cls.latest.cut == prev_id
    assert sorted(os.listdir(os.path.join(url, "cuts"))) == [prev_id]
    assert os.listdir(os.path.join(url, "marks")) == []
    assert ck.store.verify().ok
    return failed


@pytest.mark.parametrize("surfaces_at", ["maybe_cut", "cut", "close"])
def test_writer_error_fails_the_cut_and_surfaces_at_the_next_call(url, surfaces_at):
    log = EventLog()
    state = small_state(6.0)
    ck = Checkpointer(url, every=1, on_event=log)
    try:
        prev = ck.cut(1, state).wait(BOUND)
        inject_fault(ck, "raise-mid-shard")
        pid = ck.writer_pid
        h = ck.maybe_cut(2, state)
        failed = _cut_failed_cleanly(ck, log, url, prev.id, 2)
        assert failed["error_type"] == "StorageError" and "permission denied" in failed["error"]
        assert h.state == "failed"
        assert ck.writer_pid == pid and not has_exited(pid)  # an error is not a death: same writer
        with pytest.raises(CkptStoreError, match="permission denied") as err:
            if surfaces_at == "maybe_cut":
                ck.maybe_cut(3, state)
            elif surfaces_at == "cut":
                ck.cut(3, state)
            else:
                ck.close()
        exc = err.value
        assert exc is h.error
        # It crossed the process boundary with its type and fields: an OSError naming store, cut, file.
        assert isinstance(exc, StorageError) and isinstance(exc, OSError)
        assert exc.store == ck.store.url and exc.cut == h.id
        assert exc.path is not None and exc.path.startswith(f"cuts/{h.id}/rank")
        assert all(part in str(exc) for part in (ck.store.url, h.id, exc.path))
        # Reported once: the next call goes ahead (and the cut after the failure commits).
        if surfaces_at != "close":
            h4 = ck.cut(4, state)
            assert h4.wait(BOUND).step == 4
    finally:
        ck.close()
    store = check_store(url)
    assert [c.step for c in store.cuts()] == ([1] if surfaces_at == "close" else [1, 4])


def test_failed_cut_error_is_raised_by_wait_once(url):
    log = EventLog()
    with Checkpointer(url, every=1, on_event=log) as ck:
        prev = ck.cut(1, small_state()).wait(BOUND)
        inject_fault(ck, "raise-mid-shard")
        h = ck.cut(2, small_state())
        with pytest.raises(StorageError, match="injected fault"):
            h.wait(BOUND)
        _cut_failed_cleanly(ck, log, url, prev.id, 2)
        assert ck.maybe_cut(3, small_state()) is not None  # wait() reported it: not raised again
    check_store(url)


def _make_unwritable(path: str) -> tuple[str, callable]:
    """Makes a directory refuse new entries, for real. As non-root, chmod 0o555; as root (where chmod
    does not stop writes) the immutable attribute (chattr +i), which root also obeys."""
    if os.geteuid() != 0:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        os.chmod(path, 0o555)
        return "chmod", lambda: os.chmod(path, mode)
    try:
        subprocess.run(["chattr", "+i", path], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        # No chattr or no CAP_LINUX_IMMUTABLE here: the writer's "raise-mid-shard" fault (a
        # PermissionError mid-shard) covers the failure path instead (see the test above).
        pytest.skip(f"cannot make a directory unwritable as root here: {exc}")
    return "chattr", lambda: subprocess.run(["chattr", "-i", path], check=True)


@pytest.mark.parametrize("mode", ["process", "thread", "inline"])
def test_unwritable_store_fails_the_cut_cleanly_naming_store_cut_file(url, mode):
    log = EventLog()
    state = small_state(7.0)
    ck = Checkpointer(url, every=1, mode=mode, on_event=log)
    try:
        prev = ck.cut(1, state).wait(BOUND)
        cuts_dir = os.path.join(url, "cuts")
        _how, undo = _make_unwritable(cuts_dir)
        try:
            h = ck.maybe_cut(2, state)
            log.wait_for("failed", step=2)
        finally:
            undo()
        _cut_failed_cleanly(ck, log, url, prev.id, 2)
        with pytest.raises(StorageError) as err:
            ck.maybe_cut(3, state)
        exc = err.value
        assert isinstance(exc, OSError) and exc is h.error
        assert exc.store == ck.store.url and exc.cut == h.id and exc.path == f"cuts/{h.id}"
        assert all(part in str(exc) for part in (ck.store.url, h.id, "not writable"))
        assert ck.cut(4, state).wait(BOUND).step == 4  # writable again: cuts go on
    finally:
        ck.close()
    check_store(url)


EXIT_SCRIPT = """
import sys
import numpy as np
from ckptstore.writer import Checkpointer

sys.path.insert(0, sys.argv[3])
from fault_worker import inject

ck = Checkpointer(sys.argv[1], every=1)
ck.cut(1, {"a": np.zeros(4096), "b": np.ones(4096)}).wait(60)
if sys.argv[2] == "fail":
    inject(ck, "raise-mid-shard")
ck.maybe_cut(2, {"a": np.full(4096, 2.0), "b": np.full(4096, 3.0)})
# The script ends here without close() and without waiting: the atexit drain decides the exit status.
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_script_ending_without_close_drains_or_exits_nonzero(url, outcome):
    res = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, url, outcome, os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=120)
    store = check_store(url)
    if outcome == "ok":
        assert res.returncode == 0, res.stderr
        assert store.latest().step == 2  # the cut in flight at exit was committed, not dropped
    else:
        # Never "exit 0 with no checkpoint": the unreported failure ends the process with status 70.
        assert res.returncode == 70, (res.returncode, res.stderr)
        assert "a checkpoint failed and was never reported" in res.stderr and "permission denied" in res.stderr
        assert store.latest().step == 1 and store.classify().leftovers == []
