"""Benchmark of the Checkpointer with 2 ranks beside 1 rank, and beside DCP's async_save on the same 2-rank job.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_ranks.py [--mib-per-rank 256] [--reps 3] [--settle 4] [--out docs/benchmarks-ranks.md]

Every rank holds the same kind of state: ``--mib-per-rank`` MiB of fp32 ``torch.randn`` in a flat dict of
16 tensors (16 x (16 * MiB) x 1024), seeded by rank, named ``rank<r>.t<i>`` (distinct names, so DCP's
planner writes every rank's bytes instead of deduplicating them as replicated). Two jobs run one after the
other, each in fresh processes of this script (the parent only orchestrates and renders; it does not
import torch):

* **1-rank job** (one process, torch's default thread count): ``Checkpointer(url, every=1, busy="wait")``
  without a group. Per repetition: the memcpy floor, then in an order rotated per repetition the disk
  floor of the rank's bytes and one cut.
* **2-rank job** (two processes, gloo over TCP on 127.0.0.1, ``--threads-per-rank`` torch threads each,
  default 1 as torchrun's OMP_NUM_THREADS=1): ``Checkpointer(url, every=1, group=WORLD, rank_timeout=60,
  busy="wait")``, DCP ``async_save`` (the default thread executor) and DCP ``save``, all on the same
  state of the same processes. Per repetition: the memcpy floors (rank 0 alone, then both ranks at
  once), then in an order rotated per repetition the disk floor of 2x the per-rank bytes (written by
  rank 0 while rank 1 waits), one ckptstore cut, one DCP async_save and one DCP save.

Each method is warmed up once first (ckptstore's first cut starts the writer process and allocates and
prefaults the shared block; DCP's first save builds its plan caches). Before every timed cut, save and
disk floor: old cuts / DCP directories are removed (rank 0), then ``os.sync()`` and ``--settle`` s of
idle, then a barrier (both ranks start together). Timings per rank:

* **stall**: the time ``ck.cut(step, state)`` / ``dcp.async_save(...)`` takes to return (the training
  loop's pause); for ``dcp.save`` the whole call.
* **capture-to-committed**: from just before that call until ``h.wait()`` returns (ckptstore: LATEST
  durable, on rank 1 once rank 0's commit outcome is read) / the future's ``result()`` returns plus, on
  rank 0, an fsync of the checkpoint directory and its parent (DCP fsyncs its files but not the
  directory entries) / ``dcp.save`` returns plus the same directory fsyncs.

A job's figure per repetition is the slowest rank's (the next collective waits for it). Floors
(benchfloors.py, on the ranks' own bytes): a plain memcpy (``copy_`` of every tensor into prefaulted
page-aligned memory; the median of 3 copies per repetition) of one rank's bytes, alone and on both
ranks at once (the slower), and the disk's O_DIRECT write + fsync (file, dir) of the 1-rank job's bytes
and of 2x the per-rank bytes. The 2-rank rows are judged against the both-at-once memcpy and the 2x disk
floor, the 1-rank row against the 1-rank job's own memcpy and 1x disk floor. Ratios are paired per repetition, then median (min-max).
No targets are set (the issue asks for a report); speed is never asserted in tests.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchkit import fsync_dcp_dir
from benchstate import fmt, machine_lines, med
from benchtargets import DASH, Judge, Target, table as md_table

GB = 1e9
MIB = 1 << 20
NTENSORS = 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The issue sets no targets for this benchmark; add them here (judged on the median, as elsewhere).
TARGETS: dict[str, Target] = {}


# ==================================================================================================
# children (import torch)


def build_state(mib: int, rank: int) -> tuple[dict[str, Any], int]:
    """This rank's state: ``mib`` MiB of fp32 randn (seeded by rank) in NTENSORS tensors of shape (16 * mib, 1024)
    named ``rank<r>.t<i>``; returns it and its bytes."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    rows = mib * MIB // 4 // NTENSORS // 1024
    state = {f"rank{rank}.t{i:02d}": torch.randn(rows, 1024, generator=g) for i in range(NTENSORS)}
    return state, sum(t.numel() * t.element_size() for t in state.values())


