"""Mirroring a store (issue 21, first part): a committed cut of one store copied into another, byte for
byte, through the other store's own protocol.

The mirror is an ordinary store. A cut goes in as every cut does (mark, files, manifest, then LATEST:
:meth:`~ckptstore.pending.PendingCut.commit_copy`), so every crash rule of a store holds there too: a
copy killed midway is a marked leftover that the mirror's next writer open removes, and the mirror's
committed cuts are never touched. What lands is the source's committed cut unchanged: the same cut id,
step, files and manifest bytes (so the same per-tensor and file digests, and the same manifest digest
in LATEST).

Every byte is checked against the source's manifest as it streams: ``read_shard_into`` hands each
stored byte on (its ``tap``) while it hashes it, with the checks verify and load run (no second hasher).
A source file that does not match is never completed on the mirror: its sink is aborted and the
mirror's cut abandoned (the mirror keeps its older cut), the cut is recorded bad on the source, and the
``DataError`` names the source, the cut and the file. LATEST on the mirror moves only forward: a cut
older than the mirror's LATEST is committed without moving it (``CommitProtocol.commit_in_order``).

:func:`mirror_cut` copies one cut (what the writer process will call, through :mod:`ckptstore.spi`);
:func:`missing` and :func:`mirror_missing` catch a mirror up, oldest first (``ckptstore mirror``). A cut
of several ranks mirrored by its ranks, each its own files, goes through :mod:`ckptstore.mirroring_ranks`,
which builds on :func:`source_manifest`, :func:`on_mirror`, :func:`copy_file` and :func:`source_damage`.

One upload costs O(files of its cut) requests, whatever the number of cuts either store holds (issue 21):
both stores are read by name (LATEST, that cut's manifest and marks), never classified; a cut at or below
the mirror's LATEST step lists ``cuts/`` once more, for another cut at its step (a ``MirrorConflict``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .assemble import part_manifest, read_fragment
from . import cutting, labeling, layout, repairing
from .core import StoreCore
from .errors import CkptStoreError, CutNotFound, DataError, StepConflict, StorageError, UsageError
from .events import log
from .info import CutInfo
from .latest import Pointer
from .manifest import FileRecord, Manifest, TensorRecord
from .paths import refuse_symlinked_cut
from .pending import PendingCut
from .pointed import parse_manifest, read_or_none
from .shardread import read_shard_into
from .storage import Storage
from .store import Store, core_of

#: Called with each count of bytes copied (stored bytes, as the manifest's ``nbytes`` counts them).
Progress = Callable[[int], None]
#: Called before each cut ``mirror_missing`` copies: its info, its number (from 1) and how many there are.
OnCut = Callable[[CutInfo, int, int], None]


class MirrorConflict(StepConflict, wire="mirror-conflict"):
    """The mirror holds another cut under this cut's id, or another cut at its step (two runs share the
    mirror's URL, or it was written apart from its source). Nothing was changed on either store."""


@dataclass
class MirrorReport:
    """What ``mirror_missing`` did: the cuts it ``mirrored`` (oldest first), the source cuts whose bytes
    did not verify (``failed``: each recorded bad on the source, never uploaded), and those ``removed``
    (pruned) from the source while they were being mirrored."""

    source: str
    mirror: str
    mirrored: list[CutInfo] = field(default_factory=list)
    failed: list[DataError] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "mirror": self.mirror, "ok": self.ok,
                "mirrored": [c.to_json() for c in self.mirrored],
                "failed": [{"cut": e.cut, "path": e.path, "error": type(e).__name__, "message": e.message}
                           for e in self.failed],
                "removed": list(self.removed)}


def missing(src: Store, dst: Store) -> list[str]:
    """The cuts committed on ``src`` and not on ``dst``, in step order. A cut recorded bad on ``src`` is
    left out: it is proven damaged, and retrying it would fail every catch-up the same way."""
    have = core_of(dst).classify().committed_ids()
    cls = core_of(src).classify()
    return [m.cut for m in cls.committed if m.cut not in have and m.cut not in cls.bad]


