"""ckptstore as a storage backend of ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state_dict, storage_writer=StoreWriter(url, step=step))`` writes one ordinary cut of the
store (every rank's chunks as that rank's shards) and returns once it is committed;
``dcp.load(state_dict, storage_reader=StoreReader(url, cut="latest"))`` reads it back at any world
size (DCP's planner reshards; this reader only hands it the saved chunks, verified).

The commit is ckptstore's own (docs/design.md, "Several ranks"): the coordinator opens the store as its
writer and marks the cut in ``prepare_global_plan``, whose plans carry the cut id to every rank; every
rank writes its items as its shards plus its durable rank record in ``write_data``; the coordinator
collects the records and commits in ``finish``. DCP's ``Metadata`` is stored as typed JSON in the
manifest's ``metadata["ckptstore.dcp"]`` (docs/dcp.md has the format); nothing is pickled by ckptstore.
Byte-IO items (values DCP ``torch.save``s) are stored as the uint8 arrays they are and handed back to
DCP as bytes, which DCP's planner unpickles (as it does with ``FileSystemReader``).

``StoreReader`` also reads native cuts (``Store.save``, the ``Checkpointer``): :func:`native_metadata`
synthesizes DCP ``Metadata`` from every rank's tree (DTensor shards as chunks of their global tensor),
so those load resharded too (docs/dcp.md, "Loading Checkpointer cuts").
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import layout
from .arrays import ArrayItem, describe, empty_for
from .errors import CorruptCut, DataError, UsageError
from .intent import CutIntent
from .manifest import Manifest, TensorRecord
from .options import StoreOptions
from .pending import PendingCut
from .retention import KeepLast, Policy
from .shards import check_header_matches, read_header, read_shard_into, read_tensor_range
from .store import Store
from .tree import Leaf
from .verify import DCP_METADATA_KEY

log = logging.getLogger("ckptstore.dcp")

#: The manifest ``metadata`` key that holds a DCP cut's ``Metadata`` (docs/dcp.md).
METADATA_KEY = DCP_METADATA_KEY
#: The version of that JSON document.
METADATA_FORMAT_VERSION = 1
#: The DCP metadata version written (FileSystemWriter's ``CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"

_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


# ------------------------------------------------------------------------------------------ plan data
@dataclass(frozen=True)
class CutPlan:
    """``SavePlan.storage_data`` of each rank, set by the coordinator: the cut to write into."""

    cut: str
    step: int
    rank: int
    world_size: int


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


# ------------------------------------------------------------------------------ Metadata <-> JSON
def _enum_name(v: Any) -> str:
    return str(v).removeprefix("torch.")


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    """DCP ``Metadata`` as typed JSON (docs/dcp.md). ``storage_data`` must map ``MetadataIndex`` to
    :class:`ArrayLocation`; ``planner_data`` may be None or the default planner's fqn -> key path."""
    entries: list[dict[str, Any]] = []
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            entries.append({"fqn": fqn, "kind": "bytes"})
        elif isinstance(smd, TensorStorageMetadata):
            p = smd.properties
            mf = next((n for n, f in _MEMORY_FORMATS.items() if f == p.memory_format), None)
            if mf is None:
                raise UsageError(f"DCP item {fqn!r}: memory format {p.memory_format} cannot be stored")
            entries.append({
                "fqn": fqn, "kind": "tensor", "dtype": _enum_name(p.dtype), "layout": _enum_name(p.layout),
                "requires_grad": bool(p.requires_grad), "memory_format": mf, "pin_memory": bool(p.pin_memory),
                "size": [int(s) for s in smd.size],
                "chunks": [{"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                           for c in smd.chunks],
            })
        else:
            raise UsageError(f"DCP item {fqn!r}: unknown storage metadata {type(smd).__name__}")
    planner: list[dict[str, Any]] | None = None
    if md.planner_data is not None:
        if not isinstance(md.planner_data, dict):
            raise UsageError(f"DCP planner_data of type {type(md.planner_data).__name__} cannot be stored "
                             "without pickle (use the default planners)")
        planner = []
        for fqn, path in md.planner_data.items():
            if not isinstance(fqn, str) or not isinstance(path, (tuple, list)) or not all(
                    isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
                raise UsageError(f"DCP planner_data entry {fqn!r}: {path!r} is not a key path of str and int")
            planner.append({"fqn": fqn, "path": list(path)})
    storage: list[dict[str, Any]] = []
    for index, loc in (md.storage_data or {}).items():
        if not isinstance(loc, ArrayLocation):
            raise UsageError(f"DCP storage_data for {index} is not a ckptstore location")
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else [int(o) for o in index.offset],
                        "index": index.index, "rank": loc.rank, "array": loc.array})
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


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{what} must be a list of non-negative ints, got {v!r}")
    return v


def _of(v: Any, typ: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(v, typ) or isinstance(v, bool) and typ is int:
        raise ValueError(f"{what} has the wrong type: {v!r}")
    return v


def metadata_from_json(doc: Any, *, where: dict[str, Any] | None = None) -> Metadata:
    """The inverse of :func:`metadata_to_json`; ``CorruptCut`` for a document it does not accept."""
    where = where or {}
    try:
        if not isinstance(doc, dict) or doc.get("format_version") != METADATA_FORMAT_VERSION:
            raise ValueError(f"unsupported document (format_version {doc.get('format_version')!r})"
                             if isinstance(doc, dict) else "not an object")
        sdm: dict[str, Any] = {}
        for e in _of(doc["state_dict_metadata"], list, "state_dict_metadata"):
            fqn = _of(e["fqn"], str, "fqn")
            if e["kind"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            if e["kind"] != "tensor":
                raise ValueError(f"{fqn!r}: unknown kind {e['kind']!r}")
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
            sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(_ints(e["size"], "size")), chunks=chunks)
        planner = None
        if doc["planner_data"] is not None:
            planner = {}
            for p in _of(doc["planner_data"], list, "planner_data"):
                path = _of(p["path"], list, "path")
                if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
                    raise ValueError(f"planner path {path!r} is not a key path")
                planner[_of(p["fqn"], str, "fqn")] = tuple(path)
        storage: dict[MetadataIndex, ArrayLocation] = {}
        for s in _of(doc["storage_data"], list, "storage_data"):
            offset = None if s["offset"] is None else _ints(s["offset"], "offset")
            idx = s["index"]
            if idx is not None:
                _of(idx, int, "index")
            storage[MetadataIndex(_of(s["fqn"], str, "fqn"), offset, idx)] = ArrayLocation(
                rank=_of(s["rank"], int, "rank"), array=_of(s["array"], str, "array"))
        sm = doc["storage_meta"]
        meta = None
        if sm is not None:
            meta = StorageMeta(checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"],
                               modules=[_of(m, str, "module") for m in _of(sm["modules"], list, "modules")])
        version = doc["version"]
        if version is not None:
            _of(version, str, "version")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCut(f"malformed {METADATA_KEY} metadata: {exc!r}", **where) from None
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, storage_meta=meta,
                    version=version)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _options(options: StoreOptions | None, storage_options: dict[str, Any] | None) -> StoreOptions:
    if options is not None and storage_options is not None:
        raise UsageError("pass storage_options inside options= or alone, not both")
    if options is None:
        return StoreOptions(storage_options=storage_options)
    return options


#: This process's coordinator saves in flight, by store: a new save of the same store finds the one
#: before it here when DCP abandoned it (a rank failed: DCP never calls ``finish`` then, and the old
#: writer object may live on in a reference cycle of DCP's exception) and ends it first.
_IN_FLIGHT: dict[str, Any] = {}


def _store_key(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def _close_quietly(key: str, store: Store | None, pending: PendingCut | None) -> None:
    """Abandons a cut still in flight and releases the writer lock (a save that DCP abandoned after a
    rank failed)."""
    entry = _IN_FLIGHT.get(key)
    if entry is not None and entry[1] is pending:
        del _IN_FLIGHT[key]
    try:
        if pending is not None:
            pending.abandon()
    except Exception:  # noqa: BLE001 - best effort: what stays is marked, the next writer open's gc removes it
        log.warning("ckptstore.dcp: could not abandon cut %s", pending.id, exc_info=True)
    finally:
        if store is not None:
            store.close()


# ------------------------------------------------------------------------------------------- writer
class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves one cut of the store at ``url`` (created when missing).

    ``step`` must be above the store's LATEST step. ``tags``, ``final`` go into the manifest; ``keep``
    (a retention ``Policy`` or an int n for ``KeepLast(n)``) prunes after the commit. Rank 0 (DCP's
    coordinator) holds the store's writer lock from planning to ``finish``; the other ranks write
    their parts without a lock. One writer object serves one ``dcp.save`` at a time.

    When a rank fails, DCP raises on every rank without calling ``finish``: the cut then stays marked,
    LATEST where it was, and the coordinator still holds the writer lock. It abandons the cut and
    releases the lock when this object is closed (``close()``, ``with``, its garbage collection), or
    when this process starts its next DCP save of the same store; a crash leaves it to the next writer
    open's gc. ``storage_options`` (fsspec) or ``options`` (a ``StoreOptions``: compression, shard
    size) apply when the coordinator creates or opens the store.
    """

    def __init__(self, url: str | os.PathLike, step: int, *, tags: Sequence[str] = (),
                 keep: Policy | int | None = None, final: bool = False,
                 storage_options: dict[str, Any] | None = None, options: StoreOptions | None = None) -> None:
        super().__init__()
        layout.check_step(step, store=os.fspath(url))
        if isinstance(keep, int) and not isinstance(keep, bool):
            keep = KeepLast(keep)
        elif keep is not None and not isinstance(keep, Policy):
            raise UsageError(f"keep must be a retention Policy or an int, got {keep!r}")
        self.url = os.fspath(url)
        self.step = step
        self.tags = tuple(tags)
        self.keep = keep
        self.final = bool(final)
        self.options = _options(options, storage_options)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = False
        #: The cut this save writes (known on every rank once the plans are scattered).
        self.cut: str | None = None
        #: What ``finish`` committed (the coordinator's), None before.
        self.info: Any = None
        self._store: Store | None = None
        self._pending: PendingCut | None = None
        self._finalizer: Any = None

    # lifecycle ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.close()
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.cut = None
        self.info = None

    def close(self) -> None:
        """Abandons a cut this object marked and did not commit, and releases the writer lock. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs _close_quietly once
            self._finalizer = None
        self._store, self._pending = None, None

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked automatically: pass storage_writer=StoreWriter(...)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    # DCP calls ----------------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise UsageError("StoreWriter needs use_collectives=True: the coordinator commits the cut",
                             store=self.url)
        self.close()  # a previous save through this object that DCP abandoned
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: opens the store as its writer, marks the cut, and sends its id in every plan."""
        world = len(plans)
        key = _store_key(self.url)
        stale = _IN_FLIGHT.pop(key, None)
        if stale is not None:
            stale[0]()  # a save of this process that DCP abandoned: abandon its cut, release the lock
        store = Store.open(self.url, create=True, options=self.options)
        try:
            pending = store.begin_cut(self.step, writer="dcp.save", world_size=world)
        except BaseException:
            store.close()
            raise
        self._store, self._pending = store, pending
        self._finalizer = weakref.finalize(self, _close_quietly, key, store, pending)
        _IN_FLIGHT[key] = (self._finalizer, pending)
        return [dataclasses.replace(p, storage_data=CutPlan(pending.id, self.step, r, world))
                for r, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        where = plan.storage_data
        if not isinstance(where, CutPlan):
            raise UsageError("the save plan carries no ckptstore cut (was prepare_global_plan skipped?)",
                             store=self.url)
        self.cut = where.cut
        items: list[ArrayItem] = []
        results: list[WriteResult] = []
        tensors: list[dict[str, Any]] = []
        byte_io: list[dict[str, Any]] = []
        seen: set[str] = set()
        for item in plan.items:
            is_bytes = item.type == WriteItemType.BYTE_IO
            name = array_name(item.index, is_bytes)
            if name in seen:
                raise UsageError(f"DCP item {item.index} appears twice in rank {where.rank}'s plan", store=self.url,
                                 cut=where.cut)
            seen.add(name)
            data = planner.resolve_data(item)
            if is_bytes:
                buf = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                arr = ArrayItem(name, "torch", "uint8", (len(buf),), len(buf), memoryview(buf))
            else:
                arr = describe(Leaf(name, "torch", data))
            items.append(arr)
            (byte_io if is_bytes else tensors).append({"k": name, "v": {"t": "tensor", "name": name}})
            results.append(WriteResult(index=item.index, size_in_bytes=arr.nbytes,
                                       storage_data=ArrayLocation(where.rank, name)))
        # Each rank's tree: {"tensors": {name: array}, "byte_io": {name: uint8 array of torch.save bytes}},
        # so `ckptstore.load(url, rank=r)` returns the raw arrays and never unpickles a byte-IO item.
        tree = {"t": "dict", "ordered": False, "items": [
            {"k": "tensors", "v": {"t": "dict", "ordered": False, "items": tensors}},
            {"k": "byte_io", "v": {"t": "dict", "ordered": False, "items": byte_io}},
        ]}
        if self.is_coordinator and self._store is not None:
            store, own = self._store, False
        else:
            store, own = Store.open(self.url, readonly=True, options=self.options), True
        try:
            if where.world_size == 1 and (self._pending is None or self._pending.id != where.cut):
                raise UsageError("a cut of one rank is written by its coordinator", store=self.url, cut=where.cut)
            # One rank's part is kept by the cut itself, several ranks' in their records: one write path.
            part = self._pending if where.world_size == 1 else store.rank_part_for(
                where.cut, where.step, where.rank, where.world_size)
            files, arrays = part.write(items)  # type: ignore[union-attr]
            part.publish(files, arrays, CutIntent(tree=tree, mode="dcp", world_size=where.world_size))  # type: ignore[union-attr]
        finally:
            if own:
                store.close()
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: stores ``metadata`` as JSON in the manifest and commits the cut (LATEST moves
        here and only here); then prunes with ``keep``. On failure the cut is abandoned and it raises."""
        store, pending = self._store, self._pending
        if store is None or pending is None:
            raise UsageError("finish without a cut in flight (prepare_global_plan did not run here)", store=self.url)
        try:
            metadata.version = DCP_VERSION
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
            metadata.storage_meta = self.storage_meta()
            doc = metadata_to_json(metadata)
            info = pending.finish(CutIntent(tags=list(self.tags), final=self.final, metadata={METADATA_KEY: doc},
                                            mode="dcp", world_size=pending.world_size))
        except BaseException:
            self.close()  # abandons (a no-op when the commit's outcome was left to recovery)
            raise
        self.info = info
        try:
            if self.keep is not None:
                store.prune(self.keep)
        except Exception:  # noqa: BLE001 - the cut is committed; a failed prune must not report the save failed
            log.warning("ckptstore.dcp: pruning %s after committing %s failed", self.url, info.id, exc_info=True)
        finally:
            self.close()


