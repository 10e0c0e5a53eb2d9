"""Writing shard files, hashing while the bytes pass, with no torch anywhere (the write side of what
``ckptstore.shards`` names; the read side is :mod:`ckptstore.shardread`, issue 20).

``plan_shards`` splits arrays into shards of bounded size; ``write_shard`` streams one shard through a
storage sink and returns the manifest records, the file's digest built from the header bytes and the
array digests (format v2, docs/format.md); ``write_shards`` is the one loop that writes a rank's
shards. The writer subprocess uses the same functions on views of the shared-memory block.

How the bytes pass (issue 23: a state of 40,000 arrays of 4 KB spent 40 us an array in this layer's
Python): an array of ``GATHER_BELOW`` bytes or more goes in 8 MiB pieces, each hashed once, for its
array, while the previous piece is on its way to disk (on a helper thread, beside the copy into the
sink, unless ``hash_threads`` is 1); smaller arrays, which lie back to back in the file, are hashed one
call each and gathered into a staging buffer that goes to the sink in one write per ``BATCH`` bytes.
The header and the records are built column by column once every digest is known.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Iterator, Sequence

import zstandard

from . import hashing, layout
from .arrays import ArrayItem
from .errors import StorageError
from .format import DATA_ALIGN, encode_header_columns, header_dtype_rule
from .manifest import FileRecord, TensorRecord
from .records import make_record
from .storage import Sink, Storage
from .storage.sink import ZERO_COPY_MIN

_NBYTES = attrgetter("nbytes")
_DATA = attrgetter("data")

PIECE = 8 << 20
#: Arrays smaller than this are gathered (``_write_gathered``); the sink would copy them anyway, since
#: it writes from the caller's memory only from this size on.
GATHER_BELOW = ZERO_COPY_MIN
#: Bytes of small arrays handed to the sink in one write.
BATCH = 1 << 20


@dataclass(frozen=True)
class Codec:
    """How shard bytes are stored: ``name`` "none" or "zstd", with its level and thread count."""

    name: str = "none"
    level: int = 1
    threads: int = 0


def plan_shards(items: Sequence[ArrayItem], max_shard_bytes: int) -> list[list[ArrayItem]]:
    """Greedy split in state order: a shard closes once it reaches ``max_shard_bytes`` (an array larger
    than that gets a shard of its own). Always at least one shard, so every cut has a file."""
    sizes = list(map(_NBYTES, items))
    if sum(sizes) <= max_shard_bytes:  # the common small state: one shard, no Python step per array
        return [list(items)]
    shards: list[list[ArrayItem]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


def file_order(items: Sequence[ArrayItem]) -> list[ArrayItem]:
    """The order arrays take inside a shard file: those whose size is a multiple of 4096 bytes first
    (state order among them), then the rest. The data section starts page-aligned, so every array of
    the first group starts page-aligned in the file too, and a sink can write it with O_DIRECT straight
    from page-aligned memory (the writer's shared block); the odd-sized tail (biases of odd widths,
    scalars, counters) is small and goes through the sink's staging buffer. Readers never depend on
    the order: the header and the manifest give every array's offsets."""
    odd = [n % DATA_ALIGN for n in map(_NBYTES, items)]
    if not any(odd):
        return list(items)
    aligned = list(itertools.compress(items, [not r for r in odd]))
    return aligned + list(itertools.compress(items, odd))  # a stable partition, as sorted() was


class _Compressing:
    """A sink wrapper that zstd-compresses everything written and hashes the stored bytes."""

    def __init__(self, sink: Sink, codec: Codec, hash_threads: int = hashing.AUTO) -> None:
        self.sink = sink
        params = zstandard.ZstdCompressionParameters.from_level(codec.level, threads=codec.threads or 0)
        self.obj = zstandard.ZstdCompressor(compression_params=params).compressobj()
        self.hasher = hashing.new_hasher(threads=hash_threads)
        self.count = 0

    def write(self, data: memoryview | bytes) -> None:
        out = self.obj.compress(data)
        if out:
            self._emit(out)

    def _emit(self, out: bytes) -> None:
        self.hasher.update(out)
        self.count += len(out)
        self.sink.write(out)

    def finish(self) -> None:
        self._emit(self.obj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))


@dataclass
class _Times:
    """Seconds spent hashing, handing bytes to the sink, and in the final flush + fsync."""

    hash: float = 0.0
    write: float = 0.0
    fsync: float = 0.0

    def add_to(self, timings: dict[str, float] | None) -> None:
        if timings is not None:
            for key, value in (("hash", self.hash), ("write", self.write), ("fsync", self.fsync)):
                timings[key] = timings.get(key, 0.0) + value


