"""blake3 hashing: one place that decides thread counts and how streams are hashed.

blake3 releases the GIL on large inputs, so hashing overlaps disk I/O running in another thread. The
digests are lowercase hex of the default 32-byte output; docs/format.md names them ``blake3``.
"""

from __future__ import annotations

import itertools
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Iterable, Sequence

import blake3 as _blake3

#: Threads for hashing one large buffer (blake3's own pool); "auto" uses every core.
AUTO = _blake3.blake3.AUTO
#: Arrays smaller than this are hashed inline, never on a helper thread: the hand-off would cost
#: more than the overlap saves (40,000 arrays of 4 KB: one submit each doubled a load).
SMALL = 256 << 10
#: The domain separator that opens every format-v2 file digest (docs/format.md).
FILE_V2_PREFIX = b"ckptstore-file-v2\0"


def file_digest_v2(header: bytes | memoryview, tensors: Iterable[tuple[int, bytes]]) -> str:
    """The format-v2 file digest of a raw (safetensors) byte stream, from its header bytes ``H``
    (``[0, data_start)``: length prefix, JSON and padding) and each tensor's ``(nbytes, raw 32-byte
    blake3)`` in file order::

        blake3(b"ckptstore-file-v2\\0" || u64le(len(H)) || H || for each tensor: u64le(nbytes) || digest)

    The data section is contiguous, so ``H`` and that list fix every byte of the file, and each byte
    is hashed once (the tensor bytes by their own digests)."""
    pairs = list(tensors)
    return file_digest_v2_columns(header, [n for n, _ in pairs], [d for _, d in pairs])


_U64 = struct.Struct("<Q").pack


#: Tensors per piece of ``file_digest_v2_columns``' streamed input.
DIGEST_CHUNK = 4096


def file_digest_v2_columns(header: bytes | memoryview, nbytes: Sequence[int], digests: Sequence[bytes]) -> str:
    """:func:`file_digest_v2` of the tensors' sizes and digests given as two columns (a shard writer
    has them so): the digested bytes joined in one C-level pass, not two appends a tensor."""
    if len(nbytes) != len(digests):
        raise ValueError("one size per tensor digest")
    if digests and set(map(len, digests)) != {32}:
        raise ValueError("a tensor digest is 32 raw bytes")
    # Streamed, a few thousand entries at a time: the digested bytes of 100,000 tensors joined whole,
    # then joined again with the header, were 20 MB of a cut's peak memory (issue 23). Blake3 of the
    # pieces in order is blake3 of their concatenation.
    h = _blake3.blake3()
    h.update(FILE_V2_PREFIX)
    h.update(_U64(len(header)))
    h.update(header)
    step = DIGEST_CHUNK
    for i in range(0, len(digests), step):
        h.update(b"".join(itertools.chain.from_iterable(zip(map(_U64, nbytes[i:i + step]), digests[i:i + step]))))
    return h.hexdigest()


def new_hasher(*, threads: int = AUTO) -> "_blake3.blake3":
    return _blake3.blake3(max_threads=threads)


_NEW_HASHER = new_hasher


def digest_each(views: Iterable[bytes | memoryview]) -> list[bytes]:
    """The raw blake3 of each buffer, single-threaded (a 4 KB array is done before a thread could
    start): how many small arrays are hashed, one call chain each (issue 23). Through
    :func:`new_hasher`, the one seam that makes every hasher, when a test replaced it; else by the
    constructor that hashes its argument (the seam's call and ``update`` were 0.8 us of a 4 KB
    array's 3.1: 30 ms of a load of 40,000)."""
    new = new_hasher
    if new is _NEW_HASHER:
        make = _blake3.blake3  # max_threads=1, its default
        return [make(v).digest() for v in views]
    return [new(threads=1).update(v).digest() for v in views]


def digest(data: bytes | memoryview, *, threads: int = AUTO) -> str:
    """The hex blake3 of ``data``."""
    h = _blake3.blake3(max_threads=threads)
    h.update(data)
    return h.hexdigest()


def digest_file(path: str, *, threads: int = AUTO) -> str:
    """The hex blake3 of a local file, memory-mapped (one read pass, multi-threaded)."""
    h = _blake3.blake3(max_threads=threads)
    h.update_mmap(path)
    return h.hexdigest()


class HashingReader:
    """Wraps a binary reader and hashes every byte that passes through ``readinto``/``read``.

    With ``overlap=True`` the hashing of each chunk runs on a helper thread while the next chunk is
    read; only valid when the caller never reuses a buffer it has read into (the loader reads straight
    into the tensors it returns, so it qualifies). ``hexdigest()`` waits for pending work.

    With ``hashed=False`` it only counts bytes (a load with ``verify=False`` checks lengths, never
    digests, so hashing there would be pure cost); ``hexdigest()`` then raises.
    """

    def __init__(self, raw: BinaryIO, *, overlap: bool = False, hashed: bool = True) -> None:
        self.raw = raw
        self.count = 0
        self._hasher = new_hasher() if hashed else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-hash") if overlap and hashed else None
        self._last: Future[None] | None = None

    def _feed(self, view: memoryview | bytes) -> None:
        self.count += len(view)
        if self._hasher is None:
            return
        if self._pool is not None:
            self._last = self._pool.submit(self._hasher.update, view)
        else:
            self._hasher.update(view)

    def readinto(self, buf: memoryview | bytearray) -> int:
        mv = memoryview(buf).cast("B")
        n = self.raw.readinto(mv) or 0
        if n:
            self._feed(mv[:n])
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        if data:
            self._feed(data)
        return data

    def hexdigest(self) -> str:
        self.close()
        if self._hasher is None:
            raise ValueError("this HashingReader was created with hashed=False")
        return self._hasher.hexdigest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._last is not None:
            last, self._last = self._last, None
            last.result()

    def readable(self) -> bool:
        return True
