"""POSIX storage: local directories, with every durability step done explicitly.

``write_durably`` does all four steps that make a replace durable: write a sibling temp file, fsync
it, rename it over the target, fsync the directory. None of DCP, Orbax or torchsnapshot does the last
step; without it a power loss can undo the rename (or a mark's removal, failure-modes row 10). Shards
are written with O_DIRECT from page-aligned buffers where the file system allows it (:mod:`.sink`): on
this class of VM fresh page-cache pages are slow and noisy (research/limits.md), while O_DIRECT runs at
the disk's speed. Every file the store reads is opened here, by a verb (issue 20: the shard reader used
to open and map shards itself): ``open_reader`` buffers it and knows its size, ``map_file`` maps it.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import stat
from typing import BinaryIO

from .. import layout
from ..errors import CkptStoreError, NotAFile
from .base import Capabilities, Entry, MappedFile, Sink, Storage, StorageSpec, cut_of
from .buffers import STAGE, BufferPool
from .sink import PosixSink

#: The read buffer of ``open_reader``: many small arrays would each cost a read system call and its
#: Python call chain (40,000 x 4 KB: 0.5 s); 1 MiB reads serve them, while a read larger than the
#: buffer still goes straight into the caller's memory (BufferedReader bypasses its buffer for it).
READ_BUFFER = 1 << 20


class NotRegular(OSError):
    """:func:`open_regular`'s refusal; ``what`` names what stands where a regular file should be."""

    def __init__(self, code: int, what: str, path: str) -> None:
        super().__init__(code, f"not a regular file: {what} stands in its place", path)
        self.what = what