def mirror_cut(src: Store, dst: Store, cut: str, *, progress: Progress | None = None) -> CutInfo:
    """Copies committed cut ``cut`` of ``src`` into ``dst`` (opened as its writer) and commits it there;
    returns the mirror's info of it. A cut ``dst`` already holds with the same manifest bytes is a
    no-op; another manifest under its id, or another cut at its step, is a ``MirrorConflict``. A source
    byte that does not match: nothing committed on ``dst``, the cut recorded bad on ``src`` where it can
    be, and the ``DataError`` raised (``CutNotFound`` instead when ``src`` pruned the cut meanwhile)."""
    s, d = core_of(src), core_of(dst)
    d.require_writer("mirroring into a store")
    if s.closed:
        raise UsageError("mirroring from a closed store", store=s.url)
    if s.url == d.url:
        raise UsageError(f"a store cannot be its own mirror: {s.url}", store=s.url)
    src_cut = source_manifest(s, cut)
    m, data = src_cut.manifest, src_cut.data
    present = on_mirror(s, d, m, data)
    if present is None:
        started = time.monotonic()
        present = _copy_cut(s, d, m, data, progress)
        d.events.emit("mirrored", cut=m.cut, step=m.step, source=s.url, nbytes=m.nbytes,
                      seconds=round(time.monotonic() - started, 6))
    if src_cut.marked_final and not present.final:
        present = labeling.mark_manifest_final(d, m, marked=False)  # marked final after its commit, on the source
    return present


def mirror_missing(src: Store, dst: Store, *, progress: Progress | None = None,
                   on_cut: OnCut | None = None) -> MirrorReport:
    """Mirrors every cut :func:`missing` lists, oldest first. A cut whose source bytes do not verify
    is reported (and recorded bad on the source) and the next one is mirrored; a storage error of
    either store stops the catch-up and is raised (what was committed stays committed)."""
    report = MirrorReport(source=src.url, mirror=dst.url)
    todo = missing(src, dst)
    cls = core_of(src).classify()
    for i, cut in enumerate(todo, 1):
        m = cls.find(cut)
        if m is None:
            report.removed.append(cut)
            continue
        if on_cut is not None:
            on_cut(cls.info(m), i, len(todo))
        try:
            report.mirrored.append(mirror_cut(src, dst, cut, progress=progress))
        except CutNotFound:
            report.removed.append(cut)
        except DataError as exc:
            report.failed.append(exc)
    return report


@dataclass(frozen=True)
class SourceCut:
    """A committed cut of the source as an upload reads it: its manifest's bytes, what they parse to,
    and whether it was marked final after its commit (``final/``)."""

    data: bytes
    manifest: Manifest
    marked_final: bool


def source_manifest(s: StoreCore, cut: str) -> SourceCut:
    """Committed cut ``cut`` of the source, read by name: LATEST, the manifest, then the mark (a scan's
    order, docs/design.md), committed as a classification says (a valid manifest, and no mark or
    LATEST names it); ``CutNotFound`` otherwise. Issue 21: the tier uploads once per cut, and a
    classification lists every cut directory and reads every manifest, O(cuts) requests on S3."""
    layout.check_cut_id(cut, store=s.url)
    refuse_symlinked_cut(s.storage, cut)
    pointer = _pointer(s.storage, s.url)
    rel = layout.manifest_path(cut)
    data = read_or_none(s.storage, rel)
    if data is None or not _unmarked_or_latest(s.storage, cut, pointer):
        raise CutNotFound(f"cut {cut} is not committed in {s.url}", store=s.url, cut=cut, path=rel)
    try:
        m = parse_manifest(s.url, cut, data)
    except DataError as exc:  # a damaged manifest commits nothing (the classification's word, as before)
        raise CutNotFound(f"cut {cut} is not committed in {s.url}: its manifest is damaged ({exc.message})",
                          store=s.url, cut=cut, path=rel) from exc
    return SourceCut(data, m, not m.final and s.storage.exists(layout.final_path(cut)))


