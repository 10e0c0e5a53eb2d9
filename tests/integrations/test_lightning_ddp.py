"""The Lightning plugin under DDP with two processes (gloo, CPU): global rank 0 writes, every rank
reads, and a fit resumed from ``last_model_path`` ends bit-identical to an uninterrupted one on both
ranks.

Lightning's strategies call ``CheckpointIO.save_checkpoint`` and ``remove_checkpoint`` on global rank 0
only (``Strategy.save_checkpoint``; FSDP, ModelParallel and DeepSpeed save sharded state without the
CheckpointIO), and ``load_checkpoint`` on every rank, then wait at a barrier
(``_CheckpointConnector.resume_end``) before training on. So rank 0 holds the store's writer lock and
the other ranks open it readonly, before rank 0 writes again (docs/integrations.md, Lightning,
"Several processes"). Runs of ``tests/integrations/lightning_ddp.py`` (its docstring has the fit):
phase one fits an uninterrupted 16-step reference and an 8-step first part together, phase two
resumes the first part to 16 steps in new processes from ``last.ckpt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.cli import main as cli  # noqa: E402

from .forkkit import Run, free_port, rank_env  # noqa: E402

WORLD = 2


def job(name: str, root: Path, dirpath: str, *flags: str) -> list[Run]:
    port = free_port()
    return [Run(f"{name}{r}", [dirpath, "--out", str(root / f"{name}-rank{r}.pt"), *flags],
                str(root / f"{name}-rank{r}.log"), rank_env(r, WORLD, port), out=str(root / f"{name}-rank{r}.pt"))
            for r in range(WORLD)]


@pytest.fixture(scope="module")
def fits(tmp_path_factory, lightning_server) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lightning-ddp")
    ref_dir, run_dir = str(root / "ref"), str(root / "run")
    ref = job("ref", root, ref_dir, "--max-steps", "16")
    first = job("first", root, run_dir, "--max-steps", "8")
    lightning_server.phase(*ref, *first)
    for run in (*ref, *first):
        assert run.returncode == 0, run.output[-4000:]
    resumed = job("resumed", root, run_dir, "--max-steps", "16", "--ckpt-path", os.path.join(run_dir, "last.ckpt"))
    lightning_server.phase(*resumed)
    return {"ref": [r.end_state() for r in ref], "first": [r.end_state() for r in first],
            "resumed": [r.end_state() for r in resumed], "run_dir": run_dir}


def test_a_ddp_fit_resumed_from_last_ckpt_ends_bitwise_like_an_uninterrupted_one_on_both_ranks(fits):
    for rank, (ref, got) in enumerate(zip(fits["ref"], fits["resumed"])):
        assert ref["calls"] == 16 and got["calls"] == 8, rank  # every rank really resumed at step 8
        assert got["global_step"] == 16
        assert list(ref["state_dict"]) == list(got["state_dict"])
        assert all(torch.equal(ref["state_dict"][k], got["state_dict"][k]) for k in ref["state_dict"]), rank
    a, b = (r["state_dict"] for r in fits["resumed"])
    assert all(torch.equal(a[k], b[k]) for k in a)  # DDP replicas
    first = fits["first"][0]["state_dict"]
    assert not all(torch.equal(first[k], a[k]) for k in a)  # the resumed part changed the weights


def test_the_store_holds_the_paths_every_rank_tracks_and_verifies(fits):
    run_dir = fits["run_dir"]
    assert not any(n.endswith(".ckpt") for n in os.listdir(run_dir))
    names = [{r["last"], *r["best_k"]} for r in fits["resumed"]]
    assert names[0] == names[1]  # ModelCheckpoint agrees on every rank (the monitored loss is synced)
    with ckptstore.Store.open(run_dir, readonly=True) as store:
        assert set(store.labels()) == names[0]
        assert store.cuts()[-1].step == store.latest().step == 16
        assert store.latest().id == store.labels()["last.ckpt"]
    assert cli(["verify", run_dir]) == 0
