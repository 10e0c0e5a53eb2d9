"""Every target of issue 23 in one run: states of tens of thousands of small tensors, each beside its floor.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_many.py [--count 40000] [--no-large] [--quick] [--out docs/benchmarks.md]

The state is ``--count`` float32 tensors of 1024 elements (4 KB), as benchsmall.py builds it (a flat dict)
and in the nested layout of a model state_dict plus an Adam optimizer state_dict (manystate.py). Every
measurement runs in a fresh child process of this script (manychildren.py); the parent only orchestrates
and renders (manyreport.py). Figures are median (min-max); ratios are paired (per cut or per repetition)
and targets are judged on their median, as in every benchmark here (benchtargets.py).

1. **Stall and capture-to-committed** (each layout): ``--cuts`` cuts by ``Checkpointer(dir, every=1)``
   in process mode, ``ck.cut(step, state)`` timed; the first is cold (it creates the block), the target is
   the warm median. Before each cut, the floor: one ``torch._foreach_copy_`` of the same tensors into
   prefaulted, page-aligned memory (benchfloors.AlignedImage). Capture-to-committed runs from the call
   to the ``committed`` event (``on_event`` timestamps), beside the disk floor (the same bytes with
   O_DIRECT + fsync, benchfloors.odirect_write) in a rotated order with the cuts.
2. **Peak extra trainer memory during a cut** (flat layout, ``--mem-counts``, every ``--modes``): one
   child per count and mode; VmHWM reset (``/proc/self/clear_refs``) right before the call and read once
   the cut is committed, minus the RSS before and minus the growth of the block mapping's resident bytes
   (/proc/self/smaps), and a thread sampling RssAnon + RssFile every 2 ms; the larger of the two readings
   counts. Cold and warm cut both.
3. **store.save and ckptstore.load** (each layout): benchsmall's methods (store.save until durable,
   ckptstore.load verified, safetensors save_file + fsync and load_file with every tensor cloned) beside
   the disk floor and the read floor (benchkit.read_files of the store's shard files), cold (sync +
   drop_caches) and warm; the manifest's bytes per tensor.
4. **The large state** (``--large``, default on; 1 GiB, 231 tensors, benchstate.build_state): bench_store's
   ``Bench.save_store`` beside its disk floor; bench_writer's ``core`` child for the writer process's CPU
   per GiB beside a bare 1-thread blake3 pass; bench_writer's ``loop`` children for the trainer slowdown
   with 1 and 2 trainer threads (ckptstore's default process writer, DCP's async_save with its default
   thread executor, and no checkpoint: the noise floor). The targets are ratios measured in the same
   run, because this machine's CPU and disk change from day to day.

``--quick`` is a smoke run (2,000 tensors, 1 repetition, no settling, a 0.05 GiB "large" state). With
``--out``, the report replaces the ``bench_many`` region of that markdown file (the rest stays).
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

from benchkit import REPO, command_line, publish, started_at, uptime, write_region
from benchtargets import Target
from manychildren import child_main
from manystate import LAYOUTS

US_PER_TENSOR = 15.0  # the per-tensor overhead a save, a load or a cut may add to its floor (issue 23)
KIB, MIB = 1024, 1 << 20
MODES = ("process", "thread", "inline")
# bench_writer's loop children (writersaver.py). "spin", a nice-10 process spinning pure Python with no I/O,
# is the floor of any background work at the writer's priority: printed beside the target (issue 23).
SLOWDOWN_VARIANTS = ("ckpt-process", "dcp-thread", "spin", "none")

# The targets of issue 23, in one place (judged on the median of the paired values).
TARGETS: dict[str, Target] = {}
for _l in LAYOUTS:
    TARGETS.update({
        f"stall_{_l}": Target(f"{_l}: warm `cut` stall / one `torch._foreach_copy_` of the same tensors into "
                              "preallocated memory", "at_most", 2.5),
        f"commit_{_l}": Target(f"{_l}: (capture-to-committed - the disk floor) per tensor", "at_most",
                               US_PER_TENSOR, " us/tensor"),
        f"save_{_l}": Target(f"{_l}: (store.save - the disk floor) per tensor", "at_most", US_PER_TENSOR, " us/tensor"),
        f"load_cold_{_l}": Target(f"{_l}: (ckptstore.load verified, cold - the cold read floor) per tensor", "at_most",
                                  US_PER_TENSOR, " us/tensor"),
        f"load_warm_{_l}": Target(f"{_l}: (ckptstore.load verified, warm - the warm read floor) per tensor", "at_most",
                                  US_PER_TENSOR, " us/tensor"),
        f"manifest_{_l}": Target(f"{_l}: MANIFEST.json bytes per tensor (\"well under 200\")", "at_most", 200,
                                 " B/tensor"),
    })
for _which, _label in (("main", "the main count"), ("large", "the large count")):
    for _m in MODES:
        TARGETS[f"mem_{_m}_{_which}"] = Target(
            f"{_m} mode, {_label}: the trainer's peak extra memory during a cut beyond the block / "
            "(1 KiB x tensors + 64 MiB)", "at_most", 1.0)
TARGETS.update({
    "large_save": Target("large state: store.save time / the disk's O_DIRECT floor time", "at_most", 1.15),
    "large_writer_cpu": Target("large state: writer process CPU per GiB / a bare 1-thread blake3 pass's CPU per GiB",
                               "at_most", 1.3),
    "slowdown_1": Target("large state, 1 trainer thread: in-flight step median / idle median (process writer)",
                         "at_most", 1.05),
    "slowdown_2": Target("large state, 2 trainer threads: in-flight step median / idle median (process writer)",
                         "at_most", 1.10),
})

# What --quick and a full run use for the settings not given on the command line.
FULL = {"count": 40_000, "cuts": 5, "reps": 2, "settle": 1.0, "gib": 1.0, "large_reps": 2, "large_settle": 3.0,
        "loop_reps": 2}
QUICK = {"count": 2_000, "cuts": 2, "reps": 1, "settle": 0.0, "gib": 0.05, "large_reps": 1, "large_settle": 0.0,
         "loop_reps": 1}


def run_child(args: argparse.Namespace, kind: str, timeout: float = 900, **params: Any) -> dict[str, Any]:
    """One fresh child process of this script (``--child kind``); its JSON result, or ``{"error": ...}``."""
    tag = "-".join([kind, *(str(v) for v in params.values())])
    scratch = os.path.join(args.scratch_root, tag)
    jpath = scratch + ".json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--json", jpath, "--scratch", scratch]
    for k, v in params.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    load = os.getloadavg()[0]
    print(f"[{time.strftime('%H:%M:%S')}] {tag} (load {load:.2f}) ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=REPO)
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        try:  # the child's session (its writer process) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t0
    if rc != 0 or not os.path.exists(jpath):
        print(f"    FAILED ({rc}) after {wall:.0f} s", flush=True)
        return {"error": f"exit {rc}", "wall": wall, "load": load}
    with open(jpath) as f:
        res = json.load(f)
    os.unlink(jpath)
    res.update(wall=wall, load=load)
    print(f"    done in {wall:.0f} s", flush=True)
    return res


def run_many(args: argparse.Namespace, R: dict[str, Any]) -> None:
    """Sections 1-3: the cuts and the io child of each layout, the memory child of each count and mode."""
    for layout in args.layouts:
        R["cuts"][layout] = run_child(args, "cuts", layout=layout, count=args.count, cuts=args.cuts,
                                      settle=args.settle)
    for count in args.mem_counts:
        for mode in args.modes:
            R["mem"][(count, mode)] = run_child(args, "mem", mode=mode, count=count, cuts=2)
    for layout in args.layouts:
        R["io"][layout] = run_child(args, "io", layout=layout, count=args.count, reps=args.reps, settle=args.settle)


def run_large(args: argparse.Namespace, R: dict[str, Any]) -> None:
    """Section 4, through the children of bench_store (its Bench, in a child here) and bench_writer."""
    import bench_writer  # its parent side imports neither torch nor ckptstore

    R["large_save"] = run_child(args, "large-save", gib=args.gib, reps=args.large_reps, settle=args.large_settle)
    wargs = argparse.Namespace(scratch_root=args.scratch_root, gib=args.gib, reps=args.large_reps,
                               loop_reps=args.loop_reps, settle=args.large_settle)
    R["core"] = bench_writer.run_child(wargs, "core")
    if args.slowdown:
        for th in (1, 2):
            R["loop"][th] = {v: bench_writer.run_child(wargs, "loop", v, threads=th) for v in SLOWDOWN_VARIANTS}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--count", type=int, help=f"tensors of 4 KB in the state (default {FULL['count']:,})")
    ap.add_argument("--mem-counts", help="comma list: tensor counts of section 2 (default: --count and 2.5x it)")
    ap.add_argument("--cuts", type=int, help=f"cuts per layout in section 1, the first cold (default {FULL['cuts']})")
    ap.add_argument("--reps", type=int, help=f"repetitions of section 3 (default {FULL['reps']})")
    ap.add_argument("--settle", type=float, help="seconds of idle after os.sync() before each timed save, cut and "
                    f"disk floor of sections 1 and 3 (default {FULL['settle']:g})")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of sections 1 and 3 (default all)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list: writer modes of section 2 (default all)")
    ap.add_argument("--no-large", dest="large", action="store_false", help="skip section 4 (the large state)")
    ap.add_argument("--no-slowdown", dest="slowdown", action="store_false",
                    help="skip section 4's trainer-slowdown children (the longest part of it)")
    ap.add_argument("--gib", type=float, help=f"the large state's size (default {FULL['gib']:g})")
    ap.add_argument("--large-reps", type=int,
                    help=f"repetitions of section 4's saves and cuts (default {FULL['large_reps']})")
    ap.add_argument("--large-settle", type=float, help=f"section 4's settle seconds (default {FULL['large_settle']:g})")
    ap.add_argument("--loop-reps", type=int, help=f"repetitions per slowdown child (default {FULL['loop_reps']})")
    ap.add_argument("--out", help="replace the bench_many region of this markdown file (e.g. docs/benchmarks.md)")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"), help="scratch parent directory")
    # child mode
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="flat", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="process", help=argparse.SUPPRESS)
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the settings not given from QUICK or FULL, and splits the comma lists."""
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    counts = args.mem_counts or f"{args.count},{round(args.count * 2.5)}"
    args.mem_counts = [int(x) for x in counts.split(",") if x]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        return child_main(args)
    args = resolve(args)
    from manyreport import report

    cmd = command_line("bench_many.py", argv)
    started = started_at()
    args.scratch_root = os.path.join(args.scratch, f"many-{os.getpid()}")
    os.makedirs(args.scratch_root, exist_ok=True)
    load_before = uptime()
    t0 = time.perf_counter()
    R: dict[str, Any] = {"cuts": {}, "mem": {}, "io": {}, "large_save": None, "core": None, "loop": {}}
    try:
        run_many(args, R)
        if args.large:
            run_large(args, R)
    finally:
        shutil.rmtree(args.scratch_root, ignore_errors=True)
    body, _judge = report(args, R, TARGETS, cmd, started, time.perf_counter() - t0, (load_before, uptime()))
    publish(body, args.out, lambda path, text: write_region(path, text, "bench_many"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