# ------------------------------------------------------------------------- native cuts as DCP metadata
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


def _dcp_leaves(node: Any, path: tuple[Any, ...] = ()) -> Any:
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


def native_metadata(m: Manifest, *, where: dict[str, Any]) -> Metadata:
    """DCP ``Metadata`` for a cut written by ``Store.save`` or the ``Checkpointer`` (no ``ckptstore.dcp``
    metadata), from every rank's tree: a "dtensor" node gives one chunk per distinct shard (offsets,
    local shape) of the global tensor over all ranks; a plain "tensor" node is taken as replicated, one
    whole chunk from the lowest rank holding that fqn; any other terminal leaf (int, float, str, a list
    of them, ...) becomes a byte-IO item holding the value. Leaves that hold arrays inside a value DCP
    sees as opaque (numpy arrays, a tuple of tensors) or pickled values are left out (a strict DCP load
    asking for them raises "Missing key"). ``storage_data`` maps each chunk to its (rank, array)."""
    from .tree import unflatten

    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    seen_chunks: dict[str, set[tuple[int, ...]]] = {}
    skipped: list[str] = []
    for rank, tree in m.rank_trees():
        part = m.for_rank(rank)
        records = part.tensor_index()
        for fqn, node in _dcp_leaves(tree):
            kind = node.get("t") if isinstance(node, dict) else None
            if kind == "tensor" and "view" in node:  # a view of an array shared with other tensors
                skipped.append(fqn)
                continue
            if kind in ("tensor", "dtensor"):
                rec = records.get(node.get("name"))
                if rec is None or rec.kind != "torch":
                    raise CorruptCut(f"rank {rank}'s tree names array {node.get('name')!r} at {fqn!r}, which its "
                                     "part of the manifest does not record as a torch array", **where)
                dtype = getattr(torch, rec.dtype, None)
                if not isinstance(dtype, torch.dtype):
                    raise CorruptCut(f"array {rec.name!r} has unknown dtype {rec.dtype!r}", **where)
                if kind == "dtensor":
                    if any(isinstance(p, dict) and "partial" in p for p in node.get("placements", [])):
                        raise UsageError(f"{fqn!r} is a DTensor with a Partial placement; DCP cannot load it "
                                         "resharded (reduce it before saving)", **where)
                    size, offsets, sizes = node["global_shape"], node["offsets"], node["local_shape"]
                    if list(rec.shape) != list(sizes):
                        raise CorruptCut(f"{fqn!r} on rank {rank}: the array is {rec.shape}, the tree's local "
                                         f"shape {sizes}", **where)
                else:
                    if fqn in sdm:
                        continue  # replicated: the lowest rank's copy
                    size, offsets, sizes = list(rec.shape), [0] * len(rec.shape), list(rec.shape)
                have = sdm.get(fqn)
                if have is None:
                    have = sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                            size=torch.Size(size), chunks=[])
                    seen_chunks[fqn] = set()
                elif not isinstance(have, TensorStorageMetadata) or list(have.size) != list(size) \
                        or have.properties.dtype != dtype:
                    raise CorruptCut(f"{fqn!r} differs between ranks (rank {rank} has {rec.dtype}{list(size)})",
                                     **where)
                key = tuple(int(o) for o in offsets)
                if key in seen_chunks[fqn]:
                    continue  # a replica of a shard already recorded (Replicate placements)
                seen_chunks[fqn].add(key)
                have.chunks.append(ChunkStorageMetadata(offsets=torch.Size(key), sizes=torch.Size(sizes)))
                storage[MetadataIndex(fqn, key)] = ArrayLocation(rank, rec.name)
            else:
                if fqn in sdm:
                    if not isinstance(sdm[fqn], BytesStorageMetadata):
                        raise CorruptCut(f"{fqn!r} is a tensor on one rank and a value on another", **where)
                    continue
                try:
                    value = unflatten(node, _no_arrays, allow_pickle=False, where=where)
                except (_HasArrays, DataError, UsageError) as exc:
                    skipped.append(fqn)
                    log.debug("ckptstore.dcp: %s of cut %s left out of the DCP metadata: %r", fqn, m.cut, exc)
                    continue
                sdm[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = NativeValue(rank, value)
    if skipped:
        log.info("ckptstore.dcp: cut %s: %d values DCP cannot load from it were left out: %s", m.cut, len(skipped),
                 ", ".join(skipped[:10]))
    return Metadata(state_dict_metadata=sdm, storage_data=storage, storage_meta=StorageMeta(),
                    version=DCP_VERSION)


# ------------------------------------------------------------------------------------------- reader
class StoreReader(StorageReader):
    """A DCP ``StorageReader`` of one committed cut, written by :class:`StoreWriter` or natively
    (``Store.save``, the ``Checkpointer``: :func:`native_metadata`): ``cut`` is "latest", a cut id or a step. Loads at any world size (DCP reshards). Every array read is checked
    against its blake3 (``verify=False`` skips the hashes, never the size and header checks); a range
    of arrays of an uncompressed shard is read by byte range, a compressed shard whole."""

    def __init__(self, url: str | os.PathLike, cut: str | int = "latest", *,
                 storage_options: dict[str, Any] | None = None, options: StoreOptions | None = None,
                 verify: bool = True) -> None:
        super().__init__()
        self.url = os.fspath(url)
        self.cut = cut
        self.verify = verify
        self.options = _options(options, storage_options)
        self.load_id = uuid.uuid4().hex
        self._store: Store | None = None
        self._manifest: Manifest | None = None
        self._locations: dict[MetadataIndex, ArrayLocation] = {}
        self._agreed: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.close()
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._manifest, self._locations, self._agreed = None, {}, None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def _open(self) -> Store:
        if self._store is None:
            self._store = Store.open(self.url, readonly=True, options=self.options)
        return self._store

    def manifest(self) -> Manifest:
        """The manifest of the cut being read (chosen once per reader and reset)."""
        if self._manifest is None:
            self._manifest = self._open().manifest(self.cut)
        return self._manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UsageError("ckptstore cuts have one global DCP metadata, no per-rank metadata", store=self.url)
        m = self.manifest()
        if METADATA_KEY in m.metadata:
            md = metadata_from_json(m.metadata[METADATA_KEY], where={"store": self.url, "cut": m.cut})
        else:
            # A cut of Store.save or the Checkpointer: DCP metadata synthesized from its trees.
            md = native_metadata(m, where={"store": self.url, "cut": m.cut})
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise UsageError("DCP metadata without storage_data", store=self.url)
        self._locations = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank reads the cut the coordinator planned with (a cut committed between
        two ranks' ``read_metadata`` under ``cut="latest"`` is caught, never mixed in)."""
        cut = self.manifest().cut
        return [dataclasses.replace(p, storage_data=cut) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self.manifest()
        if isinstance(plan.storage_data, str) and plan.storage_data != m.cut:
            raise UsageError(f"this rank planned with cut {m.cut} but the coordinator with {plan.storage_data} "
                             "(LATEST moved during the load); pass the cut id", store=self.url, cut=m.cut)
        where = {"store": self.url, "cut": m.cut}
        parts: dict[int, Manifest] = {}
        # (rank, file) -> {array name -> [requests]}
        by_file: dict[tuple[int, str], dict[str, list[Any]]] = {}
        records: dict[tuple[int, str], TensorRecord] = {}
        for req in plan.items:
            loc = self._locations.get(req.storage_index)
            if loc is None:
                raise CorruptCut(f"DCP metadata has no location for {req.storage_index}", **where)
            if isinstance(loc, NativeValue):
                # A non-tensor value of a native cut: DCP's planner unpickles what torch.save made of it.
                if req.type != LoadItemType.BYTE_IO:
                    raise CorruptCut(f"DCP item {req.storage_index} is a value, not a tensor", **where)
                buf = io.BytesIO()
                torch.save(loc.value, buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            if loc.rank not in parts:
                try:
                    parts[loc.rank] = m.for_rank(loc.rank)
                except ValueError as exc:
                    raise CorruptCut(f"DCP metadata names rank {loc.rank}: {exc}", **where) from None
            part = parts[loc.rank]
            key = (loc.rank, loc.array)
            if key not in records:
                rec = next((t for t in part.tensors if t.name == loc.array), None)
                if rec is None:
                    raise CorruptCut(f"DCP metadata names array {loc.array!r} of rank {loc.rank}, which the "
                                     "manifest does not record", **where)
                records[key] = rec
            by_file.setdefault((loc.rank, records[key].file), {}).setdefault(loc.array, []).append(req)
        storage = self._open().storage
        for (rank, fname), wanted in by_file.items():
            part = parts[rank]
            frec = next(f for f in part.files if f.name == fname)
            in_file = [t for t in part.tensors if t.file == fname]
            # A saved array that one request takes whole, into a CPU tensor of its dtype and shape (a load
            # at the world size of the save, or of an unsharded tensor), is read straight into that
            # tensor: no second buffer and no second copy. The rest is read into fresh arrays and copied.
            direct = {name: target for name, reqs in wanted.items()
                      if (target := self._direct_target(records[(rank, name)], reqs, planner)) is not None}
            arrays = self._read_file(storage, part, frec, in_file, set(wanted), direct, where)
            for name, reqs in wanted.items():
                if name in direct:
                    planner.commit_tensor(reqs[0], direct[name])
                else:
                    self._apply(arrays.pop(name), reqs, planner, where)
        return _done(None)

    @staticmethod
    def _direct_target(rec: TensorRecord, reqs: list[Any], planner: LoadPlanner) -> Any:
        """The planner's tensor for a request that takes the whole saved array ``rec``, when its bytes can
        be read into directly (CPU, contiguous, same dtype and shape, not empty); else None."""
        if len(reqs) != 1 or rec.kind != "torch" or not rec.nbytes:
            return None
        req = reqs[0]
        if req.type == LoadItemType.BYTE_IO or any(int(o) for o in req.storage_offsets) \
                or [int(n) for n in req.lengths] != list(rec.shape):
            return None
        target = planner.resolve_tensor(req).detach()
        if (target.device.type != "cpu" or not target.is_contiguous() or list(target.shape) != list(rec.shape)
                or str(target.dtype).removeprefix("torch.") != rec.dtype):
            return None
        return target

    def _read_file(self, storage: Any, part: Manifest, frec: Any, in_file: list[TensorRecord], wanted: set[str],
                   direct: dict[str, Any], where: dict[str, Any]) -> dict[str, Any]:
        """Reads (and verifies) the ``wanted`` arrays of one shard file: those in ``direct`` into their
        target tensors, the others into fresh arrays, returned by name."""
        objs: dict[str, Any] = {}
        fwhere = {**where, "path": f"cuts/{part.cut}/{frec.name}"}

        def into(t: TensorRecord) -> memoryview:
            target = direct.get(t.name)
            if target is not None:
                return memoryview(target.reshape(-1).view(torch.uint8).numpy())
            obj, view = empty_for(t.kind, t.dtype, t.shape, t.nbytes)
            objs[t.name] = obj
            return view

        if frec.codec == "none" and len(wanted) < len(in_file):
            header = read_header(storage, part.cut, frec)
            check_header_matches(header, in_file, fwhere)
            for t in in_file:
                if t.name in wanted:
                    read_tensor_range(storage, part.cut, frec, header, t, into(t), verify=self.verify)
            return objs

        def dest(t: TensorRecord) -> memoryview:
            return into(t) if t.name in wanted else memoryview(bytearray(t.nbytes))

        read_shard_into(storage, part.cut, frec, in_file, dest, format_version=part.format_version, verify=self.verify)
        return objs

    @staticmethod
    def _apply(arr: Any, reqs: list[Any], planner: LoadPlanner, where: dict[str, Any]) -> None:
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                if arr.dtype != torch.uint8 or arr.dim() != 1:
                    raise CorruptCut(f"byte-IO item {req.storage_index} is stored as {arr.dtype}{list(arr.shape)}",
                                     **where)
                # DCP's planner unpickles these bytes (torch.load), exactly as with FileSystemReader.
                planner.load_bytes(req, io.BytesIO(arr.numpy().tobytes()))
                continue
            tensor = narrow_tensor_by_index(arr, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CorruptCut(f"DCP item {req.storage_index}: stored chunk gives {list(tensor.size())}, the plan "
                                 f"wants {list(target.size())}", **where)
            target.copy_(tensor)
            planner.commit_tensor(req, target)


__all__ = ["StoreWriter", "StoreReader", "CutPlan", "ArrayLocation", "NativeValue", "native_metadata", "METADATA_KEY", "metadata_to_json",
           "metadata_from_json", "array_name"]
