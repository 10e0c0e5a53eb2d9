"""Object storage: every non-local fsspec file system (S3 and compatible servers, GCS, memory).

Object stores have no rename: a PUT of a whole object is atomic, so ``write_durably`` is a single PUT
and a directory is only a key prefix. The commit never depends on renaming a directory.
"""

from __future__ import annotations

import datetime
import errno
import sys
from typing import Any, BinaryIO, Callable

import fsspec

from ..errors import StorageError
from .base import Capabilities, ConditionFailed, Entry, Sink, Storage, StorageSpec
from .buffers import CHUNK

#: fsspec protocols whose PUTs take If-None-Match / If-Match (s3fs passes them through).
CONDITIONAL_PROTOCOLS = frozenset({"s3", "s3a"})
#: fsspec protocols whose data lives inside one process: another process opening the URL sees nothing.
PROCESS_LOCAL_PROTOCOLS = frozenset({"memory"})


def client_errors() -> tuple[type[BaseException], ...]:
    """What an object-store call raises when the store could not be reached or answered badly: OSError,
    and botocore's own errors where s3fs runs. Once botocore's retries and s3fs's are spent, a connection
    closed, reset or timed out comes out of s3fs as a raw botocore exception, not an OSError: a LATEST
    PUT that landed unseen then escaped as neither a StorageError nor CommitUnknown, and the save
    abandoned the cut LATEST named (issue 24). Looked up, never imported: no botocore, no such errors."""
    module = sys.modules.get("botocore.exceptions")
    return (OSError,) if module is None else (OSError, module.BotoCoreError)


#: How often a read that failed in flight (a body cut short, a reset) is tried again from where it was.
READ_ATTEMPTS = 3