def settle(s: float) -> None:
    """os.sync(), then idle: the virtio disk's flush pays for whatever the host still has to persist (the
    previous write, the discards of deleted files), so every timed write starts from the same state."""
    os.sync()
    time.sleep(s)


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
        order = [cut, disk]
        for fn in order[rep % 2:] + order[:rep % 2]:
            fn(rep)
    ck.close()
    image.close()
    return out


def child_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the 2-rank job: floors, a ckptstore cut, a DCP async_save and a DCP save per repetition."""
    import torch

    torch.set_num_threads(args.threads_per_rank)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from benchfloors import AlignedImage, odirect_write
    from ckptstore import KeepLast
    from ckptstore.writer import Checkpointer

    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    state, nbytes = build_state(args.mib_per_rank, rank)
    image = AlignedImage(list(state.values()))
    image.copy_in()
    image2 = None
    fdir = os.path.join(args.scratch, "floor")
    if rank == 0:
        image2 = AlignedImage(list(state.values()) * world)  # the job's bytes: world x this rank's, one file
        image2.copy_in()
        os.makedirs(fdir)
    dist.barrier()

    def synced_settle() -> None:
        dist.barrier()
        if rank == 0:
            settle(args.settle)
        dist.barrier()

    log = EventLog()
    ck = Checkpointer(os.path.join(args.scratch, "store"), every=1, group=dist.group.WORLD, rank_timeout=60,
                      busy="wait", on_event=log)
    dirs: list[str] = []

    def dcp_dir(kind: str, step: int) -> str:
        d = os.path.join(args.scratch, f"dcp-{kind}-{step}")
        dirs.append(d)
        return d

    def drop_dcp_dirs() -> None:
        dist.barrier()
        if rank == 0:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
        dirs.clear()

    def run_async(step: int) -> dict[str, Any]:
        d = dcp_dir("async", step)
        a = time.monotonic()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=d)
        t1 = time.perf_counter()
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse where a stager is in use
        fut.result()
        if rank == 0:
            fsync_dcp_dir(d)
        t2 = time.perf_counter()
        return {"start": a, "stall_s": t1 - t0, "c2c_s": t2 - t0}

    def run_save(step: int) -> dict[str, Any]:
        d = dcp_dir("save", step)
        a = time.monotonic()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=d)
        if rank == 0:
            fsync_dcp_dir(d)
        t1 = time.perf_counter()
        return {"start": a, "stall_s": t1 - t0, "c2c_s": t1 - t0}

    out: dict[str, Any] = {"rank": rank, "world": world, "nbytes": nbytes, "threads": torch.get_num_threads(),
                           "memcpy_alone": [], "memcpy_both": [], "disk2": [], "ck": [], "dcp_async": [],
                           "dcp_save": [], "warmup": {}, "notes": [],
                           "image2_bytes": image2.size if image2 is not None else None}
    # warm-ups: ckptstore's first cut starts the writer and makes the block; DCP's first saves
    dist.barrier()
    t0 = time.perf_counter()
    ck.cut(0, state).wait()
    out["warmup"]["ck"] = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=dcp_dir("async", 0))
    getattr(fut, "upload_completion", fut).result()
    out["warmup"]["dcp_async"] = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=dcp_dir("save", 0))
    out["warmup"]["dcp_save"] = time.perf_counter() - t0
    step = 0

    def do_ck(rep: int) -> None:
        if rank == 0:
            ck.store.prune(KeepLast(1))
        synced_settle()
        out["ck"].append({"rep": rep, **ck_sample(ck, log, step, state)})

    def do_async(rep: int) -> None:
        drop_dcp_dirs()
        synced_settle()
        out["dcp_async"].append({"rep": rep, **run_async(step)})

    def do_save(rep: int) -> None:
        drop_dcp_dirs()
        synced_settle()
        out["dcp_save"].append({"rep": rep, **run_save(step)})

    def do_disk(rep: int) -> None:
        synced_settle()
        if rank == 0:
            assert image2 is not None
            try:
                out["disk2"].append(odirect_write(fdir, image2.view).wall_s)
            except OSError as exc:
                out["notes"].append(f"disk floor skipped: {exc}")
        dist.barrier()

    for rep in range(args.reps):
        step += 1
        dist.barrier()
        if rank == 0:
            out["memcpy_alone"].append(memcpy_floor(image))
        dist.barrier()
        out["memcpy_both"].append(memcpy_floor(image))
        order = [do_disk, do_ck, do_async, do_save]
        k = rep % len(order)
        for fn in order[k:] + order[:k]:
            fn(rep)
    drop_dcp_dirs()
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    image.close()
    if image2 is not None:
        image2.close()
    return out


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


# ==================================================================================================
# parent: orchestration and report (never imports torch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_busy() -> float:
    """System-wide busy CPU seconds (all cores) from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """User + system CPU of this process's waited-for descendants (a rank's writer process included)."""
    t = os.times()
    return t.children_user + t.children_system


