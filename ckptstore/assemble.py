"""Reading the parts of a version 5 cut (a commit record and one fragment per rank, issue 22).

``read_part(storage, url, m, rank)`` is what loads, ``show --rank`` and restores use: the commit record
(already read) and rank ``rank``'s fragment, one object, checked against the size and blake3 the commit
record holds before a byte of it is parsed, then against the cut (its id, step, rank and world size)
and against its own entry (counts, pickled). ``whole`` reads every fragment and gives the cut as a
manifest of version 3 would hold it (every rank's files, arrays and trees), for audits, mirrors and
listings of a whole cut. Older versions hold their parts in the manifest: both are plain reads of it.
"""

from __future__ import annotations

from typing import Any

from . import hashing, layout
from .errors import CorruptCut, HashMismatch, ManifestError, MissingFile, TruncatedFile
from .fragments import PartRef
from .manifest import RANKS_FORMAT_VERSION, Manifest, RankRecord
from .pointed import read_or_none
from .storage import Storage


def fragment_path(cut: str, rank: int) -> str:
    return layout.rank_record_path(cut, rank)


def read_fragment(storage: Storage, url: str, m: Manifest, rank: int) -> tuple[RankRecord, bytes]:
    """Rank ``rank``'s fragment of commit record ``m``, checked (module docstring), and its bytes.
    Raises ``MissingFile``, ``TruncatedFile``, ``HashMismatch``, ``ManifestError`` or ``CorruptCut``
    naming the store, the cut and the fragment."""
    ref = m.parts[rank]
    data, where = _fragment_bytes(storage, url, m, rank)
    rec = RankRecord.from_bytes(data, **where)
    check_fragment(rec, m, ref, rank, where)
    return rec, data


def _fragment_bytes(storage: Storage, url: str, m: Manifest, rank: int) -> tuple[bytes, dict[str, Any]]:
    """Rank ``rank``'s fragment's bytes, checked against the commit record (size, then blake3), and
    what an error about it names."""
    rel = fragment_path(m.cut, rank)
    where: dict[str, Any] = {"store": url, "cut": m.cut, "path": rel}
    data = read_or_none(storage, rel)
    if data is None:
        raise MissingFile(f"rank {rank}'s fragment of cut {m.cut} is missing", **where)
    check_fragment_bytes(data, m.parts[rank], rank, where)
    return data, where


def check_fragment_bytes(data: bytes, ref: PartRef, rank: int, where: dict[str, Any]) -> None:
    """The fragment's bytes are the ones the commit record names (size, then blake3)."""
    if len(data) < ref.nbytes:
        raise TruncatedFile(f"rank {rank}'s fragment is {len(data)} bytes, the commit record says {ref.nbytes}",
                            **where)
    if len(data) != ref.nbytes:
        raise CorruptCut(f"rank {rank}'s fragment is {len(data)} bytes, the commit record says {ref.nbytes}",
                         **where)
    got = hashing.digest(data)
    if got != ref.blake3:
        raise HashMismatch(f"rank {rank}'s fragment: blake3 {got} is not the commit record's {ref.blake3}",
                           **where)


def check_fragment(rec: RankRecord, m: Manifest, ref: PartRef, rank: int, where: dict[str, Any]) -> None:
    """A parsed fragment belongs where the commit record puts it and says what its entry says."""
    if (rec.cut, rec.step, rec.rank, rec.world_size) != (m.cut, m.step, rank, m.world_size):
        raise CorruptCut(f"fragment names cut {rec.cut} step {rec.step} rank {rec.rank} of {rec.world_size}, "
                         f"expected rank {rank} of {m.world_size} of cut {m.cut} step {m.step}", **where)
    foreign = [f.name for f in rec.files if layout.shard_rank(f.name) != rank]
    if foreign:
        raise ManifestError(f"rank {rank}'s fragment lists file(s) {foreign[:3]} that are not its shards", **where)
    counts = (sum(f.nbytes for f in rec.files), len(rec.files), len(rec.tensors), len(rec.attached), rec.pickled)
    if counts != (ref.data_nbytes, ref.files, ref.arrays, ref.attached, ref.pickled):
        raise CorruptCut(f"rank {rank}'s fragment does not hold what the commit record says of it", **where)


def part_manifest(m: Manifest, rec: RankRecord) -> Manifest:
    """Rank ``rec.rank``'s part as ``Manifest.for_rank`` gives it of a version 3 cut: the cut's fields,
    the rank's files, arrays, tree and attached files."""
    return m.model_copy(update={"format_version": RANKS_FORMAT_VERSION, "files": list(rec.files),
                                "tensors": list(rec.tensors), "tree": rec.tree, "attached": list(rec.attached),
                                "pickled": rec.pickled, "parts": []})


#: Parsed fragments a handle keeps (``read_part``'s cache): (cut, rank, blake3) -> the record.
PartCache = dict[tuple[str, int, str], RankRecord]
#: How many it keeps at most (a restore reads one a rank; a few cuts' worth).
PART_CACHE_SIZE = 16


def read_part(storage: Storage, url: str, m: Manifest, rank: int, cache: PartCache | None = None) -> Manifest:
    """Rank ``rank``'s part of cut ``m`` (``Manifest.for_rank`` for versions 1-4; one fragment read for
    version 5). ValueError for a rank outside the cut's world size. ``cache``: parts parsed before,
    by their fragment's digest; the fragment's bytes are read and checked against the commit record
    every time, only the parse of bytes seen before is saved (as the scan's manifest cache does)."""
    if not m.fragmented:
        return m.for_rank(rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < m.world_size:
        raise ValueError(f"rank {rank!r} is outside the cut's world size {m.world_size}")
    if cache is None:
        return part_manifest(m, read_fragment(storage, url, m, rank)[0])
    ref = m.parts[rank]
    data, where = _fragment_bytes(storage, url, m, rank)
    key = (m.cut, rank, ref.blake3)
    rec = cache.get(key)
    if rec is None:
        rec = RankRecord.from_bytes(data, **where)
        check_fragment(rec, m, ref, rank, where)
        while len(cache) >= PART_CACHE_SIZE:
            del cache[next(iter(cache))]
        cache[key] = rec
    return part_manifest(m, rec)


def whole(storage: Storage, url: str, m: Manifest) -> Manifest:
    """Cut ``m`` with every rank's part in it, as a version 3 manifest holds them (itself for versions
    1-4): every fragment read and checked. In memory only; never written."""
    if not m.fragmented:
        return m
    recs = [read_fragment(storage, url, m, r)[0] for r in range(m.world_size)]
    return merged(m, recs)


def merged(m: Manifest, recs: list[Any]) -> Manifest:
    """Commit record ``m`` with the parts ``recs`` (by rank: records, or anything with their ``files``,
    ``tensors``, ``tree`` and ``attached``) merged in, validated as version 3."""
    return Manifest(
        cut=m.cut, step=m.step, tags=list(m.tags), final=m.final, created_at=m.created_at, writer=m.writer,
        world_size=m.world_size, metadata=dict(m.metadata), format_version=RANKS_FORMAT_VERSION,
        files=[f for r in recs for f in r.files], tensors=[t for r in recs for t in r.tensors],
        tree={"t": "ranks", "ranks": [r.tree for r in recs]}, pickled=m.pickled,
        attached=[a for r in recs for a in r.attached])


__all__ = ["PartCache", "check_fragment", "check_fragment_bytes", "fragment_path", "merged", "part_manifest", "read_fragment",
           "read_part", "whole"]
