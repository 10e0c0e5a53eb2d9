"""Reading a store back: a cut's state, its attached files, the cut to resume from, audits (moved out
of store.py, issue 20). Every role may read."""

from __future__ import annotations

import os
from typing import Any, Sequence

from .arrays import resolve_map_location
from .attached import Restorer
from .core import StoreCore
from .errors import CutNotFound, HostileInput, UsageError
from .events import log
from .info import CutInfo
from .loader import load_manifest, restore_attached
from .manifest import Manifest
from .repairing import record_bad_quietly
from .selection import CutSelector, choose_cut, latest_manifest, select_manifest
from .verify import Progress, VerifyReport, verify_store


def cuts(core: StoreCore) -> list[CutInfo]:
    """See :meth:`ckptstore.Store.cuts`."""
    cls = core.classify()
    return [cls.info(m) for m in cls.committed]


def latest(core: StoreCore) -> CutInfo | None:
    """See :meth:`ckptstore.Store.latest`."""
    cls = core.classify()
    m = latest_manifest(cls, core.url)
    return None if m is None else cls.info(m)


def load(core: StoreCore, cut: CutSelector, *, map_location: Any, verify: bool, keys: Sequence[str] | None,
         allow_pickle: bool, fallback: bool, rank: int | None, allowed_types: Sequence[type] | None) -> Any:
    """See :meth:`ckptstore.Store.load`."""
    if fallback and cut == "latest":
        info, _skipped = choose(core, fallback=True)
        if info is None:
            raise CutNotFound("the store has no committed cut yet", store=core.url)
        cut = info.id
    m = rank_manifest(core.manifest(cut), rank, core.url)
    if m.pickled and not allow_pickle:
        raise HostileInput("cut holds pickled values; pass allow_pickle=True only if you trust it",
                           store=core.url, cut=m.cut)
    map_location = resolve_map_location(map_location, {"store": core.url, "cut": m.cut})
    return load_manifest(core.storage, m, map_location=map_location, verify=verify, keys=keys,
                         allow_pickle=allow_pickle, allowed_types=allowed_types)


def restore_files(core: StoreCore, cut: CutSelector, to: str | os.PathLike[str], *, rank: int | None,
                  overwrite: bool, verify: bool) -> list[str]:
    """See :meth:`ckptstore.Store.restore_files`."""
    if rank is None and core.ranks is not None:
        rank = core.ranks.rank
    m = rank_manifest(core.manifest(cut), rank, core.url)
    where = {"store": core.url, "cut": m.cut}
    with Restorer(m.attached, os.fspath(to), overwrite=overwrite, where=where) as restorer:
        restore_attached(core.storage, m, restorer, verify=verify)
        return restorer.commit()


def choose(core: StoreCore, *, fallback: bool) -> tuple[CutInfo | None, dict[str, str]]:
    """See :meth:`ckptstore.Store.choose`."""
    info, skipped = choose_cut(core.storage, core.classify(), fallback=fallback,
                               on_bad=lambda cut, why: record_bad_quietly(core, cut, why))
    for bad_cut, why in skipped.items():
        core.events.emit("fallback-skipped", cut=bad_cut, reason=why)
        log.warning("ckptstore: skipped cut %s of %s: %s", bad_cut, core.url, why)
    return info, skipped


def verify(core: StoreCore, cut: CutSelector | None, *, progress: Progress | None) -> VerifyReport:
    """See :meth:`ckptstore.Store.verify`."""
    cls = core.classify()
    cut_id = None if cut is None else select_manifest(cls, cut, core.url).cut
    return verify_store(core.storage, cls, cut=cut_id, progress=progress)


def rank_manifest(m: Manifest, rank: int | None, url: str) -> Manifest:
    """Rank ``rank``'s part of a cut (a cut of one rank is its own part 0); a ``UsageError`` that names
    the cut's world size when ``rank`` is missing for a cut of several ranks, or outside it."""
    if rank is None:
        if m.world_size > 1:
            raise UsageError(f"cut {m.cut} holds the state of {m.world_size} ranks (world size {m.world_size}); "
                             f"pass rank= (0 to {m.world_size - 1}) to load one", store=url, cut=m.cut)
        return m
    try:
        return m.for_rank(rank)
    except ValueError as exc:
        raise UsageError(str(exc), store=url, cut=m.cut) from None


__all__ = ["choose", "cuts", "latest", "load", "rank_manifest", "restore_files", "verify"]
