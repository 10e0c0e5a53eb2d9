"""Cuts written by the Checkpointer (not through DCP) load through StoreReader, resharded (issue 12):
2 FSDP2 ranks save with ``Checkpointer(group=...)``; DCP loads the cut into one process without a
process group (a plain model, full tensors) and into 4 FSDP2 ranks (uneven shards)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import ckptstore
from ckptstore.integrations.dcp import METADATA_KEY, StoreReader
from ranks.rankkit import RankResult, describe, run_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_worker.py")


def run_native_job(out_dir: str, world: int, scenario: str, **kw: Any) -> list[RankResult]:
    kw.setdefault("timeout", 120)  # 4-rank FSDP2 loads on 2 cores
    return run_job(out_dir, world, scenario, worker=WORKER, **kw)


def _ok(results: list[RankResult]) -> None:
    assert all(r.returncode == 0 and r.result and r.result.get("ok") for r in results), describe(results)


@pytest.fixture(scope="module")
def ck_cut(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One Checkpointer cut of 2 FSDP2 ranks, and the full reference state."""
    root = tmp_path_factory.mktemp("native")
    url, out = str(root / "store"), str(root / "save")
    _ok(run_native_job(out, 2, "ck_save", url=url))
    return {"url": url, "ref": os.path.join(out, "ref.pt")}


def test_checkpointer_cut_is_native(ck_cut: dict[str, str]) -> None:
    with ckptstore.Store.open(ck_cut["url"], readonly=True) as store:
        m = store.manifest("latest")
    assert m.world_size == 2 and METADATA_KEY not in m.metadata


def test_metadata_synthesized_from_trees(ck_cut: dict[str, str]) -> None:
    md = StoreReader(ck_cut["url"]).read_metadata()
    w = md.state_dict_metadata["model.0.weight"]
    assert list(w.size) == [7, 5] and w.properties.dtype == torch.float32
    assert sorted((list(c.offsets), list(c.sizes)) for c in w.chunks) == [([0, 0], [4, 5]), ([4, 0], [3, 5])]
    step = md.state_dict_metadata["optim.state.0.weight.step"]
    assert list(step.size) == [] and len(step.chunks) == 1  # a plain tensor of every rank: rank 0's
    assert type(md.state_dict_metadata["optim.param_groups.0.lr"]).__name__ == "BytesStorageMetadata"
    assert type(md.state_dict_metadata["extra.note"]).__name__ == "BytesStorageMetadata"
    assert {loc.rank for loc in md.storage_data.values() if hasattr(loc, "array")} == {0, 1}


def test_load_into_one_process_without_group(ck_cut: dict[str, str]) -> None:
    """A plain (non-FSDP) model and its Adam state, full tensors, in one process: bitwise the reference."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()  # optimizer state exists, and differs
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 0, "note": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.load(state, storage_reader=StoreReader(ck_cut["url"]))
    ref = torch.load(ck_cut["ref"], weights_only=True)
    assert set(state["model"]) == set(ref["model"])
    for k, want in ref["model"].items():
        got = state["model"][k]
        assert got.dtype == want.dtype and torch.equal(got, want), k
    for fqn, st in ref["optim"]["state"].items():
        for k, want in st.items():
            assert torch.equal(state["optim"]["state"][fqn][k], want), (fqn, k)
    assert state["optim"]["param_groups"][0]["lr"] == 0.05
    assert state["extra"] == {"step": 1, "note": "ck-run"}


def test_load_resharded_onto_four_fsdp_ranks(ck_cut: dict[str, str], tmp_path: Any) -> None:
    results = run_native_job(str(tmp_path / "load4"), 4, "fsdp_load", url=ck_cut["url"], ref=ck_cut["ref"])
    _ok(results)
    for r in results:
        assert r.result["differ"] == [] and r.result["compared"] == 16, describe(results)
        assert r.result["extra"] == {"step": 1, "note": "ck-run"} and r.result["lr"] == 0.05
    # Uneven shards: [7, 5] over 4 ranks is 2, 2, 2, 1 rows; [3, 7] is 1, 1, 1, 0.
    assert [r.result["local_shapes"]["model/0.weight"] for r in results] == [[2, 5], [2, 5], [2, 5], [1, 5]]
    assert [r.result["local_shapes"]["model/2.weight"] for r in results] == [[1, 7], [1, 7], [1, 7], [0, 7]]
