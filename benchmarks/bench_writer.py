"""Benchmark of the background writer (``ckptstore.writer.Checkpointer``) against its physical floors and DCP.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_writer.py [--gib 1] [--reps 3] [--loop-reps N] [--settle 8] [--out docs/benchmarks-writer.md]

One run measures, side by side, on the same state (``benchstate.build_state``, i.e.
shared/research/limits.md's "1 GiB state": bf16 weights, fp32 Adam moments, six int64 counters, 231
tensors at --gib 1), and judges every target of ``TARGETS`` below against a floor measured in the same run:

0. **Floors** (benchfloors.py, in the core child, every repetition, on the state's own bytes packed into
   one prefaulted page-aligned mapping): a plain memcpy (``copy_`` of every tensor into its slot), a bare
   blake3 pass over those bytes with 1 thread (wall and CPU s/GiB), and the disk's own O_DIRECT write +
   fsync of them. The core child always runs, so every report has these rows.
1. **Stall per cut**: the time ``ck.maybe_cut(step, state)`` takes in steady state (process mode, after a
   warm-up cut, block allocated), against the memcpy floor (same torch thread count).
2. **Persist and capture-to-committed**: from the end of the capture (``maybe_cut`` returns) until
   ``handle.wait()`` returns (LATEST durable), against the disk floor of the same repetition; the whole
   ``maybe_cut`` start to committed against ``torch.save`` to a file + fsync (file and directory) +
   sha256 of the file (reported, no longer a target). **Writer CPU per GiB written**: user + system CPU
   of the writer process (``ck.writer_pid``, /proc/<pid>/stat) over each cut after the warm-up, per GiB
   of shard bytes written, against the 1-thread blake3 floor. ``os.sync()`` and ``--settle`` s of idle
   run before every timed cut, disk floor and torch.save; the three (a block of 3 cuts, the disk floor,
   torch.save) run in an order rotated per repetition.
3. **Peak extra host memory while a cut is in flight**: the sum of PSS (/proc/<pid>/smaps_rollup) over
   the trainer and its child processes (the writer; DCP's checkpoint daemon), sampled every 10 ms by the
   parent benchmark process (which does not import torch, so it shares no pages with them), minus the
   trainer's PSS just before the Checkpointer (or DCP process group) existed. One fresh process per
   method.
4. **Training slowdown while a cut is written**: a trainer doing K chained fp32 1024x1024 ``torch.mm``
   per step (K calibrated towards 30 ms/step), with 1 torch thread (a spare core) and with 2 (no spare
   core). Every variant x thread count runs in a fresh process: warm-up save first, then per repetition
   100 idle steps, the save call between two steps, steps until the save is durable (committed / future
   done), 50 idle steps. Ratios are in-flight step median (and p90) over the idle median (pre + post);
   "trainer time lost" = call blocking time + sum(in-flight step - idle median). Same method as
   limits.md's "DCP async_save: training slowdown while saving". A control row ("spin") runs a nice-10
   process that only spins a pure-Python loop for 2.5 s: on this VM a busy neighbour core slows the
   trainer's matmuls by itself, so that row is the floor for any writer that keeps a core busy; the
   "no checkpoint" row is the noise floor.

GB = 1e9 bytes, GiB = 2^30 bytes. Figures are median (min-max) over repetitions; ratios are taken per
repetition (paired) and then summarised; targets are judged on the median. Every table has a "target"
and a "met?" column.

This file is the parent (the command line, one fresh child process per section and variant, the PSS
sampling); the children are writerchildren.py (with writersaver.py, the methods they compare), the /proc
probes writerprobes.py, the report writerreport.py, and the helpers every benchmark shares benchkit.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from benchkit import REPO, command_line, publish, started_at, uptime, write_doc
from benchtargets import Target
from writerchildren import child_main
from writerprobes import TreeSampler
from writerreport import DOC_HEAD, report
from writersaver import LOOP_VARIANTS, MEM_VARIANTS

# The targets of the issues, in one place (judged on the median of the per-repetition values).
TARGETS: dict[str, Target] = {
    "stall": Target("stall per cut / the memcpy floor", "at_most", 1.3),
    "persist": Target("Checkpointer, end of capture to committed / the disk floor (same bytes, same repetition)",
                      "at_most", 1.2),
    "writer_cpu": Target("writer process CPU (user + system) per GiB written, steady state (cuts after the first)",
                         "at_most", 0.45, " s/GiB"),
    "memory": Target("peak extra host memory while a cut is in flight / the state's bytes", "at_most", 1.05),
    "slowdown_1": Target("1-thread trainer: in-flight step median / idle median, default process writer",
                         "at_most", 1.05),
    "slowdown_2": Target("2-thread trainer: in-flight step median / idle median, default process writer",
                         "at_most", 1.10),
}


def run_child(args: argparse.Namespace, kind: str, variant: str = "", threads: int = 0, sample: bool = False,
              timeout: float = 900) -> dict[str, Any]:
    tag = f"{kind}-{variant or 'x'}-{threads}"
    scratch = os.path.join(args.scratch_root, tag)
    os.makedirs(scratch, exist_ok=True)
    jpath = os.path.join(args.scratch_root, f"{tag}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--gib", str(args.gib), "--json", jpath,
           "--scratch", scratch, "--variant", variant, "--threads", str(threads),
           "--reps", str(args.loop_reps if kind == "loop" else args.reps), "--settle", str(args.settle)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {tag} (load {load:.2f}) ...", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=REPO)
    sampler = TreeSampler(proc.pid) if sample else None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    finally:
        if sampler is not None:
            sampler.stop()
        try:  # anything the child left behind (a DCP daemon) goes with its session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t0
    if rc != 0 or not os.path.exists(jpath):
        print(f"    FAILED ({rc}) after {wall:.0f} s", flush=True)
        return {"error": f"exit {rc}", "wall": wall, "load": load}
    with open(jpath) as f:
        res = json.load(f)
    os.unlink(jpath)
    res["wall"] = wall
    res["load"] = load
    if sampler is not None:
        res["pss"] = mem_summary(res, sampler)
    print(f"    done in {wall:.0f} s", flush=True)
    return res


def mem_summary(res: dict[str, Any], s: TreeSampler) -> dict[str, Any]:
    base = res["base_pss"]
    peaks, roots = [], []
    for t0, t1 in res["windows"]:
        pk = s.peak(t0, t1)
        if pk is not None:
            peaks.append(pk[0] - base)
            roots.append(pk[1] - base)
    idle = [m - base for m in (s.median(a, b) for a, b in res["idle_windows"]) if m is not None]
    wpk = s.peak(*res["warmup_window"])
    # breakdown at the peak of the last window: trainer's anon/file/shmem deltas over base; children's PSS
    bp = res["base_parts"]
    parts = s.peak_parts(*res["windows"][-1]) if res["windows"] else None
    breakdown = None
    if parts is not None:
        rp, kp = parts
        breakdown = {"trainer_anon": rp[1] - bp[1], "trainer_file": rp[2] - bp[2], "trainer_shmem": rp[3] - bp[3],
                     "children_anon": kp[1], "children_file": kp[2], "children_shmem": kp[3]}
    return {"peak_extra": peaks, "peak_extra_trainer_part": roots, "idle_extra": idle,
            "warmup_peak_extra": (wpk[0] - base) if wpk else None, "samples": len(s.samples),
            "breakdown": breakdown}


def run_sections(args: argparse.Namespace, R: dict[str, Any]) -> None:
    """Runs the children into ``R``: the core child always (the floors and the persist and writer-CPU
    targets live in it), then section 3's and section 4's variants as ``--sections`` and ``--variants`` ask."""
    R["core"] = run_child(args, "core")
    R["child_loads"].append(("core", R["core"]["load"]))
    if "3" in args.sections:
        for v in MEM_VARIANTS:
            if args.variants and v not in args.variants.split(","):
                continue
            R["mem"][v] = run_child(args, "mem", v, sample=True)
            R["child_loads"].append((f"mem/{v}", R["mem"][v]["load"]))
    if "4" in args.sections:
        for th in (int(x) for x in args.threads_list.split(",")):
            R["loop"][th] = {}
            for v in LOOP_VARIANTS[th]:
                if args.variants and v not in args.variants.split(","):
                    continue
                R["loop"][th][v] = run_child(args, "loop", v, threads=th)
                R["child_loads"].append((f"loop/{th}t/{v}", R["loop"][th][v]["load"]))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions for sections 1-3 (default 3)")
    ap.add_argument("--loop-reps", type=int, default=None, help="repetitions per section-4 variant (default --reps)")
    ap.add_argument("--out", help="write the markdown report here (e.g. docs/benchmarks-writer.md)")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"), help="scratch parent directory")
    ap.add_argument("--sections", default="1234",
                    help="which sections to run (default 1234); the core child (floors, sections 1 and 2) always runs")
    ap.add_argument("--settle", type=float, default=8.0,
                    help="seconds of idle after os.sync() before each timed cut, disk floor and torch.save of the core "
                         "child (default 8)")
    ap.add_argument("--threads-list", default="1,2", help="trainer thread counts for section 4")
    ap.add_argument("--variants", default="", help="comma list: only these section-3/4 variants (default all)")
    # child mode
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        return child_main(args)
    if args.loop_reps is None:
        args.loop_reps = args.reps
    cmd = command_line("bench_writer.py", argv)
    started = started_at()
    args.scratch_root = os.path.join(args.scratch, f"writer-{os.getpid()}")
    os.makedirs(args.scratch_root, exist_ok=True)
    load_before = uptime()
    t0 = time.perf_counter()
    R: dict[str, Any] = {"core": {"error": "not run"}, "mem": {}, "loop": {}, "child_loads": [], "notes": []}
    try:
        run_sections(args, R)
    finally:
        shutil.rmtree(args.scratch_root, ignore_errors=True)
    if args.loop_reps != args.reps:
        R["notes"].append(f"section 4 used {args.loop_reps} repetitions per variant (sections 1-3: {args.reps}) "
                          "to keep the run short.")
    body, _judge = report(args, R, TARGETS, cmd, started, time.perf_counter() - t0, (load_before, uptime()))
    publish(body, args.out, lambda path, text: write_doc(path, DOC_HEAD, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
