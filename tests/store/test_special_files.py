"""Only regular files are read (issue 10, items 4 and 10, local stores): a FIFO planted as a shard
fails load, verify and export at once with a named error instead of hanging, and a symlinked shard is
refused rather than followed out of the store."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ckptstore


@pytest.fixture()
def store_with_cut(tmp_path):
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        info = store.save({"w": torch.arange(1000.0)}, step=1)
        shard = store.manifest().files[0].name
    return url, info.id, os.path.join(url, "cuts", info.id, shard)


def test_a_fifo_shard_fails_fast_with_a_named_error(store_with_cut):
    url, cut, shard = store_with_cut
    os.remove(shard)
    os.mkfifo(shard)
    with pytest.raises(ckptstore.CkptStoreError) as ei:
        ckptstore.load(url)
    assert "not a regular file" in str(ei.value) and cut in str(ei.value)
    report = ckptstore.Store.open(url, readonly=True).verify()
    assert not report.ok and any(cut == f.cut for f in report.errors)
    # The CLI, in a subprocess with a deadline: a hang would be a timeout here.
    out = subprocess.run([sys.executable, "-m", "ckptstore.cli", "export", url, "--to", os.devnull + ".st"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode in (1, 2) and "regular file" in out.stderr


def test_a_symlinked_shard_is_refused_not_followed(store_with_cut, tmp_path):
    url, cut, shard = store_with_cut
    outside = tmp_path / "outside.bin"
    os.replace(shard, outside)
    os.symlink(outside, shard)
    with pytest.raises(ckptstore.CkptStoreError) as ei:
        ckptstore.load(url)
    assert "symlink" in str(ei.value)
    report = ckptstore.Store.open(url, readonly=True).verify()
    assert not report.ok
    assert not any(f.found and f.found == ckptstore.hashing.digest(outside.read_bytes()) for f in report.findings)


# ------------------------------------- issue 19 item 12: a special file in a shard's place is damage
def _plant(kind: str, shard: str, outside: str) -> None:
    """Puts a FIFO, a directory (holding a foreign file) or a symlink to a copy of the real bytes
    where the shard was: the symlink's target hashes right, so only refusing it can fail the cut."""
    os.replace(shard, outside)
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "directory":
        os.mkdir(shard)
        with open(os.path.join(shard, "x"), "wb") as f:
            f.write(b"foreign")
    else:
        os.symlink(outside, shard)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_special_file_in_place_of_a_shard_makes_the_cut_damaged(tmp_path, kind):
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        good = store.save({"w": torch.arange(1000.0)}, step=1)
        bad = store.save({"w": torch.arange(1000.0) + 1}, step=2)
        rel = f"cuts/{bad.id}/{store.manifest().files[0].name}"
    shard, outside = os.path.join(url, rel), str(tmp_path / "outside.bin")
    with open(shard, "rb") as f:
        shard_bytes = f.read()
    _plant(kind, shard, outside)

    with ckptstore.Store.open(url, readonly=True) as ro:
        report = ro.verify()
    assert [(f.kind, f.cut, f.path) for f in report.errors] == [("not-a-file", bad.id, rel)]
    with pytest.raises(ckptstore.CorruptCut) as ei:  # a DataError: launchers fall back from it
        ckptstore.load(url)
    assert (ei.value.store, ei.value.cut, ei.value.path) == (url, bad.id, rel)
    assert "not a regular file" in ei.value.message

    got = ckptstore.load(url, fallback=True)  # falls back instead of "a transient I/O error: retry"
    assert torch.equal(got["w"], torch.arange(1000.0))
    assert os.listdir(os.path.join(url, "bad")) == [f"{bad.id}.json"]  # recorded, as other damage is
    with ckptstore.Store.open(url, readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == [good.id, bad.id]  # damage is reported, never removed
    with open(outside, "rb") as f:  # nothing planted (or behind a symlink) was touched
        assert f.read() == shard_bytes
    assert os.path.lexists(shard) and (kind != "directory" or os.listdir(shard) == ["x"])
