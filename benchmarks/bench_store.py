"""Side-by-side benchmark: ckptstore vs its physical floors, torch.save, safetensors and torch.distributed.checkpoint.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_store.py [--gib 1] [--reps 3] [--small-count 40000] [--out docs/benchmarks.md]

One process, one run. The state is built once (a transformer-like layout, as in
shared/research/limits.md: bf16 weights, fp32 Adam exp_avg / exp_avg_sq, six int64 counters). Every
repetition runs every method, interleaved, so machine drift hits all of them alike; ratios are taken per
repetition (paired) and then summarised as median (min-max). GB = 1e9 bytes; GB/s = state bytes / wall.
The targets (``TARGETS`` below) are judged on the median of those paired ratios; every table carries a
"target" and a "met?" column.

* FLOORS, measured in every repetition on the state's own bytes (benchfloors.py): a plain memcpy of every
  tensor into prefaulted page-aligned memory; a bare blake3 pass over those bytes (1 thread and AUTO);
  the disk's own O_DIRECT write + fsync of them from that page-aligned memory (timed like a save, in the
  save rotation); a raw read of the store's shard (in the load rotation).
* SAVE: wall from the call until the data is durable (fsync), including sha256 for torch.save.
  ``os.sync()`` and ``--settle`` seconds of idle run before each timed save so writeback of the previous
  one does not bleed in. One untimed warm-up round of every save runs first (DCP's first call in a
  process is ~2x slower).
* LOAD cold: ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each timed load. Warm: the files are
  read once (untimed) right before the timed load.
* VERIFY: ``Store.verify()`` vs a bare blake3 (max_threads=AUTO, update_mmap) over the same shard files,
  warm page cache.
* MANY SMALL TENSORS (``--small-count``, default 40,000 float32 tensors of 4 KB; 0 turns it off):
  store.save vs safetensors save_file + fsync (file and directory) and dcp.save, plus the disk floor of
  the same bytes; ckptstore.load vs safetensors load_file with every tensor cloned, cold and warm; the
  manifest's size per tensor.
* Peak extra RSS: psutil RSS of this process sampled every 10 ms by a thread, minus the RSS right before
  the call.

glibc's dynamic mmap threshold is pinned (mallopt) at start-up so every large tensor allocation is a
fresh mmap, as in a freshly started process; otherwise whichever loader runs second would get
recycled, already-faulted heap pages (on this VM class first-touch of fresh memory is the slow part).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from benchtargets import DASH, Judge, Target, table as md_table

GB = 1e9
GIB = float(1 << 30)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Row names; "(floor)" rows are sorted last in every table and never carry a target.
STORE_SAVE = "store.save"
TORCH_SAVE = "torch.save + fsync + sha256"
ST_SAVE = "safetensors.save_file + fsync"
DCP_SAVE = "dcp.save (FileSystemWriter)"
DCP_ASYNC = "dcp.async_save (until future done)"
DISK_WRITE = "(floor) disk: the same bytes, O_DIRECT from page-aligned memory + fsync (file, dir)"
DISK_READ = "(floor) disk: readinto a reused 8 MiB buffer, store shard"
LOAD_V = "ckptstore.load verify=True"
LOAD_NV = "ckptstore.load verify=False"
ST_LOAD = "safetensors.load_file + clone (materialized)"
TORCH_LOAD = "torch.load(weights_only=True, mmap=False)"
BARE_B3 = "(floor) bare blake3 (AUTO, update_mmap) over the shard files"
STORE_VERIFY = "Store.verify()"
SMALL_LOAD = "ckptstore.load (verify=True, the default)"

# The targets of the issue, in one place. Ratios are per repetition (paired), judged on their median.
TARGETS: dict[str, Target] = {
    "save_vs_disk": Target("store.save time / the disk floor's time (same bytes, same run)", "at_most", 1.15),
    "load_cold_noverify": Target("cold load verify=False: GB/s ratio to safetensors materialized", "at_least", 1.0),
    "load_cold_verify": Target("cold load verify=True: GB/s ratio to safetensors materialized", "at_least", 0.8),
    "verify": Target("Store.verify() time / a bare blake3 pass over the same files", "at_most", 1.2),
    "small_save": Target("many small tensors: store.save time / safetensors save_file + fsync time", "at_most", 1.3),
    "small_load_cold": Target("many small tensors, cold: ckptstore.load time / safetensors load_file "
                              "materialized time", "at_most", 1.3),
    "small_load_warm": Target("many small tensors, warm: ckptstore.load time / safetensors load_file "
                              "materialized time", "at_most", 1.3),
}


# The measurement helpers bench_dcp.py shares (no import-time side effects). The underscored names keep
# this file's call sites; ``ratio`` is also a local name here.
from benchkit import (  # noqa: E402
    FloorRep, RssSampler, Series, drop_caches, gbps, machine_summary, paired, pin_malloc, shard_files)
from benchkit import ordered as _ordered, ratio as _ratio, read_files as warm_files  # noqa: E402
from benchkit import rotate as _rotate, secs as _secs  # noqa: E402

MALLOC_PINNED = pin_malloc()

import blake3  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, REPO)
import ckptstore  # noqa: E402
import benchsmall  # noqa: E402
from benchfloors import AlignedImage, blake3_pass, odirect_write  # noqa: E402
from benchstate import build_state, fmt, fsync_path  # noqa: E402


# --------------------------------------------------------------------------------------------------
# measurement helpers


@dataclass
class SmallResults:
    """The many-small-tensors case: its own save and load tables and the manifest size per repetition."""

    count: int
    nbytes: int
    save: dict[str, Series] = field(default_factory=dict)
    load_cold: dict[str, Series] = field(default_factory=dict)
    load_warm: dict[str, Series] = field(default_factory=dict)
    manifest_bytes: list[int] = field(default_factory=list)


def fsync_tree(root: str) -> None:
    """fsync every file under root and every directory (what DCP leaves to the caller for dirs)."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


