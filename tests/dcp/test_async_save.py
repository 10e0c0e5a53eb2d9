"""dcp.async_save through StoreWriter (the thread executor, one process): the future completes once
the cut is committed, and the cut loads back bitwise."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.integrations.dcp import StoreReader, StoreWriter


def test_async_save_commits_when_its_future_completes(tmp_path):
    url = str(tmp_path / "store")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        fut = dcp.async_save(state, storage_writer=StoreWriter(url, step=7, tags=("async",)))
        fut.result(timeout=120)
        with ckptstore.Store.open(url, readonly=True) as store:
            latest = store.latest()
            assert latest.step == 7 and latest.tags == ("async",)
            assert store.verify().ok
        fresh = {"model": torch.nn.Linear(8, 4).state_dict()}
        dcp.load(fresh, storage_reader=StoreReader(url))
    assert all(torch.equal(state["model"][k], fresh["model"][k]) for k in state["model"])
