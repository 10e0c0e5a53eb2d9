"""Checking a shard against its manifest records (issue 20: split from ``shards.py``): the order of
its arrays, their digests, its v2 file digest and its header, and the digests of a shard the storage
maps (``local_digests_v2``, verify's fast path). Pure but for that one verb, no torch anywhere.
"""

from __future__ import annotations

import errno
import itertools
from operator import add, attrgetter, itemgetter
from typing import Callable, Iterable, Sequence

from . import hashing
from .errors import CorruptCut, HashMismatch, MissingFile, StorageError, TruncatedFile
from .format import SANE_INT, ShardHeader, encode_header_columns, header_dtype, header_dtype_rule
from .manifest import FileRecord, TensorRecord
from .storage import Storage


def check_missing(exc: StorageError, where: dict) -> None:
    """A file the manifest lists that the storage cannot find is damage to the cut (MissingFile, a
    DataError launchers fall back from), not the file system refusing (StorageError)."""
    if exc.errno == errno.ENOENT or isinstance(exc.__cause__, FileNotFoundError):
        raise MissingFile("a file the manifest lists is missing", **where) from exc


#: The order of a shard's arrays in its data section, from the manifest: ascending offset; a zero-size
#: array comes before the array that starts where it sits (all of a file's zero-size arrays at one
#: offset have identical v2 digest entries, so their order among themselves does not matter). A sort
#: key of ``(offset, nbytes)`` at C speed (a Python key function cost 40,000 calls a shard, issue 23).
file_order_key: Callable[[TensorRecord], tuple[int, int]] = attrgetter("offset", "nbytes")


def check_tensor_digests(digests: Iterable[tuple[TensorRecord, bytes]], where: dict) -> None:
    """Each array's blake3 against its manifest record; the error names the first array that differs."""
    digests = list(digests)
    # One comparison of all the digests (issue 23: 40,000 arrays); the loop only runs to name the first bad one.
    # Every digest is 32 bytes and every record's 64 hex digits, so the joined strings are equal exactly
    # when each pair is. Columns by C-level passes (a generator each cost 0.2 us an array).
    raw = list(map(itemgetter(1), digests))
    if (set(map(len, raw)) <= {32}
            and b"".join(raw).hex() == "".join(map(attrgetter("blake3"), map(itemgetter(0), digests)))):
        return
    for t, d in digests:
        got = d.hex()
        if got != t.blake3:
            raise HashMismatch(f"tensor {t.name!r}: blake3 mismatch, expected {t.blake3}, found {got}", **where)


def check_file_digest_v2(record: FileRecord, got: str, where: dict) -> None:
    """A v2 file digest against the record: ``raw_blake3``, and ``blake3`` too when stored bytes are
    raw bytes (codec "none")."""
    for expected in (record.raw_blake3, record.blake3) if record.codec == "none" else (record.raw_blake3,):
        if got != expected:
            raise HashMismatch(f"blake3 mismatch: expected {expected}, found {got}", **where)


def check_header_matches(header: ShardHeader, tensors: Iterable[TensorRecord], where: dict) -> None:
    """The shard's own header must agree with the manifest about every array it holds."""
    expected = list(tensors)
    if _header_agrees(header, expected):
        return
    by_name = {e.name: e for e in header.entries}
    if set(by_name) != {t.name for t in expected}:
        raise CorruptCut("shard header and manifest list different tensors", **where)
    for t in expected:
        e = by_name[t.name]
        if e.begin != t.offset or e.end - e.begin != t.nbytes:
            raise CorruptCut(
                f"tensor {t.name!r}: header offsets [{e.begin}, {e.end}) disagree with manifest "
                f"offset {t.offset} nbytes {t.nbytes}",
                **where,
            )
        st_dtype, st_shape = header_dtype(t.kind, t.dtype, tuple(t.shape), t.nbytes)
        if e.dtype != st_dtype or list(e.shape) != st_shape:
            raise CorruptCut(f"tensor {t.name!r}: header dtype/shape disagree with manifest", **where)


def header_is_written_form(head: bytes, ordered: Sequence[TensorRecord], raw_nbytes: int) -> bool:
    """Whether ``head`` (a shard's bytes before its data section) is byte for byte the header the writer
    writes for the records ``ordered`` (in file order), their offsets tile the data section from 0 and
    it ends the ``raw_nbytes``-byte file: then the header decodes and agrees with them, by construction.
    A whole-file read checks this first (issue 23: decoding 40,000 entries and checking each cost 5 us
    a tensor; encoding the expected header costs a tenth of it); False sends it to the decoder and the
    entry-by-entry check, which name what differs or accept a header another writer formatted."""
    # Column by column, each in one C-level pass (a Python step per array cost 1.5 us of a load's 20).
    names, kinds, dtypes, shapes, nbytes, offsets = (list(map(attrgetter(f), ordered)) for f in
                                                     ("name", "kind", "dtype", "shape", "nbytes", "offset"))
    ends = list(itertools.accumulate(nbytes))
    if offsets != [0, *ends[:-1]] or len(head) + (ends[-1] if ends else 0) != raw_nbytes:
        return False
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and max(dims) >= SANE_INT:
        return False  # the decoder refuses such a size (HostileInput): let it say so
    pairs = list(zip(kinds, dtypes))
    try:
        rules = {pair: header_dtype_rule(*pair) for pair in set(pairs)}
    except KeyError:
        return False
    st_dtypes = list(map({pair: st for pair, (st, _) in rules.items()}.__getitem__, pairs))
    if any(as_bytes for _, as_bytes in rules.values()):  # a dtype safetensors lacks: its shape is [nbytes]
        as_bytes_of = {pair: as_bytes for pair, (_, as_bytes) in rules.items()}
        shapes = [[n] if as_bytes_of[pair] else shape for pair, shape, n in zip(pairs, shapes, nbytes)]
    try:
        return encode_header_columns(names, st_dtypes, shapes, nbytes) == head
    except (ValueError, TypeError):  # a duplicate or reserved name: the decoder's check names it
        return False


