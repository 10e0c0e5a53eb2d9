"""The storage seam: the handful of verbs the store reaches bytes through.

Callers use them in this order for one cut (see :mod:`ckptstore.protocol`)::

    write_durably(mark)                    # in-progress mark, before any shard
    make_dir(cut dir); open_sink(shard) -> write()... close()   # each shard, fsynced on close
    sync_dir(cut dir)                      # shard names durable before the manifest names them
    write_durably(manifest)                # the cut is complete (not yet committed)
    write_durably(LATEST)                  # the commit point: an atomic replace
    delete(mark)                           # durable removal (directory fsync)

and for reading: ``read_bytes``, ``open_reader`` (streaming ``readinto``), ``read_range``, ``list_dir``,
``size``, ``exists``; for pruning and gc: ``delete`` and ``remove_dir``.

Two backends, both chosen from a URL through fsspec:

* :class:`PosixStorage` for local paths. ``write_durably`` does all four steps that make a replace
  durable: write a sibling temp file, fsync it, rename it over the target, fsync the directory. None of
  DCP, Orbax or torchsnapshot does the last step; without it a power loss can undo the rename (or a
  mark's removal, failure-modes row 10). Shards are written with O_DIRECT from page-aligned buffers where
  the file system allows it: on this class of VM fresh page-cache pages are slow and noisy
  (research/limits.md), while O_DIRECT runs at the disk's speed.
* :class:`ObjectStorage` for every other fsspec file system (S3, GCS, memory). Object stores have no
  rename: a PUT of a whole object is atomic, so ``write_durably`` is a single PUT and a directory is only
  a key prefix. The commit never depends on renaming a directory.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import mmap
import os
import socket
import stat
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import fsspec

from . import layout
from .errors import StorageError

_ALIGN = 4096
_CHUNK = 8 << 20
_ZERO_COPY_MIN = 64 << 10  # below this, copying into the staging buffer is cheaper than an extra write


def buffer_address(view: memoryview) -> int | None:
    """The memory address of a writable buffer (None for read-only ones, e.g. bytes)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Entry:
    """One name in a directory listing."""

    name: str
    is_dir: bool
    size: int


def _cut_of(rel: str) -> str | None:
    parts = rel.split("/")
    if len(parts) >= 2 and parts[0] == layout.CUTS_DIR:
        return parts[1]
    if len(parts) == 2 and parts[0] in (layout.MARKS_DIR, layout.BAD_DIR):
        return layout.cut_id_of_mark(parts[1])
    return None


class Sink(ABC):
    """A shard file being written: ``write`` chunks, then ``close`` (durable) or ``abort``."""

    @abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Flushes and makes the file's data durable (fsync on POSIX)."""

    @abstractmethod
    def abort(self) -> None:
        """Drops the partial file; never raises."""


class Storage(ABC):
    """Byte-level access to one store root; paths are ``/``-separated and relative to the root."""

    url: str
    is_local: bool

    def _error(self, exc: OSError, action: str, rel: str) -> StorageError:
        return StorageError.from_os_error(exc, action, store=self.url, cut=_cut_of(rel), path=rel)

    @abstractmethod
    def write_durably(self, rel: str, data: bytes) -> None:
        """Creates or atomically replaces ``rel`` with ``data``, durable when it returns."""

    @abstractmethod
    def open_sink(self, rel: str) -> Sink:
        """Starts writing a new file at ``rel`` (an uncommitted cut's shard)."""

    @abstractmethod
    def read_bytes(self, rel: str) -> bytes: ...

    @abstractmethod
    def read_range(self, rel: str, start: int, end: int) -> bytes: ...

    @abstractmethod
    def open_reader(self, rel: str) -> BinaryIO:
        """A raw binary reader with ``readinto`` for streaming reads."""

    @abstractmethod
    def size(self, rel: str) -> int: ...

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def list_dir(self, rel: str) -> list[Entry]:
        """Entries of a directory; empty when it does not exist."""

    @abstractmethod
    def make_dir(self, rel: str) -> None:
        """Creates a directory (tolerating EEXIST, failure-modes row 51), durable when it returns."""

    @abstractmethod
    def delete(self, rel: str, *, durable: bool = True) -> None:
        """Removes a file; missing files are fine (a concurrent gc may have won). ``durable`` fsyncs the
        directory so the removal survives a power loss."""

    @abstractmethod
    def remove_dir(self, rel: str) -> None:
        """Removes an empty (or, on object stores, prefix-only) directory; missing is fine."""

    @abstractmethod
    def sync_dir(self, rel: str) -> None:
        """Makes the names in a directory durable (POSIX directory fsync; no-op on object stores)."""

    def local_path(self, rel: str) -> str | None:
        """The OS path of ``rel`` on local backends (for mmap hashing), else None."""
        return None

    # Conditional writes: what an object-store writer lease needs (``ckptstore.lock``). Backends that
    # cannot do them say so with ``conditional_writes = False`` and the verbs raise NotImplementedError.
    conditional_writes = False

    def put_if_absent(self, rel: str, data: bytes) -> str:
        """Creates ``rel`` only if it does not exist; returns its version tag (ETag). Raises
        :class:`FileExistsError` when it exists."""
        raise NotImplementedError

    def put_if_match(self, rel: str, data: bytes, tag: str) -> str:
        """Replaces ``rel`` only if its version tag is still ``tag``; returns the new tag. Raises
        :class:`ConditionFailed` when someone else wrote it in between (or it is gone)."""
        raise NotImplementedError

    def version(self, rel: str) -> tuple[str, float]:
        """The version tag of ``rel`` and its age in seconds by the storage's own clock of writes
        (now - last modified)."""
        raise NotImplementedError


