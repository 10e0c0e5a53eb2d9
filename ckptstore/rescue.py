"""Finishing a cut whose trainer died after handing it over: what the writer process does then.

The trainer's commit thread normally commits each cut. If the trainer dies (SIGKILL, OOM, a CUDA
error) once its writer process has the cut's bytes and the plan for finishing it, the writer process
finishes it alone, under the lock it inherited (:class:`~ckptstore.lock.InheritedLock`): a cut of one
rank is marked (when the trainer died before marking it) and committed; in a cut of several ranks
every rank's writer publishes its rank record, and rank 0's writer waits for all records and commits
(or abandons the cut when a record does not come within ``rank_timeout`` of the last one that did).
Steps and invariants are the protocol's own (:mod:`ckptstore.protocol`); the same code paths commit.
"""

from __future__ import annotations

import time
from typing import Callable

from . import layout
from .errors import StorageError
from .intent import CutIntent
from .manifest import FileRecord, TensorRecord
from .pending import PendingCut, RankPart
from .protocol import CommitProtocol
from .recovery import classify, scan
from .storage import Storage

Log = Callable[[str], None]


def ensure_marked(storage: Storage, guard: Callable[[], None], *, cut: str, step: int, mode: str) -> None:
    """Marks ``cut`` unless its trainer did before it died: a rescuer marks before it writes a shard,
    so no shard ever precedes its cut's mark (issue 20)."""
    if not storage.exists(layout.mark_path(cut)):
        guard()
        CommitProtocol(storage, guard=guard).mark(cut, step, f"rescue:{mode}")


def finish_orphaned_cut(storage: Storage, guard: Callable[[], None], *, cut: str, step: int, rank: int,
                        files: list[FileRecord], tensors: list[TensorRecord], intent: CutIntent,
                        rank_timeout: float, log: Log = lambda _m: None) -> str:
    """Finishes ``cut`` from the files this process wrote, committing ``intent`` (what the trainer's
    commit thread would have, recorded as written by "rescue:<mode>"); returns "committed",
    "published" (a rank other than 0 published its record) or "abandoned". Raises what the storage
    raises."""
    protocol = CommitProtocol(storage, guard=guard)
    mode, world_size = intent.mode, intent.world_size
    writer = f"rescue:{mode}"
    recorded = intent.as_recorded(writer)
    if world_size > 1:
        RankPart(protocol, storage, cut, step, rank, world_size).publish(files, tensors, recorded)
        if rank != 0:
            return "published"
    pending = PendingCut(protocol, storage, cut, step, writer, on_end=lambda _p: None, world_size=world_size)
    latest = classify(scan(storage)).latest
    if latest is not None and latest.cut == cut:
        return "committed"  # the trainer got there before it died
    if latest is not None and latest.step >= step:
        log(f"LATEST is at step {latest.step} already; abandoning cut {cut}")
        pending.abandon()
        return "abandoned"
    ensure_marked(storage, guard, cut=cut, step=step, mode=mode)  # the trainer died before marking it
    if world_size == 1:  # the part is kept by the cut itself (several ranks: in their records)
        pending.publish(files, tensors, recorded)
    else:
        have, since = -1, time.monotonic()
        while True:
            missing = pending.missing_ranks()
            if not missing:
                break
            if len(missing) != have:
                have, since = len(missing), time.monotonic()
            elif time.monotonic() - since > rank_timeout:
                log(f"rank(s) {missing} published nothing for {rank_timeout:g} s; abandoning cut {cut}")
                pending.abandon()
                return "abandoned"
            time.sleep(0.2)
    pending.collect_ranks()
    sizes = {e.name: e.size for e in storage.list_dir(layout.cut_dir(cut)) if not e.is_dir}
    gone = [f.name for f in pending.files() if sizes.get(f.name) != f.nbytes]
    if gone:  # the trainer was abandoning the cut when it died
        log(f"files {gone[:3]} of cut {cut} are gone or cut short; abandoning it")
        pending.abandon()
        return "abandoned"
    pending.files_durable()
    try:
        pending.commit(recorded)
    except StorageError:
        if pending.state == "unknown":
            return "unknown"
        raise
    return "committed"
