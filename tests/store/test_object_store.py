"""The object-store backend against a real S3-compatible server (moto in server mode on 127.0.0.1)
and fsspec's memory file system: save, load, verify, prune, gc, with no rename anywhere."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import ckptstore
from ckptstore import StoreOptions


def _state(i: int) -> dict:
    return {"model": {"w": np.arange(5000, dtype=np.float32) * i, "b": np.ones(7, dtype=np.int64) * i},
            "step": i, "name": f"cut{i}"}


def _exercise(url: str, opts: dict) -> None:
    options = StoreOptions(storage_options=opts, max_shard_bytes=1 << 20)
    with ckptstore.Store.open(url, create=True, options=options) as store:
        assert store.latest() is None
        for i in (1, 2, 3):
            store.save(_state(i), step=i * 10)
        assert [c.step for c in store.cuts()] == [10, 20, 30]
        assert store.verify().ok
        removed = store.prune(ckptstore.KeepLast(2))
        assert [c.step for c in removed] == [10]
        assert [c.step for c in store.cuts()] == [20, 30]
    out = ckptstore.load(url, storage_options=opts)
    assert out["step"] == 3 and out["name"] == "cut3"
    np.testing.assert_array_equal(out["model"]["w"], _state(3)["model"]["w"])
    assert out["model"]["b"].dtype == np.int64
    part = ckptstore.load(url, cut=20, keys=["model"], storage_options=opts)
    assert set(part) == {"model"} and part["model"]["w"][1] == 2.0


def test_s3_round_trip_prune_verify(s3_url):
    url, opts = s3_url
    _exercise(url, opts)


def test_s3_corruption_is_found(s3_url):
    url, opts = s3_url
    options = StoreOptions(storage_options=opts)
    with ckptstore.Store.open(url, create=True, options=options) as store:
        info = store.save(_state(1), step=1)
        m = store.manifest()
        fs = store.storage.fs  # type: ignore[attr-defined]
        path = f"{url[5:]}/cuts/{info.id}/{m.files[0].name}"
        data = bytearray(fs.cat_file(path))
        data[-1] ^= 0xFF
        fs.pipe_file(path, bytes(data))
        report = store.verify()
        assert not report.ok
        assert report.errors[0].kind == "hash-mismatch" and report.errors[0].cut == info.id
    with pytest.raises(ckptstore.CorruptCut) as exc:
        ckptstore.load(url, storage_options=opts)
    assert info.id in str(exc.value) and m.files[0].name in str(exc.value)


def test_s3_leftover_of_a_crashed_save_is_not_committed_and_gc_removes_it(s3_url):
    url, opts = s3_url
    options = StoreOptions(storage_options=opts)
    from ckptstore import layout
    from ckptstore.marks import Mark
    from ckptstore.protocol import now_iso

    with ckptstore.Store.open(url, create=True, options=options) as store:
        store.save(_state(1), step=1)
        # What a save killed mid-shard leaves: a mark from a dead writer and a partial shard.
        cut = layout.new_cut_id(2)
        dead = Mark(cut=cut, step=2, host=__import__("socket").gethostname(), pid=2**22 + 12345,
                    started_at=now_iso(), writer="test")
        store.storage.write_durably(layout.mark_path(cut), dead.to_bytes())
        store.storage.write_durably(layout.cut_file(cut, "rank00000-00000.safetensors"), b"partial")
        cls = store.classify()
        assert [m.step for m in cls.committed] == [1]
        assert [(lo.cut, lo.kind, lo.owner_alive) for lo in cls.leftovers] == [(cut, "in-progress", False)]
        assert store.latest().step == 1
        report = store.gc()
        assert [lo.cut for lo in report.removed] == [cut]
        assert store.classify().leftovers == []
        assert not store.storage.exists(layout.cut_file(cut, "rank00000-00000.safetensors"))


def test_memory_filesystem_round_trip():
    _exercise(f"memory://ckpt-{uuid.uuid4().hex[:8]}", {})


# ------------------------------------------------------------------------------------------------
# One writer per store on S3: a lease object written with conditional PUTs.


def _open_once_the_lease_expires(url: str, options: StoreOptions, deadline: float) -> ckptstore.Store:
    """Opens the store as its writer, retrying while another writer's lease is still fresh; fails the
    test if the lease is still held at ``deadline`` (time.monotonic())."""
    import time

    while True:
        try:
            return ckptstore.Store.open(url, options=options)
        except ckptstore.StoreLocked:
            assert time.monotonic() < deadline, "the other writer's lease never expired"
            time.sleep(0.1)


def test_s3_second_writer_gets_store_locked_naming_the_holder(s3_url):
    url, opts = s3_url
    options = StoreOptions(storage_options=opts)
    with ckptstore.Store.open(url, create=True, options=options) as first:
        first.save(_state(1), step=1)
        with pytest.raises(ckptstore.StoreLocked) as exc:
            ckptstore.Store.open(url, options=options)
        assert exc.value.holder["pid"] == __import__("os").getpid()
        assert ".writer.lease" in str(exc.value) and url in str(exc.value)
        # Readers need no lease.
        with ckptstore.Store.open(url, readonly=True, options=options) as reader:
            assert reader.latest().step == 1
        first.save(_state(2), step=2)  # the first writer is unaffected
    # Released on close: the next writer opens at once.
    with ckptstore.Store.open(url, options=options) as again:
        assert again.latest().step == 2


def test_s3_lease_is_renewed_while_the_writer_lives(s3_url):
    url, opts = s3_url
    # ttl 3 s: the second open below builds a new s3fs client on fsspec's one shared event loop, which
    # can hold up the first writer's renewal for over a second on a loaded 2-core machine (seen in a
    # clean-clone CI run with ttl 1.5 s).
    options = StoreOptions(storage_options=opts, lease_ttl_s=3.0)
    import time

    with ckptstore.Store.open(url, create=True, options=options) as first:
        time.sleep(7.0)  # well past the ttl: only renewals keep the lease fresh
        with pytest.raises(ckptstore.StoreLocked):
            ckptstore.Store.open(url, options=options)
        first.save(_state(1), step=1)
        assert first.latest().step == 1


def test_s3_killed_writer_lease_expires_and_a_new_writer_takes_over(s3_url, tmp_path):
    """A writer process SIGKILLed while holding the lease: the store is locked until the ttl runs out,
    then the next writer takes over, cleans the killed writer's leftovers, and commits."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    url, opts = s3_url
    ttl = 5.0  # at 2 s a loaded machine let the lease run out before the open that must be refused
    options = StoreOptions(storage_options=opts, lease_ttl_s=ttl)
    with ckptstore.Store.open(url, create=True, options=options) as store:
        store.save(_state(1), step=1)
    code = f"""
import json, os, sys, numpy as np, ckptstore
from ckptstore import StoreOptions
store = ckptstore.Store.open({url!r}, options=StoreOptions(storage_options=json.loads({json.dumps(json.dumps(opts))}), lease_ttl_s={ttl}))
pending = store.begin_cut(2, writer="test")   # a cut in flight when the kill lands
print("ready", flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        with pytest.raises(ckptstore.StoreLocked) as exc:
            ckptstore.Store.open(url, options=options)
        assert exc.value.holder["pid"] == proc.pid
        with _open_once_the_lease_expires(url, options, deadline=killed_at + 10 * ttl) as store:
            assert store.classify().leftovers == []  # the killed writer's mark went on open
            assert store.latest().step == 1
            store.save(_state(3), step=3)
            assert [c.step for c in store.cuts()] == [1, 3]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_s3_writer_that_lost_its_lease_never_commits(s3_url):
    """A writer stalled past its ttl while another took the store over: its next commit raises
    StoreLocked, and LATEST stays what the new writer committed."""
    import time

    url, opts = s3_url
    # 2 s: at 1 s a loaded machine could let the lease lapse during the first save (seen under load)
    options = StoreOptions(storage_options=opts, lease_ttl_s=2.0)
    stalled = ckptstore.Store.open(url, create=True, options=options)
    stalled.save(_state(1), step=1)
    stalled._lock._lease._stop.set()  # stall the renewals, as a paused or partitioned process would
    # The taker's own lease gets a longer ttl: on a loaded 2-core machine a 1 s lease can lapse during
    # its first save, which is not what this test is about (the stalled writer's lease is).
    taker_options = StoreOptions(storage_options=opts, lease_ttl_s=5.0)
    with _open_once_the_lease_expires(url, taker_options, deadline=time.monotonic() + 15) as taker:
        taker.save(_state(2), step=2)
        with pytest.raises(ckptstore.StoreLocked) as exc:
            stalled.save(_state(3), step=3)
        assert "lost its lease" in str(exc.value)
        with pytest.raises(ckptstore.StoreLocked):
            stalled.prune(ckptstore.KeepLast(1))
        assert taker.latest().step == 2
        assert [c.step for c in taker.cuts()] == [1, 2]
    stalled.close()
    assert ckptstore.load(url, storage_options=opts)["step"] == 2


def test_memory_filesystem_has_no_lease_and_says_so():
    from ckptstore.lock import WriterLock

    store = ckptstore.Store.open(f"memory://ckpt-{uuid.uuid4().hex[:8]}", create=True)
    try:
        assert store.storage.capabilities.conditional_writes is False
        assert isinstance(store._lock, WriterLock) and store._lock.excludes is False
    finally:
        store.close()


def test_s3_renewal_that_finds_the_lease_replaced_stops_the_writer(s3_url):
    """Someone else wrote the lease object (a writer that judged it stale): the holder's next renewal
    fails its If-Match, and from then on the holder commits nothing."""
    import time

    url, opts = s3_url
    options = StoreOptions(storage_options=opts, lease_ttl_s=1.5)
    store = ckptstore.Store.open(url, create=True, options=options)
    try:
        store.save(_state(1), step=1)
        lease_path = f"{url[5:]}/.writer.lease"
        store.storage.fs.pipe_file(lease_path, b'{"host": "elsewhere", "pid": 1, "ttl_s": 60}')  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while not store._lock._lease.lost:
            assert time.monotonic() < deadline, "the renewal never noticed the replaced lease"
            time.sleep(0.05)
        with pytest.raises(ckptstore.StoreLocked) as exc:
            store.save(_state(2), step=2)
        assert exc.value.holder.get("host") == "elsewhere"
        assert store.latest().step == 1
    finally:
        store.close()
    # The closing writer must not delete a lease that is no longer its own.
    with pytest.raises(ckptstore.StoreLocked):
        ckptstore.Store.open(url, options=options)
