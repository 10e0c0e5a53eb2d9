"""The Checkpointer on object stores: the writer process reaches the same storage as the trainer (URL,
endpoint and credentials travel to it), shard settings are the store's, a process-local file system is
refused by process mode with a clear error, and LATEST moves by compare-and-swap on S3."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import ckptstore
from ckptstore import StoreLocked, StoreOptions, UsageError
from ckptstore.writer import Checkpointer
from writerkit import BOUND, EventLog

AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
           "AWS_DEFAULT_REGION")


def _state(i: int) -> dict:
    return {"w": np.arange(20_000, dtype=np.float32) * i, "b": np.full(33, i, dtype=np.int64), "step": i}


@pytest.fixture
def no_aws_env(monkeypatch):
    """Nothing about S3 comes from the environment: the worker process inherits this environment, so a
    cut it writes proves the endpoint and credentials reached it through the protocol."""
    for name in AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")


def test_process_mode_writes_into_s3_with_the_stores_endpoint_and_credentials(s3_url, no_aws_env):
    url, opts = s3_url
    log = EventLog()
    options = StoreOptions(storage_options=opts, compression="zstd", max_shard_bytes=64 << 10)
    with Checkpointer(url, every=1, mode="process", on_event=log, store_options=options) as ck:
        assert ck.writer_pid is not None
        infos = [ck.cut(i, _state(i)).wait(BOUND) for i in (1, 2, 3)]
    assert not log.of("fallback"), "the writer process itself must write, not the trainer's fallback"
    assert [e["writer_mode"] for e in log.of("committed")] == ["process"] * 3
    with ckptstore.Store.open(url, readonly=True, options=StoreOptions(storage_options=opts)) as store:
        report = store.verify()
        assert report.ok, report.findings
        m = store.manifest("latest")
        assert m.cut == infos[-1].id and m.writer.mode == "process"
        # The store's shard settings, not a Checkpointer default: zstd, several 64 KiB shards.
        assert len(m.files) > 1 and all(f.codec == "zstd" and f.name.endswith(".zst") for f in m.files)
        out = store.load()
    np.testing.assert_array_equal(out["w"], _state(3)["w"])
    assert out["step"] == 3


def test_a_local_store_opened_with_zstd_gets_zstd_shards_from_the_writer_process(tmp_path):
    """Issue 9: WriterOptions' compression shadowed the store's, so these shards came out raw."""
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True, options=StoreOptions(compression="zstd")) as store:
        with Checkpointer(store, every=1, mode="process") as ck:
            info = ck.cut(1, _state(1)).wait(BOUND)
        m = store.manifest(info.id)
    assert [f.codec for f in m.files] == ["zstd"]


def test_store_options_with_an_open_store_are_refused(tmp_path):
    with ckptstore.Store.open(str(tmp_path / "s"), create=True) as store:
        with pytest.raises(UsageError, match="store_options go with a URL"):
            Checkpointer(store, store_options=StoreOptions(compression="zstd"))


def test_memory_store_refuses_process_mode_and_works_in_thread_mode():
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    with pytest.raises(UsageError, match='mode="thread"') as err:
        Checkpointer(url, every=1, mode="process")
    assert "cannot reach this store" in err.value.message and err.value.store == url
    with Checkpointer(url, every=1, mode="thread") as ck:  # the store is released by the refusal above
        info = ck.cut(5, _state(5)).wait(BOUND)
    with ckptstore.Store.open(url, readonly=True) as store:
        assert store.verify().ok and store.latest().id == info.id


def test_latest_moves_by_compare_and_swap_so_a_stalled_former_writer_cannot_commit(s3_url):
    """Writer A stalls after its lease check (simulated: its guard passes, its lease stops renewing);
    B takes the expired lease over and commits; A's LATEST PUT then fails its If-Match and LATEST keeps
    naming B's cut, which loads."""
    url, opts = s3_url
    ttl = 1.5
    options = StoreOptions(storage_options=opts, lease_ttl_s=ttl)
    a = ckptstore.Store.open(url, create=True, options=options)
    try:
        a.save(_state(1), step=1)
        pending = a.begin_cut(2, writer="stalled")
        pending.write([], codec=a.shard_codec(), max_shard_bytes=a.options.max_shard_bytes)
        pending.files_durable()
        a._protocol._guard = lambda: None  # A already passed its lease check when it stalled
        a._lock._lease._stop.set()  # and stopped renewing while stalled
        deadline = time.monotonic() + 10 * ttl
        while True:
            try:
                b = ckptstore.Store.open(url, options=options)
                break
            except StoreLocked:
                assert time.monotonic() < deadline, "the stalled writer's lease never expired"
                time.sleep(0.2)
        try:
            b_info = b.save(_state(3), step=3)
            with pytest.raises(StoreLocked, match="LATEST was moved by another writer"):
                pending.commit(tree={"t": "dict", "items": []})
            assert b.latest().id == b_info.id
            assert b.load()["step"] == 3
        finally:
            b.close()
    finally:
        a.close()
    with ckptstore.Store.open(url, options=options) as c:  # the stalled cut is a leftover, gone on open
        assert c.latest().step == 3 and [x.step for x in c.cuts()] == [1, 3]
        assert c.classify().leftovers == []


def test_storage_options_that_cannot_travel_as_json_are_refused_by_name():
    from ckptstore.storage import StorageSpec

    with pytest.raises(UsageError, match="cannot be sent to the writer process as JSON") as err:
        StorageSpec("s3://bucket/run", {"client_kwargs": {"config": object()}}).check_json()
    assert err.value.store == "s3://bucket/run" and 'mode="thread"' in err.value.hint
