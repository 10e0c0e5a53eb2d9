"""A Hugging Face ``Trainer`` run that cuts into a ckptstore store, can kill itself, and resumes.

Run as ``python tests/integrations/hf_trainer.py URL --out F [--kill-between K | --kill-mid-cut K]``.

The model is a one-layer GPT-2 built from a config (dropout 0.2 everywhere, so the torch RNG matters),
trained on random tokens (24 samples, batch 4: 6 steps an epoch, 16 steps: the run crosses two epoch
boundaries, so the data position matters). Saving is :class:`CkptStoreCallback` (``every=EVERY``,
writer process); resuming is ``ckptstore.integrations.transformers.train``, which resumes from the
store's latest cut when there is one (the Trainer's own ``resume_from_checkpoint``).

``--kill-between K``: at step K's ``on_step_end`` (K not a cut step), wait until the last cut is
committed, then SIGKILL. ``--kill-mid-cut K`` (K a cut step): SIGKILL right after the Checkpointer
returned step K's handle, before it was committed.

Output, one JSON object per line on stdout, flushed: ``{"event": "start", "resume_step"}`` (null when
fresh); ``{"event": "kill", "step", "handle_step", "handle_state", "writer_pid"}`` just before the
SIGKILL; ``{"event": "done", "step"}`` once the end state is in ``--out`` (torch.save of model,
optimizer and scheduler state dicts, the (step, loss) pairs of ``state.log_history`` and the RNG
states).

``--group`` (a run of several processes: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set as torchrun sets them; the Trainer's DDP over gloo; with two ranks, 3 steps an
epoch): the callback cuts with ``group=torch.distributed.group.WORLD``, every rank its own part. In a
run of several processes each rank draws
``rank + 1`` extra numbers from the torch RNG before every forward (as data-dependent draws would), so
the ranks' RNG streams, and so their dropout masks, differ: a rank whose RNG came back from another
rank's part ends elsewhere. A kill waits at a barrier first, so every rank dies at the same step; the
end state carries the rank.

``python tests/integrations/hf_trainer.py --serve`` imports torch and transformers once (about 10 s of
CPU, most of a run's cost) and then forks one process per run (tests/integrations/forkkit.py).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

import ckptstore
from ckptstore.integrations.transformers import CkptStoreCallback, train
from forkkit import say, serve

SEED = 11
SAMPLES, BATCH, SEQ = 24, 4, 16
MAX_STEPS, EVERY = 16, 4


class RandomTokens(Dataset):
    """Fixed random token sequences (their own generator: the same data in every process)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RankDraws:
    """A forward pre-hook that draws ``rank + 1`` numbers from the torch RNG (and leaves the inputs)."""

    def __init__(self, rank: int) -> None:
        self.n = rank + 1

    def __call__(self, module: torch.nn.Module, inputs: tuple) -> None:
        torch.rand(self.n)


class Killer(TrainerCallback):
    """Registered after CkptStoreCallback, so it sees the cut of the step it kills at."""

    def __init__(self, saver: CkptStoreCallback, between: int | None, mid_cut: int | None) -> None:
        self.saver, self.between, self.mid_cut = saver, between, mid_cut

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.between:
            assert self.saver.last_handle is not None
            self.saver.last_handle.wait()  # the kill lands between cuts: the last one is committed
            self._kill(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # logging_steps=1: the callback takes each cut in on_log, right before this runs.
        if state.global_step == self.mid_cut:
            assert self.saver.last_handle is not None and self.saver.last_handle.step == self.mid_cut
            self._kill(state.global_step)

    def _kill(self, step: int) -> None:
        h = self.saver.last_handle
        ck = self.saver.checkpointer
        if torch.distributed.is_initialized():
            # Every rank is past its wait: none dies while another still needs the rendezvous store
            # (rank 0's process hosts it) to learn that the last cut committed.
            torch.distributed.barrier()
        say(event="kill", step=step, handle_step=h.step if h else None, handle_state=h.state if h else None,
            writer_pid=ck.writer_pid if ck else None)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-between", type=int, default=None)
    ap.add_argument("--kill-mid-cut", type=int, default=None)
    ap.add_argument("--group", action="store_true", help="cut with group=WORLD (a multi-process run)")
    args = ap.parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # as under --serve: the same kernels, so the same bits, in every run

    latest = None
    if os.path.exists(args.url):
        with ckptstore.Store.open(args.url, readonly=True) as s:
            latest = s.latest()
    say(event="start", resume_step=latest.step if latest else None)

    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                                       resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, bos_token_id=0, eos_token_id=0))
    targs = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.out), "hf-out"), max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH, learning_rate=1e-2, warmup_steps=3, weight_decay=0.01,
        report_to=[], use_cpu=True, seed=SEED, logging_steps=1, save_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True)
    rank = targs.process_index  # TrainingArguments has initialized torch.distributed in a run of several
    if targs.world_size > 1:
        model.register_forward_pre_hook(RankDraws(rank))
    group = torch.distributed.group.WORLD if args.group else None
    # nice=0: the test machine's CPUs are shared and a niced writer can starve; busy="wait": no periodic
    # cut is skipped, so the kills land where the test says. Neither is what this tests.
    saver = CkptStoreCallback(args.url, every=EVERY, group=group, mode="process", nice=0, busy="wait")
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(),
                      callbacks=[saver, Killer(saver, args.kill_between, args.kill_mid_cut)])
    saver.trainer = trainer
    train(trainer, args.url)

    torch.save({
        "model": model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "losses": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "global_step": trainer.state.global_step,
        "rank": rank,
    }, args.out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 hosts the rendezvous store: it exits last
    say(event="done", step=trainer.state.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(serve(main) if sys.argv[1:] == ["--serve"] else main())