class CpuWatch:
    """Cores used by processes other than this one (from /proc/stat busy time minus our own CPU)."""

    def __init__(self) -> None:
        self.proc = psutil.Process()

    def __enter__(self) -> "CpuWatch":
        self.t0 = time.perf_counter()
        self.sys0 = psutil.cpu_times()
        self.me0 = self.proc.cpu_times()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t0
        s1, m1 = psutil.cpu_times(), self.proc.cpu_times()
        busy = lambda s: s.user + s.nice + s.system + getattr(s, "irq", 0) + getattr(s, "softirq", 0) + getattr(s, "steal", 0)  # noqa: E731
        me = (m1.user + m1.system) - (self.me0.user + self.me0.system)
        self.foreign_cores = max(0.0, (busy(s1) - busy(self.sys0) - me) / wall)
        self.iowait_cores = (getattr(s1, "iowait", 0) - getattr(self.sys0, "iowait", 0)) / wall


# --------------------------------------------------------------------------------------------------
# the methods


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        os.makedirs(args.scratch, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix="bench-store-", dir=args.scratch)
        self.state, self.flat, self.nbytes = build_state(args.gib)
        self.ntensors = len(self.flat)
        # The floors' copy of the state: allocated and prefaulted once, refilled (timed) every repetition.
        self.image = AlignedImage(list(self.flat.values()))
        self.image.copy_in()
        self.floors: list[FloorRep] = []
        self.small: benchsmall.SmallState | None = None
        self.small_image: AlignedImage | None = None
        self.small_res: SmallResults | None = None
        if args.small_count > 0:
            self.small = benchsmall.build_small_state(args.small_count)
            self.small_image = AlignedImage(list(self.small.state.values()))
            self.small_image.copy_in()
            self.small_res = SmallResults(self.small.count, self.small.nbytes)
        self.save: dict[str, Series] = {}
        self.load_cold: dict[str, Series] = {}
        self.load_warm: dict[str, Series] = {}
        self.verify: dict[str, Series] = {}
        self.notes: list[str] = []
        self.cold_ok = True
        self.pg_initialized = False
        self.foreign: list[float] = []
        self.store_timings: list[dict[str, float]] = []
        self.async_blocking: list[float] = []

    # ---------------------------------------------------------------------------------------- saves
    def _dir(self, rep: str, name: str) -> str:
        return os.path.join(self.root, rep, name)

    def save_store(self, rep: str, step: int) -> str:
        d = self._dir(rep, "store")
        events: list[dict[str, Any]] = []
        store = ckptstore.Store.open(d, create=True, options=ckptstore.StoreOptions(on_event=events.append))
        try:
            self._timed_save(self.save, STORE_SAVE, lambda: store.save(self.state, step=step))
        finally:
            store.close()
        for e in events:
            if e.get("event") == "committed":
                self.store_timings.append(e["timings"])
        return d

    def save_torch(self, rep: str) -> str:
        d = self._dir(rep, "torch")
        os.makedirs(d)
        path = os.path.join(d, "state.pt")
        holder: dict[str, str] = {}

        def run() -> None:
            torch.save(self.state, path)
            fsync_path(path)
            fsync_path(d)
            h = hashlib.sha256()
            buf = bytearray(8 << 20)
            mv = memoryview(buf)
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(mv):
                    h.update(mv[:n])
            holder["sha256"] = h.hexdigest()

        self._timed_save(self.save, TORCH_SAVE, run)
        return path

    def save_safetensors(self, rep: str) -> str:
        from safetensors.torch import save_file

        d = self._dir(rep, "safetensors")
        os.makedirs(d)
        path = os.path.join(d, "state.safetensors")

        def run() -> None:
            save_file(self.flat, path, metadata={"step": str(self.state["step"])})
            fsync_path(path)
            fsync_path(d)

        self._timed_save(self.save, ST_SAVE, run)
        return path

    def save_dcp(self, rep: str) -> str:
        import torch.distributed.checkpoint as dcp

        d = self._dir(rep, "dcp")

        def run() -> None:
            dcp.save(self.state, storage_writer=dcp.FileSystemWriter(d))
            fsync_path(d)

        self._timed_save(self.save, DCP_SAVE, run)
        return d

    def save_dcp_async(self, rep: str) -> str:
        import torch.distributed.checkpoint as dcp

        d = self._dir(rep, "dcp_async")
        blocking: list[float] = []

        def run() -> None:
            t0 = time.perf_counter()
            try:
                fut = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(d))
            except (ValueError, RuntimeError) as exc:
                if self.pg_initialized or "process group" not in str(exc).lower():
                    raise
                self._init_pg()
                self.notes.append(f"dcp.async_save needed a process group ({exc}); a 1-rank gloo group was used")
                shutil.rmtree(d, ignore_errors=True)
                t0 = time.perf_counter()
                fut = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(d))
            blocking.append(time.perf_counter() - t0)
            f = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse in newer torch
            f.result()
            fsync_path(d)

        self._timed_save(self.save, DCP_ASYNC, run)
        self.async_blocking.extend(blocking)
        return d

    def disk_floor(self, rep: str) -> None:
        """The disk floor, timed like a save: the state's bytes written with O_DIRECT straight from the
        page-aligned image, then fsync of the file and the directory (benchfloors.odirect_write)."""
        d = self._dir(rep, "disk")
        os.makedirs(d, exist_ok=True)
        try:
            self._timed_save(self.save, DISK_WRITE, lambda: odirect_write(d, self.image.view))
        except OSError as exc:  # no O_DIRECT here (tmpfs, some FUSE): the floor row is missing, say why
            self.notes.append(f"disk floor skipped: {exc}")
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def measure_floors(self) -> FloorRep:
        """The in-memory floors of this repetition: memcpy into the image, then blake3 over it."""
        gc.collect()
        memcpy = self.image.copy_in()
        return FloorRep(memcpy, blake3_pass(self.image.view, threads=1), blake3_pass(self.image.view, threads=0))

    def _init_pg(self) -> None:
        import torch.distributed as dist

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
        self.pg_initialized = True

    def _timed_save(self, table: dict[str, Series], name: str, fn: Callable[[], Any],
                    settle: float | None = None) -> None:
        os.sync()
        gc.collect()
        # The virtio disk acknowledges writes fast but its flush (fsync) pays for whatever the host still
        # has to persist, including the previous method's data and the discards of deleted files: let it
        # settle so every method starts from the same state (see --settle).
        if self._recording:
            time.sleep(self.args.settle if settle is None else settle)
        with RssSampler() as rss:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        if self._recording:
            s = table.setdefault(name, Series())
            s.seconds.append(dt)
            s.rss_mb.append(rss.extra_mb)

    # ---------------------------------------------------------------------------------------- loads
    def _timed_load(self, table: dict[str, Series], name: str, fn: Callable[[], Any], cold: bool,
                    warm_paths: list[str], check: Callable[[Any], None] | None = None) -> None:
        gc.collect()
        if cold:
            err = drop_caches()
            if err is not None and self.cold_ok:
                self.cold_ok = False
                self.notes.append(f"drop_caches failed ({err}): the 'cold' load figures are WARM")
        else:
            warm_files(warm_paths)
        with RssSampler() as rss:
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
        if check is not None:
            check(out)
        del out
        gc.collect()
        s = table.setdefault(name, Series())
        s.seconds.append(dt)
        s.rss_mb.append(rss.extra_mb)

    def load_methods(self, store_dir: str, pt: str, st: str) -> list[tuple[str, Callable[[], Any], list[str]]]:
        from safetensors.torch import load_file

        def st_materialized() -> dict[str, torch.Tensor]:
            lazy = load_file(st)
            out = {k: v.clone() for k, v in lazy.items()}  # load_file maps lazily: clone forces every byte
            del lazy
            return out

        shards = shard_files(store_dir)

        def raw_read() -> None:
            warm_files(shards)

        return [
            (DISK_READ, raw_read, shards),
            (LOAD_V, lambda: ckptstore.load(store_dir), shards),
            (LOAD_NV, lambda: ckptstore.load(store_dir, verify=False), shards),
            (ST_LOAD, st_materialized, [st]),
            (TORCH_LOAD, lambda: torch.load(pt, weights_only=True, mmap=False), [pt]),
        ]

    def check_roundtrip(self, out: Any) -> None:
        for k, v in self.state["model"].items():
            assert torch.equal(out["model"][k], v), k
        for k, st in self.state["optim"]["state"].items():
            for sk, v in st.items():
                assert torch.equal(out["optim"]["state"][k][sk], v), (k, sk)
        assert out["step"] == self.state["step"]
        assert out["optim"]["param_groups"] == self.state["optim"]["param_groups"]

    # ---------------------------------------------------------------------------------------- verify
    def verify_pair(self, store_dir: str) -> None:
        shards = shard_files(store_dir)
        warm_files(shards)

        def bare() -> None:
            for p in shards:
                h = blake3.blake3(max_threads=blake3.blake3.AUTO)
                h.update_mmap(p)
                h.hexdigest()

        pairs = ((BARE_B3, bare), (STORE_VERIFY, None))
        with ckptstore.Store.open(store_dir, readonly=True) as store:
            for i in range(self.args.verify_pairs):  # alternate the order: no method always goes first
                for name, fn in (pairs if i % 2 == 0 else pairs[::-1]):
                    gc.collect()
                    t0 = time.perf_counter()
                    r = (fn or store.verify)()
                    dt = time.perf_counter() - t0
                    if r is not None:
                        assert r.ok, r.to_json()
                    self.verify.setdefault(name, Series()).seconds.append(dt)

    # ---------------------------------------------------------------------------------------- driver
    def run(self) -> None:
        args = self.args
        print(f"state: {self.ntensors} tensors, {self.nbytes:,} bytes; scratch {self.root}", flush=True)
        self._recording = False
        if args.warmup:
            print("warm-up round (untimed)...", flush=True)
            for fn in (lambda: self.save_store("warmup", 0), lambda: self.save_torch("warmup"),
                       lambda: self.save_safetensors("warmup"), lambda: self.save_dcp("warmup"),
                       lambda: self.save_dcp_async("warmup")):
                fn()
            shutil.rmtree(os.path.join(self.root, "warmup"))
            self.store_timings.clear()
            self.async_blocking.clear()
        self._recording = True
        for rep in range(args.reps):
            tag = f"rep{rep}"
            last = rep == args.reps - 1
            with CpuWatch() as cw:
                print(f"[{tag}] floors (memcpy, blake3)...", flush=True)
                self.floors.append(self.measure_floors())
                print(f"[{tag}] saves...", flush=True)
                saves: list[tuple[str, Callable[[], str | None]]] = [
                    ("disk", lambda: self.disk_floor(tag)),
                    ("store", lambda: self.save_store(tag, rep + 1)),
                    ("torch", lambda: self.save_torch(tag)),
                    ("safetensors", lambda: self.save_safetensors(tag)),
                    ("dcp", lambda: self.save_dcp(tag)),
                    ("dcp_async", lambda: self.save_dcp_async(tag)),
                ]
                outs = {key: fn() for key, fn in _rotate(saves, rep)}
                shutil.rmtree(outs["dcp"])
                shutil.rmtree(outs["dcp_async"])
                store_dir, pt, st = outs["store"], outs["torch"], outs["safetensors"]
                print(f"[{tag}] cold loads...", flush=True)
                methods = _rotate(self.load_methods(store_dir, pt, st), rep)
                for name, fn, paths in methods:
                    check = self.check_roundtrip if (rep == 0 and name == LOAD_V) else None
                    self._timed_load(self.load_cold, name, fn, True, paths, check)
                print(f"[{tag}] warm loads...", flush=True)
                for name, fn, paths in methods:
                    self._timed_load(self.load_warm, name, fn, False, paths)
                print(f"[{tag}] verify...", flush=True)
                self.verify_pair(store_dir)
                if self.small is not None:
                    self.run_small(tag, rep)
                if not (last and args.keep):
                    shutil.rmtree(os.path.join(self.root, tag))
            self.foreign.append(cw.foreign_cores)
            print(f"[{tag}] done; other processes used {cw.foreign_cores:.2f} cores on average", flush=True)
            self.print_progress()

    def run_small(self, tag: str, rep: int) -> None:
        """The many-small-tensors case of one repetition: saves (rotated, each after os.sync() and
        --small-settle s), cold and warm loads (rotated), the manifest size."""
        s, img, res = self.small, self.small_image, self.small_res
        assert s is not None and img is not None and res is not None
        root = self._dir(tag, "small")
        dirs = {k: os.path.join(root, k) for k in ("disk", "store", "safetensors", "dcp")}
        os.makedirs(dirs["disk"])
        print(f"[{tag}] many small tensors ({s.count:,}): saves...", flush=True)
        saves: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
            (DISK_WRITE, lambda: (lambda: odirect_write(dirs["disk"], img.view))),
            (STORE_SAVE, lambda: benchsmall.save_store(dirs["store"], s, rep + 1)),
            (ST_SAVE, lambda: benchsmall.save_safetensors(dirs["safetensors"], s)),
            (DCP_SAVE, lambda: benchsmall.save_dcp(dirs["dcp"], s)),
        ]
        for name, make in _rotate(saves, rep):
            try:
                self._timed_save(res.save, name, make(), settle=self.args.small_settle)
            except OSError as exc:
                if name != DISK_WRITE:
                    raise
                self.notes.append(f"small-tensor disk floor skipped: {exc}")
        shutil.rmtree(dirs["dcp"])
        res.manifest_bytes.append(benchsmall.manifest_bytes(dirs["store"]))
        shards = shard_files(dirs["store"])
        st = os.path.join(dirs["safetensors"], "state.safetensors")
        loads = _rotate([
            (DISK_READ, lambda: warm_files(shards), shards),
            (SMALL_LOAD, benchsmall.load_store(dirs["store"]), shards),
            (LOAD_NV, benchsmall.load_store(dirs["store"], verify=False), shards),
            (ST_LOAD, benchsmall.load_safetensors_materialized(st), [st]),
        ], rep)
        print(f"[{tag}] many small tensors: cold and warm loads...", flush=True)
        for name, fn, paths in loads:
            check = (lambda out: benchsmall.check_roundtrip(s, out)) if (rep == 0 and name == SMALL_LOAD) else None
            self._timed_load(res.load_cold, name, fn, True, paths, check)
        for name, fn, paths in loads:
            self._timed_load(res.load_warm, name, fn, False, paths)
        shutil.rmtree(root)

    def print_progress(self) -> None:
        for name, s in self.save.items():
            print(f"    {name:45s} {fmt([self.nbytes / GB / x for x in s.seconds])} GB/s")
        if self.small_res is not None:
            for name, s in self.small_res.save.items():
                print(f"    small: {name:38s} {fmt(s.seconds, 3)} s")

    def cleanup(self) -> None:
        for img in (self.image, self.small_image):
            if img is not None:
                img.close()
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        if self.pg_initialized:
            import torch.distributed as dist

            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# report


