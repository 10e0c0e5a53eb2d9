"""One rank of the listing-at-scale job (issue 24): the collective paths over a store whose storage counts
every call, per phase, so the test can say which rank listed where.

Started by ``rankkit.run_job(..., worker=LISTING_WORKER)``. The storage is a real
:class:`~ckptstore.storage.PosixStorage` (passed to ``Store.open`` as the URL), only counting.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

import ckptstore
from ckptstore.storage import PosixStorage
from ckptstore.writer import Checkpointer
from ranks.rankkit import failure, worker_main

class CountingStorage(PosixStorage):
    """Counts ``list_dir`` (a listing: what 512 ranks must not do at once) and the reads, by the phase the
    job is in (``phase``); writes are not counted."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.phase = "start"
        self.calls: dict[str, Counter[str]] = {}
        self.listed: dict[str, list[str]] = {}

    def _count(self, verb: str, rel: str) -> None:
        self.calls.setdefault(self.phase, Counter())[verb] += 1
        if verb == "list_dir":
            self.listed.setdefault(self.phase, []).append(rel)

    # Every read verb of the storage seam, each counted, then done by PosixStorage itself.
    def list_dir(self, rel: str) -> Any:
        self._count("list_dir", rel)
        return super().list_dir(rel)

    def read_bytes(self, rel: str) -> bytes:
        self._count("read_bytes", rel)
        return super().read_bytes(rel)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        self._count("read_range", rel)
        return super().read_range(rel, start, end)

    def open_reader(self, rel: str) -> Any:
        self._count("open_reader", rel)
        return super().open_reader(rel)

    def exists(self, rel: str) -> bool:
        self._count("exists", rel)
        return super().exists(rel)

    def size(self, rel: str) -> int:
        self._count("size", rel)
        return super().size(rel)

    def map_file(self, rel: str) -> Any:
        self._count("map_file", rel)
        return super().map_file(rel)


def state_of(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((rank + 2, 3), float(step)), "rank": rank, "step": step}


def scenario_paths(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every collective path once, each under its own phase name."""
    rank, world = cfg["rank"], dist.group.WORLD
    storage = CountingStorage(cfg["url"])

    def phase(name: str) -> None:
        storage.phase = name

    phase("open")
    store = ckptstore.Store.open(storage, create=True, group=world, rank_timeout=30)
    phase("save")
    for step in (1, 2):
        store.save(state_of(rank, step), step=step)
    phase("load-latest")
    loaded = store.load(rank=rank)
    phase("latest")
    latest = store.latest()
    phase("restore")
    resumed = ckptstore.restore(store, rng=False, group=world)
    phase("restore-fallback")
    ckptstore.restore(store, rng=False, fallback=True, group=world)
    phase("prune-gc")
    refused = []
    for name, call in (("prune", lambda: store.prune(ckptstore.KeepLast(1))), ("gc", store.gc)):
        try:
            call()
        except ckptstore.UsageError:  # rank 0's job: the others are refused before they read anything
            refused.append(name)
    phase("checkpointer")
    ck = Checkpointer(store, group=world, mode="thread", every=1, keep=ckptstore.KeepLast(1))
    phase("checkpointer-cut")
    for step in (3, 4):
        ck.cut(step, state_of(rank, step)).wait(60)
    phase("checkpointer-close")
    ck.close()
    phase("close")
    store.close()
    phase("restore-url")
    ckptstore.restore(storage, rng=False, group=world, rank_timeout=30)
    phase("open-readonly")
    with ckptstore.Store.open(storage, readonly=True, group=world, rank_timeout=30) as reader:
        phase("readonly-load-latest")
        again = reader.load(rank=rank)
    phase("broken-latest")
    broken = _checkpointer_on_a_broken_latest(storage, rank)
    phase("end")
    return {"calls": {p: dict(c) for p, c in storage.calls.items()}, "listed": storage.listed,
            "loaded_step": loaded["step"], "latest": latest.to_json() if latest else None,
            "resumed_step": resumed.step, "again_step": again["step"], "refused": refused,
            "broken": broken}


def _checkpointer_on_a_broken_latest(storage: CountingStorage, rank: int) -> dict[str, Any]:
    """LATEST broken after the open: rank 0's Checkpointer finds it and every rank raises (rank 1
    hears it in the ready exchange, having read nothing)."""
    with ckptstore.Store.open(storage, group=dist.group.WORLD, rank_timeout=30) as store:
        if rank == 0:
            with open(os.path.join(storage.root, "LATEST"), "wb") as f:
                f.write(b"{broken")
        dist.barrier()
        try:
            Checkpointer(store, group=dist.group.WORLD, mode="thread").close()
        except ckptstore.CkptStoreError as exc:
            return failure(exc)
    return {"ok": True}


if __name__ == "__main__":
    worker_main(globals())
