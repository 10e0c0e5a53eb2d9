"""The storage interface: the handful of verbs the store reaches bytes through, and what a backend can do.

Callers use them in this order for one cut (see :mod:`ckptstore.protocol`)::

    write_durably(mark)                    # in-progress mark, before any shard
    make_dir(cut dir); open_sink(shard) -> write()... close()   # each shard, durable on close
    sync_dir(cut dir)                      # shard names durable before the manifest names them
    write_durably(manifest)                # the cut is complete (not yet committed)
    replace_latest(LATEST)                 # the commit point: an atomic replace (compare-and-swap
                                           # where the backend has conditional writes)
    delete(mark)                           # durable removal (directory fsync)

and for reading: ``read_bytes``, ``open_reader`` (streaming ``readinto``), ``read_range``, ``list_dir``,
``size``, ``exists``, ``map_file`` (local backends: a shard mapped for hashing); for pruning and gc:
``delete`` and ``remove_dir``. The store opens no file past these verbs (issue 20).

A backend states what it can do once, in :class:`Capabilities`; callers branch on those flags, never on
a backend's class.
"""

from __future__ import annotations

import json
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .. import layout
from ..errors import StorageError, UsageError


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do.

    ``local_paths``: files have OS paths (mmap hashing, flock, ``os.makedirs``). ``conditional_writes``:
    PUT with If-None-Match / If-Match (the writer lease and the compare-and-swap of LATEST). ``other_processes``: another process can reach the same bytes from
    :meth:`Storage.spec` (false for fsspec's in-memory file system, whose data lives in one process).
    """

    local_paths: bool = False
    conditional_writes: bool = False
    other_processes: bool = True


@dataclass(frozen=True)
class StorageSpec:
    """Everything another process needs to reach the same storage: the URL, the fsspec
    ``storage_options`` (endpoint, credentials) and, for object stores, the I/O policy's fields
    (``io``: timeouts, retries, deadline; issue 24). Travels as JSON, never on a command line."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    io: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options, "io": self.io}

    def check_json(self) -> None:
        """Raises UsageError when the options cannot travel as JSON (a live object in them)."""
        try:
            json.dumps(self.storage_options)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"storage_options cannot be sent to the writer process as JSON: {exc}",
                             store=self.url, hint='use mode="thread", or plain JSON values in storage_options') from None


@dataclass(frozen=True)
class Entry:
    """One name in a directory listing."""

    name: str
    is_dir: bool
    size: int


@dataclass(frozen=True)
class Upload:
    """A multipart upload an object store holds open under the store (``Storage.list_uploads``): its
    object's path, the server's id for it, and its age in seconds by the server's clock."""

    rel: str
    upload_id: str
    age_s: float = 0.0


def cut_of(rel: str) -> str | None:
    """The cut a store-relative path belongs to, for error context."""
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


class MappedFile:
    """A whole file mapped read-only (:meth:`Storage.map_file`): ``view`` its bytes, ``size`` its length
    when it was opened. Slices taken of ``view`` must be released before ``close`` (a mapping refuses
    to close while a view of it is exported). A read error of the disk under a mapping is a SIGBUS,
    not an exception: map only where the bytes are read once, to hash them."""

    def __init__(self, mapping: mmap.mmap | None, size: int) -> None:
        self._map = mapping
        self.size = size
        self.view = memoryview(mapping) if mapping is not None else memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            self._map.close()

    def __enter__(self) -> "MappedFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ConditionFailed(Exception):
    """A conditional write lost: the object changed (or vanished) since the tag was read."""


class Storage(ABC):
    """Byte-level access to one store root; paths are ``/``-separated and relative to the root."""

    url: str
    capabilities: Capabilities = Capabilities()

    def _error(self, exc: OSError, action: str, rel: str) -> StorageError:
        return StorageError.from_os_error(exc, action, store=self.url, cut=cut_of(rel), path=rel)

    def error(self, exc: OSError, action: str, rel: str) -> StorageError:
        """The ``StorageError`` for ``exc`` naming this store, the cut and the file: what a sink of this
        storage raises (the public spelling of ``_error``, for sinks in other modules; issue 20)."""
        return self._error(exc, action, rel)

    def spec(self) -> StorageSpec | None:
        """How another process reaches this storage, or None when it cannot."""
        return None

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
        """A binary reader with ``readinto`` for streaming reads, buffered where each small read would
        cost a system call. Where the open itself tells the file's length (``fstat`` on POSIX, the
        HEAD of an fsspec file), the reader carries it as an int ``size``; callers ask ``size(rel)``
        otherwise."""

    @abstractmethod
    def size(self, rel: str) -> int: ...

    @abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists. An I/O error raises: "cannot tell" is never "absent"."""

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
        """The OS path of ``rel`` where ``capabilities.local_paths``, else None."""
        return None

    def map_file(self, rel: str) -> MappedFile:
        """The regular file ``rel`` mapped read-only, where ``capabilities.local_paths`` (verify hashes
        each array's byte range of it on every core). Raises as ``open_reader`` does (a name that is
        not a regular file is ``NotAFile``). Backends without local files raise NotImplementedError:
        stream the file through ``open_reader`` instead."""
        raise NotImplementedError(f"{type(self).__name__} cannot map files; read them with open_reader")

    # Conditional writes (``capabilities.conditional_writes``): the writer lease (``ckptstore.lock``)
    # and the compare-and-swap of LATEST. Backends without them raise NotImplementedError.
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

    # Uploads the server holds open (S3 multipart): ``gc`` and recovery list them and abort those no
    # live writer is running (issue 24). Storages without them have none.
    def list_uploads(self, rel: str = "") -> list[Upload]:
        """The multipart uploads in progress under ``rel`` (every one, however many pages)."""
        return []

    def abort_upload(self, upload: Upload) -> None:
        """Aborts ``upload``, freeing its parts; one already gone is not an error."""
        return None
