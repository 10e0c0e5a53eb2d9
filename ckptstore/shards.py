"""Writing and reading shard files: hashing while the bytes pass, with no torch anywhere.

``plan_shards`` splits arrays into shards of bounded size; ``write_shard`` streams one shard through a
storage sink (header, then each array in 8 MiB pieces, each piece hashed once, for its array, while the
previous piece is on its way to disk) and returns the manifest records, the file's digest built from
the header bytes and the array digests (format v2, docs/format.md); ``write_shards`` is the one loop
that writes a rank's shards. ``read_shard_into`` streams a shard back into caller-provided buffers,
checking the header against the manifest and every hash on the way (again each byte hashed once).
The writer subprocess uses the same functions on views of the shared-memory block.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Protocol, Sequence

import zstandard

from . import hashing, layout
from .arrays import ArrayItem
from .errors import CorruptCut, HashMismatch, MissingFile, StorageError, TruncatedFile
from .format import DATA_ALIGN, ShardHeader, decode_header, encode_header, header_dtype
from .storage import Storage
from .storage.posix import NotRegular, not_a_file, open_regular
from .manifest import FileRecord, TensorRecord

PIECE = 8 << 20
READ_BUFFER = 1 << 20
#: The largest zstd window a reader accepts (libzstd's default limit, stated): the writer's levels use
#: at most this, and a hostile frame asking for more is refused instead of sizing memory by it.
MAX_ZSTD_WINDOW = 1 << 27


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
    """Writes one shard file durably (fsynced on close) and returns its manifest records (format v2:
    each raw byte is hashed once, for its array; the file digest is built from the header bytes and
    the array digests; a zstd file's stored bytes are hashed once more, plainly). On any error the
    partial file is removed and the error raised with the store, cut and file named. ``timings``
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
        out.write(header)
        records = []
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
                # Built from the bytes just written, not parsed: validating 40,000 of them cost 1.3 s
                # per save. The manifest's own validator still checks every record when it is built
                # and whenever it is read back.
                TensorRecord.model_construct(
                    name=it.name, kind=it.kind, dtype=it.dtype, shape=list(it.shape), nbytes=it.nbytes,
                    file=name, offset=offset, blake3=d.hex(),
                )
            )
            offset += it.nbytes
        raw_nbytes = len(header) + offset
        # The items are in file order (ascending offset), as the v2 digest lists them.
        raw_digest = hashing.file_digest_v2(header, digests)
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


# --------------------------------------------------------------------------------------------------
# Reading


def _check_missing(exc: StorageError, where: dict) -> None:
    """A file the manifest lists that the storage cannot find is damage to the cut (MissingFile, a
    DataError launchers fall back from), not the file system refusing (StorageError)."""
    if exc.errno == errno.ENOENT or isinstance(exc.__cause__, FileNotFoundError):
        raise MissingFile("a file the manifest lists is missing", **where) from exc


class _RawStream:
    """The raw (safetensors) byte stream of a shard, hashing the stored bytes (``hash_stored``) and,
    of a compressed file, the raw bytes (``hash_raw``) plainly as they pass: what format v1 records.
    Format v2 hashes the stored bytes of a zstd file only; the raw bytes go to ``_TensorHashes``."""

    def __init__(
        self, storage: Storage, rel: str, record: FileRecord, where: dict, *, overlap: bool, hash_stored: bool,
        hash_raw: bool,
    ) -> None:
        self.where = where
        self.record = record
        try:
            self.file = storage.open_reader(rel)
        except StorageError as exc:
            _check_missing(exc, where)
            raise
        self._check_size(storage, rel)
        source: BinaryIO = self.file
        if isinstance(self.file, io.FileIO):
            # Many small arrays would each cost a read syscall and its Python call chain (40,000 x 4 KB:
            # 0.5 s); a BufferedReader serves them from 1 MiB reads, and still reads large arrays
            # straight into their own memory (it bypasses its buffer for requests larger than it).
            source = io.BufferedReader(self.file, buffer_size=READ_BUFFER)  # type: ignore[arg-type]
        self.stored = hashing.HashingReader(source, overlap=overlap and record.codec == "none", hashed=hash_stored)
        if record.codec == "zstd":
            # Output is pulled in pieces no larger than the caller's buffers (the raw length the
            # manifest records is the most ever asked for; ``finish`` refuses one byte more), and the
            # window a frame may demand is capped at the 128 MiB the writer's levels stay within.
            dctx = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW)
            self.reader: BinaryIO = dctx.stream_reader(self.stored, read_across_frames=False)  # type: ignore[assignment]
            self.raw = hashing.HashingReader(self.reader, hashed=hash_raw)
        else:
            self.reader = self.stored  # type: ignore[assignment]
            self.raw = self.stored
        self.pos = 0

    def _check_size(self, storage: Storage, rel: str) -> None:
        """The file's size against the manifest, before a byte is read or a buffer allocated for it: a
        hostile record claiming a huge array is refused here (issue 10, item 9). The raw length was
        checked against the stored one when the manifest was parsed (``manifest._check_arrays``)."""
        try:
            if isinstance(self.file, io.FileIO):
                size = os.fstat(self.file.fileno()).st_size
            else:
                size = getattr(self.file, "size", None)
                if type(size) is not int:
                    size = storage.size(rel)
        except OSError as exc:
            self.file.close()
            if isinstance(exc, StorageError):
                raise
            raise StorageError.from_os_error(exc, "sizing shard", **self.where) from exc
        if size != self.record.nbytes:
            self.file.close()
            cls = TruncatedFile if size < self.record.nbytes else CorruptCut
            raise cls(f"expected {self.record.nbytes} bytes, found {size}", **self.where)

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

    def finish(self) -> None:
        """Drains the rest of the file and checks lengths: a truncated frame or file can never pass,
        since both the stored and the raw length must match. Digests are checked by the caller."""
        try:
            rest = self.raw.read(1)
            if rest:
                raise CorruptCut("shard has bytes past its recorded raw length", **self.where)
            while self.stored.read(1 << 20):
                pass
        except zstandard.ZstdError as exc:
            raise CorruptCut(f"zstd stream is damaged: {exc}", **self.where) from None
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise StorageError.from_os_error(exc, "reading shard", **self.where) from exc
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

    def check_stored(self) -> None:
        """The plain blake3 of the stored bytes against ``blake3`` (v1; v2 for zstd files)."""
        got = self.stored.hexdigest()
        if got != self.record.blake3:
            raise HashMismatch(f"blake3 mismatch: expected {self.record.blake3}, found {got}", **self.where)

    def check_raw_plain(self) -> None:
        """v1, compressed files: the plain blake3 of the decoded bytes against ``raw_blake3``."""
        got_raw = self.raw.hexdigest()
        if got_raw != self.record.raw_blake3:
            raise HashMismatch(f"raw blake3 mismatch: expected {self.record.raw_blake3}, found {got_raw}", **self.where)

    def close(self) -> None:
        for closer in (self.stored.close, self.raw.close, self.file.close):
            try:
                closer()
            except Exception:  # noqa: BLE001 - closing after an error must not mask it
                pass


