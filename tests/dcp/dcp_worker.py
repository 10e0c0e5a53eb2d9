"""One rank of a DCP test job (started by ``run_dcp_job`` in tests/dcp/test_dcp.py): runs a scenario that
saves or loads through ``torch.distributed.checkpoint`` with ckptstore's StoreWriter/StoreReader, and
writes rank<r>.json. Same conventions as tests/ranks/rank_worker.py (gloo over TCP on 127.0.0.1)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckptstore
from ckptstore.dcp import StoreReader, StoreWriter
from ranks.rank_worker import fsdp_model, train_step
from ranks.rankkit import worker_main

warnings.simplefilter("ignore")
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trained(steps: int = 2) -> tuple[Any, Any]:
    model, opt = fsdp_model()
    for s in range(1, steps + 1):
        train_step(model, opt, dist.get_rank(), s)
    return model, opt


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    """The unsharded state (collective): what every load must give back, whatever its world size."""
    return {"model": get_model_state_dict(model, options=FULL), "optim": get_optimizer_state_dict(model, opt, options=FULL)}


def flat_tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat_tensors(v, f"{prefix}/{i}"))
    elif isinstance(state, torch.Tensor):
        out[prefix] = state
    return out


def compare_full(got: dict[str, Any], ref_path: str) -> dict[str, Any]:
    ref = flat_tensors(torch.load(ref_path, weights_only=True))
    have = flat_tensors(got)
    diff = sorted(k for k in ref if k not in have or not (have[k].dtype == ref[k].dtype and have[k].shape == ref[k].shape
                                                          and torch.equal(have[k], ref[k])))
    return {"compared": len(ref), "differ": diff, "unexpected": sorted(set(have) - set(ref))}


def scenario_fsdp_save(cfg: dict[str, Any]) -> dict[str, Any]:
    model, opt = trained()
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(cfg["out_dir"], "full.pt"))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 3, "note": "fsdp-run"}}
    writer = StoreWriter(cfg["url"], step=3, tags=("dcp",))
    dcp.save(state, storage_writer=writer)
    out: dict[str, Any] = {"ok": True, "cut": writer.cut}
    if writer.info is not None:
        out["info"] = writer.info.to_json()
    return out


def scenario_fsdp_load(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(123)  # a different model than the one saved
    model, opt = fsdp_model()
    train_step(model, opt, dist.get_rank(), 99)  # optimizer state exists, and differs
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 0, "note": ""}}
    dcp.load(state, storage_reader=StoreReader(cfg["url"], cut=cfg.get("cut", "latest")))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    got = full_state(model, opt)
    out: dict[str, Any] = {"ok": True, "extra": state["extra"]}
    if dist.get_rank() == 0:
        out.update(compare_full(got, cfg["ref"]))
    return out


def scenario_write_fails(cfg: dict[str, Any]) -> dict[str, Any]:
    """Step 1 commits; at step 2 the victim rank's write raises, twice: dcp.save raises on every rank and
    leaves LATEST at step 1. Rank 0 ends the first failed save with ``writer.close()``; the second one
    (no reference kept) is ended by the next save of the store in this process, the retry that commits."""
    from ckptstore import pending

    rank = dist.get_rank()
    model, opt = trained(1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, storage_writer=StoreWriter(cfg["url"], step=1))
    real = pending.RankPart.write, pending.PendingCut.write
    if rank == cfg["victim"]:
        def boom(self: Any, items: Any, **kw: Any) -> Any:
            raise OSError(28, "No space left on device (injected)")

        pending.RankPart.write = pending.PendingCut.write = boom  # type: ignore[method-assign]
    out: dict[str, Any] = {"ok": True, "raised": []}

    def failing_save(writer: StoreWriter) -> None:
        try:
            dcp.save(state, storage_writer=writer)
            out["raised"].append(None)
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            out["raised"].append(f"{type(exc).__name__}: {exc}"[:2000])

    writer = StoreWriter(cfg["url"], step=2)
    failing_save(writer)
    dist.barrier()
    if rank == 0:
        try:
            ckptstore.Store.open(cfg["url"]).close()
            out["locked_before_close"] = False
        except ckptstore.StoreLocked:
            out["locked_before_close"] = True
        writer.close()  # abandons the cut DCP gave up on, releases the writer lock
        with ckptstore.Store.open(cfg["url"]) as store:
            out["after_close"] = {"latest_step": store.latest().step,
                                  "leftovers": [lo.kind for lo in store.classify().leftovers],
                                  "cut_dirs": len(os.listdir(os.path.join(cfg["url"], "cuts")))}
    dist.barrier()
    failing_save(StoreWriter(cfg["url"], step=2))
    pending.RankPart.write, pending.PendingCut.write = real  # type: ignore[method-assign]
    retry = StoreWriter(cfg["url"], step=2)
    dcp.save(state, storage_writer=retry)
    out["retry_cut"] = retry.cut
    dist.barrier()
    if rank == 0:
        with ckptstore.Store.open(cfg["url"]) as store:
            out["after_retry"] = {"cuts": [c.step for c in store.cuts()], "latest_step": store.latest().step,
                                  "leftovers": [lo.kind for lo in store.classify().leftovers],
                                  "cut_dirs": len(os.listdir(os.path.join(cfg["url"], "cuts")))}
    return out


if __name__ == "__main__":
    worker_main(globals())
