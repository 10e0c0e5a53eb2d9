"""One rank of a job that mirrors its cuts rank by rank (issue 21, "Several ranks"); started by
``rankkit.run_job(..., worker=WORKER)`` from tests/ranks/test_mirror_ranks.py.

Every rank saves into the job's one local store (``group=``), then mirrors its own part of each cut with
``spi.mirror_rank``: rank 0 through the mirror's writer, the others through participants, as each
rank's writer process will. A victim rank may be SIGKILLed at a protocol phase of the mirror's cut.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch.distributed as dist

import ckptstore
from ckptstore import layout, spi
from ranks.rank_worker import same, state_of
from ranks.rankkit import failure, worker_main


def _local(cfg: dict[str, Any], **kw: Any) -> ckptstore.Store:
    return ckptstore.Store.open(cfg["url"], group=dist.group.WORLD, rank_timeout=cfg["rank_timeout"], **kw)


def _mirror(cfg: dict[str, Any], kill_cut: str | None = None) -> ckptstore.Store:
    """The mirror as this rank's uploads open it; ``kill_cut``: this rank dies once its files of that cut
    are durable on the mirror, before its record (phase "shards-synced" of its rank part)."""
    def on_phase(name: str, cut: str) -> None:
        if cut == kill_cut and name == "shards-synced":
            os.kill(os.getpid(), signal.SIGKILL)

    opts = ckptstore.StoreOptions(on_phase=on_phase)
    if cfg["rank"] == 0:
        return ckptstore.Store.open(cfg["mirror"], options=opts)
    return spi.open_participant(cfg["mirror"], opts)


def _save_and_mirror(cfg: dict[str, Any], steps: list[int]) -> tuple[ckptstore.Store, list[str], list[Any]]:
    """Saves ``steps`` into the local store and mirrors each cut, each rank its own part."""
    local = _local(cfg, create=True)
    cuts = [local.save(state_of(cfg["rank"], s), step=s).id for s in steps]
    with _mirror(cfg) as mirror:
        got = [spi.mirror_rank(local, mirror, c, cfg["rank"], rank_timeout=cfg["rank_timeout"]) for c in cuts]
    return local, cuts, [None if g is None else g.to_json() for g in got]


def scenario_mirror(cfg: dict[str, Any]) -> dict[str, Any]:
    local, cuts, got = _save_and_mirror(cfg, [1, 2])
    local.close()
    return {"ok": True, "cuts": cuts, "infos": got}


def scenario_fail(cfg: dict[str, Any]) -> dict[str, Any]:
    """Step 1 mirrored by both ranks; then rank 1 fails its part of the mirror's next cut twice: step 2
    with its local file damaged, step 3 SIGKILLed after its files landed, before its record."""
    rank = cfg["rank"]
    local = _local(cfg, create=True)
    # Every save first: a save is collective, and a rank waiting on the mirror is in no group call.
    first, *later = [local.save(state_of(rank, s), step=s).id for s in (1, 2, 3)]
    with _mirror(cfg) as mirror:
        spi.mirror_rank(local, mirror, first, rank, rank_timeout=cfg["rank_timeout"])
    out: dict[str, Any] = {"ok": True, "first": first}
    for cut, how in zip(later, ("corrupt", "kill")):
        if rank == 1 and how == "corrupt":
            name = next(f.name for f in local.manifest(cut).files if f.rank == 1)
            path = os.path.join(cfg["url"], layout.cut_file(cut, name))
            with open(path, "r+b") as f:  # the last byte flipped: an array's bytes, the size unchanged
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
        dist.barrier()  # both ranks past the previous cut: rank 1's wait for the mark starts with rank 0's
        t0 = time.monotonic()
        with _mirror(cfg, kill_cut=cut if how == "kill" and rank == 1 else None) as mirror:
            try:
                spi.mirror_rank(local, mirror, cut, rank, rank_timeout=cfg["rank_timeout"])
                out[how] = {"ok": True}
            except ckptstore.CkptStoreError as exc:
                out[how] = {**failure(exc), "store": exc.store, "cut": exc.cut, "path": exc.path}
        out[how].update(expected_cut=cut, seconds=time.monotonic() - t0)
        with open(os.path.join(cfg["out_dir"], f"partial{rank}.json"), "w") as f:
            json.dump(out, f)  # what this rank saw so far: a rank killed later writes no result
    local.close()
    return out


def scenario_restore(cfg: dict[str, Any]) -> dict[str, Any]:
    """Two cuts mirrored; rank 1 loses its local files of the newer one (its node's tier is gone); then
    restore(group=) across the tiers, without fallback and with it."""
    rank = cfg["rank"]
    local, cuts, _ = _save_and_mirror(cfg, [1, 2])
    if rank == 1:
        for f in local.manifest(cuts[1]).files:
            if f.rank == 1:
                os.remove(os.path.join(cfg["url"], layout.cut_file(cuts[1], f.name)))
    local.close()
    dist.barrier()  # rank 1's files are gone before any rank restores
    out: dict[str, Any] = {"ok": True, "cuts": cuts}
    for fallback in (False, True):
        with _local(cfg, mirror=cfg["mirror"]) as store:
            got = ckptstore.restore(store, fallback=fallback, rng=False)
        assert got is not None
        out[str(fallback)] = {"cut": got.cut.id, "tier": got.tier, "same": same(got.state, state_of(rank, 2)),
                              "skipped": got.skipped}
    return out


if __name__ == "__main__":
    worker_main(globals())