class ObjectReader:
    """``open_reader``'s file: a read whose response failed in flight (a GET cut short, so the client's
    checksum fails; a connection reset) is read again from the same offset on a fresh request, up to
    ``READ_ATTEMPTS`` times, then raised as a ``StorageError`` naming the store, the cut and the file.
    Only bytes that arrived whole are ever handed on, so a transient read fault is never taken for
    damage (issue 24: botocore's ``FlexibleChecksumError`` escaped raw from ``load`` and ``verify``)."""

    def __init__(self, storage: "ObjectStorage", rel: str) -> None:
        self._storage = storage
        self._rel = rel
        self._f = self._open()
        self.size = self._f.size
        self._pos = 0

    def _open(self) -> Any:
        try:
            return self._storage.fs.open(self._storage._abs(self._rel), "rb", block_size=CHUNK)
        except client_errors() as exc:
            raise self._storage.error(exc, "opening object", self._rel) from exc

    def _again(self, step: Callable[[], Any], length: Callable[[Any], int]) -> Any:
        """``step`` (one read), tried again from the same offset on a fresh file when it fails in flight."""
        last: BaseException | None = None
        for _ in range(READ_ATTEMPTS):
            try:
                got = step()
            except client_errors() as exc:
                last = exc
                self._f.close()
                self._f = self._open()  # the old file's buffer may hold what was cut short
                self._f.seek(self._pos)
                continue
            self._pos += length(got)
            return got
        assert last is not None
        raise self._storage.error(last, "reading object", self._rel) from last  # type: ignore[arg-type]

    def read(self, n: int = -1) -> bytes:
        return self._again(lambda: self._f.read(n), len)

    def readinto(self, buf: Any) -> int:
        # Straight into the caller's buffer (no copy of every shard byte through a bytes object).
        return self._again(lambda: self._f.readinto(buf) or 0, int)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._f.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ObjectReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectSink(Sink):
    def __init__(self, storage: "ObjectStorage", rel: str) -> None:
        self._storage = storage
        self._rel = rel
        try:
            self._f = storage.fs.open(storage._abs(rel), "wb")
        except client_errors() as exc:
            raise storage.error(exc, "creating object", rel) from exc

    def write(self, data: memoryview | bytes) -> None:
        try:
            self._f.write(bytes(data) if not isinstance(data, bytes) else data)
        except client_errors() as exc:
            raise self._storage.error(exc, "writing object", self._rel) from exc

    def close(self) -> None:
        try:
            self._f.close()
        except client_errors() as exc:
            self.abort()
            raise self._storage.error(exc, "uploading object", self._rel) from exc

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

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.storage_options = dict(storage_options or {})
        protocol = fs.protocol
        protocols = set(protocol if isinstance(protocol, (list, tuple)) else [protocol])
        self.capabilities = Capabilities(
            conditional_writes=bool(CONDITIONAL_PROTOCOLS & protocols),
            other_processes=not (PROCESS_LOCAL_PROTOCOLS & protocols),
        )

    def _error(self, exc: BaseException, action: str, rel: str) -> StorageError:
        if not isinstance(exc, OSError):  # a botocore error (client_errors): an I/O error of the store
            exc = OSError(errno.EIO, f"{type(exc).__name__}: {exc}")
        return super()._error(exc, action, rel)

    def _abs(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def spec(self) -> StorageSpec | None:
        if not self.capabilities.other_processes:
            return None
        return StorageSpec(self.url, self.storage_options)

    def write_durably(self, rel: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._abs(rel), bytes(data))
        except client_errors() as exc:
            raise self._error(exc, "put", rel) from exc

    # A conditional PUT whose first attempt landed but whose answer was lost (a reset, a read timeout)
    # is retried by botocore and s3fs, and the retry fails its condition against our own write: the
    # lease looked taken by this very writer, and a commit looked lost while LATEST named it (issue 24).
    # So a failed condition re-reads the object: when its bytes are ours, byte for byte, the PUT landed.
    # Callers' documents are unique to the write (a lease carries a token and a time, LATEST its cut and
    # manifest digest), so equal bytes are this write, or one with the very outcome it asked for.
    def put_if_absent(self, rel: str, data: bytes) -> str:
        if not self.capabilities.conditional_writes:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional writes")
        data = bytes(data)
        try:
            out = self.fs.pipe_file(self._abs(rel), data, mode="create")
        except FileExistsError:
            tag = self._tag_if_holds(rel, data)
            if tag is None:
                raise
            return tag
        except client_errors() as exc:
            raise self._error(exc, "conditional put", rel) from exc
        return str((out or {}).get("ETag", ""))

    def put_if_match(self, rel: str, data: bytes, tag: str) -> str:
        if not self.capabilities.conditional_writes:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional writes")
        data = bytes(data)
        try:
            out = self.fs.pipe_file(self._abs(rel), data, IfMatch=tag)
        except (FileNotFoundError, FileExistsError) as exc:
            raise ConditionFailed(str(exc)) from exc
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # s3fs maps 412 PreconditionFailed to EINVAL
                raise self._error(exc, "conditional put", rel) from exc
            ours = self._tag_if_holds(rel, data)
            if ours is None:
                raise ConditionFailed(str(exc)) from exc
            return ours
        except client_errors() as exc:
            raise self._error(exc, "conditional put", rel) from exc
        return str((out or {}).get("ETag", ""))

    def _tag_if_holds(self, rel: str, data: bytes) -> str | None:
        """The version tag of ``rel`` when it holds exactly ``data`` now, else None (also when it is
        gone). The tag is read first: nobody writes these bytes after the PUT that failed its condition,
        so if they are still there when read, the tag read before them is theirs. An I/O error raises
        (``StorageError``): "could not look" is not "someone else's"."""
        try:
            tag, _ = self.version(rel)
            held = self.read_bytes(rel)
        except StorageError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        return tag if held == data else None

    def version(self, rel: str) -> tuple[str, float]:
        try:
            info = self.fs.info(self._abs(rel), refresh=True)
        except client_errors() as exc:
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
        except client_errors() as exc:
            raise self._error(exc, "get", rel) from exc

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self._abs(rel), start=start, end=end)
        except client_errors() as exc:
            raise self._error(exc, "ranged get", rel) from exc

    def open_reader(self, rel: str) -> BinaryIO:
        return ObjectReader(self, rel)  # type: ignore[return-value]

    def size(self, rel: str) -> int:
        try:
            return int(self.fs.size(self._abs(rel)))
        except client_errors() as exc:
            raise self._error(exc, "head", rel) from exc

    def exists(self, rel: str) -> bool:
        # fsspec's exists() answers False on any error; only "not found" may mean absent here.
        try:
            self.fs.info(self._abs(rel), refresh=True)
        except FileNotFoundError:
            return False
        except TypeError:  # file systems whose info() takes no refresh
            try:
                self.fs.info(self._abs(rel))
            except FileNotFoundError:
                return False
            except client_errors() as exc:
                raise self._error(exc, "head", rel) from exc
        except client_errors() as exc:
            raise self._error(exc, "head", rel) from exc
        return True

    def list_dir(self, rel: str) -> list[Entry]:
        base = self._abs(rel)
        try:
            self.fs.invalidate_cache(base)
            items = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        except client_errors() as exc:
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
        except client_errors() as exc:
            raise self._error(exc, "delete", rel) from exc

    def remove_dir(self, rel: str) -> None:
        try:
            if self.fs.exists(self._abs(rel)) and self.fs.isdir(self._abs(rel)):
                left = self.fs.ls(self._abs(rel))
                if not left:
                    self.fs.rmdir(self._abs(rel))
        except (FileNotFoundError, NotImplementedError):
            return
        except client_errors() as exc:
            raise self._error(exc, "removing prefix", rel) from exc

    def sync_dir(self, rel: str) -> None:
        return None


