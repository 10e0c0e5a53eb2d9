"""The Hugging Face Trainer integration resumes bitwise-exactly across a SIGKILL and a new process.

Three runs of ``tests/integrations/hf_trainer.py`` (16 steps, a cut every 4, the last one final) start
together: an uninterrupted reference, one SIGKILLed at step 10 between cuts (the cut of step 8 is
committed: the resume replays steps 9-10 from the middle of the second epoch), and one SIGKILLed right
after the Checkpointer took step 12's cut and before it committed (the writer process finishes it
alone; the resume starts at the epoch boundary, or from step 8 should the rescue not have committed).
Both killed stores are then resumed in new processes, together. The runs are forked by
``hf_trainer.py --serve`` after it imported transformers once (tests/integrations/forkkit.py, the
``hf_server`` fixture of conftest.py): separate processes that share only imported code, and the test
stays within about 40 s on two shared cores. The resumed runs must end with the
reference's model parameters, optimizer and scheduler state, RNG states and per-step losses
(``state.log_history``), float for float; the stores must report the run finished at step 16.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it on torch (transformers[torch])

from ckptstore import Store, load  # noqa: E402
from statekit import assert_bitwise, resume_info  # noqa: E402

from prockit import wait_gone  # noqa: E402

from .forkkit import Run, Server  # noqa: E402

MAX_STEPS, EVERY = 16, 4
KILL_BETWEEN, KILL_MID_CUT = 10, 12


def hf_run(run_id: str, url: str, out: str, *flags: str, env: dict[str, str] | None = None) -> Run:
    """A run of hf_trainer.py: its JSON events in ``out + ".log"``, its end state in ``out``."""
    return Run(run_id, [url, "--out", out, *flags], out + ".log", env, out=out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_server) -> dict[str, Any]:
    return _run_all(tmp_path_factory.mktemp("hf"), hf_server)


def _run_all(root: Path, server: Server) -> dict[str, Any]:
    url = {k: str(root / f"{k}-store") for k in ("ref", "between", "midcut")}
    ref = hf_run("ref", url["ref"], str(root / "ref.pt"))
    killed = {"between": hf_run("between", url["between"], str(root / "between-killed.pt"),
                                "--kill-between", str(KILL_BETWEEN)),
              "midcut": hf_run("midcut", url["midcut"], str(root / "midcut-killed.pt"),
                               "--kill-mid-cut", str(KILL_MID_CUT))}
    server.phase(ref, *killed.values())
    after_kill: dict[str, Any] = {}
    for k, r in killed.items():
        kill = r.of("kill")
        assert kill, f"{k} run was not killed: {r.returncode}\n{r.output[-3000:]}"
        wait_gone(kill[0]["writer_pid"])  # a rescue in progress holds the writer lock until it has committed
        with Store.open(url[k], readonly=True) as s:
            after_kill[k] = {"latest": s.latest(), "cuts": s.cuts(), "verify": s.verify()}
        code, after_kill[k]["resume_info"] = resume_info(url[k])
        assert code == 0, after_kill[k]["resume_info"]
    resumed = {k: hf_run(f"{k}-resumed", url[k], str(root / f"{k}-resumed.pt")) for k in killed}
    server.phase(*resumed.values())
    return {"ref": ref, "killed": killed, "after_kill": after_kill, "resumed": resumed, "url": url}


def test_reference_run_cuts_periodically_and_ends_with_a_final_cut_of_its_last_step(runs):
    ref = runs["ref"]
    assert ref.returncode == 0, ref.output[-3000:]
    assert ref.of("start") == [{"event": "start", "resume_step": None}]
    with Store.open(runs["url"]["ref"], readonly=True) as s:
        cuts = s.cuts()
    # busy="wait": no periodic cut is skipped; the last step is a final cut, never a periodic one too.
    assert [(c.step, c.final) for c in cuts] == [(4, False), (8, False), (12, False), (16, True)]
    code, doc = resume_info(runs["url"]["ref"])
    assert code == 0, doc
    assert doc["resume_step"] == MAX_STEPS and doc["finished"] is True and doc["healthy"] is True


def test_run_killed_between_cuts_leaves_the_previous_cut(runs):
    killed = runs["killed"]["between"]
    assert killed.returncode == -signal.SIGKILL, killed.output[-3000:]
    assert killed.of("kill") == [{"event": "kill", "step": KILL_BETWEEN, "handle_step": 8,
                                  "handle_state": "committed", "writer_pid": killed.of("kill")[0]["writer_pid"]}]
    after = runs["after_kill"]["between"]
    assert after["latest"].step == 8 and not after["latest"].final and after["verify"].ok
    doc = after["resume_info"]
    assert doc["resume_step"] == 8 and doc["finished"] is False and doc["healthy"] is True


def test_run_killed_mid_cut_is_finished_by_its_writer_or_left_at_the_previous_cut(runs):
    killed = runs["killed"]["midcut"]
    assert killed.returncode == -signal.SIGKILL, killed.output[-3000:]
    (kill,) = killed.of("kill")
    assert kill["step"] == kill["handle_step"] == KILL_MID_CUT
    assert kill["handle_state"] in ("writing", "committing"), kill  # handed over, not yet committed
    after = runs["after_kill"]["midcut"]
    assert after["latest"].step in (8, KILL_MID_CUT) and not after["latest"].final and after["verify"].ok
    assert max(c.step for c in after["cuts"]) == after["latest"].step
    assert after["resume_info"]["resume_step"] == after["latest"].step


@pytest.mark.parametrize("kind", ["between", "midcut"])
def test_resumed_run_starts_from_the_latest_cut_and_ends_finished(runs, kind):
    resumed = runs["resumed"][kind]
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.of("start")[0]["resume_step"] == runs["after_kill"][kind]["latest"].step
    assert resumed.of("done") == [{"event": "done", "step": MAX_STEPS}]
    with Store.open(runs["url"][kind], readonly=True) as s:
        latest, cuts = s.latest(), s.cuts()
    assert latest.step == MAX_STEPS and latest.final and [c.step for c in cuts if c.final] == [MAX_STEPS]
    code, doc = resume_info(runs["url"][kind])  # the step where the run ended: never MAX_STEPS + 1
    assert code == 0, doc
    assert doc["resume_step"] == MAX_STEPS and doc["finished"] is True and doc["healthy"] is True


@pytest.mark.parametrize("kind", ["between", "midcut"])
def test_resumed_run_ends_bitwise_identical_to_the_uninterrupted_run(runs, kind):
    ref, got = runs["ref"].end_state(), runs["resumed"][kind].end_state()
    # Every step's loss, the same float: log_history came back with the cut, and the replayed steps
    # saw the same batches, dropout masks and learning rates.
    assert [s for s, _ in ref["losses"]] == list(range(1, MAX_STEPS + 1))
    assert got["losses"] == ref["losses"]
    assert got["global_step"] == ref["global_step"] == MAX_STEPS
    for key in ("model", "optimizer", "scheduler", "rng"):
        assert_bitwise(ref[key], got[key], key)


def test_the_resumed_part_changes_the_state(runs):
    """Guards the comparison: the cut the 'between' run resumed from differs from the end state."""
    at_cut = load(runs["url"]["between"], 8, keys=["model", "step"])
    ref = runs["ref"].end_state()
    assert at_cut["step"] == 8
    assert not all(torch.equal(v, ref["model"][k]) for k, v in at_cut["model"].items())


def test_resume_dir_is_none_without_a_cut_and_refuses_foreign_cuts_and_busy_dirs(tmp_path):
    from ckptstore import CutNotFound, UsageError
    from ckptstore.integrations.transformers import resume_dir

    url = str(tmp_path / "store")
    assert resume_dir(url) is None  # no store yet: a fresh run
    with Store.open(url, create=True) as s:
        assert resume_dir(s) is None  # a store without cuts
        s.save({"model": {"w": torch.zeros(2)}, "step": 3}, step=3)
    with pytest.raises(CutNotFound, match="not written by CkptStoreCallback"):
        resume_dir(url)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "pytorch_model.bin").write_bytes(b"stale")
    with pytest.raises(UsageError, match="missing or empty directory"):
        resume_dir(url, dir=str(busy))
