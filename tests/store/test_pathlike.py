"""Every public API that takes a store URL takes an ``os.PathLike`` too (issue 19 item 11:
``restore(pathlib.Path(...))`` raised AttributeError and ``load(pathlib.Path(...))`` TypeError), and a
URL of any other type is a ``UsageError`` naming it, never a raw TypeError from deep inside.

The APIs, one test each: ``Store.open`` (writer, readonly, ``group=`` of one), ``load``, ``restore``,
the ``Checkpointer``, ``export_cut``'s output path, DCP's ``StoreWriter``/``StoreReader`` (and DCP's
``checkpoint_id``), the Lightning plugin and ``load_checkpoint``, the transformers callback and
``resume_dir``; ``ckptstore.storage.open_storage`` underneath them all."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ckptstore
from ckptstore import Store, UsageError
from ckptstore.export import export_cut
from ckptstore.storage import open_storage
from ckptstore.writer import Checkpointer


class Where(os.PathLike):
    """An os.PathLike that is not a pathlib.Path, whose ``str()`` is not its path: only
    ``os.fspath`` gives the right directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return f"<somewhere near {self.path.name}>"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": nn.Linear(4, 3).state_dict(), "step": seed}


@pytest.mark.parametrize("wrap", [Path, Where], ids=["Path", "PathLike"])
def test_store_open_load_and_restore_take_a_path(root: Path, wrap) -> None:
    with Store.open(wrap(root), create=True) as store:
        assert store.url == str(root)
        store.save(model_state(1), step=1)
    with Store.open(wrap(root), readonly=True) as ro:
        assert ro.url == str(root) and ro.latest().step == 1
    assert torch.equal(ckptstore.load(wrap(root))["model"]["weight"], model_state(1)["model"]["weight"])
    model = nn.Linear(4, 3)
    resumed = ckptstore.restore(wrap(root), model=model, rng=False)
    assert resumed is not None and resumed.step == 1
    assert torch.equal(model.weight, model_state(1)["model"]["weight"])
    assert ckptstore.restore(wrap(root.parent / "fresh"), fallback=True) is None  # created, empty


def test_store_open_with_a_group_of_one_takes_a_path(root: Path) -> None:
    import torch.distributed as dist

    store_addr = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store_addr, rank=0, world_size=1)
    try:
        with Store.open(root, create=True, group=dist.group.WORLD) as store:
            assert store.url == str(root)
            store.save({"x": np.arange(3)}, step=1)
    finally:
        dist.destroy_process_group()
    assert ckptstore.load(root)["x"].tolist() == [0, 1, 2]


def test_the_checkpointer_takes_a_path(root: Path) -> None:
    with Checkpointer(root, every=1, mode="thread") as ck:
        assert ck.store.url == str(root)
        ck.cut(1, {"x": torch.arange(4.0)}, final=True).wait(60)
    assert torch.equal(ckptstore.load(root)["x"], torch.arange(4.0))


def test_export_takes_a_path(root: Path, tmp_path: Path) -> None:
    with Store.open(root, create=True) as store:
        store.save({"x": torch.arange(4.0)}, step=1)
        export_cut(store, "latest", tmp_path / "out.safetensors", fmt="safetensors")
    import safetensors.torch

    assert torch.equal(next(iter(safetensors.torch.load_file(tmp_path / "out.safetensors").values())),
                       torch.arange(4.0))


def test_dcp_writer_and_reader_take_a_path(root: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreReader, StoreWriter

    state = model_state(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        with StoreWriter(root, step=3) as w:
            dcp.save({"model": state["model"]}, storage_writer=w)
        with StoreWriter(root.parent / "unused", step=4) as w:  # DCP's checkpoint_id replaces it (reset)
            dcp.save({"model": state["model"]}, storage_writer=w, checkpoint_id=root)
        fresh = {"model": nn.Linear(4, 3).state_dict()}
        dcp.load(fresh, storage_reader=StoreReader(root))
    assert torch.equal(fresh["model"]["weight"], state["model"]["weight"])
    assert [c.step for c in Store.open(root, readonly=True).cuts()] == [3, 4]


def test_the_lightning_plugin_takes_paths(root: Path) -> None:
    pytest.importorskip("lightning")
    from ckptstore.integrations.lightning import CkptStoreCheckpointIO, load_checkpoint

    io = CkptStoreCheckpointIO()
    try:
        io.save_checkpoint({"global_step": 2, "state_dict": model_state(2)["model"]}, root / "last.ckpt")
        assert io.load_checkpoint(root / "last.ckpt")["global_step"] == 2
        io.remove_checkpoint(root / "other.ckpt")  # no such name: nothing happens
    finally:
        io.teardown()
    assert load_checkpoint(root / "last.ckpt")["global_step"] == 2
    assert load_checkpoint(root)["global_step"] == 2


def test_the_transformers_callback_and_resume_dir_take_paths(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckptstore.integrations.transformers import CkptStoreCallback, resume_dir

    callback = CkptStoreCallback(root, mode="thread")
    callback.on_train_begin(TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[]), TrainerState(),
                            TrainerControl())
    try:
        assert callback.checkpointer is not None and callback.checkpointer.store.url == str(root)
    finally:
        callback.checkpointer.close()
    assert resume_dir(root, dir=str(tmp_path / "ckpt")) is None  # the store has no cut yet


def test_open_storage_takes_a_path(root: Path) -> None:
    root.mkdir()
    assert open_storage(Where(root)).url == str(root)


@pytest.mark.parametrize("bad", [None, 7, b"/tmp/store", ["/tmp/store"]], ids=["None", "int", "bytes", "list"])
def test_a_url_of_another_type_is_a_usage_error_naming_it(bad) -> None:
    for call in (lambda: Store.open(bad, create=True), lambda: ckptstore.load(bad),
                 lambda: ckptstore.restore(bad), lambda: Checkpointer(bad, mode="thread")):
        with pytest.raises(UsageError) as ei:
            call()
        assert "str or os.PathLike" in ei.value.message and repr(bad)[:20] in ei.value.message
