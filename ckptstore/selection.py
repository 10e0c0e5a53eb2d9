"""Which cut to read: LATEST, an id, a step, or the newest cut that verifies (fallback).

Works on a :class:`~ckptstore.recovery.Classification` and a storage, never on the Store, so the store
and the resume tooling can both use it without importing each other.

Only proven damage makes fallback skip a cut: a finding about the bytes (hash or size mismatch, a
missing or truncated file, a broken tree). An I/O error while checking (EIO, a timeout) proves
nothing; it is raised, never recorded, so one transient error cannot quarantine an intact cut.
"""

from __future__ import annotations

from typing import Callable

from . import layout
from .errors import CutNotFound, DataError, LatestError, StorageError, UsageError
from .info import CutInfo
from .manifest import Manifest
from .recovery import Classification
from .storage import Storage
from .verify import FindingKind, VerifyReport, verify_store

CutSelector = str | int
#: Called with (cut id, reason) for each cut fallback proved damaged.
OnBad = Callable[[str, str], None]


def latest_manifest(cls: Classification, url: str) -> Manifest | None:
    """The manifest LATEST names; None for an empty store; LatestError when LATEST is broken."""
    if cls.latest_problem is not None:
        raise LatestError(cls.latest_problem, store=url, path=layout.LATEST_FILE,
                          hint=f"run `ckptstore repair {url}`")
    return None if cls.latest is None else cls.find(cls.latest.cut)


def select_manifest(cls: Classification, cut: CutSelector, url: str) -> Manifest:
    """The manifest of a committed cut: "latest", a cut id, or an int step."""
    if cut == "latest":
        m = latest_manifest(cls, url)
        if m is None:
            raise CutNotFound("the store has no committed cut yet", store=url)
        return m
    if isinstance(cut, bool) or not isinstance(cut, (str, int)):
        raise UsageError(f"cut must be 'latest', a cut id or an int step, not {cut!r}", store=url)
    if isinstance(cut, int):
        matches = [m for m in cls.committed if m.step == cut]
        broken = [exc for c, exc in sorted(cls.broken.items()) if layout.step_of_cut_id(c) == cut]
        if not matches and broken:
            raise broken[-1]  # damaged data is a DataError, not the caller's mistake (CutNotFound)
        if not matches:
            raise CutNotFound(f"no committed cut at step {cut}", store=url,
                              hint=f"committed steps: {[m.step for m in cls.committed][-10:]}")
        return matches[-1]
    layout.check_cut_id(cut, store=url)
    m = cls.find(cut)
    if m is None and cut in cls.broken:
        raise cls.broken[cut]
    if m is None:
        raise CutNotFound("no such committed cut", store=url, cut=cut)
    return m


def raise_io_errors(report: VerifyReport) -> None:
    """An audit that could not read a file proves nothing about it: raise, never skip or record."""
    for f in report.errors:
        if f.kind == FindingKind.IO_ERROR:
            raise StorageError(f"could not check the cut: {f.message}", store=report.store, cut=f.cut, path=f.path,
                               hint="a transient I/O error: retry; the cut was not recorded bad")


def choose_cut(storage: Storage, cls: Classification, *, fallback: bool,
               on_bad: OnBad | None = None) -> tuple[CutInfo | None, dict[str, str]]:
    """The newest committed cut to resume from, and the cuts skipped (id -> why). Without
    ``fallback`` it is LATEST's target, verified (a failure raises). With it, cuts recorded bad are
    skipped outright and cuts proven damaged are skipped and passed to ``on_bad``."""
    if cls.latest_problem is not None and not fallback:
        raise LatestError(cls.latest_problem, store=storage.url, hint=f"run `ckptstore repair {storage.url}`")
    if not cls.committed:
        return None, {}
    skipped: dict[str, str] = {}
    if not fallback:
        m = cls.find(cls.latest.cut) if cls.latest else None
        if m is None:
            return None, {}
        report = verify_store(storage, cls, cut=m.cut)
        raise_io_errors(report)
        if not report.ok:
            f = report.errors[0]
            raise DataError(f"LATEST cut fails verification: {f.message}", store=storage.url, cut=m.cut, path=f.path,
                            hint="load(..., fallback=True) resumes from the newest cut that verifies")
        return cls.info(m), skipped
    latest_step = cls.latest.step if cls.latest else None
    for m in reversed(cls.committed):
        if latest_step is not None and m.step > latest_step and m.cut not in cls.bad:
            skipped[m.cut] = "newer than LATEST"
            continue
        if m.cut in cls.bad:
            skipped[m.cut] = "recorded bad by an earlier load"
            continue
        report = verify_store(storage, cls, cut=m.cut)
        raise_io_errors(report)
        errors = [f for f in report.errors if not f.kind.about_latest]
        if errors:
            skipped[m.cut] = f"{errors[0].kind}: {errors[0].message}"
            if on_bad is not None:
                on_bad(m.cut, skipped[m.cut])
            continue
        return cls.info(m), skipped
    raise CutNotFound("no committed cut verifies", store=storage.url, hint=f"skipped: {skipped}")