def report_floors(b: Bench, J: Judge) -> list[str]:
    """The floors of this run, on the state's own bytes: memcpy, blake3, disk write, disk read."""
    fl, n = b.floors, b.nbytes
    mc = [f.memcpy for f in fl]
    b1 = [f.blake3_1t for f in fl]
    ba = [f.blake3_auto for f in fl]
    rows = [
        [f"plain memcpy: `copy_` of every tensor into prefaulted page-aligned memory (torch threads "
         f"{torch.get_num_threads()})", fmt([x.wall_s for x in mc], 3), fmt([x.gbps for x in mc]), DASH],
        ["bare blake3 pass over those bytes in memory, 1 thread", fmt([x.wall_s for x in b1], 3),
         fmt([x.gbps for x in b1]), fmt([x.cpu_s_per_gib for x in b1], 3)],
        ["bare blake3 pass over those bytes in memory, AUTO threads (CPU: the whole process)",
         fmt([x.wall_s for x in ba], 3), fmt([x.gbps for x in ba]), fmt([x.cpu_s_per_gib for x in ba], 3)],
    ]
    dw, dr = _secs(b.save, DISK_WRITE), _secs(b.load_cold, DISK_READ)
    rows.append(["disk write: those bytes with O_DIRECT from the page-aligned memory, 8 MiB requests, then "
                 "fsync (file, dir); the save table's floor row", fmt(dw, 3), fmt(gbps(n, dw)), DASH])
    rows.append(["disk read: the store's shard file, cold page cache, 8 MiB readinto; the cold load table's "
                 "floor row", fmt(dr, 3), fmt(gbps(n, dr)), DASH])
    L = ["### Floors (the state's own bytes, measured in every repetition of this run)", ""]
    L += md_table(["floor", "wall s", "GB/s", "CPU s/GiB", "target", "met?"], [r + J.cells(None) for r in rows])
    return L


