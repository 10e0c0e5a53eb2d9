"""The store: composes the layout, storage seam, commit protocol, recovery, retention and audits.

``Store.open(url)`` opens a store as its single writer (taking the writer lock and recovering what a
crash left), ``Store.open(url, readonly=True)`` as one of any number of readers. Writers ``save``
(synchronous: returns once the cut is committed), ``begin_cut`` (a :class:`~ckptstore.pending.PendingCut`
for writers that write files elsewhere), ``prune``, ``gc`` and ``repair``; everyone can ``latest``,
``cuts``, ``manifest``, ``verify`` and ``load``. Every change to the store goes through the commit
protocol (:mod:`ckptstore.protocol`); this module composes, it does not touch marks or LATEST.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from . import hashing, layout, saving
from .arrays import resolve_map_location
from .attached import FilesArg, Restorer
from .errors import (
    CorruptCut,
    CutNotFound,
    HostileInput,
    LatestError,
    StepConflict,
    StorageError,
    StoreNotFound,
    UsageError,
)
from .events import Emitter, log
from .gcpause import pausing
from .info import CutInfo
from .intent import ShardSpec
from .latest import StoreIdentity
from .loader import load_manifest, restore_attached
from .lock import WriterLock
from .manifest import Manifest
from .labels import MAX_LABEL, Label, label_path
from .marks import BadCut, FinalMark
from .options import StoreOptions
from .pending import COMMITTED, PendingCut, RankPart
from .protocol import CommitProtocol, now_iso
from .ranks import DEFAULT_RANK_TIMEOUT, RankFailure, RankGroup, check_all_ok, outcome, store_namespace
from .recovery import Classification, Leftover, ManifestCache, classify_now
from .retention import PINNED_TAG, Policy, hard_keeps
from .selection import CutSelector, choose_cut, latest_manifest, raise_io_errors, select_manifest
from .shards import Codec
from .storage import Storage, open_storage, store_url
from .verify import Progress, VerifyReport, verify_store


def leftover_json(x: Leftover) -> dict[str, Any]:
    return {"cut": x.cut, "kind": x.kind, "paths": x.paths, "owner": x.owner, "owner_alive": x.owner_alive}


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``) and what it left alone.

    ``at_open`` is what this handle's writer open already removed (its recovery), so no removal goes
    unreported; ``removed`` is what this call removed. Open with ``recover=False`` to have one ``gc``
    (or a dry run) see everything."""

    removed: list[Leftover] = field(default_factory=list)
    kept: list[Leftover] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    dry_run: bool = False
    at_open: list[Leftover] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "removed": [leftover_json(x) for x in self.removed],
                "kept": [leftover_json(x) for x in self.kept], "foreign": self.foreign,
                "removed_at_open": [leftover_json(x) for x in self.at_open]}


