"""DCP's ``Metadata`` to and from the typed JSON a DCP cut keeps in its manifest's
``metadata["ckptstore.dcp"]`` (docs/dcp.md has the format): nothing is pickled by ckptstore. Also the
names both sides share: where an item's bytes are (:class:`ArrayLocation`) and an item's array name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.errors import CorruptCut, UsageError

from .checks import METADATA_KEY

#: The version of that JSON document.
METADATA_FORMAT_VERSION = 1
#: The DCP metadata version written (FileSystemWriter's ``CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"

_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


@dataclass(frozen=True)
class ArrayLocation:
    """``WriteResult.storage_data`` (and ``Metadata.storage_data`` values): where an item's bytes are."""

    rank: int
    array: str


def array_name(index: MetadataIndex, byte_io: bool) -> str:
    """The array name of a DCP item: its fqn, "@", then the chunk offset ("0,128") or "bytes". The part
    after the last "@" never holds one, so names are unique whatever the fqns."""
    if byte_io:
        return f"{index.fqn}@bytes"
    return f"{index.fqn}@{','.join(str(int(o)) for o in (index.offset or ()))}"


# ------------------------------------------------------------------------------------ to JSON
def _enum_name(v: Any) -> str:
    return str(v).removeprefix("torch.")


def _entry_to_json(fqn: str, smd: Any) -> dict[str, Any]:
    if isinstance(smd, BytesStorageMetadata):
        return {"fqn": fqn, "kind": "bytes"}
    if not isinstance(smd, TensorStorageMetadata):
        raise UsageError(f"DCP item {fqn!r}: unknown storage metadata {type(smd).__name__}")
    p = smd.properties
    mf = next((n for n, f in _MEMORY_FORMATS.items() if f == p.memory_format), None)
    if mf is None:
        raise UsageError(f"DCP item {fqn!r}: memory format {p.memory_format} cannot be stored")
    return {
        "fqn": fqn, "kind": "tensor", "dtype": _enum_name(p.dtype), "layout": _enum_name(p.layout),
        "requires_grad": bool(p.requires_grad), "memory_format": mf, "pin_memory": bool(p.pin_memory),
        "size": [int(s) for s in smd.size],
        "chunks": [{"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]} for c in smd.chunks],
    }


def _planner_to_json(planner_data: Any) -> list[dict[str, Any]] | None:
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict):
        raise UsageError(f"DCP planner_data of type {type(planner_data).__name__} cannot be stored "
                         "without pickle (use the default planners)")
    planner = []
    for fqn, path in planner_data.items():
        if not isinstance(fqn, str) or not isinstance(path, (tuple, list)) or not all(
                isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            raise UsageError(f"DCP planner_data entry {fqn!r}: {path!r} is not a key path of str and int")
        planner.append({"fqn": fqn, "path": list(path)})
    return planner


def _storage_to_json(storage_data: Any) -> list[dict[str, Any]]:
    storage: list[dict[str, Any]] = []
    for index, loc in (storage_data or {}).items():
        if not isinstance(loc, ArrayLocation):
            raise UsageError(f"DCP storage_data for {index} is not a ckptstore location")
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else [int(o) for o in index.offset],
                        "index": index.index, "rank": loc.rank, "array": loc.array})
    return storage


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    """DCP ``Metadata`` as typed JSON (docs/dcp.md). ``storage_data`` must map ``MetadataIndex`` to
    :class:`ArrayLocation`; ``planner_data`` may be None or the default planner's fqn -> key path."""
    entries = [_entry_to_json(fqn, smd) for fqn, smd in md.state_dict_metadata.items()]
    planner = _planner_to_json(md.planner_data)
    storage = _storage_to_json(md.storage_data)
    sm = md.storage_meta
    return {
        "format_version": METADATA_FORMAT_VERSION,
        "version": md.version,
        "state_dict_metadata": entries,
        "planner_data": planner,
        "storage_data": storage,
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id, "modules": list(sm.modules)},
    }


# ---------------------------------------------------------------------------------- from JSON
def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{what} must be a list of non-negative ints, got {v!r}")
    return v


