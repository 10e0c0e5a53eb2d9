"""A Lightning fit whose checkpoints are cuts of a ckptstore store, resumable after any crash.

Run: python examples/lightning_example.py CKPT_DIR [--steps 64]
CKPT_DIR is ModelCheckpoint's dirpath and a ckptstore store (``ckptstore ls CKPT_DIR``). Interrupt the
run however you like (Ctrl-C, kill -9) and run the same command again: it resumes from ``last.ckpt``
(Lightning's ``last_model_path``) and finishes as if it had never stopped, bit for bit; then the
store's last cut is marked final, so ``ckptstore resume-info CKPT_DIR`` says ``finished``. The
hyperparameters hold a ``pathlib.Path``, stored without pickle. A tiny MLP on random data, on the CPU:
well under a minute.

Bit for bit because Lightning resumes exactly at an epoch's end and this fit draws nothing from the
global RNGs: checkpoints fall at epoch ends (8 steps an epoch, one every 8 steps; from the middle of an
epoch Lightning restarts the epoch's data unless the loader is stateful), the shuffle order is a
function of the seed and the epoch (``EpochShuffle``; a ``RandomSampler`` would start a resumed fit
over at the first epoch's order) and there is no dropout (Lightning saves no RNG state).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import ckptstore
from ckptstore.integrations.lightning import CkptStoreCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05, data_dir: pathlib.Path = pathlib.Path("data")) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):  # noqa: ANN201
        x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        return torch.utils.data.DataLoader(data, batch_size=16, sampler=EpochShuffle(len(data)))


class EpochShuffle(torch.utils.data.Sampler):
    """A shuffle whose order depends on the seed and the epoch only (Lightning calls ``set_epoch``)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # noqa: ANN204
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt_dir")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args(argv)
    ckpt_dir = os.path.abspath(args.ckpt_dir)
    last = os.path.join(ckpt_dir, "last.ckpt")
    resume = None
    try:  # a store with a last.ckpt label: resume from it
        with ckptstore.Store.open(ckpt_dir, readonly=True) as store:
            resume = last if "last.ckpt" in store.labels() else None
    except ckptstore.StoreNotFound:
        pass
    L.seed_everything(0, workers=True)
    cb = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=2, save_last=True, monitor="train_loss", every_n_train_steps=8)
    trainer = L.Trainer(max_steps=args.steps, plugins=[CkptStoreCheckpointIO()], callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few-worker DataLoader and similar advice
        trainer.fit(Regressor(data_dir=pathlib.Path(ckpt_dir) / "data"), ckpt_path=resume)
    with ckptstore.Store.open(ckpt_dir) as store:
        latest = store.latest()
        if latest is not None and latest.step == trainer.global_step:  # the fit's last step is cut: the end
            store.mark_final()
    print(f"{'resumed from ' + resume if resume else 'fresh'}; finished at step {trainer.global_step}; "
          f"best {cb.best_model_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
