"""One rank of a test job of tests/dcp/test_native_cuts.py: a cut written by the ``Checkpointer``
(FSDP2, DTensors) and loaded back resharded through ``dcp.load(..., storage_reader=StoreReader(url))``.
Writes rank<r>.json; same conventions as tests/dcp/dcp_worker.py (gloo over TCP on 127.0.0.1)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ckptstore.integrations.dcp import StoreReader
from ranks.rank_worker import fsdp_model, train_step
from ranks.rankkit import worker_main

warnings.simplefilter("ignore")
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def scenario_ck_save(cfg: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 + Adam, one step, then one final Checkpointer cut of the DCP-style state dicts (fqn keys,
    DTensors); rank 0 saves the full (unsharded) state as the reference."""
    from ckptstore.writer import Checkpointer

    model, opt = fsdp_model()
    train_step(model, opt, dist.get_rank(), 1)
    ref = {"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
           "optim": get_optimizer_state_dict(model, opt, options=FULL)}
    if dist.get_rank() == 0:
        torch.save(ref, os.path.join(cfg["out_dir"], "ref.pt"))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 1, "note": "ck-run"}}
    with Checkpointer(cfg["url"], group=dist.group.WORLD, every=1, rank_timeout=30) as ck:
        ck.cut(1, state, final=True)
    return {"ok": True}


def _slice(ref: torch.Tensor, dt: DTensor) -> torch.Tensor:
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    out = ref
    for d, (o, n) in enumerate(zip(offsets, shape)):
        out = out.narrow(d, o, n)
    return out


def scenario_fsdp_load(cfg: dict[str, Any]) -> dict[str, Any]:
    """Another world size: a differently initialized FSDP2 model and optimizer state, loaded in place
    through DCP; each rank's local shards must equal the reference's slices bitwise."""
    torch.manual_seed(123)
    model, opt = fsdp_model()
    train_step(model, opt, dist.get_rank(), 99)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 0, "note": ""}}
    dcp.load(state, storage_reader=StoreReader(cfg["url"]))
    ref = torch.load(cfg["ref"], weights_only=True)
    differ, compared, local_shapes = [], 0, {}
    pairs = [(f"model/{k}", v, ref["model"][k]) for k, v in state["model"].items()]
    for fqn, st in state["optim"]["state"].items():
        pairs += [(f"optim/{fqn}/{k}", v, ref["optim"]["state"][fqn][k]) for k, v in st.items()]
    for name, got, want in pairs:
        if isinstance(got, DTensor):
            local, want = got.to_local(), _slice(want, got)
            local_shapes[name] = list(local.shape)
        else:
            local = got
        compared += 1
        if not (local.dtype == want.dtype and local.shape == want.shape and torch.equal(local, want)):
            differ.append(name)
    return {"ok": True, "compared": compared, "differ": differ, "local_shapes": local_shapes,
            "extra": state["extra"], "lr": state["optim"]["param_groups"][0]["lr"]}


if __name__ == "__main__":
    worker_main(globals())
