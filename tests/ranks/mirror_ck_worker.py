"""One rank of a Checkpointer(group=, mirror=) job (issue 21, "Several ranks", the writer side);
started by ``rankkit.run_job(..., worker=WORKER)`` from tests/ranks/test_mirror_checkpointer.py.

Every rank's local tier is the job's one local store (``group=``); the mirror is a second directory.
Each rank's mirror tier (its writer process, or a thread with ``mode="thread"``) uploads its own
files of every cut rank 0 marks there; rank 0 commits. A victim rank may SIGKILL itself (its whole
job: thread mode runs the tier in the trainer) once its files of a cut are durable on the mirror.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import torch.distributed as dist

import ckptstore
from ckptstore import layout
from ranks.rank_worker import same, state_of
from ranks.rankkit import failure, worker_main


def _checkpointer(cfg: dict[str, Any], **kw: Any) -> tuple[Any, list[dict[str, Any]]]:
    from ckptstore.writer import Checkpointer

    events: list[dict[str, Any]] = []
    ck = Checkpointer(cfg["url"], group=dist.group.WORLD, rank_timeout=cfg["rank_timeout"], every=1,
                      mode=cfg.get("mode", "process"), on_event=events.append, mirror=cfg["mirror"],
                      mirror_timeout=cfg.get("mirror_timeout", 30.0), mirror_retry_s=0.2, **kw)
    return ck, events


def _mirrored(events: list[dict[str, Any]]) -> list[str]:
    return [e["cut"] for e in events if e["event"] == "mirrored"]


def scenario_cuts(cfg: dict[str, Any]) -> dict[str, Any]:
    """Three cuts (the last final) mirrored by both ranks; then the local tier is removed and every
    rank restores its part from the mirror (restore(group=) across tiers)."""
    rank = cfg["rank"]
    ck, events = _checkpointer(cfg, keep=ckptstore.KeepLast(1))
    cuts = [ck.cut(s, state_of(rank, s)).wait().id for s in (1, 2)]
    final = ck.cut(3, state_of(rank, 3), final=True)
    # cut(final=True) returns once the cut is committed on the mirror too, on every rank
    on_mirror_at_final = os.path.exists(os.path.join(cfg["mirror"], layout.manifest_path(final.id)))
    cuts.append(final.id)
    ck.close()
    out: dict[str, Any] = {"ok": True, "cuts": cuts, "mirrored": _mirrored(events),
                           "on_mirror_at_final": on_mirror_at_final,
                           "failed": [e for e in events if e["event"] == "mirror-failed"]}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(cfg["url"])  # the node's local tier is gone
    dist.barrier()
    with ckptstore.Store.open(cfg["url"], create=True, group=dist.group.WORLD, rank_timeout=cfg["rank_timeout"],
                              mirror=cfg["mirror"]) as store:
        got = ckptstore.restore(store, fallback=True, rng=False)
    assert got is not None
    out["restored"] = {"cut": got.cut.id, "tier": got.tier, "same": same(got.state, state_of(rank, 3))}
    return out


def scenario_kill(cfg: dict[str, Any]) -> dict[str, Any]:
    """Step 1 mirrored by both ranks; rank 1 dies (SIGKILL, thread mode: its whole job) once its
    files of step 2 are durable on the mirror, before its rank record."""
    rank = cfg["rank"]

    def on_phase(name: str, cut: str) -> None:
        if rank == 1 and name == "shards-synced" and layout.step_of_cut_id(cut) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    ck, events = _checkpointer(cfg, mirror_options=ckptstore.StoreOptions(on_phase=on_phase))
    first = ck.cut(1, state_of(rank, 1), final=True).id
    second = ck.cut(2, state_of(rank, 2)).wait().id
    out: dict[str, Any] = {"ok": True, "first": first, "second": second}
    deadline = time.monotonic() + 30  # rank 0's tier gives the cut up within rank_timeout
    while time.monotonic() < deadline and not [e for e in events if e["event"] == "mirror-failed"]:
        time.sleep(0.05)
    out["failed"] = [e for e in events if e["event"] == "mirror-failed"]
    out["mirrored"] = _mirrored(events)
    try:
        ck.close_locally()  # rank 1 is gone: no collective close
    except ckptstore.CkptStoreError as exc:
        out["close"] = failure(exc)
    return out


if __name__ == "__main__":
    worker_main(globals())
