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
from ckptstore.integrations.dcp import StoreReader, StoreWriter
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


# ----------------------------------------------------------------------------- placements and 2-D meshes
def placed_tensors(mesh: Any, two_d: bool) -> dict[str, Any]:
    """DTensors of every placement kind on ``mesh`` (uneven sizes included), built from the same global
    tensors on every rank (seeded), so a load at any world size can compare against them."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(2024)
    glob = {"a": torch.randn(6, 10, generator=g), "b": torch.randn(5, 7, generator=g),
            "c": torch.arange(24, dtype=torch.bfloat16).reshape(4, 6), "d": torch.randn(9, generator=g)}
    if two_d:
        placements = {"a": [Shard(0), Shard(1)], "b": [Shard(1), Shard(0)], "c": [Replicate(), Shard(1)],
                      "d": [Shard(0), Replicate()]}
    else:
        placements = {"a": [Shard(1)], "b": [Shard(0)], "c": [Replicate()], "d": [Shard(0)]}
    return {k: distribute_tensor(v, mesh, placements[k]) for k, v in glob.items()}


def tp_fsdp_model(mesh: Any) -> tuple[Any, Any]:
    """A 2-D (FSDP x TP) model on ``mesh`` ("dp", "tp"): Megatron-style column/row parallel linears on
    "tp", FSDP2 on "dp" (its shards of the TP shards are _StridedShard placements); or an FSDP2-only
    model when ``mesh`` is 1-D. Same seed, so every layout starts from the same global weights."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    if mesh.ndim == 2:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def mesh_train(model: Any, opt: Any, dp_rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(31 * step + dp_rank)
    loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def scenario_mesh2d_save(cfg: dict[str, Any]) -> dict[str, Any]:
    """4 ranks as a 2x2 (dp, tp) mesh: an FSDP x TP model and Adam, plus DTensors of every placement. Saves
    the full (unsharded) state as the reference, then: dcp.save (step 1) and dcp.async_save with the thread
    executor (step 2) through StoreWriter, and a Checkpointer cut (step 2) into a second store."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from ckptstore.writer import Checkpointer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, opt = tp_fsdp_model(mesh)
    mesh_train(model, opt, mesh.get_local_rank("dp"), 1)
    placed = placed_tensors(mesh, two_d=True)
    full = {**full_state(model, opt), "placed": {k: v.full_tensor() for k, v in placed.items()}}
    placements = {k: [str(p) for p in v.placements] for k, v in placed.items()}
    placements["model.0.weight"] = [str(p) for p in model[0].weight.placements]
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(cfg["out_dir"], "full.pt"))
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "placed": placed, "extra": {"note": "mesh2d"}}
    dcp.save(state, storage_writer=StoreWriter(cfg["url"], step=1))
    fut = dcp.async_save(state, storage_writer=StoreWriter(cfg["url"], step=2, tags=("async",)))
    fut.result(timeout=120)
    with Checkpointer(cfg["native_url"], group=dist.group.WORLD, every=1) as ck:
        ck.cut(2, state, final=True)
    return {"ok": True, "placements": placements}


def scenario_mesh_load(cfg: dict[str, Any]) -> dict[str, Any]:
    """Loads a store saved by mesh2d_save into a 1-D mesh of this job's ranks (FSDP2 only, placements of a
    1-D mesh) through DCP's get_state_dict/set_state_dict helpers, and compares the full state with the
    saved reference, bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = tp_fsdp_model(mesh)
    mesh_train(model, opt, 99, 99)  # optimizer state exists, and differs from the saved one
    out: dict[str, Any] = {"ok": True}
    for label, url in (("dcp", cfg["url"]), ("native", cfg["native_url"])):
        placed = placed_tensors(mesh, two_d=False)
        for v in placed.values():
            v.to_local().zero_()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "placed": placed, "extra": {"note": ""}}
        dcp.load(state, storage_reader=StoreReader(url, cut="latest"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = {**full_state(model, opt), "placed": {k: v.full_tensor() for k, v in state["placed"].items()}}
        if dist.get_rank() == 0:
            out[label] = {**compare_full(got, cfg["ref"]), "extra": state["extra"]}
        model, opt = tp_fsdp_model(mesh)  # fresh for the next store
        mesh_train(model, opt, 99, 99)
    return out


# ----------------------------------------------------------------------------------- kills, S3, process
def scenario_killed_mid_save(cfg: dict[str, Any]) -> dict[str, Any]:
    """Step 1 commits; in step 2's write_data the victim SIGKILLs itself after half of its shards are
    written (a real mid-save death). The survivors' dcp.save must raise, never commit; a surviving
    coordinator ends its writer, and LATEST stays at step 1."""
    import signal

    from ckptstore import pending

    rank = dist.get_rank()
    torch.manual_seed(rank)
    state = {f"w{i}": torch.randn(64, 64) for i in range(4)}
    dcp.save(state, storage_writer=StoreWriter(cfg["url"], step=1))
    if rank == cfg["victim"]:
        real = pending.RankPart.write if dist.get_world_size() > 1 else pending.PendingCut.write

        def die_halfway(self: Any, items: Any, **kw: Any) -> Any:
            real(self, list(items)[: max(1, len(items) // 2)], **kw)
            os.kill(os.getpid(), signal.SIGKILL)

        pending.RankPart.write = die_halfway  # type: ignore[method-assign]
    state = {k: v + 1 for k, v in state.items()}
    writer = StoreWriter(cfg["url"], step=2)
    out: dict[str, Any] = {"ok": True}
    try:
        dcp.save(state, storage_writer=writer)
        out["raised"] = None
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException or a gloo error
        out["raised"] = f"{type(exc).__name__}: {exc}"[:1000]
    writer.close()
    with ckptstore.Store.open(cfg["url"], readonly=True) as store:
        out["latest_step"] = store.latest().step
    return out


def scenario_s3_process_save(cfg: dict[str, Any]) -> dict[str, Any]:
    """An FSDP2 job on the S3 server: dcp.save (step 1), then dcp.async_save with DCP's process executor
    (step 2: the StoreWriter is pickled into DCP's checkpoint daemon, which commits)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, opt = trained()
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(cfg["out_dir"], "full.pt"))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    opts = cfg["storage_options"]
    dcp.save(state, storage_writer=StoreWriter(cfg["url"], step=1, storage_options=opts))
    train_step(model, opt, dist.get_rank(), 3)
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(cfg["out_dir"], "full2.pt"))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    fut = dcp.async_save(state, storage_writer=StoreWriter(cfg["url"], step=2, storage_options=opts, keep=1),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    fut.result(timeout=180)
    with ckptstore.Store.open(cfg["url"], readonly=True, options=ckptstore.StoreOptions(storage_options=opts)) as store:
        return {"ok": True, "steps": [c.step for c in store.cuts()], "world_size": store.latest().world_size}


if __name__ == "__main__":
    worker_main(globals())
