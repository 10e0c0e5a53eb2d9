"""Writing and reading shard files: hashing while the bytes pass, with no torch anywhere.

``plan_shards`` splits arrays into shards of bounded size; ``write_shard`` streams one shard through a
storage sink (header, then each array in 8 MiB pieces, each piece hashed for its array and for the
file while the previous piece is on its way to disk) and returns the manifest records;
``read_shard_into`` streams a shard back into caller-provided buffers, checking the header against the
manifest and every hash on the way. The writer subprocess uses the same functions on views of the
shared-memory block.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Sequence

import zstandard

from . import hashing, layout
from .arrays import ArrayItem
from .errors import CorruptCut, MissingFile, StorageError, TruncatedFile
from .format import DATA_ALIGN, ShardHeader, decode_header, encode_header, header_dtype
from .fs import Storage
from .manifest import FileRecord, TensorRecord

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

    def __init__(self, sink, codec: Codec, hash_threads: int = hashing.AUTO) -> None:  # type: ignore[no-untyped-def]
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
    """Writes one shard file durably (fsynced on close) and returns its manifest records. On any error
    the partial file is removed and the error raised with the store, cut and file named. ``timings``
    accumulates seconds spent hashing, handing bytes to the sink, and in the final flush + fsync.
    ``hash_threads``: blake3 threads per update (default every core; the background writer process
    uses 1 so it stays on one core). The digests do not depend on it."""
    clock = time.perf_counter
    t_hash = t_write = 0.0
    rel = layout.cut_file(cut, name)
    items = file_order(items)
    header = encode_header(
        [(it.name, *header_dtype(it.kind, it.dtype, it.shape, it.nbytes), it.nbytes) for it in items]
    )
    sink = storage.open_sink(rel)
    try:
        out = _Compressing(sink, codec, hash_threads) if codec.name == "zstd" else sink
        raw_hash = hashing.new_hasher(threads=hash_threads)
        raw_hash.update(header)
        out.write(header)
        records = []
        offset = 0
        for it in items:
            th = hashing.new_hasher(threads=hash_threads)
            data = it.data
            for start in range(0, it.nbytes, PIECE):
                piece = data[start : start + PIECE]
                t0 = clock()
                th.update(piece)
                raw_hash.update(piece)
                t1 = clock()
                out.write(piece)
                t_hash += t1 - t0
                t_write += clock() - t1
                if on_bytes is not None:
                    on_bytes(len(piece))
            records.append(
                TensorRecord(
                    name=it.name, kind=it.kind, dtype=it.dtype, shape=list(it.shape), nbytes=it.nbytes,
                    file=name, offset=offset, blake3=th.hexdigest(),
                )
            )
            offset += it.nbytes
        raw_nbytes = len(header) + offset
        raw_digest = raw_hash.hexdigest()
        if isinstance(out, _Compressing):
            out.finish()
            stored_nbytes, stored_digest = out.count, out.hasher.hexdigest()
        else:
            stored_nbytes, stored_digest = raw_nbytes, raw_digest
        t0 = clock()
        sink.close()
        t_fsync = clock() - t0
    except BaseException as exc:
        sink.abort()
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise StorageError.from_os_error(exc, "writing shard", store=storage.url, cut=cut, path=rel) from exc
        raise
    if timings is not None:
        for key, value in (("hash", t_hash), ("write", t_write), ("fsync", t_fsync)):
            timings[key] = timings.get(key, 0.0) + value
    record = FileRecord(
        name=name, rank=rank, codec=codec.name, nbytes=stored_nbytes, blake3=stored_digest,
        raw_nbytes=raw_nbytes, raw_blake3=raw_digest,
    )
    return record, records


# --------------------------------------------------------------------------------------------------
# Reading


def _check_missing(exc: StorageError, where: dict) -> None:
    """A file the manifest lists that the storage cannot find is damage to the cut (MissingFile, a
    DataError launchers fall back from), not the file system refusing (StorageError)."""
    if exc.errno == errno.ENOENT or isinstance(exc.__cause__, FileNotFoundError):
        raise MissingFile("a file the manifest lists is missing", **where) from exc


class _RawStream:
    """The raw (safetensors) byte stream of a shard, hashing stored and raw bytes as they pass."""

    def __init__(
        self, storage: Storage, rel: str, record: FileRecord, where: dict, *, overlap: bool, hashed: bool = True
    ) -> None:
        self.where = where
        self.record = record
        try:
            self.file = storage.open_reader(rel)
        except StorageError as exc:
            _check_missing(exc, where)
            raise
        self.stored = hashing.HashingReader(self.file, overlap=overlap and record.codec == "none", hashed=hashed)
        if record.codec == "zstd":
            dctx = zstandard.ZstdDecompressor()
            self.reader: BinaryIO = dctx.stream_reader(self.stored, read_across_frames=False)  # type: ignore[assignment]
            self.raw = hashing.HashingReader(self.reader, hashed=hashed)
        else:
            self.reader = self.stored  # type: ignore[assignment]
            self.raw = self.stored
        self.pos = 0

    def readinto_exact(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                n = self.raw.readinto(view[done:])
            except zstandard.ZstdError as exc:
                raise CorruptCut(f"zstd stream is damaged: {exc}", **self.where) from None
            except OSError as exc:
                raise StorageError.from_os_error(exc, "reading shard", **self.where) from exc
            if not n:
                raise TruncatedFile(
                    f"shard ended after {self.pos + done} raw bytes, manifest records {self.record.raw_nbytes}",
                    **self.where,
                )
            done += n
        self.pos += done

    def read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto_exact(memoryview(buf))
        return bytes(buf)

    def finish(self, verify: bool) -> None:
        """Drains the rest of the file and checks lengths and hashes: a truncated frame or file can
        never pass, since both the stored and the raw length must match."""
        try:
            rest = self.raw.read(1)
            if rest:
                raise CorruptCut("shard has bytes past its recorded raw length", **self.where)
            while self.stored.read(1 << 20):
                pass
        except zstandard.ZstdError as exc:
            raise CorruptCut(f"zstd stream is damaged: {exc}", **self.where) from None
        finally:
            self.stored.close()
            self.raw.close()
            self.file.close()
        rec = self.record
        if self.stored.count != rec.nbytes:
            cls = TruncatedFile if self.stored.count < rec.nbytes else CorruptCut
            raise cls(f"expected {rec.nbytes} bytes, found {self.stored.count}", **self.where)
        if self.raw.count != rec.raw_nbytes:
            raise TruncatedFile(f"decoded {self.raw.count} raw bytes, expected {rec.raw_nbytes}", **self.where)
        if verify:
            got = self.stored.hexdigest()
            if got != rec.blake3:
                raise CorruptCut(f"blake3 mismatch: expected {rec.blake3}, found {got}", **self.where)
            if rec.codec != "none":
                got_raw = self.raw.hexdigest()
                if got_raw != rec.raw_blake3:
                    raise CorruptCut(f"raw blake3 mismatch: expected {rec.raw_blake3}, found {got_raw}", **self.where)

    def close(self) -> None:
        for closer in (self.stored.close, self.raw.close, self.file.close):
            try:
                closer()
            except Exception:  # noqa: BLE001 - closing after an error must not mask it
                pass


def check_header_matches(header: ShardHeader, tensors: Iterable[TensorRecord], where: dict) -> None:
    """The shard's own header must agree with the manifest about every array it holds."""
    by_name = {e.name: e for e in header.entries}
    expected = list(tensors)
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