def on_mirror(s: StoreCore, d: StoreCore, m: Manifest, data: bytes) -> CutInfo | None:
    """The mirror's info of the cut when it holds it already (the same manifest bytes), None when it
    does not; ``MirrorConflict`` when it holds another cut under its id or at its step. Read by name
    as :func:`source_manifest` reads (issue 21): its manifest, and LATEST, which names the mirror's
    newest cut (``commit_in_order`` moves it only forward), so a cut above LATEST's step costs no
    listing; one at or below it lists ``cuts/`` once, never a cut directory."""
    refuse_symlinked_cut(d.storage, m.cut)
    pointer = _pointer(d.storage, d.url)
    rel = layout.manifest_path(m.cut)
    have = read_or_none(d.storage, rel)
    if have is not None and _committed(d, m.cut, have, pointer):
        if have == data:
            return CutInfo.from_manifest(m, marked_final=not m.final and d.storage.exists(layout.final_path(m.cut)))
        raise MirrorConflict(f"the mirror holds cut {m.cut} with another manifest than the source {s.url}",
                             store=d.url, cut=m.cut, path=rel,
                             hint="a mirror belongs to one source store; give this one a URL of its own")
    other = _other_at_step(d, m, pointer)
    if other is not None:
        raise MirrorConflict(f"the mirror holds cut {other} at step {m.step}; the source {s.url} has cut "
                             f"{m.cut} there", store=d.url, cut=other, path=layout.manifest_path(other),
                             hint="a mirror belongs to one source store; give this one a URL of its own")
    return None


def _other_at_step(d: StoreCore, m: Manifest, pointer: Pointer | None) -> str | None:
    """A committed cut of the mirror at ``m``'s step under another id, or None. Above LATEST's step
    there is none (the rule ``StoreCore.check_step`` applies to every save, issue 24). Otherwise the
    names of ``cuts/`` tell the candidates: a cut id carries its step, and a valid manifest's step
    is its id's (``Manifest`` checks it)."""
    if pointer is not None and pointer.step < m.step:
        return None
    for e in d.storage.list_dir(layout.CUTS_DIR):
        if not (e.is_dir and e.name != m.cut and layout.is_cut_id(e.name) and layout.step_of_cut_id(e.name) == m.step):
            continue
        body = read_or_none(d.storage, layout.manifest_path(e.name))
        if body is not None and _committed(d, e.name, body, pointer):
            return e.name
    return None


def _committed(d: StoreCore, cut: str, body: bytes, pointer: Pointer | None) -> bool:
    """Whether ``cut``, whose manifest reads ``body``, is committed on the mirror: the manifest is
    valid (a damaged one commits nothing: the copy writes over it, as before) and the cut unmarked
    or LATEST's."""
    try:
        parse_manifest(d.url, cut, body)
    except DataError:
        return False
    return _unmarked_or_latest(d.storage, cut, pointer)


def _unmarked_or_latest(storage: Storage, cut: str, pointer: Pointer | None) -> bool:
    """The protocol's test of a cut with a valid manifest (LATEST read before, the mark after: a stale
    mark that Rule M removes before LATEST moves on is then never read as in flight)."""
    return (pointer is not None and pointer.cut == cut) or not storage.exists(layout.mark_path(cut))


def _pointer(storage: Storage, url: str) -> Pointer | None:
    """LATEST as it is now; None when absent or damaged (then it names no cut, and rules out no
    conflict: ``_other_at_step`` lists)."""
    data = read_or_none(storage, layout.LATEST_FILE)
    try:
        return None if data is None else Pointer.from_bytes(data, store=url, path=layout.LATEST_FILE)
    except DataError:
        return None


def _copy_cut(s: StoreCore, d: StoreCore, m: Manifest, data: bytes, progress: Progress | None) -> CutInfo:
    """The mirror's cut: marked first, every file streamed and checked, the manifest's bytes, then the
    commit. Any failure abandons it (the mark goes last, so what a crash leaves stays marked)."""
    pending = cutting.begin_cut(d, m.step, writer="mirror", cut=m.cut, world_size=m.world_size,
                                above_latest=False)
    damage: DataError | None = None
    try:
        damage = _copy_files(s.storage, d.storage, m, pending, progress)
        if damage is None:
            pending.files_durable()
            return pending.commit_copy(data)
    except BaseException:
        pending.abandon()
        raise
    pending.abandon()
    raise source_damage(s, d, m, damage)


