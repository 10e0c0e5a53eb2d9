"""A Hugging Face Trainer run that cuts into ckptstore and resumes exactly after any crash.

Run: python examples/hf_example.py STORE [--steps 60] [--every 10]
Interrupt it however you like (Ctrl-C, kill -9) and run the same command again: it resumes from the
store's latest cut (model, optimizer, scheduler, RNG, trainer state and the position in the data) and
finishes as if it had never stopped. A finished run ends with a final cut of its last step:
``ckptstore resume-info STORE`` then says ``finished``. A tiny GPT-2 built from a config on random
tokens, on the CPU: well under a minute.

Several processes: ``torchrun --nproc-per-node 2 examples/hf_example.py STORE`` trains with DDP (gloo on
the CPU), and every rank cuts its own part of each cut (``group=``: rank 0 the whole state, the
others their RNG states) and resumes from it.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ckptstore
from ckptstore.integrations.transformers import CkptStoreCallback, train


class RandomTokens(Dataset):
    def __init__(self, n: int = 64, length: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    targs = TrainingArguments(
        output_dir=f"{args.store}.hf-out",
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=args.every,  # every cut at a logging step: the resumed logs match too
        save_strategy="no",  # ckptstore takes the checkpoints; the Trainer writes none of its own
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # Under torchrun, TrainingArguments has initialized torch.distributed: every rank cuts its own part.
    group = torch.distributed.group.WORLD if targs.world_size > 1 else None
    saver = CkptStoreCallback(args.store, every=args.every, group=group, keep=ckptstore.KeepLast(3))
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(), callbacks=[saver])
    saver.trainer = trainer  # so the grad scaler (fp16 runs) is cut too

    latest = None
    try:
        with ckptstore.Store.open(args.store, readonly=True) as store:
            latest = store.latest()
    except ckptstore.StoreNotFound:
        pass
    if latest is not None and latest.final:
        print(f"{args.store}: the run finished at step {latest.step}; nothing to do")
        return 0
    print(f"resuming from step {latest.step}" if latest else "starting fresh", flush=True)
    out = train(trainer, args.store)  # trainer.train(), from the store's latest cut when it has one
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"done at step {out.global_step}; last logged loss {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
