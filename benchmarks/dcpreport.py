"""bench_dcp's report: the floors, save and load tables of ckptstore's DCP backend beside DCP's own
FileSystemWriter / FileSystemReader, and the conditions of the run (split out of bench_dcp.py, issue 20).
The row names and the phases it reports live here, since the benchmark files its timings under them.
torch is imported lazily (its thread count)."""

from __future__ import annotations

from typing import Any

from benchkit import GB, REPO, Series, gbps, load_cell, machine_summary, memory_floor_rows, timings_cell
from benchkit import ratio as _ratio, secs as _secs
from benchstate import fmt
from benchtargets import DASH, table as md_table

SW_SAVE = "dcp.save, StoreWriter (returns committed: shards fsynced, manifest, LATEST)"
FSW_SAVE = "dcp.save, FileSystemWriter as shipped (files fsynced, directory not)"
FSW_DUR = "dcp.save, FileSystemWriter + fsync of the directory and its parent (durable)"
DISK_WRITE = "(floor) disk: the same bytes, O_DIRECT from page-aligned memory + fsync (file, dir)"
SR_V = "dcp.load, StoreReader verify=True"
SR_NV = "dcp.load, StoreReader verify=False"
FSR = "dcp.load, FileSystemReader"
DISK_READ = "(floor) disk: raw read of the store's shard files, 8 MiB readinto"
WRITER_PHASES = ("prepare_global_plan", "write_data", "finish")
READER_PHASES = ("read_metadata", "read_data")


def _phases(s: Series, keys: tuple[str, ...]) -> str:
    return timings_cell(s.phases, 3, keys, unit=" s")


def report_floors(b: Any) -> list[str]:
    import torch

    n = b.nbytes
    dw, dr = _secs(b.save, DISK_WRITE), _secs(b.load_cold, DISK_READ)
    rows = memory_floor_rows(b.floors, torch.get_num_threads(), "StoreWriter's default; ") + [
        ["disk write: those bytes with O_DIRECT, 8 MiB requests, then fsync (file, dir); the save table's floor row",
         fmt(dw, 3), fmt(gbps(n, dw)), DASH],
        ["disk read: the store's shard files, cold page cache, 8 MiB readinto; the cold load table's floor row",
         fmt(dr, 3), fmt(gbps(n, dr)), DASH],
    ]
    return (["### Floors (the state's own bytes, every repetition of this run)", ""]
            + md_table(["floor", "wall s", "GB/s", "CPU s/GiB"], rows))


def report_save(b: Any) -> list[str]:
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


def report_loads(b: Any) -> list[str]:
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


def report(b: Any, malloc_pinned: bool, cmd: str, started: str, wall: float, load_before: tuple,
           load_after: tuple, says: str) -> str:
    """The report of bench_dcp's ``Bench`` ``b`` after its run (the region bench_dcp keeps in its file)."""
    n = b.nbytes
    L = [
        "## DCP backend: StoreWriter/StoreReader beside FileSystemWriter",
        "",
        "Generated by `benchmarks/bench_dcp.py` (the text under \"What this run says\" is written by hand).",
        "",
        f"* Command: `{cmd}`",
        f"* Started {started}; the whole run took {wall:.0f} s.",
        *[f"* {line}" for line in machine_summary(REPO)],
        f"* Load average (1/5/15 min) before: {load_cell(load_before)}; after: {load_cell(load_after)}.",
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
        f"glibc mmap threshold pinned: {malloc_pinned}.",
        "",
    ]
    L += report_floors(b)
    L += [""] + report_save(b)
    L += report_loads(b)
    for note in b.notes:
        L += ["", f"Note: {note}"]
    L += ["", "### What this run says", "", says.strip() or SAYS_PLACEHOLDER]
    return "\n".join(L) + "\n"
