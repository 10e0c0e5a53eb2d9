"""Benchmark of the background writer (``ckptstore.writer.Checkpointer``) against its floors and DCP.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_writer.py [--gib 1] [--reps 3] [--loop-reps N] [--out docs/benchmarks-writer.md]

One run measures, side by side, on the same state (``build_state``: a copy of benchmarks/bench_store.py's
builder, i.e. shared/research/limits.md's "1 GiB state": bf16 weights, fp32 Adam moments, six int64
counters, 231 tensors at --gib 1):

1. **Stall per cut**: the time ``ck.maybe_cut(step, state)`` takes in steady state (process mode, after a
   warm-up cut, block allocated), against the floor: ``copy_`` of every tensor into views of one
   preallocated, already-touched flat uint8 buffer (4 KiB-aligned slots, same torch thread count).
2. **Capture-to-committed**: ``maybe_cut`` start until ``handle.wait()`` returns, against ``torch.save``
   to a file + fsync (file and directory) + sha256 of the file (hashlib, re-reading it).
   ``os.sync()`` runs before each timed save. Sections 1 and 2 share one process; every repetition runs
   floor / cut / floor / cut / floor / cut / torch.save, so drift hits all alike.
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
   trainer's matmuls by itself, so that row is the floor for any writer that keeps a core busy.

GB = 1e9 bytes. Figures are median (min-max) over repetitions; ratios are taken per repetition (paired)
and then summarised.
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
import threading
import time
from typing import Any

from benchstate import build_state, fmt, fsync_path, machine_lines, med

GB = 1e9
ALIGN = 4096
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_STEP_S = 0.030
PRE_STEPS, POST_STEPS, NONE_WINDOW_STEPS = 100, 50, 30

# ==================================================================================================
# small helpers shared by parent and children (no torch here)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank style percentile (q in [0, 1]) with linear interpolation."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


PSS_KEYS = (b"Pss:", b"Pss_Anon:", b"Pss_File:", b"Pss_Shmem:")


def pss_parts(pid: int) -> tuple[int, int, int, int] | None:
    """(Pss, Pss_Anon, Pss_File, Pss_Shmem) in bytes from /proc/<pid>/smaps_rollup (None if gone)."""
    vals = dict.fromkeys(PSS_KEYS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                key = line.split(None, 1)[0]
                if key in vals:
                    vals[key] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return vals[b"Pss:"], vals[b"Pss_Anon:"], vals[b"Pss_File:"], vals[b"Pss_Shmem:"]


def pss_of(pid: int) -> int | None:
    """PSS in bytes from /proc/<pid>/smaps_rollup (None if the process is gone)."""
    parts = pss_parts(pid)
    return None if parts is None else parts[0]


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()


def children_of(pid: int) -> list[int]:
    """All descendants of pid (from /proc/*/stat ppid fields)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        rest = stat_fields(name)
        if rest is not None:
            parent[int(name)] = int(rest[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def cpu_busy() -> float:
    """System-wide busy CPU seconds (all cores) from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / tick


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of pid and its live descendants (children's own counters)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in [pid, *children_of(pid)]:
        rest = stat_fields(p)
        if rest is not None:
            total += (int(rest[11]) + int(rest[12])) / tick
    return total


class ForeignCpu:
    """Cores used by processes outside this process tree over a window (from /proc/stat)."""

    def __enter__(self) -> "ForeignCpu":
        self.t0, self.b0, self.m0 = time.perf_counter(), cpu_busy(), tree_cpu(os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t0
        self.cores = max(0.0, ((cpu_busy() - self.b0) - (tree_cpu(os.getpid()) - self.m0)) / wall)


# ==================================================================================================
# children (import torch)




def disk_write_bound(d: str, nbytes: int) -> float:
    """Reference, not a checkpoint method: the disk's own O_DIRECT sequential write + fsync of nbytes from
    one prefaulted, page-aligned 8 MiB buffer (no hashing, no copy), into a new file that is then
    deleted. ``os.sync()`` first."""
    import mmap

    chunk = 8 << 20
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(chunk))
    mv = memoryview(buf)
    path = os.path.join(d, "disk-bound.bin")
    os.sync()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        left = -(-nbytes // 4096) * 4096
        while left > 0:
            n = os.write(fd, mv[: min(chunk, left)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    secs = time.perf_counter() - t0
    os.unlink(path)
    mv.release()
    buf.close()
    return secs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


class Saver:
    """One checkpointing method behind a common start()/done()/wait() interface (section 4 and 3)."""

    def __init__(self, variant: str, scratch: str, nbytes: int) -> None:
        self.variant = variant
        self.scratch = scratch
        self.nbytes = nbytes
        self.ck = None
        self.fut = None
        self.handle = None
        self.done_at: float | None = None
        self.dirs: list[str] = []
        self.step = 0
        self.events: list[dict[str, Any]] = []
        if variant.startswith("ckpt-"):
            from ckptstore.writer import Checkpointer

            kw: dict[str, Any] = {"mode": "thread" if variant == "ckpt-thread" else "process"}
            if "idleio" in variant:
                kw["idle_io"] = True
            if variant.endswith("-nice19"):
                kw["nice"] = 19
            if "pin" in variant:
                cpus = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
                kw["cpu_affinity"] = (cpus[-1],)
            self.kw = kw
            self.ck = Checkpointer(os.path.join(scratch, "store"), every=1, on_event=self._on_event, **kw)
        elif variant == "dcp-process":
            init_gloo()
        self.proc: subprocess.Popen | None = None

    def _on_event(self, e: dict[str, Any]) -> None:
        if e["event"] == "committed":
            self.done_at = time.perf_counter()
        self.events.append(e)

    def start(self, state: Any) -> float:
        """Starts one save; returns the time the call blocked."""
        self.done_at = None
        self.step += 1
        if self.ck is not None:
            t0 = time.perf_counter()
            self.handle = self.ck.maybe_cut(self.step, state)
            blocked = time.perf_counter() - t0
            assert self.handle is not None
            return blocked
        if self.variant == "none":
            return 0.0
        if self.variant == "spin":
            t0 = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, "-c", SPIN_CODE])
            return time.perf_counter() - t0
        import torch.distributed.checkpoint as dcp

        d = os.path.join(self.scratch, f"dcp-{self.step}")
        self.dirs.append(d)
        kw: dict[str, Any] = {}
        if self.variant == "dcp-process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(d), **kw)
        blocked = time.perf_counter() - t0
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse in newer torch
        self.fut = fut

        def _mark(_f: Any) -> None:
            self.done_at = time.perf_counter()

        fut.add_done_callback(_mark)
        return blocked

    def done(self) -> bool:
        if self.ck is not None:
            return self.handle is not None and self.handle.done
        if self.proc is not None:
            if self.proc.poll() is None:
                return False
            if self.done_at is None:
                self.done_at = time.perf_counter()
            return True
        if self.fut is not None:
            return self.fut.done()
        return True

    def wait(self) -> None:
        if self.ck is not None and self.handle is not None:
            self.handle.wait()
        elif self.proc is not None:
            self.proc.wait()
            self.done()
        elif self.fut is not None:
            self.fut.result()
            d = self.dirs[-1]
            fsync_path(d)
            while self.done_at is None:  # the callback runs right after result() is set
                time.sleep(0.001)

    def cleanup(self) -> None:
        """Removes every saved checkpoint but the newest (outside any timed window)."""
        if self.ck is not None:
            from ckptstore import KeepLast

            self.ck.store.prune(KeepLast(1))
        for d in self.dirs[:-1]:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = self.dirs[-1:]

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
        if self.variant == "dcp-process":
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def child_core(args: argparse.Namespace) -> dict[str, Any]:
    """Sections 1 and 2: stall vs floor copy; capture-to-committed vs torch.save + fsync + sha256."""
    import hashlib

    import torch
    from ckptstore.writer import Checkpointer

    state, flat, nbytes = build_state(args.gib)
    tensors = list(flat.values())
    out: dict[str, Any] = {"nbytes": nbytes, "ntensors": len(tensors), "threads": torch.get_num_threads(),
                           "floor": [], "stall": [], "stall_event": [], "e2e": [], "torch_save": [],
                           "torch_parts": [], "written": [], "commit": [], "rep_of": [], "disk": []}
    # floor: preallocated, touched flat buffer with 4 KiB-aligned slots (the block's layout)
    offs, off = [], 0
    for t in tensors:
        offs.append(off)
        off = -(-(off + t.numel() * t.element_size()) // ALIGN) * ALIGN
    buf = torch.empty(off, dtype=torch.uint8)
    buf.fill_(0)
    views = [buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offs, tensors)]

    def floor_copy() -> float:
        t0 = time.perf_counter()
        for v, t in zip(views, tensors):
            v.copy_(t)
        return time.perf_counter() - t0

    floor_copy()  # warm
    events: list[dict[str, Any]] = []
    store_dir = os.path.join(args.scratch, "core-store")
    ck = Checkpointer(store_dir, every=1, on_event=events.append)
    step = 0
    t0 = time.perf_counter()
    ck.maybe_cut(step, state).wait()  # warm-up: spawns nothing new, allocates + prefaults the block
    out["warmup_cut_s"] = time.perf_counter() - t0
    out["writer_nice"] = ck._writer.hello.nice if ck._writer is not None else None
    out["writer_has_torch"] = ck._writer.hello.modules_with_torch if ck._writer is not None else None
    out["block_bytes"] = ck._block.size if ck._block is not None else None
    from ckptstore import KeepLast

    tdir = os.path.join(args.scratch, "torch")
    os.makedirs(tdir, exist_ok=True)
    cuts_per_rep = 3
    for rep in range(args.reps):
        for _ in range(cuts_per_rep):
            out["floor"].append(floor_copy())
            ck.store.prune(KeepLast(1))
            os.sync()
            step += 1
            n_ev = len(events)
            t0 = time.perf_counter()
            h = ck.maybe_cut(step, state)
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
            out["stall"].append(t1 - t0)
            out["e2e"].append(t2 - t0)
            out["rep_of"].append(rep)
            for e in events[n_ev:]:
                if e["event"] == "captured":
                    out["stall_event"].append(e["stall_s"])
                elif e["event"] == "written":
                    out["written"].append(e["timings"])
                elif e["event"] == "committed":
                    out["commit"].append(e["timings"]["commit"])
        # torch.save baseline
        path = os.path.join(tdir, f"state-{rep}.pt")
        os.sync()
        t0 = time.perf_counter()
        torch.save(state, path)
        t1 = time.perf_counter()
        fsync_path(path)
        fsync_path(tdir)
        t2 = time.perf_counter()
        h = hashlib.sha256()
        rb = bytearray(8 << 20)
        mv = memoryview(rb)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(mv):
                h.update(mv[:n])
        t3 = time.perf_counter()
        out["torch_save"].append(t3 - t0)
        out["torch_parts"].append({"save": t1 - t0, "fsync": t2 - t1, "sha256": t3 - t2})
        os.unlink(path)
        out["disk"].append(disk_write_bound(tdir, nbytes))
    ck.close()
    return out


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
    for _ in range(10):
        torch.mm(a, b)
    one = []
    for _ in range(30):  # calibrate K after the warm-up, so its aftermath does not skew it
        t0 = time.perf_counter()
        torch.mm(a, b)
        one.append(time.perf_counter() - t0)
    k = max(1, round(TARGET_STEP_S / med(one)))

    def step() -> float:
        t0 = time.perf_counter()
        x = a
        for _ in range(k):
            x = torch.mm(x, b)
        return time.perf_counter() - t0

    out: dict[str, Any] = {"nbytes": nbytes, "threads": torch.get_num_threads(), "k": k, "mm_s": med(one),
                           "reps": [], "warmup_s": warmup_s}
    if saver.ck is not None and saver.ck._writer is not None:
        out["writer_nice"] = saver.ck._writer.hello.nice
    for _ in range(10):
        step()
    for _rep in range(args.reps):
        saver.cleanup()
        os.sync()
        time.sleep(0.2)
        with ForeignCpu() as fc:
            pre = [step() for _ in range(PRE_STEPS)]
            t_call = time.perf_counter()
            blocked = saver.start(state)
            inflight = []
            if args.variant == "none":
                inflight = [step() for _ in range(NONE_WINDOW_STEPS)]
                done_s = None
            else:
                while not saver.done():
                    inflight.append(step())
                saver.wait()
                done_s = (saver.done_at or time.perf_counter()) - t_call
            post = [step() for _ in range(POST_STEPS)]
        idle = med(pre + post)
        rec = {
            "idle_med": idle, "pre_med": med(pre), "post_med": med(post),
            "idle_p90_over_med": pct(pre + post, 0.9) / idle,
            "blocked": blocked, "done_s": done_s, "n_inflight": len(inflight),
            "ratio_med": med(inflight) / idle if inflight else None,
            "ratio_p90": pct(inflight, 0.9) / idle if inflight else None,
            "lost": blocked + sum(s - idle for s in inflight),
            "foreign_cores": fc.cores,
        }
        if saver.ck is not None:
            ws = [e for e in saver.events if e["event"] == "written"]
            if ws:
                rec["written"] = ws[-1]["timings"]
        out["reps"].append(rec)
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


# ==================================================================================================
# parent: orchestration, PSS sampling, report (never imports torch)


class TreeSampler:
    """Samples the summed PSS of a process and its descendants every ``interval`` seconds."""

    def __init__(self, root: int, interval: float = 0.01) -> None:
        self.root = root
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, tree PSS, root PSS)
        self.parts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (root parts, children's summed parts)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        kids: list[int] = []
        last_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_scan > 0.1:
                kids = children_of(self.root)
                last_scan = now
            rp = pss_parts(self.root)
            if rp is None:
                break
            kp = [0, 0, 0, 0]
            for k in kids:
                q = pss_parts(k)
                if q is not None:
                    kp = [a + b for a, b in zip(kp, q)]
            self.samples.append((time.monotonic(), rp[0] + kp[0], rp[0]))
            self.parts.append((rp, tuple(kp)))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def peak(self, t0: float, t1: float) -> tuple[int, int] | None:
        inside = [(tot, root) for t, tot, root in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None

    def peak_parts(self, t0: float, t1: float) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        inside = [(tot, i) for i, (t, tot, _root) in enumerate(self.samples) if t0 <= t <= t1]
        return self.parts[max(inside)[1]] if inside else None

    def median(self, t0: float, t1: float) -> int | None:
        inside = [tot for t, tot, _ in self.samples if t0 <= t <= t1]
        return int(med(inside)) if inside else None


def run_child(args: argparse.Namespace, kind: str, variant: str = "", threads: int = 0, sample: bool = False,
              timeout: float = 900) -> dict[str, Any]:
    tag = f"{kind}-{variant or 'x'}-{threads}"
    scratch = os.path.join(args.scratch_root, tag)
    os.makedirs(scratch, exist_ok=True)
    jpath = os.path.join(args.scratch_root, f"{tag}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--gib", str(args.gib), "--json", jpath,
           "--scratch", scratch, "--variant", variant, "--threads", str(threads),
           "--reps", str(args.loop_reps if kind == "loop" else args.reps)]
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


def machine_summary() -> list[str]:
    return [*machine_lines(REPO), f"Python {platform.python_version()}; host {socket.gethostname()}"]


def ratio_list(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def per_rep(values: list[float], rep_of: list[int]) -> list[float]:
    reps = sorted(set(rep_of))
    return [med([v for v, r in zip(values, rep_of) if r == k]) for k in reps]


# The "spin" control: a nice-10 process that only spins a pure-Python loop (no I/O, hardly any memory
# traffic) for SPIN_S seconds, about as long as a ckptstore cut is in flight. What it costs the trainer
# is what any writer that keeps a core busy costs on this machine, whatever it does with the core.
SPIN_S = 2.5
SPIN_CODE = f"import os, time\nos.nice(10)\nend = time.monotonic() + {SPIN_S}\nwhile time.monotonic() < end:\n    pass\n"
LOOP_VARIANTS = {
    1: ["none", "spin", "ckpt-process", "ckpt-process-pin", "ckpt-process-idleio", "ckpt-thread", "dcp-thread",
        "dcp-process"],
    2: ["none", "spin", "ckpt-process", "ckpt-process-nice19", "ckpt-process-idleio", "ckpt-thread", "dcp-thread",
        "dcp-process"],
}
LABEL = {
    "none": "no checkpoint (noise floor: idle steps in the window)",
    "spin": f"control: a nice-10 process spinning a pure-Python loop for {SPIN_S} s (no I/O, no checkpoint)",
    "ckpt-process": "ckptstore process mode (nice 10, default)",
    "ckpt-process-pin": "ckptstore process, trainer pinned to CPU 0, writer cpu_affinity=(1,)",
    "ckpt-process-nice19": "ckptstore process, nice=19",
    "ckpt-process-idleio": "ckptstore process, idle_io=True",
    "ckpt-thread": "ckptstore thread mode",
    "dcp-thread": "DCP async_save, thread executor (default)",
    "dcp-process": "DCP async_save, PROCESS executor (1-rank gloo)",
}
MEM_VARIANTS = ["ckpt-process", "dcp-thread", "dcp-process"]


def report(args: argparse.Namespace, R: dict[str, Any], cmd: str, started: str, wall: float,
           loads: tuple[str, str]) -> tuple[str, list[tuple[str, bool | None]]]:
    L: list[str] = []
    targets: list[tuple[str, bool | None]] = []
    core = R["core"]
    n = core.get("nbytes") or 1
    if "error" not in core:
        L.append(f"State: {core['ntensors']} tensors, {n:,} bytes ({n / GB:.3f} GB; bf16 weights, fp32 Adam "
                 f"moments, 6 int64 counters). GB = 1e9 bytes. Figures are median (min-max).")
    L.append("")
    # ---------------------------------------------------------------- 1
    L.append("### 1. Stall per cut (process mode, steady state) vs a plain copy into a touched buffer")
    L.append("")
    if "error" in core:
        L.append(f"core benchmark failed: {core['error']}")
    else:
        fl, st = per_rep(core["floor"], core["rep_of"]), per_rep(core["stall"], core["rep_of"])
        ev = per_rep(core["stall_event"], core["rep_of"]) if len(core["stall_event"]) == len(core["rep_of"]) else []
        r1 = ratio_list(st, fl)
        L.append(f"{len(core['stall'])} cuts ({args.reps} repetitions x 3, each cut right after a floor copy); "
                 f"torch threads {core['threads']}; per-repetition medians, then median (min-max) of those.")
        L.append("")
        L.append("| what | seconds | GB/s | ratio to floor |")
        L.append("|---|---|---|---|")
        L.append(f"| floor: copy_ per tensor into views of a preallocated, touched flat buffer | {fmt(fl, 4)} | "
                 f"{fmt([n / GB / x for x in fl])} | 1 |")
        L.append(f"| `ck.maybe_cut(step, state)` wall (trainer stall) | {fmt(st, 4)} | {fmt([n / GB / x for x in st])} "
                 f"| **{fmt(r1)}x** |")
        if ev:
            L.append(f"| its `captured` event `stall_s` (capture only) | {fmt(ev, 4)} | "
                     f"{fmt([n / GB / x for x in ev])} | {fmt(ratio_list(ev, fl))}x |")
        L.append("")
        L.append(f"All {len(core['stall'])} stalls: min {min(core['stall']):.4f} s, max {max(core['stall']):.4f} s. "
                 f"Warm-up (first) cut, block creation + prefault included: {core['warmup_cut_s']:.2f} s "
                 f"(block {core['block_bytes']:,} bytes = {core['block_bytes'] / n:.3f}x the state).")
        targets.append((f"stall per cut <= 1.3x the floor copy (measured {med(r1):.2f}x)", med(r1) <= 1.3))
    # ---------------------------------------------------------------- 2
    L.append("")
    L.append("### 2. Capture-to-committed vs torch.save + fsync + sha256")
    L.append("")
    if "error" not in core:
        e2e = per_rep(core["e2e"], core["rep_of"])
        ts = core["torch_save"]
        r2 = ratio_list(ts, e2e)
        L.append("| method | wall s | GB/s | speed-up of ckptstore (torch.save time / ckptstore time) |")
        L.append("|---|---|---|---|")
        L.append(f"| ckptstore: `maybe_cut` start until `handle.wait()` returns (LATEST durable) | {fmt(e2e, 3)} | "
                 f"{fmt([n / GB / x for x in e2e])} | **{fmt(r2)}x** |")
        L.append(f"| torch.save + fsync (file, dir) + sha256 re-read | {fmt(ts, 3)} | {fmt([n / GB / x for x in ts])} | 1 |")
        dk = core.get("disk") or []
        if dk:
            L.append(f"| (reference) the disk itself: O_DIRECT write + fsync of the same bytes from one 8 MiB buffer, "
                     f"no hashing | {fmt(dk, 3)} | {fmt([n / GB / x for x in dk])} | {fmt(ratio_list(ts, dk))}x "
                     f"(the most any writer could reach) |")
            L.append("")
            L.append(f"ckptstore capture-to-committed / disk reference time: **{fmt(ratio_list(e2e, dk))}x** "
                     "(1.0 = as fast as the raw disk write + fsync alone).")
        L.append("")
        w = core["written"]
        if w:
            parts = ", ".join(f"{k} {fmt([x.get(k, 0) for x in w], 3)}" for k in ("hash", "write", "fsync", "total"))
            L.append(f"ckptstore writer timings (`written` event, s; hash and write overlap): {parts}; commit "
                     f"{fmt(core['commit'], 4)} s. torch.save parts (s): "
                     + ", ".join(f"{k} {fmt([p[k] for p in core['torch_parts']], 3)}" for k in ("save", "fsync", "sha256"))
                     + ".")
        targets.append((f"capture-to-committed >= 4x faster than torch.save + fsync + sha256 (measured "
                        f"{med(r2):.2f}x)", med(r2) >= 4.0))
    # ---------------------------------------------------------------- 3
    L.append("")
    L.append("### 3. Peak extra host memory while a cut is in flight (summed PSS of the process tree)")
    L.append("")
    notes_mem: list[str] = []
    L.append("| method | peak extra GB | x state | of which trainer process GB | idle extra between saves GB | "
             "first save's peak extra GB |")
    L.append("|---|---|---|---|---|---|")
    for v in MEM_VARIANTS:
        m = R["mem"].get(v)
        if m is None:
            continue
        if "error" in m:
            L.append(f"| {LABEL[v]} | failed: {m['error']} | | | | |")
            continue
        p = m["pss"]
        pe = [x / GB for x in p["peak_extra"]]
        xs = [x * GB / m["nbytes"] for x in pe]
        L.append(f"| {LABEL[v]} | {fmt(pe, 3)} | **{fmt(xs)}x** | {fmt([x / GB for x in p['peak_extra_trainer_part']], 3)} | "
                 f"{fmt([x / GB for x in p['idle_extra']], 3)} | "
                 f"{(p['warmup_peak_extra'] or 0) / GB:.3f} |")
        bd = p.get("breakdown")
        if bd:
            notes_mem.append(f"{LABEL[v]}, at the peak of its last save (MB): trainer anon {bd['trainer_anon'] / 1e6:+.1f}, "
                             f"trainer shmem {bd['trainer_shmem'] / 1e6:+.1f}, trainer file {bd['trainer_file'] / 1e6:+.1f}; "
                             f"child processes anon {bd['children_anon'] / 1e6:.1f}, shmem {bd['children_shmem'] / 1e6:.1f}, "
                             f"file {bd['children_file'] / 1e6:.1f}.")
        if v == "ckpt-process" and xs:
            targets.append((f"peak extra host memory <= 1.05x the state (measured {med(xs):.3f}x)", med(xs) <= 1.05))
    L.append("")
    for line in notes_mem:
        L.append(f"* {line}")
    L.append("")
    L.append("Base = the trainer's PSS right before the Checkpointer (or, for DCP PROCESS, the process group) "
             "existed, with the state built and ckptstore.writer / torch.distributed.checkpoint imported. The idle column is the median over 0.3 s windows between saves. "
             "PSS splits shared pages (the shm block, DCP's shared-memory staging) between the processes "
             "mapping them, so the sum counts them once.")
    # ---------------------------------------------------------------- 4
    L.append("")
    L.append("### 4. Trainer slowdown while one save is in flight")
    for th in (1, 2):
        L.append("")
        loops = R["loop"].get(th, {})
        any_ok = next((x for x in loops.values() if "error" not in x), None)
        if any_ok is None:
            continue
        L.append(f"**{th} trainer thread{'s' if th > 1 else ''}** ({'a spare core' if th == 1 else 'no spare core'}; "
                 f"K chained 1024x1024 fp32 mm per step, K calibrated per process towards 30 ms (shown per row); "
                 f"{args.loop_reps} repetitions per variant, each variant in a fresh process)")
        L.append("")
        L.append("| variant | K | idle step ms | call blocks s | step ratio median | step ratio p90 | in-flight steps | "
                 "done s | writer GB/s under load | trainer time lost s | foreign cores |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for v in LOOP_VARIANTS[th]:
            r = loops.get(v)
            if r is None:
                continue
            if "error" in r:
                L.append(f"| {LABEL[v]} | failed: {r['error']} | | | | | | | | | |")
                continue
            reps = r["reps"]
            g = lambda key: [x[key] for x in reps if x.get(key) is not None]  # noqa: E731
            done = g("done_s")
            L.append(f"| {LABEL[v]} | {r['k']} | {fmt([x * 1e3 for x in g('idle_med')], 1)} | {fmt(g('blocked'), 3)} | "
                     f"**{fmt(g('ratio_med'))}** | {fmt(g('ratio_p90'))} | {fmt(g('n_inflight'), 0)} | "
                     f"{fmt(done)} | {fmt([r['nbytes'] / GB / d for d in done])} | {fmt(g('lost'))} | "
                     f"{fmt(g('foreign_cores'))} |")
            if v == "ckpt-process":
                rm = med(g("ratio_med"))
                lim = 1.05 if th == 1 else 1.10
                targets.append((f"{th}-thread trainer: step ratio with the default process writer <= {lim:.2f}x "
                                f"(measured {rm:.2f}x)", rm <= lim))
        nn = loops.get("none")
        if nn and "error" not in nn:
            L.append("")
            L.append(f"Idle noise: p90/median of idle steps {fmt([x['idle_p90_over_med'] for x in nn['reps']])}; "
                     f"post/pre idle medians {fmt([x['post_med'] / x['pre_med'] for x in nn['reps']])}.")
        for v in ("ckpt-process", "ckpt-process-pin", "ckpt-process-nice19", "ckpt-process-idleio", "ckpt-thread"):
            r = loops.get(v)
            if r and "error" not in r:
                ws = [x["written"] for x in r["reps"] if "written" in x]
                if ws:
                    L.append(f"{LABEL[v]}: writer timings under load (s): " + ", ".join(
                        f"{k} {fmt([w.get(k, 0) for w in ws])}" for k in ("hash", "write", "fsync", "total")) + ".")
    L.append("")
    L.append("Column definitions (as in limits.md): the step ratios are the median and p90 of the steps that start "
             "while the save is in flight, over the median of the 100 idle steps before and 50 after. *done s* is "
             "from the call until the save is durable (ckptstore: `committed` event, LATEST fsynced; DCP: the upload "
             "future completes, fsync of files included). *Trainer time lost* = the call's blocking time + "
             "sum(in-flight step - idle median). *Foreign cores*: CPU used outside the benchmark's process tree "
             "during the repetition (/proc/stat).")
    # ---------------------------------------------------------------- targets
    L.append("")
    L.append("### Targets")
    L.append("")
    L.append("| target | met? |")
    L.append("|---|---|")
    for what, ok in targets:
        L.append(f"| {what} | {'**met**' if ok else '**NOT met**'} |")
    met = sum(1 for _, ok in targets if ok)
    L.append("")
    L.append(f"{met} of {len(targets)} targets met in this run.")
    L.append("")
    L.append("### Conditions")
    L.append("")
    L.append(f"* Command: `{cmd}`")
    L.append(f"* Started {started}; the whole run took {wall:.0f} s.")
    for line in machine_summary():
        L.append(f"* {line}")
    if "error" not in core:
        L.append(f"* torch {core.get('torch_version')}, safetensors {core.get('safetensors_version')}, ckptstore "
                 f"{core.get('ckptstore_version')}; writer process nice {core.get('writer_nice')}, imports torch: "
                 f"{core.get('writer_has_torch')}.")
    L.append(f"* Load (`uptime`) before: {loads[0]}; after: {loads[1]}. 1-minute load average at the start of "
             "each child: " + ", ".join(f"{k} {v:.2f}" for k, v in R["child_loads"]) + ".")
    L.append("* Method: each section runs in fresh child processes of this script; the parent only orchestrates and "
             "samples PSS (it does not import torch). Scratch directories live under bench-out/ (same file system "
             "as the work tree) and are removed afterwards. Old cuts / DCP directories are deleted between "
             "repetitions, outside the timed windows, followed by `os.sync()`.")
    for note in R.get("notes", []):
        L.append(f"* Note: {note}")
    return "\n".join(L) + "\n", targets


def write_doc(path: str, body: str) -> None:
    head = [
        "# Benchmarks: the background writer",
        "",
        "Generated by `benchmarks/bench_writer.py` (do not edit by hand; rerun it). It measures",
        "`ckptstore.writer.Checkpointer` (stall per cut, capture-to-committed time, extra host memory, and the",
        "slowdown of a CPU-bound trainer while a cut is written) against a plain copy, torch.save and",
        "torch.distributed.checkpoint's async_save. The store's own benchmark is docs/benchmarks.md; this",
        "machine class's physical limits are in shared/research/limits.md.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n" + body)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions for sections 1-3 (default 3)")
    ap.add_argument("--loop-reps", type=int, default=None, help="repetitions per section-4 variant (default --reps)")
    ap.add_argument("--out", help="write the markdown report here (e.g. docs/benchmarks-writer.md)")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"), help="scratch parent directory")
    ap.add_argument("--sections", default="1234", help="which sections to run (default 1234)")
    ap.add_argument("--threads-list", default="1,2", help="trainer thread counts for section 4")
    ap.add_argument("--variants", default="", help="comma list: only these section-3/4 variants (default all)")
    # child mode
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.loop_reps is None:
        args.loop_reps = args.reps
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_writer.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    args.scratch_root = os.path.join(args.scratch, f"writer-{os.getpid()}")
    os.makedirs(args.scratch_root, exist_ok=True)
    load_before = uptime()
    t0 = time.perf_counter()
    R: dict[str, Any] = {"core": {"error": "not run"}, "mem": {}, "loop": {}, "child_loads": [], "notes": []}
    try:
        if "1" in args.sections or "2" in args.sections:
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
    finally:
        shutil.rmtree(args.scratch_root, ignore_errors=True)
    if args.loop_reps != args.reps:
        R["notes"].append(f"section 4 used {args.loop_reps} repetitions per variant (sections 1-3: {args.reps}) "
                          "to keep the run short.")
    body, _targets = report(args, R, cmd, started, time.perf_counter() - t0, (load_before, uptime()))
    print()
    print(body)
    if args.out:
        write_doc(args.out, body)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
