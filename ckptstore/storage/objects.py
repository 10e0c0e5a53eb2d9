"""Object storage: every non-local fsspec file system (S3 and compatible servers, GCS, memory).

Object stores have no rename: a PUT of a whole object is atomic, so ``write_durably`` is a single PUT
and a directory is only a key prefix. The commit never depends on renaming a directory.
"""

from __future__ import annotations

import base64
import datetime
import errno
import hashlib
from typing import Any, BinaryIO, Callable, TypeVar

import fsspec

from ..errors import StorageError
from .base import Capabilities, ConditionFailed, Entry, Sink, Storage, StorageSpec, Upload
from .buffers import CHUNK
from .multipart import PART_BYTES, MultipartSink, abort_upload, list_uploads
from .retry import IoPolicy, IoStats, ShortBody, WireMismatch, client_errors, run

T = TypeVar("T")

#: fsspec protocols whose PUTs take If-None-Match / If-Match (s3fs passes them through).
CONDITIONAL_PROTOCOLS = frozenset({"s3", "s3a"})
#: fsspec protocols whose data lives inside one process: another process opening the URL sees nothing.
PROCESS_LOCAL_PROTOCOLS = frozenset({"memory"})


class ObjectReader:
    """``open_reader``'s file: ranged GETs of at most ``CHUNK`` bytes, each one call of
    :meth:`ObjectStorage.read_range` (its own tries and deadline), so a GET cut short or reset is read
    again from the same offset and only bytes that arrived whole are handed on: a transient read fault
    is never taken for damage (issue 24: botocore's ``FlexibleChecksumError`` escaped raw from ``load``
    and ``verify``). Once the tries are spent, a ``StorageError`` names the store, the cut and the file."""

    def __init__(self, storage: "ObjectStorage", rel: str) -> None:
        self._storage = storage
        self._rel = rel
        self.size = storage.size(rel)
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        out = []
        while self._pos < end:
            piece = self._storage.read_exact(self._rel, self._pos, min(end, self._pos + CHUNK))
            out.append(piece)
            self._pos += len(piece)
        return b"".join(out)

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        piece = self.read(min(len(view), CHUNK))
        view[:len(piece)] = piece
        return len(piece)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        return None

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
    directory, so ``write_durably`` is one PUT and ``sync_dir``/``make_dir`` are no-ops.

    Every call runs under ``io`` (:mod:`.retry`: a timeout per request, jittered retries, a deadline)
    and is counted in ``stats``. On S3, every PUT carries Content-MD5 and its answer's ETag is compared
    with what was sent (:meth:`check_etag`), and shards go up as multipart uploads this class runs
    itself (:mod:`.multipart`), so a part is retried alone and an upload is never left behind unseen."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str,
                 storage_options: dict[str, Any] | None = None, io: IoPolicy | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.io = io or IoPolicy()
        self.stats = IoStats()
        protocol = fs.protocol
        protocols = set(protocol if isinstance(protocol, (list, tuple)) else [protocol])
        self.s3 = bool(CONDITIONAL_PROTOCOLS & protocols) and hasattr(fs, "call_s3")
        self._async = bool(getattr(fs, "async_impl", False))
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

    def call(self, action: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` (a method of ``fs``) under the storage's I/O policy: each try cut off
        after its timeout (fsspec's ``sync(timeout=)`` cancels the request), retried while transient."""
        def attempt(timeout: float) -> T:
            return fn(*args, **self._timeout(timeout), **kwargs)

        return run(self.io, action, attempt, stats=self.stats)

    def _timeout(self, seconds: float) -> dict[str, float]:
        """The keyword that cuts one try off after ``seconds``: fsspec's ``sync(timeout=)``, which only
        async file systems' methods take."""
        return {"timeout": seconds} if self._async else {}

    def bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self._abs(rel))
        return bucket, key

    def md5_headers(self, md5: Any) -> dict[str, str]:
        """The Content-MD5 a real server checks the body against (S3 only; other file systems take none)."""
        return {"ContentMD5": base64.b64encode(md5.digest()).decode()} if self.s3 else {}

    def check_etag(self, answer: Any, want: str, rel: str, what: str = "object") -> None:
        """Raises :class:`WireMismatch` when the server's ETag for what it stored is not ``want`` (the
        MD5 hex of the bytes sent, or of a multipart upload's part MD5s): moto checks no Content-MD5."""
        if not (self.s3 and self.io.check_etag):
            return
        got = str((answer or {}).get("ETag", "")).strip('"')
        if got and got != want:
            raise WireMismatch(f"the server stored {what} {rel} as ETag {got}, not the MD5 of the bytes sent "
                               f"({want}): damaged in flight")

    def spec(self) -> StorageSpec | None:
        if not self.capabilities.other_processes:
            return None
        return StorageSpec(self.url, self.storage_options, self.io.to_json())

    def write_durably(self, rel: str, data: bytes) -> None:
        data = bytes(data)
        if self.s3 and len(data) > PART_BYTES:
            with self.open_sink(rel) as sink:  # a large manifest: in parts, each checked and retried
                sink.write(data)
            return
        md5 = hashlib.md5(data)

        def put(timeout: float) -> None:
            answer = self.fs.pipe_file(self._abs(rel), data, **self.md5_headers(md5), **self._timeout(timeout))
            self.check_etag(answer, md5.hexdigest(), rel)

        try:
            run(self.io, "put", put, stats=self.stats)
        except client_errors() as exc:
            raise self._error(exc, "put", rel) from exc

    # A conditional PUT whose first attempt landed but whose answer was lost (a reset, a read timeout)
    # is retried, and the retry fails its condition against our own write: the lease looked taken by
    # this very writer, and a commit looked lost while LATEST named it (issue 24). So a failed
    # condition re-reads the object: when its bytes are ours, byte for byte, the PUT landed. Callers'
    # documents are unique to the write (a lease carries a token and a time, LATEST its cut and
    # manifest digest), so equal bytes are this write, or one with the very outcome it asked for.
    # A body damaged in flight (its ETag is not our MD5) landed too: it is ours, so it is replaced,
    # on the condition that it is still that damaged version (``_repaired``).
    def put_if_absent(self, rel: str, data: bytes) -> str:
        if not self.capabilities.conditional_writes:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional writes")
        data = bytes(data)
        md5 = hashlib.md5(data)
        try:
            out = self.call("conditional put", self.fs.pipe_file, self._abs(rel), data, mode="create",
                            **self.md5_headers(md5))
        except FileExistsError:
            tag = self._tag_if_holds(rel, data)
            if tag is None:
                raise
            return tag
        except client_errors() as exc:
            raise self._error(exc, "conditional put", rel) from exc
        return self._repaired(rel, data, md5, out)

    def put_if_match(self, rel: str, data: bytes, tag: str) -> str:
        if not self.capabilities.conditional_writes:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional writes")
        data = bytes(data)
        md5 = hashlib.md5(data)
        try:
            out = self.call("conditional put", self.fs.pipe_file, self._abs(rel), data, IfMatch=tag,
                            **self.md5_headers(md5))
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
        return self._repaired(rel, data, md5, out)

    def _repaired(self, rel: str, data: bytes, md5: Any, out: Any, depth: int = 0) -> str:
        tag = str((out or {}).get("ETag", ""))
        try:
            self.check_etag(out, md5.hexdigest(), rel)
        except WireMismatch as exc:
            if depth + 1 >= self.io.attempts:
                raise self._error(exc, "conditional put", rel) from exc
            self.stats.retried("conditional put")
            try:  # the damaged version is ours: only it may be replaced
                again = self.call("conditional put", self.fs.pipe_file, self._abs(rel), data, IfMatch=tag,
                                  **self.md5_headers(md5))
            except client_errors() as err:
                raise self._error(err, "conditional put", rel) from err
            return self._repaired(rel, data, md5, again, depth + 1)
        return tag

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
            info = self.call("head", self.fs.info, self._abs(rel), refresh=True)
        except client_errors() as exc:
            raise self._error(exc, "head", rel) from exc
        modified = info.get("LastModified")
        age = 0.0
        if isinstance(modified, datetime.datetime):
            age = (datetime.datetime.now(datetime.timezone.utc) - modified).total_seconds()
        return str(info.get("ETag", "")), age

    def open_sink(self, rel: str) -> Sink:
        return MultipartSink(self, rel) if self.s3 else ObjectSink(self, rel)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.call("get", self.fs.cat_file, self._abs(rel))
        except client_errors() as exc:
            raise self._error(exc, "get", rel) from exc

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        try:
            return self.call("ranged get", self.fs.cat_file, self._abs(rel), start=start, end=end)
        except client_errors() as exc:
            raise self._error(exc, "ranged get", rel) from exc

    def read_exact(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of ``rel``, which holds them (its size said so): an answer with fewer was
        cut short in flight and is read again (:class:`ShortBody`), never handed on as the object's."""
        def get(timeout: float) -> bytes:
            got = self.fs.cat_file(self._abs(rel), start=start, end=end, **self._timeout(timeout))
            if len(got) != end - start:
                raise ShortBody(f"a ranged GET of {end - start} bytes at {start} answered {len(got)}")
            return got

        try:
            return run(self.io, "ranged get", get, stats=self.stats)
        except client_errors() as exc:
            raise self._error(exc, "ranged get", rel) from exc

    def open_reader(self, rel: str) -> BinaryIO:
        return ObjectReader(self, rel)  # type: ignore[return-value]

    def size(self, rel: str) -> int:
        try:
            return int(self.call("head", self.fs.size, self._abs(rel)))
        except client_errors() as exc:
            raise self._error(exc, "head", rel) from exc

    def exists(self, rel: str) -> bool:
        # fsspec's exists() answers False on any error; only "not found" may mean absent here.
        try:
            try:
                self.call("head", self.fs.info, self._abs(rel), refresh=True)
            except TypeError:  # file systems whose info() takes no refresh
                self.call("head", self.fs.info, self._abs(rel))
        except FileNotFoundError:
            return False
        except client_errors() as exc:
            raise self._error(exc, "head", rel) from exc
        return True

    def list_dir(self, rel: str) -> list[Entry]:
        base = self._abs(rel)

        def listing(timeout: float) -> Any:
            self.fs.invalidate_cache(base)
            return self.fs.ls(base, detail=True, **self._timeout(timeout))

        try:
            items = run(self.io, "listing", listing, stats=self.stats)
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
            self.call("delete", self.fs.rm_file, self._abs(rel))
        except FileNotFoundError:
            return
        except client_errors() as exc:
            raise self._error(exc, "delete", rel) from exc

    def remove_dir(self, rel: str) -> None:
        path = self._abs(rel)

        def remove(timeout: float) -> None:
            if self.fs.exists(path) and self.fs.isdir(path) and not self.fs.ls(path):
                self.fs.rmdir(path)

        try:
            run(self.io, "removing prefix", remove, stats=self.stats)
        except (FileNotFoundError, NotImplementedError):
            return
        except client_errors() as exc:
            raise self._error(exc, "removing prefix", rel) from exc

    def sync_dir(self, rel: str) -> None:
        return None

    def list_uploads(self, rel: str = "") -> list[Upload]:
        return list_uploads(self, rel) if self.s3 else []

    def abort_upload(self, upload: Upload) -> None:
        if self.s3:
            abort_upload(self, upload)