def _what(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "a device"


def not_a_file(exc: NotRegular, **where: str | None) -> NotAFile:
    """The ckptstore error for a refused name: damage of that one file (a ``CorruptCut``), never an I/O
    error to retry, so verify reports it and fallback skips its cut (issue 19 item 12)."""
    rel = where.get("path") or exc.filename
    return NotAFile(f"{rel} is not a regular file: {exc.what} stands in its place; the store never reads one "
                    "(a symlink could reach files outside the store, a FIFO would hang the read)",
                    hint="its cut is damaged: load(..., fallback=True) resumes from the newest cut that verifies; "
                         "the store never removes what stands there", **where)


def open_regular(path: str, buffering: int = 0) -> BinaryIO:
    """Opens ``path`` for reading only if it is a regular file reached without following a symlink in
    its last component: a FIFO planted as a shard must not hang a reader (opened non-blocking, then
    refused), and a symlinked shard must not make the store read what lies outside it. Raises
    :class:`NotRegular` for a name that is something else (a symlink, directory, FIFO, socket,
    device), any other OSError as it came."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # ELOOP (a symlink), ENXIO (a socket), ...: what stands there says whether it is damage.
        mode = _lstat_mode(path)
        if mode is not None and not stat.S_ISREG(mode):
            raise NotRegular(exc.errno or errno.EINVAL, _what(mode), path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(errno.EINVAL, _what(mode), path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)  # type: ignore[return-value]
    except BaseException:
        os.close(fd)
        raise


class PosixReader(io.BufferedReader):
    """What ``PosixStorage.open_reader`` hands out: a buffered reader of ``READ_BUFFER`` bytes that
    also knows ``size``, the file's length as ``fstat`` of its own descriptor gave it at the open."""

    def __init__(self, raw: BinaryIO, size: int) -> None:
        super().__init__(raw, buffer_size=READ_BUFFER)  # type: ignore[arg-type]
        self.size = size


def _lstat_mode(path: str) -> int | None:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return None


class PosixStorage(Storage):
    """Local directories, with every durability step done explicitly (see the module docstring)."""

    capabilities = Capabilities(local_paths=True)

    def __init__(self, root: str, *, use_direct: bool = True, chunk_bytes: int = STAGE) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        #: O_DIRECT for new shard files; a sink clears it once the file system refuses O_DIRECT.
        self.use_direct = use_direct
        #: The staging buffers of this storage's sinks (:class:`~.sink.SinkHost`).
        self.buffers = BufferPool(chunk_bytes)

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def local_path(self, rel: str) -> str:
        return self._abs(rel)

    def spec(self) -> StorageSpec:
        return StorageSpec(self.root)

    def _fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_durably(self, rel: str, data: bytes) -> None:
        final = self._abs(rel)
        parent = os.path.dirname(final)
        tmp = os.path.join(parent, layout.tmp_name(os.path.basename(final)))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                view = memoryview(data)
                while len(view):
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # 1. the data is on disk before any name points at it
            finally:
                os.close(fd)
            os.replace(tmp, final)  # 2. atomic switch to the new content
            self._fsync_dir(parent)  # 3. the rename itself survives a power loss
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise self._error(exc, "durable write", rel) from exc

    def open_sink(self, rel: str) -> Sink:
        return PosixSink(self, rel)

    def _read_error(self, exc: OSError, action: str, rel: str) -> CkptStoreError:
        if isinstance(exc, NotRegular):
            return not_a_file(exc, store=self.url, cut=cut_of(rel), path=rel)
        return self._error(exc, action, rel)

    def read_bytes(self, rel: str) -> bytes:
        try:
            with open_regular(self._abs(rel), buffering=-1) as f:
                return f.read()
        except OSError as exc:
            raise self._read_error(exc, "reading", rel) from exc

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        try:
            with open_regular(self._abs(rel)) as f:
                return os.pread(f.fileno(), end - start, start)
        except OSError as exc:
            raise self._read_error(exc, "reading", rel) from exc

    def open_reader(self, rel: str) -> BinaryIO:
        """A :class:`PosixReader`: buffered, and ``size`` the length of the very file it opened."""
        try:
            raw = open_regular(self._abs(rel))
        except OSError as exc:
            raise self._read_error(exc, "opening", rel) from exc
        try:
            size = os.fstat(raw.fileno()).st_size
        except OSError as exc:
            raw.close()
            raise self._error(exc, "stat", rel) from exc
        return PosixReader(raw, size)  # type: ignore[return-value]

    def map_file(self, rel: str) -> MappedFile:
        try:
            with open_regular(self._abs(rel)) as f:
                size = os.fstat(f.fileno()).st_size
                # An empty file cannot be mapped; it is no shard either (its caller's size check says so).
                return MappedFile(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None, size)
        except OSError as exc:
            raise self._read_error(exc, "mapping", rel) from exc

    def size(self, rel: str) -> int:
        """The size of the regular file ``rel``; its own, never a symlink target's (a link's target
        size would pass a size check for bytes outside the store), and a FIFO's or directory's is no
        file size at all: both are refused as :func:`open_regular` refuses them."""
        path = self._abs(rel)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegular(errno.EINVAL, _what(st.st_mode), path)
            return st.st_size
        except OSError as exc:
            raise self._read_error(exc, "stat", rel) from exc

    def exists(self, rel: str) -> bool:
        # os.path.lexists would say False on EIO: "cannot tell" must never read as "absent" (a LATEST
        # that seems absent makes its marked cut look in progress, and gc would remove it).
        try:
            os.lstat(self._abs(rel))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._error(exc, "stat", rel) from exc
        return True

    def list_dir(self, rel: str) -> list[Entry]:
        path = self._abs(rel)
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise self._error(exc, "listing", rel) from exc
        out = []
        for name in sorted(names):
            try:
                st = os.lstat(os.path.join(path, name))
            except FileNotFoundError:
                continue
            out.append(Entry(name, stat.S_ISDIR(st.st_mode), st.st_size))
        return out

    def make_dir(self, rel: str) -> None:
        path = self._abs(rel)
        try:
            try:
                os.mkdir(path)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
                return
            self._fsync_dir(os.path.dirname(path))
        except OSError as exc:
            raise self._error(exc, "creating directory", rel) from exc

    def delete(self, rel: str, *, durable: bool = True) -> None:
        path = self._abs(rel)
        try:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            if durable:
                self._fsync_dir(os.path.dirname(path))
        except OSError as exc:
            raise self._error(exc, "deleting", rel) from exc

    def remove_dir(self, rel: str) -> None:
        path = self._abs(rel)
        try:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                return
            self._fsync_dir(os.path.dirname(path))
        except OSError as exc:
            raise self._error(exc, "removing directory", rel) from exc

    def sync_dir(self, rel: str) -> None:
        try:
            self._fsync_dir(self._abs(rel))
        except OSError as exc:
            raise self._error(exc, "directory fsync", rel) from exc


