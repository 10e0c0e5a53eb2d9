"""``StoreReader``: a DCP load of one committed cut at any world size (DCP's planner reshards; this
reader hands it the saved chunks, verified). Cuts written by ``StoreWriter`` carry their DCP
``Metadata`` (:mod:`.metadata`); native cuts get it synthesized from their trees (:mod:`.native`)."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore import CorruptCut, Store, StoreOptions, UsageError
from ckptstore.spi import commit_record, empty_for, part_of, whole_of
from ckptstore.spi import FileRecord, Manifest, TensorRecord
from ckptstore.spi import check_header_matches, read_header, read_shard_into, read_tensor_range

from .common import done, store_options
from .metadata import METADATA_KEY, ArrayLocation, metadata_from_json
from .native import NativeValue, native_metadata


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
        self.options = store_options(options, storage_options)
        self.load_id = uuid.uuid4().hex
        self._store: Store | None = None
        self._manifest: Manifest | None = None
        self._record: Manifest | None = None
        self._parts: dict[int, Manifest] = {}
        self._locations: dict[MetadataIndex, ArrayLocation] = {}
        self._agreed: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.close()
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._manifest, self._record, self._parts, self._locations, self._agreed = None, None, {}, {}, None

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
        """The manifest of the cut being read, whole (chosen once per reader and reset): of a cut of
        several ranks committed as format 5, every rank's fragment read."""
        if self._manifest is None:
            self._manifest = whole_of(self._open(), self.record())
        return self._manifest

    def record(self) -> Manifest:
        """The cut's manifest as stored (chosen once per reader and reset): of a cut of format 5 its
        commit record alone; a load reads the fragments of the ranks its plan touches (issue 22)."""
        if self._record is None:
            self._record = commit_record(self._open(), self.cut)
        return self._record

    def _part(self, rank: int) -> Manifest:
        """Rank ``rank``'s part of the cut (one fragment read, once, for a cut of format 5)."""
        if rank not in self._parts:
            self._parts[rank] = part_of(self._open(), self.record(), rank)
        return self._parts[rank]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UsageError("ckptstore cuts have one global DCP metadata, no per-rank metadata", store=self.url)
        m = self.record()
        if METADATA_KEY in m.metadata:
            md = metadata_from_json(m.metadata[METADATA_KEY], where={"store": self.url, "cut": m.cut})
        else:
            # A cut of Store.save or the Checkpointer: DCP metadata synthesized from every rank's tree.
            md = native_metadata(self.manifest(), where={"store": self.url, "cut": m.cut})
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
        cut = self.record().cut
        return [dataclasses.replace(p, storage_data=cut) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self.record()
        if isinstance(plan.storage_data, str) and plan.storage_data != m.cut:
            raise UsageError(f"this rank planned with cut {m.cut} but the coordinator with {plan.storage_data} "
                             "(LATEST moved during the load); pass the cut id", store=self.url, cut=m.cut)
        where = {"store": self.url, "cut": m.cut}
        parts, records, by_file = self._plan_reads(m, plan, planner, where)
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
        return done(None)

    def _plan_reads(self, m: Manifest, plan: LoadPlan, planner: LoadPlanner, where: dict[str, Any]) -> tuple[
            dict[int, Manifest], dict[tuple[int, str], TensorRecord], dict[tuple[int, str], dict[str, list[Any]]]]:
        """Serves the plan's native values, and groups its array reads: each rank's part, the record of
        each (rank, array) read, and (rank, file) -> {array name -> [requests]}."""
        parts: dict[int, Manifest] = {}
        records: dict[tuple[int, str], TensorRecord] = {}
        by_file: dict[tuple[int, str], dict[str, list[Any]]] = {}
        for req in plan.items:
            loc = self._locations.get(req.storage_index)
            if loc is None:
                raise CorruptCut(f"DCP metadata has no location for {req.storage_index}", **where)
            if isinstance(loc, NativeValue):
                self._load_value(loc, req, planner, where)
                continue
            if loc.rank not in parts:
                if isinstance(loc.rank, bool) or not (isinstance(loc.rank, int) and 0 <= loc.rank < m.world_size):
                    raise CorruptCut(f"DCP metadata names rank {loc.rank}: rank {loc.rank!r} is outside the "
                                     f"cut's world size {m.world_size}", **where)
                parts[loc.rank] = self._part(loc.rank)
            key = (loc.rank, loc.array)
            if key not in records:
                rec = next((t for t in parts[loc.rank].tensors if t.name == loc.array), None)
                if rec is None:
                    raise CorruptCut(f"DCP metadata names array {loc.array!r} of rank {loc.rank}, which the "
                                     "manifest does not record", **where)
                records[key] = rec
            by_file.setdefault((loc.rank, records[key].file), {}).setdefault(loc.array, []).append(req)
        return parts, records, by_file

    @staticmethod
    def _load_value(loc: NativeValue, req: Any, planner: LoadPlanner, where: dict[str, Any]) -> None:
        """A non-tensor value of a native cut: DCP's planner unpickles what torch.save made of it."""
        if req.type != LoadItemType.BYTE_IO:
            raise CorruptCut(f"DCP item {req.storage_index} is a value, not a tensor", **where)
        buf = io.BytesIO()
        torch.save(loc.value, buf)
        buf.seek(0)
        planner.load_bytes(req, buf)

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

    def _read_file(self, storage: Any, part: Manifest, frec: FileRecord, in_file: list[TensorRecord],
                   wanted: set[str], direct: dict[str, Any], where: dict[str, Any]) -> dict[str, Any]:
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


__all__ = ["StoreReader"]
