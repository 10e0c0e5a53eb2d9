"""One cut from begin to commit or abandon: the lifecycle object every writer of the store goes through.

``Store.begin_cut`` (writer handles only) marks a cut and returns a :class:`PendingCut`. Its files are
written into it (``write`` here, or elsewhere and recorded with ``add_files``: the background writer
process), ``files_durable`` makes their names durable, and ``commit`` publishes the manifest and
moves LATEST (:mod:`ckptstore.protocol` has the steps and the invariant). ``abandon`` removes an
uncommitted cut. States::

    open -> written -> committing -> committed
      |        |            |
      +--------+------------+-> abandoned      (committing -> abandoned only when LATEST surely
                            +-> unknown         does not name the cut; unknown: the next open decides)

Any other transition raises ``UsageError``. The files of a cut are recorded per rank. In a cut of
several ranks every rank writes its share through a :class:`RankPart` (shards, then its durable rank
record, the part's fragment), and tells the coordinator the record's size and digest; the
coordinator's ``PendingCut`` commits a record of those (``take_parts``, format 5: no fragment is read,
issue 22), or reads every record itself where nobody told it (``collect_ranks``: rescue, mirrors).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

from . import hashing, layout
from .arrays import ArrayItem
from .attached import AttachedFile
from .errors import CkptStoreError, CorruptCut, ManifestError, StorageError, StoreLocked, UsageError
from .gcpause import pausing
from .ident import host_identity
from .info import CutInfo
from .intent import CutIntent, ShardSpec
from .fragments import BadPart, PartRef, checked, parts_from_json
from .manifest import FRAGMENTS_FORMAT_VERSION, FileRecord, Manifest, RankRecord, TensorRecord, WriterIdentity
from .protocol import CommitProtocol, CommitUnknown, now_iso
from .shards import Codec
from .version import __version__

if TYPE_CHECKING:
    from .storage import Storage

OPEN, WRITTEN, COMMITTING, COMMITTED, ABANDONED, UNKNOWN = (
    "open", "written", "committing", "committed", "abandoned", "unknown")
_ALLOWED = {
    OPEN: {WRITTEN, ABANDONED},
    WRITTEN: {COMMITTING, ABANDONED},
    COMMITTING: {COMMITTED, ABANDONED, UNKNOWN},
}


class PendingCut:
    """A marked cut of this writer's. Made by ``Store.begin_cut``; not thread-safe (one driver)."""

    def __init__(self, protocol: CommitProtocol, storage: "Storage", cut: str, step: int, writer: str,
                 on_end: Callable[["PendingCut"], None], world_size: int = 1, shards: ShardSpec | None = None,
                 publishing: ContextManager[Any] | None = None) -> None:
        self._protocol = protocol
        self._storage = storage
        self.id = cut
        self.step = step
        self.writer = writer
        self.world_size = world_size
        #: How this cut's shards are written (the store's settings, carried by the cut; issue 20).
        self.shards = shards if shards is not None else ShardSpec()
        self.state = OPEN
        self._files: dict[int, tuple[list[FileRecord], list[TensorRecord]]] = {}
        self._trees: dict[int, tuple[dict[str, Any], bool]] = {}
        self._attached: dict[int, list[AttachedFile]] = {}
        #: Cuts of several ranks: each rank's fragment as the rank described it (``take_parts``) or as
        #: ``collect_ranks`` read it: what the commit record lists (format 5, issue 22).
        self._refs: dict[int, PartRef] = {}
        self._on_end = on_end
        # Held over steps 4-5: LATEST is read, then replaced, and two cuts of one handle in two threads
        # (a restore's background write-back and the trainer's next cut, issue 21) must not interleave
        # there, or LATEST could move back.
        self._publishing = publishing if publishing is not None else contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"PendingCut({self.id!r}, {self.state})"

    def _move(self, new: str) -> None:
        if new not in _ALLOWED.get(self.state, set()):
            raise UsageError(f"cut {self.id}: {self.state} -> {new} is not allowed", store=self._protocol.url,
                             cut=self.id)
        self.state = new
        if new in (COMMITTED, ABANDONED, UNKNOWN):
            self._on_end(self)

    # files -------------------------------------------------------------------------------------------
    def write(self, items: Sequence[ArrayItem], *, codec: Codec | None = None, max_shard_bytes: int | None = None,
              rank: int = 0, on_bytes: Callable[[int], None] | None = None, timings: dict[str, float] | None = None,
              hash_threads: int = hashing.AUTO) -> tuple[list[FileRecord], list[TensorRecord]]:
        """Writes ``items`` as this cut's shards of ``rank`` (durable on return) and records them, with
        the cut's shard settings unless ``codec`` / ``max_shard_bytes`` say otherwise."""
        self._require(OPEN, "write files")
        files, tensors = self._protocol.write_shards(
            self.id, rank, items, codec=codec or self.shards.make_codec(),
            max_shard_bytes=max_shard_bytes or self.shards.max_shard_bytes, on_bytes=on_bytes, timings=timings,
            hash_threads=hash_threads)
        self.add_files(files, tensors, rank=rank)
        return files, tensors

    def add_files(self, files: list[FileRecord], tensors: list[TensorRecord], *, rank: int = 0) -> None:
        """Records files of ``rank`` written (and fsynced) elsewhere, e.g. by the writer process."""
        self._require(OPEN, "add files")
        if any(f.rank != rank for f in files):
            raise UsageError(f"file records of cut {self.id} name another rank than {rank}", cut=self.id)
        self._files[rank] = (list(files), list(tensors))

    def publish(self, files: list[FileRecord], tensors: list[TensorRecord], intent: CutIntent | None = None, /,
                **fields: Any) -> None:
        """The part of a cut of one rank (the intent's ``tree``, ``pickled`` and ``attached``), kept
        here for ``commit`` (as :meth:`RankPart.publish` keeps a part of several in a durable record):
        so one save path writes a part whatever the world size."""
        part = CutIntent.given(intent, fields, what="publish")
        if self.world_size != 1:
            raise UsageError(f"cut {self.id} of {self.world_size} ranks takes its parts from rank records",
                             store=self._protocol.url, cut=self.id)
        if part.tree is None:
            raise UsageError(f"the part of cut {self.id} needs its tree", store=self._protocol.url, cut=self.id)
        self.add_files(files, tensors)
        self._trees[0] = (part.tree, part.pickled)
        self._attached[0] = list(part.attached)

    def files(self) -> list[FileRecord]:
        """Every file recorded so far, of every rank."""
        return [f for rank in sorted(self._files) for f in self._files[rank][0]]

    def missing_ranks(self) -> list[int]:
        """Ranks whose record is not (yet) in the cut's directory."""
        self._require(OPEN, "look for rank records")
        have = self._protocol.ranks_published(self.id)
        return [r for r in range(self.world_size) if r not in have]

    def collect_ranks(self) -> None:
        """Reads every rank's record (cuts of several ranks) and records their files and trees. Raises
        ``CkptStoreError`` naming the ranks whose record is missing, ``CorruptCut`` for a record that
        does not belong to this cut, and ``ManifestError`` for one that lists another rank's files."""
        self._require(OPEN, "collect rank records")
        if self.world_size == 1:
            return  # its one part was published here (``publish``), not as a record
        missing = self.missing_ranks()
        if missing:
            raise CkptStoreError(f"rank(s) {missing} have not published their files of cut {self.id}",
                                 store=self._protocol.url, cut=self.id)
        for rank in range(self.world_size):
            rec, data = self._protocol.read_rank(self.id, rank)
            if (rec.cut, rec.step, rec.rank, rec.world_size) != (self.id, self.step, rank, self.world_size):
                raise CorruptCut(f"rank record names cut {rec.cut} step {rec.step} rank {rec.rank} of "
                                 f"{rec.world_size}, expected rank {rank} of {self.world_size}",
                                 store=self._protocol.url, cut=self.id, path=layout.rank_record_path(self.id, rank))
            # A rank writes only its own shards, whose names carry its rank: a record that lists
            # another's made the manifest's duplicate-name check fail as a raw pydantic error
            # naming neither the rank nor the record (issue 19 item 10).
            foreign = [f.name for f in rec.files if layout.shard_rank(f.name) != rank]
            if foreign:
                raise ManifestError(f"rank {rank}'s record lists file(s) {foreign[:3]} that are not rank {rank}'s "
                                    "shards; the cut is not committed", store=self._protocol.url, cut=self.id,
                                    path=layout.rank_record_path(self.id, rank))
            self._files[rank] = (list(rec.files), list(rec.tensors))
            self._trees[rank] = (rec.tree, rec.pickled)
            self._attached[rank] = list(rec.attached)
            self._refs[rank] = rec.part_ref(data)

    def copy_part(self, record: RankRecord, data: bytes) -> None:
        """Another store's fragment of this cut (``data``, its bytes: a mirror copies a cut of format 5
        byte for byte, issue 21) written here durably once the rank's files are, and recorded as
        ``collect_ranks`` records a record it read."""
        self._require(OPEN, "copy a rank's part")
        self._protocol.publish_rank(record, data)
        self._files[record.rank] = (list(record.files), list(record.tensors))
        self._trees[record.rank] = (record.tree, record.pickled)
        self._attached[record.rank] = list(record.attached)
        self._refs[record.rank] = record.part_ref(data)

    def take_parts(self, parts: Sequence[Any]) -> None:
        """Each rank's fragment as the rank itself described it once it was durable (its ``written``
        post: :meth:`RankPart.publish`'s ``ref``), in rank order: the commit record is made of these,
        and no fragment is read (issue 22). ``CorruptCut`` naming the rank for a reference that is not
        a sane one of its own record."""
        self._require(OPEN, "take the ranks' parts")
        if len(parts) != self.world_size:
            raise UsageError(f"cut {self.id} of {self.world_size} ranks got {len(parts)} part references",
                             store=self._protocol.url, cut=self.id)
        try:
            refs = dict(enumerate(parts_from_json([p.to_json() if type(p) is PartRef else p for p in parts])))
        except BadPart as exc:
            raise CorruptCut(f"rank {exc.rank}'s description of its part is not valid: {exc}; the cut is not "
                             "committed", store=self._protocol.url, cut=self.id,
                             path=layout.rank_record_path(self.id, exc.rank)) from None
        self._refs = refs

    def discard_files(self) -> None:
        """Drops the files written so far (a writer process died mid-cut), keeping the cut marked, so
        the same cut can be written again from the same memory."""
        self._require(OPEN, "discard files")
        self._files.clear()
        self._protocol.discard_files(self.id)

    def files_durable(self) -> None:
        """Makes the names of every recorded file durable; after it only ``commit`` or ``abandon``."""
        self._require(OPEN, "finish files")
        self._protocol.files_durable(self.id)
        self._move(WRITTEN)

    # outcome -----------------------------------------------------------------------------------------
    @pausing
    def commit(self, intent: CutIntent | None = None, /, **fields: Any) -> CutInfo:
        """Publishes the manifest and moves LATEST: returns once the cut is committed durably. On a
        failure before the commit point the cut is abandoned; when LATEST may have moved the cut is
        left to recovery (state "unknown"); either way the error is raised. ``intent`` (or its fields
        as keywords) says what the manifest records: a cut of one rank takes its tree and attached
        files from it or from its published part, a cut of several from the collected records."""
        self._require(WRITTEN, "commit")
        manifest = self._manifest(CutIntent.given(intent, fields, what="commit"))
        return self._publish(manifest, None)

    @pausing
    def commit_copy(self, data: bytes) -> CutInfo:
        """Commits this cut with another store's manifest bytes of it, unchanged (a mirror copies a
        committed cut byte for byte, issue 21): they must name this cut, its step, its world size and
        exactly the files recorded. LATEST only moves forward: a cut older than LATEST's is committed
        without moving it (``CommitProtocol.commit_in_order``), so the store's newest stays newest.
        Failures end the cut as ``commit`` says."""
        self._require(WRITTEN, "commit")
        where = {"store": self._protocol.url, "cut": self.id, "path": layout.manifest_path(self.id)}
        manifest = Manifest.from_bytes(data, **where)
        recorded = {f.name: f for f in self.files()}
        same = (manifest.parts == [self._refs.get(r) for r in range(self.world_size)] if manifest.fragmented
                else {f.name: f for f in manifest.files} == recorded)
        if (manifest.cut, manifest.step, manifest.world_size) != (self.id, self.step, self.world_size) or not same:
            raise UsageError(f"the manifest to copy names cut {manifest.cut} step {manifest.step} of "
                             f"{manifest.world_size} rank(s) and {len(manifest.files)} file(s), not the "
                             f"{len(recorded)} recorded of this cut", **where)
        return self._publish(manifest, data)

    def _publish(self, manifest: Manifest, copied: bytes | None) -> CutInfo:
        """Steps 4-6 of ``commit`` (``copied``: the manifest's bytes as another store holds them)."""
        self._move(COMMITTING)
        moved = True
        with self._publishing:
            try:
                if copied is None:
                    digest = self._protocol.write_manifest(manifest)
                    self._protocol.point_latest(self.id, self.step, digest)
                else:
                    digest = self._protocol.copy_manifest(self.id, copied)
                    moved = self._protocol.commit_in_order(self.id, self.step, digest)
            except CommitUnknown:
                self._move(UNKNOWN)
                raise
            except StoreLocked:
                # This handle may no longer change the store; only its own manifest is taken back, so a
                # cut the new holder already cleaned cannot look committed without its files. The rest
                # (mark, files) is the holder's gc's.
                self._protocol.withdraw_manifest(self.id)
                self._move(UNKNOWN)
                raise
            except BaseException:
                self._protocol.abandon(self.id)
                self._move(ABANDONED)
                raise
        self._move(COMMITTED)
        try:
            if moved:  # else the unmark was the commit point
                self._protocol.unmark(self.id)
        except StorageError:
            # Committed and named by LATEST; the stale mark is cleared by the next commit (Rule M) or
            # by recovery, and can never demote the cut (docs/design.md).
            pass
        return CutInfo.from_manifest(manifest)

    def finish(self, intent: CutIntent | None = None, /, *, parts: Sequence[Any] | None = None,
               **fields: Any) -> CutInfo:
        """The coordinator's side of every driver: the parts (one rank's was published here; of
        several, ``parts`` as the ranks described their records, else the records read), their names
        durable, commit. One copy of the sequence (issue 20)."""
        if parts is not None and self.world_size > 1:
            self.take_parts(parts)
        else:
            self.collect_ranks()
        self.files_durable()
        return self.commit(intent, **fields)

    def _manifest(self, intent: CutIntent) -> Manifest:
        files = [f for rank in sorted(self._files) for f in self._files[rank][0]]
        tensors = [t for rank in sorted(self._files) for t in self._files[rank][1]]
        tree, pickled, attached = intent.tree, intent.pickled, intent.attached
        if self.world_size > 1:
            # Every rank's part (the coordinator's too: the intent's part fields) is in its record,
            # its fragment: the commit record lists them (format 5, issue 22).
            if len(self._refs) != self.world_size:
                raise UsageError(f"cut {self.id} of {self.world_size} ranks commits its ranks' fragments "
                                 "(take_parts or collect_ranks first)", store=self._protocol.url, cut=self.id)
            parts = checked([self._refs[r] for r in range(self.world_size)])
            ident = host_identity()
            return Manifest(
                format_version=FRAGMENTS_FORMAT_VERSION, world_size=self.world_size, cut=self.id, step=self.step,
                tags=list(intent.tags), final=intent.final, created_at=now_iso(),
                writer=WriterIdentity(host=ident.host, pid=ident.pid, ckptstore_version=__version__, mode=intent.mode),
                metadata=dict(intent.metadata), parts=parts, pickled=any(p.pickled for p in parts))
        elif tree is None and 0 in self._trees:  # the part published here
            tree, pickled = self._trees[0]
            attached = self._attached.get(0, [])
        elif tree is None:
            raise UsageError(f"committing cut {self.id} needs its tree", store=self._protocol.url, cut=self.id)
        ident = host_identity()
        return Manifest(
            cut=self.id, step=self.step, tags=list(intent.tags), final=intent.final, created_at=now_iso(),
            writer=WriterIdentity(host=ident.host, pid=ident.pid, ckptstore_version=__version__, mode=intent.mode),
            metadata=dict(intent.metadata), files=files, tensors=tensors, tree=tree, pickled=pickled,
            attached=list(attached),
        )

    @staticmethod
    def left_as(pending: "PendingCut | None") -> str:
        """What a failed commit left, for the ranks that hear of it: LATEST may name the cut (state
        "unknown"), or it was left where it was."""
        if pending is not None and pending.state == UNKNOWN:
            return "LATEST may name it: the next writer open decides"
        return "LATEST was left where it was"

    def abandon(self) -> None:
        """Removes the cut's files and mark (best effort: what stays is still marked, so ``gc`` finds
        it). A no-op once the cut has ended."""
        if self.state in (COMMITTED, ABANDONED, UNKNOWN):
            return
        if self.state == COMMITTING:
            raise UsageError(f"cut {self.id} is being committed", cut=self.id)
        self._protocol.abandon(self.id)
        self._move(ABANDONED)

    def _require(self, state: str, what: str) -> None:
        if self.state != state:
            raise UsageError(f"cannot {what}: cut {self.id} is {self.state}", store=self._protocol.url, cut=self.id)


