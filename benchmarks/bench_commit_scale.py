"""Thousands of simulated ranks (issue 22), part 2: the commit of a cut against world size and tensors.

For each world size N and tensors per rank K, one cut of N ranks on a real local store, through the real
commit code: every rank's fragment is written durably first (rank N-1's is the real record of a real
part: K float32 tensors of 8 bytes, its shard written by ``RankPart.write``; the other ranks' are that
record with their rank and file names, byte-accurate in size; their shards are not written, the commit
never reads them), then rank 0 commits:

* format 5 (today): ``PendingCut.finish(parts=...)`` with every rank's (size, blake3) as the ranks post
  them: no fragment read; the record is O(N) bytes;
* format 3 (before issue 22, for comparison): rank 0 reads and parses every rank's record and writes one
  merged manifest of every rank's files, arrays and trees, as ``PendingCut`` did until then. Skipped
  where its manifest would pass ``--v3-max-arrays`` arrays (it is held in rank 0's memory whole).

Commit latency is from the parts being durable (rank 0 has every post) to LATEST moved and the mark gone;
rank 0's peak extra memory is ``tracemalloc``'s peak over that commit (Python allocations; run apart
from the timing). Then ``load(rank=N-1)`` on the cut against loading a one-rank cut of the same part.

    .venv/bin/python benchmarks/bench_commit_scale.py --ranks 1,8,64,512,4096 --tensors 100,2000 \\
        --out docs/benchmarks-scale.md
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
import tracemalloc
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import command_line, started_at, uptime, write_region  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def part_state(k: int) -> dict[str, Any]:
    import torch

    return {"w": [torch.full((2,), float(i)) for i in range(k)]}


def build_cut(root: str, n: int, k: int) -> dict[str, Any]:
    """A store at ``root`` with one marked cut of ``n`` ranks whose fragments are durable; returns the
    writer store, its pending cut, the intent and every rank's posted reference."""
    import ckptstore
    from ckptstore import cutting, hashing, layout
    from ckptstore.fragments import PartRef
    from ckptstore.intent import CutIntent
    from ckptstore.saving import prepare_state
    from ckptstore.store import core_of

    store = ckptstore.Store.open(root, create=True)
    core = core_of(store)
    step = 5
    pending = cutting.begin_cut(core, step, writer="bench", cut=None, world_size=n)
    tree, items, pickled, attached = prepare_state(part_state(k), None, False, core.url)
    last = n - 1
    part = cutting.rank_part(core, pending.id, step, last, n)
    files, tensors = part.write(items)
    record = part.publish(files, tensors, CutIntent(tree=tree, pickled=pickled, attached=attached, world_size=n))
    data = record.to_bytes()
    refs: list[Any] = [None] * n
    refs[last] = part.ref
    src_name, src_rank = f"rank{last:05d}-".encode(), f'"rank":{last},'.encode()
    for r in range(n - 1):
        body = data.replace(src_name, f"rank{r:05d}-".encode()).replace(src_rank, f'"rank":{r},'.encode())
        core.storage.write_durably(layout.rank_record_path(pending.id, r), body)
        refs[r] = PartRef(layout.rank_record_name(r), len(body), hashing.digest(body), part.ref.data_nbytes,
                          part.ref.files, part.ref.arrays, part.ref.attached, part.ref.pickled)
    return {"store": store, "pending": pending, "intent": CutIntent(mode="sync", world_size=n),
            "refs": [r.to_json() for r in refs], "fragment_bytes": len(data), "cut": pending.id}


def commit_v5(c: dict[str, Any]) -> None:
    c["pending"].finish(c["intent"], parts=c["refs"])


def commit_v3(c: dict[str, Any]) -> None:
    """What rank 0 did before format 5: read every record, merge, validate, write one manifest."""
    from ckptstore import assemble

    pending = c["pending"]
    pending.collect_ranks()
    pending.files_durable()
    record = pending._manifest(c["intent"])  # the format 5 record, for the cut's fields
    merged = assemble.merged(record, [_record_of(pending, r) for r in range(pending.world_size)])
    digest = pending._protocol.write_manifest(merged)
    pending._protocol.point_latest(pending.id, pending.step, digest)
    pending._protocol.unmark(pending.id)


class _Part:
    def __init__(self, files: Any, tensors: Any, tree: Any, attached: Any) -> None:
        self.files, self.tensors, self.tree, self.attached = files, tensors, tree, attached


def _record_of(pending: Any, rank: int) -> _Part:
    files, tensors = pending._files[rank]
    return _Part(files, tensors, pending._trees[rank][0], pending._attached.get(rank, []))


