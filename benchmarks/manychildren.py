"""bench_many's child processes: each builds its state in a fresh process, measures one thing and writes its
result as JSON for the parent (bench_writer's pattern). ``cuts``: a Checkpointer's stall and
capture-to-committed beside the ``torch._foreach_copy_`` and disk floors; ``mem``: the trainer's peak extra
memory during a cut, in one writer mode; ``io``: ``store.save`` and ``ckptstore.load`` beside the disk and
read floors and safetensors; ``large-save``: bench_store's ``store.save`` beside its disk floor on the 1 GiB
state. torch and ckptstore are imported inside the functions, so the parent imports this module without them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import struct
import sys
import threading
import time
from typing import Any, Callable

from benchkit import REPO, prime_cache, read_files, rotate, settle, shard_files, timed_call
from manystate import build, check_roundtrip

# Row keys of the io child's tables (the report names them).
DISK, STORE_SAVE, ST_SAVE = "disk", "store.save", "safetensors.save_file"
READ, LOAD, ST_LOAD = "read", "ckptstore.load", "safetensors.load_file"


class EventClock:
    """A Checkpointer's ``on_event`` sink: every event with the ``perf_counter`` time it arrived, and a wait
    for one. The cut's handle can wake ``wait()`` a moment before the ``committed`` event is emitted, so
    capture-to-committed is timed on the event, never on the handle."""

    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._cv = threading.Condition()

    def __call__(self, event: dict[str, Any]) -> None:
        with self._cv:
            self.events.append((time.perf_counter(), event))
            self._cv.notify_all()

    def find(self, step: int, kind: str) -> tuple[float, dict[str, Any]] | None:
        return next(((t, e) for t, e in self.events if e.get("step") == step and e["event"] == kind), None)

    def wait(self, step: int, kind: str = "committed", timeout: float = 900.0) -> tuple[float, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                hit = self.find(step, kind)
                if hit is not None:
                    return hit
                failed = self.find(step, "failed")
                if failed is not None:
                    raise RuntimeError(f"cut of step {step} failed: {failed[1]}")
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    raise TimeoutError(f"no {kind} event for step {step} within {timeout} s")


# ------------------------------------------------------------------------------------------ cuts


def child_cuts(args: argparse.Namespace) -> dict[str, Any]:
    """``args.cuts`` cuts of the state (process mode, the default), the first cold (it creates the block);
    before each, the ``torch._foreach_copy_`` floor, and in a rotated order with each, the disk floor."""
    import torch
    from benchfloors import AlignedImage, odirect_write
    from ckptstore import KeepLast
    from ckptstore.writer import Checkpointer

    s = build(args.layout, args.count)
    image = AlignedImage(s.tensors)
    image.copy_in()  # prefaults the floors' memory, as the block is prefaulted
    clock = EventClock()
    ck = Checkpointer(os.path.join(args.scratch, "store"), every=1, on_event=clock)
    floor_dir = os.path.join(args.scratch, "floor")
    os.makedirs(floor_dir, exist_ok=True)
    out: dict[str, Any] = {"layout": s.layout, "count": s.count, "nbytes": s.nbytes, "image_bytes": image.size,
                           "threads": torch.get_num_threads(), "cuts": [], "disk_s": [], "notes": []}

    def one_cut(step: int) -> None:
        floor = image.foreach_copy_in().wall_s
        ck.store.prune(KeepLast(1))
        settle(args.settle)
        t0 = time.perf_counter()
        handle = ck.cut(step, s.state)
        t1 = time.perf_counter()
        t_committed, committed = clock.wait(step)
        handle.wait()
        captured = clock.find(step, "captured")
        written = clock.find(step, "written")
        out["cuts"].append({"step": step, "floor_s": floor, "stall_s": t1 - t0,
                            "stall_event_s": captured[1].get("stall_s") if captured else None,
                            "e2e_s": t_committed - t0, "written": written[1].get("timings", {}) if written else {},
                            "commit": committed.get("timings", {})})

    def disk() -> None:
        settle(args.settle)
        try:
            out["disk_s"].append(odirect_write(floor_dir, image.view).wall_s)
        except OSError as exc:  # no O_DIRECT here (tmpfs, some FUSE): the floor is missing, say why
            if not out["notes"]:
                out["notes"].append(f"disk floor skipped: {exc}")

    try:
        for i in range(args.cuts):
            for fn in rotate([lambda: one_cut(i + 1), disk], i):
                fn()
    finally:
        ck.close()
        image.close()
    return out


# ------------------------------------------------------------------------------------------ memory

STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile and RssShmem of a process, in bytes (/proc/<pid>/status)."""
    vals: dict[str, int] = {}
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            if key.decode() in STATUS_KEYS:
                vals[key.decode()] = int(rest.split()[0]) * 1024
    return vals


