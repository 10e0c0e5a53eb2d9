"""Which cut to read: LATEST, an id, a step, or the newest cut that verifies (fallback).

Works on a :class:`~ckptstore.recovery.Classification` and a storage, never on the Store, so the store
and the resume tooling can both use it without importing each other.

Only proven damage makes fallback skip a cut: a finding about the bytes (hash or size mismatch, a
missing or truncated file, a broken tree). An I/O error while checking (EIO, a timeout) proves
nothing; it is raised, never recorded, so one transient error cannot quarantine an intact cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

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
#: A tier's own check of a copy in place of verify: the damage it proved (None: it verifies); an I/O
#: error raises. A restore from the mirror loads the copy as its check, so each byte is downloaded
#: once (issue 21).
Check = Callable[[Manifest], DataError | None]


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
    chosen = choose_across([Tier("local", storage, cls, on_bad)], fallback=fallback)
    return chosen.info, chosen.skipped


@dataclass(frozen=True)
class Tier:
    """One store a cut may be read from (issue 21): the local tier, a mirror. ``on_bad`` records a copy
    of this tier that fallback proved damaged, in this tier; ``check`` (None: verify) checks a copy."""

    name: str
    storage: Storage
    cls: Classification
    on_bad: OnBad | None = None
    check: Check | None = None


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_across` chose: the cut (None for empty tiers), the index of the tier whose copy
    verified, and every copy skipped, as (tier name, cut id, why), newest first."""

    info: CutInfo | None
    tier: int | None
    skips: list[tuple[str, str, str]]
    several: bool

    @property
    def skipped(self) -> dict[str, str]:
        """Cut id -> why. With several tiers each reason names its tier's copy ("mirror copy: ..."), and
        the reasons of both copies of a cut are joined; with one, the reasons are as they always were."""
        out: dict[str, str] = {}
        for name, cut, why in self.skips:
            why = f"{name} copy: {why}" if self.several else why
            out[cut] = f"{out[cut]}; {why}" if cut in out else why
        return out


def choose_across(tiers: Sequence[Tier], *, fallback: bool) -> Choice:
    """The newest committed cut of any tier that verifies (issue 21): a mirror newer than the local tier
    wins, and a copy that fails gives way to another tier's copy of the same cut (the same id and the
    same manifest) before older steps. Ties at a step go to the earlier tier. Without ``fallback`` the
    candidates are each tier's LATEST target; a broken LATEST raises, and so does the newest cut when no
    copy of it verifies. One tier is :func:`choose_cut` exactly."""
    if not fallback:
        return _choose_latest(tiers)
    skips: list[tuple[str, str, str]] = []
    first: dict[int, tuple[int, Manifest]] = {}  # step -> the first tier's copy there
    for i, m in _copies(tiers):
        tier = tiers[i]
        why = _not_a_copy(tiers, first.setdefault(m.step, (i, m)), i, m) or _recorded_skip(tier.cls, m)
        if why is None:
            why = _damage(tier, m)
            if why is not None and tier.on_bad is not None:
                tier.on_bad(m.cut, why)
        if why is None:
            return Choice(tier.cls.info(m), i, skips, len(tiers) > 1)
        skips.append((tier.name, m.cut, why))
    if not skips:
        return Choice(None, None, [], len(tiers) > 1)
    skipped = Choice(None, None, skips, len(tiers) > 1).skipped
    raise CutNotFound("no committed cut verifies", store=tiers[0].storage.url, hint=f"skipped: {skipped}")


