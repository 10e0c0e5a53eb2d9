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

``python tests/integrations/hf_trainer.py --serve`` imports torch and transformers once (about 10 s of
CPU, most of a run's cost) and then forks one process per run: it reads one JSON line per phase from
stdin, ``[{"id", "argv", "log"}, ...]``, forks a process for each (``main(argv)``, stdout and stderr
to ``log``), waits for all of them and prints ``{"event": "exited", "id", "pid", "returncode"}`` per
run (``-9`` after a SIGKILL), then ``{"event": "phase-done"}``. Each run is still a process of its own
that shares nothing with the others but the imported code: it builds its model, Trainer and
Checkpointer (whose writer is a fresh interpreter) itself, and a resumed run gets its state only from
the store.
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
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

import ckptstore
from ckptstore.integrations.transformers import CkptStoreCallback, train

SEED = 11
SAMPLES, BATCH, SEQ = 24, 4, 16
MAX_STEPS, EVERY = 16, 4


def say(**doc: Any) -> None:
    print(json.dumps(doc), flush=True)


class RandomTokens(Dataset):
    """Fixed random token sequences (their own generator: the same data in every process)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


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
        say(event="kill", step=step, handle_step=h.step if h else None, handle_state=h.state if h else None,
            writer_pid=ck.writer_pid if ck else None)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-between", type=int, default=None)
    ap.add_argument("--kill-mid-cut", type=int, default=None)
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
    # nice=0: the test machine's CPUs are shared and a niced writer can starve; busy="wait": no periodic
    # cut is skipped, so the kills land where the test says. Neither is what this tests.
    saver = CkptStoreCallback(args.url, every=EVERY, mode="process", nice=0, busy="wait")
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
    }, args.out)
    say(event="done", step=trainer.state.global_step)
    return 0


def serve() -> int:
    """The fork server (module docstring): one phase per stdin line, until EOF."""
    torch.set_num_threads(1)  # no intra-op pool before fork (libgomp's is not fork-safe); runs do the same
    for line in sys.stdin:
        children: dict[int, str] = {}
        for job in json.loads(line):
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(job["argv"], job["log"])
            children[pid] = job["id"]
        for pid, job_id in children.items():
            _, status = os.waitpid(pid, 0)
            say(event="exited", id=job_id, pid=pid, returncode=os.waitstatus_to_exitcode(status))
        say(event="phase-done")
    return 0


def _child(argv: list[str], log: str) -> None:
    """In a forked run: stdin from /dev/null, stdout and stderr to ``log``; never returns."""
    code = 70
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback goes to the run's log, the status says it failed
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main())
