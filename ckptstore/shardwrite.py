"""Writing shard files, hashing while the bytes pass, with no torch anywhere (the write side of what
``ckptstore.shards`` names; the read side is :mod:`ckptstore.shardread`, issue 20).

``plan_shards`` splits arrays into shards of bounded size; ``write_shard`` streams one shard through a
storage sink (header, then each array in 8 MiB pieces, each piece hashed once, for its array, while the
previous piece is on its way to disk) and returns the manifest records, the file's digest built from
the header bytes and the array digests (format v2, docs/format.md); ``write_shards`` is the one loop
that writes a rank's shards. The writer subprocess uses the same functions on views of the
shared-memory block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import zstandard

from . import hashing, layout
from .arrays import ArrayItem
from .errors import StorageError
from .format import DATA_ALIGN, encode_header, header_dtype
from .manifest import FileRecord, TensorRecord
from .storage import Sink, Storage

PIECE = 8 << 20


@dataclass(frozen=True)
class Codec:
    """How shard bytes are stored: ``name`` "none" or "zstd", with its level and thread count."""

    name: str = "none"
    level: int = 1
    threads: int = 0


def plan_shards(items: Sequence[ArrayItem], max_shard_bytes: int) -> list[list[ArrayItem]]:
    """Greedy split in state order: a shard closes once it reaches ``max_shard_bytes`` (an array larger
    than that gets a shard of its own). Always at least one shard, so every cut has a file."""
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
    return sorted(items, key=lambda it: it.nbytes % DATA_ALIGN != 0)


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
    out: Any, items: Sequence[ArrayItem], name: str, times: _Times, *, hash_threads: int,
    on_bytes: Callable[[int], None] | None,
) -> tuple[list[TensorRecord], list[tuple[int, bytes]]]:
    """Writes each array's bytes to ``out`` in ``PIECE``-sized pieces, hashing each piece once just
    before it goes; returns the arrays' records and their (nbytes, digest) in file order."""
    clock = time.perf_counter
    t_hash = t_write = 0.0
    records: list[TensorRecord] = []
    digests: list[tuple[int, bytes]] = []
    offset = 0
    for it in items:
        th = hashing.new_hasher(threads=hash_threads)
        data = it.data
        for start in range(0, it.nbytes, PIECE):
            piece = data[start : start + PIECE]
            t0 = clock()
            th.update(piece)
            t1 = clock()
            out.write(piece)
            t_hash += t1 - t0
            t_write += clock() - t1
            if on_bytes is not None:
                on_bytes(len(piece))
        d = th.digest()
        digests.append((it.nbytes, d))
        records.append(
            # Built from the bytes just written; the manifest checks every record in bulk when it is
            # built and whenever it is read back (ckptstore.records).
            TensorRecord(it.name, it.kind, it.dtype, list(it.shape), it.nbytes, name, offset, d.hex())
        )
        offset += it.nbytes
    times.hash += t_hash
    times.write += t_write
    return records, digests


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
    header = encode_header(
        [(it.name, *header_dtype(it.kind, it.dtype, it.shape, it.nbytes), it.nbytes) for it in items]
    )
    times = _Times()
    sink = storage.open_sink(rel)
    try:
        out = _Compressing(sink, codec, hash_threads) if codec.name == "zstd" else sink
        out.write(header)
        records, digests = _stream_arrays(out, items, name, times, hash_threads=hash_threads, on_bytes=on_bytes)
        raw_nbytes = len(header) + sum(n for n, _ in digests)
        # The items are in file order (ascending offset), as the v2 digest lists them.
        raw_digest = hashing.file_digest_v2(header, digests)
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
    return record, records


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
