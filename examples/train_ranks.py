"""A restartable FSDP2 training job of several ranks that takes background cuts with ckptstore.

Run (CPU, gloo): python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_ranks.py STORE
Every rank shards the model with ``fully_shard``; ``Checkpointer(..., group=WORLD)`` takes one cut of
every rank's state (DTensor shards and their layout) every few steps, and ``restore(..., group=)``
puts each rank's shards back in place after a restart. Rank 0 prints one JSON line per event; every
rank prints a last line with the blake3 of its parameter shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ckptstore
import ckptstore.hashing
from ckptstore.writer import Checkpointer


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    data_gen = torch.Generator().manual_seed(1234 + rank)  # each rank reads its own part of the data
    lock = threading.Lock()

    def out(event: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(event, default=str) + "\n")
            sys.stdout.flush()

    events = out if rank == 0 else None
    with Checkpointer(args.store, every=args.every, keep=ckptstore.KeepLast(3), busy="wait", on_event=events,
                      group=dist.group.WORLD, rank_timeout=60) as ck:
        start = 0
        resumed = ckptstore.restore(ck.store, model=model, optimizer=opt, group=dist.group.WORLD)
        if resumed is not None:
            data_gen.set_state(resumed.extra["data_gen"])
            start = resumed.step
            if rank == 0:
                out({"event": "resumed", "step": start, "cut": resumed.cut.id, "world_size": resumed.cut.world_size})
        for step in range(start + 1, args.steps + 1):
            x = torch.randn(32, 16, generator=data_gen)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state = ckptstore.training_state(step=step, model=model, optimizer=opt, extra={"data_gen": data_gen.get_state()})
            if step == args.steps:
                ck.cut(step, state, final=True)
            else:
                ck.maybe_cut(step, state)
    shards = b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())
    out({"event": "finished", "rank": rank, "step": args.steps, "params_blake3": ckptstore.hashing.digest(shards)})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