class Store:
    """A checkpoint store on one fsspec URL. Use :meth:`open`; close it (or use ``with``)."""

    def __init__(self, storage: Storage, options: StoreOptions, readonly: bool) -> None:
        self.storage = storage  # for reading; every change goes through self._protocol
        self.url = storage.url
        self.options = options
        self.readonly = readonly
        self.events = Emitter(self.url, options.on_event)
        self._lock = WriterLock(storage, options.lease_ttl_s, options.orphan_wait_s)
        self._protocol = CommitProtocol(storage, options.on_phase, guard=self._lock.ensure_held)
        self._in_flight: dict[str, PendingCut] = {}
        self._manifests: ManifestCache = {}
        self._closed = False
        #: What recovery removed when this handle opened as the writer (``GcReport.at_open``).
        self.recovered: list[Leftover] = []
        #: ``Store.open(..., recover=False)``: recovery waits for the first change (save, prune, gc).
        self._recovery_pending = False
        #: Cuts this handle committed: hashed as they were written, so ``prune`` takes them as verified.
        self._written: set[str] = set()
        #: The ranks this handle takes cuts with (``Store.open(..., group=)``), None for one process.
        self.ranks: RankGroup | None = None
        #: True on ranks other than 0 of a group: they write their part of each cut; rank 0 holds the
        #: writer lock and commits.
        self.participant = False

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
        """
        url = url if isinstance(url, Storage) else store_url(url)  # a pathlib.Path too (issue 19 item 11)
        if group is not None and not recover:
            raise UsageError("recover=False is for one process; a group's open always recovers", store=str(url))
        if group is not None:
            return cls._open_group(url, group=group, rank_timeout=rank_timeout, create=create, readonly=readonly,
                                   options=options)
        if rank_timeout is not None:
            raise UsageError("rank_timeout goes with group=", store=str(url))
        store = cls._open(url, create=create, readonly=readonly, options=options)
        if not readonly and not recover:
            store._recovery_pending = True
        elif not readonly:
            try:
                store._recover()
            except BaseException:
                store.close()
                raise
        return store

    @classmethod
    def _open_group(cls, url: str | Storage, *, group: Any, rank_timeout: float | None, create: bool, readonly: bool,
                    options: StoreOptions | None) -> "Store":
        name = url.url if isinstance(url, Storage) else str(url)
        ranks = RankGroup(group, rank_timeout=DEFAULT_RANK_TIMEOUT if rank_timeout is None else rank_timeout,
                          namespace=store_namespace(name), store=name)
        if ranks.size == 1:
            ranks.close()
            return cls.open(url, create=create, readonly=readonly, options=options)
        try:
            # Beating throughout: rank 0's writer open may wait minutes for a dead trainer's writer
            # process to finish its cut while the others wait for it (issue 19 item 7).
            with ranks.busy():
                store = cls._open_ranks(url, ranks, create=create, readonly=readonly, options=options)
        except BaseException:
            ranks.close()
            raise
        store.ranks = ranks
        return store

    @classmethod
    def _open_ranks(cls, url: str | Storage, ranks: RankGroup, *, create: bool, readonly: bool,
                    options: StoreOptions | None) -> "Store":
        """The collective open's body: rank 0 opens as the writer (or every rank readonly), then the
        others join as participants; every rank raises if any failed."""
        where = {"store": url.url if isinstance(url, Storage) else str(url)}
        store: Store | None = None
        try:
            if readonly:
                err: BaseException | None = None
                try:
                    store = cls.open(url, readonly=True, options=options)
                except BaseException as exc:  # noqa: BLE001 - every rank hears of it below
                    err = exc
                msgs = ranks.exchange("open", outcome(err), **where)
                if err is not None:
                    raise err
                check_all_ok(msgs, "opening the store", **where)
            else:
                err = None
                if ranks.rank == 0:
                    try:
                        store = cls.open(url, create=create, options=options)
                    except BaseException as exc:  # noqa: BLE001
                        err = exc
                first = ranks.exchange("open-writer", outcome(err), senders=[0], **where)[0]
                if err is not None:
                    raise err
                if not first["ok"]:
                    raise RankFailure(f"rank 0 could not open the store as its writer: {first['error']}", ranks=[0],
                                      **where)
                if ranks.rank != 0:
                    try:
                        store = cls._open(url, create=False, readonly=True, options=options)
                        store.readonly, store.participant = False, True
                    except BaseException as exc:  # noqa: BLE001
                        err = exc
                msgs = ranks.exchange("open-participants", outcome(err), **where)
                if err is not None:
                    raise err
                check_all_ok(msgs, "joining the store", **where)
            assert store is not None
            return store
        except BaseException:
            if store is not None:
                store.close()
            raise

    @classmethod
    def _open(cls, url: str | Storage, *, create: bool, readonly: bool, options: StoreOptions | None) -> "Store":
        options = options or StoreOptions()
        # A Storage instance is accepted as is: custom backends, and the power-loss simulator in tests.
        storage = url if isinstance(url, Storage) else open_storage(url, storage_options=options.storage_options)
        if not storage.exists(layout.STORE_FILE):
            if not create or readonly:
                raise StoreNotFound("no ckptstore store here", store=storage.url, path=layout.STORE_FILE,
                                    hint="pass create=True to make one" if not readonly else None)
            # A directory holding only our own names is a creation that crashed before STORE.json
            # was durable: finish it. Anything else is someone's data: never take it over.
            foreign = [e.name for e in storage.list_dir("")
                       if e.name not in layout.ROOT_ENTRIES and not layout.is_tmp_name(e.name)]
            if foreign:
                raise UsageError(f"refusing to create a store in a non-empty directory ({foreign[:3]})",
                                 store=storage.url)
            cls._create(storage)
        else:
            StoreIdentity.from_bytes(storage.read_bytes(layout.STORE_FILE), store=storage.url, path=layout.STORE_FILE)
        store = cls(storage, options, readonly)
        if not readonly:
            try:
                store._lock.acquire()
                store._own_dirs(layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR)
            except BaseException:
                store.close()
                raise
        return store

    def _own_dirs(self, *dirs: str) -> None:
        """Recreates the store's own directories that someone deleted (an operator "cleaning up"
        ``marks/``): they hold nothing but the store's bookkeeping, and without ``marks/`` every save
        fails (issue 10, item 11). An existing one costs one failed mkdir."""
        for d in dirs:
            self.storage.make_dir(d)

    @staticmethod
    def _create(storage: Storage) -> None:
        root = storage.local_path("") if storage.capabilities.local_paths else None
        if root is not None:
            _make_root(root, storage.url)
        for d in (layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR):
            storage.make_dir(d)
        storage.write_durably(layout.STORE_FILE, StoreIdentity(created_at=now_iso()).to_bytes())

    def _recover(self) -> None:
        report = self._collect(dry_run=False)
        self._recovery_pending = False
        self.recovered = list(report.removed)
        for lo in report.removed:
            self.events.emit("recovered", cut=lo.cut, kind=lo.kind, paths=lo.paths)

    def _ensure_recovered(self) -> None:
        """Runs the recovery a ``recover=False`` open put off, before the first change: a stale mark
        left beside the LATEST cut must be cleared before LATEST moves on, or that cut would read as
        in progress."""
        if self._recovery_pending:
            self._recover()

    def close(self) -> None:
        """Releases the writer lock. Idempotent. Not collective: each rank closes its own handle."""
        if not self._closed:
            self._closed = True
            if self.ranks is not None:
                self.ranks.close()
            if not self.participant:
                self._lock.release()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "readonly" if self.readonly else "participant" if self.participant else "writer"
        if self.ranks is not None:
            role += f", rank {self.ranks.rank} of {self.ranks.size}"
        return f"Store({self.url!r}, {role})"

    def _require_writer(self, what: str, *, participant_ok: bool = False) -> None:
        if self._closed:
            raise UsageError(f"{what} on a closed store", store=self.url)
        if self.readonly:
            raise UsageError(f"{what} needs a writer; this store was opened readonly", store=self.url)
        if self.participant:
            if participant_ok:
                return
            assert self.ranks is not None
            raise UsageError(f"{what} is rank 0's job: rank {self.ranks.rank} takes part in cuts but does not hold "
                             "the writer lock", store=self.url)
        self._lock.ensure_held()

    # ----------------------------------------------------------------------------------------- reads
    @pausing
    def classify(self) -> Classification:
        """What is on disk right now (see :mod:`ckptstore.recovery`)."""
        return classify_now(self.storage, self._manifests)

    def cuts(self) -> list[CutInfo]:
        """Committed cuts, ascending by step."""
        cls = self.classify()
        return [cls.info(m) for m in cls.committed]

    def latest(self) -> CutInfo | None:
        """The committed cut LATEST points at, or None for an empty store."""
        cls = self.classify()
        m = latest_manifest(cls, self.url)
        return None if m is None else cls.info(m)

    def manifest(self, cut: CutSelector = "latest") -> Manifest:
        """The manifest of a committed cut: "latest", a cut id, or an int step."""
        return select_manifest(self.classify(), cut, self.url)

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
        if fallback and cut == "latest":
            info, skipped = self.choose(fallback=True)
            if info is None:
                raise CutNotFound("the store has no committed cut yet", store=self.url)
            cut = info.id
        m = rank_manifest(self.manifest(cut), rank, self.url)
        if m.pickled and not allow_pickle:
            raise HostileInput("cut holds pickled values; pass allow_pickle=True only if you trust it",
                               store=self.url, cut=m.cut)
        map_location = resolve_map_location(map_location, {"store": self.url, "cut": m.cut})
        return load_manifest(self.storage, m, map_location=map_location, verify=verify, keys=keys,
                             allow_pickle=allow_pickle, allowed_types=allowed_types)

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
        if rank is None and self.ranks is not None:
            rank = self.ranks.rank
        m = rank_manifest(self.manifest(cut), rank, self.url)
        where = {"store": self.url, "cut": m.cut}
        with Restorer(m.attached, os.fspath(to), overwrite=overwrite, where=where) as restorer:
            restore_attached(self.storage, m, restorer, verify=verify)
            return restorer.commit()

    def choose(self, *, fallback: bool) -> tuple[CutInfo | None, dict[str, str]]:
        """The cut to resume from (see :func:`ckptstore.selection.choose_cut`); with ``fallback`` the
        cuts proven damaged are recorded bad, and each skip is logged and emitted."""
        info, skipped = choose_cut(self.storage, self.classify(), fallback=fallback, on_bad=self._record_bad_quietly)
        for bad_cut, why in skipped.items():
            self.events.emit("fallback-skipped", cut=bad_cut, reason=why)
            log.warning("ckptstore: skipped cut %s of %s: %s", bad_cut, self.url, why)
        return info, skipped

    @pausing
    def verify(self, cut: CutSelector | None = None, *, progress: Progress | None = None) -> VerifyReport:
        """Re-hashes every file of every committed cut (or one cut) and reports every finding."""
        cls = self.classify()
        cut_id = None if cut is None else select_manifest(cls, cut, self.url).cut
        return verify_store(self.storage, cls, cut=cut_id, progress=progress)

    # ---------------------------------------------------------------------------------------- writes
    def shard_codec(self) -> Codec:
        """How this store's shards are encoded (the one source of shard settings)."""
        return Codec("zstd", self.options.zstd_level) if self.options.compression == "zstd" else Codec()

    def begin_cut(self, step: int, *, writer: str = "store.save", cut: str | None = None,
                  world_size: int = 1) -> PendingCut:
        """Marks a new cut at ``step`` in flight and returns its lifecycle object (writers only).

        ``step`` must be above the committed LATEST step (``StepConflict`` otherwise: re-saving an
        old step would silently roll LATEST back). ``cut`` fixes the id (default: a fresh one).
        ``world_size`` > 1: a cut of that many ranks, committed from their records (``collect_ranks``)."""
        self._require_writer("begin_cut")
        self._ensure_recovered()
        self._check_step(step)
        if cut is None:
            cut = layout.new_cut_id(step)
        elif layout.check_cut_id(cut, store=self.url) and layout.step_of_cut_id(cut) != step:
            raise UsageError(f"cut id {cut} does not match step {step}", store=self.url, cut=cut)
        pending = PendingCut(self._protocol, self.storage, cut, step, writer, on_end=self._ended, world_size=world_size,
                             shards=ShardSpec.of(self.options))
        self._in_flight[cut] = pending
        try:
            self._own_dirs(layout.MARKS_DIR)
            self._protocol.mark(cut, step, writer)
        except BaseException:
            self._protocol.abandon(cut)
            self._in_flight.pop(cut, None)
            raise
        return pending

    def _ended(self, pending: PendingCut) -> None:
        self._in_flight.pop(pending.id, None)
        if pending.state == COMMITTED:
            self._written.add(pending.id)

    def lock_handoff(self) -> tuple[dict[str, Any], int | None]:
        """The writer lock as a helper process inherits it (``ckptstore.lock.InheritedLock``): a
        description and, for a flock, the descriptor to pass along (a rank other than 0 holds none)."""
        if self.readonly or self.participant:
            return {"kind": "none"}, None
        return self._lock.handoff(), self._lock.lock_fd()

    def rank_part(self, cut: str, step: int) -> RankPart:
        """This rank's share of cut ``cut`` that rank 0 marked (stores opened with ``group=``)."""
        self._require_writer("writing a rank's part", participant_ok=True)
        if self.ranks is None:
            raise UsageError("rank parts belong to stores opened with group=", store=self.url)
        return self.rank_part_for(cut, step, self.ranks.rank, self.ranks.size)

    def rank_part_for(self, cut: str, step: int, rank: int, world_size: int) -> RankPart:
        """Rank ``rank``'s share of cut ``cut`` of ``world_size`` ranks that a coordinator elsewhere
        marked, without a group (``ckptstore.dcp``: the cut travels in DCP's plans). Allowed on a
        readonly handle: a rank part only writes shards and its record into a marked cut, holds no
        lock and commits nothing (as a participant does)."""
        if self._closed:
            raise UsageError("writing a rank's part on a closed store", store=self.url)
        layout.check_cut_id(cut, store=self.url)
        for what, v, low in (("rank", rank, 0), ("world_size", world_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= layout.MAX_WORLD_SIZE:
                raise UsageError(f"{what} must be an int in [{low}, {layout.MAX_WORLD_SIZE}], got {v!r}", store=self.url)
        if rank >= world_size:
            raise UsageError(f"rank {rank} is outside world size {world_size}", store=self.url, cut=cut)
        if layout.step_of_cut_id(cut) != step:
            raise UsageError(f"cut id {cut} does not match step {step}", store=self.url, cut=cut)
        self._protocol.open_rank_dir(cut)
        return RankPart(self._protocol, self.storage, cut, step, rank, world_size, shards=ShardSpec.of(self.options))

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
        self._require_writer("save", participant_ok=self.ranks is not None)
        return saving.save(self, state, step=step, tags=tags, final=final, metadata=metadata,
                           allow_pickle=allow_pickle, files=files)

    def _check_step(self, step: int) -> None:
        layout.check_step(step, store=self.url)
        latest = latest_manifest(self.classify(), self.url)
        if latest is not None and step <= latest.step:
            raise StepConflict(
                f"step {step} is not above the committed LATEST step {latest.step}", store=self.url,
                cut=latest.cut, hint="steps must increase; resume from LATEST and continue from its step",
            )

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
        self._require_writer("prune")
        if not dry_run:
            self._ensure_recovered()
        cls = self.classify()
        latest = latest_manifest(cls, self.url)
        good = [cls.info(m) for m in cls.committed if m.cut not in cls.bad]
        keep = policy.keep(good)
        hard = hard_keeps(good, keep, latest.cut if latest else None)
        doomed = [c for c in good if c.id not in keep and c.id not in hard and c.id not in self._in_flight]
        if doomed and verify_kept:
            spared = self._verifying_cut_to_spare(cls, good, {c.id for c in doomed}, progress)
            if spared is not None:
                doomed = [c for c in doomed if c.id != spared]
        for c in doomed:
            if not dry_run:
                self._protocol.uncommit(c.id)
                self._written.discard(c.id)
            self.events.emit("pruned", cut=c.id, step=c.step, dry_run=dry_run)
        if not dry_run:
            self._drop_labels(cls, {c.id for c in doomed})
        return doomed

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
        self._require_writer("remove")
        if isinstance(cut, str) and cut == "latest":
            raise UsageError("remove takes a cut id or a step, not \"latest\": LATEST's cut is never removed",
                             store=self.url)
        if not dry_run:
            self._ensure_recovered()
        cls = self.classify()
        m = select_manifest(cls, cut, self.url)
        info = cls.info(m)
        latest = latest_manifest(cls, self.url)
        refusal = None
        if latest is not None and latest.cut == m.cut:
            refusal = "it is LATEST's target (commit a newer cut first)"
        elif PINNED_TAG in m.tags:
            refusal = f"it is tagged {PINNED_TAG!r}"
        elif m.cut in self._in_flight:
            refusal = "this handle is still writing it"
        if refusal is not None:
            raise UsageError(f"cut {m.cut} (step {m.step}) is not removed: {refusal}", store=self.url, cut=m.cut)
        if verify_kept and m.cut not in cls.bad:
            good = [cls.info(x) for x in cls.committed if x.cut not in cls.bad]
            if self._verifying_cut_to_spare(cls, good, {m.cut}, progress) == m.cut:
                raise CorruptCut(f"cut {m.cut} (step {m.step}) is not removed: it is the newest cut that verifies "
                                 "and LATEST's does not", store=self.url, cut=m.cut,
                                 hint="run `ckptstore repair` to point LATEST at it; `--no-verify` skips this check")
        if not dry_run:
            self._protocol.uncommit(m.cut)
            self._written.discard(m.cut)
            self._drop_labels(cls, {m.cut})
        self.events.emit("removed", cut=m.cut, step=m.step, dry_run=dry_run)
        return info

    def _drop_labels(self, cls: Classification, cuts: set[str]) -> None:
        """After ``cuts`` were uncommitted: their labels go too (a crash before leaves stale labels, gc)."""
        for name, cut in cls.labels.items():
            if cut in cuts:
                self._protocol.remove_label_file(label_path(name))

    # labels ---------------------------------------------------------------------------------------
    def label(self, name: str, cut: CutSelector = "latest") -> CutInfo:
        """Names a committed cut ``name`` (any text up to 1024 characters), replacing what the label
        named before: one durable write of ``labels/<digest>.json`` (``ckptstore.labels``). Returns the
        cut's CutInfo. Frameworks that name checkpoints by path map their paths onto cuts this way."""
        self._require_writer("label")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_LABEL:
            raise UsageError(f"a label is a str of 1 to {MAX_LABEL} characters, got {name!r:.80}", store=self.url)
        cls = self.classify()
        m = select_manifest(cls, cut, self.url)
        if cls.labels.get(name) != m.cut:
            self._own_dirs(layout.LABELS_DIR)
            self._protocol.write_label(Label(label=name, cut=m.cut, step=m.step, labeled_at=now_iso()))
            self.events.emit("labeled", cut=m.cut, step=m.step, label=name)
        return cls.info(m)

    def unlabel(self, name: str) -> str | None:
        """Removes a label; returns the cut it named, or None when no such label exists. The cut stays."""
        self._require_writer("unlabel")
        cut = self.classify().labels.get(name)
        if cut is not None:
            self._protocol.remove_label_file(label_path(name))
            self.events.emit("unlabeled", cut=cut, label=name)
        return cut

    def labels(self) -> dict[str, str]:
        """Every label and the committed cut it names (labels of cuts that are gone are left out)."""
        return dict(self.classify().labels)

    def mark_final(self, cut: CutSelector = "latest") -> CutInfo:
        """Marks a committed cut final without writing it again (default: LATEST's), so ``resume-info``
        reports the step where the run really ended and ``KeepFinal`` keeps it: for a run whose last
        periodic cut already holds its final state. One durable write of ``final/<cut>.json``; the
        manifest and LATEST are untouched. Idempotent; returns the cut's CutInfo (final)."""
        self._require_writer("mark_final")
        cls = self.classify()
        m = select_manifest(cls, cut, self.url)
        if not (m.final or m.cut in cls.final):
            self._own_dirs(layout.FINAL_DIR)
            self._protocol.mark_final(FinalMark(cut=m.cut, step=m.step, marked_at=now_iso()))
            self.events.emit("marked-final", cut=m.cut, step=m.step)
        return CutInfo.from_manifest(m, marked_final=True)

    def _verifying_cut_to_spare(self, cls: Classification, good: list[CutInfo], doomed: set[str],
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
            if c.id not in self._written:
                report = verify_store(self.storage, cls, cut=c.id, progress=progress)
                raise_io_errors(report)  # could not read: proves nothing, so remove nothing
                if not report.ok:
                    failed[c.id] = report.errors[0].message
                    continue
            if c.id not in doomed:
                return None
            reason = f"no kept cut verifies ({'; '.join(list(failed.values())[:2]) or 'none is kept'})"
            self.events.emit("prune-spared", cut=c.id, step=c.step, reason=reason)
            log.warning("ckptstore: prune of %s keeps %s, the newest cut that verifies: %s", self.url, c.id, reason)
            return c.id
        raise CorruptCut(f"no committed cut verifies ({'; '.join(list(failed.values())[:2])}); prune removed "
                         "nothing", store=self.url, cut=next(iter(failed), None),
                         hint="run `ckptstore verify` to see the damage; `prune --no-verify` (verify_kept=False) "
                              "removes cuts without this check")

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Removes what interrupted saves and prunes left behind; reports foreign files and never
        deletes them. Needs the writer lock, so every marked cut not in flight in this process
        belongs to a dead writer. Refuses while LATEST is broken: which marked cut it names (and so
        which is committed) cannot be told then.

        Every removal is reported: ``removed`` (what this call removed, or with ``dry_run`` would
        remove) and ``at_open`` (what this handle's writer open removed before). ``dry_run`` changes
        nothing; on a handle opened with ``recover=False`` it lists all that recovery would remove."""
        self._require_writer("gc")
        report = self._collect(dry_run=dry_run)
        report.at_open = list(self.recovered)
        if not dry_run:
            self._recovery_pending = False
        return report

    def _collect(self, *, dry_run: bool) -> GcReport:
        """``gc``'s work (recovery runs it at open): classify, then remove (or list) each leftover."""
        cls = self.classify()
        if cls.latest_problem is not None:
            raise LatestError(cls.latest_problem, store=self.url, path=layout.LATEST_FILE,
                              hint=f"run `ckptstore repair {self.url}` to point LATEST at the newest cut that verifies")
        report = GcReport(foreign=list(cls.foreign), dry_run=dry_run)
        lock_excludes = self._lock.excludes
        for lo in cls.leftovers:
            mine = lo.cut is not None and lo.cut in self._in_flight
            dead = lo.owner_alive is False or (lock_excludes and not mine)
            if mine or (lo.kind in ("in-progress", "orphan-mark") and not dead):
                report.kept.append(lo)
                continue
            report.removed.append(lo)
            if dry_run:
                continue
            if lo.kind == "stale-mark":
                self._protocol.unmark(lo.cut)  # type: ignore[arg-type]
            elif lo.kind == "temp-file":
                self._protocol.remove_temp(lo.paths[0])
            elif lo.kind == "stale-final-mark":
                self._protocol.remove_final_mark(lo.cut)  # type: ignore[arg-type]
            elif lo.kind in ("stale-label", "broken-label"):
                self._protocol.remove_label_file(lo.paths[0])
            else:
                report.foreign.extend(self._protocol.remove_leftover(lo.cut))  # type: ignore[arg-type]
        if not dry_run and report.removed:
            self.events.emit("gc", removed=len(report.removed))
        return report

    def repair(self, *, progress: Progress | None = None) -> CutInfo | None:
        """Points LATEST at the newest committed cut that verifies (or removes LATEST when no cut is
        committed). Raises ``CorruptCut`` when committed cuts exist but none verifies, and the I/O
        error when a cut could not be read (a transient error never makes repair skip a good cut)."""
        self._require_writer("repair")
        cls = self.classify()
        for m in reversed(cls.committed):
            report = verify_store(self.storage, cls, cut=m.cut, progress=progress)
            raise_io_errors(report)
            if report.ok or all(f.kind.about_latest for f in report.errors):
                with _latest_must_be_a_file(self.url):
                    info = self.point_latest(m.cut)
                self.events.emit("repaired", cut=m.cut, step=m.step)
                return info
        if cls.committed:
            raise CorruptCut("no committed cut verifies; LATEST left as it was", store=self.url,
                             hint="run `ckptstore verify` to see what is damaged")
        with _latest_must_be_a_file(self.url):
            self._protocol.remove_latest()
        return None

    def point_latest(self, cut: str) -> CutInfo:
        """Durably points LATEST at a committed cut (repair, and resuming from a fallback cut so the next
        saves continue from it), clearing a stale mark of that cut."""
        self._require_writer("point_latest")
        m = self.manifest(cut)
        data = self.storage.read_bytes(layout.manifest_path(m.cut))
        self._protocol.point_latest(m.cut, m.step, hashing.digest(data))
        try:
            self._protocol.unmark(m.cut)
        except StorageError:
            pass  # LATEST names it: a stale mark cannot demote it (protocol Rule M)
        return self.classify().info(m)

    def record_bad(self, cut: str, reason: str) -> None:
        """Records that a committed cut is proven damaged, so restarts skip it (no retry loop).
        Allowed on readonly handles too: ``bad/`` is only ever added to, and writers never read it
        for anything but skipping."""
        m = self.manifest(cut)
        self._protocol.record_bad(BadCut(cut=m.cut, step=m.step, reason=reason, recorded_at=now_iso()))

    def _record_bad_quietly(self, cut: str, reason: str) -> None:
        try:
            self.record_bad(cut, reason)
        except StorageError as exc:
            # A reader may lack write access; the record only saves later fallbacks a verification.
            if not self.readonly:
                raise
            log.warning("ckptstore: could not record bad cut %s of %s: %s", cut, self.url, exc)


@contextmanager
def _latest_must_be_a_file(url: str) -> Iterator[None]:
    """Turns the file system's refusal to read, replace or delete a LATEST that is a directory or a
    FIFO into a ``LatestError`` that says what to do: repair never deletes what may be someone's data."""
    try:
        yield
    except StorageError as exc:
        if exc.path != layout.LATEST_FILE or exc.errno not in (errno.EISDIR, errno.EINVAL, errno.ENOTEMPTY):
            raise
        raise LatestError("LATEST is not a regular file (a directory or FIFO stands in its place); repair does not "
                          "remove it", store=url, path=layout.LATEST_FILE,
                          hint="move it aside, then run `ckptstore repair` again") from exc


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


def _make_root(root: str, url: str) -> None:
    """Creates a local store's root and its parents. A path that is, or runs through, something other
    than a directory is a ``UsageError`` naming what is in the way (issue 10 item 20; issue 19 item 14:
    a path below a regular file raised a raw NotADirectoryError); any other refusal (permissions, a
    full disk, a file created meanwhile) is a ``StorageError`` naming the store."""
    there = root
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if os.path.lexists(there) and not os.path.isdir(there):
        what = "a file, not a directory" if os.path.isfile(there) else "not a directory"
        raise UsageError(f"cannot create a store here: {there} is {what}", store=url, path=there,
                         hint="pick a new or empty directory for the store")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise StorageError.from_os_error(exc, "creating the store directory", store=url, path=root) from exc


def open_for_repair(url: str, options: StoreOptions | None = None) -> Store:
    """A writer handle without recovery, for ``ckptstore repair`` on a store whose LATEST is broken."""
    return Store._open(url, create=False, readonly=False, options=options)


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
    """
    kw = dict(map_location=map_location, verify=verify, keys=keys, allow_pickle=allow_pickle, fallback=fallback,
              rank=rank, allowed_types=allowed_types)
    if isinstance(url, Store):
        return url.load(cut, **kw)  # type: ignore[arg-type]
    with Store.open(url, readonly=True, options=StoreOptions(storage_options=storage_options)) as store:
        return store.load(cut, **kw)  # type: ignore[arg-type]
