"""Snapshot semantics (failure-modes S16): a cut holds the values of the moment maybe_cut returned, and
the three writer modes write byte-identical shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import StoreOptions
from ckptstore.writer import Checkpointer
from writerkit import BOUND, assert_state_equal, check_store, clone_state, mutate_in_place, small_state

MODES = ["process", "thread", "inline"]


@pytest.mark.parametrize("mode", MODES)
def test_mutating_right_after_maybe_cut_does_not_reach_the_cut(url, mode):
    state = small_state(1.0, n=4, numel=64 * 1024)  # 256 KiB per tensor: the writer is busy while we mutate
    expected = clone_state(state)
    with Checkpointer(url, every=5, mode=mode) as ck:
        h = ck.maybe_cut(5, state)
        assert h is not None
        mutate_in_place(state)  # the next training step, in place, before the cut is written
        state["layer0"].mul_(-3.0)
        state["rng"][:] = -1
        assert not torch.equal(state["layer0"], expected["layer0"])
        info = h.wait(BOUND)
    store = check_store(url)
    assert store.manifest(info.id).step == 5
    assert_state_equal(store.load(info.id), expected)


@pytest.mark.parametrize("mode", MODES)
def test_back_to_back_cuts_each_hold_their_own_snapshot(url, mode):
    state = small_state(0.0, n=4, numel=64 * 1024)
    snaps, ids = [], []
    with Checkpointer(url, every=1, mode=mode, busy="wait") as ck:
        for step in (1, 2, 3):
            snaps.append(clone_state(state))
            h = ck.maybe_cut(step, state)
            assert h is not None  # busy="wait": a due cut is never skipped
            ids.append(h.id)
            mutate_in_place(state)
    store = check_store(url)
    assert [c.id for c in store.cuts()] == ids
    for cut, snap in zip(ids, snaps):
        assert_state_equal(store.load(cut), snap)
    assert not torch.equal(store.load(ids[0])["layer1"], store.load(ids[2])["layer1"])


def _shards(url: str, cut: str) -> dict[str, bytes]:
    d = Path(url) / "cuts" / cut
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "MANIFEST.json"}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_modes_write_byte_identical_shards(tmp_path, compression):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(300, 100, generator=g),
        "b": torch.randn(100, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 30, (5000,), generator=g),
        "mask": torch.rand(777, generator=g) > 0.5,
        "np": np.linspace(0, 1, 1000, dtype=np.float32),
        "nested": {"m": torch.zeros(3, 5, dtype=torch.float16), "scalar": torch.tensor(3.5), "n": 4},
    }
    out = {}
    for mode in MODES:
        url = str(tmp_path / mode)
        # A small shard limit, so the state spreads over several shard files. Shard settings are the
        # store's: the Checkpointer writes what the store was opened with, in every mode.
        opts = StoreOptions(compression=compression, max_shard_bytes=64 << 10)
        with Checkpointer(url, every=1, mode=mode, store_options=opts) as ck:
            info = ck.cut(7, state).wait(BOUND)
        m = check_store(url).manifest(info.id)
        out[mode] = (
            _shards(url, info.id),
            [(t.name, t.file, t.offset, t.nbytes, t.dtype, t.shape, t.blake3) for t in m.tensors],
            [(f.name, f.nbytes, f.blake3, f.codec) for f in m.files],
            m.tree,
        )
    ref = out["process"]
    assert len(ref[0]) > 1, "expected several shard files"
    assert all(name.endswith(".zst") == (compression == "zstd") for name in ref[0])
    for mode in ("thread", "inline"):
        assert out[mode][0].keys() == ref[0].keys()
        for name in ref[0]:
            assert out[mode][0][name] == ref[0][name], f"{mode}: shard {name} differs from process mode"
        assert out[mode][1:] == ref[1:], mode
