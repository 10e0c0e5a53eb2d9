"""bench_ranks' child processes: the 1-rank job's one process and each rank of the 2-rank job; each
builds its state, measures, and writes its result as JSON for the parent (split out of bench_ranks.py,
issue 20). torch and ckptstore are imported inside the functions, so the parent imports this module
without them."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from benchkit import REPO, fsync_dcp_dir, rotate, settle
from benchstate import med

MIB = 1 << 20
NTENSORS = 16


def build_state(mib: int, rank: int) -> tuple[dict[str, Any], int]:
    """This rank's state: ``mib`` MiB of fp32 randn (seeded by rank) in NTENSORS tensors of shape (16 * mib, 1024)
    named ``rank<r>.t<i>``; returns it and its bytes."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    rows = mib * MIB // 4 // NTENSORS // 1024
    state = {f"rank{rank}.t{i:02d}": torch.randn(rows, 1024, generator=g) for i in range(NTENSORS)}
    return state, sum(t.numel() * t.element_size() for t in state.values())


class EventLog:
    """on_event sink: every event with the CLOCK_MONOTONIC time it arrived (comparable across processes)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, e: dict[str, Any]) -> None:
        self.events.append({**e, "_t": time.monotonic()})

    def since(self, n: int, kind: str) -> dict[str, Any]:
        return next((e for e in self.events[n:] if e["event"] == kind), {})


def memcpy_floor(image: Any) -> float:
    """The memcpy floor of one repetition: the median of 3 consecutive copies (one copy alone is noisy here)."""
    return med([image.copy_in().wall_s for _ in range(3)])


def ck_sample(ck: Any, log: EventLog, step: int, state: Any) -> dict[str, Any]:
    """One timed ckptstore cut (the caller has settled and synchronised the ranks)."""
    n = len(log.events)
    a = time.monotonic()
    t0 = time.perf_counter()
    h = ck.cut(step, state)
    t1 = time.perf_counter()
    h.wait()
    t2 = time.perf_counter()
    cap, wr, com = log.since(n, "captured"), log.since(n, "written"), log.since(n, "committed")
    return {"start": a, "stall_s": t1 - t0, "c2c_s": t2 - t0, "capture_s": cap.get("stall_s"),
            "written_at": wr.get("_t"), "written": wr.get("timings", {}), "written_bytes": wr.get("bytes"),
            "committed_at": com.get("_t"), "commit_s": (com.get("timings") or {}).get("commit"),
            "total_s": (com.get("timings") or {}).get("total"), "fallback": wr.get("fallback") or com.get("fallback")}


def child_one(args: argparse.Namespace) -> dict[str, Any]:
    """The 1-rank job: memcpy floor, disk floor (1x) and one cut per repetition."""
    import torch
    from benchfloors import AlignedImage, odirect_write
    from ckptstore import KeepLast
    from ckptstore.writer import Checkpointer

    state, nbytes = build_state(args.mib_per_rank, 0)
    image = AlignedImage(list(state.values()))
    image.copy_in()
    fdir = os.path.join(args.scratch, "floor")
    os.makedirs(fdir)
    log = EventLog()
    ck = Checkpointer(os.path.join(args.scratch, "store"), every=1, busy="wait", on_event=log)
    t0 = time.perf_counter()
    ck.cut(0, state).wait()
    out: dict[str, Any] = {"nbytes": nbytes, "threads": torch.get_num_threads(), "warmup_s": time.perf_counter() - t0,
                           "memcpy": [], "disk1": [], "ck": [], "notes": []}
    step = 0

    def cut(rep: int) -> None:
        nonlocal step
        step += 1
        ck.store.prune(KeepLast(1))
        settle(args.settle)
        out["ck"].append({"rep": rep, **ck_sample(ck, log, step, state)})

    def disk(rep: int) -> None:
        settle(args.settle)
        try:
            out["disk1"].append(odirect_write(fdir, image.view).wall_s)
        except OSError as exc:
            out["notes"].append(f"disk floor skipped: {exc}")

    for rep in range(args.reps):
        out["memcpy"].append(memcpy_floor(image))
        for fn in rotate([cut, disk], rep):
            fn(rep)
    ck.close()
    image.close()
    return out


class RankJob:
    """One rank of the 2-rank job: its state, the floors' images, its Checkpointer, its DCP directories and
    the result, with a method per timed step (every rank runs the same steps in the same order)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from benchfloors import AlignedImage
        from ckptstore.writer import Checkpointer

        self.args, self.dist, self.dcp = args, dist, dcp
        rank, world = args.rank, args.world
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
        self.state, nbytes = build_state(args.mib_per_rank, rank)
        self.image = AlignedImage(list(self.state.values()))
        self.image.copy_in()
        self.image2 = None
        self.fdir = os.path.join(args.scratch, "floor")
        if rank == 0:
            # the job's bytes: world x this rank's, one file
            self.image2 = AlignedImage(list(self.state.values()) * world)
            self.image2.copy_in()
            os.makedirs(self.fdir)
        dist.barrier()
        self.log = EventLog()
        self.ck = Checkpointer(os.path.join(args.scratch, "store"), every=1, group=dist.group.WORLD, rank_timeout=60,
                               busy="wait", on_event=self.log)
        self.dirs: list[str] = []
        self.step = 0
        self.out: dict[str, Any] = {
            "rank": rank, "world": world, "nbytes": nbytes, "threads": torch.get_num_threads(),
            "memcpy_alone": [], "memcpy_both": [], "disk2": [], "ck": [], "dcp_async": [], "dcp_save": [],
            "warmup": {}, "notes": [], "image2_bytes": self.image2.size if self.image2 is not None else None}

    def synced_settle(self) -> None:
        self.dist.barrier()
        if self.rank == 0:
            settle(self.args.settle)
        self.dist.barrier()

    def dcp_dir(self, kind: str, step: int) -> str:
        d = os.path.join(self.args.scratch, f"dcp-{kind}-{step}")
        self.dirs.append(d)
        return d

    def drop_dcp_dirs(self) -> None:
        self.dist.barrier()
        if self.rank == 0:
            for d in self.dirs:
                shutil.rmtree(d, ignore_errors=True)
        self.dirs.clear()

    def run_async(self, step: int) -> dict[str, Any]:
        dcp = self.dcp
        d = self.dcp_dir("async", step)
        a = time.monotonic()
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, checkpoint_id=d)
        t1 = time.perf_counter()
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse where a stager is in use
        fut.result()
        if self.rank == 0:
            fsync_dcp_dir(d)
        t2 = time.perf_counter()
        return {"start": a, "stall_s": t1 - t0, "c2c_s": t2 - t0}

    def run_save(self, step: int) -> dict[str, Any]:
        dcp = self.dcp
        d = self.dcp_dir("save", step)
        a = time.monotonic()
        t0 = time.perf_counter()
        dcp.save(self.state, checkpoint_id=d)
        if self.rank == 0:
            fsync_dcp_dir(d)
        t1 = time.perf_counter()
        return {"start": a, "stall_s": t1 - t0, "c2c_s": t1 - t0}

    def warm_up(self) -> None:
        """ckptstore's first cut starts the writer and makes the block; DCP's first saves build its caches."""
        dist, dcp, out = self.dist, self.dcp, self.out
        dist.barrier()
        t0 = time.perf_counter()
        self.ck.cut(0, self.state).wait()
        out["warmup"]["ck"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, checkpoint_id=self.dcp_dir("async", 0))
        getattr(fut, "upload_completion", fut).result()
        out["warmup"]["dcp_async"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(self.state, checkpoint_id=self.dcp_dir("save", 0))
        out["warmup"]["dcp_save"] = time.perf_counter() - t0

    def do_ck(self, rep: int) -> None:
        from ckptstore import KeepLast

        if self.rank == 0:
            self.ck.store.prune(KeepLast(1))
        self.synced_settle()
        self.out["ck"].append({"rep": rep, **ck_sample(self.ck, self.log, self.step, self.state)})

    def do_async(self, rep: int) -> None:
        self.drop_dcp_dirs()
        self.synced_settle()
        self.out["dcp_async"].append({"rep": rep, **self.run_async(self.step)})

    def do_save(self, rep: int) -> None:
        self.drop_dcp_dirs()
        self.synced_settle()
        self.out["dcp_save"].append({"rep": rep, **self.run_save(self.step)})

    def do_disk(self, rep: int) -> None:
        from benchfloors import odirect_write

        self.synced_settle()
        if self.rank == 0:
            assert self.image2 is not None
            try:
                self.out["disk2"].append(odirect_write(self.fdir, self.image2.view).wall_s)
            except OSError as exc:
                self.out["notes"].append(f"disk floor skipped: {exc}")
        self.dist.barrier()

    def run(self) -> None:
        """Per repetition: the memcpy floors (rank 0 alone, then both ranks at once), then the disk floor, the
        ckptstore cut, the DCP async_save and the DCP save in an order rotated per repetition."""
        for rep in range(self.args.reps):
            self.step += 1
            self.dist.barrier()
            if self.rank == 0:
                self.out["memcpy_alone"].append(memcpy_floor(self.image))
            self.dist.barrier()
            self.out["memcpy_both"].append(memcpy_floor(self.image))
            for fn in rotate([self.do_disk, self.do_ck, self.do_async, self.do_save], rep):
                fn(rep)

    def close(self) -> dict[str, Any]:
        self.drop_dcp_dirs()
        self.ck.close()
        self.dist.barrier()
        self.dist.destroy_process_group()
        self.image.close()
        if self.image2 is not None:
            self.image2.close()
        return self.out


def child_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the 2-rank job: floors, a ckptstore cut, a DCP async_save and a DCP save per repetition."""
    import torch

    torch.set_num_threads(args.threads_per_rank)
    job = RankJob(args)
    job.warm_up()
    job.run()
    return job.close()


def child_main(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, REPO)
    result = child_one(args) if args.child == "one" else child_rank(args)
    import torch

    import ckptstore

    result["torch_version"] = torch.__version__
    result["ckptstore_version"] = ckptstore.__version__
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0