def _choose_latest(tiers: Sequence[Tier]) -> Choice:
    """Without fallback: the newest LATEST target of the tiers, verified; another tier's copy of that
    same cut when it fails; the first copy's ``DataError`` when none verifies. Nothing is recorded."""
    heads: list[tuple[int, Manifest]] = []
    for i, t in enumerate(tiers):
        if t.cls.latest_problem is not None:
            raise LatestError(t.cls.latest_problem, store=t.storage.url,
                              hint=f"run `ckptstore repair {t.storage.url}`")
        m = t.cls.find(t.cls.latest.cut) if t.cls.committed and t.cls.latest else None
        if m is not None:
            heads.append((i, m))
    if not heads:
        return Choice(None, None, [], len(tiers) > 1)
    i0, m0 = min(heads, key=lambda h: (-h[1].step, h[0]))
    copies = [(i0, m0)] + [(i, tiers[i].cls.find(m0.cut)) for i in range(len(tiers)) if i != i0]
    skips: list[tuple[str, str, str]] = []
    failure: DataError | None = None
    for i, m in copies:
        if m is None or m != m0:
            continue
        if tiers[i].check is not None:
            exc = tiers[i].check(m)
            if exc is None:
                return Choice(tiers[i].cls.info(m), i, skips, len(tiers) > 1)
            skips.append((tiers[i].name, m.cut, _reason(exc)))
            failure = failure or DataError(f"LATEST cut fails verification: {exc.message}", store=exc.store,
                                           cut=m.cut, path=exc.path, hint=_FALLBACK_HINT)
            continue
        report = verify_store(tiers[i].storage, tiers[i].cls, cut=m.cut)
        raise_io_errors(report)
        if report.ok:
            return Choice(tiers[i].cls.info(m), i, skips, len(tiers) > 1)
        f = report.errors[0]
        skips.append((tiers[i].name, m.cut, f"{f.kind}: {f.message}"))
        failure = failure or DataError(f"LATEST cut fails verification: {f.message}", store=tiers[i].storage.url,
                                       cut=m.cut, path=f.path,
                                       hint=_FALLBACK_HINT)
    assert failure is not None
    raise failure


def _copies(tiers: Sequence[Tier]) -> list[tuple[int, Manifest]]:
    """Every committed copy as (tier index, manifest): newest step first, then in tier order, then (two
    cuts of one tier at one step) the later one first, as one tier's walk back always went."""
    rows = [(-m.step, i, -pos, m) for i, t in enumerate(tiers) for pos, m in enumerate(t.cls.committed)]
    rows.sort(key=lambda r: r[:3])
    return [(i, m) for _s, i, _p, m in rows]


def _not_a_copy(tiers: Sequence[Tier], first: tuple[int, Manifest], i: int, m: Manifest) -> str | None:
    """Why a tier's cut is no alternative to the cut an earlier tier holds at its step: another cut (two
    runs sharing a mirror, or one written apart from its source) is never taken for this run's."""
    i0, m0 = first
    if i0 == i or m == m0:
        return None
    return f"another cut than the {tiers[i0].name} tier's {m0.cut} at step {m.step}"


def _recorded_skip(cls: Classification, m: Manifest) -> str | None:
    latest_step = cls.latest.step if cls.latest else None
    if latest_step is not None and m.step > latest_step and m.cut not in cls.bad:
        return "newer than LATEST"
    if m.cut in cls.bad:
        return "recorded bad by an earlier load"
    return None


def _damage(tier: Tier, m: Manifest) -> str | None:
    """The first finding that proves a copy damaged (findings about LATEST alone do not), None when it
    verifies; an I/O error raises (it proves nothing)."""
    if tier.check is not None:
        exc = tier.check(m)
        return None if exc is None else _reason(exc)
    report = verify_store(tier.storage, tier.cls, cut=m.cut)
    raise_io_errors(report)
    errors = [f for f in report.errors if not f.kind.about_latest]
    return f"{errors[0].kind}: {errors[0].message}" if errors else None


_FALLBACK_HINT = "load(..., fallback=True) resumes from the newest cut that verifies"


def _reason(exc: DataError) -> str:
    """A check's damage as a skip reason, spelled as verify's findings are (kind: message)."""
    return f"{type(exc).wire_key or 'data-error'}: {exc.message}"