def _header_agrees(header: ShardHeader, expected: list[TensorRecord]) -> bool:
    """Whether the header and the records agree on every array, compared column by column in file order
    (issue 23: one entry at a time cost 5 us per array). False sends the caller to the entry-by-entry
    check, which names what differs (or accepts what this cannot order: zero-size arrays at one offset
    listed in different orders)."""
    entries = header.entries
    if len(entries) != len(expected):
        return False
    if not entries:
        return True
    ordered = sorted(expected, key=file_order_key)
    names, kinds, dtypes, shapes, nbytes, offsets = (list(map(attrgetter(f), ordered)) for f in
                                                     ("name", "kind", "dtype", "shape", "nbytes", "offset"))
    if names != [e.name for e in entries] or offsets != [e.begin for e in entries]:
        return False
    if list(map(add, offsets, nbytes)) != [e.end for e in entries]:
        return False
    # What the header records for each (kind, dtype): its safetensors dtype, and whether the shape is
    # stored as the array's raw bytes (``header_dtype``'s U8 case).
    try:
        stored = {pair: header_dtype_rule(*pair) for pair in set(zip(kinds, dtypes))}
    except KeyError:
        return False  # a dtype no header can record: the entry-by-entry check says so
    st_of = [stored[pair] for pair in zip(kinds, dtypes)]
    if [st for st, _ in st_of] != [e.dtype for e in entries]:
        return False
    want_shapes = [(n,) if as_bytes else tuple(s) for (_, as_bytes), s, n in zip(st_of, shapes, nbytes)]
    return want_shapes == [e.shape for e in entries]


def local_digests_v2(
    storage: Storage, rel: str, record: FileRecord, tensors: Sequence[TensorRecord], where: dict
) -> tuple[list[tuple[TensorRecord, bytes]], str]:
    """Format v2 digests of the uncompressed shard ``rel``, laid out as the manifest records it
    (``verify``'s fast path, where the storage maps files: ``Storage.map_file``): each array's blake3
    over its byte range of the mapped file (big ones on every core), and the file digest of the bytes
    before the data section plus those. The header is not decoded first, so damage anywhere shows as a
    digest mismatch; the caller checks the header's structure afterwards. Raises CorruptCut when the
    records do not tile a data section that ends at ``raw_nbytes``, TruncatedFile when the file is not
    ``raw_nbytes`` long, MissingFile when it is gone, NotAFile when something else stands there."""
    ordered = sorted(tensors, key=file_order_key)
    end = 0
    for t in ordered:
        if t.offset != end:
            raise CorruptCut(f"tensor {t.name!r}: manifest offset {t.offset} leaves a gap or overlap at {end}", **where)
        end += t.nbytes
    data_start = record.raw_nbytes - end
    if data_start < 8:
        raise CorruptCut(f"manifest records {end} data bytes in a {record.raw_nbytes}-byte shard", **where)
    try:
        mapped = storage.map_file(rel)  # a NotAFile (issue 19 item 12) passes as it is: damage, not I/O
    except StorageError as exc:
        check_missing(exc, where)
        raise
    with mapped:
        if mapped.size != record.raw_nbytes:
            cls = TruncatedFile if mapped.size < record.raw_nbytes else CorruptCut
            raise cls(f"expected {record.raw_nbytes} bytes, found {mapped.size}", **where)
        digests = _hash_ranges(mapped.view, data_start, ordered)
        with mapped.view[:data_start] as head:
            header = bytes(head)
    return digests, hashing.file_digest_v2(header, [(t.nbytes, d) for t, d in digests])


def _hash_ranges(view: memoryview, data_start: int, ordered: Sequence[TensorRecord]) -> list[tuple[TensorRecord, bytes]]:
    # Each slice is released before the next: the mapping refuses to close while one is exported.
    out = []
    for t in ordered:
        h = hashing.new_hasher(threads=hashing.AUTO if t.nbytes >= hashing.SMALL else 1)
        start = data_start + t.offset
        with view[start : start + t.nbytes] as part:
            h.update(part)
        out.append((t, h.digest()))
    return out
