"""The O_DIRECT shard sink of POSIX storage: two page-aligned buffers, writes overlapped with hashing,
and zero-copy writes straight from page-aligned caller memory (see :class:`PosixSink`).

The sink reaches its storage only through :class:`SinkHost`, the public face ``PosixStorage`` offers
it, and takes its buffers from a :class:`~.buffers.BufferPool` (issue 20: it used to drive the
storage's private members while ``posix.py`` imported the sink's private buffer class).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from ..errors import StorageError
from .base import Sink, cut_of
from .buffers import ALIGN, CHUNK, BufferPool

__all__ = ["ALIGN", "CHUNK", "ZERO_COPY_MIN", "PosixSink", "SinkHost", "buffer_address"]

#: Below this, copying into the staging buffer is cheaper than an extra write.
ZERO_COPY_MIN = 64 << 10


def buffer_address(view: memoryview) -> int | None:
    """The memory address of a writable buffer (None for read-only ones, e.g. bytes)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


class SinkHost(Protocol):
    """What a :class:`PosixSink` needs of its storage. ``use_direct``: whether new files try O_DIRECT;
    a sink clears it when the file system refuses O_DIRECT, so later files skip the attempt."""

    url: str
    use_direct: bool
    buffers: BufferPool

    def local_path(self, rel: str) -> str | None: ...


class PosixSink(Sink):
    """Writes one file, with O_DIRECT where possible. Data is gathered into two page-aligned buffers:
    while one is written by a background thread (``os.write`` releases the GIL), the caller hashes and
    fills the other, so hashing overlaps the disk. The last chunk is padded to the alignment and the
    file truncated back to its true length before the fsync, so the file holds exactly what was
    written.

    Zero copy: when a piece the caller hands over is itself page-aligned in memory (the writer's
    shared block gives every array a page-aligned slot) and the file position is page-aligned, the
    piece goes to the disk straight from the caller's memory, skipping the staging copy: one less pass
    over every byte, which is memory bandwidth and cache the trainer next door keeps. The caller's
    memory must then stay unchanged until ``close`` returns (``write_shard`` callers own it until then).
    Only writable memory goes this way: a read-only piece (bytes, or a view made with ``toreadonly()``)
    is always copied before ``write`` returns, so its buffer may be reused at once (``write_shard``'s
    gathering buffer relies on it).
    Should the kernel refuse an aligned O_DIRECT write (EINVAL), the file drops O_DIRECT and carries on
    through the page cache: slower, never wrong."""

    def __init__(self, storage: SinkHost, rel: str) -> None:
        self._storage = storage
        self._rel = rel
        path = storage.local_path(rel)
        assert path is not None, "a PosixSink writes to local paths only"
        self._path = path
        self._length = 0
        self._fill = 0
        self._fd = -1
        self._direct = storage.use_direct
        self._pending: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.zero_copy_bytes = 0  # bytes that went to the disk straight from the caller's memory
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            if self._direct:
                try:
                    self._fd = os.open(self._path, flags | os.O_DIRECT, 0o644)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # tmpfs and some FUSE mounts refuse O_DIRECT
                        raise
                    self._direct = False
                    storage.use_direct = False
            if self._fd < 0:
                self._fd = os.open(self._path, flags, 0o644)
        except OSError as exc:
            raise self._error(exc, "creating shard") from exc
        self._bufs = [storage.buffers.take(), storage.buffers.take()] if self._direct else []
        self._cur = 0

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        try:
            if not self._bufs:
                while len(mv):
                    n = os.write(self._fd, mv)
                    mv = mv[n:]
                    self._length += n
                return
            while len(mv):
                direct = self._zero_copy_len(mv)
                if direct:
                    if self._fill:  # a page-aligned partial buffer goes first, in file order
                        self._submit(self._fill)
                    self._submit_view(mv[:direct])
                    self.zero_copy_bytes += direct
                    mv = mv[direct:]
                    continue
                buf = self._bufs[self._cur]
                take = min(len(mv), buf.size - self._fill)
                self._copy(buf.view, mv, take)
                self._fill += take
                mv = mv[take:]
                if self._fill == buf.size:
                    self._submit(self._fill)
        except OSError as exc:
            raise self._error(exc, "writing shard") from exc

    def _copy(self, dest: memoryview, mv: memoryview, take: int) -> None:
        """Copies ``mv[:take]`` into ``dest`` at the fill position. A large copy from writable memory
        runs without the GIL (``ctypes.memmove``): a slice assignment holds it for the whole copy (1 ms
        for 8 MiB), and the I/O thread, back from a write, waited that long before it could hand the
        result over and take the next buffer, while the disk sat idle (issue 23: the gaps between the
        writes of a 1 GiB store.save went from 0.7-1.4 ms to 0.2 ms at the median)."""
        src = buffer_address(mv) if take >= ZERO_COPY_MIN else None
        if src is None:
            dest[self._fill : self._fill + take] = mv[:take]
            return
        base = buffer_address(dest)
        assert base is not None, "staging buffers are writable"
        ctypes.memmove(base + self._fill, src, take)

    def _error(self, exc: OSError, action: str) -> StorageError:
        """The error a storage verb raises for ``exc`` (as ``Storage``'s own), naming store, cut and file."""
        return StorageError.from_os_error(exc, action, store=self._storage.url, cut=cut_of(self._rel), path=self._rel)

    def _zero_copy_len(self, mv: memoryview) -> int:
        """How many leading bytes of ``mv`` can go to the disk from the caller's memory: a multiple of
        the alignment, when the file position (after the buffered bytes) and the address both are
        aligned; 0 when the piece must be copied."""
        if not self._direct or len(mv) < ZERO_COPY_MIN or self._fill % ALIGN:
            return 0
        address = buffer_address(mv)
        if address is None or address % ALIGN:
            return 0
        return len(mv) - len(mv) % ALIGN

    def _submit(self, nbytes: int) -> None:
        """Hands the current buffer to the I/O thread and switches to the other one."""
        self._submit_view(self._bufs[self._cur].view[:nbytes])
        self._fill = 0
        self._cur ^= 1

    def _submit_view(self, view: memoryview) -> None:
        """Waits for the write in flight, then starts writing ``view`` (aligned memory and length)."""
        self._wait_pending()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptstore-io")
        self._pending = self._pool.submit(self._write_all, view)
        self._length += len(view)

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                self._drop_direct()

    def _drop_direct(self) -> None:
        """The kernel refused an O_DIRECT write (an alignment this file system does not take): the
        rest of this file goes through the page cache, and later files skip O_DIRECT."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self._direct = False
        self._storage.use_direct = False

    def _wait_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            if self._bufs and self._fill:
                true_len = self._length + self._fill
                padded = -(-self._fill // ALIGN) * ALIGN
                self._bufs[self._cur].view[self._fill : padded] = bytes(padded - self._fill)
                self._submit(padded)
                self._wait_pending()
                os.ftruncate(self._fd, true_len)
                self._length = true_len
            self._wait_pending()
            os.fsync(self._fd)
        except OSError as exc:
            self.abort()
            raise self._error(exc, "writing shard") from exc
        self._release()
        os.close(self._fd)
        self._fd = -1

    def _release(self) -> None:
        try:
            self._wait_pending()
        except OSError:
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for buf in self._bufs:
            self._storage.buffers.give_back(buf)
        self._bufs = []

    def abort(self) -> None:
        self._release()
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        try:
            os.unlink(self._path)
        except OSError:
            pass


