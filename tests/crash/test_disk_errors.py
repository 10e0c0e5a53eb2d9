"""Errors from the disk: ENOSPC, EIO and EACCES injected at each write and fsync of a save, and a real
size-limited tmpfs filled up during a cut. Each time: the cut fails cleanly with an error naming the
store, cut and file; nothing committed is lost; no partial files stay; the next cut succeeds."""

from __future__ import annotations

import errno
import os
import subprocess

import numpy as np
import pytest

import ckptstore
from ckptstore import StoreOptions, layout
from ckptstore.storage import PosixSink, PosixStorage


class Faults:
    """Counts write/fsync/durable-write calls on a real PosixStorage and fails the chosen one."""

    def __init__(self, kind: str, nth: int, err: int) -> None:
        self.kind, self.nth, self.err = kind, nth, err
        self.count = 0
        self.fired = False

    def hit(self, kind: str) -> None:
        if kind != self.kind:
            return
        self.count += 1
        if self.count == self.nth and not self.fired:
            self.fired = True
            raise OSError(self.err, os.strerror(self.err))


class FaultySink(PosixSink):
    faults: Faults

    def write(self, data):  # type: ignore[no-untyped-def]
        self.faults.hit("write")
        super().write(data)

    def close(self) -> None:
        try:
            self.faults.hit("fsync")
        except OSError as exc:
            self.abort()
            raise self._storage._error(exc, "writing shard", self._rel) from exc
        super().close()


class FaultyStorage(PosixStorage):
    def __init__(self, root: str, faults: Faults) -> None:
        super().__init__(root)
        self.faults = faults

    def open_sink(self, rel: str):  # type: ignore[no-untyped-def]
        sink = FaultySink(self, rel)
        sink.faults = self.faults
        return sink

    def write_durably(self, rel: str, data: bytes) -> None:
        try:
            self.faults.hit("durable")
        except OSError as exc:
            raise self._error(exc, "durable write", rel) from exc
        super().write_durably(rel, data)


def _state(i: int) -> dict:
    return {"w": np.arange(300_000, dtype=np.float32) * i, "b": np.ones(10) * i}


POINTS = [("write", n) for n in (1, 2, 3)] + [("fsync", 1), ("fsync", 2)] + [("durable", n) for n in (1, 2, 3)]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO, errno.EACCES], ids=["ENOSPC", "EIO", "EACCES"])
@pytest.mark.parametrize("kind,nth", POINTS)
def test_injected_error_fails_the_cut_cleanly(tmp_path, kind, nth, err):
    root = str(tmp_path / "store")
    with ckptstore.Store.open(root, create=True) as store:
        store.save(_state(1), step=1)
    faults = Faults(kind, nth, err)
    opts = StoreOptions(max_shard_bytes=1 << 20)
    faults.fired = True  # opening writes WRITER.json: not part of the cut
    store = ckptstore.Store.open(FaultyStorage(root, faults), options=opts)
    faults.fired, faults.count = False, 0
    try:
        with pytest.raises(ckptstore.StorageError) as exc:
            store.save(_state(2), step=2)
        assert faults.fired
        assert exc.value.errno == err and isinstance(exc.value, OSError)
        assert exc.value.store == os.path.abspath(root) and exc.value.path
        if kind != "durable" or nth > 1:  # the first durable write is the mark: no cut file yet
            assert exc.value.cut is not None and exc.value.cut.startswith("step-000000000002-")
        # Nothing committed is lost, and nothing of the failed cut stays behind.
        assert store.latest().step == 1
        assert store.classify().leftovers == []
        assert os.listdir(os.path.join(root, layout.MARKS_DIR)) == []
        assert store.verify().ok
        np.testing.assert_array_equal(ckptstore.load(root)["w"], _state(1)["w"])
        # Space is back: the next cut succeeds.
        store.save(_state(3), step=3)
        assert store.latest().step == 3 and store.verify().ok
    finally:
        store.close()


def test_checkpointer_reports_an_injected_disk_error_at_the_next_call(tmp_path):
    from ckptstore.writer import Checkpointer

    root = str(tmp_path / "store")
    faults = Faults("fsync", 1, errno.ENOSPC)
    faults.fired = True  # armed below, after the first cut
    ckptstore.Store.open(root, create=True).close()
    store = ckptstore.Store.open(FaultyStorage(root, faults))
    with Checkpointer(store, every=1, mode="thread", busy="wait") as ck:
        ck.cut(1, _state(1)).wait()
        faults.fired, faults.count = False, 0
        handle = ck.cut(2, _state(2))
        with pytest.raises(ckptstore.StorageError) as exc:
            handle.wait()
        assert exc.value.errno == errno.ENOSPC and "full" in str(exc.value)
        assert store.latest().step == 1 and store.classify().leftovers == []
        ck.cut(3, _state(3)).wait()
    assert ckptstore.Store.open(root, readonly=True).latest().step == 3
    store.close()


@pytest.fixture()
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {res.stderr.strip() or res.returncode}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_filesystem(small_tmpfs):
    root = os.path.join(small_tmpfs, "store")
    big = {"w": np.ones(400_000, dtype=np.float32)}  # 1.6 MB: the second one cannot fit beside the first
    with ckptstore.Store.open(root, create=True) as store:
        store.save(big, step=1)
        with pytest.raises(ckptstore.StorageError) as exc:
            store.save({"w": np.ones(400_000, dtype=np.float32) * 2}, step=2)
        assert exc.value.errno == errno.ENOSPC
        assert "full" in str(exc.value) and exc.value.cut.startswith("step-000000000002-")
        assert store.latest().step == 1 and store.verify().ok
        assert store.classify().leftovers == []
        # Make room (an operator deletes something), then the next cut succeeds.
        store.save({"w": np.ones(10, dtype=np.float32)}, step=3)
        store.prune(ckptstore.KeepLast(1))
        store.save({"w": np.ones(400_000, dtype=np.float32) * 4}, step=4)
        assert store.latest().step == 4 and store.verify().ok
    np.testing.assert_array_equal(ckptstore.load(root)["w"], np.ones(400_000, dtype=np.float32) * 4)


def test_real_full_filesystem_under_the_background_writer(small_tmpfs):
    """The writer process hits ENOSPC on a real full file system: the trainer gets a typed error
    naming the store, cut and file; LATEST and the previous cut are untouched; no partial files stay;
    the next cut succeeds once there is room again."""
    from ckptstore.writer import Checkpointer

    root = os.path.join(small_tmpfs, "store")
    with Checkpointer(root, every=1, mode="process", busy="wait") as ck:
        ck.cut(1, {"w": np.ones(400_000, dtype=np.float32)}).wait()
        failing = ck.cut(2, {"w": np.ones(400_000, dtype=np.float32) * 2})
        with pytest.raises(ckptstore.StorageError) as exc:
            failing.wait()
        assert exc.value.errno == errno.ENOSPC and "full" in str(exc.value)
        assert exc.value.store == root and exc.value.cut == failing.id and exc.value.path
        assert ck.store.latest().step == 1 and ck.store.verify().ok
        assert ck.store.classify().leftovers == []
        ck.cut(3, {"w": np.ones(10, dtype=np.float32) * 3}).wait()
        ck.store.prune(ckptstore.KeepLast(1))
        ck.cut(4, {"w": np.ones(400_000, dtype=np.float32) * 4}).wait()
    with ckptstore.Store.open(root, readonly=True) as store:
        assert store.latest().step == 4 and store.verify().ok