def report_save(b: Bench, J: Judge) -> list[str]:
    n = b.nbytes
    store_s, disk_s, torch_s = _secs(b.save, STORE_SAVE), _secs(b.save, DISK_WRITE), _secs(b.save, TORCH_SAVE)
    L = ["### Save (until durable)", ""]
    rows = []
    for name, s in _ordered(b.save):
        to_disk = paired(s.seconds, disk_s) if disk_s else []
        to_store = "1 (reference)" if name == STORE_SAVE else _ratio(s.seconds, store_s)
        key = "save_vs_disk" if name == STORE_SAVE else None
        shown = _ratio(s.seconds, disk_s) + " the disk floor's time"
        rows.append([name, fmt(s.seconds), fmt(gbps(n, s.seconds)), _ratio(s.seconds, disk_s), to_store,
                     fmt(s.rss_mb, 0), *J.cells(key, to_disk, shown)])
    L += md_table(["method", "wall s", "GB/s", "time / disk floor", "time / store.save (torch.save row: the ratio "
                   "to torch.save)", "peak extra RSS MB", "target", "met?"], rows)
    L.append("")
    if b.async_blocking:
        L.append(f"dcp.async_save call blocked for {fmt(b.async_blocking)} s before returning its future.")
    if b.store_timings:
        parts = ", ".join(f"{k} {fmt([t[k] for t in b.store_timings], 3)} s" for k in ("flatten", "write", "commit")
                          if all(k in t for t in b.store_timings))
        L.append(f"store.save stages (its own 'committed' event): {parts}.")
    if torch_s and store_s:
        L.append(f"Ratio to torch.save (reported, no longer a target): torch.save + fsync + sha256 took "
                 f"{_ratio(torch_s, store_s)} store.save's time" + (f" and {_ratio(torch_s, disk_s)} the disk floor's "
                 "time (the most any writer could reach on this disk)" if disk_s else "") + ".")
    if not disk_s:
        L.append("**The disk floor is missing from this run (see the notes), so the save target could not be judged.**")
    return L


