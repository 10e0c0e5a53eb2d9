"""The single-writer lock with real processes: a second writer is refused and told who holds the
store, readers are never blocked, and a SIGKILLed holder leaves no lock behind (the kernel drops the
flock), only leftovers that the next writer recovers."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crashkit import (  # noqa: E402
    assert_same_state,
    check_after_crash,
    owner_of,
    read_until,
    spawn_script,
    state_for,
)

import ckptstore  # noqa: E402
from ckptstore import Store, StoreLocked, StoreOptions, layout  # noqa: E402
from ckptstore.lock import WriterLock  # noqa: E402
from ckptstore.storage import PosixStorage  # noqa: E402

WAIT = 60


@pytest.fixture
def holder(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A writer process that committed step 1 and is now mid-save of step 2 (its shards are synced),
    blocked with the writer lock held. Yields (url, process, pid, in-flight cut)."""
    url = tmp_path / "store"
    proc = spawn_script(url, "--create", "--pre", "1", "--hold-at", "shards-synced")
    try:
        lines = read_until(proc, "HOLD", WAIT)
        pid = int(next(ln.split()[1] for ln in lines if ln.startswith("PID")))
        assert pid == proc.pid
        cut = lines[-1].split()[1]
        yield url, proc, pid, cut
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def _second_writer_in_subprocess(url: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, ckptstore\n"
        "try:\n"
        "    ckptstore.Store.open(sys.argv[1])\n"
        "except ckptstore.StoreLocked as exc:\n"
        "    print(exc.holder.get('pid')); print(exc); sys.exit(7)\n"
    )
    return subprocess.run([sys.executable, "-c", code, str(url)], capture_output=True, text=True, timeout=WAIT)


def test_second_writer_is_refused_and_names_the_holder(holder: Any) -> None:
    url, proc, pid, _ = holder
    # from this (test) process
    with pytest.raises(StoreLocked) as info:
        Store.open(str(url))
    assert info.value.holder.get("pid") == pid
    assert f"pid {pid}" in str(info.value)
    assert "readonly=True" in str(info.value)  # says what to do instead
    # and from a third, fresh process
    p = _second_writer_in_subprocess(url)
    assert p.returncode == 7, p.stderr
    got_pid, message = p.stdout.splitlines()[:2]
    assert int(got_pid) == pid and f"pid {pid}" in message
    assert proc.poll() is None, "the holder must not be disturbed"


def test_readers_work_while_a_writer_holds_the_store(holder: Any) -> None:
    url, proc, pid, cut = holder
    with Store.open(str(url), readonly=True) as ro:
        assert ro.latest() is not None and ro.latest().step == 1
        assert_same_state(ro.load(), state_for(1))
        report = ro.verify()
        assert report.ok, report.findings
        [notice] = [f for f in report.findings if f.kind.startswith("leftover-")]
        # the in-flight save is reported, with its writer alive, and not as damage
        assert notice.kind == "leftover-in-progress" and notice.cut == cut and notice.severity == "notice"
        assert f"writer {owner_of(pid)}, alive" in notice.message
        [lo] = ro.classify().leftovers
        assert lo.owner_alive is True
    assert_same_state(ckptstore.load(str(url)), state_for(1))
    assert proc.poll() is None


def test_sigkilled_holder_releases_the_lock_and_next_writer_recovers(holder: Any) -> None:
    url, proc, pid, cut = holder
    with pytest.raises(StoreLocked):
        Store.open(str(url))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(WAIT) == -signal.SIGKILL
    assert (url / "marks" / f"{cut}.json").exists(), "the killed save left its mark"
    store = check_after_crash(url, latest_step=1, committed_steps=[1], leftovers=[("in-progress", cut)],
                              dead_owner=pid)
    with store:
        # the new holder is recorded, so a third writer is told about this process now
        with pytest.raises(StoreLocked) as info:
            Store.open(str(url))
        assert info.value.holder.get("pid") == os.getpid()


def test_holder_that_exits_without_closing_releases_the_lock(holder: Any) -> None:
    url, proc, _, cut = holder
    proc.stdin.close()  # the held save returns from its hook; the script exits without committing
    assert proc.wait(WAIT) == 4
    with Store.open(str(url)) as store:  # the save's own error path or recovery removed the cut
        assert store.latest().step == 1
        assert store.classify().leftovers == []
        assert not (url / "cuts" / cut).exists()


def test_two_writer_opens_in_one_process(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    first = Store.open(url, create=True, options=StoreOptions(max_shard_bytes=1 << 20))
    try:
        with pytest.raises(StoreLocked) as info:
            Store.open(url)
        assert info.value.holder.get("pid") == os.getpid()
        # the refused open changed nothing: the first writer still saves, readers still read
        first.save(state_for(1), step=1)
        with Store.open(url, readonly=True) as ro:
            assert ro.latest().step == 1
    finally:
        first.close()
    with Store.open(url) as again:  # closing released the lock
        assert again.latest().step == 1
        with pytest.raises(StoreLocked):
            Store.open(url)


def test_the_lock_descriptor_is_handed_over_from_any_thread(tmp_path: Path) -> None:
    """issue 20: ``lock_fd`` read filelock's private, thread-local context, so asked from another thread
    (the commit thread respawning a dead writer process) it answered None and the new writer process
    inherited no flock. The descriptor now comes from filelock's public ``on_acquired`` hook."""
    lock = WriterLock(PosixStorage(str(tmp_path)))
    lock.acquire()
    try:
        fd = lock.lock_fd()
        seen: list[int | None] = []
        helper = threading.Thread(target=lambda: seen.append(lock.lock_fd()))
        helper.start()
        helper.join(timeout=WAIT)
        assert fd is not None and seen == [fd]
        path = tmp_path / layout.LOCK_FILE
        assert os.fstat(fd).st_ino == os.stat(path).st_ino
        other = os.open(path, os.O_RDONLY)
        try:  # the descriptor is the one holding the flock: another open file of it cannot take it
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        lock.release()
    assert lock.lock_fd() is None


def test_a_file_system_without_flock_still_gets_a_soft_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 20: filelock hands the descriptor over (``on_acquired``) for native locks only. Where flock is
    missing (ENOSYS, some FUSE mounts) the writer lock stays filelock's soft lock, as before: a second
    writer is refused, and there is no descriptor for a helper to inherit."""
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    url = str(tmp_path / "store")
    with pytest.warns(UserWarning, match="flock"):
        first = Store.open(url, create=True)
    try:
        assert first.lock_handoff()[1] is None
        with pytest.raises(StoreLocked):
            Store.open(url)
        first.save(state_for(1), step=1)
    finally:
        first.close()
    with Store.open(url) as again:  # closing released the soft lock
        assert again.latest().step == 1