class ConditionFailed(Exception):
    """A conditional write lost: the object changed (or vanished) since the tag was read."""


# --------------------------------------------------------------------------------------------------
# POSIX


class _AlignedBuffer:
    """A page-aligned anonymous mapping, reused for every chunk of every shard (first touch of fresh
    memory is slow on this VM class, so it is allocated once per storage and kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size)
        self.view = memoryview(self.map)


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
    Should the kernel refuse an aligned O_DIRECT write (EINVAL), the file drops O_DIRECT and carries on
    through the page cache: slower, never wrong."""

    def __init__(self, storage: "PosixStorage", rel: str) -> None:
        self._storage = storage
        self._rel = rel
        self._path = storage._abs(rel)
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
            raise storage._error(exc, "creating shard", rel) from exc
        self._bufs = [storage._buffer(), storage._buffer()] if self._direct else []
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
                buf.view[self._fill : self._fill + take] = mv[:take]
                self._fill += take
                mv = mv[take:]
                if self._fill == buf.size:
                    self._submit(self._fill)
        except OSError as exc:
            raise self._storage._error(exc, "writing shard", self._rel) from exc

    def _zero_copy_len(self, mv: memoryview) -> int:
        """How many leading bytes of ``mv`` can go to the disk from the caller's memory: a multiple of
        the alignment, when the file position (after the buffered bytes) and the address both are
        aligned; 0 when the piece must be copied."""
        if not self._direct or len(mv) < _ZERO_COPY_MIN or self._fill % _ALIGN:
            return 0
        address = buffer_address(mv)
        if address is None or address % _ALIGN:
            return 0
        return len(mv) - len(mv) % _ALIGN

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
                padded = -(-self._fill // _ALIGN) * _ALIGN
                self._bufs[self._cur].view[self._fill : padded] = bytes(padded - self._fill)
                self._submit(padded)
                self._wait_pending()
                os.ftruncate(self._fd, true_len)
                self._length = true_len
            self._wait_pending()
            os.fsync(self._fd)
        except OSError as exc:
            self.abort()
            raise self._storage._error(exc, "writing shard", self._rel) from exc
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
            self._storage._give_back(buf)
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


class PosixStorage(Storage):
    """Local directories, with every durability step done explicitly (see the module docstring)."""

    is_local = True

    def __init__(self, root: str, *, use_direct: bool = True, chunk_bytes: int = _CHUNK) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self.use_direct = use_direct
        self._chunk = chunk_bytes
        self._free: list[_AlignedBuffer] = []

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _buffer(self) -> _AlignedBuffer:
        return self._free.pop() if self._free else _AlignedBuffer(self._chunk)

    def _give_back(self, buf: _AlignedBuffer) -> None:
        self._free.append(buf)

    def local_path(self, rel: str) -> str:
        return self._abs(rel)

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

    def read_bytes(self, rel: str) -> bytes:
        try:
            with open(self._abs(rel), "rb") as f:
                return f.read()
        except OSError as exc:
            raise self._error(exc, "reading", rel) from exc

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        try:
            with open(self._abs(rel), "rb", buffering=0) as f:
                return os.pread(f.fileno(), end - start, start)
        except OSError as exc:
            raise self._error(exc, "reading", rel) from exc

    def open_reader(self, rel: str) -> BinaryIO:
        try:
            return open(self._abs(rel), "rb", buffering=0)  # type: ignore[return-value]
        except OSError as exc:
            raise self._error(exc, "opening", rel) from exc

    def size(self, rel: str) -> int:
        try:
            return os.stat(self._abs(rel)).st_size
        except OSError as exc:
            raise self._error(exc, "stat", rel) from exc

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self._abs(rel))

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


# --------------------------------------------------------------------------------------------------
# Object stores


class ObjectSink(Sink):
    def __init__(self, storage: "ObjectStorage", rel: str) -> None:
        self._storage = storage
        self._rel = rel
        try:
            self._f = storage.fs.open(storage._abs(rel), "wb")
        except OSError as exc:
            raise storage._error(exc, "creating object", rel) from exc

    def write(self, data: memoryview | bytes) -> None:
        try:
            self._f.write(bytes(data) if not isinstance(data, bytes) else data)
        except OSError as exc:
            raise self._storage._error(exc, "writing object", self._rel) from exc

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as exc:
            self.abort()
            raise self._storage._error(exc, "uploading object", self._rel) from exc

    def abort(self) -> None:
        # Never let close() publish a partial object (failure-modes row 58): discard the upload.
        try:
            discard = getattr(self._f, "discard", None)
            if discard is not None:
                discard()
        except Exception:  # noqa: BLE001 - abort must not raise
            pass
        try:
            self._storage.fs.rm_file(self._storage._abs(self._rel))
        except Exception:  # noqa: BLE001
            pass


