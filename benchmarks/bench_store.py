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

This file runs the methods (``Bench``); the report and its row names are storereport.py, the many small
tensors' methods benchsmall.py, and the helpers every benchmark shares benchkit.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from benchtargets import Target
from storereport import (
    BARE_B3, DCP_ASYNC, DCP_SAVE, DISK_READ, DISK_WRITE, DOC_HEAD, LOAD_NV, LOAD_V, SMALL_LOAD, ST_LOAD, ST_SAVE,
    STORE_SAVE, STORE_VERIFY, TORCH_LOAD, TORCH_SAVE, report)

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


# The measurement helpers the benchmarks share (no import-time side effects). The underscored names keep
# this file's call sites.
from benchkit import (  # noqa: E402
    GB, REPO, FloorRep, Series, command_line, free_port, measure_floors, pin_malloc, prime_cache, publish,
    sha256_file, shard_files, started_at, timed_call, write_doc)
from benchkit import read_files as warm_files, rotate as _rotate  # noqa: E402

MALLOC_PINNED = pin_malloc()

import blake3  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, REPO)
import ckptstore  # noqa: E402
import benchsmall  # noqa: E402
from benchfloors import AlignedImage, odirect_write  # noqa: E402
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
        # run() turns it off for its warm-up round; set here so bench_many can call the save methods alone.
        self._recording = True

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
            holder["sha256"] = sha256_file(path)

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
        d = self._dir(rep, "dcp")
        self._timed_save(self.save, DCP_SAVE, benchsmall.save_dcp(d, self.state))
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
        return measure_floors(self.image)

    def _init_pg(self) -> None:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
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
        _out, dt, rss_mb = timed_call(fn)
        if self._recording:
            s = table.setdefault(name, Series())
            s.seconds.append(dt)
            s.rss_mb.append(rss_mb)

    # ---------------------------------------------------------------------------------------- loads
    def _timed_load(self, table: dict[str, Series], name: str, fn: Callable[[], Any], cold: bool,
                    warm_paths: list[str], check: Callable[[Any], None] | None = None) -> None:
        gc.collect()
        self.cold_ok = prime_cache(cold, warm_paths, self.notes, self.cold_ok)
        out, dt, rss_mb = timed_call(fn)
        if check is not None:
            check(out)
        del out
        gc.collect()
        s = table.setdefault(name, Series())
        s.seconds.append(dt)
        s.rss_mb.append(rss_mb)

    def load_methods(self, store_dir: str, pt: str, st: str) -> list[tuple[str, Callable[[], Any], list[str]]]:
        shards = shard_files(store_dir)
        return [
            (DISK_READ, lambda: warm_files(shards), shards),
            (LOAD_V, benchsmall.load_store(store_dir), shards),
            (LOAD_NV, benchsmall.load_store(store_dir, verify=False), shards),
            (ST_LOAD, benchsmall.load_safetensors_materialized(st), [st]),
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
            (DCP_SAVE, lambda: benchsmall.save_dcp(dirs["dcp"], s.state)),
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
    cmd = command_line("bench_store.py", argv)
    started = started_at()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    b = Bench(args)
    try:
        b.run()
    finally:
        b.cleanup()
    body = report(b, TARGETS, MALLOC_PINNED, cmd, started, time.perf_counter() - t0, load_before, os.getloadavg())
    # bench_dcp.py maintains its own region of the same file: it stays.
    publish(body, args.out, lambda path, text: write_doc(path, DOC_HEAD, text, keep_region="bench_dcp"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
