"""The Checkpointer facade: construction, maybe_cut/cut/close, handles, retention, events."""

from __future__ import annotations

import os

import pytest

from ckptstore import CutInfo, KeepLast, Store, StepConflict, UsageError
from ckptstore.writer import Checkpointer, CutHandle
from ckptstore.writer.shm import leftover_segments
from writerkit import BOUND, EventLog, check_store, has_exited, read_jsonl, small_state, wait_until


@pytest.mark.parametrize("mode", ["process", "thread", "inline"])
def test_creates_store_cuts_every_k_and_keeps_last_n(url, mode):
    assert not os.path.exists(url)
    with Checkpointer(url, every=3, keep=KeepLast(2), mode=mode) as ck:
        assert os.path.exists(os.path.join(url, "STORE.json"))
        handles = {}
        for step in range(1, 13):
            h = ck.maybe_cut(step, small_state(step))
            if step % 3 == 0:
                assert isinstance(h, CutHandle), step
                info = h.wait(BOUND)  # waiting on each keeps busy="skip" from skipping the next one
                assert isinstance(info, CutInfo) and info.step == step and not info.final
                assert h.state == "committed"
                handles[step] = h
            else:
                assert h is None, step
        assert sorted(handles) == [3, 6, 9, 12]
    # Pruning runs after a cut is committed, so the retained set is checked once close() drained it.
    store = check_store(url)
    assert [c.step for c in store.cuts()] == [9, 12]
    assert store.latest().id == handles[12].id


def test_final_cut_waits_and_is_marked_final(url):
    with Checkpointer(url, every=100) as ck:
        assert ck.maybe_cut(5, small_state()) is None  # not due
        h = ck.cut(5, small_state(5), final=True)  # due or not, and returns committed
        assert h.state == "committed"
        info = h.wait(0)
        assert info.final is True and info.step == 5
    store = check_store(url)
    assert store.latest().final is True
    assert store.manifest("latest").final is True


def test_mark_final_marks_the_last_periodic_cut_without_writing_it_again(url):
    """A loop whose last periodic cut holds its final state (step 6 of 6): mark_final waits for that cut
    to commit and marks it final, so resume-info says the run finished at 6 (not at a cut of step 7)."""
    with Checkpointer(url, every=3, busy="wait") as ck:
        for step in range(1, 7):
            ck.maybe_cut(step, small_state(step))
        with pytest.raises(StepConflict, match="not step 7"):
            ck.mark_final(7)
        info = ck.mark_final(6)
        assert info.step == 6 and info.final
    store = check_store(url)
    assert [(c.step, c.final) for c in store.cuts()] == [(3, False), (6, True)]
    assert store.manifest("latest").final is False  # the manifest as committed: the mark is beside it


def test_uses_a_given_store_and_leaves_it_open(url):
    store = Store.open(url, create=True)
    try:
        with Checkpointer(store, every=1, mode="thread") as ck:
            assert ck.store is store
            ck.cut(1, small_state(1)).wait(BOUND)
        # The Checkpointer does not own it: the store is still usable as a writer afterwards.
        info = store.save(small_state(2), step=2)
        assert [c.step for c in store.cuts()] == [1, 2] and store.latest().id == info.id
    finally:
        store.close()


def test_refuses_a_readonly_store(url):
    Store.open(url, create=True).close()
    ro = Store.open(url, readonly=True)
    with pytest.raises(UsageError, match="for writing"):
        Checkpointer(ro)


def test_context_manager_closes_writer_and_block(url):
    with Checkpointer(url, every=1) as ck:
        ck.cut(1, small_state()).wait(BOUND)
        pid = ck.writer_pid
        assert pid is not None and not has_exited(pid)
        assert leftover_segments(os.getpid())
    wait_until(lambda: has_exited(pid), what=f"writer {pid} exit after close")
    assert leftover_segments(os.getpid()) == []
    with pytest.raises(UsageError, match="closed"):
        ck.maybe_cut(2, small_state())
    ck.close()  # idempotent


