"""The Lightning CheckpointIO plugin, with real Lightning fits (tiny model, random data, CPU)."""

from __future__ import annotations

import datetime
import os
import pathlib
import warnings

import pytest

pytest.importorskip("lightning")  # a test extra (pyproject); CI installs it

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.cli import main as cli  # noqa: E402
from ckptstore.integrations.lightning import CkptStoreCheckpointIO, load_checkpoint  # noqa: E402

STEPS_PER_EPOCH = 4


class TinyModule(L.LightningModule):
    def __init__(self, lr: float = 0.05, width: int = 8, data_dir: pathlib.Path = pathlib.Path("data"),
                 when: datetime.date = datetime.date(2026, 11, 30)) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.calls = 0  # training steps this process ran: a resumed fit runs only the remaining ones

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.calls += 1
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)}

    def train_dataloader(self):  # noqa: ANN201
        g = torch.Generator().manual_seed(1)
        x = torch.randn(STEPS_PER_EPOCH * 2, 4, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)


class ShiftedModule(TinyModule):
    """TinyModule with 8 steps an epoch and a hyperparameter that changes what every step learns: the
    optimizer's own settings (lr) would not, a resume restores them from the checkpoint."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return super().training_step((x, y + self.hparams.shift), batch_idx)

    def train_dataloader(self):  # noqa: ANN201
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()),
                                           batch_size=2, shuffle=False)


def _fit(dirpath: str, max_steps: int, ckpt_path: str | None = None, *, model: TinyModule | None = None,
         every: int = 2, top_k: int = 2, monitor: str | None = "train_loss") -> tuple[TinyModule, ModelCheckpoint]:
    cb = ModelCheckpoint(dirpath=dirpath, save_top_k=top_k, save_last=True, monitor=monitor,
                         every_n_train_steps=every)
    trainer = L.Trainer(max_steps=max_steps, plugins=[CkptStoreCheckpointIO()], callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        deterministic=True, num_sanity_val_steps=0)
    model = TinyModule() if model is None else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, cb


def _names(cb: ModelCheckpoint) -> set[str]:
    return {os.path.basename(p) for p in [*cb.best_k_models, cb.last_model_path]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    ref, ref_cb = _fit(str(root / "ref"), 16)
    first, first_cb = _fit(str(root / "run"), 8)
    last = first_cb.last_model_path
    resumed, resumed_cb = _fit(str(root / "run"), 16, ckpt_path=last)
    return {"root": root, "ref": ref, "ref_cb": ref_cb, "first_cb": first_cb, "last": last,
            "resumed": resumed, "resumed_cb": resumed_cb}


def test_a_fit_resumed_from_last_model_path_ends_bitwise_like_an_uninterrupted_one(runs):
    assert runs["ref"].calls == 16 and runs["resumed"].calls == 8  # really resumed at step 8
    ref, got = runs["ref"].state_dict(), runs["resumed"].state_dict()
    assert list(ref) == list(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    assert runs["ref_cb"].best_model_score == runs["resumed_cb"].best_model_score


def test_the_directory_is_a_store_whose_labels_are_the_paths_lightning_holds(runs):
    url = str(runs["root"] / "run")
    cb = runs["resumed_cb"]
    assert not any(n.endswith(".ckpt") for n in os.listdir(url))  # no checkpoint files: cuts
    with ckptstore.Store.open(url, readonly=True) as store:
        labels = store.labels()
        cuts = {c.id: c for c in store.cuts()}
        assert set(labels) == _names(cb)  # save_top_k=2 removed the rest: their labels and cuts
        assert set(labels.values()) <= set(cuts) and set(cuts) <= set(labels.values()) | {store.latest().id}
        assert cuts[labels["last.ckpt"]].step == 16 == store.latest().step  # one cut per step: labelled twice
        assert all("lightning" in c.tags for c in cuts.values())
    assert cli(["verify", url]) == 0


def test_load_checkpoint_outside_a_trainer_and_a_missing_name(runs):
    cb = runs["resumed_cb"]
    ckpt = load_checkpoint(cb.best_model_path)
    # hyperparameters of types Lightning users have (a Path, a date) come back as themselves, without pickle
    assert ckpt["hyper_parameters"] == {"lr": 0.05, "width": 8, "data_dir": pathlib.Path("data"),
                                        "when": datetime.date(2026, 11, 30)}
    assert type(ckpt["hyper_parameters"]["data_dir"]) is type(pathlib.Path("data"))
    model = TinyModule(**ckpt["hyper_parameters"])
    model.load_state_dict(ckpt["state_dict"])
    assert ckpt["global_step"] == int(os.path.basename(cb.best_model_path).split("step=")[1].split(".")[0])
    whole = load_checkpoint(os.path.dirname(cb.last_model_path))  # the store itself: its LATEST
    assert whole["global_step"] == 16
    with pytest.raises(FileNotFoundError, match="no checkpoint 'nope.ckpt'"):
        load_checkpoint(os.path.join(os.path.dirname(cb.last_model_path), "nope.ckpt"))


def test_resuming_from_an_older_path_and_training_on(runs, tmp_path):
    """best_model_path (older) while last is newer: the fit continues from it; LATEST moves back to it
    and the steps after it are saved again as new cuts; the store verifies."""
    url = str(runs["root"] / "run")
    with ckptstore.Store.open(url, readonly=True) as store:
        older = min((store.labels()[n], n) for n in store.labels() if n != "last.ckpt")
        older_step = next(c.step for c in store.cuts() if c.id == older[0])
    assert older_step < 16
    model, cb = _fit(url, 16, ckpt_path=os.path.join(url, older[1]))
    assert model.calls == 16 - older_step
    with ckptstore.Store.open(url, readonly=True) as store:
        latest = store.latest()
        assert latest.step == 16 and store.labels()["last.ckpt"] == latest.id
        assert set(store.labels()) == _names(cb)
    ref = runs["ref"].state_dict()
    assert all(torch.equal(ref[k], v) for k, v in model.state_dict().items())  # same steps, same result
    assert cli(["verify", url]) == 0


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fit_resumed_from_an_older_step_saves_latests_step_again_with_its_own_weights(tmp_path):
    """Issue 19 item 1: a first fit saves steps 4 and 8; a second resumes from step 4 with another
    hyperparameter and trains to 8. Its step-8 save is a new cut (it only labelled the first fit's),
    so both names of step 8 load the second fit's weights; the first fit's step-8 cut, left without a
    name, goes; a save at the end step after the fit is still one more name of that cut."""
    url = str(tmp_path / "run")
    first, _ = _fit(url, 8, model=ShiftedModule(shift=0.0), every=4, top_k=-1, monitor=None)
    with ckptstore.Store.open(url, readonly=True) as store:
        old = store.labels()
    assert old["epoch=0-step=8.ckpt"] == old["last.ckpt"] != old["epoch=0-step=4.ckpt"]  # one cut a step
    second, _ = _fit(url, 8, ckpt_path=os.path.join(url, "epoch=0-step=4.ckpt"), model=ShiftedModule(shift=1.0),
                     every=4, top_k=-1, monitor=None)
    assert second.calls == 4 and not _same(first.state_dict(), second.state_dict())  # really another fit
    for name in ("epoch=0-step=8.ckpt", "last.ckpt"):
        ckpt = load_checkpoint(os.path.join(url, name))
        assert ckpt["global_step"] == 8 and ckpt["hyper_parameters"]["shift"] == 1.0, name
        assert _same(ckpt["state_dict"], second.state_dict()), name
    second.trainer.save_checkpoint(os.path.join(url, "final.ckpt"))  # same fit, same step: a name, no cut
    with ckptstore.Store.open(url, readonly=True) as store:
        labels, latest = store.labels(), store.latest()
        assert labels["epoch=0-step=8.ckpt"] == labels["last.ckpt"] == labels["final.ckpt"] == latest.id
        assert latest.id != old["last.ckpt"] and labels["epoch=0-step=4.ckpt"] == old["epoch=0-step=4.ckpt"]
        assert {c.id for c in store.cuts()} == {old["epoch=0-step=4.ckpt"], latest.id}  # the first 8 went
    assert cli(["verify", url]) == 0


def test_a_fresh_fit_saving_latests_step_into_a_store_it_did_not_resume_from_is_refused(tmp_path):
    """Issue 19 item 1: a fit that did not resume from this store and saves at LATEST's step is not
    the fit that wrote LATEST: StepConflict naming the store, not a label on another fit's weights."""
    url = str(tmp_path / "run")
    first, _ = _fit(url, 8, model=ShiftedModule(shift=0.0), every=8, top_k=-1, monitor=None)
    with pytest.raises(ckptstore.StepConflict, match="without having resumed") as info:
        _fit(url, 8, model=ShiftedModule(shift=1.0), every=8, top_k=-1, monitor=None)
    assert info.value.store == url
    ckpt = load_checkpoint(os.path.join(url, "last.ckpt"))  # the first fit's step 8, untouched
    assert ckpt["hyper_parameters"]["shift"] == 0.0 and _same(ckpt["state_dict"], first.state_dict())
    assert cli(["verify", url]) == 0


def test_a_resume_from_the_store_directory_stands_on_its_latest_cut(tmp_path):
    """ckpt_path may be the store itself: the fit stands on LATEST's cut, so a save at its step is one
    more name of it (issue 19 item 1's rule), neither a second cut nor a StepConflict."""
    url = str(tmp_path / "run")
    _fit(url, 8, model=ShiftedModule(), every=8, top_k=-1, monitor=None)
    io = CkptStoreCheckpointIO()
    ckpt = io.load_checkpoint(url)
    io.save_checkpoint(ckpt, os.path.join(url, "again.ckpt"))
    io.teardown()
    with ckptstore.Store.open(url, readonly=True) as store:
        assert store.labels()["again.ckpt"] == store.labels()["last.ckpt"] == store.latest().id
        assert len(store.cuts()) == 1


def test_removing_a_name_from_a_directory_without_a_store_creates_nothing(tmp_path):
    io = CkptStoreCheckpointIO()
    io.remove_checkpoint(str(tmp_path / "never-saved" / "epoch=0-step=4.ckpt"))
    io.teardown()
    assert not (tmp_path / "never-saved").exists()
