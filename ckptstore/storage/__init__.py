"""The storage seam: backends the store reaches bytes through, chosen from a URL by a registry.

* :mod:`.base`: the interface (:class:`Storage`, :class:`Sink`, :class:`Entry`, :class:`MappedFile`),
  what a backend can do (:class:`Capabilities`) and how another process reaches it (:class:`StorageSpec`).
* :mod:`.posix`: local directories (temp file, fsync, rename, directory fsync); :mod:`.sink` its
  O_DIRECT shard sink, which fills page-aligned buffers of :mod:`.buffers`.
* :mod:`.objects`: every other fsspec file system (S3, GCS, memory): one PUT per object, no rename.

``open_storage(url)`` looks the URL's protocol up in the registry (``register_backend``); a plain path
or ``file://`` gives POSIX storage, any protocol nobody registered goes to fsspec as an object store.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import fsspec

from ..errors import UsageError
from .base import Capabilities, ConditionFailed, Entry, MappedFile, Sink, Storage, StorageSpec, Upload
from .objects import CONDITIONAL_PROTOCOLS, ObjectStorage
from .retry import IoPolicy, IoStats, client_options
from .posix import PosixStorage
from .sink import PosixSink, buffer_address

#: protocol -> factory(url, storage_options) for backends other than fsspec's default route. A factory
#: that also takes ``io`` (keyword) gets the store's I/O policy (:class:`.retry.IoPolicy`, issue 24).
BackendFactory = Callable[..., Storage]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(protocol: str, factory: BackendFactory) -> None:
    """Makes ``open_storage`` build ``protocol://`` URLs with ``factory`` (the last registration wins)."""
    _REGISTRY[protocol] = factory


def _posix(url: str, storage_options: dict[str, Any], io: IoPolicy | None = None) -> Storage:
    _, root = fsspec.core.url_to_fs(url)
    return PosixStorage(root)


def _fsspec_objects(url: str, storage_options: dict[str, Any], io: IoPolicy | None = None) -> Storage:
    io = io or IoPolicy()
    protocol = url.split("://", 1)[0]
    # On S3, botocore's own retries are off and its timeouts are the policy's: ObjectStorage retries
    # (issue 24: s3fs's five retries of botocore's five stacked to about six minutes per call).
    opts = client_options(storage_options, io) if protocol in CONDITIONAL_PROTOCOLS else storage_options
    fs, root = fsspec.core.url_to_fs(url, **opts)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return PosixStorage(root)
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop: one try, so ours is the only one
    return ObjectStorage(fs, root, url, storage_options, io)


register_backend("file", _posix)
register_backend("local", _posix)


def store_url(url: str | os.PathLike[str]) -> str:
    """The text of a store URL: a str as it is, an ``os.PathLike`` (``pathlib.Path``) through
    ``os.fspath``. Every public API that takes a URL goes through here (``Store.open``, which ``load``,
    ``restore``, the Checkpointer and the integrations open through, and :func:`open_storage`), so a
    Path works everywhere (issue 19 item 11) and anything else is a ``UsageError`` naming it, not a
    TypeError from deep inside."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if not isinstance(text, str):
        raise UsageError(f"a store URL is a str or os.PathLike of str (a path or an fsspec URL), not "
                         f"{type(url).__name__} {url!r:.80}")
    return text


def open_storage(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                 io: IoPolicy | None = None) -> Storage:
    """The backend for ``url``: a plain path or ``file://`` gives POSIX storage, a registered protocol
    its backend, any other fsspec URL an object store, whose calls run under ``io`` (default
    :class:`IoPolicy()`)."""
    url = store_url(url)
    if "://" not in url:
        return PosixStorage(url)
    protocol = url.split("://", 1)[0]
    factory = _REGISTRY.get(protocol)
    if factory is None:
        return _fsspec_objects(url, dict(storage_options or {}), io)
    if io is not None and "io" in inspect.signature(factory).parameters:
        return factory(url, dict(storage_options or {}), io=io)
    return factory(url, dict(storage_options or {}))


def open_spec(spec: StorageSpec) -> Storage:
    """The storage a :class:`StorageSpec` describes (the writer process opens its store this way)."""
    return open_storage(spec.url, storage_options=spec.storage_options,
                        io=IoPolicy.from_json(spec.io) if spec.io is not None else None)


__all__ = [
    "Capabilities", "ConditionFailed", "Entry", "IoPolicy", "IoStats", "MappedFile", "Sink", "Storage", "StorageSpec",
    "ObjectStorage", "Upload",
    "PosixStorage", "PosixSink", "buffer_address", "open_storage", "open_spec", "register_backend", "store_url",
]
