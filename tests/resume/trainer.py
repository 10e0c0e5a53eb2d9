"""A tiny trainer that checkpoints into a ckptstore store, can kill itself, and resumes exactly.

Run as ``python tests/resume/trainer.py URL --steps T [--kill-after K] --path sync|checkpointer --out F``.

The loop uses every source of randomness a real trainer does, so an inexact resume shows up in the
final bits: dropout (torch's global RNG), input noise (numpy's global RNG), an input scale (python's
``random``) and a shuffling DataLoader driven by an explicit ``torch.Generator``. The data position
goes into the cut's ``extra``: the generator state at the start of the current epoch, the epoch and the
number of batches consumed in it; a resumed run sets the generator back, rebuilds the iterator and
skips the consumed batches.

Paths: ``sync`` saves with ``Store.save`` every ``--every`` steps (and at the kill step), then a final
cut; ``checkpointer`` uses ``Checkpointer(url, every=..., mode="process")``: ``maybe_cut`` on the
periodic steps, ``cut`` (then the handle's ``wait()``) at the kill step, ``cut(final=True)`` at the end.

Output, one JSON object per line on stdout, flushed: ``{"event": "resumed", "step", "cut"}`` or
``{"event": "fresh"}``; ``{"event": "cut", "step", "cut"}`` per committed cut; ``{"event": "kill",
"step", "pid", "writer_pid"}`` just before SIGKILL (right after the kill step's cut is committed); ``{"event": "done",
"step"}`` after the final state is written to ``--out`` (torch.save of model, optimizer and scheduler
state, the RNG states, the data position and the per-step losses).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptstore

SEED = 1234
SAMPLES, BATCH = 40, 8  # 5 batches per epoch: a kill after step 7 lands inside the second epoch


def say(**doc: Any) -> None:
    print(json.dumps(doc), flush=True)


def build() -> tuple[nn.Module, torch.optim.Optimizer, Any, DataLoader, torch.Generator]:
    """Everything a run constructs, in the same order whether it starts fresh or resumes."""
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    random.seed(SEED)
    data_gen = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=data_gen)
    y = torch.randn(SAMPLES, 2, generator=data_gen)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(p=0.3), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    shuffle_gen = torch.Generator().manual_seed(99)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=shuffle_gen)
    return model, optimizer, scheduler, loader, shuffle_gen


class Position:
    """Where the loop is in the data: the epoch, the batches consumed in it, and the shuffle
    generator's state when the epoch's iterator was built."""

    def __init__(self, loader: DataLoader, gen: torch.Generator) -> None:
        self.loader, self.gen = loader, gen
        self.epoch = -1
        self.batch_in_epoch = 0
        self.epoch_gen_state: torch.Tensor | None = None
        self.it: Any = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.it is None or self.batch_in_epoch == len(self.loader):
            self.epoch += 1
            self.epoch_gen_state = self.gen.get_state()
            self.it = iter(self.loader)
            self.batch_in_epoch = 0
        batch = next(self.it)
        self.batch_in_epoch += 1
        return batch

    def extra(self) -> dict[str, Any]:
        assert self.epoch_gen_state is not None
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "epoch_gen_state": self.epoch_gen_state.clone()}

    def resume(self, extra: dict[str, Any]) -> None:
        self.epoch = int(extra["epoch"])
        self.batch_in_epoch = int(extra["batch_in_epoch"])
        self.epoch_gen_state = extra["epoch_gen_state"]
        self.gen.set_state(self.epoch_gen_state)
        self.it = iter(self.loader)
        for _ in range(self.batch_in_epoch):
            next(self.it)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
               batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = batch
    noise = torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
    scale = 1.0 + 0.1 * random.random()
    out = model(x * scale + 0.05 * noise)
    loss = nn.functional.mse_loss(out, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss.item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--steps", type=int, required=True, help="total steps of the run")
    ap.add_argument("--kill-after", type=int, default=None, help="SIGKILL right after this step's cut commits")
    ap.add_argument("--path", choices=["sync", "checkpointer"], required=True)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--preempt-at", type=int, default=None,
                    help="checkpointer path with preemption=True: at this step print 'paused' and wait for a "
                         "line on stdin (the test sends the preemption signals meanwhile)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    model, optimizer, scheduler, loader, gen = build()
    pos = Position(loader, gen)
    model.train()

    store = ckptstore.Store.open(args.url, create=True) if args.path == "sync" else None
    # The checkpointer opens the store as its writer, so the restore (a writer too: it may record bad
    # cuts and move LATEST) has to finish and close first.
    resumed = ckptstore.restore(store if store is not None else args.url,
                                model=model, optimizer=optimizer, scheduler=scheduler)
    start = 0
    if resumed is None:
        say(event="fresh")
    else:
        start = resumed.step
        pos.resume(resumed.extra)
        say(event="resumed", step=resumed.step, cut=resumed.cut.id)

    ck = None
    chained: list[int] = []
    if args.path == "checkpointer":
        from ckptstore.writer import Checkpointer

        # nice=0: the test machine's CPUs are shared, and a niced writer can starve for many seconds;
        # the writer's priority is not what this run tests.
        preemption = args.preempt_at is not None
        if preemption:  # a framework's own SIGTERM handler, installed first: the Checkpointer chains to it
            signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
        ck = Checkpointer(args.url, every=args.every, mode="process", nice=0, preemption=preemption)
    pending: list[Any] = []

    def report_done() -> None:
        for h in [h for h in pending if h.done]:
            pending.remove(h)
            info = h.wait()  # raises the cut's error, if any
            say(event="cut", step=info.step, cut=info.id, final=info.final)

    def state(step: int) -> dict[str, Any]:
        return ckptstore.training_state(step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                                        extra=pos.extra())

    losses: dict[int, float] = {}
    for step in range(start + 1, args.steps + 1):
        losses[step] = train_step(model, optimizer, scheduler, pos.next_batch())
        if step == args.preempt_at:
            say(event="paused", step=step, pid=os.getpid(), writer_pid=ck.writer_pid if ck is not None else None)
            sys.stdin.readline()
        kill_now = step == args.kill_after
        if store is not None:
            if step % args.every == 0 or kill_now:
                info = store.save(state(step), step=step, final=step == args.steps)
                say(event="cut", step=info.step, cut=info.id, final=info.final)
        else:
            assert ck is not None
            if kill_now:
                h = ck.cut(step, state(step))
                pending.append(h)
                h.wait()
            elif step != args.steps:
                h = ck.maybe_cut(step, state(step))
                if h is not None:
                    pending.append(h)
            report_done()
            if ck.preempted:  # the preemption cut of this step is committed: end the run, exit 0
                assert h is not None
                say(event="preempted", step=step, chained=chained, fallback=h.fallback)
                ck.close()
                return 0
        if kill_now:
            say(event="kill", step=step, pid=os.getpid(), writer_pid=ck.writer_pid if ck is not None else None)
            os.kill(os.getpid(), signal.SIGKILL)

    if ck is not None:
        if args.steps > start:
            pending.append(ck.cut(args.steps, state(args.steps), final=True))
        ck.close()
        report_done()
    elif store is not None:
        if args.steps % args.every != 0 and args.steps > start:
            info = store.save(state(args.steps), step=args.steps, final=True)
            say(event="cut", step=info.step, cut=info.id, final=info.final)
        store.close()

    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": ckptstore.capture_rng(),
        "shuffle_gen": gen.get_state(),
        "position": {"epoch": pos.epoch, "batch_in_epoch": pos.batch_in_epoch},
        "losses": losses,
    }, args.out)
    say(event="done", step=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
