"""Side-by-side benchmark: ckptstore's DCP backend (StoreWriter / StoreReader) beside DCP's own
FileSystemWriter / FileSystemReader, on the same state, with the physical floors of the same run.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_dcp.py [--gib 1] [--reps 3] [--out docs/benchmarks.md]

One process, DCP without a process group (its single-process mode; the "no process group" warnings are
silenced). The state is benchstate.build_state(--gib): bf16 weights, fp32 Adam moments, six int64
counters, plus the optimizer's param_groups and an int step (byte-IO items for DCP). Every repetition
runs every method, interleaved and in a rotated order, into fresh directories under a scratch directory
on the repository's file system (bench-out/, as bench_store.py); ratios are taken per repetition
(paired) and summarised as median (min-max). GB = 1e9 bytes; GB/s = the state's tensor bytes / wall.

* SAVE, until durable, each after ``os.sync()`` and ``--settle`` s of idle (as bench_store.py, so the
  previous method's writeback does not bleed in):
  - ``dcp.save(state, storage_writer=StoreWriter(url, step=rep+1))``: returns once the cut is committed
    (shards fsynced, manifest, LATEST). StoreWriter hashes every byte with blake3 on the way.
  - ``dcp.save(state, storage_writer=FileSystemWriter(dir))`` with its defaults (1 thread,
    sync_files=True: it fsyncs its data files and .metadata, not the directory). The same save is timed
    twice: when dcp.save returns ("as shipped") and after bench_ranks' ``fsync_dcp_dir`` (the directory
    and its parent, so the files' and the directory's own entries are durable): the durable figure.
    FileSystemWriter does not hash.
  - the disk floor (benchfloors.odirect_write): the same bytes written with O_DIRECT from page-aligned
    memory, then fsync of the file and the directory.
  Per-phase times of the two DCP writers (their prepare_global_plan, write_data, finish, timed by
  wrapping the writer object's methods) are reported under the table; the rest of a save is DCP's own
  planning and collectives.
* LOAD, ``dcp.load`` into one preallocated state of the same structure (zeroed, untimed, before each
  load), cold (``sync; echo 3 > /proc/sys/vm/drop_caches`` before each) and warm (the files read once
  right before): ``StoreReader(url, verify=True)``, ``StoreReader(url, verify=False)``,
  ``FileSystemReader(dir)``; floor: a raw sequential read of the store's shard files (8 MiB readinto).
  In the first repetition every reader's cold load is checked against the saved state (torch.equal of
  every tensor, the step, the param_groups), so no broken load is ever timed unnoticed.
* FLOORS in memory, every repetition, on the state's own bytes (benchfloors): a plain memcpy, a bare
  blake3 pass with 1 thread and with AUTO threads (StoreWriter hashes with AUTO threads by default).
* Peak extra RSS: psutil RSS of this process sampled every 10 ms by a thread, minus the RSS right before
  the call. glibc's mmap threshold is pinned (as in bench_store.py) so big temporary buffers are fresh
  memory every time.

With ``--out FILE``, only the region between ``<!-- bench_dcp:begin -->`` and ``<!-- bench_dcp:end -->``
of FILE is replaced (appended when missing); the rest of the file (bench_store.py's report) is kept.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SW_SAVE = "dcp.save, StoreWriter (returns committed: shards fsynced, manifest, LATEST)"
FSW_SAVE = "dcp.save, FileSystemWriter as shipped (files fsynced, directory not)"
FSW_DUR = "dcp.save, FileSystemWriter + fsync of the directory and its parent (durable)"
DISK_WRITE = "(floor) disk: the same bytes, O_DIRECT from page-aligned memory + fsync (file, dir)"
SR_V = "dcp.load, StoreReader verify=True"
SR_NV = "dcp.load, StoreReader verify=False"
FSR = "dcp.load, FileSystemReader"
DISK_READ = "(floor) disk: raw read of the store's shard files, 8 MiB readinto"

# The measurement helpers bench_store.py shares (no import-time side effects).
from benchkit import (  # noqa: E402
    GB, FloorRep, RssSampler, Series, drop_caches, files_under, fsync_dcp_dir, gbps, machine_summary, pin_malloc, read_files,
    shard_files)
from benchkit import ratio as _ratio, rotate as _rotate, secs as _secs, write_region as _write_region  # noqa: E402

MALLOC_PINNED = pin_malloc()

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

sys.path.insert(0, REPO)
from ckptstore.dcp import StoreReader, StoreWriter  # noqa: E402
from benchfloors import AlignedImage, blake3_pass, odirect_write  # noqa: E402
from benchstate import build_state, fmt  # noqa: E402
from benchtargets import table as md_table  # noqa: E402


# --------------------------------------------------------------------------------------------------
# helpers of this benchmark only (the shared ones are in benchkit.py)


class PhaseTimer:
    """Wraps named methods of one storage writer/reader object and adds up the wall time spent in each."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.secs: dict[str, float] = {n: 0.0 for n in names}
        for n in names:
            setattr(obj, n, self._wrap(n, getattr(obj, n)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.secs[name] += time.perf_counter() - t0
        return timed


WRITER_PHASES = ("prepare_global_plan", "write_data", "finish")
READER_PHASES = ("read_metadata", "read_data")


# --------------------------------------------------------------------------------------------------
# the benchmark


def _zeros_like_state(state: Any) -> Any:
    """The same structure, every tensor a zeroed tensor of its own (prefaulted), the step changed so a load
    that skips it is caught."""
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return copy.deepcopy(v)
    out = z(state)
    out["step"] = -1
    return out


def _tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out.append((prefix + str(k), v))
        elif isinstance(v, dict):
            out.extend(_tensors(v, f"{prefix}{k}."))
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        os.makedirs(args.scratch, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.scratch)
        self.state, self.flat, self.nbytes = build_state(args.gib)
        self.ntensors = len(self.flat)
        self.image = AlignedImage(list(self.flat.values()))
        self.image.copy_in()
        self.target = _zeros_like_state(self.state)
        self.target_tensors = _tensors(self.target)
        self.state_tensors = dict(_tensors(self.state))
        self.floors: list[FloorRep] = []
        self.save: dict[str, Series] = {}
        self.load_cold: dict[str, Series] = {}
        self.load_warm: dict[str, Series] = {}
        self.notes: list[str] = []
        self.cold_ok = True
        self.checked: list[str] = []
        self.sizes: dict[str, list[int]] = {"store": [], "fsw": []}
        self._recording = False

    def _dir(self, rep: str, name: str) -> str:
        return os.path.join(self.root, rep, name)

    def _settle(self) -> None:
        os.sync()
        gc.collect()
        if self._recording:
            time.sleep(self.args.settle)

    def _record(self, t: dict[str, Series], name: str, secs: float, rss: float,
                phases: dict[str, float] | None = None) -> None:
        if not self._recording:
            return
        s = t.setdefault(name, Series())
        s.seconds.append(secs)
        s.rss_mb.append(rss)
        if phases is not None:
            s.phases.append(dict(phases))

    # ---------------------------------------------------------------------------------------- saves
    def save_store(self, rep: str, step: int) -> str:
        url = self._dir(rep, "store")
        w = StoreWriter(url, step=step)
        ph = PhaseTimer(w, WRITER_PHASES)
        self._settle()
        with RssSampler() as rss:
            t0 = time.perf_counter()
            dcp.save(self.state, storage_writer=w)
            dt = time.perf_counter() - t0
        assert w.info is not None and w.info.step == step, w.info
        self._record(self.save, SW_SAVE, dt, rss.extra_mb, ph.secs)
        return url

    def save_fsw(self, rep: str) -> str:
        d = self._dir(rep, "fsw")
        w = dcp.FileSystemWriter(d)
        ph = PhaseTimer(w, WRITER_PHASES)
        self._settle()
        with RssSampler() as rss:
            t0 = time.perf_counter()
            dcp.save(self.state, storage_writer=w)
            t1 = time.perf_counter()
            fsync_dcp_dir(d)
            t2 = time.perf_counter()
        self._record(self.save, FSW_SAVE, t1 - t0, rss.extra_mb, ph.secs)
        self._record(self.save, FSW_DUR, t2 - t0, rss.extra_mb, {**ph.secs, "fsync_dcp_dir": t2 - t1})
        return d

    def disk_floor(self, rep: str) -> None:
        d = self._dir(rep, "disk")
        os.makedirs(d, exist_ok=True)
        try:
            self._settle()
            with RssSampler() as rss:
                t = odirect_write(d, self.image.view)
            self._record(self.save, DISK_WRITE, t.wall_s, rss.extra_mb)
        except OSError as exc:  # no O_DIRECT here (tmpfs, some FUSE): the floor row is missing, say why
            if not any(n.startswith("disk floor skipped") for n in self.notes):
                self.notes.append(f"disk floor skipped: {exc}")
        finally:
            shutil.rmtree(d, ignore_errors=True)

    # ---------------------------------------------------------------------------------------- loads
    def _zero_target(self) -> None:
        for _k, t in self.target_tensors:
            t.zero_()
        self.target["step"] = -1
        self.target["optim"]["param_groups"][0]["lr"] = -1.0  # a load that skips the byte-IO items is caught

    def check_target(self, who: str) -> None:
        for k, t in self.target_tensors:
            assert torch.equal(t, self.state_tensors[k]), f"{who}: {k} differs after the load"
        assert self.target["step"] == self.state["step"], f"{who}: step {self.target['step']!r}"
        assert self.target["optim"]["param_groups"] == self.state["optim"]["param_groups"], f"{who}: param_groups"
        self.checked.append(who)

    def _timed_load(self, table: dict[str, Series], name: str, fn: Callable[[], Any], cold: bool,
                    paths: list[str], check: bool) -> None:
        self._zero_target()
        gc.collect()
        if cold:
            err = drop_caches()
            if err is not None and self.cold_ok:
                self.cold_ok = False
                self.notes.append(f"drop_caches failed ({err}): the 'cold' load figures are WARM")
        else:
            read_files(paths)
        with RssSampler() as rss:
            t0 = time.perf_counter()
            phases = fn()
            dt = time.perf_counter() - t0
        if check:
            self.check_target(name)
        self._record(table, name, dt, rss.extra_mb, phases)

    def load_methods(self, url: str, d: str) -> list[tuple[str, Callable[[], Any], list[str]]]:
        shards = shard_files(url)

        def reader(make: Callable[[], Any]) -> Callable[[], dict[str, float]]:
            def run() -> dict[str, float]:
                r = make()
                ph = PhaseTimer(r, READER_PHASES)
                dcp.load(self.target, storage_reader=r)
                return ph.secs
            return run

        def raw() -> None:
            read_files(shards)

        return [
            (DISK_READ, raw, shards),
            (SR_V, reader(lambda: StoreReader(url, verify=True)), shards),
            (SR_NV, reader(lambda: StoreReader(url, verify=False)), shards),
            (FSR, reader(lambda: dcp.FileSystemReader(d)), files_under(d)),
        ]

    def measure_floors(self) -> FloorRep:
        gc.collect()
        memcpy = self.image.copy_in()
        return FloorRep(memcpy, blake3_pass(self.image.view, threads=1), blake3_pass(self.image.view, threads=0))

    # ---------------------------------------------------------------------------------------- driver
    def run(self) -> None:
        args = self.args
        print(f"state: {self.ntensors} tensors, {self.nbytes:,} bytes; scratch {self.root}", flush=True)
        if args.warmup:
            print("warm-up round (untimed: DCP's first calls in a process are slow)...", flush=True)
            url, d = self.save_store("warmup", 1), self.save_fsw("warmup")
            for _name, fn, _p in self.load_methods(url, d)[1:]:
                self._zero_target()
                fn()
            shutil.rmtree(os.path.join(self.root, "warmup"))
        self._recording = True
        for rep in range(args.reps):
            tag = f"rep{rep}"
            print(f"[{tag}] floors (memcpy, blake3)...", flush=True)
            self.floors.append(self.measure_floors())
            print(f"[{tag}] saves (os.sync + {args.settle:g} s idle before each)...", flush=True)
            saves: list[tuple[str, Callable[[], Any]]] = [
                ("disk", lambda: self.disk_floor(tag)),
                ("store", lambda: self.save_store(tag, rep + 1)),
                ("fsw", lambda: self.save_fsw(tag)),
            ]
            outs = {k: fn() for k, fn in _rotate(saves, rep)}
            url, d = outs["store"], outs["fsw"]
            self.sizes["store"].append(sum(os.path.getsize(p) for p in files_under(url)))
            self.sizes["fsw"].append(sum(os.path.getsize(p) for p in files_under(d)))
            methods = _rotate(self.load_methods(url, d), rep)
            print(f"[{tag}] cold loads...", flush=True)
            for name, fn, paths in methods:
                self._timed_load(self.load_cold, name, fn, True, paths, check=(rep == 0 and name != DISK_READ))
            print(f"[{tag}] warm loads...", flush=True)
            for name, fn, paths in methods:
                self._timed_load(self.load_warm, name, fn, False, paths, check=False)
            if not (rep == args.reps - 1 and args.keep):
                shutil.rmtree(os.path.join(self.root, tag))
            for t in (self.save, self.load_cold, self.load_warm):
                for name, s in t.items():
                    print(f"    {name[:70]:70s} {fmt(s.seconds)} s", flush=True)

    def cleanup(self) -> None:
        self.image.close()
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# report


def _phases(s: Series, keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k} {fmt([p.get(k, 0.0) for p in s.phases], 3)} s" for k in keys)


def report_floors(b: Bench) -> list[str]:
    n = b.nbytes
    mc = [f.memcpy for f in b.floors]
    b1 = [f.blake3_1t for f in b.floors]
    ba = [f.blake3_auto for f in b.floors]
    dw, dr = _secs(b.save, DISK_WRITE), _secs(b.load_cold, DISK_READ)
    rows = [
        [f"plain memcpy: `copy_` of every tensor into prefaulted page-aligned memory (torch threads "
         f"{torch.get_num_threads()})", fmt([x.wall_s for x in mc], 3), fmt([x.gbps for x in mc]), "—"],
        ["bare blake3 pass over those bytes in memory, 1 thread", fmt([x.wall_s for x in b1], 3),
         fmt([x.gbps for x in b1]), fmt([x.cpu_s_per_gib for x in b1], 3)],
        ["bare blake3 pass over those bytes in memory, AUTO threads (StoreWriter's default; CPU: the whole "
         "process)", fmt([x.wall_s for x in ba], 3), fmt([x.gbps for x in ba]), fmt([x.cpu_s_per_gib for x in ba], 3)],
        ["disk write: those bytes with O_DIRECT, 8 MiB requests, then fsync (file, dir); the save table's floor row",
         fmt(dw, 3), fmt(gbps(n, dw)), "—"],
        ["disk read: the store's shard files, cold page cache, 8 MiB readinto; the cold load table's floor row",
         fmt(dr, 3), fmt(gbps(n, dr)), "—"],
    ]
    return (["### Floors (the state's own bytes, every repetition of this run)", ""]
            + md_table(["floor", "wall s", "GB/s", "CPU s/GiB"], rows))


def report_save(b: Bench) -> list[str]:
    n = b.nbytes
    disk, dur = _secs(b.save, DISK_WRITE), _secs(b.save, FSW_DUR)
    order = [SW_SAVE, FSW_SAVE, FSW_DUR, DISK_WRITE]
    rows = []
    for name in order:
        if name not in b.save:
            continue
        s = b.save[name]
        rows.append([name, fmt(s.seconds), fmt(gbps(n, s.seconds)), _ratio(s.seconds, disk),
                     "1 (reference)" if name == FSW_DUR else _ratio(s.seconds, dur), fmt(s.rss_mb, 0)])
    b3 = [f.blake3_auto.wall_s for f in b.floors]
    b3_1 = [f.blake3_1t.wall_s for f in b.floors]
    L = ["### Save (until durable)", ""]
    L += md_table(["method", "wall s", "GB/s", "time / disk floor", "time / FileSystemWriter + dir fsync",
                   "peak extra RSS MB"], rows)
    L.append("")
    sw, fsw = b.save.get(SW_SAVE), b.save.get(FSW_DUR)
    if sw and fsw:
        gap = [a - c for a, c in zip(sw.seconds, fsw.seconds)]
        L.append(f"StoreWriter hashes every byte with blake3 (AUTO threads); FileSystemWriter does not hash. A bare "
                 f"blake3 pass over the same bytes took {fmt(b3, 3)} s (AUTO) / {fmt(b3_1, 3)} s (1 thread) in this "
                 f"run, beside StoreWriter's time minus FileSystemWriter + dir fsync's (paired per repetition): "
                 f"{'; '.join(f'{x:+.3f}' for x in gap)} s (negative: StoreWriter was faster).")
        L.append("")
        L.append(f"Phases (wall s spent inside the writer's methods; the rest is DCP's planning): StoreWriter: "
                 f"{_phases(sw, WRITER_PHASES)}; FileSystemWriter: {_phases(fsw, WRITER_PHASES + ('fsync_dcp_dir',))}.")
    if b.sizes["store"]:
        L.append("")
        L.append(f"Bytes on disk: the store {b.sizes['store'][-1]:,} (all its files: shards, manifest, "
                 f"LATEST, ...), FileSystemWriter's directory {b.sizes['fsw'][-1]:,}; the state's tensors {n:,}.")
    if not disk:
        L.append("")
        L.append("**The disk floor is missing from this run (see the notes).**")
    return L


def report_loads(b: Bench) -> list[str]:
    n = b.nbytes
    L: list[str] = []
    for cold, t in ((True, b.load_cold), (False, b.load_warm)):
        title = ("### Load, cold page cache (sync + drop_caches before each)" if cold
                 else "### Load, warm page cache (the files read once right before)")
        if cold and not b.cold_ok:
            title += " - **drop_caches FAILED: these are WARM figures**"
        L += ["", title, ""]
        ref, floor = _secs(t, FSR), _secs(t, DISK_READ)
        rows = []
        for name in (SR_V, SR_NV, FSR, DISK_READ):
            if name not in t:
                continue
            s = t[name]
            rows.append([name, fmt(s.seconds), fmt(gbps(n, s.seconds)),
                         "1 (reference)" if name == FSR else _ratio(s.seconds, ref), _ratio(s.seconds, floor),
                         fmt(s.rss_mb, 0)])
        L += md_table(["method", "wall s", "GB/s", "time / FileSystemReader", "time / raw read floor",
                       "peak extra RSS MB"], rows)
        L.append("")
        parts = [f"{name.removeprefix('dcp.load, ')}: {_phases(t[name], READER_PHASES)}"
                 for name in (SR_V, SR_NV, FSR) if name in t and t[name].phases]
        L.append("Phases (wall s inside the reader's methods; read_data includes the copy into the target): "
                 + "; ".join(parts) + ".")
    return L


SAYS_PLACEHOLDER = "(fill in by hand from this run's numbers)"


def report(b: Bench, cmd: str, started: str, wall: float, load_before: tuple, load_after: tuple,
           says: str) -> str:
    n = b.nbytes
    L = [
        "## DCP backend: StoreWriter/StoreReader beside FileSystemWriter",
        "",
        "Generated by `benchmarks/bench_dcp.py` (the text under \"What this run says\" is written by hand).",
        "",
        f"* Command: `{cmd}`",
        f"* Started {started}; the whole run took {wall:.0f} s.",
        *[f"* {line}" for line in machine_summary(REPO)],
        f"* Load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}.",
        "",
        f"State: build_state({b.args.gib:g}): {b.ntensors} tensors, {n:,} bytes ({n / GB:.3f} GB), plus the "
        f"param_groups and the step (DCP byte-IO items); {b.args.reps} repetitions, figures are median (min-max); "
        "ratios are paired per repetition. GB = 1e9 bytes. One process, DCP without a process group; every "
        f"repetition runs every method in a rotated order, into fresh directories under bench-out/ (the "
        f"repository's file system); `os.sync()` and {b.args.settle:g} s of idle before each timed save; an "
        f"untimed warm-up save and load of each backend first: {b.args.warmup}. FileSystemWriter/Reader with "
        "their defaults (1 thread, sync_files=True). The two FileSystemWriter rows are one save timed twice: "
        "when dcp.save returns and after fsync of the directory and its parent (bench_ranks.py's "
        "`fsync_dcp_dir`). Loads go into one preallocated state of the same structure, zeroed before each; "
        f"checked equal to the saved state (torch.equal) after the first cold load of: "
        f"{'; '.join(c.removeprefix('dcp.load, ') for c in b.checked) or 'none'}. "
        f"glibc mmap threshold pinned: {MALLOC_PINNED}.",
        "",
    ]
    L += report_floors(b)
    L += [""] + report_save(b)
    L += report_loads(b)
    for note in b.notes:
        L += ["", f"Note: {note}"]
    L += ["", "### What this run says", "", says.strip() or SAYS_PLACEHOLDER]
    return "\n".join(L) + "\n"


def write_region(path: str, body: str) -> None:
    """Replaces the bench_dcp region of ``path`` (appends it when missing); the rest is untouched."""
    _write_region(path, body, "bench_dcp")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="approximate state size in GiB (default 1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="replace the bench_dcp region of this markdown file (e.g. docs/benchmarks.md)")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"),
                    help="scratch directory on the file system under test (default: bench-out/, gitignored)")
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds of idle after os.sync() before each timed save (default 15, as bench_store.py)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--keep", action="store_true", help="keep the scratch files of the last repetition")
    ap.add_argument("--says", help="file with the hand-written 'What this run says' text (default: a placeholder "
                                   "to fill in from this run's numbers)")
    args = ap.parse_args(argv)
    # DCP without a process group warns "torch.distributed is disabled, unavailable or uninitialized,
    # assuming the intent is to save/load in a single process" on every call: that is this benchmark's intent.
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*[Pp]rocess [Gg]roup.*")
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_dcp.py",
                    *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    b = Bench(args)
    try:
        b.run()
    finally:
        b.cleanup()
    says = ""
    if args.says:
        with open(args.says, encoding="utf-8") as f:
            says = f.read()
    body = report(b, cmd, started, time.perf_counter() - t0, load_before, os.getloadavg(), says)
    print()
    print(body)
    if args.out:
        write_region(args.out, body)
        print(f"wrote the bench_dcp region of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