class _TensorHashes:
    """Format v2 reads: each array's blake3, hashed once as its bytes are read. With ``overlap`` (the
    caller never reuses a buffer), arrays of ``hashing.SMALL`` bytes or more are hashed on a helper
    thread while the next piece is read; smaller ones inline (a hand-off per 4 KB array would cost more
    than it saves)."""

    def __init__(self, overlap: bool) -> None:
        self._overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._updates: list[Future[None]] = []
        self._done: list[tuple[TensorRecord, bytes | Future[bytes]]] = []
        self._hasher: Any = None  # the current array's
        self._pooled = False

    def begin(self, t: TensorRecord) -> None:
        self._hasher = hashing.new_hasher(threads=hashing.AUTO if t.nbytes >= hashing.SMALL else 1)
        self._pooled = self._overlap and t.nbytes >= hashing.SMALL
        if self._pooled and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-hash")

    def update(self, piece: memoryview) -> None:
        if self._pooled:
            assert self._pool is not None
            self._updates.append(self._pool.submit(self._hasher.update, piece))
        else:
            self._hasher.update(piece)

    def end(self, t: TensorRecord) -> None:
        if self._pooled:
            assert self._pool is not None
            self._done.append((t, self._pool.submit(self._hasher.digest)))
        else:
            self._done.append((t, self._hasher.digest()))

    def digests(self) -> list[tuple[TensorRecord, bytes]]:
        """Every array's raw digest, in the order they were read; waits for the helper thread."""
        self.close()
        for f in self._updates:
            f.result()
        return [(t, d if isinstance(d, bytes) else d.result()) for t, d in self._done]

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True)


def file_order_key(t: TensorRecord) -> tuple[int, int]:
    """The order of a shard's arrays in its data section, from the manifest: ascending offset; a
    zero-size array comes before the array that starts where it sits (all of a file's zero-size arrays
    at one offset have identical v2 digest entries, so their order among themselves does not matter)."""
    return (t.offset, t.nbytes)


def check_tensor_digests(digests: Iterable[tuple[TensorRecord, bytes]], where: dict) -> None:
    """Each array's blake3 against its manifest record; the error names the first array that differs."""
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


class ArraySink(Protocol):
    """Where :func:`read_shard_into` hands each array's bytes as they are read (unverified until it
    returns)."""

    def begin(self, t: TensorRecord) -> None: ...
    def write(self, piece: memoryview) -> None: ...
    def end(self, t: TensorRecord) -> None: ...


