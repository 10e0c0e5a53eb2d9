"""What a due cut does while the previous one is still in flight: busy="skip" skips periodic cuts and
says so; busy="wait" and final cuts wait; the block is never overwritten under a cut not yet written.

The in-flight cut is held deterministically with the writer's "hang-mid-shard" fault and a short
write_timeout: the writer hangs after half the bytes until the timeout kills it and the commit thread
writes the cut itself (fallback), so the cut is in flight for at least write_timeout seconds.
"""

from __future__ import annotations

import time

from ckptstore.writer import Checkpointer
from writerkit import (inject_fault, BOUND, EventLog, assert_state_equal, check_store, clone_state, mutate_in_place,
                       read_jsonl, small_state)

TIMEOUT = 2.0


def test_skip_while_in_flight_then_final_waits(url, tmp_path):
    log = EventLog()
    events_path = tmp_path / "events.jsonl"
    state = small_state(1.0)
    with Checkpointer(url, every=10, busy="skip", write_timeout=TIMEOUT, on_event=log,
                      events_path=str(events_path)) as ck:
        inject_fault(ck, "hang-mid-shard")
        first = ck.maybe_cut(10, state)
        snap10 = clone_state(state)
        assert first is not None
        mutate_in_place(state)

        assert ck.maybe_cut(20, state) is None  # the hung cut is in flight: skipped, not queued
        skipped = log.of("skipped")
        assert len(skipped) == 1 and skipped[0]["step"] == 20
        assert first.id in skipped[0]["reason"] and "step 10" in skipped[0]["reason"]
        assert skipped[0]["skipped_total"] == 1 and ck.skipped == 1
        assert ck.maybe_cut(25, state) is None  # not due: no event, no counter
        assert ck.skipped == 1

        info = first.wait(TIMEOUT + BOUND)  # the hang turns into the fallback and commits
        assert info.step == 10 and first.fallback and "no progress" in first.fallback

        # A second hung cut, and then the final cut: it waits for the one in flight, never skips.
        inject_fault(ck, "hang-mid-shard")
        second = ck.maybe_cut(30, state)
        snap30 = clone_state(state)
        assert second is not None
        mutate_in_place(state)
        snap_final = clone_state(state)
        t0 = time.monotonic()
        final = ck.cut(31, state, final=True)
        assert final.state == "committed" and final.wait(0).final
        assert second.state == "committed"  # the final cut waited for it
        assert time.monotonic() - t0 >= TIMEOUT * 0.9
        assert ck.skipped == 1 and ck.waited == 1
        waited = log.of("waited")
        assert len(waited) == 1 and waited[0]["step"] == 31 and waited[0]["for_cut"] == second.id
        assert waited[0]["waited_total"] == 1 and waited[0]["seconds"] > 0
        cap = log.of("captured", step=31)[0]
        assert cap["skipped_total"] == 1 and cap["waited_total"] == 1

    store = check_store(url)
    assert [c.step for c in store.cuts()] == [10, 30, 31]
    assert store.latest().step == 31 and store.latest().final
    # Each cut holds its own values: the final capture did not overwrite the block before the
    # fallback had written cut 30 from it.
    assert_state_equal(store.load(first.id), snap10)
    assert_state_equal(store.load(second.id), snap30)
    assert_state_equal(store.load(final.id), snap_final)
    kinds = [e["event"] for e in read_jsonl(events_path)]
    assert kinds.count("skipped") == 1 and kinds.count("waited") == 1 and kinds.count("fallback") == 2


def test_busy_wait_waits_for_periodic_cuts_too(url):
    log = EventLog()
    state = small_state(2.0)
    with Checkpointer(url, every=1, busy="wait", write_timeout=TIMEOUT, on_event=log) as ck:
        inject_fault(ck, "hang-mid-shard")
        first = ck.maybe_cut(1, state)
        snap1 = clone_state(state)
        mutate_in_place(state)
        second = ck.maybe_cut(2, state)  # waits for the hung cut instead of skipping
        assert second is not None
        assert first.state == "committed" and first.fallback
        assert ck.skipped == 0 and ck.waited == 1 and not log.of("skipped")
        snap2 = clone_state(state)
        mutate_in_place(state)
        second.wait(BOUND)
    store = check_store(url)
    assert_state_equal(store.load(first.id), snap1)
    assert_state_equal(store.load(second.id), snap2)
