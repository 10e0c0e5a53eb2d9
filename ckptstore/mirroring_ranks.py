"""Mirroring a cut of several ranks, each rank its own files (issue 21, "Several ranks").

The mirror's cut goes in through the storage-side two-phase commit every cut of several ranks uses
(docs/design.md, "Several ranks"), with the local cut's bytes::

    rank 0        mark the cut on the mirror                     (before any rank writes a byte there)
    every rank r  waits (bounded) for that mark; streams ITS files of the local cut into the mirror,
                  each byte checked against the local manifest; then its rank record, durably
    rank 0        waits (bounded) for every rank's record, checks each lists exactly the local
                  manifest's files of its rank and that they are there at their sizes; then the local
                  manifest's bytes, then LATEST (only forward), then unmark

So the mirror's cut is the local one byte for byte (cut id, files, manifest bytes), and a record commits
nothing: a rank that fails or dies before its record leaves a marked cut that rank 0 abandons after
``rank_timeout`` with a ``RankFailure`` naming it. The mirror keeps its older cut, and whatever a dead
rank's upload left after the abandon (a file, a record, an unfinished multipart upload) is a leftover
the mirror's next writer open collects (its recovery, as for any store).

The ranks meet through the mirror's storage alone, never through torch.distributed: each rank calls
:func:`mirror_rank` from its own writer process, which imports no torch (rank 0's holds the mirror's
writer lock or lease; the others open it as participants, ``spi.open_participant``). A wait ends when
the awaited object is there, or after ``rank_timeout`` seconds in which nothing new appeared (a rank
uploading a large file shows no progress until that file lands: ``rank_timeout`` must exceed one
shard's upload).

Shape: every rank's local tier is the same store (the shared directory or bucket that ranks of a
``group=`` write their parts into today); rank r reads only its own files of it, and only rank 0 lists
it (issue 24). Local tiers of a directory per node are a later part of issue 21.
"""

from __future__ import annotations

import time
from typing import Callable

from . import cutting, labeling, layout
from .assemble import part_manifest, read_fragment
from .core import StoreCore
from .errors import CutNotFound, DataError, RankFailure, UsageError
from .info import CutInfo
from .intent import CutIntent
from .manifest import Manifest, TensorRecord
from .mirroring import MirrorConflict, Progress, copy_file, on_mirror, source_damage, source_manifest
from .pending import PendingCut
from .pointed import read_or_none
from .ranks import DEFAULT_RANK_TIMEOUT
from .store import Store, core_of
from .tree import has_pickle

#: The writer mode the mirror's rank records carry (their manifest is the local one, unchanged).
MODE = "mirror"


def mirror_rank(src: Store, dst: Store, cut: str, rank: int, *, rank_timeout: float = DEFAULT_RANK_TIMEOUT,
                progress: Progress | None = None) -> CutInfo | None:
    """Rank ``rank``'s share of mirroring committed cut ``cut`` of several ranks from ``src`` (the local
    tier) into ``dst`` (module docstring). Rank 0 (``dst`` opened as its writer) marks, copies its files,
    waits for every rank's record and commits: it returns the mirror's info of the cut. Another rank
    (``dst`` a participant or a writer) waits for rank 0's mark, copies its files and posts its record:
    it returns None. A cut the mirror holds already (the same manifest bytes) is a no-op on every rank.
    A local file that does not verify is never completed on the mirror: the cut is recorded bad locally
    and the ``DataError`` raised (rank 0 then fails too, with a ``RankFailure`` naming this rank)."""
    s, d = core_of(src), core_of(dst)
    if s.closed:
        raise UsageError("mirroring from a closed store", store=s.url)
    if s.url == d.url:
        raise UsageError(f"a store cannot be its own mirror: {s.url}", store=s.url)
    if not (isinstance(rank_timeout, (int, float)) and rank_timeout > 0):
        raise UsageError(f"rank_timeout must be a positive number of seconds, got {rank_timeout!r}", store=d.url)
    if rank == 0:
        return _coordinate(s, d, cut, rank_timeout, progress)
    d.require_writer(f"mirroring rank {rank}'s part", participant_ok=True)
    data, m = _named_source(s, cut)
    _check_rank(d, m, rank)
    if _mirrored(d, m, data):
        return None
    _await(lambda: d.storage.exists(layout.mark_path(cut)) or _mirrored(d, m, data), rank_timeout,
           lambda: RankFailure(f"rank 0 did not mark cut {cut} on the mirror {d.url} within {rank_timeout:g} s; "
                               f"rank {rank} copied nothing", ranks=[0], store=d.url, cut=cut,
                               path=layout.mark_path(cut)))
    if not _mirrored(d, m, data):
        _post_part(s, d, m, rank, progress)
    return None


