"""Falling back past a damaged LATEST: the error by default, the walk back with ``fallback=True``, the
``bad/`` record that keeps restarts from re-verifying (or looping on) a bad cut, LATEST moved back by
``restore`` so the run can continue, and retention that neither counts nor deletes recorded-bad cuts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import ckptstore
from ckptstore import DataError, KeepLast, Store, StoreOptions

RECORDED_BAD = "recorded bad by an earlier load"


def state_for(step: int) -> dict:
    """Different bytes at every step, so returning the wrong cut cannot pass."""
    rng = np.random.default_rng(step)
    return {"model": {"w": torch.from_numpy(rng.standard_normal((64, 32), dtype=np.float32)),
                      "b": torch.full((32,), float(step))},
            "step": step}


def shard_paths(url: str, cut: str) -> list[str]:
    with Store.open(url, readonly=True) as s:
        m = s.manifest(cut)
    return [os.path.join(url, "cuts", cut, f.name) for f in m.files]


def flip_byte(path: str, offset: int = -1) -> None:
    """Flips every bit of one byte (default: the last, inside the array data) in place."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        pos = f.tell()
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def build_store(url: str, steps: list[int]) -> dict[int, str]:
    with Store.open(url, create=True) as s:
        return {step: s.save(state_for(step), step=step).id for step in steps}