def _copy_files(src: Storage, dst: Storage, m: Manifest, pending: PendingCut,
                progress: Progress | None) -> DataError | None:
    """Streams each of the cut's files (of every rank) into the pending cut and records them; the
    first source file that does not verify stops it and is returned. A cut of format 5 goes rank by
    rank: its fragment read and checked, its files, then the fragment's bytes unchanged (issue 22)."""
    if m.fragmented:
        for rank in range(m.world_size):
            try:
                record, fragment = read_fragment(src, src.url, m, rank)
            except DataError as exc:
                return exc
            part = part_manifest(m, record)
            by_file = {}
            for t in part.tensors:
                by_file.setdefault(t.file, []).append(t)
            for rec in part.files:
                try:
                    copy_file(src, dst, part, rec, by_file.get(rec.name, []), progress)
                except DataError as exc:
                    return exc
            dst.sync_dir(layout.cut_dir(m.cut))  # the files' names before the fragment that names them
            pending.copy_part(record, fragment)
        return None
    by_file: dict[str, list[TensorRecord]] = {}
    for t in m.tensors:
        by_file.setdefault(t.file, []).append(t)
    by_rank: dict[int, list[FileRecord]] = {}
    for rec in m.files:
        try:
            copy_file(src, dst, m, rec, by_file.get(rec.name, []), progress)
        except DataError as exc:
            return exc
        by_rank.setdefault(rec.rank, []).append(rec)
    for rank, files in sorted(by_rank.items()):
        pending.add_files(files, [t for f in files for t in by_file.get(f.name, [])], rank=rank)
    return None


def copy_file(src: Storage, dst: Storage, m: Manifest, rec: FileRecord, tensors: list[TensorRecord],
               progress: Progress | None) -> None:
    """One file: its stored bytes into a sink of the mirror as they are read and checked. The sink is
    closed (durable) only once every check passed; otherwise it is aborted, so bad bytes never land."""
    sink = dst.open_sink(layout.cut_file(m.cut, rec.name))

    def tap(piece: memoryview | bytes) -> None:
        # The read reuses its buffer for the next piece, and a POSIX sink may write a page-aligned
        # piece straight from the caller's memory until it closes (zero copy): hand over a copy.
        sink.write(bytes(piece))
        if progress is not None:
            progress(len(piece))

    try:
        read_shard_into(src, m.cut, rec, tensors, lambda t: None, format_version=m.format_version, verify=True,
                        reuses_buffers=True, tap=tap)
    except BaseException:
        sink.abort()
        raise
    sink.close()


def source_damage(s: StoreCore, d: StoreCore, m: Manifest, exc: DataError) -> CkptStoreError:
    """What to raise for a source file that did not verify: the error itself, once the cut is recorded
    bad on the source; ``CutNotFound`` when the source pruned the cut meanwhile (prune deletes the
    manifest first, so files going under a manifest that is gone are no damage)."""
    gone = CutNotFound(f"cut {m.cut} was removed from {s.url} while it was mirrored", store=s.url, cut=m.cut)
    try:
        if not s.storage.exists(layout.manifest_path(m.cut)):
            return gone
    except CkptStoreError:
        return exc  # cannot tell: only proven damage is recorded bad
    try:
        repairing.record_bad(s, m.cut, f"mirroring to {d.url}: {exc.message}")
    except CutNotFound:
        return gone
    except StorageError as refused:  # a reader without write access, say: the error still says it all
        log.warning("ckptstore: could not record bad cut %s of %s: %s", m.cut, s.url, refused)
    return exc


__all__ = ["MirrorConflict", "MirrorReport", "OnCut", "Progress", "missing", "mirror_cut", "mirror_missing"]
