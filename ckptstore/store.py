"""The store: a facade over one open handle (:class:`~ckptstore.core.StoreCore`) and the modules that do
the work (issue 20: this module was 950 lines and implemented what it now delegates).

``Store.open(url)`` opens a store as its single writer (taking the writer lock and recovering what a
crash left), ``Store.open(url, readonly=True)`` as one of any number of readers. Writers ``save``
(synchronous: returns once the cut is committed), ``begin_cut`` (a :class:`~ckptstore.pending.PendingCut`
for writers that write files elsewhere), ``prune``, ``gc`` and ``repair``; everyone can ``latest``,
``cuts``, ``manifest``, ``verify`` and ``load``. A handle's :class:`Role` is fixed at open. Every change
to the store goes through the commit protocol (:mod:`ckptstore.protocol`).

Where the work lives: opening (:mod:`~ckptstore.opening`), cuts and rank parts (:mod:`~ckptstore.cutting`,
:mod:`~ckptstore.saving`), reads (:mod:`~ckptstore.reading`), ``prune``/``remove``
(:mod:`~ckptstore.pruning`), ``gc`` and recovery (:mod:`~ckptstore.collect`), labels and final marks
(:mod:`~ckptstore.labeling`), ``repair`` (:mod:`~ckptstore.repairing`). What the writer, the rescue and
DCP need beyond the user API is :mod:`ckptstore.spi`.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, Sequence

from . import collect, cutting, labeling, opening, pruning, reading, repairing, saving
from .attached import FilesArg
from .collect import GcReport, leftover_json
from .core import Role, StoreCore
from .events import Emitter
from .gcpause import pausing
from .info import CutInfo
from .manifest import Manifest
from .options import StoreOptions
from .pending import PendingCut
from .ranks import RankGroup
from .reading import rank_manifest
from .recovery import Leftover
from .retention import Policy
from .selection import CutSelector
from .storage import Storage
from .verify import Progress, VerifyReport

#: Plumbing that left ``Store``'s public face for :mod:`ckptstore.spi` (issue 20), kept working for one
#: minor release by ``Store.__getattr__`` with a ``DeprecationWarning``: old name -> (its new spelling,
#: what it gives bound to the handle's core). They bind the functions spi delegates to, not spi's own:
#: spi imports this module, and importing spi back would be a cycle.
_MOVED: dict[str, tuple[str, Callable[[StoreCore], Any]]] = {
    "lock_handoff": ("ckptstore.spi.lock_handoff(store)", lambda c: functools.partial(cutting.lock_handoff, c)),
    "rank_part": ("ckptstore.spi.rank_part(store, cut, step)", lambda c: functools.partial(cutting.group_rank_part, c)),
    # Readers still write rank parts through the old name, for one release (DCP's ranks opened readonly);
    # spi.rank_part refuses them.
    "rank_part_for": ("ckptstore.spi.rank_part(store, cut, step, rank, world_size)",
                      lambda c: functools.partial(cutting.rank_part, c, reader_ok=True)),
    "shard_codec": ("ckptstore.spi.shard_codec(store)", lambda c: functools.partial(cutting.shard_codec, c)),
    "point_latest": ("ckptstore.spi.point_latest(store, cut)", lambda c: functools.partial(repairing.point_latest, c)),
    "record_bad": ("ckptstore.spi.record_bad(store, cut, reason)",
                   lambda c: functools.partial(repairing.record_bad, c)),
    "classify": ("ckptstore.spi.classify(store)", lambda c: c.classify),
    "participant": ("store.role == 'participant'", lambda c: c.role is Role.PARTICIPANT),
}


class Store:
    """A checkpoint store on one fsspec URL. Use :meth:`open`; close it (or use ``with``)."""

    def __init__(self, core: StoreCore, mirror: StoreCore | None = None) -> None:
        self._core = core
        self._mirror_core = mirror  # the mirror tier's reader (issue 21)
        self._mirror = None if mirror is None else Store(mirror)
        # The lock and protocol, under the names fault tests reach them by (a stalled lease, a guard off).
        self._lock = core.lock
        self._protocol = core.protocol

    # -------------------------------------------------------------------------------------- the handle
    @property
    def url(self) -> str:
        return self._core.url

    @property
    def options(self) -> StoreOptions:
        return self._core.options

    @property
    def role(self) -> Role:
        """What this handle may do (reader, writer or participant), fixed at open."""
        return self._core.role

    @property
    def readonly(self) -> bool:
        """True for a reader (``Store.open(url, readonly=True)``)."""
        return self._core.readonly

    @property
    def storage(self) -> Storage:
        """The storage seam, for reading; every change goes through the commit protocol."""
        return self._core.storage

    @property
    def ranks(self) -> RankGroup | None:
        """The ranks this handle takes cuts with (``Store.open(..., group=)``), None for one process."""
        return self._core.ranks

    @property
    def mirror(self) -> "Store | None":
        """The mirror tier (issue 21) this handle reads too, a reader; None without one or none there yet."""
        return self._mirror

    @property
    def events(self) -> Emitter:
        return self._core.events

    @property
    def recovered(self) -> list[Leftover]:
        """What recovery removed when this handle opened as the writer (``GcReport.at_open``)."""
        return self._core.recovered

    # ------------------------------------------------------------------------------------------ open
    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str] | Storage,
        *,
        create: bool = False,
        readonly: bool = False,
        options: StoreOptions | None = None,
        group: Any = None,
        rank_timeout: float | None = None,
        recover: bool = True,
        mirror: str | os.PathLike[str] | Storage | None = None, mirror_options: StoreOptions | None = None,
    ) -> "Store":
        """Opens the store at ``url`` (a path, a ``pathlib.Path``, an fsspec URL, or a
        :class:`~ckptstore.storage.Storage`).

        As a writer (default) it takes the writer lock (``StoreLocked`` if another writer has it) and
        recovers: leftovers of interrupted saves and prunes are removed (listed in ``recovered`` and
        in every ``GcReport.at_open``), a stale mark beside a committed cut is cleared. A store whose
        LATEST is missing or broken while committed cuts exist is not reset: opening it raises
        ``LatestError`` that says to run ``ckptstore repair``.

        ``recover=False`` (writers) changes nothing at open: recovery waits for the first change
        (``save``, ``begin_cut``, ``prune`` or ``gc`` without ``dry_run``), so a dry run on such a
        handle deletes nothing and ``gc(dry_run=True)`` lists what recovery would remove.

        ``group`` (a torch.distributed process group) makes the handle one of several ranks taking
        cuts together: the open is collective over the group (every rank passes the same ``url``),
        rank 0 holds the writer lock and recovers, the other ranks join as participants, and ``save``
        is collective. ``rank_timeout`` (seconds, default 300) bounds how long a rank waits for one
        that shows no sign of life (:mod:`ckptstore.ranks`). ``group=None`` is one process, also when
        torch.distributed is initialized.

        ``mirror`` (+ ``mirror_options``), a mirror tier opened readonly (:attr:`mirror`, issue 21): ``choose``,
        ``load("latest")``, ``restore`` take the newest cut verified in either; the rest is the local tier's.
        """
        return cls(*opening.open_tiers(url, mirror, mirror_options, create=create, readonly=readonly,
                                       options=options, group=group, rank_timeout=rank_timeout, recover=recover))

    def close(self) -> None:
        """Releases the writer lock, closes the mirror's handle. Idempotent. Not collective (per rank)."""
        self._core.close()
        if self._mirror is not None:
            self._mirror.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return self._core.describe()

    def __getattr__(self, name: str) -> Any:
        """The old names of what moved to :mod:`ckptstore.spi`, for one release (see ``_MOVED``)."""
        moved = _MOVED.get(name)
        core = self.__dict__.get("_core")
        if moved is None or core is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"Store.{name} is deprecated (issue 20) and goes in the next minor release: use "
                      f"{moved[0]}", DeprecationWarning, stacklevel=2)
        return moved[1](core)

    # ----------------------------------------------------------------------------------------- reads
    def cuts(self) -> list[CutInfo]:
        """Committed cuts, ascending by step."""
        return reading.cuts(self._core)

    def latest(self) -> CutInfo | None:
        """The committed cut LATEST points at, or None for an empty store."""
        return reading.latest(self._core)

    def manifest(self, cut: CutSelector = "latest") -> Manifest:
        """The manifest of a committed cut: "latest", a cut id, or an int step. A cut of several ranks
        committed as format 5 (a commit record and a fragment per rank, issue 22) is given whole, every
        fragment read and checked: as a manifest of format 3 holds it (``Manifest.for_rank`` works).
        ``load(rank=r)`` reads one fragment only."""
        return reading.whole_manifest(self._core, cut)

    @pausing
    def load(
        self,
        cut: CutSelector = "latest",
        *,
        map_location: Any = "cpu",
        verify: bool = True,
        keys: Sequence[str] | None = None,
        allow_pickle: bool = False,
        fallback: bool = False,
        rank: int | None = None,
        allowed_types: Sequence[type] | None = None,
    ) -> Any:
        """The state saved in a committed cut (see :func:`ckptstore.load`)."""
        return reading.load(self._core, cut, map_location=map_location, verify=verify, keys=keys,
                            allow_pickle=allow_pickle, fallback=fallback, rank=rank, allowed_types=allowed_types,
                            mirror=self._mirror_core)

    def restore_files(self, cut: CutSelector = "latest", to: str | os.PathLike[str] = ".", *,
                      rank: int | None = None, overwrite: bool = True, verify: bool = True) -> list[str]:
        """Puts the files attached to ``cut`` (``save(files=)``, ``maybe_cut(files=)``) back under the
        directory ``to`` and returns the paths written: each file's bytes as they were at the cut. They
        stream through a bounded buffer, hashed as read, into fsynced temporary files that replace the
        old ones only once every byte was read and verified (a damaged cut changes nothing under
        ``to``). Files under ``to`` the cut does not hold are left alone. ``rank`` as in :meth:`load`
        (a store opened with ``group=`` restores its own rank's). Without ``overwrite`` existing files
        are refused, all named, before anything is written. Each file gets the permission bits it had at
        the cut (docs/format.md, "Attached files"); a refusal of ``to``'s file system (a full disk) is a
        ``StorageError`` naming the store, the cut and the file."""
        return reading.restore_files(self._core, cut, to, rank=rank, overwrite=overwrite, verify=verify)

    def choose(self, *, fallback: bool) -> tuple[CutInfo | None, dict[str, str]]:
        """The cut to resume from (see :func:`ckptstore.selection.choose_across`): with a mirror, the
        newest that verifies in either tier. With ``fallback`` the copies proven damaged are recorded bad
        in their own tier, and each skip is logged and emitted."""
        return reading.choose(self._core, fallback=fallback, mirror=self._mirror_core)

    @pausing
    def verify(self, cut: CutSelector | None = None, *, progress: Progress | None = None) -> VerifyReport:
        """Re-hashes every file of every committed cut (or one cut) and reports every finding."""
        return reading.verify(self._core, cut, progress=progress)

    # ---------------------------------------------------------------------------------------- writes
    def begin_cut(self, step: int, *, writer: str = "store.save", cut: str | None = None,
                  world_size: int = 1) -> PendingCut:
        """Marks a new cut at ``step`` in flight and returns its lifecycle object (writers only).

        ``step`` must be above the committed LATEST step (``StepConflict`` otherwise: re-saving an
        old step would silently roll LATEST back). ``cut`` fixes the id (default: a fresh one).
        ``world_size`` > 1: a cut of that many ranks, committed from their records (``collect_ranks``)."""
        return cutting.begin_cut(self._core, step, writer=writer, cut=cut, world_size=world_size)

    @pausing
    def save(
        self,
        state: Any,
        *,
        step: int,
        tags: Sequence[str] = (),
        final: bool = False,
        metadata: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        files: FilesArg | None = None,
    ) -> CutInfo:
        """Writes ``state`` as a new cut and commits it; returns once LATEST names it durably.

        ``step`` must be above the committed LATEST step (``StepConflict`` otherwise). Values that
        need pickle are refused unless ``allow_pickle`` is passed. ``files``: files that belong to the
        cut (paths of files or directories, or {stored path: source path}), read now, hashed with the
        cut and put back by :meth:`restore_files` (docs/format.md, "Attached files").

        On a store opened with ``group=`` it is collective: every rank passes its own ``state`` and
        the same ``step``, tags and flags; one cut holds every rank's state, committed by rank 0 once
        all ranks' files are durable. Any rank's failure leaves LATEST where it was and raises on
        every rank (``RankFailure`` naming the ranks that failed, on the others).
        """
        return saving.save(self._core, state, step=step, tags=tags, final=final, metadata=metadata,
                           allow_pickle=allow_pickle, files=files)

    def prune(self, policy: Policy, *, dry_run: bool = False, verify_kept: bool = True,
              progress: Progress | None = None) -> list[CutInfo]:
        """Removes committed cuts that ``policy`` does not keep; returns them (with ``dry_run``: the
        ones it would remove, removing nothing).

        Never removed whatever the policy says: the LATEST target, a cut newer than the newest kept one,
        a cut tagged "keep". Cuts recorded bad are neither counted as kept nor removed here (``gc``
        reports them). Each removal uncommits first (manifest deleted durably), then deletes files.

        ``verify_kept`` (default): before removing anything, the newest kept cut is verified (every
        byte re-hashed; a cut this handle committed itself was hashed as it was written and is taken as
        verified, so a trainer's prune after each save costs no reads). If it does not verify, the
        newest cut that does is kept too, so a prune never takes a store that had a verifying cut to
        none (issue 10, item 5); when no cut verifies, nothing is removed and ``CorruptCut`` is raised.
        An I/O error while verifying raises and removes nothing. ``verify_kept=False`` skips this.
        """
        return pruning.prune(self._core, policy, dry_run=dry_run, verify_kept=verify_kept, progress=progress)

    def remove(self, cut: CutSelector, *, dry_run: bool = False, verify_kept: bool = True,
               progress: Progress | None = None) -> CutInfo:
        """Removes one committed cut ("latest" is refused; a cut id or an int step) under prune's rules,
        and returns what it removed (with ``dry_run``: would remove, removing nothing).

        Refused with ``UsageError`` naming the cut: LATEST's target (a resume needs it; commit a newer
        cut or point LATEST elsewhere first), a cut tagged "keep", a cut this handle is still writing.
        With ``verify_kept`` (default) a store never goes from having a verifying cut to having none:
        when the cut to remove is the newest that verifies while LATEST's does not, it is refused
        (``CorruptCut``). Like a prune it uncommits first (manifest deleted durably), then deletes the
        files; a crash midway leaves what ``gc`` removes."""
        return pruning.remove(self._core, cut, dry_run=dry_run, verify_kept=verify_kept, progress=progress)

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Removes what interrupted saves and prunes left behind; reports foreign files and never
        deletes them. Needs the writer lock, so every marked cut not in flight in this process
        belongs to a dead writer. Refuses while LATEST is broken: which marked cut it names (and so
        which is committed) cannot be told then.

        Every removal is reported: ``removed`` (what this call removed, or with ``dry_run`` would
        remove) and ``at_open`` (what this handle's writer open removed before). ``dry_run`` changes
        nothing; on a handle opened with ``recover=False`` it lists all that recovery would remove."""
        return collect.gc(self._core, dry_run=dry_run)

    def repair(self, *, progress: Progress | None = None) -> CutInfo | None:
        """Points LATEST at the newest committed cut that verifies (or removes LATEST when no cut is
        committed). Raises ``CorruptCut`` when committed cuts exist but none verifies, and the I/O
        error when a cut could not be read (a transient error never makes repair skip a good cut)."""
        return repairing.repair(self._core, progress=progress)

    # labels ---------------------------------------------------------------------------------------
    def label(self, name: str, cut: CutSelector = "latest") -> CutInfo:
        """Names a committed cut ``name`` (any text up to 1024 characters), replacing what the label
        named before: one durable write of ``labels/<digest>.json`` (``ckptstore.labels``). Returns the
        cut's CutInfo. Frameworks that name checkpoints by path map their paths onto cuts this way."""
        return labeling.label(self._core, name, cut)

    def unlabel(self, name: str) -> str | None:
        """Removes a label; returns the cut it named, or None when no such label exists. The cut stays."""
        return labeling.unlabel(self._core, name)

    def labels(self) -> dict[str, str]:
        """Every label and the committed cut it names (labels of cuts that are gone are left out)."""
        return labeling.labels(self._core)

    def mark_final(self, cut: CutSelector = "latest") -> CutInfo:
        """Marks a committed cut final without writing it again (default: LATEST's), so ``resume-info``
        reports the step where the run really ended and ``KeepFinal`` keeps it: for a run whose last
        periodic cut already holds its final state. One durable write of ``final/<cut>.json``; the
        manifest and LATEST are untouched. Idempotent; returns the cut's CutInfo (final)."""
        return labeling.mark_final(self._core, cut)


def core_of(store: Store) -> StoreCore:
    """The core under a facade, for :mod:`ckptstore.spi` (the one way in from outside this module)."""
    return store._core


def open_for_repair(url: str | Storage, options: StoreOptions | None = None) -> Store:
    """A writer handle without recovery, for ``ckptstore repair`` on a store whose LATEST is broken."""
    return Store(opening.open_for_repair(url, options))


# Paused here too, not only in Store.load: the collector then runs once the store is closed and the
# manifest it cached is freed, and scans the state alone (issue 23: a manifest of 40,000 arrays is
# ~190,000 objects, 0.04 s of one collection).
@pausing
def load(
    url: str | os.PathLike[str] | Store,
    cut: CutSelector = "latest",
    *,
    map_location: Any = "cpu",
    verify: bool = True,
    keys: Sequence[str] | None = None,
    allow_pickle: bool = False,
    fallback: bool = False,
    storage_options: dict[str, Any] | None = None,
    rank: int | None = None,
    allowed_types: Sequence[type] | None = None,
    mirror: str | os.PathLike[str] | Storage | None = None,
    mirror_options: StoreOptions | None = None,
) -> Any:
    """Loads a committed cut: "latest" (default), a cut id, or an int step.

    A cut of several ranks (saved with ``group=``) holds one state per rank: ``rank=r`` loads rank r's
    (``keys`` then selects among its keys); without ``rank`` such a cut raises ``UsageError`` naming
    its world size. A rank's DTensors load as their local shards (plain tensors).

    Every byte read is checked against the manifest's blake3 (``verify=False`` skips the hashes but
    never the size and header checks); a damaged or torn cut raises rather than returning. ``keys``
    loads only those top-level keys and reads only their bytes. ``map_location`` moves tensors.
    ``fallback=True`` (with ``cut="latest"``) walks back from a LATEST that fails verification to the
    newest cut that verifies, logs what it skipped and why, and records the bad cuts so no restart tries
    them again. ``allowed_types`` (a list of classes, e.g. ``[Color, OptimCfg]``) are the user classes
    whose enum members, dataclasses, namedtuples and class objects come back as themselves, matched by
    qualified name; the others come back in plain shapes (docs/format.md). Nothing is imported by name.

    ``mirror`` (with ``mirror_options``): the mirror tier (issue 21); both are opened readonly, "latest"
    is the newest cut that verifies in either, and a missing local store loads from the mirror alone.
    """
    kw = dict(map_location=map_location, verify=verify, keys=keys, allow_pickle=allow_pickle, fallback=fallback,
              rank=rank, allowed_types=allowed_types)
    if isinstance(url, Store):
        return url.load(cut, **kw)  # type: ignore[arg-type]
    tiers = opening.open_tiers(url, mirror, mirror_options, alone_ok=True, readonly=True,
                               options=StoreOptions(storage_options=storage_options))
    with Store(*tiers) as store:
        return store.load(cut, **kw)  # type: ignore[arg-type]


__all__ = ["CutSelector", "GcReport", "Role", "Store", "core_of", "leftover_json", "load", "open_for_repair",
           "rank_manifest"]