def read_shard_into(
    storage: Storage,
    cut: str,
    record: FileRecord,
    tensors: Sequence[TensorRecord],
    dest: Callable[[TensorRecord], memoryview | None],
    *,
    format_version: int,
    verify: bool = True,
    on_bytes: Callable[[int], None] | None = None,
    reuses_buffers: bool = False,
    sink: ArraySink | None = None,
) -> None:
    """Streams a whole shard, reading each array's bytes straight into ``dest(record)``; checks the
    file's size, then the header against the manifest, the file's lengths and (with ``verify``) its
    digests as the manifest's ``format_version`` defines them, hashed while reading (each byte once:
    v2 hashes each array and builds the file digest from them; v1 hashes the file plainly). Hashing
    overlaps the next read on a helper thread unless ``reuses_buffers`` says ``dest`` hands out the
    same memory twice (then a chunk could change before it is hashed). ``dest`` returning None reads
    that array through one reused buffer of at most ``PIECE`` bytes (verify: memory stays bounded
    whatever the arrays' sizes); it needs ``reuses_buffers``. ``sink`` sees every array's bytes piece by
    piece as they are read (``begin``, ``write`` of each piece, ``end``): its bytes are verified only
    when this returns."""
    rel = layout.cut_file(cut, record.name)
    where = {"store": storage.url, "cut": cut, "path": rel}
    v2 = format_version >= 2
    overlap = verify and not reuses_buffers
    # verify=False checks lengths and the header but no digest, so nothing is hashed at all.
    stream = _RawStream(
        storage, rel, record, where, overlap=overlap and not v2,
        hash_stored=verify and (not v2 or record.codec != "none"), hash_raw=verify and not v2,
    )
    hashes = _TensorHashes(overlap) if verify and v2 else None
    try:
        prefix = stream.read_exact(8)
        n = int.from_bytes(prefix, "little")
        head_bytes = prefix + (stream.read_exact(n) if n <= min(record.raw_nbytes - 8, 64 << 20) else b"")
        header = decode_header(lambda s, e: head_bytes[s:e], record.raw_nbytes, where=where)
        ordered = sorted(tensors, key=file_order_key)
        check_header_matches(header, ordered, where)
        scratch: memoryview | None = None
        for t in ordered:
            view = dest(t)
            if view is None:
                if not reuses_buffers:
                    raise ValueError("dest returned no buffer; pass reuses_buffers=True")
                if scratch is None:
                    scratch = memoryview(bytearray(min(PIECE, max(x.nbytes for x in ordered))))
            if hashes is not None:
                hashes.begin(t)
            if sink is not None:
                sink.begin(t)
            for start in range(0, t.nbytes, PIECE):
                piece = view[start : start + PIECE] if view is not None else scratch[: min(PIECE, t.nbytes - start)]
                stream.readinto_exact(piece)
                if hashes is not None:
                    hashes.update(piece)
                if sink is not None:
                    sink.write(piece)
                if on_bytes is not None:
                    on_bytes(len(piece))
            if sink is not None:
                sink.end(t)
            if hashes is not None:
                hashes.end(t)
        stream.finish()
        if hashes is not None:
            digests = hashes.digests()
            check_tensor_digests(digests, where)
            got = hashing.file_digest_v2(head_bytes, [(t.nbytes, d) for t, d in digests])
            check_file_digest_v2(record, got, where)
            if record.codec != "none":
                stream.check_stored()
        elif verify:
            stream.check_stored()
            if record.codec != "none":
                stream.check_raw_plain()
    except BaseException:
        stream.close()
        if hashes is not None:
            hashes.close()
        raise


def local_digests_v2(
    path: str, record: FileRecord, tensors: Sequence[TensorRecord], where: dict
) -> tuple[list[tuple[TensorRecord, bytes]], str]:
    """Format v2 digests of an uncompressed shard on a local disk, laid out as the manifest records it
    (``verify``'s fast path): each array's blake3 over its byte range of the memory-mapped file (big
    ones on every core), and the file digest of the bytes before the data section plus those. The
    header is not decoded first, so damage anywhere shows as a digest mismatch; the caller checks the
    header's structure afterwards. Raises CorruptCut when the records do not tile a data section that
    ends at ``raw_nbytes``, TruncatedFile when the file is not ``raw_nbytes`` long."""
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
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size != record.raw_nbytes:
                cls = TruncatedFile if size < record.raw_nbytes else CorruptCut
                raise cls(f"expected {record.raw_nbytes} bytes, found {size}", **where)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                digests = _hash_ranges(mm, data_start, ordered)
                header = mm[:data_start]
    except NotRegular as exc:  # damage of this file, not an I/O error to retry (issue 19 item 12)
        raise not_a_file(exc, **where) from exc
    except FileNotFoundError as exc:
        raise MissingFile("a file the manifest lists is missing", **where) from exc
    except OSError as exc:
        raise StorageError.from_os_error(exc, "hashing shard", **where) from exc
    return digests, hashing.file_digest_v2(header, [(t.nbytes, d) for t, d in digests])


def _hash_ranges(mm: mmap.mmap, data_start: int, ordered: Sequence[TensorRecord]) -> list[tuple[TensorRecord, bytes]]:
    # The views must be gone before the mmap closes (it refuses to close while exported).
    with memoryview(mm) as view:
        out = []
        for t in ordered:
            h = hashing.new_hasher(threads=hashing.AUTO if t.nbytes >= hashing.SMALL else 1)
            start = data_start + t.offset
            with view[start : start + t.nbytes] as part:
                h.update(part)
            out.append((t, h.digest()))
    return out


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
            raise HashMismatch(f"tensor {t.name!r}: blake3 mismatch, expected {t.blake3}, found {got}", **where)
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
