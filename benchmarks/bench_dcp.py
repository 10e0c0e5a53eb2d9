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

This file runs the methods (``Bench``); the report, its row names and the phases it shows are
dcpreport.py, and the helpers every benchmark shares benchkit.py.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

from dcpreport import (
    DISK_READ, DISK_WRITE, FSR, FSW_DUR, FSW_SAVE, READER_PHASES, SR_NV, SR_V, SW_SAVE, WRITER_PHASES, report)

# The measurement helpers the benchmarks share (no import-time side effects).
from benchkit import (  # noqa: E402
    REPO, FloorRep, RssSampler, Series, command_line, files_under, fsync_dcp_dir, measure_floors, pin_malloc,
    prime_cache, publish, read_files, shard_files, started_at, timed_call, write_region)
from benchkit import rotate as _rotate  # noqa: E402

MALLOC_PINNED = pin_malloc()

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

sys.path.insert(0, REPO)
from ckptstore.integrations.dcp import StoreReader, StoreWriter  # noqa: E402
from benchfloors import AlignedImage, odirect_write  # noqa: E402
from benchstate import build_state, fmt  # noqa: E402


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
        _out, dt, rss_mb = timed_call(lambda: dcp.save(self.state, storage_writer=w))
        assert w.info is not None and w.info.step == step, w.info
        self._record(self.save, SW_SAVE, dt, rss_mb, ph.secs)
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
        self.cold_ok = prime_cache(cold, paths, self.notes, self.cold_ok)
        phases, dt, rss_mb = timed_call(fn)
        if check:
            self.check_target(name)
        self._record(table, name, dt, rss_mb, phases)

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
        return measure_floors(self.image)

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
    cmd = command_line("bench_dcp.py", argv)
    started = started_at()
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
    body = report(b, MALLOC_PINNED, cmd, started, time.perf_counter() - t0, load_before, os.getloadavg(), says)
    # Only this benchmark's region of the file is replaced: bench_store.py's report around it stays.
    publish(body, args.out, lambda path, text: write_region(path, text, "bench_dcp"),
            "wrote the bench_dcp region of {}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
