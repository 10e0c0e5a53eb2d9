"""A small restartable training loop that takes background cuts every few steps with ckptstore.

Run: python examples/train.py STORE --steps 60 --every 5 [--mirror MIRROR]
It resumes from the newest cut that verifies (ckptstore.restore, fallback=True), takes cuts through a
Checkpointer (a niced writer process writes them while training goes on) and prints one JSON line per
event. With ``--mirror`` each cut committed in STORE is copied into the store MIRROR behind the loop
(events "mirrored"), and a restart whose STORE is gone restores from MIRROR (issue 21).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading

import numpy as np
import torch

import ckptstore
import ckptstore.hashing
from ckptstore.writer import Checkpointer


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    return model, opt, sched


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=gen)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--mirror", default=None, help="a second store each cut is copied into (the durable tier)")
    args = ap.parse_args()

    model, opt, sched = build()
    data_gen = torch.Generator().manual_seed(1234)
    random.seed(0)
    np.random.seed(0)
    lock = threading.Lock()

    def events(event: dict) -> None:  # called from the commit thread too: one whole line at a time
        with lock:
            sys.stdout.write(json.dumps(event, default=str) + "\n")
            sys.stdout.flush()

    keep = ckptstore.KeepLast(3) | ckptstore.KeepEvery(20)
    # The mirror keeps what the local tier keeps; on a cluster it is an s3:// URL with mirror_options.
    tier = {"mirror": args.mirror, "mirror_keep": keep} if args.mirror else {}
    # busy="wait": every due cut is taken (the demo's steps are tiny); real loops keep the default "skip".
    with Checkpointer(args.store, every=args.every, keep=keep, busy="wait", on_event=events, **tier) as ck:
        start = 0
        # fallback: the newest cut that verifies, in either tier (a replaced node's empty STORE: the mirror).
        resumed = ckptstore.restore(ck.store, model=model, optimizer=opt, scheduler=sched, fallback=True)
        if resumed is not None:
            data_gen.set_state(resumed.extra["data_gen"])
            start = resumed.step
            events({"event": "resumed", "step": start, "cut": resumed.cut.id, "tier": resumed.tier})
        for step in range(start + 1, args.steps + 1):
            x, y = batch(data_gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            state = ckptstore.training_state(step=step, model=model, optimizer=opt, scheduler=sched,
                                             extra={"data_gen": data_gen.get_state(), "loss": float(loss.detach())})
            if step == args.steps:
                ck.cut(step, state, final=True)
            else:
                ck.maybe_cut(step, state)
    digest = ckptstore.hashing.digest(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    events({"event": "finished", "step": args.steps, "params_blake3": digest})
    return 0


if __name__ == "__main__":
    sys.exit(main())