def report_loads(b: Bench, J: Judge) -> list[str]:
    n = b.nbytes
    L: list[str] = []
    targets = {LOAD_NV: "load_cold_noverify", LOAD_V: "load_cold_verify"}
    for cold, t in ((True, b.load_cold), (False, b.load_warm)):
        title = ("### Load, cold page cache (sync + drop_caches before each)" if cold else "### Load, warm page cache")
        if cold and not b.cold_ok:
            title += " - **drop_caches FAILED: these are WARM figures**"
        L += ["", title, ""]
        ref = _secs(t, ST_LOAD)
        rows = []
        for name, s in _ordered(t):
            ratio = paired(ref, s.seconds)
            key = targets.get(name) if cold else None
            rows.append([name, fmt(s.seconds), fmt(gbps(n, s.seconds)), fmt(ratio) + "x", fmt(s.rss_mb, 0),
                         *J.cells(key, ratio, f"GB/s ratio {fmt(ratio)}x")])
        L += md_table(["method", "wall s", "GB/s", "GB/s ratio to safetensors materialized", "peak extra RSS MB",
                       "target", "met?"], rows)
    if not b.cold_ok:
        L += ["", "The cold load targets were judged on warm figures because drop_caches failed."]
    return L


def report_verify(b: Bench, J: Judge) -> list[str]:
    n = b.nbytes
    vb = _secs(b.verify, BARE_B3)
    rows = []
    for name, s in sorted(b.verify.items(), key=lambda kv: kv[0].startswith("(floor)")):
        r = paired(s.seconds, vb)
        key = "verify" if name == STORE_VERIFY else None
        rows.append([name, fmt(s.seconds, 3), fmt(gbps(n, s.seconds)), fmt(r) + "x",
                     *J.cells(key, r, f"time ratio {fmt(r)}x")])
    return ["", "### Verify (warm page cache)", ""] + md_table(
        ["method", "wall s", "GB/s", "time / bare blake3 time", "target", "met?"], rows)