def _coordinate(s: StoreCore, d: StoreCore, cut: str, rank_timeout: float, progress: Progress | None) -> CutInfo:
    """Rank 0: mark, its own part, every rank's record, commit (module docstring)."""
    d.require_writer("mirroring a cut of several ranks (rank 0)")
    src_cut = source_manifest(s, cut)
    data, m = src_cut.data, src_cut.manifest
    _check_rank(d, m, 0)
    present = on_mirror(s, d, m, data)
    if present is None:
        started = time.monotonic()
        pending = cutting.begin_cut(d, m.step, writer=MODE, cut=m.cut, world_size=m.world_size, above_latest=False)
        try:
            _post_part(s, d, m, 0, progress)
            _await_records(d, pending, rank_timeout)
            _check_parts(d, pending)
            pending.files_durable()
            present = pending.commit_copy(data)
        except BaseException:
            pending.abandon()  # a no-op once the commit itself ended the cut
            raise
        d.events.emit("mirrored", cut=m.cut, step=m.step, source=s.url, nbytes=m.nbytes,
                      seconds=round(time.monotonic() - started, 6))
    if src_cut.marked_final and not present.final:
        present = labeling.mark_manifest_final(d, m, marked=False)  # marked final after its commit, on the source
    return present


def _named_source(s: StoreCore, cut: str) -> tuple[bytes, Manifest]:
    """The local manifest's bytes and what they parse to, read by name (a rank other than 0 lists
    nothing: issue 24); it takes the caller's word that the cut is committed, and rank 0 checks it."""
    layout.check_cut_id(cut, store=s.url)
    rel = layout.manifest_path(cut)
    data = read_or_none(s.storage, rel)
    if data is None:
        raise CutNotFound(f"cut {cut} is not committed in {s.url}", store=s.url, cut=cut, path=rel)
    return data, Manifest.from_bytes(data, store=s.url, cut=cut, path=rel)


