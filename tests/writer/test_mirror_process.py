"""The mirror tier in the writer process (issue 21: "the upload runs in the writer process (niced),
never in the training loop"): the writer process holds the mirror and uploads; ``mirror_keep`` travels
as JSON and a policy that cannot is refused by name; a writer that dies takes nothing with it (the
next one looks at both stores again); a mirror that is down costs the local tier at most what
``mirror_keep`` keeps. Real local directories, real processes and signals."""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptstore import KeepEvery, KeepFinal, KeepLast, KeepTagged, Policy, Store, StoreOptions, UsageError, spi
from ckptstore.writer import Checkpointer
from writerkit import BOUND, EventLog, has_exited, small_state, wait_until


def _steps(url: str) -> list[int]:
    with Store.open(url, readonly=True) as s:
        return [c.step for c in s.cuts()]


def test_the_writer_process_holds_the_mirror_and_the_trainer_runs_no_upload_thread(tmp_path: Path) -> None:
    url, murl, log = str(tmp_path / "local"), str(tmp_path / "mirror"), EventLog()
    with Checkpointer(url, every=1, busy="wait", mirror=murl, on_event=log) as ck:
        ck.maybe_cut(1, small_state(1))
        log.wait_for("mirrored", step=1)
        # The mirror's writer lock is the writer process's, not the trainer's (WRITER.json names it).
        holder = json.loads((Path(murl) / "WRITER.json").read_text())
        assert holder["pid"] == ck.writer_pid != os.getpid()
        assert not [t for t in threading.enumerate() if t.name == "ckptstore-mirror"]
        ck.cut(2, small_state(2), final=True)
    assert _steps(murl) == [1, 2]
    assert [e["step"] for e in log.of("mirrored")] == [1, 2]  # the writer's events reach on_event


@pytest.mark.parametrize("policy", [KeepLast(3), KeepEvery(10) | KeepTagged("best", "x") | KeepFinal(),
                                    KeepLast(2) | (KeepEvery(5) | KeepFinal())])
def test_a_policy_travels_as_json_and_comes_back_equal(policy: Policy) -> None:
    doc = spi.policy_to_json(policy)
    assert spi.policy_from_json(json.loads(json.dumps(doc))) == policy


@dataclass(frozen=True)
class _Odd(Policy):
    def keep(self, cuts):  # type: ignore[no-untyped-def]
        return {c.id for c in cuts if c.step % 2}


def test_a_custom_mirror_keep_or_an_event_hook_is_refused_in_process_mode_by_name(tmp_path: Path) -> None:
    url, murl = str(tmp_path / "local"), str(tmp_path / "mirror")
    with pytest.raises(UsageError, match="_Odd is not one of ckptstore's policies"):
        Checkpointer(url, mirror=murl, mirror_keep=_Odd())
    with pytest.raises(UsageError, match="on_event"):
        Checkpointer(url, mirror=murl, mirror_options=StoreOptions(on_event=print))
    with pytest.raises(ValueError, match="not a policy"):
        spi.policy_from_json({"keep_last": "3"})
    # mode="thread" runs the tier here: any policy works.
    with Checkpointer(url, every=1, busy="wait", mode="thread", mirror=murl, mirror_keep=_Odd()) as ck:
        for step in (1, 2, 3):
            ck.maybe_cut(step, small_state(step))
        ck.cut(4, small_state(4), final=True)
    assert _steps(murl) == [1, 3, 4]  # _Odd's, and the mirror's LATEST


def test_a_writer_killed_between_cuts_loses_no_upload_the_next_writer_looks_again(tmp_path: Path) -> None:
    url, murl, log = str(tmp_path / "local"), str(tmp_path / "mirror"), EventLog()
    with Checkpointer(url, every=1, busy="wait", mirror=murl, on_event=log) as ck:
        ck.maybe_cut(1, small_state(1))
        log.wait_for("mirrored", step=1)
        first = ck.writer_pid
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: has_exited(first), what="the writer's death")
        ck.maybe_cut(2, small_state(2))  # written by the commit thread (fallback): the writer is dead
        log.wait_for("committed", step=2)
        # close() drains the mirror: a writer process is started for it, and its look at both stores
        # finds cut 2 (submitted while no writer ran).
    assert log.of("fallback")
    assert _steps(murl) == [1, 2]


def test_a_mirror_that_is_down_costs_the_local_tier_at_most_what_mirror_keep_keeps(tmp_path: Path) -> None:
    blocker = tmp_path / "down"
    blocker.write_text("not a directory")  # every open of the mirror fails until it goes
    url, murl, log = str(tmp_path / "local"), str(blocker / "mirror"), EventLog()
    with Checkpointer(url, every=1, busy="wait", keep=KeepLast(1), mirror=murl, mirror_keep=KeepLast(2),
                      mirror_retry_s=0.05, mirror_timeout=2 * BOUND, on_event=log) as ck:
        for step in range(1, 5):
            ck.maybe_cut(step, small_state(step))
            log.wait_for("committed", step=step)
        log.wait_for("mirror-failed")
        # Never reached, the mirror's content is unknown: the local prune spares what mirror_keep keeps
        # of the local cuts (two), not all four; keep=KeepLast(1) alone would leave one.
        wait_until(lambda: _steps(url) == [3, 4], what="the local prune after cut 4")
        blocker.unlink()
        ck.cut(5, small_state(5), final=True)
    assert _steps(murl) == [4, 5]
    # The last prune ran as cut 5 committed, with the writer's last word on what waits (3 and 4 then,
    # both kept by mirror_keep among the waiting) and 5 not yet seen there: it may spare all three.
    assert set(_steps(url)) <= {3, 4, 5}
    assert not [e for e in log.of("mirrored") if e["step"] < 3]


def test_the_gate_holds_an_upload_between_pieces_while_a_local_cut_is_written() -> None:
    from ckptstore.writer.gate import Gate

    gate, passed = Gate(), threading.Event()

    def piece() -> None:  # what the tier does after each piece it uploaded
        gate.wait_idle()
        passed.set()

    with gate.busy():
        t = threading.Thread(target=piece)
        t.start()
        assert not passed.wait(0.3)  # held while the write lasts
    assert passed.wait(BOUND)  # and let go once it ended
    t.join(BOUND)
    gate.wait_idle()  # idle: returns at once