def assert_state(got: dict, step: int) -> None:
    want = state_for(step)
    assert got["step"] == step
    assert set(got["model"]) == set(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


def bad_records(url: str) -> dict[str, dict]:
    d = os.path.join(url, "bad")
    return {n.removesuffix(".json"): json.loads(open(os.path.join(d, n), "rb").read()) for n in os.listdir(d)}


@pytest.fixture
def damaged(tmp_path):
    """Cuts at 100 and 200, LATEST (200) with a flipped byte in its shard."""
    url = str(tmp_path / "store")
    ids = build_store(url, [100, 200])
    for p in shard_paths(url, ids[200]):
        flip_byte(p)
    return url, ids


def test_load_of_damaged_latest_raises_data_error_and_records_nothing(damaged):
    url, ids = damaged
    with pytest.raises(DataError) as ei:
        ckptstore.load(url)
    assert ei.value.cut == ids[200]
    with pytest.raises(DataError):
        ckptstore.restore(url, model=nn.Linear(1, 1))  # no fallback: restore refuses too
    assert bad_records(url) == {}
    with Store.open(url, readonly=True) as s:
        assert s.latest().id == ids[200]  # a failed load moves nothing


def test_fallback_load_returns_previous_cut_and_records_the_bad_one(damaged):
    url, ids = damaged
    events: list[dict] = []
    with Store.open(url, readonly=True, options=StoreOptions(on_event=events.append)) as s:
        got = ckptstore.load(s, fallback=True)
    assert_state(got, 100)
    skipped = [e for e in events if e["event"] == "fallback-skipped"]
    assert [e["cut"] for e in skipped] == [ids[200]]
    assert skipped[0]["reason"] != RECORDED_BAD and "hash" in skipped[0]["reason"]
    rec = bad_records(url)
    assert list(rec) == [ids[200]]
    assert rec[ids[200]]["cut"] == ids[200] and rec[ids[200]]["step"] == 200 and rec[ids[200]]["reason"]


def test_fallback_load_by_url_records_the_bad_cut(damaged):
    """The documented contract of ``ckptstore.load(url, fallback=True)``: the bad cut is recorded so no
    restart verifies it again, also when the call opens the store itself (as a reader)."""
    url, ids = damaged
    assert_state(ckptstore.load(url, fallback=True), 100)
    assert list(bad_records(url)) == [ids[200]]


def test_later_fallback_loads_skip_the_recorded_cut_without_verifying_it(damaged):
    url, ids = damaged
    assert_state(ckptstore.load(url, fallback=True), 100)
    assert list(bad_records(url)) == [ids[200]]
    # Remove the bad cut's data: re-verifying it would now report a missing file, not the record.
    for p in shard_paths(url, ids[200]):
        os.remove(p)
    for _ in range(2):
        events: list[dict] = []
        with Store.open(url, readonly=True, options=StoreOptions(on_event=events.append)) as s:
            assert_state(ckptstore.load(s, fallback=True), 100)
        skipped = [(e["cut"], e["reason"]) for e in events if e["event"] == "fallback-skipped"]
        assert skipped == [(ids[200], RECORDED_BAD)]
        assert list(bad_records(url)) == [ids[200]]


def test_fallback_walks_back_past_several_bad_cuts(tmp_path):
    url = str(tmp_path / "store")
    ids = build_store(url, [100, 200, 300])
    for step in (200, 300):
        for p in shard_paths(url, ids[step]):
            flip_byte(p)
    assert_state(ckptstore.load(url, fallback=True), 100)
    assert set(bad_records(url)) == {ids[200], ids[300]}


def test_fallback_with_no_good_cut_raises(tmp_path):
    url = str(tmp_path / "store")
    ids = build_store(url, [100])
    for p in shard_paths(url, ids[100]):
        flip_byte(p)
    with pytest.raises(ckptstore.CutNotFound):
        ckptstore.load(url, fallback=True)


def _model_for(step: int) -> nn.Module:
    torch.manual_seed(step)
    return nn.Linear(8, 4)


def test_restore_with_fallback_points_latest_back_so_the_run_continues(tmp_path):
    url = str(tmp_path / "store")
    saved = {}
    with Store.open(url, create=True) as s:
        for step in (100, 200):
            m = _model_for(step)
            saved[step] = {k: v.clone() for k, v in m.state_dict().items()}
            s.save(ckptstore.training_state(step=step, model=m, extra={"at": step}), step=step)
        ids = {c.step: c.id for c in s.cuts()}
    for p in shard_paths(url, ids[200]):
        flip_byte(p)
    # Control: while LATEST names step 200, a save at 150 is refused.
    with Store.open(url) as s:
        with pytest.raises(ckptstore.StepConflict):
            s.save({"x": torch.zeros(1)}, step=150)

    model = nn.Linear(8, 4)
    resumed = ckptstore.restore(url, model=model, fallback=True)
    assert resumed is not None
    assert resumed.step == 100 and resumed.cut.id == ids[100] and resumed.extra == {"at": 100}
    assert list(resumed.skipped) == [ids[200]]
    for k, v in saved[100].items():
        assert torch.equal(model.state_dict()[k], v)
    assert list(bad_records(url)) == [ids[200]]

    with Store.open(url) as s:
        assert s.latest().id == ids[100]
        info = s.save(ckptstore.training_state(step=150, model=model), step=150)
        assert s.latest().id == info.id
    assert ckptstore.load(url, keys=["step"]) == {"step": 150}


def test_restore_into_a_checkpointer_store_lets_the_checkpointer_continue(tmp_path):
    """The loop of docs/resume.md: a Checkpointer opens the store, ``restore(ck.store, fallback=True)``
    moves LATEST back to the good cut, and the loop's next cut (a step between the good and the bad
    cut) must be taken, not refused."""
    from ckptstore.writer import Checkpointer

    url = str(tmp_path / "store")
    ids = build_store(url, [100, 200])
    for p in shard_paths(url, ids[200]):
        flip_byte(p)
    model = nn.Linear(64, 32)
    with Checkpointer(url, every=10, mode="inline") as ck:
        resumed = ckptstore.restore(ck.store, fallback=True)
        assert resumed is not None and resumed.step == 100
        info = ck.cut(110, ckptstore.training_state(step=110, model=model), final=True).wait()
    with Store.open(url, readonly=True) as s:
        assert s.latest().id == info.id and info.step == 110


def test_prune_neither_counts_nor_removes_recorded_bad_cuts(tmp_path):
    url = str(tmp_path / "store")
    ids = build_store(url, [100, 200, 300, 400, 500])
    with Store.open(url) as s:
        # Control: without bad records KeepLast(2) keeps 400 and 500.
        assert [c.step for c in s.prune(KeepLast(2), dry_run=True)] == [100, 200, 300]
        s.record_bad(ids[400], "test: damaged")
        s.record_bad(ids[500], "test: damaged")
        removed = s.prune(KeepLast(2))
        assert [c.step for c in removed] == [100]
        assert [c.step for c in s.cuts()] == [200, 300, 400, 500]
        # A second prune finds nothing more to do: 200 and 300 are the two kept good cuts.
        assert s.prune(KeepLast(2)) == []
    assert set(bad_records(url)) == {ids[400], ids[500]}
    for step in (400, 500):  # evidence is kept whole
        assert all(os.path.exists(p) for p in shard_paths(url, ids[step]))
    assert not os.path.exists(os.path.join(url, "cuts", ids[100]))
    for step in (200, 300):
        assert_state(ckptstore.load(url, step), step)


def test_prune_after_fallback_restore_keeps_the_resumed_cut(tmp_path):
    """After a fallback restore LATEST names the good cut; retention keeps it and the bad cut."""
    url = str(tmp_path / "store")
    ids = build_store(url, [100, 200, 300])
    for p in shard_paths(url, ids[300]):
        flip_byte(p)
    assert ckptstore.restore(url, fallback=True).step == 200
    with Store.open(url) as s:
        assert [c.step for c in s.prune(KeepLast(1))] == [100]
        assert [c.step for c in s.cuts()] == [200, 300]
        assert s.latest().id == ids[200]
