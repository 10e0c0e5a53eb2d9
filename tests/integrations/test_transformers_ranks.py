"""The Hugging Face integration with ``group=``: a two-process DDP Trainer (gloo, CPU) cuts one cut of
both ranks, is SIGKILLed whole, and resumes bitwise-exactly on every rank, each rank's RNG from its
own part.

Runs of ``tests/integrations/hf_trainer.py --group`` (16 steps, a cut every 4, the last one final; two
ranks, each its own process with torchrun's environment, 3 steps an epoch per rank). Each rank draws
``rank + 1`` extra numbers per forward, so the ranks' RNG streams (dropout masks) differ. Phase one
runs an uninterrupted reference job and a job whose ranks are SIGKILLed together at step 10 (step 8's
cut committed: the resume replays steps 9-10 from the middle of an epoch); phase two resumes the
killed job in new processes. Every rank of the resumed job must end with the reference's parameters,
optimizer and scheduler state, losses and RNG states of the same rank, bit for bit.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ckptstore import Store  # noqa: E402
from ckptstore.integrations.transformers import CUT_KEYS, RANK_PART_KEYS, resume_dir  # noqa: E402
from statekit import assert_bitwise, resume_info  # noqa: E402

from prockit import wait_gone  # noqa: E402

from .forkkit import Run, free_port, rank_env  # noqa: E402
from .test_transformers import hf_run  # noqa: E402

WORLD, MAX_STEPS, KILL_AT = 2, 16, 10


def job(name: str, root: Path, url: str, *flags: str) -> list[Run]:
    """The ranks of one job: a run each, with torchrun's environment and a rendezvous port of the job's own."""
    port = free_port()
    return [hf_run(f"{name}{r}", url, str(root / f"{name}-rank{r}.pt"), "--group", *flags, env=rank_env(r, WORLD, port))
            for r in range(WORLD)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, hf_server) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf-ddp")
    url = {"ref": str(root / "ref-store"), "killed": str(root / "killed-store")}
    ref = job("ref", root, url["ref"])
    killed = job("killed", root, url["killed"], "--kill-between", str(KILL_AT))
    hf_server.phase(*ref, *killed)
    for run in killed:
        kill = run.of("kill")
        assert kill, f"{run.id} was not killed: {run.returncode}\n{run.output[-3000:]}"
        wait_gone(kill[0]["writer_pid"])  # rank 0's writer holds the store's lock until it exited
    with Store.open(url["killed"], readonly=True) as s:
        after_kill = {"latest": s.latest(), "world_size": s.manifest().world_size, "verify": s.verify()}
    resumed = job("resumed", root, url["killed"])
    hf_server.phase(*resumed)
    return {"root": root, "url": url, "ref": ref, "killed": killed, "after_kill": after_kill, "resumed": resumed}


def test_every_rank_of_the_killed_job_died_at_the_same_step_after_a_cut_of_both_ranks(ddp):
    for run in ddp["killed"]:
        assert run.returncode == -signal.SIGKILL, run.output[-3000:]
        (kill,) = run.of("kill")
        assert (kill["step"], kill["handle_step"], kill["handle_state"]) == (KILL_AT, 8, "committed")
    after = ddp["after_kill"]
    assert after["latest"].step == 8 and after["world_size"] == WORLD and after["verify"].ok


def test_reference_store_holds_one_cut_of_both_ranks_per_cut_step_rank_0_the_whole_state(ddp):
    url = ddp["url"]["ref"]
    with Store.open(url, readonly=True) as s:
        assert [(c.step, c.final) for c in s.cuts()] == [(4, False), (8, False), (12, False), (16, True)]
        assert s.manifest().world_size == WORLD
        parts = [s.load(rank=r) for r in range(WORLD)]
    assert set(CUT_KEYS) <= set(parts[0]) and tuple(parts[1]) == RANK_PART_KEYS
    assert not any(k.startswith("module.") for k in parts[0]["model"])  # the model, not its DDP wrapper
    # Guards the test's meaning: the ranks' RNG streams differ, so restoring the wrong part would show.
    assert not torch.equal(parts[0]["trainer_rng"]["cpu"], parts[1]["trainer_rng"]["cpu"])
    code, doc = resume_info(url)
    assert code == 0 and doc["resume_step"] == MAX_STEPS and doc["finished"] is True, doc


def test_resumed_job_ends_bitwise_identical_to_the_reference_on_every_rank(ddp):
    for ref_run, got_run in zip(ddp["ref"], ddp["resumed"]):
        assert got_run.of("start")[0]["resume_step"] == 8
        ref, got = ref_run.end_state(), got_run.end_state()
        assert ref["rank"] == got["rank"]
        assert [s for s, _ in ref["losses"]] == list(range(1, MAX_STEPS + 1)) and got["losses"] == ref["losses"]
        for key in ("model", "optimizer", "scheduler", "rng"):
            assert_bitwise(ref[key], got[key], f"rank {ref['rank']} {key}")
    ranks = [r.end_state() for r in ddp["resumed"]]
    assert_bitwise(ranks[0]["model"], ranks[1]["model"], "DDP replicas")
    assert not torch.equal(ranks[0]["rng"]["torch"], ranks[1]["rng"]["torch"])  # each rank's own stream
    code, doc = resume_info(ddp["url"]["killed"])
    assert code == 0 and doc["resume_step"] == MAX_STEPS and doc["finished"] is True, doc


def test_resume_dir_writes_the_shared_files_once_and_each_ranks_rng_file(ddp, tmp_path):
    url = ddp["url"]["ref"]
    every = resume_dir(url, 8, str(tmp_path / "every"))
    one = resume_dir(url, 8, str(tmp_path / "one"), rank=1)
    assert {f for f in os.listdir(every) if f.startswith("rng_state")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert {f for f in os.listdir(one) if f.startswith("rng_state")} == {"rng_state_1.pth"}
    assert "model.safetensors" in os.listdir(one) and "trainer_state.json" in os.listdir(one)
    with Store.open(url, readonly=True) as s:
        part1 = s.load(8, rank=1)
    got = torch.load(os.path.join(one, "rng_state_1.pth"), weights_only=False)
    assert_bitwise(part1["trainer_rng"]["cpu"], got["cpu"], "rank 1 cpu RNG")
    outside = resume_dir(url, 8, str(tmp_path / "outside"), rank=WORLD)  # a rank the cut does not hold
    assert not any(f.startswith("rng_state") for f in os.listdir(outside))


def test_group_needs_torch_distributed_before_anything_is_opened(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckptstore import UsageError
    from ckptstore.integrations.transformers import CkptStoreCallback

    saver = CkptStoreCallback(str(tmp_path / "store"), group=object())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    with pytest.raises(UsageError, match="needs torch.distributed to be initialized"):
        saver.on_train_begin(args, TrainerState(), TrainerControl())
    assert saver.checkpointer is None and not (tmp_path / "store").exists()
