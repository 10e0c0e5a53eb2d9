"""Reading a store back: a cut's state, its attached files, the cut to resume from, audits (moved out
of store.py, issue 20). Every role may read.

Listing at scale (issue 24): a rank other than 0 of a group lists nothing to read LATEST's cut. It reads
LATEST and the manifest LATEST names, two objects (:func:`pointed_manifest`), and a cut that rank 0
named in a collective call by that name alone (:func:`named_manifest`); only rank 0 (and a handle of
one process) classifies the store. Peers' incident: 512 ranks listing an object store at once were
answered SlowDown and read the store as "0 checkpoints" (dlio_benchmark issue 347).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Sequence

from . import layout, pointed
from .arrays import resolve_map_location
from .assemble import PartCache, read_part, whole
from .attached import Restorer
from .core import StoreCore
from .errors import CutNotFound, DataError, HostileInput, UsageError
from .events import log
from .gcpause import pausing
from .info import CutInfo
from .loader import FileTaps, load_manifest, restore_attached
from .manifest import Manifest
from .paths import refuse_symlinked_dirs
from .repairing import record_bad_quietly
from .storage import Storage
from .selection import Check, CutSelector, Tier, choose_across, latest_manifest, select_manifest
from .verify import Progress, VerifyReport, verify_store


def cuts(core: StoreCore) -> list[CutInfo]:
    """See :meth:`ckptstore.Store.cuts`."""
    cls = core.classify()
    return [cls.info(m) for m in cls.committed]


def latest(core: StoreCore) -> CutInfo | None:
    """See :meth:`ckptstore.Store.latest`."""
    if lists_nothing(core):
        m = pointed_manifest(core)
        if m is not None:
            return CutInfo.from_manifest(m, marked_final=core.storage.exists(layout.final_path(m.cut)))
    cls = core.classify()
    m = latest_manifest(cls, core.url)
    return None if m is None else cls.info(m)


def load(core: StoreCore, cut: CutSelector, *, map_location: Any, verify: bool, keys: Sequence[str] | None,
         allow_pickle: bool, fallback: bool, rank: int | None, allowed_types: Sequence[type] | None,
         mirror: StoreCore | None = None) -> Any:
    """See :meth:`ckptstore.Store.load`. With a ``mirror`` (issue 21), "latest" is the newest cut that
    verifies in either tier (:func:`choose_tiers`), and another selector reads the local tier's cut, or
    the mirror's when the local tier has none by that name."""
    if cut == "latest" and (fallback or mirror is not None):
        chosen = choose_tiers(core, mirror, fallback=fallback)
        if chosen.info is None:
            raise CutNotFound("the store has no committed cut yet", store=core.url)
        core, cut = chosen.core, chosen.info.id
    elif mirror is not None:
        try:
            manifest(core, cut)
        except CutNotFound:
            core = mirror
    return load_part(core, rank_manifest(manifest(core, cut), rank, core.url, core.storage, core.parts), map_location=map_location,
                     verify=verify, keys=keys, allow_pickle=allow_pickle, allowed_types=allowed_types)


@pausing
def load_part(core: StoreCore, m: Manifest, *, map_location: Any, verify: bool, keys: Sequence[str] | None,
              allow_pickle: bool, allowed_types: Sequence[type] | None, taps: FileTaps | None = None) -> Any:
    """The state of one rank's part ``m`` of a committed cut (:func:`rank_manifest`), read as it is;
    ``taps`` see every stored byte of it as it passes (``loader.load_manifest``)."""
    if m.pickled and not allow_pickle:
        raise HostileInput("cut holds pickled values; pass allow_pickle=True only if you trust it",
                           store=core.url, cut=m.cut)
    map_location = resolve_map_location(map_location, {"store": core.url, "cut": m.cut})
    return load_manifest(core.storage, m, map_location=map_location, verify=verify, keys=keys,
                         allow_pickle=allow_pickle, allowed_types=allowed_types, taps=taps)


def restore_files(core: StoreCore, cut: CutSelector, to: str | os.PathLike[str], *, rank: int | None,
                  overwrite: bool, verify: bool) -> list[str]:
    """See :meth:`ckptstore.Store.restore_files`."""
    if rank is None and core.ranks is not None:
        rank = core.ranks.rank
    return restore_part_files(core, rank_manifest(manifest(core, cut), rank, core.url, core.storage, core.parts), to, overwrite=overwrite,
                              verify=verify)


def restore_part_files(core: StoreCore, m: Manifest, to: str | os.PathLike[str], *, overwrite: bool,
                       verify: bool) -> list[str]:
    """The files attached to one rank's part ``m`` of a committed cut, back under ``to``."""
    where = {"store": core.url, "cut": m.cut}
    with Restorer(m.attached, os.fspath(to), overwrite=overwrite, where=where) as restorer:
        restore_attached(core.storage, m, restorer, verify=verify)
        return restorer.commit()


