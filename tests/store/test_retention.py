"""Retention: the pure policies (many Hypothesis examples against an independent oracle), the store's
hard rules in ``Store.prune`` (a few real-store runs), and what an interrupted prune leaves behind."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore import CutInfo, KeepEvery, KeepFinal, KeepLast, KeepTagged, Store, StoreOptions
from ckptstore.retention import PINNED_TAG, hard_keeps

SPECIAL_STEPS = [999, 1000, 9999, 10000]
EPOCH = datetime(2024, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Plan:
    """A retention scenario: cuts (step -> tags) and a policy made of optional parts."""

    steps: tuple[int, ...]  # ascending
    tags: dict[int, tuple[str, ...]]
    last: int | None
    every: int | None
    best: bool

    def policy(self) -> ckptstore.Policy:
        parts: list[ckptstore.Policy] = []
        if self.last is not None:
            parts.append(KeepLast(self.last))
        if self.every is not None:
            parts.append(KeepEvery(self.every))
        if self.best:
            parts.append(KeepTagged("best"))
        policy = parts[0]
        for p in parts[1:]:
            policy = policy | p
        return policy

    def expected_kept_steps(self, latest_step: int | None) -> set[int]:
        """An oracle written from the rules, not from the code: top-n by step, multiples of k, tagged
        "best" (when asked), tagged "keep", the LATEST target, and anything newer than all of those."""
        kept: set[int] = set()
        if self.last is not None:
            kept |= set(sorted(self.steps)[-self.last:])
        if self.every is not None:
            kept |= {s for s in self.steps if s % self.every == 0}
        if self.best:
            kept |= {s for s in self.steps if "best" in self.tags[s]}
        if latest_step is not None:
            kept.add(latest_step)
        if kept:
            newest = max(kept)
            kept |= {s for s in self.steps if s > newest}
        kept |= {s for s in self.steps if PINNED_TAG in self.tags[s]}
        return kept


TAGS = st.lists(st.sampled_from(["best", PINNED_TAG, "other"]), max_size=2, unique=True).map(tuple)


@st.composite
def plans(draw: st.DrawFn, max_cuts: int = 16, max_step: int = 20000) -> Plan:
    specials = draw(st.sets(st.sampled_from(SPECIAL_STEPS)))
    others = draw(st.sets(st.integers(0, max_step), max_size=max_cuts - len(specials)))
    steps = tuple(sorted(specials | others))
    if not steps:
        steps = (draw(st.sampled_from(SPECIAL_STEPS)),)
    tags = {s: draw(TAGS) for s in steps}
    last = draw(st.none() | st.integers(1, 6))
    every = draw(st.none() | st.sampled_from([1, 3, 7, 10, 100, 1000, 5000]))
    best = draw(st.booleans())
    if last is None and every is None and not best:
        last = 1
    return Plan(steps, tags, last, every, best)


def fake_cuts(plan: Plan, names: Sequence[str], ages: Sequence[int]) -> list[CutInfo]:
    """CutInfos whose ids and creation times are deliberately unrelated to their steps."""
    return [
        CutInfo(id=names[i], step=s, tags=plan.tags[s], created_at=EPOCH + timedelta(seconds=ages[i]), nbytes=0,
                final=False, files=1, tensors=0, metadata={})
        for i, s in enumerate(plan.steps)
    ]


def store_kept(policy: ckptstore.Policy, cuts: list[CutInfo], latest: str | None) -> set[str]:
    """What Store.prune keeps: the policy's choice plus the store's hard rules."""
    keep = policy.keep(cuts)
    return keep | set(hard_keeps(cuts, keep, latest))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Plan, list[CutInfo]]:
    plan = draw(plans())
    n = len(plan.steps)
    # Names that sort in a different order than steps ("c-999" > "c-10000") and random ages.
    names = draw(st.permutations([f"c-{s}" for s in plan.steps]))
    ages = draw(st.permutations(list(range(n))))
    cuts = fake_cuts(plan, names, ages)
    return plan, draw(st.permutations(cuts))


# --------------------------------------------------------------------------------------------------
# pure policies


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_policy_plus_hard_rules_match_the_oracle(scenario: tuple[Plan, list[CutInfo]]) -> None:
    plan, cuts = scenario
    by_id = {c.id: c for c in cuts}
    newest = max(cuts, key=lambda c: c.step)
    before = list(cuts)
    kept = store_kept(plan.policy(), cuts, latest=newest.id)
    assert cuts == before, "a policy must not reorder or change its input"
    assert kept <= set(by_id)
    kept_steps = {by_id[i].step for i in kept}

    assert kept_steps == plan.expected_kept_steps(newest.step)
    assert newest.id in kept
    assert {c.id for c in cuts if PINNED_TAG in c.tags} <= kept
    if plan.best:
        assert {c.id for c in cuts if "best" in c.tags} <= kept
    if plan.last is not None:
        assert set(sorted(c.step for c in cuts)[-plan.last:]) <= kept_steps
    every_matches = {c.step for c in cuts if plan.every is not None and c.step % plan.every == 0}
    assert every_matches <= kept_steps
    n_best = sum(1 for c in cuts if "best" in c.tags) if plan.best else 0
    n_pinned = sum(1 for c in cuts if PINNED_TAG in c.tags)
    assert len(kept) <= (plan.last or 1) + n_best + len(every_matches) + n_pinned


@settings(max_examples=120, deadline=None)
@given(scenarios(), st.data())
def test_latest_anywhere_is_kept_and_the_newest_always_survives(scenario: tuple[Plan, list[CutInfo]],
                                                                data: st.DataObject) -> None:
    """LATEST may name an older cut (after a repair fell back): it is kept, and so is every newer cut
    no policy chose to drop below the newest kept one; the newest cut always survives."""
    plan, cuts = scenario
    latest = data.draw(st.sampled_from(cuts))
    by_id = {c.id: c for c in cuts}
    kept = store_kept(plan.policy(), cuts, latest=latest.id)
    assert latest.id in kept
    assert max(cuts, key=lambda c: c.step).id in kept
    assert {by_id[i].step for i in kept} == plan.expected_kept_steps(latest.step)


@settings(max_examples=80, deadline=None)
@given(scenarios(), st.data())
def test_order_comes_from_steps_never_names_or_times(scenario: tuple[Plan, list[CutInfo]],
                                                     data: st.DataObject) -> None:
    plan, cuts = scenario
    policy = plan.policy()
    newest = max(cuts, key=lambda c: c.step)
    kept_steps = {c.step for c in cuts if c.id in store_kept(policy, cuts, newest.id)}
    # Rename every cut and reshuffle ages and input order: the same steps must survive.
    renamed = [CutInfo(id=f"z-{i}-{data.draw(st.integers(0, 10**6))}", step=c.step, tags=c.tags,
                       created_at=EPOCH - timedelta(seconds=data.draw(st.integers(0, 10**6))), nbytes=0,
                       final=False, files=1, tensors=0, metadata={})
               for i, c in enumerate(data.draw(st.permutations(cuts)))]
    newest2 = max(renamed, key=lambda c: c.step)
    assert {c.step for c in renamed if c.id in store_kept(policy, renamed, newest2.id)} == kept_steps


@pytest.mark.parametrize("names", [
    {999: "ckpt-999", 1000: "ckpt-1000", 9999: "ckpt-9999", 10000: "ckpt-10000"},  # lexical: 999 > 10000
    {999: "a", 1000: "b", 9999: "c", 10000: "d"},
    {999: "d", 1000: "c", 9999: "b", 10000: "a"},
])
def test_keep_last_two_of_999_1000_9999_10000(names: dict[int, str]) -> None:
    # Created newest-step-first, so ordering by time would pick the wrong two as well.
    cuts = [CutInfo(id=names[s], step=s, tags=(), created_at=EPOCH - timedelta(seconds=s), nbytes=0, final=False,
                    files=1, tensors=0, metadata={}) for s in (10000, 999, 9999, 1000)]
    assert KeepLast(2).keep(cuts) == {names[9999], names[10000]}
    assert store_kept(KeepLast(2), cuts, names[10000]) == {names[9999], names[10000]}


def test_small_policies() -> None:
    cuts = [CutInfo(id=f"c{s}", step=s, tags=t, created_at=EPOCH, nbytes=0, final=f, files=1, tensors=0, metadata={})
            for s, t, f in [(0, (), False), (5, ("best",), False), (10, ("x", "keep"), False), (15, (), True),
                            (20, ("best", "x"), False)]]
    assert KeepLast(1).keep(cuts) == {"c20"}
    assert KeepLast(100).keep(cuts) == {c.id for c in cuts}
    assert KeepEvery(10).keep(cuts) == {"c0", "c10", "c20"}
    assert KeepTagged("best").keep(cuts) == {"c5", "c20"}
    assert KeepTagged("x", "best").keep(cuts) == {"c5", "c10", "c20"}
    assert KeepTagged().keep(cuts) == set()
    assert KeepFinal().keep(cuts) == {"c15"}
    assert (KeepLast(1) | KeepFinal() | KeepEvery(10)).keep(cuts) == {"c0", "c10", "c15", "c20"}
    assert KeepLast(1).keep([]) == set()
    for bad in (lambda: KeepLast(0), lambda: KeepEvery(0), lambda: KeepLast(-1)):
        with pytest.raises(ValueError):
            bad()


# --------------------------------------------------------------------------------------------------
# real store


def _build(url: str, plan: Plan, options: StoreOptions | None = None) -> Store:
    s = Store.open(url, create=True, options=options)
    for step in plan.steps:
        s.save({"step": step}, step=step, tags=plan.tags[step])
    return s


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(max_cuts=5))
def test_store_prune_keeps_exactly_what_the_rules_say(plan: Plan) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = os.path.join(tmp, "store")
        events: list[dict[str, Any]] = []
        s = _build(url, plan, StoreOptions(on_event=events.append))
        try:
            ids = {c.step: c.id for c in s.cuts()}
            latest = s.latest()
            assert latest is not None and latest.step == max(plan.steps)
            expected = plan.expected_kept_steps(latest.step)

            dry = s.prune(plan.policy(), dry_run=True)
            assert {c.step for c in dry} == set(plan.steps) - expected
            assert [c.step for c in s.cuts()] == list(plan.steps), "dry run removed something"

            pruned = s.prune(plan.policy())
            assert {c.step for c in pruned} == set(plan.steps) - expected
            assert [c.step for c in s.cuts()] == sorted(expected)
            assert s.latest() == latest
            assert sorted(os.listdir(os.path.join(url, "cuts"))) == sorted(ids[x] for x in expected)
            assert {e["cut"] for e in events if e["event"] == "pruned" and not e["dry_run"]} == {c.id for c in pruned}
            report = s.verify()
            assert report.ok and not report.findings
            assert ckptstore.load(url) == {"step": latest.step}
            # Pruning again with the same policy is a no-op.
            assert s.prune(plan.policy()) == []
        finally:
            s.close()


def test_store_prune_999_1000_9999_10000(store: Store) -> None:
    for step in SPECIAL_STEPS:
        store.save({"step": step}, step=step)
    pruned = store.prune(KeepLast(2))
    assert sorted(c.step for c in pruned) == [999, 1000]
    assert [c.step for c in store.cuts()] == [9999, 10000]


def test_store_prune_keeps_pinned_best_and_recorded_bad(store: Store) -> None:
    for step, tags in [(1, ("keep",)), (2, ("best",)), (3, ()), (4, ()), (5, ())]:
        store.save({"step": step}, step=step, tags=tags)
    bad = store.cuts()[2]  # step 3
    store.record_bad(bad.id, "test: failed verification")
    pruned = store.prune(KeepLast(1) | KeepTagged("best"))
    assert [c.step for c in pruned] == [4]
    assert [c.step for c in store.cuts()] == [1, 2, 3, 5]


def test_prune_needs_a_writer(store: Store) -> None:
    store.save({"x": 1}, step=1)
    store.save({"x": 2}, step=2)
    with Store.open(store.url, readonly=True) as ro:
        with pytest.raises(ckptstore.UsageError):
            ro.prune(KeepLast(1))
    assert len(store.cuts()) == 2


# --------------------------------------------------------------------------------------------------
# interrupted prune


def _leftover_notices(s: Store, cut: str) -> list[ckptstore.Finding]:
    return [f for f in s.verify().findings if f.cut == cut and f.kind.startswith("leftover-")]


def test_prune_interrupted_after_uncommit_by_hand(store: Store) -> None:
    """Prune's first step deletes the manifest; a crash right after leaves a directory with shards and
    no manifest: not a cut any more, reported as a leftover, removed by gc."""
    infos = [store.save({"step": s}, step=s) for s in (1, 2, 3)]
    victim = infos[0]
    cut_dir = os.path.join(store.url, "cuts", victim.id)
    os.remove(os.path.join(cut_dir, "MANIFEST.json"))
    assert os.listdir(cut_dir), "the shards are still there"

    assert [c.id for c in store.cuts()] == [infos[1].id, infos[2].id]
    with pytest.raises(ckptstore.CutNotFound):
        ckptstore.load(store.url, cut=victim.id)
    report = store.verify()
    assert report.ok, "a half-pruned cut is gc material, not damage"
    notes = _leftover_notices(store, victim.id)
    assert [f.kind for f in notes] == ["leftover-abandoned"] and notes[0].severity == "notice"

    dry = store.gc(dry_run=True)
    assert [lo.cut for lo in dry.removed] == [victim.id] and os.path.isdir(cut_dir)
    gc = store.gc()
    assert [lo.cut for lo in gc.removed] == [victim.id]
    assert not os.path.exists(cut_dir)
    assert _leftover_notices(store, victim.id) == []
    assert [c.step for c in store.cuts()] == [2, 3]
    assert ckptstore.load(store.url) == {"step": 3}


class _Crash(Exception):
    pass


@pytest.mark.parametrize("phase", ["prune-uncommitted", "prune-files-deleted"])
def test_prune_interrupted_at_a_phase(store_url: str, phase: str) -> None:
    """The same through the protocol's own fault-injection seam, and recovery on the next open."""
    armed = {"on": False}

    def on_phase(name: str, cut: str) -> None:
        if armed["on"] and name == phase:
            raise _Crash(f"crash at {name} of {cut}")

    events: list[dict[str, Any]] = []
    s = Store.open(store_url, create=True, options=StoreOptions(on_phase=on_phase))
    try:
        infos = [s.save({"step": step}, step=step) for step in (10, 20, 30)]
        armed["on"] = True
        with pytest.raises(_Crash):
            s.prune(KeepLast(1))
        armed["on"] = False
        victim = infos[0]
        cut_dir = os.path.join(store_url, "cuts", victim.id)
        assert os.path.isdir(cut_dir) and not os.path.exists(os.path.join(cut_dir, "MANIFEST.json"))
        assert victim.id not in [c.id for c in s.cuts()]
        assert s.latest().id == infos[2].id  # type: ignore[union-attr]
        assert [f.kind for f in _leftover_notices(s, victim.id)] == ["leftover-abandoned"]
    finally:
        s.close()

    # Reopening as the writer recovers: the half-pruned directory goes, the rest stays.
    with Store.open(store_url, options=StoreOptions(on_event=events.append)) as s2:
        assert not os.path.exists(cut_dir)
        assert [e["cut"] for e in events if e["event"] == "recovered"] == [victim.id]
        assert victim.id not in {c.id for c in s2.cuts()}
        assert s2.latest().id == infos[2].id  # type: ignore[union-attr]
        assert s2.verify().ok
        assert [c.step for c in s2.prune(KeepLast(1))] == [20]
        assert [c.step for c in s2.cuts()] == [30]