def run_job(args: argparse.Namespace, kind: str, world: int) -> list[dict[str, Any]] | dict[str, Any]:
    """Runs one job (``world`` processes of this script); returns each rank's result, or {"error": ...}."""
    scratch = os.path.join(args.scratch_root, kind)
    os.makedirs(scratch)
    port = _free_port()
    base = [sys.executable, os.path.abspath(__file__), "--child", kind, "--mib-per-rank", str(args.mib_per_rank),
            "--reps", str(args.reps), "--settle", str(args.settle), "--scratch", scratch,
            "--threads-per-rank", str(args.threads_per_rank), "--port", str(port), "--world", str(world)]
    jsons = [os.path.join(args.scratch_root, f"{kind}-{r}.json") for r in range(world)]
    print(f"[{time.strftime('%H:%M:%S')}] {kind} job, {world} process(es) (load {os.getloadavg()[0]:.2f}) ...", flush=True)
    load = os.getloadavg()[0]
    b0, c0 = cpu_busy(), children_cpu()
    t0 = time.perf_counter()
    procs = [subprocess.Popen([*base, "--rank", str(r), "--json", jsons[r]], start_new_session=True, cwd=REPO)
             for r in range(world)]
    rcs: list[Any] = []
    try:
        for p in procs:
            left = max(1.0, args.timeout - (time.perf_counter() - t0))
            try:
                rcs.append(p.wait(timeout=left))
            except subprocess.TimeoutExpired:
                rcs.append("timeout")
    finally:
        for p in procs:  # anything a child left behind (its writer process) goes with its session
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t0
    cores = ((cpu_busy() - b0), (children_cpu() - c0))
    args.job_lines.append(f"{kind} job: {wall:.0f} s, 1-minute load at its start {load:.2f}; CPU of its processes "
                          f"{cores[1] / wall:.2f} cores, of everything else (other processes, kernel I/O threads) "
                          f"{max(0.0, cores[0] - cores[1]) / wall:.2f} cores (/proc/stat)")
    if any(rc != 0 for rc in rcs) or not all(os.path.exists(j) for j in jsons):
        print(f"    FAILED (exit {rcs}) after {wall:.0f} s", flush=True)
        return {"error": f"exit status per rank {rcs}", "wall": wall}
    res = []
    for j in jsons:
        with open(j) as f:
            res.append(json.load(f))
        os.unlink(j)
    print(f"    done in {wall:.0f} s", flush=True)
    return res


