"""The Checkpointer's mirror tier (issue 21, second part): cuts committed locally reach a mirror store
behind the loop, the loop waits for it only at ``cut(final=True)`` and ``close()`` (bounded), a mirror
that is down costs no local cut and catches up, the local prune spares what the mirror still needs,
and a Checkpointer open uploads what the mirror lacks. Real stores: local directories, and moto."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptstore
from ckptstore import KeepLast, Store, StoreOptions, UsageError
from ckptstore.writer import Checkpointer
from ckptstore.writer import MirrorTimeout
from s3proxy import Rule
from writerkit import EventLog, assert_state_equal, check_store, clone_state, small_state, wait_until


def _ids(url: str, **kw) -> list[str]:
    with Store.open(url, readonly=True, **kw) as s:
        return [c.id for c in s.cuts()]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_cuts_reach_the_mirror_in_order_and_load_bitwise_from_it_alone(tmp_path: Path, mode: str) -> None:
    url, murl, log = str(tmp_path / "local"), str(tmp_path / "mirror"), EventLog()
    states = {}
    with Checkpointer(url, every=1, busy="wait", mode=mode, mirror=murl, on_event=log) as ck:
        for step in (1, 2):
            states[step] = clone_state(small_state(step))
            ck.maybe_cut(step, states[step])
        states[3] = clone_state(small_state(3))
        final = ck.cut(3, states[3], final=True)
        # cut(final=True) returned: the cut is on the mirror already, not only locally.
        assert final.id in _ids(murl)
    assert _ids(murl) == _ids(url)
    mirror = check_store(murl)
    for info in mirror.cuts():
        assert_state_equal(mirror.load(info.id), states[info.step])
    mirror.close()
    kinds = [(e["event"], e["step"]) for e in log.events if e["event"] in ("committed", "mirrored")]
    for step in (1, 2, 3):
        assert kinds.index(("committed", step)) < kinds.index(("mirrored", step))
    got = log.of("mirrored", step=3)[0]
    assert got["cut"] == final.id and got["bytes"] > 0 and got["seconds"] >= 0


def test_a_mirror_that_is_down_costs_no_local_cut_keeps_them_locally_and_catches_up(tmp_path: Path) -> None:
    # A file where the mirror's directory should be: every open of it fails (root or not), until it goes.
    blocker = tmp_path / "down"
    blocker.write_text("not a directory")
    url, murl, log = str(tmp_path / "local"), str(blocker / "mirror"), EventLog()
    with Checkpointer(url, every=1, busy="wait", mode="thread", keep=KeepLast(1), mirror=murl,
                      mirror_retry_s=0.05, on_event=log) as ck:
        for step in (1, 2, 3):
            ck.maybe_cut(step, small_state(step))
            log.wait_for("committed", step=step)
        log.wait_for("mirror-failed")
        assert not log.of("mirrored")
        # keep=KeepLast(1) would leave one cut: the two the mirror still needs are spared.
        assert len(_ids(url)) == 3
        blocker.unlink()
        for step in (1, 2, 3):
            log.wait_for("mirrored", step=step)
        ck.cut(4, small_state(4), final=True)
    failed = log.of("mirror-failed")[0]
    assert failed["error"] and failed["error_type"] and failed["retry_in"] > 0
    with Store.open(murl, readonly=True) as m:
        assert [c.step for c in m.cuts()] == [1, 2, 3, 4]
    # Once mirrored, the local prune goes on (after the final cut's commit: only it and step 3 are
    # left, step 3 because the final cut was still waiting for the mirror when the prune ran).
    assert {c.step for c in Store.open(url, readonly=True).cuts()} <= {3, 4}


def test_mirror_keep_prunes_the_mirror_and_a_backlog_skips_what_it_would_not_keep(tmp_path: Path) -> None:
    blocker = tmp_path / "down"
    blocker.write_text("")
    url, murl, log = str(tmp_path / "local"), str(blocker / "mirror"), EventLog()
    with Checkpointer(url, every=1, busy="wait", mode="thread", mirror=murl, mirror_keep=KeepLast(2),
                      mirror_retry_s=0.05, on_event=log) as ck:
        for step in (1, 2, 3, 4):
            ck.maybe_cut(step, small_state(step))
            log.wait_for("committed", step=step)
        blocker.unlink()
        log.wait_for("mirrored", step=4)
        ck.cut(5, small_state(5), final=True)
    with Store.open(murl, readonly=True) as m:
        assert [c.step for c in m.cuts()] == [4, 5]
    assert {e["step"] for e in log.of("mirror-skipped")} >= {1, 2}


def test_a_checkpointer_open_uploads_what_the_mirror_lacks(tmp_path: Path) -> None:
    # Cuts committed without their upload (as a trainer SIGKILLed after its local commit leaves them).
    url, murl, log = str(tmp_path / "local"), str(tmp_path / "mirror"), EventLog()
    with Store.open(url, create=True) as s:
        s.save(small_state(1), step=1)
        s.save(small_state(2), step=2)
    with Checkpointer(url, mode="thread", mirror=murl, on_event=log):
        log.wait_for("mirrored", step=2)
    assert _ids(murl) == _ids(url)
    assert [e["step"] for e in log.of("mirrored")] == [1, 2]


def test_a_mirror_timeout_is_a_named_error_and_everything_stays_committed_locally(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    murl, opts = s3_url
    s3_proxy.add(Rule("slowdown"))  # every request of the mirror: 503 SlowDown
    mopts = StoreOptions(storage_options=s3_proxy.options(opts), io_attempts=1, io_backoff_s=0.01)
    url, log = str(tmp_path / "local"), EventLog()
    ck = Checkpointer(url, mode="thread", mirror=murl, mirror_options=mopts, mirror_timeout=1.0,
                      mirror_retry_s=0.05, on_event=log)
    with pytest.raises(MirrorTimeout) as exc:
        ck.cut(1, small_state(1), final=True)
    assert "committed locally" in str(exc.value)
    with pytest.raises(MirrorTimeout):
        ck.close()
    assert log.of("mirror-failed")
    with Store.open(url, readonly=True) as s:
        assert [c.step for c in s.cuts()] == [1] and s.latest().final
    s3_proxy.clear()  # the mirror is back: the next open catches up
    log2 = EventLog()
    with Checkpointer(url, mode="thread", mirror=murl, mirror_options=mopts, on_event=log2):
        log2.wait_for("mirrored", step=1)
    store = Store.open(murl, readonly=True, options=StoreOptions(storage_options=opts))
    assert_state_equal(store.load(), small_state(1))
    store.close()


def test_a_group_checkpointer_with_a_mirror_needs_a_real_group_and_mirror_keep_needs_a_mirror(tmp_path: Path) -> None:
    # A group= Checkpointer mirrors (issue 21, several ranks: tests/ranks/test_mirror_checkpointer.py);
    # a group that is none is refused before anything is created.
    with pytest.raises(UsageError, match="torch.distributed"):
        Checkpointer(str(tmp_path / "a"), mode="thread", mirror=str(tmp_path / "m"), group=object())
    with pytest.raises(UsageError, match="mirror="):
        Checkpointer(str(tmp_path / "a"), mode="thread", mirror_keep=ckptstore.KeepLast(1))
    assert not (tmp_path / "a").exists()


def test_a_replaced_node_resumes_from_the_mirror_through_the_checkpointers_store_and_goes_on(tmp_path: Path) -> None:
    """The issue's own loop: ``restore(ck.store, fallback=True)`` takes the newest verified cut of either
    tier, so a node whose local tier is gone resumes from the mirror, and its next cuts reach both."""
    import shutil

    url, murl = str(tmp_path / "local"), str(tmp_path / "mirror")
    states = {step: clone_state(small_state(step)) for step in (1, 2, 3)}
    with Checkpointer(url, every=1, busy="wait", mode="thread", mirror=murl) as ck:
        for step in (1, 2):
            ck.maybe_cut(step, states[step])
        ck.cut(3, states[3], final=True)
    shutil.rmtree(url)  # the node is replaced: an empty local directory
    log = EventLog()
    with Checkpointer(url, every=1, busy="wait", mode="thread", mirror=murl, on_event=log) as ck:
        resumed = ckptstore.restore(ck.store, fallback=True, rng=False)  # the state's "rng" is plain data here
        assert resumed is not None and resumed.step == 3 and resumed.tier == "mirror"
        assert_state_equal(resumed.state, states[3])
        ck.cut(4, small_state(4), final=True)
    assert _ids(url)[-1] == _ids(murl)[-1] and [c.split("-")[1] for c in _ids(murl)][-2:] == ["000000000003",
                                                                                              "000000000004"]
