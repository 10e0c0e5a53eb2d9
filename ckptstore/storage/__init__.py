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

import os
from typing import Any, Callable

import fsspec

from ..errors import UsageError
from .base import Capabilities, ConditionFailed, Entry, MappedFile, Sink, Storage, StorageSpec
from .objects import ObjectStorage
from .posix import PosixStorage
from .sink import PosixSink, buffer_address

#: protocol -> factory(url, storage_options) for backends other than fsspec's default route.
BackendFactory = Callable[[str, dict[str, Any]], Storage]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(protocol: str, factory: BackendFactory) -> None:
    """Makes ``open_storage`` build ``protocol://`` URLs with ``factory`` (the last registration wins)."""
    _REGISTRY[protocol] = factory


def _posix(url: str, storage_options: dict[str, Any]) -> Storage:
    _, root = fsspec.core.url_to_fs(url)
    return PosixStorage(root)


def _fsspec_objects(url: str, storage_options: dict[str, Any]) -> Storage:
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return PosixStorage(root)
    return ObjectStorage(fs, root, url, storage_options)


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


def open_storage(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Storage:
    """The backend for ``url``: a plain path or ``file://`` gives POSIX storage, a registered protocol
    its backend, any other fsspec URL an object store."""
    url = store_url(url)
    if "://" not in url:
        return PosixStorage(url)
    protocol = url.split("://", 1)[0]
    factory = _REGISTRY.get(protocol, _fsspec_objects)
    return factory(url, dict(storage_options or {}))


def open_spec(spec: StorageSpec) -> Storage:
    """The storage a :class:`StorageSpec` describes (the writer process opens its store this way)."""
    return open_storage(spec.url, storage_options=spec.storage_options)


__all__ = [
    "Capabilities", "ConditionFailed", "Entry", "MappedFile", "Sink", "Storage", "StorageSpec", "ObjectStorage",
    "PosixStorage", "PosixSink", "buffer_address", "open_storage", "open_spec", "register_backend", "store_url",
]
