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

This file is the parent (the command line, the jobs' processes, their CPU); the children are
rankschildren.py, the report ranksreport.py, and the helpers every benchmark shares benchkit.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchkit import REPO, command_line, cpu_busy, free_port, publish, started_at, uptime, write_doc
from benchtargets import Target
from rankschildren import child_main
from ranksreport import doc_head, report

# The issue sets no targets for this benchmark; add them here (judged on the median, as elsewhere).
TARGETS: dict[str, Target] = {}


def children_cpu() -> float:
    """User + system CPU of this process's waited-for descendants (a rank's writer process included)."""
    t = os.times()
    return t.children_user + t.children_system


def run_job(args: argparse.Namespace, kind: str, world: int) -> list[dict[str, Any]] | dict[str, Any]:
    """Runs one job (``world`` processes of this script); returns each rank's result, or {"error": ...}."""
    scratch = os.path.join(args.scratch_root, kind)
    os.makedirs(scratch)
    port = free_port()
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
    cmd = command_line("bench_ranks.py", argv)
    started = started_at()
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
    body = report(args, one, two, TARGETS, cmd, started, time.perf_counter() - t0, (load_before, uptime()))
    publish(body, args.out, lambda path, text: write_doc(path, doc_head(cmd), text))
    return 0 if isinstance(one, list) and isinstance(two, list) else 1


if __name__ == "__main__":
    sys.exit(main())
