"""blake3 hashing: one place that decides thread counts and how streams are hashed.

blake3 releases the GIL on large inputs, so hashing overlaps disk I/O running in another thread. The
digests are lowercase hex of the default 32-byte output; docs/format.md names them ``blake3``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import blake3 as _blake3

#: Threads for hashing one large buffer (blake3's own pool); "auto" uses every core.
AUTO = _blake3.blake3.AUTO


def new_hasher(*, threads: int = AUTO) -> "_blake3.blake3":
    return _blake3.blake3(max_threads=threads)


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
