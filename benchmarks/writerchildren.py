"""bench_writer's child processes: each builds the state in a fresh process, measures one section and
writes its result as JSON for the parent (split out of bench_writer.py, issue 20). ``core``: the floors
and sections 1 and 2; ``mem``: section 3 (the parent samples PSS); ``loop``: section 4. torch and ckptstore
are imported inside the functions, so the parent imports this module without them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

from benchkit import REPO, fsync_path, rotate, settle, sha256_file
from benchstate import build_state, med
from writerprobes import ForeignCpu, pct, pss_parts, writer_cpu
from writerresults import CoreRep, CoreResult, CutSample, LoopRep
from writersaver import Saver

TARGET_STEP_S = 0.030
PRE_STEPS, POST_STEPS, NONE_WINDOW_STEPS = 100, 50, 30
CUTS_PER_REP = 3  # steady-state cuts per repetition of the core child


def writer_hello(ck: Any) -> Any:
    """The writer process's handshake (its nice level, whether it imports torch), or None. It is private to
    the Checkpointer: read only for the conditions line, and the benchmark runs on without it."""
    return getattr(getattr(ck, "_writer", None), "hello", None)


def timed_cut(ck: Any, events: list[dict[str, Any]], state: Any, step: int, rep: int, floor_s: float,
              nbytes: int) -> CutSample:
    """One steady-state cut of the core child, timed by the trainer and by the writer's events (the caller
    has pruned and settled)."""
    n_ev, pid = len(events), ck.writer_pid
    c0 = writer_cpu(pid)
    t0 = time.perf_counter()
    h = ck.maybe_cut(step, state)
    t1 = time.perf_counter()
    h.wait()
    t2 = time.perf_counter()
    c1 = writer_cpu(pid) if ck.writer_pid == pid else None  # a replaced writer's CPU is not comparable
    new = events[n_ev:]
    cap = next((e for e in new if e["event"] == "captured"), {})
    wr = next((e for e in new if e["event"] == "written"), {})
    com = next((e for e in new if e["event"] == "committed"), {})
    return CutSample(
        rep=rep, floor_s=floor_s, stall_s=t1 - t0, stall_event_s=cap.get("stall_s"), e2e_s=t2 - t0,
        persist_s=t2 - t1, written_bytes=int(wr.get("bytes") or nbytes),
        writer_user_s=(c1[0] - c0[0]) if c0 and c1 else None, writer_sys_s=(c1[1] - c0[1]) if c0 and c1 else None,
        written=wr.get("timings", {}), commit_s=com.get("timings", {}).get("commit"))


def child_core(args: argparse.Namespace) -> dict[str, Any]:
    """The floors, section 1 (stall vs the memcpy floor) and section 2 (persist vs the disk floor, writer CPU
    per GiB vs the blake3 floor, capture-to-committed vs torch.save + fsync + sha256)."""
    import torch
    from benchfloors import AlignedImage, blake3_pass, odirect_write
    from ckptstore import KeepLast
    from ckptstore.writer import Checkpointer

    state, flat, nbytes = build_state(args.gib)
    image = AlignedImage(list(flat.values()))  # the memcpy floor's destination, the other floors' source
    image.copy_in()
    events: list[dict[str, Any]] = []
    ck = Checkpointer(os.path.join(args.scratch, "core-store"), every=1, on_event=events.append)
    t0 = time.perf_counter()
    ck.maybe_cut(0, state).wait()  # warm-up: allocates + prefaults the block (and the writer's first cut)
    hello = writer_hello(ck)
    block = getattr(ck, "_block", None)  # private, as in writer_hello: only for the conditions line
    res = CoreResult(nbytes=nbytes, ntensors=len(flat), threads=torch.get_num_threads(),
                     warmup_cut_s=time.perf_counter() - t0, block_bytes=getattr(block, "size", None),
                     writer_nice=getattr(hello, "nice", None), writer_has_torch=getattr(hello, "modules_with_torch", None),
                     cuts=[], reps=[])
    tdir = os.path.join(args.scratch, "floor")
    os.makedirs(tdir, exist_ok=True)
    step = 0

    def cuts(rep: int) -> None:
        nonlocal step
        for _ in range(CUTS_PER_REP):
            floor = image.copy_in().wall_s
            ck.store.prune(KeepLast(1))
            settle(args.settle)
            step += 1
            res.cuts.append(timed_cut(ck, events, state, step, rep, floor, nbytes))

    for rep in range(args.reps):
        b3 = blake3_pass(image.view, threads=1)
        rec: dict[str, Any] = {"disk_s": None}

        def disk() -> None:
            settle(args.settle)
            try:
                rec["disk_s"] = odirect_write(tdir, image.view).wall_s
            except OSError as exc:
                if not res.notes:
                    res.notes.append(f"disk floor skipped: {exc}")

        def torch_save() -> None:
            rec["torch_save_s"], rec["torch_parts"] = torch_save_baseline(args, state, tdir, rep)

        for fn in rotate([lambda: cuts(rep), disk, torch_save], rep):
            fn()
        res.reps.append(CoreRep(rep=rep, image_bytes=image.size, blake3_wall_s=b3.wall_s, blake3_cpu_s=b3.cpu_s or 0.0,
                                disk_s=rec["disk_s"], torch_save_s=rec["torch_save_s"], torch_parts=rec["torch_parts"]))
    ck.close()
    image.close()
    return asdict(res)


def torch_save_baseline(args: argparse.Namespace, state: Any, d: str, rep: int) -> tuple[float, dict[str, float]]:
    """torch.save to a file + fsync (file, dir) + a sha256 re-read of the file; the file is deleted after."""
    import torch

    path = os.path.join(d, f"state-{rep}.pt")
    settle(args.settle)
    t0 = time.perf_counter()
    torch.save(state, path)
    t1 = time.perf_counter()
    fsync_path(path)
    fsync_path(d)
    t2 = time.perf_counter()
    sha256_file(path)
    t3 = time.perf_counter()
    os.unlink(path)
    return t3 - t0, {"save": t1 - t0, "fsync": t2 - t1, "sha256": t3 - t2}


def child_mem(args: argparse.Namespace) -> dict[str, Any]:
    """Section 3: marks windows; the parent samples PSS of this process tree every 10 ms."""
    import torch  # noqa: F401

    state, _flat, nbytes = build_state(args.gib)
    # Import the libraries first: the base is "before the checkpointer existed", not "before import".
    if args.variant.startswith("ckpt-"):
        import ckptstore.writer  # noqa: F401
    else:
        import torch.distributed  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
    time.sleep(0.5)
    out: dict[str, Any] = {"nbytes": nbytes, "windows": [], "idle_windows": []}
    out["base_t"] = time.monotonic()
    out["base_parts"] = pss_parts(os.getpid())
    out["base_pss"] = out["base_parts"][0]
    saver = Saver(args.variant, args.scratch, nbytes)
    t0 = time.monotonic()
    saver.start(state)
    saver.wait()
    out["warmup_window"] = (t0, time.monotonic())
    for _ in range(args.reps):
        saver.cleanup()
        os.sync()
        a = time.monotonic()
        time.sleep(0.3)
        out["idle_windows"].append((a, time.monotonic()))
        t0 = time.monotonic()
        saver.start(state)
        saver.wait()
        out["windows"].append((t0, time.monotonic()))
    a = time.monotonic()
    time.sleep(0.3)
    out["idle_windows"].append((a, time.monotonic()))
    saver.cleanup()
    saver.close()
    return out


def calibrate(a: Any, b: Any) -> tuple[int, float]:
    """K, the chained mm per step that make a step last about TARGET_STEP_S, and one mm's median seconds:
    10 untimed mm, then 30 timed (run after the warm-up save, so its aftermath does not skew K)."""
    import torch

    for _ in range(10):
        torch.mm(a, b)
    one = []
    for _ in range(30):
        t0 = time.perf_counter()
        torch.mm(a, b)
        one.append(time.perf_counter() - t0)
    return max(1, round(TARGET_STEP_S / med(one))), med(one)


def loop_rep(saver: Saver, state: Any, step: Callable[[], float], variant: str) -> LoopRep:
    """One repetition of section 4: idle steps, the save call between two steps, steps until the save is
    durable (a fixed window for "none"), idle steps; the figures against the idle median."""
    pid = saver.ck.writer_pid if saver.ck is not None else None
    with ForeignCpu() as fc:
        pre = [step() for _ in range(PRE_STEPS)]
        c0 = writer_cpu(pid)
        t_call = time.perf_counter()
        blocked = saver.start(state)
        inflight = []
        if variant == "none":
            inflight = [step() for _ in range(NONE_WINDOW_STEPS)]
            done_s = None
        else:
            while not saver.done():
                inflight.append(step())
            saver.wait()
            done_s = (saver.done_at or time.perf_counter()) - t_call
        c1 = writer_cpu(pid) if saver.ck is not None and saver.ck.writer_pid == pid else None
        post = [step() for _ in range(POST_STEPS)]
    idle = med(pre + post)
    rec = LoopRep(
        idle_med=idle, pre_med=med(pre), post_med=med(post), idle_p90_over_med=pct(pre + post, 0.9) / idle,
        blocked=blocked, done_s=done_s, n_inflight=len(inflight),
        ratio_med=med(inflight) / idle if inflight else None,
        ratio_p90=pct(inflight, 0.9) / idle if inflight else None,
        lost=blocked + sum(s - idle for s in inflight), foreign_cores=fc.cores,
        writer_cpu_s=sum(c1) - sum(c0) if c0 and c1 else None)
    if saver.ck is not None:
        ws = [e for e in saver.events if e["event"] == "written"]
        if ws:
            rec.written, rec.written_bytes = ws[-1]["timings"], ws[-1].get("bytes")
    return rec


def child_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Section 4: step times of a CPU-bound trainer while one save is in flight."""
    if args.variant == "ckpt-process-pin":
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[0]})  # the trainer on the first core; the writer gets the last
    import torch

    torch.set_num_threads(args.threads)
    state, _flat, nbytes = build_state(args.gib)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1024, 1024, generator=g)
    b = torch.randn(1024, 1024, generator=g).div_(32.0)
    saver = Saver(args.variant, args.scratch, nbytes)
    t0 = time.perf_counter()
    saver.start(state)  # warm-up save first (DCP PROCESS spawns its daemon here; ckptstore makes its block)
    saver.wait()
    warmup_s = time.perf_counter() - t0
    time.sleep(0.5)
    k, mm_s = calibrate(a, b)

    def step() -> float:
        t0 = time.perf_counter()
        x = a
        for _ in range(k):
            x = torch.mm(x, b)
        return time.perf_counter() - t0

    out: dict[str, Any] = {"nbytes": nbytes, "threads": torch.get_num_threads(), "k": k, "mm_s": mm_s,
                           "reps": [], "warmup_s": warmup_s}
    hello = writer_hello(saver.ck) if saver.ck is not None else None
    if hello is not None:
        out["writer_nice"] = hello.nice
    for _ in range(10):
        step()
    for _rep in range(args.reps):
        saver.cleanup()
        os.sync()
        time.sleep(0.2)
        out["reps"].append(asdict(loop_rep(saver, state, step, args.variant)))
    saver.cleanup()
    saver.close()
    return out


def child_main(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, REPO)
    os.makedirs(args.scratch, exist_ok=True)
    fn = {"core": child_core, "mem": child_mem, "loop": child_loop}[args.child]
    result = fn(args)
    import torch

    result["torch_version"] = torch.__version__
    try:
        import safetensors

        result["safetensors_version"] = safetensors.__version__
    except ImportError:
        pass
    import ckptstore

    result["ckptstore_version"] = ckptstore.__version__
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0
