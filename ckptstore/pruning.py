"""``Store.prune`` and ``Store.remove``: which committed cuts go, under the hard rules that
:mod:`ckptstore.retention` owns (issue 20: ``remove`` re-implemented them), and never a store's last
cut that verifies (issue 10, item 5). Moved out of store.py; each removal uncommits through the protocol."""

from __future__ import annotations

from .collect import ensure_recovered
from .core import StoreCore
from .errors import CorruptCut, UsageError
from .events import log
from .info import CutInfo
from .labels import label_path
from .recovery import Classification
from .retention import PINNED_TAG, HardKeep, Policy, hard_keeps
from .selection import CutSelector, latest_manifest, raise_io_errors, select_manifest
from .verify import Progress, verify_store

#: Why ``remove`` refuses a cut a hard rule keeps, by the rule (the messages ``remove`` always gave).
REMOVE_REFUSALS = {HardKeep.LATEST: "it is LATEST's target (commit a newer cut first)",
                   HardKeep.PINNED: f"it is tagged {PINNED_TAG!r}"}


def prune(core: StoreCore, policy: Policy, *, dry_run: bool, verify_kept: bool,
          progress: Progress | None) -> list[CutInfo]:
    """See :meth:`ckptstore.Store.prune`."""
    core.require_writer("prune")
    if not dry_run:
        ensure_recovered(core)
    cls = core.classify()
    latest = latest_manifest(cls, core.url)
    good = [cls.info(m) for m in cls.committed if m.cut not in cls.bad]
    keep = policy.keep(good)
    hard = hard_keeps(good, keep, latest.cut if latest else None)
    doomed = [c for c in good if c.id not in keep and c.id not in hard and c.id not in core.in_flight]
    if doomed and verify_kept:
        spared = verifying_cut_to_spare(core, cls, good, {c.id for c in doomed}, progress)
        if spared is not None:
            doomed = [c for c in doomed if c.id != spared]
    for c in doomed:
        if not dry_run:
            core.protocol.uncommit(c.id)
            core.written.discard(c.id)
        core.events.emit("pruned", cut=c.id, step=c.step, dry_run=dry_run)
    if not dry_run:
        drop_labels(core, cls, {c.id for c in doomed})
    return doomed


def remove(core: StoreCore, cut: CutSelector, *, dry_run: bool, verify_kept: bool,
           progress: Progress | None) -> CutInfo:
    """See :meth:`ckptstore.Store.remove`."""
    core.require_writer("remove")
    if isinstance(cut, str) and cut == "latest":
        raise UsageError("remove takes a cut id or a step, not \"latest\": LATEST's cut is never removed",
                         store=core.url)
    if not dry_run:
        ensure_recovered(core)
    cls = core.classify()
    m = select_manifest(cls, cut, core.url)
    info = cls.info(m)
    latest = latest_manifest(cls, core.url)
    # The named cut is the only one a remove gives up ("kept" by no policy is every other cut), so the
    # rule about cuts newer than the newest kept one, prune's, cannot refuse it: a cut above a fallback
    # LATEST stays removable, as before.
    rule = hard_keeps([info], {info.id}, latest.cut if latest else None).get(info.id)
    refusal = REMOVE_REFUSALS[rule] if rule is not None else None
    if refusal is None and m.cut in core.in_flight:
        refusal = "this handle is still writing it"
    if refusal is not None:
        raise UsageError(f"cut {m.cut} (step {m.step}) is not removed: {refusal}", store=core.url, cut=m.cut)
    if verify_kept and m.cut not in cls.bad:
        good = [cls.info(x) for x in cls.committed if x.cut not in cls.bad]
        if verifying_cut_to_spare(core, cls, good, {m.cut}, progress) == m.cut:
            raise CorruptCut(f"cut {m.cut} (step {m.step}) is not removed: it is the newest cut that verifies "
                             "and LATEST's does not", store=core.url, cut=m.cut,
                             hint="run `ckptstore repair` to point LATEST at it; `--no-verify` skips this check")
    if not dry_run:
        core.protocol.uncommit(m.cut)
        core.written.discard(m.cut)
        drop_labels(core, cls, {m.cut})
    core.events.emit("removed", cut=m.cut, step=m.step, dry_run=dry_run)
    return info


def verifying_cut_to_spare(core: StoreCore, cls: Classification, good: list[CutInfo], doomed: set[str],
                           progress: Progress | None) -> str | None:
    """The doomed cut ``prune`` must keep so that a verifying cut survives it, or None when a kept
    cut verifies; ``CorruptCut`` when no cut verifies. Checks the newest kept cut first, then the
    others newest first, and stops at the first that verifies: a healthy store costs one cut."""
    order = sorted(good, key=lambda c: c.step, reverse=True)
    newest_kept = next((c for c in order if c.id not in doomed), None)
    if newest_kept is not None:
        order.remove(newest_kept)
        order.insert(0, newest_kept)
    failed: dict[str, str] = {}  # cut -> its first error
    for c in order:
        if c.id not in core.written:
            report = verify_store(core.storage, cls, cut=c.id, progress=progress)
            raise_io_errors(report)  # could not read: proves nothing, so remove nothing
            if not report.ok:
                failed[c.id] = report.errors[0].message
                continue
        if c.id not in doomed:
            return None
        reason = f"no kept cut verifies ({'; '.join(list(failed.values())[:2]) or 'none is kept'})"
        core.events.emit("prune-spared", cut=c.id, step=c.step, reason=reason)
        log.warning("ckptstore: prune of %s keeps %s, the newest cut that verifies: %s", core.url, c.id, reason)
        return c.id
    raise CorruptCut(f"no committed cut verifies ({'; '.join(list(failed.values())[:2])}); prune removed "
                     "nothing", store=core.url, cut=next(iter(failed), None),
                     hint="run `ckptstore verify` to see the damage; `prune --no-verify` (verify_kept=False) "
                          "removes cuts without this check")


def drop_labels(core: StoreCore, cls: Classification, cuts: set[str]) -> None:
    """After ``cuts`` were uncommitted: their labels go too (a crash before leaves stale labels, gc)."""
    for name, cut in cls.labels.items():
        if cut in cuts:
            core.protocol.remove_label_file(label_path(name))


__all__ = ["REMOVE_REFUSALS", "drop_labels", "prune", "remove", "verifying_cut_to_spare"]
