"""The store: composes the layout, storage seam, commit protocol, recovery, retention and audits.

``Store.open(url)`` opens a store as its single writer (taking the writer lock and recovering what a
crash left), ``Store.open(url, readonly=True)`` as one of any number of readers. Writers ``save``
(synchronous: returns once the cut is committed), ``prune``, ``gc`` and ``repair``; everyone can
``latest``, ``cuts``, ``manifest``, ``verify`` and ``load``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import __version__, hashing, layout
from .arrays import describe
from .errors import (
    CorruptCut,
    CutNotFound,
    LatestError,
    StepConflict,
    StorageError,
    StoreNotFound,
    UsageError,
)
from .events import Emitter, log
from .fs import Storage, host_identity, open_storage
from .info import CutInfo
from .latest import StoreIdentity
from .loader import load_manifest
from .lock import WriterLock
from .manifest import FileRecord, Manifest, TensorRecord, WriterIdentity
from .marks import BadCut
from .options import StoreOptions
from .protocol import CommitProtocol, now_iso
from .recovery import Classification, Leftover, classify, scan
from .retention import Policy, hard_keeps
from .shards import Codec, plan_shards, write_shard
from .tree import flatten, has_pickle
from .verify import Progress, VerifyReport, verify_store

CutSelector = str | int


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``) and what it left alone."""

    removed: list[Leftover] = field(default_factory=list)
    kept: list[Leftover] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        def lo(x: Leftover) -> dict[str, Any]:
            return {"cut": x.cut, "kind": x.kind, "paths": x.paths, "owner": x.owner, "owner_alive": x.owner_alive}

        return {"dry_run": self.dry_run, "removed": [lo(x) for x in self.removed],
                "kept": [lo(x) for x in self.kept], "foreign": self.foreign}