def read_shard_into(
    storage: Storage,
    cut: str,
    record: FileRecord,
    tensors: Sequence[TensorRecord],
    dest: Callable[[TensorRecord], memoryview],
    *,
    verify: bool = True,
    on_bytes: Callable[[int], None] | None = None,
    reuses_buffers: bool = False,
) -> None:
    """Streams a whole shard, reading each array's bytes straight into ``dest(record)``; checks the
    header against the manifest, the file's lengths and (with ``verify``) its blake3, hashed while
    reading (one pass over the bytes). Hashing overlaps the next read on a helper thread unless
    ``reuses_buffers`` says ``dest`` hands out the same memory twice (then a chunk could change before
    it is hashed)."""
    rel = layout.cut_file(cut, record.name)
    where = {"store": storage.url, "cut": cut, "path": rel}
    # verify=False checks lengths and the header but no digest, so nothing is hashed at all.
    stream = _RawStream(storage, rel, record, where, overlap=verify and not reuses_buffers, hashed=verify)
    try:
        prefix = stream.read_exact(8)
        n = int.from_bytes(prefix, "little")
        head_bytes = prefix + (stream.read_exact(n) if n <= min(record.raw_nbytes - 8, 64 << 20) else b"")
        header = decode_header(lambda s, e: head_bytes[s:e], record.raw_nbytes, where=where)
        ordered = sorted(tensors, key=lambda t: t.offset)
        check_header_matches(header, ordered, where)
        for t in ordered:
            view = dest(t)
            for start in range(0, t.nbytes, PIECE):
                piece = view[start : start + PIECE]
                stream.readinto_exact(piece)
                if on_bytes is not None:
                    on_bytes(len(piece))
        stream.finish(verify)
    except BaseException:
        stream.close()
        raise


def read_tensor_range(
    storage: Storage, cut: str, record: FileRecord, header: ShardHeader, t: TensorRecord, view: memoryview,
    *, verify: bool = True,
) -> None:
    """Reads one array of an uncompressed shard by byte range (partial loads) and checks its blake3."""
    rel = layout.cut_file(cut, record.name)
    where = {"store": storage.url, "cut": cut, "path": rel}
    start = header.data_start + t.offset
    data = storage.read_range(rel, start, start + t.nbytes)
    if len(data) != t.nbytes:
        raise TruncatedFile(f"tensor {t.name!r}: expected {t.nbytes} bytes, found {len(data)}", **where)
    if verify:
        got = hashing.digest(data)
        if got != t.blake3:
            raise CorruptCut(f"tensor {t.name!r}: blake3 mismatch, expected {t.blake3}, found {got}", **where)
    view[:] = data


def read_header(storage: Storage, cut: str, record: FileRecord) -> ShardHeader:
    """The decoded header of an uncompressed shard (two small ranged reads)."""
    rel = layout.cut_file(cut, record.name)
    where = {"store": storage.url, "cut": cut, "path": rel}
    try:
        size = storage.size(rel)
    except StorageError as exc:
        _check_missing(exc, where)
        raise
    if size != record.nbytes:
        cls = TruncatedFile if size < record.nbytes else CorruptCut
        raise cls(f"expected {record.nbytes} bytes, found {size}", **where)
    return decode_header(lambda s, e: storage.read_range(rel, s, e), size, where=where)