def test_steps_must_increase_also_across_restarts(url):
    with Checkpointer(url, every=1, mode="thread") as ck:
        ck.cut(10, small_state()).wait(BOUND)
        with pytest.raises(StepConflict):
            ck.cut(10, small_state())
        with pytest.raises(UsageError):
            ck.cut(-1, small_state())
    with Checkpointer(url, every=1, mode="inline") as ck:  # a new Checkpointer learns LATEST's step
        with pytest.raises(StepConflict):
            ck.maybe_cut(10, small_state())
        assert ck.cut(11, small_state()).wait(BOUND).step == 11


@pytest.mark.parametrize("mode", ["process", "thread", "inline"])
def test_every_cut_emits_captured_written_committed_to_callback_and_file(url, tmp_path, mode):
    log = EventLog()
    path = tmp_path / "events.jsonl"
    with Checkpointer(url, every=2, mode=mode, on_event=log, events_path=str(path)) as ck:
        ids = {}
        for step in (2, 4, 6):
            ids[step] = ck.maybe_cut(step, small_state(step)).id
            log.wait_for("committed", step=step)
    from_file = read_jsonl(path)
    assert from_file == [dict(e) for e in log.events]  # the same events, in the same order, as JSON
    for step, cut in ids.items():
        kinds = [e["event"] for e in from_file if e.get("cut") == cut]
        assert kinds == ["captured", "written", "committed"], kinds
        cap, wr, com = (next(e for e in from_file if e.get("cut") == cut and e["event"] == k)
                        for k in ("captured", "written", "committed"))
        for e in (cap, wr, com):
            assert e["step"] == step and e["store"] == os.path.abspath(url) and e["writer_mode"] == mode
            assert isinstance(e["ts"], float)
        assert cap["capture_mode"] == "cpu-copy" and cap["capture_reason"]
        assert cap["bytes"] > 0 and cap["tensors"] == 7 and cap["stall_s"] >= 0
        assert cap["skipped_total"] == 0 and cap["waited_total"] == 0
        assert wr["bytes"] >= cap["bytes"] and wr["fallback"] is None
        assert {"hash", "write", "fsync", "total"} <= set(wr["timings"])
        assert com["bytes"] == wr["bytes"] and com["final"] is False and com["fallback"] is None
        assert com["timings"]["total"] >= com["timings"]["commit"] >= 0
        assert com["bytes"] == check_store(url).manifest(cut).nbytes


def test_a_step_out_of_bounds_is_the_same_usage_error_on_every_path(url):
    """Issue 20: maybe_cut(10**12) raised a raw ValueError, and save, the Checkpointer, ranked cuts and
    the DCP writer had different bounds. One check now (layout.check_step), naming the store."""
    from ckptstore.integrations.dcp import StoreWriter

    with Checkpointer(url, every=1, mode="inline") as ck:
        for bad in (10**12, -1, True, 1.0):
            with pytest.raises(UsageError, match=r"step must be an int in \[0, 999999999999\]") as err:
                ck.maybe_cut(bad, {"a": 1})
            assert err.value.store == ck.store.url
        ck.cut(10**12 - 1, {"a": 1}).wait(BOUND)  # the largest step a cut id holds
    with Store.open(url) as store:
        with pytest.raises(UsageError, match="step must be an int in"):
            store.save({"a": 1}, step=10**12)
    with pytest.raises(UsageError, match="step must be an int in"):
        StoreWriter(url, 10**12)


def test_options_and_their_keywords_together_are_refused(url):
    """Issue 20: Checkpointer(options=..., every=...) silently ignored every, keep, mode and busy."""
    from ckptstore.writer import WriterOptions

    with pytest.raises(UsageError, match=r"not both: \['every', 'mode'\]"):
        Checkpointer(url, options=WriterOptions(), every=5, mode="inline")
    with pytest.raises(UsageError, match="every must be >= 1"):
        Checkpointer(url, every=0)
    with pytest.raises(UsageError, match="unexpected keyword"):
        Checkpointer(url, evrey=5)
    with Checkpointer(url, options=WriterOptions(every=3, mode="inline")) as ck:  # either alone is fine
        assert ck.options.every == 3