def _check_rank(d: StoreCore, m: Manifest, rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < m.world_size:
        raise UsageError(f"rank {rank!r} is outside cut {m.cut}'s world size {m.world_size}", store=d.url, cut=m.cut)
    if m.world_size < 2:
        raise UsageError(f"cut {m.cut} holds one rank: mirror it with mirror_cut", store=d.url, cut=m.cut)


def _mirrored(d: StoreCore, m: Manifest, data: bytes) -> bool:
    """Whether the mirror holds this cut's manifest bytes already (read by name: no listing). Other
    bytes under its id are a ``MirrorConflict`` (rank 0's check by listing says the same)."""
    have = read_or_none(d.storage, layout.manifest_path(m.cut))
    if have is None:
        return False
    if have != data:
        raise MirrorConflict(f"the mirror holds cut {m.cut} with another manifest than the local tier's",
                             store=d.url, cut=m.cut, path=layout.manifest_path(m.cut),
                             hint="a mirror belongs to one source store; give this one a URL of its own")
    return True


def _post_part(s: StoreCore, d: StoreCore, m: Manifest, rank: int, progress: Progress | None) -> None:
    """This rank's files streamed into the mirror's cut and checked, then its record (durably). A local
    file that does not verify stops it: recorded bad locally, raised, and no record posted."""
    record, fragment = None, b""
    if m.fragmented:  # format 5: the rank's fragment, checked, is copied byte for byte after its files
        try:
            record, fragment = read_fragment(s.storage, s.url, m, rank)
        except DataError as exc:
            raise source_damage(s, d, m, exc) from exc
        part = part_manifest(m, record)
    else:
        part = m.for_rank(rank)
    by_file: dict[str, list[TensorRecord]] = {}
    for t in part.tensors:
        by_file.setdefault(t.file, []).append(t)
    share = cutting.rank_part(d, m.cut, m.step, rank, m.world_size)
    for rec in part.files:
        try:
            copy_file(s.storage, d.storage, m, rec, by_file.get(rec.name, []), progress)
        except DataError as exc:
            raise source_damage(s, d, m, exc) from exc
    if record is not None:
        share.publish_copy(record, fragment)
        return
    share.publish(part.files, part.tensors, CutIntent(tree=part.tree, pickled=has_pickle(part.tree),
                                                      attached=part.attached, mode=MODE, world_size=m.world_size))


def _await_records(d: StoreCore, pending: PendingCut, rank_timeout: float) -> None:
    """Until every rank's record is on the mirror (one listing of the cut's directory a poll); a
    ``RankFailure`` naming the ranks still missing once nothing new landed there for ``rank_timeout``
    seconds."""
    seen: dict[str, tuple[tuple[str, int], ...]] = {}

    def missing() -> list[int]:
        names = {name for name, _ in seen.get("now", ())}
        return [r for r in range(pending.world_size) if layout.rank_record_name(r) not in names]

    def done() -> bool:
        seen["now"] = _listing(d, pending.id)
        return not missing()

    def failure() -> RankFailure:
        gone = missing()
        return RankFailure(f"rank(s) {gone} posted no record of cut {pending.id} on the mirror {d.url} within "
                           f"{rank_timeout:g} s of its last change; the cut is abandoned there and the mirror keeps "
                           "its older cut", ranks=gone, store=d.url, cut=pending.id,
                           path=layout.rank_record_path(pending.id, gone[0]))

    _await(done, rank_timeout, failure, progress_of=lambda: seen.get("now"))


def _check_parts(d: StoreCore, pending: PendingCut) -> None:
    """Every rank's record read and checked (``collect_ranks``), and every file it names there at its
    size: a rank's upload abandoned by an earlier attempt of this cut may have lost its files since
    its record landed."""
    pending.collect_ranks()
    sizes = {e.name: e.size for e in d.storage.list_dir(layout.cut_dir(pending.id)) if not e.is_dir}
    gone = [f for f in pending.files() if sizes.get(f.name) != f.nbytes]
    if gone:
        ranks = sorted({f.rank for f in gone})
        raise RankFailure(f"file(s) {[f.name for f in gone[:3]]} of rank(s) {ranks} are gone or cut short on the "
                          f"mirror {d.url} after their record landed; the cut is abandoned there", ranks=ranks,
                          store=d.url, cut=pending.id, path=layout.cut_file(pending.id, gone[0].name))


def _listing(d: StoreCore, cut: str) -> tuple[tuple[str, int], ...]:
    """What the mirror's cut directory holds now (names and sizes): a new file is a rank's progress."""
    return tuple(sorted((e.name, e.size) for e in d.storage.list_dir(layout.cut_dir(cut)) if not e.is_dir))


def _await(done: Callable[[], bool], rank_timeout: float, failure: Callable[[], RankFailure], *,
           progress_of: Callable[[], object] = lambda: None) -> None:
    """Polls ``done`` (backing off to 0.2 s) until it holds; raises ``failure()`` once ``progress_of``
    has not changed for ``rank_timeout`` seconds. The only clock is the deadline: no sleep stands in
    for an event."""
    seen, since, delay = progress_of(), time.monotonic(), 0.005
    while not done():
        now = progress_of()
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > rank_timeout:
            raise failure()
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


__all__ = ["MODE", "mirror_rank"]
