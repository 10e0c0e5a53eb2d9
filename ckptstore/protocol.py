"""The commit protocol as one object: the only code that writes or deletes marks, manifests, LATEST
and cut directories. :class:`~ckptstore.pending.PendingCut` drives a cut through it; prune, gc, repair
and recovery call its removal and pointing verbs.

Save, in this order (each step durable before the next starts)::

    1. mark       marks/<cut>.json written durably          (phase "mark-written")
    2. shards     cuts/<cut>/<shard> written and fsynced     (phase "shard-written", once per shard)
    3. dir sync   fsync cuts/<cut>/ so the shard names last  (phase "shards-synced")
    4. manifest   cuts/<cut>/MANIFEST.json durably           (phase "manifest-written")
    5. LATEST     atomic durable replace: THE COMMIT POINT   (phase "latest-written")
                  first: the cut LATEST names now loses its stale mark, durably, if it still has one
    6. unmark     marks/<cut>.json removed, marks/ fsynced   (phase "mark-removed"); best effort

A cut of several ranks (docs/design.md, "Several ranks"): rank 0 (the coordinator) does step 1; every
rank does steps 2 and 3 for its own shards and then writes ``cuts/<cut>/rank<r>.json`` durably (phase
"rank-written"), naming its files with their digests; the coordinator reads every rank's record and
does steps 4 to 6. Until the manifest and LATEST exist the records commit nothing: a cut missing a
rank's record is never committed, and ``gc`` removes it like any other in-progress cut.

Invariant: a cut is committed iff it has a valid manifest and either no mark or LATEST names it.

Rule M (what makes the invariant safe against a single fault after the commit point): **LATEST never
moves away from a cut that still has a mark.** Step 5 removes the mark of the cut LATEST names *before*
it replaces LATEST; if that removal fails, the new cut is not committed (the old one stays committed
and named). So a failed step 6 leaves a committed cut whose stale mark is cleared by the next commit
or by recovery, and nothing can ever demote it. Without Rule M, one failed unlink in step 6 followed by
the next commit left a committed cut with a mark that LATEST no longer names: "in progress" by the
invariant, deleted by the next writer open (the bug behind issue 9).

A crash before 5 leaves the previous LATEST and a marked cut that ``gc`` removes; a crash between 5 and
6 leaves a committed cut with a stale mark that recovery removes (failure-modes row 10).

Prune (uncommit first, then delete)::

    a. delete MANIFEST.json durably   (phase "prune-uncommitted"): the cut is no longer committed
    b. delete the shard files          (phase "prune-files-deleted")
    c. remove the directory            (phase "prune-removed")

so a crash mid-prune leaves a directory without manifest or mark: "abandoned", which ``gc`` removes.

On object stores every step is one PUT or DELETE of one object and nothing is renamed; LATEST moves by
compare-and-swap (``If-Match`` on the version this writer last saw or wrote), so a writer that lost its
lease while stalled before its PUT cannot move LATEST under the holder that replaced it. A writer that
put LATEST itself, and whose cut's mark is gone since, knows what LATEST holds: its next step 5 is the
conditional PUT alone (no GET of LATEST, no look for a mark Rule M would remove; issue 22). Anyone
else's move of LATEST meanwhile changes its version, and the PUT fails as above.

``on_phase`` is the fault-injection seam: tests kill the process in it.
"""

from __future__ import annotations

import errno
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from . import hashing, layout
from .errors import CkptStoreError, DataError, StorageError, StoreLocked
from .ident import host_identity
from .kinds import StrKind
from .latest import Pointer
from .arrays import ArrayItem
from .manifest import FileRecord, Manifest, RankRecord, TensorRecord
from .shards import write_shards
from .labels import Label, label_path
from .marks import BadCut, FinalMark, Mark
from .storage import ConditionFailed, Storage, Upload


class SavePhase(StrKind):
    """The named points of a save (module docstring), in protocol order; ``on_phase`` gets one after
    the step it names is durable."""

    MARK_WRITTEN = "mark-written"
    SHARD_WRITTEN = "shard-written"
    SHARDS_SYNCED = "shards-synced"
    RANK_WRITTEN = "rank-written"  # cuts of several ranks only
    MANIFEST_WRITTEN = "manifest-written"
    LATEST_WRITTEN = "latest-written"
    MARK_REMOVED = "mark-removed"


