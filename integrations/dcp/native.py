"""DCP ``Metadata`` synthesized for a native cut (one of ``Store.save`` or the ``Checkpointer``, without
``"ckptstore.dcp"`` metadata), so :class:`~ckptstore.integrations.dcp.StoreReader` loads it resharded
too (docs/dcp.md, "Loading Checkpointer cuts")."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

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

from ckptstore.errors import CorruptCut, DataError, UsageError
from ckptstore.spi import Manifest, TensorRecord
from ckptstore.spi import unflatten

from .metadata import DCP_VERSION, ArrayLocation

log = logging.getLogger("ckptstore.dcp")


@dataclass(frozen=True)
class NativeValue:
    """``Metadata.storage_data`` value of a non-tensor leaf of a native cut (a cut of ``Store.save`` or
    the ``Checkpointer``): the value itself, rebuilt from the manifest tree (never unpickled), which the
    reader ``torch.save``s into the bytes DCP's planner loads."""

    rank: int
    value: Any


def _is_terminal(node: Any) -> bool:
    """DCP's ``traverse_state_dict._is_terminal`` on a tree node: a dict is never terminal; a list is,
    unless it holds a tensor, a dict or a non-terminal list; anything else (tuples included) is."""
    kind = node.get("t") if isinstance(node, dict) else None
    if kind == "dict":
        return False
    if kind != "list":
        return True
    for entry in node.get("items") or []:
        ekind = entry.get("t") if isinstance(entry, dict) else None
        if ekind in ("dict", "list") and not _is_terminal(entry):
            return False
        if ekind in ("tensor", "dtensor"):
            return False
    return True


