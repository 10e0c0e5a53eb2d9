"""What an open store handle is made of: its storage, options, role, lock, protocol and bookkeeping.

:class:`~ckptstore.store.Store` is a facade over one :class:`StoreCore` (issue 20): the modules that do
the work (:mod:`~ckptstore.opening`, :mod:`~ckptstore.cutting`, :mod:`~ckptstore.pruning`,
:mod:`~ckptstore.collect`, :mod:`~ckptstore.labeling`, :mod:`~ckptstore.repairing`,
:mod:`~ckptstore.reading`) take the core, so none of them reaches into the facade's private members.
The handle's :class:`Role` is one value fixed when the core is made, never flipped later (it was two
booleans, ``readonly`` and ``participant``, set after construction).
"""

from __future__ import annotations

import threading
from typing import Callable

from . import layout
from .errors import StepConflict, UsageError
from .events import Emitter
from .gcpause import pausing
from .kinds import StrKind
from .lock import WriterLock
from .manifest import Manifest
from .options import StoreOptions
from .assemble import PartCache
from .pending import COMMITTED, PendingCut
from .pointed import pointed_step
from .protocol import CommitProtocol
from .ranks import RankGroup
from .recovery import Classification, Leftover, ManifestCache, classify_now
from .selection import CutSelector, latest_manifest, select_manifest
from .storage import Storage


class Role(StrKind):
    """What a handle may do, fixed at open.

    ``reader``: reads only; writes nothing (no cut, no rank part, no label; ``record_bad`` alone, which
    only adds to ``bad/``). ``writer``: holds the writer lock, recovers, begins and commits cuts, prunes.
    ``participant``: writes rank parts into cuts a coordinator marks (ranks other than 0 of a group,
    DCP's ranks); holds no lock, recovers nothing, commits nothing."""

    READER = "reader"
    WRITER = "writer"
    PARTICIPANT = "participant"


class StoreCore:
    """One open handle's state. ``role`` and ``ranks`` are fixed here; only the bookkeeping changes."""

    def __init__(self, storage: Storage, options: StoreOptions, role: Role, ranks: RankGroup | None = None) -> None:
        self.storage = storage  # for reading; every change goes through self.protocol
        self.url = storage.url
        self.options = options
        self.role = role
        #: The ranks this handle takes cuts with (``Store.open(..., group=)``), None for one process.
        self.ranks = ranks
        self.events = Emitter(self.url, options.on_event)
        self.lock = WriterLock(storage, options.lease_ttl_s, options.orphan_wait_s)
        self.protocol = CommitProtocol(storage, options.on_phase, guard=self.lock.ensure_held)
        self.in_flight: dict[str, PendingCut] = {}
        self.manifests: ManifestCache = {}
        #: Fragments of cuts of format 5 parsed by this handle's loads (``assemble.read_part``).
        self.parts: PartCache = {}
        self.closed = False
        #: What recovery removed when this handle opened as the writer (``GcReport.at_open``).
        self.recovered: list[Leftover] = []
        #: ``Store.open(..., recover=False)``: recovery waits for the first change (save, prune, gc).
        self.recovery_pending = False
        #: Cuts this handle committed: hashed as they were written, so ``prune`` takes them as verified.
        self.written: set[str] = set()
        #: Background work on this handle that ``close`` finishes (bounded) or abandons before the lock
        #: goes (a restore's write-back, issue 21): each entry does that when called.
        self.background: list[Callable[[], None]] = []
        #: Held by a cut of this handle over its manifest and LATEST (``PendingCut``): one at a time.
        self.publishing = threading.Lock()

    def with_ranks(self, ranks: RankGroup) -> "StoreCore":
        """This core joined to ``ranks`` (a collective open sets them once, before the facade exists)."""
        self.ranks = ranks
        return self

    @property
    def readonly(self) -> bool:
        return self.role is Role.READER

    def require_writer(self, what: str, *, participant_ok: bool = False) -> None:
        """``UsageError`` unless this handle may do ``what``: a writer (holding its lock), or with
        ``participant_ok`` a participant too."""
        if self.closed:
            raise UsageError(f"{what} on a closed store", store=self.url)
        if self.role is Role.READER:
            raise UsageError(f"{what} needs a writer; this store was opened readonly", store=self.url)
        if self.role is Role.PARTICIPANT:
            if participant_ok:
                return
            who = f"rank {self.ranks.rank}" if self.ranks is not None else "this handle"
            raise UsageError(f"{what} is rank 0's job: {who} takes part in cuts but does not hold the writer lock",
                             store=self.url)
        self.lock.ensure_held()

    @pausing
    def classify(self) -> Classification:
        """What is on disk right now (see :mod:`ckptstore.recovery`)."""
        return classify_now(self.storage, self.manifests)

    def manifest(self, cut: CutSelector = "latest") -> Manifest:
        return select_manifest(self.classify(), cut, self.url)

    def own_dirs(self, *dirs: str) -> None:
        """Recreates the store's own directories that someone deleted (an operator "cleaning up"
        ``marks/``): they hold nothing but the store's bookkeeping, and without ``marks/`` every save
        fails (issue 10, item 11). An existing one costs one failed mkdir."""
        for d in dirs:
            self.storage.make_dir(d)

    def check_step(self, step: int) -> None:
        layout.check_step(step, store=self.url)
        # LATEST and the manifest it names, two reads, checked as the classification checks them; only
        # a store without LATEST is classified (issue 24: every save listed the whole store and read
        # every manifest, O(cuts) requests per save on an object store).
        latest = pointed_step(self.storage, self.url, known=self.protocol.last_written)
        if latest is None:
            m = latest_manifest(self.classify(), self.url)
            latest = None if m is None else (m.cut, m.step)
        if latest is not None and step <= latest[1]:
            raise StepConflict(
                f"step {step} is not above the committed LATEST step {latest[1]}", store=self.url,
                cut=latest[0], hint="steps must increase; resume from LATEST and continue from its step",
            )

    def ended(self, pending: PendingCut) -> None:
        """A cut of this handle ended: no longer in flight; committed ones count as verified."""
        self.in_flight.pop(pending.id, None)
        if pending.state == COMMITTED:
            self.written.add(pending.id)

    def close(self) -> None:
        """Finishes the handle's background work (bounded), then releases the writer lock (a writer's)
        and the ranks. Idempotent."""
        if not self.closed:
            for finish in list(self.background):
                finish()  # while the lock is held: what it leaves is a marked cut, never another's
            self.closed = True
            if self.ranks is not None:
                self.ranks.close()
            if self.role is Role.WRITER:
                self.lock.release()

    def describe(self) -> str:
        role = {Role.READER: "readonly"}.get(self.role, str(self.role))
        if self.ranks is not None:
            role += f", rank {self.ranks.rank} of {self.ranks.size}"
        return f"Store({self.url!r}, {role})"


__all__ = ["Role", "StoreCore"]