class RankPart:
    """One rank's share of a cut of several ranks that the coordinator marked: its shards, then its
    durable record (``cuts/<cut>/rank<r>.json``). Holds no lock and commits nothing: any process that
    can reach the storage (a rank, its writer process) can write one."""

    def __init__(self, protocol: CommitProtocol, storage: "Storage", cut: str, step: int, rank: int,
                 world_size: int, shards: ShardSpec | None = None) -> None:
        self._protocol = protocol
        self._storage = storage
        self.id = cut
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.shards = shards if shards is not None else ShardSpec()
        self.published = False
        self.ref: PartRef | None = None

    def __repr__(self) -> str:
        return f"RankPart({self.id!r}, rank {self.rank} of {self.world_size})"

    def write(self, items: Sequence[ArrayItem], *, codec: Codec | None = None, max_shard_bytes: int | None = None,
              timings: dict[str, float] | None = None, hash_threads: int = hashing.AUTO
              ) -> tuple[list[FileRecord], list[TensorRecord]]:
        """Writes ``items`` as this rank's shards (durable on return), with the cut's shard settings
        unless ``codec`` / ``max_shard_bytes`` say otherwise; ``publish`` them next."""
        return self._protocol.write_shards(self.id, self.rank, items, codec=codec or self.shards.make_codec(),
                                           max_shard_bytes=max_shard_bytes or self.shards.max_shard_bytes,
                                           timings=timings, hash_threads=hash_threads)

    def discard_files(self) -> None:
        """Removes this rank's partial files (its writer process died mid-cut), so they can be
        written again; other ranks' files are left alone."""
        if self.published:
            raise UsageError(f"rank {self.rank} already published its part of cut {self.id}", cut=self.id)
        self._protocol.discard_rank_files(self.id, self.rank)

    def publish(self, files: list[FileRecord], tensors: list[TensorRecord], intent: CutIntent | None = None, /,
                **fields: Any) -> RankRecord:
        """Makes the names of this rank's (fsynced) files durable, then writes its record durably: the
        intent's part (``tree``, ``pickled``, ``attached``) under its writer ``mode``."""
        part = CutIntent.given(intent, fields, what="publish")
        if part.tree is None:
            raise UsageError(f"rank {self.rank}'s part of cut {self.id} needs its tree", cut=self.id)
        tree, pickled, mode, attached = part.tree, part.pickled, part.mode, part.attached
        if self.published:
            raise UsageError(f"rank {self.rank} already published its part of cut {self.id}", cut=self.id)
        # The commit reads no record (issue 22): a rank checks its own before it describes it.
        foreign = [f.name for f in files if layout.shard_rank(f.name) != self.rank]
        if foreign:
            raise ManifestError(f"rank {self.rank}'s part lists file(s) {foreign[:3]} that are not its shards",
                                store=self._protocol.url, cut=self.id, path=layout.rank_record_path(self.id, self.rank))
        self._protocol.files_durable(self.id)
        ident = host_identity()
        record = RankRecord(cut=self.id, step=self.step, rank=self.rank, world_size=self.world_size,
                            created_at=now_iso(), files=list(files), tensors=list(tensors), tree=tree, pickled=pickled,
                            attached=[a.model_copy(update={"rank": self.rank}) for a in attached],
                            writer=WriterIdentity(host=ident.host, pid=ident.pid, ckptstore_version=__version__, mode=mode))
        data = self._protocol.publish_rank(record)
        self.published = True
        #: What the commit record lists of this part: the rank tells the coordinator (issue 22).
        self.ref = record.part_ref(data)
        return record

    def publish_copy(self, record: RankRecord, data: bytes) -> None:
        """Another store's record of this rank (``data``, its bytes, unchanged: a mirror copies a cut
        byte for byte) once this rank's files are copied; as :meth:`publish` otherwise."""
        if self.published:
            raise UsageError(f"rank {self.rank} already published its part of cut {self.id}", cut=self.id)
        self._protocol.files_durable(self.id)
        self._protocol.publish_rank(record, data)
        self.published = True
        self.ref = record.part_ref(data)


__all__ = ["PendingCut", "RankPart"]