def one_point(scratch: str, n: int, k: int, fmt: int, memory: bool) -> dict[str, Any]:
    root = os.path.join(scratch, f"commit-{n}-{k}-v{fmt}-{'mem' if memory else 'time'}")
    shutil.rmtree(root, ignore_errors=True)
    c = build_cut(root, n, k)
    gc.collect()
    try:
        if memory:
            tracemalloc.start()
            (commit_v5 if fmt == 5 else commit_v3)(c)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            out: dict[str, Any] = {"peak": peak}
        else:
            t0 = time.perf_counter()
            (commit_v5 if fmt == 5 else commit_v3)(c)
            out = {"seconds": time.perf_counter() - t0}
        out["record_bytes"] = os.path.getsize(os.path.join(root, "cuts", c["cut"], "MANIFEST.json"))
        out["fragment_bytes"] = c["fragment_bytes"]
        if not memory and fmt == 5:
            out["load"] = load_times(c, root, n, k, scratch)
    finally:
        c["store"].close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def load_times(c: dict[str, Any], root: str, n: int, k: int, scratch: str, repeats: int = 7) -> dict[str, float]:
    """Median seconds of ``load(rank=n-1)`` on the cut and of ``load()`` of a one-rank cut of that part."""
    import ckptstore

    one = os.path.join(scratch, f"one-{n}-{k}")
    shutil.rmtree(one, ignore_errors=True)
    with ckptstore.Store.open(one, create=True) as s:
        s.save(part_state(k), step=5)
    times: dict[str, list[float]] = {"ranks": [], "one": []}
    with ckptstore.Store.open(root, readonly=True) as big, ckptstore.Store.open(one, readonly=True) as small:
        for i in range(repeats):
            for name, fn in (("ranks", lambda: big.load(rank=n - 1)), ("one", lambda: small.load())):
                t0 = time.perf_counter()
                fn()
                if i:  # the first of each warms the page cache and imports
                    times[name].append(time.perf_counter() - t0)
    shutil.rmtree(one, ignore_errors=True)
    return {name: statistics.median(v) for name, v in times.items()}


def report(points: list[dict[str, Any]], cmd: str, started: str, loads: tuple[str, str]) -> str:
    rows = ["| ranks | tensors a rank | format | commit latency, s | rank 0 peak extra memory, MB | commit record, bytes "
            "(a rank) | fragment, bytes | load(rank=N-1) / one-rank load |",
            "|---|---|---|---|---|---|---|---|"]
    for p in points:
        if "skipped" in p:
            rows.append(f"| {p['n']:,} | {p['k']:,} | {p['fmt']} | not run | — | — | — | {p['skipped']} |")
            continue
        load = p.get("load")
        ratio = f"{load['ranks'] / load['one']:.2f}x ({load['ranks'] * 1e3:.1f} / {load['one'] * 1e3:.1f} ms)" \
            if load else "—"
        rows.append(f"| {p['n']:,} | {p['k']:,} | {p['fmt']} | {p['seconds']:.4f} | {p['peak'] / 1e6:.2f} | "
                    f"{p['record_bytes']:,} ({p['record_bytes'] / p['n']:.0f}) | {p['fragment_bytes']:,} | {ratio} |")
    return "\n".join([
        "## The commit against world size and tensors (issue 22): `benchmarks/bench_commit_scale.py`", "",
        f"Generated by `{cmd}` (do not edit by hand; rerun it), started {started}. One cut of N ranks on the "
        "local disk; every rank's fragment durable first, then rank 0 commits through the real code "
        "(format 5: `PendingCut.finish(parts=...)`, no fragment read; format 3: every record read, merged "
        "into one manifest, as before issue 22). Latency: parts durable -> LATEST moved, mark removed. "
        "Memory: tracemalloc's peak over the commit, in a run of its own.", "",
        *rows, "",
        "Targets (issue 22): at 4,096 ranks x 2,000 tensors a commit of at most 1 s on the local store, rank 0's "
        "peak extra memory at most 100 MB, at most 256 bytes a rank in the commit record, `load(rank=r)` within "
        "1.2x of a one-rank cut's load.", "",
        f"* Load (`uptime`) before: {loads[0]}; after: {loads[1]}.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,8,64,512,4096")
    ap.add_argument("--tensors", default="100,2000")
    ap.add_argument("--v3-max-arrays", type=int, default=1_100_000,
                    help="skip format 3 where its manifest would list more arrays (default 1.1M)")
    ap.add_argument("--out", help="replace the bench_commit_scale region of this markdown file")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"))
    args = ap.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    cmd, started, before = command_line("bench_commit_scale.py", argv), started_at(), uptime()
    points = []
    for k in (int(x) for x in args.tensors.split(",") if x):
        for n in (int(x) for x in args.ranks.split(",") if x):
            for fmt in (5, 3):
                if n == 1:  # a cut of one rank is format 4, committed as before: nothing to compare
                    if fmt == 3:
                        continue
                    point: dict[str, Any] = {"n": n, "k": k, "fmt": 4, "skipped": "one rank: format 4, unchanged"}
                    points.append(point)
                    continue
                point = {"n": n, "k": k, "fmt": fmt}
                if fmt == 3 and n * k > args.v3_max_arrays:
                    point["skipped"] = (f"{n * k:,} arrays in one manifest held by rank 0 (~{n * k * 300 / 1e9:.1f} GB "
                                        "of JSON): past --v3-max-arrays")
                    points.append(point)
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] N={n} K={k} format {fmt} ...", flush=True)
                point.update(one_point(args.scratch, n, k, fmt, memory=False))
                point["peak"] = one_point(args.scratch, n, k, fmt, memory=True)["peak"]
                print(f"    {point}", flush=True)
                points.append(point)
    body = report(points, cmd, started, (before, uptime()))
    print(body)
    if args.out:
        write_region(args.out, body, "bench_commit_scale")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