def _of(v: Any, typ: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(v, typ) or isinstance(v, bool) and typ is int:
        raise ValueError(f"{what} has the wrong type: {v!r}")
    return v


def _tensor_from_json(fqn: str, e: dict[str, Any]) -> TensorStorageMetadata:
    dtype = getattr(torch, _of(e["dtype"], str, "dtype"), None)
    layout = getattr(torch, _of(e["layout"], str, "layout"), None)
    if not isinstance(dtype, torch.dtype) or not isinstance(layout, torch.layout):
        raise ValueError(f"{fqn!r}: unknown dtype or layout {e['dtype']!r}, {e['layout']!r}")
    if e["memory_format"] not in _MEMORY_FORMATS:
        raise ValueError(f"{fqn!r}: unknown memory format {e['memory_format']!r}")
    props = TensorProperties(dtype=dtype, layout=layout, requires_grad=_of(e["requires_grad"], bool, "requires_grad"),
                             memory_format=_MEMORY_FORMATS[e["memory_format"]],
                             pin_memory=_of(e["pin_memory"], bool, "pin_memory"))
    chunks = [ChunkStorageMetadata(offsets=torch.Size(_ints(c["offsets"], "offsets")),
                                   sizes=torch.Size(_ints(c["sizes"], "sizes")))
              for c in _of(e["chunks"], list, "chunks")]
    return TensorStorageMetadata(properties=props, size=torch.Size(_ints(e["size"], "size")), chunks=chunks)


def _entries_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    sdm: dict[str, Any] = {}
    for e in _of(doc["state_dict_metadata"], list, "state_dict_metadata"):
        fqn = _of(e["fqn"], str, "fqn")
        if e["kind"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
        elif e["kind"] == "tensor":
            sdm[fqn] = _tensor_from_json(fqn, e)
        else:
            raise ValueError(f"{fqn!r}: unknown kind {e['kind']!r}")
    return sdm


def _planner_from_json(doc: dict[str, Any]) -> dict[str, tuple[Any, ...]] | None:
    if doc["planner_data"] is None:
        return None
    planner = {}
    for p in _of(doc["planner_data"], list, "planner_data"):
        path = _of(p["path"], list, "path")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            raise ValueError(f"planner path {path!r} is not a key path")
        planner[_of(p["fqn"], str, "fqn")] = tuple(path)
    return planner


def _storage_from_json(doc: dict[str, Any]) -> dict[MetadataIndex, ArrayLocation]:
    storage: dict[MetadataIndex, ArrayLocation] = {}
    for s in _of(doc["storage_data"], list, "storage_data"):
        offset = None if s["offset"] is None else _ints(s["offset"], "offset")
        idx = s["index"]
        if idx is not None:
            _of(idx, int, "index")
        storage[MetadataIndex(_of(s["fqn"], str, "fqn"), offset, idx)] = ArrayLocation(
            rank=_of(s["rank"], int, "rank"), array=_of(s["array"], str, "array"))
    return storage


def _storage_meta_from_json(doc: dict[str, Any]) -> StorageMeta | None:
    sm = doc["storage_meta"]
    if sm is None:
        return None
    return StorageMeta(checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"],
                       modules=[_of(m, str, "module") for m in _of(sm["modules"], list, "modules")])


def metadata_from_json(doc: Any, *, where: dict[str, Any] | None = None) -> Metadata:
    """The inverse of :func:`metadata_to_json`; ``CorruptCut`` for a document it does not accept."""
    where = where or {}
    try:
        if not isinstance(doc, dict) or doc.get("format_version") != METADATA_FORMAT_VERSION:
            raise ValueError(f"unsupported document (format_version {doc.get('format_version')!r})"
                             if isinstance(doc, dict) else "not an object")
        sdm = _entries_from_json(doc)
        planner = _planner_from_json(doc)
        storage = _storage_from_json(doc)
        meta = _storage_meta_from_json(doc)
        version = doc["version"]
        if version is not None:
            _of(version, str, "version")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCut(f"malformed {METADATA_KEY} metadata: {exc!r}", **where) from None
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, storage_meta=meta,
                    version=version)


__all__ = ["ArrayLocation", "DCP_VERSION", "METADATA_FORMAT_VERSION", "METADATA_KEY", "array_name",
           "metadata_from_json", "metadata_to_json"]