class PrunePhase(StrKind):
    """The named points of a prune, in protocol order."""

    UNCOMMITTED = "prune-uncommitted"
    FILES_DELETED = "prune-files-deleted"
    REMOVED = "prune-removed"


PhaseHook = Callable[[SavePhase | PrunePhase, str], None]
Guard = Callable[[], None]

#: Every phase, for crash tables that must cover them all ("rank-written" was missing: issue 20).
SAVE_PHASES = tuple(SavePhase)
PRUNE_PHASES = tuple(PrunePhase)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


class CommitUnknown(StorageError, wire="commit-unknown"):
    """Replacing LATEST failed in a way that may or may not have landed; the cut keeps its mark, and
    the next open decides (committed if LATEST names it, removed otherwise)."""


class CommitProtocol:
    """Performs each protocol step on a storage; knows nothing about tensors.

    ``guard`` raises when this handle may no longer change the store (the object-store writer lease
    was lost); it runs before every step that moves LATEST or deletes committed data.
    """

    def __init__(self, storage: Storage, on_phase: PhaseHook | None = None, guard: Guard | None = None) -> None:
        self._storage = storage
        self._on_phase = on_phase
        self._guard = guard or (lambda: None)
        self._latest_tag: str | None = None  # object stores: the LATEST version this writer last saw or wrote
        #: (blake3 of its bytes, cut, step) of the last manifest this writer published: the next save's
        #: step check takes it as LATEST's when the bytes there hash the same (``pointed_step``).
        self.last_written: tuple[str, str, int] | None = None
        #: Object stores: the pointer this writer last put in LATEST (at version ``_latest_tag``) and
        #: whether that cut's mark is gone since (step 6 landed): then the next commit knows what LATEST
        #: holds without reading it, and that Rule M has no mark to remove (issue 22: two requests
        #: fewer a commit; a LATEST moved by anyone else fails the conditional PUT as before).
        self._pointed: Pointer | None = None
        self._pointed_unmarked = False

    @property
    def url(self) -> str:
        return self._storage.url

    def phase(self, name: SavePhase | PrunePhase, cut: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name, cut)

    # save -----------------------------------------------------------------------------------------
    def mark(self, cut: str, step: int, writer: str) -> None:
        """Step 1: the durable in-progress mark, then the cut directory."""
        ident = host_identity()
        mark = Mark(cut=cut, step=step, host=ident.host, pid=ident.pid, started_at=now_iso(), writer=writer)
        self._storage.write_durably(layout.mark_path(cut), mark.to_bytes())
        self._storage.make_dir(layout.cut_dir(cut))
        self.phase(SavePhase.MARK_WRITTEN, cut)

    def write_shards(self, cut: str, rank: int, items: Sequence[ArrayItem], **kw: Any
                     ) -> tuple[list[FileRecord], list[TensorRecord]]:
        """Step 2 for one rank: its shards, each fsynced (phase "shard-written" after each); ``kw`` as
        :func:`ckptstore.shards.write_shards` takes them."""
        return write_shards(self._storage, cut, rank, items,
                            on_shard=lambda: self.phase(SavePhase.SHARD_WRITTEN, cut), **kw)

    def files_durable(self, cut: str) -> None:
        """Step 3: the names of the cut's files are durable before a manifest names them."""
        self._storage.sync_dir(layout.cut_dir(cut))
        self.phase(SavePhase.SHARDS_SYNCED, cut)

    def publish_rank(self, record: RankRecord, data: bytes | None = None) -> bytes:
        """Step 3b (cuts of several ranks): a rank's record (its fragment), durably, once its shards
        and their names are durable; returns its bytes (``data``: another store's bytes of it, copied
        unchanged). Any rank may do this; it changes no committed state."""
        data = record.to_bytes() if data is None else data
        self._storage.write_durably(layout.rank_record_path(record.cut, record.rank), data)
        self.phase(SavePhase.RANK_WRITTEN, record.cut)
        return data

    def ranks_published(self, cut: str) -> set[int]:
        """The ranks whose record is in the cut's directory now."""
        return {int(e.name[4:9]) for e in self._storage.list_dir(layout.cut_dir(cut))
                if not e.is_dir and layout.is_rank_record_name(e.name)}

    def open_rank_dir(self, cut: str) -> None:
        """The cut's directory, for a rank that may get there before the coordinator's mark does
        (a directory without mark or manifest is an abandoned leftover that ``gc`` removes, should
        the cut never be marked)."""
        self._storage.make_dir(layout.cut_dir(cut))

    def read_rank(self, cut: str, rank: int) -> tuple[RankRecord, bytes]:
        """Rank ``rank``'s record of ``cut`` and its bytes."""
        path = layout.rank_record_path(cut, rank)
        data = self._storage.read_bytes(path)
        return RankRecord.from_bytes(data, store=self.url, cut=cut, path=path), data

    def write_manifest(self, manifest: Manifest) -> str:
        """Step 4: publishes the manifest; returns the blake3 of its bytes for LATEST."""
        self._guard()
        data = manifest.to_bytes()
        self._storage.write_durably(layout.manifest_path(manifest.cut), data)
        self.phase(SavePhase.MANIFEST_WRITTEN, manifest.cut)
        digest = hashing.digest(data)
        self.last_written = (digest, manifest.cut, manifest.step)
        return digest

    def copy_manifest(self, cut: str, data: bytes) -> str:
        """Step 4 with another store's manifest bytes of this cut, unchanged (a mirror, issue 21)."""
        self._guard()
        self._storage.write_durably(layout.manifest_path(cut), data)
        self.phase(SavePhase.MANIFEST_WRITTEN, cut)
        return hashing.digest(data)

    def commit_in_order(self, cut: str, step: int, manifest_blake3: str) -> bool:
        """Step 5 where LATEST only moves forward (a mirror receives cuts out of order, issue 21): a cut
        above LATEST's step by ``point_latest`` (True: step 6 follows); one below it by removing its mark
        alone (False): by the invariant a valid manifest and no mark is committed, and LATEST stays. A
        failed removal may have landed: ``CommitUnknown``, the next open decides by the mark."""
        previous = self._read_pointer()
        if previous is None or previous.step < step:
            self.point_latest(cut, step, manifest_blake3)
            return True
        self._guard()  # a writer that lost its lease commits nothing
        try:
            self._storage.delete(layout.mark_path(cut), durable=True)
        except StoreLocked:
            raise
        except StorageError as exc:
            raise CommitUnknown(f"removing the mark of cut {cut} (its commit point: it is older than LATEST's) "
                                f"failed and may have landed: {exc.message}", errno=exc.errno, store=self.url,
                                cut=cut, path=layout.mark_path(cut),
                                hint="the next writer open keeps the cut if its mark is gone") from exc
        self.phase(SavePhase.MARK_REMOVED, cut)
        return False

    def point_latest(self, cut: str, step: int, manifest_blake3: str) -> Pointer:
        """Step 5, and repair's move: LATEST names ``cut`` durably. Rule M first: the cut LATEST names
        now loses its mark before LATEST leaves it. Raises ``CommitUnknown`` when the replace failed
        after it may have landed (then the caller must not remove the cut)."""
        self._guard()
        if not self._knows_latest():
            previous = self._read_pointer()
            if previous is not None and previous.cut != cut and self._storage.exists(layout.mark_path(previous.cut)):
                self._storage.delete(layout.mark_path(previous.cut), durable=True)
        pointer = Pointer(cut=cut, step=step, manifest_blake3=manifest_blake3)
        self._pointed, self._pointed_unmarked = None, False  # until the replace is known to have landed
        self._guard()  # an object-store writer that lost its lease never commits
        try:
            self._replace_latest(pointer.to_bytes())
        except StoreLocked:
            raise
        except StorageError as exc:
            exc.cut = exc.cut or cut
            if self._landed(cut) is False:
                raise
            # The rename may have landed (only the directory fsync failed, or a PUT timed out after
            # the server applied it): LATEST may name a whole cut. Never remove it from here.
            raise CommitUnknown(f"replacing LATEST failed and may have landed: {exc.message}", errno=exc.errno,
                                store=self.url, cut=cut, path=layout.LATEST_FILE,
                                hint="the cut keeps its mark; the next open keeps it if LATEST names it") from exc
        if self._storage.capabilities.conditional_writes:
            self._pointed = pointer
        self.phase(SavePhase.LATEST_WRITTEN, cut)
        return pointer

    def _knows_latest(self) -> bool:
        """Whether LATEST is, unless another writer moved it (then the conditional PUT fails), the
        pointer this writer put there, whose cut has no mark left: Rule M has nothing to do."""
        return (self._storage.capabilities.conditional_writes and self._latest_tag not in (None, "")
                and self._pointed is not None and self._pointed_unmarked)

    def _read_pointer(self) -> Pointer | None:
        """LATEST as it is now (None when absent or unparseable: then there is no cut to unmark)."""
        try:
            data = self._storage.read_bytes(layout.LATEST_FILE)
        except StorageError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        except FileNotFoundError:  # a backend that does not wrap its errors
            return None
        try:
            return Pointer.from_bytes(data, store=self.url, path=layout.LATEST_FILE)
        except DataError:
            return None

    def _replace_latest(self, data: bytes) -> None:
        if not self._storage.capabilities.conditional_writes:
            self._storage.write_durably(layout.LATEST_FILE, data)
            return
        if self._latest_tag is None:
            self._latest_tag = self._current_tag()
        try:
            if self._latest_tag == "":
                self._latest_tag = self._storage.put_if_absent(layout.LATEST_FILE, data)
            else:
                self._latest_tag = self._storage.put_if_match(layout.LATEST_FILE, data, self._latest_tag)
        except (ConditionFailed, FileExistsError):
            self._latest_tag = self._current_tag()
            raise StoreLocked("LATEST was moved by another writer since this writer last saw it (a former "
                              "lease holder that stalled); this cut was not committed", store=self.url,
                              path=layout.LATEST_FILE, hint="take the next cut; it commits against the new LATEST") from None

    def _current_tag(self) -> str:
        """The version tag of LATEST now, "" when it does not exist."""
        try:
            return self._storage.version(layout.LATEST_FILE)[0]
        except StorageError as exc:
            if exc.errno == errno.ENOENT or isinstance(exc.__cause__, FileNotFoundError):
                return ""
            raise

    def _landed(self, cut: str) -> bool | None:
        """After a failed replace: does LATEST name ``cut``? None when it cannot be read. Where it does
        on an object store, the PUT landed unseen (its answer and every retry lost): the next replace
        must compare against that version, not the one before it, or the next commit of this handle
        looks beaten by another writer (issue 24). The tag is read first: nobody else names this cut."""
        try:
            tag = self._current_tag() if self._storage.capabilities.conditional_writes else None
            pointer = self._read_pointer()
        except CkptStoreError:
            return None
        landed = pointer is not None and pointer.cut == cut
        if landed and tag is not None:
            self._latest_tag = tag
        return landed

    def withdraw_manifest(self, cut: str) -> None:
        """Takes back the manifest of a cut that lost its commit to another writer (a stalled former
        lease holder's): without it, a cut whose files the new holder removed would look committed.
        Never raises."""
        try:
            self._storage.delete(layout.manifest_path(cut), durable=True)
        except CkptStoreError:
            pass

    def unmark(self, cut: str) -> None:
        """Step 6 (and recovery of a stale mark): the mark of a cut LATEST names goes, durably."""
        self._storage.delete(layout.mark_path(cut), durable=True)
        if self._pointed is not None and self._pointed.cut == cut:
            self._pointed_unmarked = True
        self.phase(SavePhase.MARK_REMOVED, cut)

    def abandon(self, cut: str) -> None:
        """Removes an uncommitted cut of this writer's: files, directory, then the mark (last, so a
        crash or fault midway leaves a marked leftover that ``gc`` finishes). Never raises."""
        try:
            self.remove_leftover(cut)
        except CkptStoreError:
            pass

    # prune / gc / repair ---------------------------------------------------------------------------
    def uncommit(self, cut: str) -> list[str]:
        """Deletes a committed cut that is not LATEST's target: manifest first (durably), then files,
        then the directory. Returns foreign names left in place."""
        self._guard()
        self._storage.delete(layout.manifest_path(cut), durable=True)
        self.phase(PrunePhase.UNCOMMITTED, cut)
        foreign = self._remove_files(cut)
        if self._storage.exists(layout.final_path(cut)):
            self._storage.delete(layout.final_path(cut), durable=False)  # a crash before: gc removes it
        return foreign

    def remove_leftover(self, cut: str) -> list[str]:
        """Removes an uncommitted cut (in progress of a dead writer, abandoned): manifest first, files,
        directory, mark. Returns foreign names left in place (then the directory stays)."""
        self._guard()
        self._storage.delete(layout.manifest_path(cut), durable=True)
        foreign = self._remove_files(cut)
        self._storage.delete(layout.mark_path(cut), durable=True)
        return foreign

    def discard_files(self, cut: str) -> None:
        """Removes the partial files of a cut still in flight (a dead writer process's), keeping its
        mark and an empty directory, so the same cut can be written again."""
        self._remove_files(cut)
        self._storage.make_dir(layout.cut_dir(cut))

    def discard_rank_files(self, cut: str, rank: int) -> None:
        """Removes rank ``rank``'s partial shard files of a cut still in flight (a dead writer
        process's), leaving every other rank's files and records alone."""
        d = layout.cut_dir(cut)
        prefix = layout.shard_name(rank, 0, compressed=False)[:len("rank00000-")]
        for entry in self._storage.list_dir(d):
            if not entry.is_dir and layout.is_shard_name(entry.name) and entry.name.startswith(prefix):
                self._storage.delete(f"{d}/{entry.name}", durable=False)

    def _remove_files(self, cut: str) -> list[str]:
        d = layout.cut_dir(cut)
        foreign = []
        for entry in self._storage.list_dir(d):
            ours = layout.is_shard_name(entry.name) or layout.is_rank_record_name(entry.name) or layout.is_tmp_name(entry.name)
            if entry.is_dir or not ours:
                foreign.append(f"{d}/{entry.name}")
                continue
            self._storage.delete(f"{d}/{entry.name}", durable=False)
        self.phase(PrunePhase.FILES_DELETED, cut)
        if not foreign:
            self._storage.remove_dir(d)
        self.phase(PrunePhase.REMOVED, cut)
        return foreign

    def remove_temp(self, rel: str) -> None:
        """A temp file a crashed durable write left."""
        self._guard()
        self._storage.delete(rel, durable=True)

    def abort_upload(self, upload: Upload) -> None:
        """A multipart upload no live writer runs (gc, recovery; issue 24): its parts are freed."""
        self._guard()
        self._storage.abort_upload(upload)

    def remove_latest(self) -> None:
        """An empty store's LATEST (repair when no cut is committed)."""
        self._guard()
        self._pointed, self._pointed_unmarked, self._latest_tag = None, False, None
        self._storage.delete(layout.LATEST_FILE, durable=True)

    def mark_final(self, mark: FinalMark) -> None:
        """``final/<cut>.json``: a committed cut marked final after its commit (one durable write; the
        cut's manifest and LATEST stay as they are)."""
        self._guard()
        self._storage.write_durably(layout.final_path(mark.cut), mark.to_bytes())

    def remove_final_mark(self, cut: str) -> None:
        """The final mark of a cut that is gone (a crash between a prune's uncommit and this)."""
        self._guard()
        self._storage.delete(layout.final_path(cut), durable=True)

    def write_label(self, label: Label) -> None:
        """``labels/<digest>.json`` names a committed cut: one durable replace (a label moves atomically)."""
        self._guard()
        self._storage.write_durably(label_path(label.label), label.to_bytes())

    def remove_label_file(self, rel: str) -> None:
        """Deletes one label file, durably (``unlabel``, a removed cut's labels, gc of stale ones)."""
        self._guard()
        self._storage.delete(rel, durable=True)

    def record_bad(self, bad: BadCut) -> None:
        """``bad/<cut>.json``: a committed cut proven damaged, skipped by later fallbacks."""
        self._storage.write_durably(layout.bad_path(bad.cut), bad.to_bytes())
