"""A small restartable training loop that takes a cut every few steps with ckptstore.

Run: python examples/train.py STORE --steps 60 --every 5
It resumes from the store's LATEST cut when there is one, and prints one JSON line per event.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import numpy as np
import torch

import ckptstore
import ckptstore.hashing


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
    args = ap.parse_args()

    model, opt, sched = build()
    data_gen = torch.Generator().manual_seed(1234)
    random.seed(0)
    np.random.seed(0)
    start = 0
    events = lambda e: print(json.dumps(e, default=str), flush=True)  # noqa: E731
    with ckptstore.Store.open(args.store, create=True, options=ckptstore.StoreOptions(on_event=events)) as store:
        latest = store.latest()
        if latest is not None:
            state = store.load("latest")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
            torch.set_rng_state(state["rng"]["torch"])
            data_gen.set_state(state["rng"]["data"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
            start = state["step"]
            print(json.dumps({"event": "resumed", "step": start, "cut": latest.id}), flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = batch(data_gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if step % args.every == 0 or step == args.steps:
                state = {
                    "model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                    "rng": {"torch": torch.get_rng_state(), "data": data_gen.get_state(),
                            "numpy": np.random.get_state(), "python": random.getstate()},
                    "step": step, "loss": float(loss.detach()),
                }
                store.save(state, step=step, final=step == args.steps, tags=("final",) if step == args.steps else ())
                store.prune(ckptstore.KeepLast(3) | ckptstore.KeepEvery(20))
        digest = ckptstore.hashing.digest(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        print(json.dumps({"event": "finished", "step": args.steps, "params_blake3": digest}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
