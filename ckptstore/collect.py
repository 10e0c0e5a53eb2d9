"""``Store.gc`` and the recovery a writer open runs: classify, then remove (or list) each leftover of
interrupted work, through the protocol's removal verbs (moved out of store.py, issue 20), and abort the
multipart uploads no live writer runs (issue 24: a killed writer or a lost CreateMultipartUpload
answer left uploads that nothing listed, billed until a bucket lifecycle rule caught them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import layout
from .core import StoreCore
from .errors import LatestError
from .recovery import Leftover, LeftoverKind
from .storage import Upload


def leftover_json(x: Leftover) -> dict[str, Any]:
    out = {"cut": x.cut, "kind": x.kind, "paths": x.paths, "owner": x.owner, "owner_alive": x.owner_alive}
    if x.upload_id is not None:  # an upload's only: the other kinds' JSON stays as it was
        out["upload_id"] = x.upload_id
    return out


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``) and what it left alone.

    ``at_open`` is what this handle's writer open already removed (its recovery), so no removal goes
    unreported; ``removed`` is what this call removed. Open with ``recover=False`` to have one ``gc``
    (or a dry run) see everything. Multipart uploads are ``upload`` leftovers (``upload_id`` set); one
    outside ``cuts/`` is listed in ``foreign`` and never aborted."""

    removed: list[Leftover] = field(default_factory=list)
    kept: list[Leftover] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    dry_run: bool = False
    at_open: list[Leftover] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "removed": [leftover_json(x) for x in self.removed],
                "kept": [leftover_json(x) for x in self.kept], "foreign": self.foreign,
                "removed_at_open": [leftover_json(x) for x in self.at_open]}


def gc(core: StoreCore, *, dry_run: bool) -> GcReport:
    """See :meth:`ckptstore.Store.gc`."""
    core.require_writer("gc")
    report = collect(core, dry_run=dry_run)
    report.at_open = list(core.recovered)
    if not dry_run:
        core.recovery_pending = False
    return report


def recover(core: StoreCore) -> None:
    """A writer open's recovery: what ``gc`` removes, removed now and listed in ``recovered``."""
    report = collect(core, dry_run=False)
    core.recovery_pending = False
    core.recovered = list(report.removed)
    for lo in report.removed:
        core.events.emit("recovered", cut=lo.cut, kind=lo.kind, paths=lo.paths)


def ensure_recovered(core: StoreCore) -> None:
    """Runs the recovery a ``recover=False`` open put off, before the first change: a stale mark
    left beside the LATEST cut must be cleared before LATEST moves on, or that cut would read as
    in progress."""
    if core.recovery_pending:
        recover(core)


def collect(core: StoreCore, *, dry_run: bool) -> GcReport:
    """``gc``'s work (recovery runs it at open): classify, then remove (or list) each leftover."""
    # Uploads are listed before the store is classified, so every upload seen belongs to a cut that
    # began before the classify: one whose mark it then sees, or one in flight here. Listed here only,
    # never in every classify: it is one more request, and only gc and recovery act on it.
    uploads = core.storage.list_uploads("")
    cls = core.classify()
    if cls.latest_problem is not None:
        raise LatestError(cls.latest_problem, store=core.url, path=layout.LATEST_FILE,
                          hint=f"run `ckptstore repair {core.url}` to point LATEST at the newest cut that verifies")
    report = GcReport(foreign=list(cls.foreign), dry_run=dry_run)
    lock_excludes = core.lock.excludes
    for lo in cls.leftovers:
        mine = lo.cut is not None and lo.cut in core.in_flight
        dead = lo.owner_alive is False or (lock_excludes and not mine)
        if mine or (lo.kind in (LeftoverKind.IN_PROGRESS, LeftoverKind.ORPHAN_MARK) and not dead):
            report.kept.append(lo)
            continue
        report.removed.append(lo)
        if not dry_run:
            _remove(core, lo, report)
    _collect_uploads(core, uploads, report)
    if not dry_run and report.removed:
        core.events.emit("gc", removed=len(report.removed))
    return report


def _collect_uploads(core: StoreCore, uploads: list[Upload], report: GcReport) -> None:
    """Aborts (or lists) each multipart upload no live writer runs. One is kept when its cut is in flight
    on this handle (checked now: a cut that committed since the listing completed its uploads, and
    aborting those is a no-op) or its cut's own leftover was kept (a live owner's in-progress cut: the
    same rule). Every other upload under a cut is an orphan: under a committed cut (whose objects are
    all complete: a lost CreateMultipartUpload answer's twin), under a cut just removed, or under none.
    An upload outside ``cuts/`` is not ckptstore's (it writes shards and manifests only there): foreign,
    reported and never aborted, like a foreign file."""
    live = {lo.cut: lo for lo in report.kept if lo.cut is not None}
    for up in uploads:
        parts = up.rel.split("/")
        if len(parts) < 3 or parts[0] != layout.CUTS_DIR or not layout.is_cut_id(parts[1]):
            report.foreign.append(f"{up.rel} (multipart upload {up.upload_id})")
            continue
        cut = parts[1]
        owner = live.get(cut)
        lo = Leftover(cut, LeftoverKind.UPLOAD, [up.rel], owner.owner if owner else None,
                      owner.owner_alive if owner else None, upload_id=up.upload_id)
        if cut in core.in_flight or owner is not None:
            report.kept.append(lo)
            continue
        report.removed.append(lo)
        if not report.dry_run:
            core.protocol.abort_upload(up)


def _remove(core: StoreCore, lo: Leftover, report: GcReport) -> None:
    protocol = core.protocol
    if lo.kind == LeftoverKind.STALE_MARK:
        protocol.unmark(lo.cut)  # type: ignore[arg-type]
    elif lo.kind == LeftoverKind.TEMP_FILE:
        protocol.remove_temp(lo.paths[0])
    elif lo.kind == LeftoverKind.STALE_FINAL_MARK:
        protocol.remove_final_mark(lo.cut)  # type: ignore[arg-type]
    elif lo.kind in (LeftoverKind.STALE_LABEL, LeftoverKind.BROKEN_LABEL):
        protocol.remove_label_file(lo.paths[0])
    else:
        report.foreign.extend(protocol.remove_leftover(lo.cut))  # type: ignore[arg-type]


__all__ = ["GcReport", "collect", "ensure_recovered", "gc", "leftover_json", "recover"]
