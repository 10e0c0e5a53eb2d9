"""The object-store backend against a real S3-compatible server (moto in server mode on 127.0.0.1)
and fsspec's memory file system: save, load, verify, prune, gc, with no rename anywhere."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import ckptstore
from ckptstore import StoreOptions


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket="ckpt")
    yield endpoint
    server.stop()


@pytest.fixture()
def s3_url(s3_server):
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": s3_server, "region_name": "us-east-1"},
            "skip_instance_cache": True}
    return f"s3://ckpt/run-{uuid.uuid4().hex[:8]}", opts


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
