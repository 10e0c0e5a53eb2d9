"""S3 multipart uploads run by ckptstore itself (issue 24), not by s3fs's file object.

s3fs's file retried nothing per part once its retries were ours, hid its upload id, and left the upload
behind when its CreateMultipartUpload answer was lost (the retry made a second one) or the process died:
``gc`` could neither see nor abort it. Here each part is one call under the store's I/O policy, carries
its Content-MD5, and is checked against the ETag the server answers; the whole object is checked against
the multipart ETag (the MD5 of the parts' MD5s, ``-N``) before anything names it; a failure aborts the
upload; and a CreateMultipartUpload that needed more than one try sweeps the other uploads of its key.
What a killed writer leaves, ``gc`` and a writer's recovery list and abort (``list_uploads``).
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any, Callable, Protocol

from ..errors import StorageError
from .base import Sink, Upload
from .retry import WireMismatch, client_errors


class ObjectStorage(Protocol):
    """What the sink uses of :class:`.objects.ObjectStorage` (a protocol, so the two modules do not
    import each other)."""

    fs: Any

    def call(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
    def bucket_key(self, rel: str) -> tuple[str, str]: ...
    def md5_headers(self, md5: Any) -> dict[str, str]: ...
    def check_etag(self, answer: Any, want: str, rel: str, what: str = "object") -> None: ...
    def write_durably(self, rel: str, data: bytes) -> None: ...
    def version(self, rel: str) -> tuple[str, float]: ...
    def delete(self, rel: str, *, durable: bool = True) -> None: ...
    def error(self, exc: OSError, action: str, rel: str) -> StorageError: ...

#: The size of every part but the last (S3 takes 5 MiB to 5 GiB, at most 10,000 parts): one request
#: under one timeout, so a part must fit the timeout on a slow link (16 MiB at 1 MiB/s is 16 s).
PART_BYTES = 16 << 20


class MultipartSink(Sink):
    """A shard on S3: an object of less than one part is a single checked PUT (``write_durably``); a
    larger one a multipart upload whose parts go up as they fill."""

    def __init__(self, storage: ObjectStorage, rel: str) -> None:
        self._storage = storage
        self._rel = rel
        self._bucket, self._key = storage.bucket_key(rel)
        self._buf = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._md5s: list[bytes] = []
        self._upload_id: str | None = None
        self._creates = 0

    def _s3(self, action: str, method: str, **kwargs: Any) -> dict[str, Any]:
        kwargs = {"Bucket": self._bucket, "Key": self._key, **kwargs}
        return self._storage.call(action, self._storage.fs.call_s3, method, kwargs)

    def write(self, data: memoryview | bytes) -> None:
        self._buf += data
        try:
            while len(self._buf) >= PART_BYTES:
                self._upload(bytes(memoryview(self._buf)[:PART_BYTES]))
                del self._buf[:PART_BYTES]
        except client_errors() as exc:
            self.abort()
            raise self._storage.error(exc, "uploading part of object", self._rel) from exc

    def _create(self) -> None:
        def create(**timeout: Any) -> dict[str, Any]:
            self._creates += 1  # a try whose answer was lost left an upload: swept at the end
            return self._storage.fs.call_s3("create_multipart_upload", {"Bucket": self._bucket, "Key": self._key},
                                            **timeout)

        self._upload_id = str(self._storage.call("creating multipart upload", create)["UploadId"])

    def _upload(self, data: bytes) -> None:
        if self._upload_id is None:
            self._create()
        n = len(self._parts) + 1
        md5 = hashlib.md5(data)

        def put(**timeout: Any) -> dict[str, Any]:
            out = self._storage.fs.call_s3("upload_part", {
                "Bucket": self._bucket, "Key": self._key, "UploadId": self._upload_id, "PartNumber": n,
                "Body": data, **self._storage.md5_headers(md5)}, **timeout)
            self._storage.check_etag(out, md5.hexdigest(), self._rel, f"part {n} of")
            return out

        out = self._storage.call("uploading part", put)
        self._parts.append({"PartNumber": n, "ETag": out["ETag"]})
        self._md5s.append(md5.digest())

    def close(self) -> None:
        try:
            if self._upload_id is None:
                self._storage.write_durably(self._rel, bytes(self._buf))  # less than one part: one PUT
                return
            if self._buf:
                self._upload(bytes(self._buf))
            self._complete()
        except client_errors() as exc:
            self.abort()
            raise self._storage.error(exc, "uploading object", self._rel) from exc
        finally:
            self._buf = bytearray()
            self._sweep()

    def _complete(self) -> None:
        want = f"{hashlib.md5(b''.join(self._md5s)).hexdigest()}-{len(self._parts)}"
        try:
            out = self._s3("completing multipart upload", "complete_multipart_upload", UploadId=self._upload_id,
                           MultipartUpload={"Parts": self._parts})
        except FileNotFoundError:
            # NoSuchUpload on a retry: the first try completed it and its answer was lost. Ours if the
            # object now is exactly these parts.
            tag, _ = self._storage.version(self._rel)
            out = {"ETag": tag}
        self._upload_id = None
        self._storage.check_etag(out, want, self._rel)

    def abort(self) -> None:
        # Never let a partial object be published (failure-modes row 58), nor an upload be left behind.
        if self._upload_id is not None:
            try:
                self._s3("aborting multipart upload", "abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - abort must not raise; gc lists what is left
                pass
            self._upload_id = None
        try:
            self._storage.delete(self._rel)
        except Exception:  # noqa: BLE001
            pass
        self._sweep()

    def _sweep(self) -> None:
        """Aborts the other uploads of this key when CreateMultipartUpload took more than one try: one
        whose answer was lost made an upload nobody knows the id of (only this writer writes this key)."""
        if self._creates < 2:
            return
        self._creates = 0
        try:
            for upload in list_uploads(self._storage, self._rel, exact=True):
                if upload.upload_id != self._upload_id:
                    abort_upload(self._storage, upload)
        except Exception:  # noqa: BLE001 - gc lists what is left
            pass


def list_uploads(storage: ObjectStorage, rel: str = "", *, exact: bool = False) -> list[Upload]:
    """Every multipart upload in progress under ``rel`` (or of the key ``rel`` itself, ``exact``)."""
    _, root_key = storage.bucket_key("")
    bucket, key = storage.bucket_key(rel)
    prefix = key if exact else (key.rstrip("/") + "/" if key else "")
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    now = datetime.datetime.now(datetime.timezone.utc)
    out = []
    while True:
        page = storage.call("listing multipart uploads", storage.fs.call_s3, "list_multipart_uploads", kwargs)
        for item in page.get("Uploads", []):
            if exact and item["Key"] != key:
                continue
            started = item.get("Initiated")
            age = (now - started).total_seconds() if isinstance(started, datetime.datetime) else 0.0
            name = item["Key"][len(root_key) + 1:] if root_key else item["Key"]
            out.append(Upload(name, str(item["UploadId"]), age))
        if not page.get("IsTruncated"):
            return out
        kwargs = {**kwargs, "KeyMarker": page.get("NextKeyMarker", ""),
                  "UploadIdMarker": page.get("NextUploadIdMarker", "")}


def abort_upload(storage: ObjectStorage, upload: Upload) -> None:
    bucket, key = storage.bucket_key(upload.rel)
    try:
        storage.call("aborting multipart upload", storage.fs.call_s3, "abort_multipart_upload",
                     {"Bucket": bucket, "Key": key, "UploadId": upload.upload_id})
    except FileNotFoundError:  # NoSuchUpload: aborted or completed already
        return
    except client_errors() as exc:
        raise storage.error(exc, "aborting multipart upload", upload.rel) from exc


__all__ = ["PART_BYTES", "MultipartSink", "WireMismatch", "abort_upload", "list_uploads"]