def report_small(b: Bench, J: Judge) -> list[str]:
    r = b.small_res
    if r is None:
        return ["", "### Many small tensors", "", "Not run (`--small-count 0`)."]
    mb = r.nbytes / 1e6
    L = ["", f"### Many small tensors: {r.count:,} float32 tensors of {benchsmall.ELEMS * 4:,} bytes "
         f"({r.nbytes:,} bytes), one flat dict", ""]
    st_save, disk_s = _secs(r.save, ST_SAVE), _secs(r.save, DISK_WRITE)
    rows = []
    for name, s in _ordered(r.save):
        ratio = paired(s.seconds, st_save)
        key = "small_save" if name == STORE_SAVE else None
        rows.append([name, fmt(s.seconds, 3), fmt([mb / x for x in s.seconds], 0),
                     fmt([r.count / x / 1e3 for x in s.seconds], 1), fmt(ratio) + "x", _ratio(s.seconds, disk_s),
                     *J.cells(key, ratio, f"time ratio {fmt(ratio)}x")])
    L += ["Save (until durable; os.sync() and " + f"{b.args.small_settle:g} s of idle before each):", ""]
    L += md_table(["method", "wall s", "MB/s", "k tensors/s", "time / safetensors save_file + fsync",
                   "time / disk floor", "target", "met?"], rows)
    for cold, t in ((True, r.load_cold), (False, r.load_warm)):
        ref = _secs(t, ST_LOAD)
        rows = []
        for name, s in _ordered(t):
            ratio = paired(s.seconds, ref)
            key = ("small_load_cold" if cold else "small_load_warm") if name == SMALL_LOAD else None
            rows.append([name, fmt(s.seconds, 3), fmt([mb / x for x in s.seconds], 0),
                         fmt([r.count / x / 1e3 for x in s.seconds], 1), fmt(ratio) + "x", fmt(s.rss_mb, 0),
                         *J.cells(key, ratio, f"time ratio {fmt(ratio)}x")])
        L += ["", ("Load, cold page cache (sync + drop_caches before each):" if cold else "Load, warm page cache:"), ""]
        L += md_table(["method", "wall s", "MB/s", "k tensors/s", "time / safetensors load_file materialized",
                       "peak extra RSS MB", "target", "met?"], rows)
    if r.manifest_bytes:
        L += ["", f"Manifest (MANIFEST.json): {fmt(r.manifest_bytes, 0)} bytes, "
              f"{fmt([x / r.count for x in r.manifest_bytes], 1)} bytes per tensor."]
    return L