def _stream_arrays(
    out: Any, items: Sequence[ArrayItem], sizes: list[int], times: _Times, *, hash_threads: int,
    on_bytes: Callable[[int], None] | None,
) -> list[bytes]:
    """Writes the arrays' bytes (``sizes``: their ``nbytes``) to ``out`` back to back, in file order, and
    returns their raw digests: runs of small arrays gathered (``_write_gathered``), each larger one in
    pieces (``_write_pieces``)."""
    digests: list[bytes] = []
    stage: memoryview | None = None
    # Hashing on a helper thread beside the copy into the sink (issue 23: a store.save of 1 GiB hashed
    # and copied each piece in turn, and fell behind the disk); hash_threads=1 keeps to one core.
    pool = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-hash") \
        if hash_threads != 1 and max(sizes, default=0) >= GATHER_BELOW else None
    try:
        for i, j, run in _spans(sizes):
            if run is None:
                digests.append(_write_pieces(out, items[i], times, pool, hash_threads, on_bytes))
                continue
            if stage is None:
                stage = memoryview(bytearray(BATCH))
            digests += _write_gathered(out, items[i:j], sizes[i:j], run, stage, times, on_bytes)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return digests


def _spans(sizes: list[int]) -> Iterator[tuple[int, int, int | None]]:
    """The arrays of ``sizes`` in write order as spans ``[i, j)`` with their bytes in all: one array of
    ``GATHER_BELOW`` bytes or more alone (``None`` for its bytes: it is written in pieces), else runs
    of smaller arrays of at most ``BATCH`` bytes (a single array when one is larger)."""
    start = run = 0
    for j, n in enumerate(sizes):
        if n >= GATHER_BELOW:
            if j > start:
                yield start, j, run
            yield j, j + 1, None
            start, run = j + 1, 0
        elif run + n > BATCH and j > start:
            yield start, j, run
            start, run = j, n
        else:
            run += n
    if len(sizes) > start:
        yield start, len(sizes), run


def _write_gathered(out: Any, run: Sequence[ArrayItem], sizes: list[int], nbytes: int, stage: memoryview,
                    times: _Times, on_bytes: Callable[[int], None] | None) -> list[bytes]:
    """Hashes each array of ``run`` (small arrays of ``sizes``, ``nbytes`` in all, at most ``BATCH``) and
    writes them as one piece gathered in ``stage``; returns their digests."""
    clock = time.perf_counter
    views = list(map(_DATA, run))
    t0 = clock()
    digests = hashing.digest_each(views)
    t1 = clock()
    fill = 0
    for view, n in zip(views, sizes):
        end = fill + n
        # A view that is not nbytes long fails here, as it would corrupt every later offset.
        stage[fill:end] = view
        fill = end
    if nbytes:
        # Read-only, so the sink copies it before returning (it writes straight from writable memory
        # only): the stage is refilled at once.
        out.write(stage[:nbytes].toreadonly())
        if on_bytes is not None:
            on_bytes(nbytes)
    times.hash += t1 - t0
    times.write += clock() - t1
    return digests


def _write_pieces(out: Any, it: ArrayItem, times: _Times, pool: ThreadPoolExecutor | None, hash_threads: int,
                  on_bytes: Callable[[int], None] | None) -> bytes:
    """Writes one array in ``PIECE``-sized pieces, each hashed once: on ``pool``'s thread while this one
    hands the same piece to the sink (blake3 lets go of the GIL), else just before it goes."""
    clock = time.perf_counter
    h = hashing.new_hasher(threads=hash_threads)
    data = it.data
    for start in range(0, it.nbytes, PIECE):
        piece = data[start : start + PIECE]
        if pool is not None:
            hashed = pool.submit(_timed_update, h, piece)
            t0 = clock()
            try:
                out.write(piece)
            finally:
                times.hash += hashed.result()  # the piece is hashed before its array's next one
            times.write += clock() - t0
        else:
            t0 = clock()
            h.update(piece)
            t1 = clock()
            out.write(piece)
            times.hash += t1 - t0
            times.write += clock() - t1
        if on_bytes is not None:
            on_bytes(len(piece))
    return h.digest()


def _timed_update(h: Any, piece: memoryview) -> float:
    t0 = time.perf_counter()
    h.update(piece)
    return time.perf_counter() - t0