class Store:
    """A checkpoint store on one fsspec URL. Use :meth:`open`; close it (or use ``with``)."""

    def __init__(self, storage: Storage, options: StoreOptions, readonly: bool) -> None:
        self.storage = storage
        self.url = storage.url
        self.options = options
        self.readonly = readonly
        self.events = Emitter(self.url, options.on_event)
        self.protocol = CommitProtocol(storage, options.on_phase)
        self._lock = WriterLock(storage, options.lease_ttl_s)
        self._in_flight: set[str] = set()
        self._closed = False

    # ------------------------------------------------------------------------------------------ open
    @classmethod
    def open(
        cls,
        url: str | Storage,
        *,
        create: bool = False,
        readonly: bool = False,
        options: StoreOptions | None = None,
    ) -> "Store":
        """Opens the store at ``url`` (a path, an fsspec URL, or a :class:`~ckptstore.fs.Storage`).

        As a writer (default) it takes the writer lock (``StoreLocked`` if another writer has it) and
        recovers: leftovers of interrupted saves and prunes are removed, a stale mark beside a committed
        cut is cleared. A store whose LATEST is missing or broken while committed cuts exist is not
        reset: opening it raises ``LatestError`` that says to run ``ckptstore repair``.
        """
        store = cls._open(url, create=create, readonly=readonly, options=options)
        if not readonly:
            try:
                store._recover()
            except BaseException:
                store.close()
                raise
        return store

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
            store._lock.acquire()
        return store

    @staticmethod
    def _create(storage: Storage) -> None:
        if storage.is_local:
            import os

            os.makedirs(storage.local_path(""), exist_ok=True)  # type: ignore[arg-type]
        for d in (layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR):
            storage.make_dir(d)
        storage.write_durably(layout.STORE_FILE, StoreIdentity(created_at=now_iso()).to_bytes())

    def _recover(self) -> None:
        cls = self.classify()
        if cls.latest_problem is not None:
            raise LatestError(cls.latest_problem, store=self.url, path=layout.LATEST_FILE,
                              hint=f"run `ckptstore repair {self.url}` to point LATEST at the newest cut that verifies")
        report = self.gc()
        for lo in report.removed:
            self.events.emit("recovered", cut=lo.cut, kind=lo.kind, paths=lo.paths)

    def close(self) -> None:
        """Releases the writer lock. Idempotent."""
        if not self._closed:
            self._closed = True
            self._lock.release()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, {'readonly' if self.readonly else 'writer'})"

    def _require_writer(self, what: str) -> None:
        if self._closed:
            raise UsageError(f"{what} on a closed store", store=self.url)
        if self.readonly:
            raise UsageError(f"{what} needs a writer; this store was opened readonly", store=self.url)
        self._lock.ensure_held()

    # ----------------------------------------------------------------------------------------- reads
    def classify(self) -> Classification:
        """What is on disk right now (see :mod:`ckptstore.recovery`)."""
        return classify(scan(self.storage))

    def cuts(self) -> list[CutInfo]:
        """Committed cuts, ascending by step."""
        return [CutInfo.from_manifest(m) for m in self.classify().committed]

    def latest(self) -> CutInfo | None:
        """The committed cut LATEST points at, or None for an empty store."""
        m = self._latest_manifest(self.classify())
        return None if m is None else CutInfo.from_manifest(m)

    def _latest_manifest(self, cls: Classification) -> Manifest | None:
        if cls.latest_problem is not None:
            raise LatestError(cls.latest_problem, store=self.url, path=layout.LATEST_FILE,
                              hint=f"run `ckptstore repair {self.url}`")
        return None if cls.latest is None else cls.find(cls.latest.cut)

    def manifest(self, cut: CutSelector = "latest") -> Manifest:
        """The manifest of a committed cut: "latest", a cut id, or an int step."""
        cls = self.classify()
        if cut == "latest":
            m = self._latest_manifest(cls)
            if m is None:
                raise CutNotFound("the store has no committed cut yet", store=self.url)
            return m
        if isinstance(cut, bool) or not isinstance(cut, (str, int)):
            raise UsageError(f"cut must be 'latest', a cut id or an int step, not {cut!r}", store=self.url)
        if isinstance(cut, int):
            matches = [m for m in cls.committed if m.step == cut]
            broken = [exc for c, exc in sorted(cls.broken.items()) if layout.step_of_cut_id(c) == cut]
            if not matches and broken:
                raise broken[-1]  # damaged data is a DataError, not the caller's mistake (CutNotFound)
            if not matches:
                raise CutNotFound(f"no committed cut at step {cut}", store=self.url,
                                  hint=f"committed steps: {[m.step for m in cls.committed][-10:]}")
            return matches[-1]
        layout.check_cut_id(cut, store=self.url)
        m = cls.find(cut)
        if m is None and cut in cls.broken:
            raise cls.broken[cut]
        if m is None:
            raise CutNotFound("no such committed cut", store=self.url, cut=cut)
        return m

    def load(
        self,
        cut: CutSelector = "latest",
        *,
        map_location: Any = "cpu",
        verify: bool = True,
        keys: Sequence[str] | None = None,
        allow_pickle: bool = False,
        fallback: bool = False,
    ) -> Any:
        """The state saved in a committed cut (see :func:`ckptstore.load`)."""
        if fallback and cut == "latest":
            from .resume import choose_cut

            info, skipped, _ = choose_cut(self, fallback=True, record=True)
            if info is None:
                raise CutNotFound("the store has no committed cut yet", store=self.url)
            for bad_cut, why in skipped.items():
                self.events.emit("fallback-skipped", cut=bad_cut, reason=why)
                log.warning("ckptstore: skipped cut %s of %s: %s", bad_cut, self.url, why)
            cut = info.id
        m = self.manifest(cut)
        if m.pickled and not allow_pickle:
            from .errors import HostileInput

            raise HostileInput("cut holds pickled values; pass allow_pickle=True only if you trust it",
                               store=self.url, cut=m.cut)
        return load_manifest(self.storage, m, map_location=map_location, verify=verify, keys=keys,
                             allow_pickle=allow_pickle)

    def verify(self, cut: CutSelector | None = None, *, progress: Progress | None = None) -> VerifyReport:
        """Re-hashes every file of every committed cut (or one cut) and reports every finding."""
        cls = self.classify()
        cut_id = None if cut is None else self.manifest(cut).cut
        return verify_store(self.storage, cls, cut=cut_id, progress=progress)

    # ---------------------------------------------------------------------------------------- writes
    def save(
        self,
        state: Any,
        *,
        step: int,
        tags: Sequence[str] = (),
        final: bool = False,
        metadata: dict[str, Any] | None = None,
        allow_pickle: bool = False,
    ) -> CutInfo:
        """Writes ``state`` as a new cut and commits it; returns once LATEST names it durably.

        ``step`` must be above the committed LATEST step (``StepConflict`` otherwise: re-saving an old
        step would silently roll LATEST back). Values that need pickle are refused unless
        ``allow_pickle`` is passed.
        """
        self._require_writer("save")
        self._check_step(step, tags, metadata)
        t0 = time.perf_counter()
        tree, leaves = flatten(state, allow_pickle=allow_pickle)
        items = [describe(leaf) for leaf in leaves]
        pickled = allow_pickle and has_pickle(tree)
        cut = layout.new_cut_id(step)
        t_flat = time.perf_counter()
        files, tensors = self._write_cut(cut, step, items)
        t_write = time.perf_counter()
        manifest = Manifest(
            cut=cut, step=step, tags=list(tags), final=final, created_at=now_iso(),
            writer=WriterIdentity(host=str(host_identity()["host"]), pid=int(host_identity()["pid"]),  # type: ignore[call-overload]
                                  ckptstore_version=__version__, mode="sync"),
            metadata=dict(metadata or {}), files=files, tensors=tensors, tree=tree, pickled=pickled,
        )
        info = self.commit_manifest(manifest)
        t_end = time.perf_counter()
        self.events.emit(
            "committed", cut=cut, step=step, bytes=info.nbytes, tensors=len(tensors), files=len(files),
            timings={"flatten": t_flat - t0, "write": t_write - t_flat, "commit": t_end - t_write, "total": t_end - t0},
            writer_mode="sync",
        )
        return info

    def _check_step(self, step: int, tags: Sequence[str], metadata: dict[str, Any] | None) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= layout.MAX_STEP:
            raise UsageError(f"step must be an int in [0, {layout.MAX_STEP}], got {step!r}", store=self.url)
        if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags):
            raise UsageError(f"tags must be a sequence of non-empty strings, got {tags!r}", store=self.url)
        try:
            json.dumps(metadata or {}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"metadata must be JSON-serializable: {exc}", store=self.url) from None
        cls = self.classify()
        latest = self._latest_manifest(cls)
        if latest is not None and step <= latest.step:
            raise StepConflict(
                f"step {step} is not above the committed LATEST step {latest.step}", store=self.url,
                cut=latest.cut, hint="steps must increase; resume from LATEST and continue from its step",
            )

    def _write_cut(self, cut: str, step: int, items: list) -> tuple[list[FileRecord], list[TensorRecord]]:
        """Protocol steps 1-3: mark, shards, directory sync. On failure everything is removed again."""
        codec = Codec("zstd", self.options.zstd_level) if self.options.compression == "zstd" else Codec()
        self._in_flight.add(cut)
        try:
            self.protocol.begin(cut, step, "store.save")
            files: list[FileRecord] = []
            tensors: list[TensorRecord] = []
            for i, group in enumerate(plan_shards(items, self.options.max_shard_bytes)):
                name = layout.shard_name(0, i, compressed=codec.name == "zstd")
                rec, trecs = write_shard(self.storage, cut, name, 0, group, codec)
                files.append(rec)
                tensors.extend(trecs)
                self.protocol.phase("shard-written", cut)
            self.protocol.shards_done(cut)
            return files, tensors
        except BaseException as exc:
            self.protocol.abandon(cut)
            self._in_flight.discard(cut)
            self.events.emit("failed", cut=cut, step=step, error=str(exc), error_type=type(exc).__name__)
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                # A raw OSError from below the storage seam still names the store and the cut.
                raise StorageError.from_os_error(exc, "saving", store=self.url, cut=cut,
                                                 path=getattr(exc, "filename", None)) from exc
            raise

    def commit_manifest(self, manifest: Manifest) -> CutInfo:
        """Protocol steps 4-6 for a cut whose files are durable: manifest, LATEST, unmark.

        Public for the writer's commit thread, which writes files elsewhere and commits here.
        """
        cut = manifest.cut
        self._in_flight.add(cut)
        try:
            try:
                digest = self.protocol.write_manifest(manifest)
            except BaseException as exc:
                self.protocol.abandon(cut)
                self.events.emit("failed", cut=cut, step=manifest.step, error=str(exc), error_type=type(exc).__name__)
                raise
            try:
                self._lock.ensure_held()  # an object-store writer that lost its lease never commits
                self.protocol.commit(manifest, digest)
            except BaseException as exc:
                # Did the rename land (only the directory fsync failed)? Then LATEST names a whole cut:
                # keep it. Otherwise nothing names it and its files go now.
                if not self.protocol.latest_names(cut):
                    self.protocol.abandon(cut)
                self.events.emit("failed", cut=cut, step=manifest.step, error=str(exc), error_type=type(exc).__name__)
                raise
            try:
                self.protocol.end(cut)
            except StorageError as exc:
                self.events.emit("warning", cut=cut, message=f"committed, but the mark was not removed: {exc}")
        finally:
            self._in_flight.discard(cut)
        return CutInfo.from_manifest(manifest)

    def begin_cut(self, cut: str, step: int, writer: str) -> None:
        """Protocol step 1 for an external writer (the background writer): mark the cut in flight."""
        self._require_writer("begin_cut")
        self._in_flight.add(cut)
        self.protocol.begin(cut, step, writer)

    def abandon_cut(self, cut: str) -> None:
        """Removes an uncommitted cut of this writer's (after a failed background write)."""
        self.protocol.abandon(cut)
        self._in_flight.discard(cut)

    def prune(self, policy: Policy, *, dry_run: bool = False) -> list[CutInfo]:
        """Removes committed cuts that ``policy`` does not keep; returns them.

        Never removed whatever the policy says: the LATEST target, a cut newer than the newest kept one,
        a cut tagged "keep". Cuts recorded bad are neither counted as kept nor removed here (``gc``
        reports them). Each removal uncommits first (manifest deleted durably), then deletes files.
        """
        self._require_writer("prune")
        cls = self.classify()
        latest = self._latest_manifest(cls)
        good = [CutInfo.from_manifest(m) for m in cls.committed if m.cut not in cls.bad]
        keep = policy.keep(good)
        hard = hard_keeps(good, keep, latest.cut if latest else None)
        doomed = [c for c in good if c.id not in keep and c.id not in hard and c.id not in self._in_flight]
        for c in doomed:
            if not dry_run:
                self.protocol.uncommit(c.id)
            self.events.emit("pruned", cut=c.id, step=c.step, dry_run=dry_run)
        return doomed

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Removes what interrupted saves and prunes left behind; reports foreign files and never
        deletes them. Needs the writer lock, so every marked cut not in flight in this process
        belongs to a dead writer."""
        self._require_writer("gc")
        cls = self.classify()
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
                self.storage.delete(layout.mark_path(lo.cut), durable=True)  # type: ignore[arg-type]
            elif lo.kind == "temp-file":
                self.storage.delete(lo.paths[0], durable=True)
            else:
                foreign = self.protocol.remove_cut_files(lo.cut)  # type: ignore[arg-type]
                report.foreign.extend(foreign)
                self.storage.delete(layout.mark_path(lo.cut), durable=True)  # type: ignore[arg-type]
        if not dry_run and report.removed:
            self.events.emit("gc", removed=len(report.removed))
        return report

    def repair(self, *, progress: Progress | None = None) -> CutInfo | None:
        """Points LATEST at the newest committed cut that verifies (or removes LATEST when no cut is
        committed). Raises ``CorruptCut`` when committed cuts exist but none verifies."""
        self._require_writer("repair")
        cls = self.classify()
        for m in reversed(cls.committed):
            report = verify_store(self.storage, cls, cut=m.cut, progress=progress)
            if report.ok or all(f.kind.startswith("latest-") for f in report.errors):
                info = self.point_latest(m.cut)
                self.events.emit("repaired", cut=m.cut, step=m.step)
                return info
        if cls.committed:
            raise CorruptCut("no committed cut verifies; LATEST left as it was", store=self.url,
                             hint="run `ckptstore verify` to see what is damaged")
        self.storage.delete(layout.LATEST_FILE, durable=True)
        return None

    def point_latest(self, cut: str) -> CutInfo:
        """Durably points LATEST at a committed cut (repair, and resuming from a fallback cut so the next
        saves continue from it), clearing a stale mark of that cut."""
        self._require_writer("point_latest")
        m = self.manifest(cut)
        data = self.storage.read_bytes(layout.manifest_path(m.cut))
        self.protocol.commit(m, hashing.digest(data))
        self.storage.delete(layout.mark_path(m.cut), durable=True)
        return CutInfo.from_manifest(m)

    def record_bad(self, cut: str, reason: str) -> None:
        """Records that a committed cut failed verification, so restarts skip it (no retry loop).
        Allowed on readonly handles too: ``bad/`` is only ever added to, and writers never read it
        for anything but skipping."""
        m = self.manifest(cut)
        bad = BadCut(cut=m.cut, step=m.step, reason=reason, recorded_at=now_iso())
        self.storage.write_durably(layout.bad_path(m.cut), bad.to_bytes())


def open_for_repair(url: str, options: StoreOptions | None = None) -> Store:
    """A writer handle without recovery, for ``ckptstore repair`` on a store whose LATEST is broken."""
    return Store._open(url, create=False, readonly=False, options=options)


def load(
    url: str | Store,
    cut: CutSelector = "latest",
    *,
    map_location: Any = "cpu",
    verify: bool = True,
    keys: Sequence[str] | None = None,
    allow_pickle: bool = False,
    fallback: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Loads a committed cut: "latest" (default), a cut id, or an int step.

    Every byte read is checked against the manifest's blake3 (``verify=False`` skips the hashes but
    never the size and header checks); a damaged or torn cut raises rather than returning. ``keys``
    loads only those top-level keys and reads only their bytes. ``map_location`` moves tensors.
    ``fallback=True`` (with ``cut="latest"``) walks back from a LATEST that fails verification to the
    newest cut that verifies, logs what it skipped and why, and records the bad cuts so no restart tries
    them again.
    """
    kw = dict(map_location=map_location, verify=verify, keys=keys, allow_pickle=allow_pickle, fallback=fallback)
    if isinstance(url, Store):
        return url.load(cut, **kw)  # type: ignore[arg-type]
    with Store.open(url, readonly=True, options=StoreOptions(storage_options=storage_options)) as store:
        return store.load(cut, **kw)  # type: ignore[arg-type]