def block_rss(pid: int | str = "self") -> int:
    """Resident bytes of the process's mappings of Checkpointer blocks (/dev/shm/ckptstore-*, writer/shm.py),
    from /proc/<pid>/smaps. Not RssShmem: that also counts shared anonymous mappings (``mmap.mmap(-1, n)``,
    a writer's staging buffer), which are memory beyond the block."""
    from ckptstore.writer.shm import PREFIX, SHM_DIR

    mark = f"{SHM_DIR}/{PREFIX}".encode()
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps", "rb") as f:
        for line in f:
            if line[:1] in b"0123456789abcdef" and b"-" in line.split(b" ", 1)[0]:
                inside = mark in line
            elif inside and line.startswith(b"Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def reset_hwm(pid: int | str = "self") -> bool:
    """Resets the process's VmHWM (peak RSS) to its current RSS: ``echo 5 > /proc/<pid>/clear_refs``
    (Linux 4.0+). False where that is refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PrivateRssSampler:
    """Peak of RssAnon + RssFile (RSS without shared pages, the block's among them) of this process,
    sampled every ``interval`` s by a thread: a second reading beside VmHWM, which counts the block and so
    has the block's growth subtracted, which would undercount a peak reached before the block was resident."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def private() -> int:
        st = proc_status()
        return st["RssAnon"] + st["RssFile"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.private())

    def __enter__(self) -> "PrivateRssSampler":
        self.peak = self.private()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.private())


def measured_cut(ck: Any, clock: EventClock, state: Any, step: int) -> dict[str, Any]:
    """One cut, from the call until its ``committed`` event, with the trainer's peak memory beyond what
    it held right before the call and beyond the block's growth (and the writer process's, if any)."""
    gc.collect()
    os.sync()
    pid = ck.writer_pid
    before, block_before = proc_status(), block_rss()
    w_before = (proc_status(pid), block_rss(pid)) if pid is not None and reset_hwm(pid) else None
    hwm_reset = reset_hwm()
    with PrivateRssSampler() as sampler:
        t0 = time.perf_counter()
        handle = ck.cut(step, state)
        clock.wait(step)
        handle.wait()
        secs = time.perf_counter() - t0
    after = proc_status()
    block = block_rss() - block_before
    by_hwm = after["VmHWM"] - before["VmRSS"] - block if hwm_reset else None
    by_sampler = sampler.peak - (before["RssAnon"] + before["RssFile"])
    gc.collect()
    kept = PrivateRssSampler.private() - (before["RssAnon"] + before["RssFile"])
    w_extra = None
    if w_before is not None and ck.writer_pid == pid:
        w_after = proc_status(pid)
        w_extra = w_after["VmHWM"] - w_before[0]["VmRSS"] - (block_rss(pid) - w_before[1])
    return {"step": step, "seconds": secs, "block_growth": block,
            "shmem_growth": after["RssShmem"] - before["RssShmem"], "extra_by_hwm": by_hwm,
            "extra_by_sampler": by_sampler, "extra": max(x for x in (by_hwm, by_sampler) if x is not None),
            "kept_after": kept, "writer_extra": w_extra}


def child_mem(args: argparse.Namespace) -> dict[str, Any]:
    """``args.cuts`` measured cuts of the flat state in writer mode ``args.mode``, the first cold (it
    creates the block); old cuts are pruned between them."""
    from ckptstore import KeepLast
    from ckptstore.writer import Checkpointer

    s = build("flat", args.count)
    clock = EventClock()
    ck = Checkpointer(os.path.join(args.scratch, "store"), every=1, mode=args.mode, on_event=clock)
    out: dict[str, Any] = {"mode": args.mode, "count": s.count, "nbytes": s.nbytes, "cuts": []}
    try:
        for i in range(args.cuts):
            ck.store.prune(KeepLast(1))
            out["cuts"].append(measured_cut(ck, clock, s.state, i + 1))
    finally:
        ck.close()
    return out


# ------------------------------------------------------------------------------------------ io


def st_header_bytes(path: str) -> int:
    """The length of a safetensors file's JSON header (its first 8 bytes, little-endian)."""
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def child_io(args: argparse.Namespace) -> dict[str, Any]:
    """``args.reps`` repetitions, each: the saves (disk floor, store.save, safetensors for the flat
    layout) in a rotated order, each after ``os.sync()`` and ``--settle`` s; then the loads (read floor,
    ckptstore.load verified, safetensors materialized), cold and then warm. One untimed store.save and
    load first (a process's first call imports and warms what the others reuse)."""
    import benchsmall
    from benchfloors import AlignedImage, odirect_write

    s = build(args.layout, args.count)
    small = s.as_small()
    image = AlignedImage(s.tensors)
    image.copy_in()
    flat = s.layout == "flat"
    out: dict[str, Any] = {"layout": s.layout, "count": s.count, "nbytes": s.nbytes, "save": {}, "save_rss_mb": {},
                           "load_cold": {}, "load_warm": {}, "manifest_bytes": [], "st_header_bytes": [],
                           "cold_ok": True, "notes": []}
    warm_dir = os.path.join(args.scratch, "warmup")
    benchsmall.save_store(warm_dir, small, 1)()
    benchsmall.load_store(warm_dir)()
    shutil.rmtree(warm_dir)

    def record(table: str, name: str, fn: Callable[[], Any]) -> Any:
        res, dt, rss_mb = timed_call(fn)
        out[table].setdefault(name, []).append(dt)
        if table == "save":
            out["save_rss_mb"].setdefault(name, []).append(rss_mb)
        return res

    try:
        for rep in range(args.reps):
            root = os.path.join(args.scratch, f"rep{rep}")
            d = {k: os.path.join(root, k) for k in (DISK, STORE_SAVE, ST_SAVE)}
            os.makedirs(d[DISK])
            saves: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
                (DISK, lambda: (lambda: odirect_write(d[DISK], image.view))),
                (STORE_SAVE, lambda: benchsmall.save_store(d[STORE_SAVE], small, 1)),
            ]
            if flat:
                saves.append((ST_SAVE, lambda: benchsmall.save_safetensors(d[ST_SAVE], small)))
            for name, make in rotate(saves, rep):
                fn = make()
                gc.collect()
                settle(args.settle)
                try:
                    record("save", name, fn)
                except OSError as exc:
                    if name != DISK:
                        raise
                    out["notes"].append(f"disk floor skipped: {exc}")
            out["manifest_bytes"].append(benchsmall.manifest_bytes(d[STORE_SAVE]))
            shards = shard_files(d[STORE_SAVE])
            st = os.path.join(d[ST_SAVE], "state.safetensors")
            loads = [(READ, lambda: read_files(shards), shards), (LOAD, benchsmall.load_store(d[STORE_SAVE]), shards)]
            if flat:
                out["st_header_bytes"].append(st_header_bytes(st))
                loads.append((ST_LOAD, benchsmall.load_safetensors_materialized(st), [st]))
            for cold in (True, False):
                for name, fn, paths in rotate(loads, rep):
                    gc.collect()
                    out["cold_ok"] = prime_cache(cold, paths, out["notes"], out["cold_ok"])
                    res = record("load_cold" if cold else "load_warm", name, fn)
                    if rep == 0 and cold and name == LOAD:
                        check_roundtrip(s, res)
                    del res
            shutil.rmtree(root)
    finally:
        image.close()
    return out


