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