class _Columns:
    """The fields of a shard's arrays in file order, one list each, read once for the header, the
    stream, the file digest and the records."""

    def __init__(self, items: Sequence[ArrayItem]) -> None:
        self.names, self.kinds, self.dtypes, self.shapes, self.sizes = (
            list(map(attrgetter(f), items)) for f in ("name", "kind", "dtype", "shape", "nbytes"))

    def header(self) -> bytes:
        """The shard header, each array's header dtype decided once per (kind, dtype) of the shard."""
        # The (kind, dtype) pairs are zipped anew for each pass, never kept as a list (a tuple each:
        # 7 MB at 100,000 arrays, issue 23); a shard of one dtype gets its one header dtype repeated.
        rules = {kd: header_dtype_rule(*kd) for kd in set(zip(self.kinds, self.dtypes))}
        if len(rules) == 1:
            st_dtypes = [next(iter(rules.values()))[0]] * len(self.names)
        else:
            st_dtypes = list(map({kd: rule[0] for kd, rule in rules.items()}.__getitem__, zip(self.kinds, self.dtypes)))
        shapes: list[Any] = self.shapes
        if any(as_bytes for _, as_bytes in rules.values()):  # dtypes safetensors has no name for: U8 bytes
            shapes = [[n] if rules[kd][1] else s for kd, s, n in zip(zip(self.kinds, self.dtypes), shapes, self.sizes)]
        return encode_header_columns(self.names, st_dtypes, shapes, self.sizes)

    def records(self, name: str, digests: list[bytes]) -> list[TensorRecord]:
        """The arrays' manifest records, from the bytes just written; the manifest checks every record
        in bulk when it is built and whenever it is read back (ckptstore.records)."""
        offsets = [0, *itertools.accumulate(self.sizes)][: len(self.sizes)]
        # One shape list per distinct shape, shared by its records (a state repeats a few shapes; records
        # are never changed in place): 40,000 fewer lists to make and for the collector to walk.
        lists = {shape: list(shape) for shape in set(self.shapes)}
        return list(map(make_record, zip(self.names, self.kinds, self.dtypes, map(lists.__getitem__, self.shapes),
                                         self.sizes, itertools.repeat(name), offsets, map(bytes.hex, digests))))


def write_shard(
    storage: Storage,
    cut: str,
    name: str,
    rank: int,
    items: Sequence[ArrayItem],
    codec: Codec = Codec(),
    *,
    on_bytes: Callable[[int], None] | None = None,
    timings: dict[str, float] | None = None,
    hash_threads: int = hashing.AUTO,
) -> tuple[FileRecord, list[TensorRecord]]:
    """Writes one shard file durably (fsynced on close) and returns its manifest records (format v2:
    each raw byte is hashed once, for its array; the file digest is built from the header bytes and
    the array digests; a zstd file's stored bytes are hashed once more, plainly). On any error the
    partial file is removed and the error raised with the store, cut and file named. ``timings``
    accumulates seconds spent hashing, handing bytes to the sink, and in the final flush + fsync.
    ``hash_threads``: blake3 threads per update (default every core; the background writer process
    uses 1 so it stays on one core). The digests do not depend on it."""
    rel = layout.cut_file(cut, name)
    items = file_order(items)
    cols = _Columns(items)
    header = cols.header()
    times = _Times()
    sink = storage.open_sink(rel)
    try:
        out = _Compressing(sink, codec, hash_threads) if codec.name == "zstd" else sink
        out.write(header)
        digests = _stream_arrays(out, items, cols.sizes, times, hash_threads=hash_threads, on_bytes=on_bytes)
        raw_nbytes = len(header) + sum(cols.sizes)
        # The items are in file order (ascending offset), as the v2 digest lists them.
        raw_digest = hashing.file_digest_v2_columns(header, cols.sizes, digests)
        # The header's bytes go before the records are made (issue 23: 7.8 MB at 100,000 arrays, on
        # top of the records at the cut's peak).
        del header
        if isinstance(out, _Compressing):
            out.finish()
            stored_nbytes, stored_digest = out.count, out.hasher.hexdigest()
        else:
            stored_nbytes, stored_digest = raw_nbytes, raw_digest
        t0 = time.perf_counter()
        sink.close()
        times.fsync = time.perf_counter() - t0
    except BaseException as exc:
        sink.abort()
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise StorageError.from_os_error(exc, "writing shard", store=storage.url, cut=cut, path=rel) from exc
        raise
    times.add_to(timings)
    record = FileRecord(
        name=name, rank=rank, codec=codec.name, nbytes=stored_nbytes, blake3=stored_digest,
        raw_nbytes=raw_nbytes, raw_blake3=raw_digest,
    )
    return record, cols.records(name, digests)


def write_shards(
    storage: Storage,
    cut: str,
    rank: int,
    items: Sequence[ArrayItem],
    *,
    codec: Codec,
    max_shard_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
    timings: dict[str, float] | None = None,
    hash_threads: int = hashing.AUTO,
    on_shard: Callable[[], None] | None = None,
) -> tuple[list[FileRecord], list[TensorRecord]]:
    """The one shard-writing loop (the store's save, the Checkpointer's fallback and the writer
    process all call it): plans ``items`` into shards of at most ``max_shard_bytes``, writes each
    durably, and returns every record. ``on_shard`` runs after each shard is durable."""
    files: list[FileRecord] = []
    tensors: list[TensorRecord] = []
    for i, group in enumerate(plan_shards(items, max_shard_bytes)):
        name = layout.shard_name(rank, i, compressed=codec.name == "zstd")
        rec, trecs = write_shard(storage, cut, name, rank, group, codec, on_bytes=on_bytes, timings=timings,
                                 hash_threads=hash_threads)
        files.append(rec)
        tensors.extend(trecs)
        if on_shard is not None:
            on_shard()
    return files, tensors