def ratio_list(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def job_values(ranks: list[dict[str, Any]], method: str, key: str) -> list[float]:
    """Per repetition, the slowest rank's value."""
    per_rep: dict[int, list[float]] = {}
    for r in ranks:
        for s in r[method]:
            per_rep.setdefault(s["rep"], []).append(s[key])
    return [max(v) for _, v in sorted(per_rep.items())]


def _gbps(nbytes: int, secs: list[float]) -> list[float]:
    return [nbytes / GB / x for x in secs]


def xcell(xs: list[float], bold: bool = False) -> str:
    if not xs:
        return "n/a"
    s = f"{fmt(xs)}x"
    return f"**{s}**" if bold else s


def report(args: argparse.Namespace, one: Any, two: Any, cmd: str, started: str, wall: float,
           loads: tuple[str, str]) -> str:
    J = Judge(TARGETS)
    L: list[str] = []
    ok1, ok2 = isinstance(one, list), isinstance(two, list)
    nb = (one[0]["nbytes"] if ok1 else two[0]["nbytes"] if ok2 else args.mib_per_rank * MIB)
    L += [f"Per rank: {NTENSORS} fp32 tensors, {nb:,} bytes ({nb / GB:.3f} GB); a 2-rank cut holds "
          f"{2 * nb:,} bytes. {args.reps} repetitions after one warm-up per method; figures are median (min-max) "
          "over the repetitions, each repetition's figure the slowest rank's; ratios are paired per repetition. "
          "GB = 1e9 bytes.", ""]
    if not ok1:
        L += [f"**The 1-rank job failed: {one['error']}**", ""]
    if not ok2:
        L += [f"**The 2-rank job failed: {two['error']}**", ""]

    # ---- floors
    rows = []
    if ok1:
        o = one[0]
        rows.append([f"plain memcpy of one rank's bytes, 1-rank job (torch threads {o['threads']})",
                     fmt(o["memcpy"], 4), fmt(_gbps(nb, o["memcpy"]))])
    if ok2:
        r0 = two[0]
        both = [max(x) for x in zip(*(r["memcpy_both"] for r in two))]
        rows.append([f"plain memcpy of one rank's bytes, rank 0 of the 2-rank job alone (torch threads {r0['threads']})",
                     fmt(r0["memcpy_alone"], 4), fmt(_gbps(nb, r0["memcpy_alone"]))])
        rows.append([f"plain memcpy of one rank's bytes on both ranks at once, the slower (torch threads "
                     f"{r0['threads']} each); the 2-rank stall floor", fmt(both, 4), fmt(_gbps(nb, both))])
    if ok1 and one[0]["disk1"]:
        d1 = one[0]["disk1"]
        rows.append(["disk: one rank's bytes, O_DIRECT from page-aligned memory (8 MiB requests) + fsync (file, dir); "
                     "the 1-rank capture-to-committed floor", fmt(d1, 3), fmt(_gbps(nb, d1))])
    if ok2 and two[0]["disk2"]:
        d2 = two[0]["disk2"]
        rows.append(["disk: 2x one rank's bytes in one file, O_DIRECT + fsync (file, dir), rank 0 writing while rank 1 "
                     "waits; the 2-rank capture-to-committed floor", fmt(d2, 3), fmt(_gbps(2 * nb, d2))])
    L += ["### Floors (the ranks' own bytes, measured in every repetition of the same run)", ""]
    L += md_table(["floor", "wall s", "GB/s", "target", "met?"], [r + J.cells(None) for r in rows])

    # ---- main table
    rows = []
    hdr = ["method", "ranks", "stall s", "stall / memcpy floor", "capture-to-committed s", "job GB/s",
           "capture-to-committed / disk floor", "ckptstore 2 ranks / this (stall, c2c)", "target", "met?"]
    if ok1:
        o = one[0]
        st = [s["stall_s"] for s in o["ck"]]
        c2 = [s["c2c_s"] for s in o["ck"]]
        rows.append(["ckptstore `Checkpointer` (process writer), 1 rank", "1", fmt(st, 4),
                     xcell(ratio_list(st, o["memcpy"]), True), fmt(c2, 3), fmt(_gbps(nb, c2)),
                     xcell(ratio_list(c2, o["disk1"]) if len(o["disk1"]) == len(c2) else [], True), DASH,
                     *J.cells(None)])
    if ok2:
        both = [max(x) for x in zip(*(r["memcpy_both"] for r in two))]
        d2 = two[0]["disk2"] if len(two[0]["disk2"]) == args.reps else []
        cks, ckc = job_values(two, "ck", "stall_s"), job_values(two, "ck", "c2c_s")
        for label, m in [("ckptstore `Checkpointer(group=WORLD)` (process writer per rank), 2 ranks", "ck"),
                         ("DCP `async_save` (thread executor, default FileSystemWriter), 2 ranks", "dcp_async"),
                         ("DCP `save` (synchronous; stall = the whole call), 2 ranks", "dcp_save")]:
            st, c2 = job_values(two, m, "stall_s"), job_values(two, m, "c2c_s")
            vs = DASH if m == "ck" else (f"{xcell(ratio_list(cks, st))}, {xcell(ratio_list(ckc, c2), m == 'dcp_async')}")
            rows.append([label, "2", fmt(st, 4), xcell(ratio_list(st, both), True), fmt(c2, 3),
                         fmt(_gbps(2 * nb, c2)), xcell(ratio_list(c2, d2) if d2 else [], True), vs, *J.cells(None)])
        rows.append(["(floor) memcpy of one rank's bytes on both ranks at once", "2", fmt(both, 4), "1", DASH, DASH,
                     DASH, DASH, *J.cells(None)])
        if d2:
            rows.append(["(floor) disk: 2x one rank's bytes, O_DIRECT + fsync", "2", DASH, DASH, fmt(d2, 3),
                         fmt(_gbps(2 * nb, d2)), "1", DASH, *J.cells(None)])
    if ok1 and one[0]["disk1"]:
        rows.append(["(floor) disk: one rank's bytes, O_DIRECT + fsync (the 1-rank row's floor)", "1", DASH, DASH,
                     fmt(one[0]["disk1"], 3), fmt(_gbps(nb, one[0]["disk1"])), "1", DASH, *J.cells(None)])
    L += ["", "### Stall per cut and capture-to-committed", ""]
    L += md_table(hdr, rows)
    L += ["", "*stall*: the time the call takes to return (the loop's pause). *capture-to-committed*: from just "
          "before the call until the cut is durable (ckptstore: `h.wait()` returns, LATEST fsynced; DCP: the "
          "future's `result()` / `save` returns, then fsync of the checkpoint directory and its parent on rank 0). "
          "The 2-rank rows' stall is judged against memcpy on both ranks at once, the 1-rank row's against the "
          "1-rank job's memcpy; capture-to-committed against the disk write of the same job's bytes. The last "
          "column is ckptstore-2-ranks' time over this row's, per repetition (below 1: ckptstore is faster)."]

    # ---- where the time goes
    notes: list[str] = []
    if ok1:
        o = one[0]
        cap = [s["capture_s"] for s in o["ck"] if s["capture_s"] is not None]
        w = [s["written"] for s in o["ck"] if s["written"]]
        notes.append(
            f"ckptstore, 1 rank: `captured` stall_s {fmt(cap, 4)} s of the {fmt([s['stall_s'] for s in o['ck']], 4)} s "
            "call; writer timings (`written` event, s; hash and write overlap): "
            + ", ".join(f"{k} {fmt([x.get(k, 0) for x in w], 3)}" for k in sorted({k for x in w for k in x}))
            + f"; commit {fmt([s['commit_s'] for s in o['ck']], 4)} s. Warm-up (first) cut: {o['warmup_s']:.2f} s.")
    if ok2:
        per_rank_cap = [fmt([s["capture_s"] for s in r["ck"]], 4) for r in two]
        calls = [fmt([s["stall_s"] for s in r["ck"]], 4) for r in two]
        notes.append("ckptstore, 2 ranks, the call per rank: `captured` stall_s (the capture alone) "
                     + ", ".join(f"rank {r} {c}" for r, c in enumerate(per_rank_cap)) + " s of the `ck.cut` call "
                     + ", ".join(f"rank {r} {c}" for r, c in enumerate(calls))
                     + " s (the rest: the cut and captured exchanges through the rendezvous store, and waiting for the "
                       "other rank to reach the call).")
        for r in two:
            w = [s["written"] for s in r["ck"] if s["written"]]
            notes.append(f"ckptstore, 2 ranks, rank {r['rank']} writer timings (s): "
                         + ", ".join(f"{k} {fmt([x.get(k, 0) for x in w], 3)}" for k in sorted({k for x in w for k in x})))
        # the phases of each cut: call start -> last rank's part durable -> rank 0 committed -> last rank committed
        phases: dict[str, list[float]] = {"parts": [], "commit": [], "outcome": []}
        per_rank_parts: list[list[float]] = [[] for _ in two]
        for rep in range(args.reps):
            ss = [next((s for s in r["ck"] if s["rep"] == rep), None) for r in two]
            if any(s is None or s["written_at"] is None or s["committed_at"] is None for s in ss):
                continue
            start = min(s["start"] for s in ss)
            last_written = max(s["written_at"] for s in ss)
            phases["parts"].append(last_written - start)
            for r, x in enumerate(ss):
                per_rank_parts[r].append(x["written_at"] - start)
            phases["commit"].append(ss[0]["committed_at"] - last_written)
            phases["outcome"].append(max(s["committed_at"] for s in ss) - ss[0]["committed_at"])
        if phases["parts"]:
            notes.append(f"ckptstore, 2 ranks, the phases of a cut (s, from the first rank's call): until the last "
                         f"rank's part is durable and published {fmt(phases['parts'], 3)}; then until rank 0's "
                         f"`committed` event {fmt(phases['commit'], 3)} (the other ranks' posts noticed, records read, manifest "
                         f"and LATEST written; rank 0's own `commit` timing, which starts before it waits for the "
                         f"other ranks' posts: {fmt([s['commit_s'] for s in two[0]['ck'] if s['commit_s'] is not None], 3)}); "
                         f"then until the last rank's `committed` event {fmt(phases['outcome'], 3)}. Each rank's part "
                         "durable and published, from the first rank's call: "
                         + ", ".join(f"rank {r} {fmt(v, 3)}" for r, v in enumerate(per_rank_parts)) + ".")
        wu = two[0]["warmup"]
        notes.append("Warm-up (first) save, rank 0: " + ", ".join(f"{k} {v:.2f} s" for k, v in wu.items()) + ".")
        fb = [s["fallback"] for r in two for s in r["ck"] if s.get("fallback")]
        if fb:
            notes.append(f"**ckptstore fell back to writing in the commit thread {len(fb)} time(s)**: {fb[0]}")
    if ok1 and any(s.get("fallback") for s in one[0]["ck"]):
        notes.append("**ckptstore (1 rank) fell back to writing in the commit thread.**")
    L += ["", "### Where the time goes", ""] + [f"* {n}" for n in notes]

    if TARGETS:
        L += ["", "### Targets", ""] + J.summary()
    L += ["", "### Conditions", "", f"* Command: `{cmd}`", f"* Started {started}; the whole run took {wall:.0f} s."]
    L += [f"* {line}" for line in machine_lines(args.scratch)]
    L.append(f"* Python {platform.python_version()}; host {socket.gethostname()}")
    L.append(f"* {args.code}.")
    src = one[0] if ok1 else two[0] if ok2 else {}
    if src:
        L.append(f"* torch {src.get('torch_version')}, ckptstore {src.get('ckptstore_version')}; gloo over TCP on "
                 "127.0.0.1; ckptstore's agreement messages go through the same rendezvous TCPStore.")
    L.append(f"* Load (`uptime`) before: {loads[0]}; after: {loads[1]}.")
    L += [f"* {line}." for line in args.job_lines]
    where = os.path.relpath(args.scratch, REPO) if args.scratch.startswith(REPO) else args.scratch
    L.append(f"* Method: scratch directories under {where} (the real disk, not tmpfs), removed afterwards; before every timed cut, save and disk floor: old "
             f"cuts / DCP directories removed, `os.sync()`, {args.settle:g} s of idle, then a barrier. "
             "Each job's processes are fresh; the 2-rank job runs every method in the same two processes.")
    for r in ((one if ok1 else []) + (two if ok2 else [])):
        for n in r.get("notes", []):
            L.append(f"* Note: {n}")
    return "\n".join(L) + "\n"


def write_doc(path: str, body: str, cmd: str) -> None:
    head = [
        "# Benchmarks: several ranks",
        "",
        "Generated by `benchmarks/bench_ranks.py` (rerun it; do not edit the tables by hand). It measures the",
        "stall per cut and capture-to-committed of `ckptstore.writer.Checkpointer` in a 2-rank torch.distributed",
        "job (gloo, one process per rank, `group=`) beside the same Checkpointer in a 1-rank job, and beside",
        "torch.distributed.checkpoint's `async_save` and `save` on the same 2-rank job and state, against",
        "floors measured in the same run on the same bytes (memcpy of one rank's bytes, the disk's own",
        "O_DIRECT write + fsync of the job's bytes). No targets are set; the single-process writer's",
        "benchmark is docs/benchmarks-writer.md. \"What this run says\" is the one hand-written section:",
        "rewrite it from the tables after each run.",
        "",
        f"Command: `{cmd}`",
        "",
        "### What this run says",
        "",
        "(to be written by hand from the tables below)",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n" + body)


def code_line() -> str:
    """The commit measured, and whether the library's sources differ from it (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ckptstore", "writer"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "Code: unknown (git not available)"
    return f"Code: commit {head or '?'}" + ("; ckptstore/ or writer/ had uncommitted changes" if dirty else
                                           ", ckptstore/ and writer/ as committed")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-rank", type=int, default=256, help="MiB of fp32 state per rank (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="timed cuts per method after the warm-up (default 3)")
    ap.add_argument("--settle", type=float, default=4.0,
                    help="seconds of idle after os.sync() before each timed cut, save and disk floor (default 4)")
    ap.add_argument("--threads-per-rank", type=int, default=1,
                    help="torch threads in each process of the 2-rank job (default 1, as torchrun sets); the 1-rank "
                         "job keeps torch's default")
    ap.add_argument("--out", help="write the markdown report here (e.g. docs/benchmarks-ranks.md)")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"),
                    help="parent of the scratch directory (default bench-out/, on the work tree's file system)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a job is killed (default 900)")
    # child mode
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mib_per_rank < 1 or args.reps < 1:
        ap.error("--mib-per-rank and --reps must be at least 1")
    if args.child:
        return child_main(args)
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_ranks.py",
                    *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    os.makedirs(args.scratch, exist_ok=True)
    args.job_lines = []
    args.scratch_root = tempfile.mkdtemp(prefix="ranks-", dir=args.scratch)
    load_before = uptime()
    args.code = code_line()
    t0 = time.perf_counter()
    try:
        one = run_job(args, "one", 1)
        two = run_job(args, "rank", 2)
    finally:
        shutil.rmtree(args.scratch_root, ignore_errors=True)
    body = report(args, one, two, cmd, started, time.perf_counter() - t0, (load_before, uptime()))
    print()
    print(body)
    if args.out:
        write_doc(args.out, body, cmd)
        print(f"wrote {args.out}")
    return 0 if isinstance(one, list) and isinstance(two, list) else 1


if __name__ == "__main__":
    sys.exit(main())