class ObjectStorage(Storage):
    """Any non-local fsspec file system. A PUT is atomic per object; there is no rename and no
    directory, so ``write_durably`` is one PUT and ``sync_dir``/``make_dir`` are no-ops."""

    is_local = False

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _abs(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    @property
    def conditional_writes(self) -> bool:  # type: ignore[override]
        """S3 and S3-compatible servers take If-None-Match / If-Match on PUT (s3fs passes them)."""
        protocol = self.fs.protocol
        return bool({"s3", "s3a"} & set(protocol if isinstance(protocol, (list, tuple)) else [protocol]))

    def write_durably(self, rel: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._abs(rel), bytes(data))
        except OSError as exc:
            raise self._error(exc, "put", rel) from exc

    def put_if_absent(self, rel: str, data: bytes) -> str:
        if not self.conditional_writes:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional writes")
        try:
            out = self.fs.pipe_file(self._abs(rel), bytes(data), mode="create")
        except FileExistsError:
            raise
        except OSError as exc:
            raise self._error(exc, "conditional put", rel) from exc
        return str((out or {}).get("ETag", ""))

    def put_if_match(self, rel: str, data: bytes, tag: str) -> str:
        if not self.conditional_writes:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional writes")
        try:
            out = self.fs.pipe_file(self._abs(rel), bytes(data), IfMatch=tag)
        except (FileNotFoundError, FileExistsError) as exc:
            raise ConditionFailed(str(exc)) from exc
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # s3fs maps 412 PreconditionFailed to EINVAL
                raise ConditionFailed(str(exc)) from exc
            raise self._error(exc, "conditional put", rel) from exc
        return str((out or {}).get("ETag", ""))

    def version(self, rel: str) -> tuple[str, float]:
        try:
            info = self.fs.info(self._abs(rel), refresh=True)
        except OSError as exc:
            raise self._error(exc, "head", rel) from exc
        modified = info.get("LastModified")
        age = 0.0
        if isinstance(modified, datetime.datetime):
            age = (datetime.datetime.now(datetime.timezone.utc) - modified).total_seconds()
        return str(info.get("ETag", "")), age

    def open_sink(self, rel: str) -> Sink:
        return ObjectSink(self, rel)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self._abs(rel))
        except OSError as exc:
            raise self._error(exc, "get", rel) from exc

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self._abs(rel), start=start, end=end)
        except OSError as exc:
            raise self._error(exc, "ranged get", rel) from exc

    def open_reader(self, rel: str) -> BinaryIO:
        try:
            return self.fs.open(self._abs(rel), "rb", block_size=_CHUNK)
        except OSError as exc:
            raise self._error(exc, "opening object", rel) from exc

    def size(self, rel: str) -> int:
        try:
            return int(self.fs.size(self._abs(rel)))
        except OSError as exc:
            raise self._error(exc, "head", rel) from exc

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._abs(rel)))

    def list_dir(self, rel: str) -> list[Entry]:
        base = self._abs(rel)
        try:
            self.fs.invalidate_cache(base)
            items = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error(exc, "listing", rel) from exc
        out = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if not name or item["name"].rstrip("/") == base:
                continue
            out.append(Entry(name, item.get("type") == "directory", int(item.get("size") or 0)))
        return sorted(out, key=lambda e: e.name)

    def make_dir(self, rel: str) -> None:
        return None

    def delete(self, rel: str, *, durable: bool = True) -> None:
        try:
            self.fs.rm_file(self._abs(rel))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error(exc, "delete", rel) from exc

    def remove_dir(self, rel: str) -> None:
        try:
            if self.fs.exists(self._abs(rel)) and self.fs.isdir(self._abs(rel)):
                left = self.fs.ls(self._abs(rel))
                if not left:
                    self.fs.rmdir(self._abs(rel))
        except (FileNotFoundError, NotImplementedError):
            return
        except OSError as exc:
            raise self._error(exc, "removing prefix", rel) from exc

    def sync_dir(self, rel: str) -> None:
        return None


def open_storage(url: str, *, storage_options: dict | None = None) -> Storage:
    """The backend for ``url``: a plain path or ``file://`` gives POSIX, any other fsspec URL an object
    store."""
    if "://" not in url:
        return PosixStorage(url)
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return PosixStorage(root)
    return ObjectStorage(fs, root, url)


def host_identity() -> dict[str, object]:
    """Who this process is, for marks and the writer lock."""
    return {"host": socket.gethostname(), "pid": os.getpid()}
