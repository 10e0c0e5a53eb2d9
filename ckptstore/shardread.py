"""Reading shard files back, hashing while the bytes pass, with no torch anywhere (the read side of what
``ckptstore.shards`` names; the write side is :mod:`ckptstore.shardwrite`, issue 20).

``read_shard_into`` streams a shard back into caller-provided buffers (small arrays in runs through one
scratch buffer, issue 23), checking the header against the manifest and every hash on the way (each
byte hashed once); ``read_header`` and ``read_tensor_range`` serve partial loads. The checks themselves
are :mod:`ckptstore.shardcheck`'s. Every byte comes through a storage verb (``open_reader``,
``read_range``, ``size``; no branch opens a file itself), so the fault sweep sees each read.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import BinaryIO, Callable, Sequence

import zstandard

from . import hashing, layout
from .errors import CorruptCut, HashMismatch, StorageError, TruncatedFile
from .format import ShardHeader, decode_header
from .manifest import FileRecord, TensorRecord
from .shardarrays import BATCH_BELOW, ArraySink, Take, TensorHashes, read_arrays
from .shardcheck import (
    check_file_digest_v2,
    check_header_matches,
    check_missing,
    check_tensor_digests,
    file_order_key,
    header_is_written_form,
)
from .storage import Storage

#: The largest zstd window a reader accepts (libzstd's default limit, stated): the writer's levels use
#: at most this, and a hostile frame asking for more is refused instead of sizing memory by it.
MAX_ZSTD_WINDOW = 1 << 27


class _RawStream:
    """The raw (safetensors) byte stream of a shard, hashing the stored bytes (``hash_stored``) and,
    of a compressed file, the raw bytes (``hash_raw``) plainly as they pass: what format v1 records.
    Format v2 hashes the stored bytes of a zstd file only; the raw bytes go to ``TensorHashes``."""

    def __init__(
        self, storage: Storage, rel: str, record: FileRecord, where: dict, *, overlap: bool, hash_stored: bool,
        hash_raw: bool, tap: Callable[[memoryview | bytes], None] | None = None,
    ) -> None:
        self.where = where
        self.record = record
        try:
            self.file = storage.open_reader(rel)
        except StorageError as exc:
            check_missing(exc, where)
            raise
        self._check_size(storage, rel)
        if tap is not None:
            self.file = _Tapped(self.file, tap)  # type: ignore[assignment]
        # The reader comes buffered from the storage where small reads would cost (POSIX: 1 MiB).
        self.stored = hashing.HashingReader(self.file, overlap=overlap and record.codec == "none", hashed=hash_stored)
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
            # The size the open itself gave (``Storage.open_reader``), else the storage's own answer.
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

    def read_header_bytes(self) -> bytes:
        """The header's bytes (length prefix, JSON, padding); a length prefix past the file (or past
        64 MiB) is not followed, and the decoder refuses what is returned then (the prefix alone)."""
        prefix = self.read_exact(8)
        n = int.from_bytes(prefix, "little")
        return prefix + (self.read_exact(n) if n <= min(self.record.raw_nbytes - 8, 64 << 20) else b"")

    def decode(self, head_bytes: bytes) -> ShardHeader:
        """The header ``head_bytes`` decode to, every bound checked (``format.decode_header``)."""
        return decode_header(lambda s, e: head_bytes[s:e], self.record.raw_nbytes, where=self.where)

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


class _TapFailed(Exception):
    """What a tap raised, carried past the read's own handling of ``OSError``: a mirror's failed write is
    the mirror's error, not a read error of this shard (issue 21)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Tapped:
    """A shard's reader that hands every stored byte to ``tap`` as it passes, in file order, each byte
    once (the read hashes the same bytes: a mirror's upload, issue 21). The piece is the reader's buffer:
    the tap must be done with it when it returns."""

    def __init__(self, raw: BinaryIO, tap: Callable[[memoryview | bytes], None]) -> None:
        self._raw = raw
        self._tap = tap

    def _give(self, piece: memoryview | bytes) -> None:
        try:
            self._tap(piece)
        except Exception as exc:  # noqa: BLE001 - re-raised as itself by read_shard_into
            raise _TapFailed(exc) from exc

    def readinto(self, buf: memoryview | bytearray) -> int:
        n = self._raw.readinto(buf) or 0
        if n:
            self._give(memoryview(buf)[:n])
        return n

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        if data:
            self._give(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()


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
    tap: Callable[[memoryview | bytes], None] | None = None,
    take: Take | None = None,
) -> None:
    """Streams a whole shard, reading each array's bytes into ``dest(record)``; checks the
    file's size, then the header against the manifest, the file's lengths and (with ``verify``) its
    digests as the manifest's ``format_version`` defines them, hashed while reading (each byte once:
    v2 hashes each array and builds the file digest from them; v1 hashes the file plainly). Hashing
    overlaps the next read on a helper thread unless ``reuses_buffers`` says ``dest`` hands out the
    same memory twice (then a chunk could change before it is hashed). ``dest`` returning None reads
    that array through one reused buffer of at most ``PIECE`` bytes (verify: memory stays bounded
    whatever the arrays' sizes); it needs ``reuses_buffers``. ``sink`` sees every array's bytes piece by
    piece as they are read (``begin``, ``write`` of each piece, ``end``): its bytes are verified only
    when this returns. ``tap`` sees every stored byte of the file (compressed ones as stored) in order,
    each once, as it is read: a mirror streams them on (issue 21), and they too are verified only when
    this returns; what ``tap`` raises is raised as itself.

    Arrays under ``BATCH_BELOW`` bytes are read in runs, up to ``PIECE`` bytes in one read into a
    scratch buffer (issue 23: one read and one hasher per 4 KB array cost more than its bytes), hashed
    from it and copied into ``dest(record)``; with ``take``, a run goes to ``take(run, data, starts)``
    instead (``run[k]``'s bytes are ``data[starts[k]:starts[k] + run[k].nbytes]``, valid until it
    returns, unverified until this does) and ``dest`` sees only the larger arrays."""
    rel = layout.cut_file(cut, record.name)
    where = {"store": storage.url, "cut": cut, "path": rel}
    v2 = format_version >= 2
    overlap = verify and not reuses_buffers
    # verify=False checks lengths and the header but no digest, so nothing is hashed at all. A v1 file's
    # bytes are hashed as they pass; never on the helper thread when runs reuse the scratch buffer.
    stream = _RawStream(
        storage, rel, record, where, overlap=overlap and not v2 and all(t.nbytes >= BATCH_BELOW for t in tensors),
        hash_stored=verify and (not v2 or record.codec != "none"), hash_raw=verify and not v2, tap=tap,
    )
    hashes = TensorHashes(overlap) if verify and v2 else None
    try:
        head_bytes = stream.read_header_bytes()
        ordered = sorted(tensors, key=file_order_key)
        if not header_is_written_form(head_bytes, ordered, record.raw_nbytes):
            check_header_matches(stream.decode(head_bytes), ordered, where)
        read_arrays(stream, ordered, dest, reuses_buffers=reuses_buffers, hashes=hashes, sink=sink, on_bytes=on_bytes,
                     take=take)
        stream.finish()
        _check_digests(stream, hashes, head_bytes, verify=verify)
    except BaseException as exc:
        stream.close()
        if hashes is not None:
            hashes.close()
        if isinstance(exc, _TapFailed):
            raise exc.error from None
        raise


def _check_digests(stream: _RawStream, hashes: TensorHashes | None, head_bytes: bytes, *, verify: bool) -> None:
    """The digests as the manifest's format version defines them: v2 (``hashes``) every array's and
    the file digest built from them, plus a zstd file's stored bytes; v1 the plain stored and raw."""
    record, where = stream.record, stream.where
    if hashes is not None:
        digests = hashes.digests()
        check_tensor_digests(digests, where)
        got = hashing.file_digest_v2_columns(head_bytes, list(map(attrgetter("nbytes"), map(itemgetter(0), digests))),
                                             list(map(itemgetter(1), digests)))
        check_file_digest_v2(record, got, where)
        if record.codec != "none":
            stream.check_stored()
    elif verify:
        stream.check_stored()
        if record.codec != "none":
            stream.check_raw_plain()


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
        check_missing(exc, where)
        raise
    if size != record.nbytes:
        cls = TruncatedFile if size < record.nbytes else CorruptCut
        raise cls(f"expected {record.nbytes} bytes, found {size}", **where)
    return decode_header(lambda s, e: storage.read_range(rel, s, e), size, where=where)