def manifest(core: StoreCore, cut: CutSelector) -> Manifest:
    """The manifest of a committed cut, for a read (:meth:`ckptstore.Store.manifest`): on a rank other
    than 0 of a group, LATEST's from two single-object reads (:func:`pointed_manifest`); else, and for
    every other selector, from the classification."""
    if cut == "latest" and lists_nothing(core):
        m = pointed_manifest(core)
        if m is not None:
            return m
    if cut == "latest" and core.readonly and core.ranks is None:
        # A reader's LATEST from two objects as well (issue 22: the scan lists every cut directory, one
        # of 4,096 ranks' fragments and shards for every load); anything it cannot tell (no LATEST, a
        # damaged one) is the classification's to say, in its words.
        refuse_symlinked_dirs(core.storage)  # as the scan refuses them first: nothing behind a symlink
        try:
            m = pointed.pointed_manifest(core.storage, core.url, core.manifests)
        except DataError:
            m = None
        if m is not None:
            return m
    return core.manifest(cut)


def whole_manifest(core: StoreCore, cut: CutSelector) -> Manifest:
    """``manifest`` with every rank's part in it (``assemble.whole``: every fragment of a cut of format 5)."""
    return whole(core.storage, core.url, manifest(core, cut))


def lists_nothing(core: StoreCore) -> bool:
    """Whether this handle is a rank other than 0 of a group, which leaves listing to rank 0 (issue 24)."""
    return core.ranks is not None and core.ranks.rank != 0


def pointed_manifest(core: StoreCore) -> Manifest | None:
    """LATEST's manifest from two single-object reads (:func:`ckptstore.pointed.pointed_manifest`)."""
    return pointed.pointed_manifest(core.storage, core.url)


def named_manifest(core: StoreCore, cut: str) -> Manifest:
    """The manifest of ``cut`` read as one object (:func:`ckptstore.pointed.named_manifest`)."""
    return pointed.named_manifest(core.storage, core.url, cut)


@dataclass(frozen=True)
class Chosen:
    """The cut to resume from across the tiers (issue 21): its info (None: no tier holds a cut), the cuts
    skipped (id -> why), the tier whose copy verified ("local" or "mirror") and the handle to read it by."""

    info: CutInfo | None
    skipped: dict[str, str]
    tier: str
    core: StoreCore


def choose(core: StoreCore, *, fallback: bool,
           mirror: StoreCore | None = None) -> tuple[CutInfo | None, dict[str, str]]:
    """See :meth:`ckptstore.Store.choose`."""
    chosen = choose_tiers(core, mirror, fallback=fallback)
    return chosen.info, chosen.skipped


def choose_tiers(core: StoreCore, mirror: StoreCore | None, *, fallback: bool,
                 mirror_check: Check | None = None) -> Chosen:
    """The cut to resume from in the local tier ``core`` and its ``mirror`` (None: the local tier alone,
    as ever), by :func:`ckptstore.selection.choose_across`. A copy proven damaged is recorded bad in its
    own tier; each skip is logged and emitted on the local handle's events (naming the tier's copy when
    there is a mirror). The mirror is only read: nothing here waits for, or locks, the local tier.
    ``mirror_check`` checks a mirror copy instead of verify (a restore loads it: one download)."""
    cores = [core] if mirror is None else [core, mirror]
    checks = [None, mirror_check]
    tiers = [Tier(name, c.storage, c.classify(), on_bad=functools.partial(record_bad_quietly, c), check=check)
             for name, c, check in zip(("local", "mirror"), cores, checks)]
    choice = choose_across(tiers, fallback=fallback)
    urls = {t.name: t.storage.url for t in tiers}
    for name, bad_cut, why in choice.skips:
        core.events.emit("fallback-skipped", cut=bad_cut, reason=f"{name} copy: {why}" if choice.several else why)
        log.warning("ckptstore: skipped cut %s of %s: %s", bad_cut, urls[name], why)
    i = choice.tier or 0
    return Chosen(choice.info, choice.skipped, tiers[i].name, cores[i])


def verify(core: StoreCore, cut: CutSelector | None, *, progress: Progress | None) -> VerifyReport:
    """See :meth:`ckptstore.Store.verify`."""
    cls = core.classify()
    cut_id = None if cut is None else select_manifest(cls, cut, core.url).cut
    return verify_store(core.storage, cls, cut=cut_id, progress=progress)


def rank_manifest(m: Manifest, rank: int | None, url: str, storage: Storage | None = None,
                  cache: PartCache | None = None) -> Manifest:
    """Rank ``rank``'s part of a cut (a cut of one rank is its own part 0); a ``UsageError`` that names
    the cut's world size when ``rank`` is missing for a cut of several ranks, or outside it. A cut of
    version 5 reads the rank's fragment from ``storage`` (one object, checked: ``assemble.read_part``)."""
    if rank is None:
        if m.world_size > 1:
            raise UsageError(f"cut {m.cut} holds the state of {m.world_size} ranks (world size {m.world_size}); "
                             f"pass rank= (0 to {m.world_size - 1}) to load one", store=url, cut=m.cut)
        return m
    try:
        if m.fragmented:
            if storage is None:
                raise ValueError(f"cut {m.cut}'s part of rank {rank} is in its fragment: pass the storage")
            return read_part(storage, url, m, rank, cache)
        return m.for_rank(rank)
    except ValueError as exc:
        raise UsageError(str(exc), store=url, cut=m.cut) from None


__all__ = ["Chosen", "choose", "choose_tiers", "cuts", "latest", "lists_nothing", "load", "load_part", "manifest", "named_manifest",
           "pointed_manifest", "rank_manifest", "restore_files", "restore_part_files", "verify", "whole_manifest"]