def report(b: Bench, cmd: str, started: str, wall: float, load_before: tuple, load_after: tuple) -> str:
    n = b.nbytes
    J = Judge(TARGETS)
    L: list[str] = [
        f"State: {b.ntensors} tensors, {n:,} bytes ({n / GB:.3f} GB; bf16 weights, fp32 Adam moments, "
        f"6 int64 counters), {b.args.reps} repetitions, figures are median (min-max). GB = 1e9 bytes, "
        "GiB = 2^30 bytes. Ratios are paired per repetition; targets are judged on their median.",
        "",
    ]
    L += report_floors(b, J)
    L += [""] + report_save(b, J)
    L += report_loads(b, J)
    L += report_verify(b, J)
    L += report_small(b, J)
    L += ["", "### Targets (from the issues), judged on the median of the paired per-repetition ratios", ""]
    L += J.summary()
    L += ["", "### Conditions", "", f"* Command: `{cmd}`", f"* Started {started}; the whole run took {wall:.0f} s."]
    L += [f"* {line}" for line in machine_summary(REPO)]
    L.append(f"* Load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}; after: "
             f"{'/'.join(f'{x:.2f}' for x in load_after)}. Other processes used {fmt(b.foreign)} cores on "
             "average per repetition (from /proc/stat). The machine is shared with other engineers running "
             "tests, so treat spreads as noise, not signal.")
    L.append(f"* glibc mmap threshold pinned (fresh memory for every big allocation): {MALLOC_PINNED}. "
             f"Untimed warm-up round of every save first: {b.args.warmup}.")
    L.append("* Method: every repetition runs every method, into a scratch directory on the "
             f"same file system as the work tree; `os.sync()` and {b.args.settle:g} s of idle before each timed save (so the host has drained the previous method's writes and file deletions: in a probe on this VM, a 1 GiB O_DIRECT write + fsync got 0.21-0.25 GB/s right after another and 0.42 GB/s after 15-30 s idle); cold loads after `sync` + "
             "`echo 3 > /proc/sys/vm/drop_caches`; warm loads after reading the files once. torch.save's sha256 "
             "re-reads the file (page cache). safetensors/DCP/torch.save fsync their files and directory. "
             "dcp.save and dcp.async_save run without a process group (single-process mode), FileSystemWriter "
             "defaults (1 thread, sync_files=True); async_save uses the default thread executor. "
             "The safetensors load clones every tensor because load_file maps the file lazily; its peak RSS counts the "
             "mapped file pages as well as the clones. Peak extra RSS = peak of psutil RSS sampled every 10 ms minus "
             "the RSS just before the call. "
             "Methods run in a rotated order (each repetition starts with a different one). "
             "store.save is timed from the call to its return (LATEST durable), excluding Store.open.")
    L.append("* Floors: the disk floor writes the state's bytes (packed in 4 KiB-aligned slots, as the writer's block "
             "lays them out) from one prefaulted, page-aligned anonymous mapping with O_DIRECT, then fsyncs the file "
             "and the directory; it is timed like a save (same os.sync(), same settle, same rotation). The memcpy "
             "and blake3 floors run on that mapping at the start of each repetition; blake3's 1-thread CPU time is "
             "the hashing thread's own (time.thread_time).")
    for note in b.notes:
        L.append(f"* Note: {note}")
    return "\n".join(L) + "\n"


