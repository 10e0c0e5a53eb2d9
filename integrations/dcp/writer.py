"""``StoreWriter``: a DCP save as one ordinary cut of the store, committed by ckptstore's own protocol
(docs/dcp.md, "How a save commits").

The coordinator opens the store as its writer and marks the cut in ``prepare_global_plan``, whose
plans carry the cut id to every rank; every rank writes its items as its shards plus its part in
``write_data`` (ranks other than the coordinator through a participant handle, ``ckptstore.spi``);
the coordinator collects the parts and commits in ``finish``. DCP's ``Metadata`` goes into the
manifest as JSON (:mod:`.metadata`). Byte-IO items (values DCP ``torch.save``s) are stored as the uint8
arrays they are.
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

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstore import KeepLast, Policy, Store, StoreOptions, UsageError
from ckptstore import spi
from ckptstore.spi import layout
from ckptstore.spi import ArrayItem, describe
from ckptstore.spi import Leaf

from .common import done, store_options
from .metadata import DCP_VERSION, METADATA_KEY, ArrayLocation, array_name, metadata_to_json

log = logging.getLogger("ckptstore.dcp")


@dataclass(frozen=True)
class CutPlan:
    """``SavePlan.storage_data`` of each rank, set by the coordinator: the cut to write into."""

    cut: str
    step: int
    rank: int
    world_size: int


#: This process's coordinator saves in flight, by store: a new save of the same store finds the one
#: before it here when DCP abandoned it (a rank failed: DCP never calls ``finish`` then, and the old
#: writer object may live on in a reference cycle of DCP's exception) and ends it first.
_IN_FLIGHT: dict[str, Any] = {}


def _store_key(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def _close_quietly(key: str, store: Store | None, pending: spi.PendingCut | None) -> None:
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


def _items_of(plan: SavePlan, planner: SavePlanner, where: CutPlan, url: str) -> tuple[list[ArrayItem],
                                                                                       list[WriteResult], Any]:
    """A rank's write items as arrays, DCP's write results, and the rank's tree: {"tensors": {name:
    array}, "byte_io": {name: uint8 array of torch.save bytes}}, so ``ckptstore.load(url, rank=r)``
    returns the raw arrays and never unpickles a byte-IO item."""
    items: list[ArrayItem] = []
    results: list[WriteResult] = []
    tensors: list[dict[str, Any]] = []
    byte_io: list[dict[str, Any]] = []
    seen: set[str] = set()
    for item in plan.items:
        is_bytes = item.type == WriteItemType.BYTE_IO
        name = array_name(item.index, is_bytes)
        if name in seen:
            raise UsageError(f"DCP item {item.index} appears twice in rank {where.rank}'s plan", store=url,
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
    tree = {"t": "dict", "ordered": False, "items": [
        {"k": "tensors", "v": {"t": "dict", "ordered": False, "items": tensors}},
        {"k": "byte_io", "v": {"t": "dict", "ordered": False, "items": byte_io}},
    ]}
    return items, results, tree


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
        self.options = store_options(options, storage_options)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = False
        #: The cut this save writes (known on every rank once the plans are scattered).
        self.cut: str | None = None
        #: What ``finish`` committed (the coordinator's), None before.
        self.info: Any = None
        self._store: Store | None = None
        self._pending: spi.PendingCut | None = None
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
        items, results, tree = _items_of(plan, planner, where, self.url)
        intent = spi.CutIntent(tree=tree, mode="dcp", world_size=where.world_size)
        if where.world_size == 1:
            # One rank's part is kept by the cut itself, several ranks' in their records: one write path.
            if self._pending is None or self._pending.id != where.cut:
                raise UsageError("a cut of one rank is written by its coordinator", store=self.url, cut=where.cut)
            files, arrays = self._pending.write(items)
            self._pending.publish(files, arrays, intent)
        elif self.is_coordinator and self._store is not None:
            self._write_part(self._store, where, items, intent)
        else:
            # Another rank: a participant handle writes its part into the cut its coordinator marked
            # (no lock, no commit: issue 20, read-only handles write nothing).
            with spi.open_participant(self.url, self.options) as store:
                self._write_part(store, where, items, intent)
        return done(results)

    @staticmethod
    def _write_part(store: Store, where: CutPlan, items: list[ArrayItem], intent: spi.CutIntent) -> None:
        part = spi.rank_part(store, where.cut, where.step, where.rank, where.world_size)
        files, arrays = part.write(items)
        part.publish(files, arrays, intent)

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
            info = pending.finish(spi.CutIntent(tags=list(self.tags), final=self.final, metadata={METADATA_KEY: doc},
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


__all__ = ["CutPlan", "StoreWriter"]
