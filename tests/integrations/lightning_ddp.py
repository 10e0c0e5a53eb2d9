"""One rank of a Lightning DDP fit (gloo, CPU) whose checkpoints go through ``CkptStoreCheckpointIO``.

Run as ``python tests/integrations/lightning_ddp.py DIRPATH --out F --max-steps N [--ckpt-path P]`` with
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set as torchrun
sets them: Lightning then joins the job instead of launching processes itself
(``LightningEnvironment.creates_processes_externally``). ``Trainer(strategy="ddp", devices=WORLD_SIZE)``
fits a tiny MLP on 16 fixed samples (batch 2, shuffled by the DistributedSampler: 4 steps an epoch per
rank), with ``ModelCheckpoint(DIRPATH, save_top_k=2, save_last=True, every_n_train_steps=2)``; the
monitored loss is synced across ranks, so every rank's ModelCheckpoint keeps the same paths. Lightning
saves and removes from global rank 0 only; every rank loads ``--ckpt-path``.

Output: ``{"event": "done", "rank", "step"}`` once the end state is in ``--out`` (torch.save of the
model's state dict, the training steps this process ran, ModelCheckpoint's ``last_model_path`` and
``best_k_models`` names, the global step).

``python tests/integrations/lightning_ddp.py --serve`` imports Lightning once and forks the runs
(tests/integrations/forkkit.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptstore.integrations.lightning import CkptStoreCheckpointIO
from forkkit import say, serve

SAMPLES, BATCH = 16, 2


class TinyModule(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.calls = 0  # training steps this process ran: a resumed fit runs only the remaining ones

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.calls += 1
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # the same monitored value, so the same top-k, on every rank
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)}

    def train_dataloader(self):  # noqa: ANN201
        x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(1))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        # Lightning swaps in a DistributedSampler (seeded, set_epoch each epoch): the order of an epoch
        # depends on the epoch alone, so a resume at an epoch boundary replays the same batches.
        return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirpath")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-steps", type=int, required=True)
    ap.add_argument("--ckpt-path", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as under --serve: the same kernels, so the same bits, in every run
    cb = ModelCheckpoint(dirpath=args.dirpath, save_top_k=2, save_last=True, monitor="train_loss",
                         every_n_train_steps=2)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), num_nodes=1,
                        max_steps=args.max_steps, plugins=[CkptStoreCheckpointIO()], callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        num_sanity_val_steps=0)
    model = TinyModule()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few-worker DataLoader and similar advice
        trainer.fit(model, ckpt_path=args.ckpt_path)
    torch.save({"state_dict": model.state_dict(), "calls": model.calls, "global_step": trainer.global_step,
                "last": os.path.basename(cb.last_model_path),
                "best_k": sorted(os.path.basename(p) for p in cb.best_k_models)}, args.out)
    torch.distributed.barrier()  # rank 0 hosts the rendezvous store: it exits last
    say(event="done", rank=trainer.global_rank, step=trainer.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(serve(main) if sys.argv[1:] == ["--serve"] else main())