def write_doc(path: str, body: str) -> None:
    head = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/bench_store.py` (do not edit by hand; rerun it). It judges ckptstore's",
        "synchronous `Store.save`, `ckptstore.load` and `Store.verify` against the physical floors measured in",
        "the same run on the same bytes (memcpy, a bare blake3 pass, the disk's own O_DIRECT write + fsync and",
        "raw read), and compares them with torch.save, safetensors and torch.distributed.checkpoint, in one",
        "process, interleaved per repetition; then the same for many small tensors. Each table has a target and",
        "a met? column. Physical limits of this machine class are in shared/research/limits.md (O_DIRECT",
        "write+fsync ~1.6-1.9 GB/s; buffered writes 0.2-1.5 GB/s because fresh page-cache pages are slow on this",
        "VM; cold sequential reads ~0.7-1.4 GB/s).",
        "",
        "Several ranks (a 2-rank Checkpointer beside 1 rank and DCP's `async_save`): docs/benchmarks-ranks.md.",
        "The background writer: docs/benchmarks-writer.md.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Keep the region bench_dcp.py maintains in the same file (between its begin/end markers).
    keep = ""
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
        begin, end = "<!-- bench_dcp:begin -->", "<!-- bench_dcp:end -->"
        if begin in old and end in old.split(begin, 1)[1]:
            keep = "\n" + begin + old.split(begin, 1)[1].split(end, 1)[0] + end + "\n"
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n" + body + keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the markdown report here (e.g. docs/benchmarks.md)")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"),
                    help="scratch directory on the file system under test (default: bench-out/, gitignored)")
    ap.add_argument("--verify-pairs", type=int, default=3,
                    help="verify / bare-blake3 pairs per repetition, alternating which goes first (default 3)")
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds of idle after os.sync() before each timed save (default 15: on this VM a write "
                         "right after another large one ran at about half speed)")
    ap.add_argument("--small-count", type=int, default=benchsmall.DEFAULT_COUNT,
                    help=f"tensors in the many-small-tensors case, float32 x {benchsmall.ELEMS} each "
                         f"(default {benchsmall.DEFAULT_COUNT:,}; 0 skips the case)")
    ap.add_argument("--small-settle", type=float, default=3.0,
                    help="seconds of idle after os.sync() before each timed save of the small-tensors case (default 3)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--keep", action="store_true", help="keep the scratch files of the last repetition")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_store.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    b = Bench(args)
    try:
        b.run()
    finally:
        b.cleanup()
    body = report(b, cmd, started, time.perf_counter() - t0, load_before, os.getloadavg())
    print()
    print(body)
    if args.out:
        write_doc(args.out, body)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