# ------------------------------------------------------------------------------------------ large state


def child_large_save(args: argparse.Namespace) -> dict[str, Any]:
    """bench_store's store.save and disk floor of the 1 GiB state (its ``Bench`` methods, so the same
    timing: ``os.sync()``, ``--settle`` s, peak RSS), rotated over ``args.reps`` repetitions after one
    untimed store.save. Imports bench_store, which pins glibc's mmap threshold as its own run does."""
    import bench_store
    from storereport import DISK_WRITE, STORE_SAVE as STORE_ROW

    ns = argparse.Namespace(gib=args.gib, scratch=args.scratch, small_count=0, settle=args.settle, keep=False)
    b = bench_store.Bench(ns)
    try:
        b.save_store("warmup", 0)
        shutil.rmtree(os.path.join(b.root, "warmup"))
        b.save.clear()
        b.store_timings.clear()
        for rep in range(args.reps):
            tag = f"rep{rep}"
            for fn in rotate([lambda: b.disk_floor(tag), lambda: b.save_store(tag, rep + 1)], rep):
                fn()
            shutil.rmtree(os.path.join(b.root, tag), ignore_errors=True)
        disk = b.save.get(DISK_WRITE)
        return {"nbytes": b.nbytes, "ntensors": b.ntensors, "store_s": b.save[STORE_ROW].seconds,
                "disk_s": disk.seconds if disk is not None else [], "store_timings": b.store_timings,
                "malloc_pinned": bench_store.MALLOC_PINNED, "notes": b.notes}
    finally:
        b.cleanup()


CHILDREN: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "cuts": child_cuts, "mem": child_mem, "io": child_io, "large-save": child_large_save}


def child_main(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, REPO)
    os.makedirs(args.scratch, exist_ok=True)
    result = CHILDREN[args.child](args)
    import safetensors
    import torch

    import ckptstore

    result["versions"] = {"torch": torch.__version__, "safetensors": safetensors.__version__,
                          "ckptstore": ckptstore.__version__}
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0