def _dcp_leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(fqn, node) of every leaf DCP's ``flatten_state_dict`` makes of the state a tree records: keys
    joined by "." (int keys as str, list entries by index), traversed as ``traverse_state_dict`` does."""
    kind = node.get("t") if isinstance(node, dict) else None
    if kind == "dict":
        for item in node.get("items") or []:
            key = item["k"] if "k" in item else item["ik"]
            yield from _dcp_leaves(item["v"], path + (str(key),))
    elif _is_terminal(node) or kind not in ("list", "tuple"):
        if path:
            yield ".".join(map(str, path)), node
    else:
        for i, child in enumerate(node.get("items") or []):
            yield from _dcp_leaves(child, path + (i,))


def _no_arrays(name: str, node: dict[str, Any]) -> Any:
    raise _HasArrays(name)


class _HasArrays(Exception):
    pass


class _Synthesis:
    """The metadata of one native cut, built leaf by leaf over its ranks in order."""

    def __init__(self, m: Manifest, where: dict[str, Any]) -> None:
        self.m, self.where = m, where
        self.sdm: dict[str, Any] = {}
        self.storage: dict[MetadataIndex, Any] = {}
        self.seen_chunks: dict[str, set[tuple[int, ...]]] = {}
        self.skipped: list[str] = []

    def add_rank(self, rank: int, tree: Any) -> None:
        records = self.m.for_rank(rank).tensor_index()
        for fqn, node in _dcp_leaves(tree):
            kind = node.get("t") if isinstance(node, dict) else None
            if kind == "tensor" and "view" in node:  # a view of an array shared with other tensors
                self.skipped.append(fqn)
            elif kind in ("tensor", "dtensor"):
                self.add_array(rank, fqn, node, records)
            else:
                self.add_value(rank, fqn, node)

    def _record(self, rank: int, fqn: str, node: dict[str, Any], records: dict[str, TensorRecord]) -> TensorRecord:
        rec = records.get(node.get("name"))  # type: ignore[arg-type]
        if rec is None or rec.kind != "torch":
            raise CorruptCut(f"rank {rank}'s tree names array {node.get('name')!r} at {fqn!r}, which its "
                             "part of the manifest does not record as a torch array", **self.where)
        return rec

    def _chunk(self, rank: int, fqn: str, node: dict[str, Any], rec: TensorRecord) -> tuple[Any, Any, Any] | None:
        """(global size, offsets, sizes) of a tensor leaf's chunk; None for a replica already taken."""
        if node.get("t") != "dtensor":
            if fqn in self.sdm:
                return None  # replicated: the lowest rank's copy
            return list(rec.shape), [0] * len(rec.shape), list(rec.shape)
        if any(isinstance(p, dict) and "partial" in p for p in node.get("placements", [])):
            raise UsageError(f"{fqn!r} is a DTensor with a Partial placement; DCP cannot load it "
                             "resharded (reduce it before saving)", **self.where)
        size, offsets, sizes = node["global_shape"], node["offsets"], node["local_shape"]
        if list(rec.shape) != list(sizes):
            raise CorruptCut(f"{fqn!r} on rank {rank}: the array is {rec.shape}, the tree's local "
                             f"shape {sizes}", **self.where)
        return size, offsets, sizes

    def add_array(self, rank: int, fqn: str, node: dict[str, Any], records: dict[str, TensorRecord]) -> None:
        rec = self._record(rank, fqn, node, records)
        dtype = getattr(torch, rec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCut(f"array {rec.name!r} has unknown dtype {rec.dtype!r}", **self.where)
        chunk = self._chunk(rank, fqn, node, rec)
        if chunk is None:
            return
        size, offsets, sizes = chunk
        have = self.sdm.get(fqn)
        if have is None:
            have = self.sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                         size=torch.Size(size), chunks=[])
            self.seen_chunks[fqn] = set()
        elif not isinstance(have, TensorStorageMetadata) or list(have.size) != list(size) \
                or have.properties.dtype != dtype:
            raise CorruptCut(f"{fqn!r} differs between ranks (rank {rank} has {rec.dtype}{list(size)})",
                             **self.where)
        key = tuple(int(o) for o in offsets)
        if key in self.seen_chunks[fqn]:
            return  # a replica of a shard already recorded (Replicate placements)
        self.seen_chunks[fqn].add(key)
        have.chunks.append(ChunkStorageMetadata(offsets=torch.Size(key), sizes=torch.Size(sizes)))
        self.storage[MetadataIndex(fqn, key)] = ArrayLocation(rank, rec.name)

    def add_value(self, rank: int, fqn: str, node: Any) -> None:
        if fqn in self.sdm:
            if not isinstance(self.sdm[fqn], BytesStorageMetadata):
                raise CorruptCut(f"{fqn!r} is a tensor on one rank and a value on another", **self.where)
            return
        try:
            value = unflatten(node, _no_arrays, allow_pickle=False, where=self.where)
        except (_HasArrays, DataError, UsageError) as exc:
            self.skipped.append(fqn)
            log.debug("ckptstore.dcp: %s of cut %s left out of the DCP metadata: %r", fqn, self.m.cut, exc)
            return
        self.sdm[fqn] = BytesStorageMetadata()
        self.storage[MetadataIndex(fqn)] = NativeValue(rank, value)


def native_metadata(m: Manifest, *, where: dict[str, Any]) -> Metadata:
    """DCP ``Metadata`` for a cut written by ``Store.save`` or the ``Checkpointer`` (no ``ckptstore.dcp``
    metadata), from every rank's tree: a "dtensor" node gives one chunk per distinct shard (offsets,
    local shape) of the global tensor over all ranks; a plain "tensor" node is taken as replicated, one
    whole chunk from the lowest rank holding that fqn; any other terminal leaf (int, float, str, a list
    of them, ...) becomes a byte-IO item holding the value. Leaves that hold arrays inside a value DCP
    sees as opaque (numpy arrays, a tuple of tensors) or pickled values are left out (a strict DCP load
    asking for them raises "Missing key"). ``storage_data`` maps each chunk to its (rank, array)."""
    built = _Synthesis(m, where)
    for rank, tree in m.rank_trees():
        built.add_rank(rank, tree)
    if built.skipped:
        log.info("ckptstore.dcp: cut %s: %d values DCP cannot load from it were left out: %s", m.cut,
                 len(built.skipped), ", ".join(built.skipped[:10]))
    return Metadata(state_dict_metadata=built.sdm, storage_data=built.storage, storage_meta=StorageMeta(),
                    version=DCP_VERSION)


__all__ = ["NativeValue", "native_metadata"]
