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

The measured commit is the handle's second (a job's steady state: the first one read LATEST's version).
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


class Backend:
    """Where the cuts go: the local disk under ``scratch``, or moto's S3 server on 127.0.0.1 (``--s3``)."""

    def __init__(self, name: str, scratch: str) -> None:
        self.name, self.scratch = name, scratch
        self.server: Any = None
        self.options: Any = None
        if name == "s3":
            import logging

            import boto3
            from moto.server import ThreadedMotoServer

            import ckptstore

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
            self.server.start()
            host, port = self.server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                         region_name="us-east-1").create_bucket(Bucket="ckpt")
            self.storage_options = {"key": "test", "secret": "test",
                                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
            self.options = ckptstore.StoreOptions(storage_options=self.storage_options)

    def url(self, name: str) -> str:
        return f"s3://ckpt/{name}" if self.name == "s3" else os.path.join(self.scratch, name)

    def remove(self, url: str) -> None:
        if self.name == "s3":
            import fsspec

            fs = fsspec.filesystem("s3", **self.storage_options)
            if fs.exists(url):
                fs.rm(url, recursive=True)
        else:
            shutil.rmtree(url, ignore_errors=True)

    def put_floor(self, nbytes: int, repeats: int = 7) -> float | None:
        """Median seconds of one PUT of ``nbytes`` (S3) with a fresh key each: the target's unit."""
        if self.name != "s3":
            return None
        import fsspec

        fs = fsspec.filesystem("s3", **self.storage_options)
        blob, times = os.urandom(nbytes), []
        for i in range(repeats):
            t0 = time.perf_counter()
            fs.pipe_file(f"ckpt/floor/put-{nbytes}-{i}", blob)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def build_cut(root: str, n: int, k: int, options: Any = None) -> dict[str, Any]:
    """A store at ``root`` with one marked cut of ``n`` ranks whose fragments are durable; returns the
    writer store, its pending cut, the intent and every rank's posted reference."""
    import ckptstore
    from ckptstore import cutting, hashing, layout
    from ckptstore.fragments import PartRef
    from ckptstore.intent import CutIntent
    from ckptstore.saving import prepare_state
    from ckptstore.store import core_of

    store = ckptstore.Store.open(root, create=True, options=options)
    core = core_of(store)
    # A job commits cut after cut: the measured commit is this handle's second (its first read LATEST).
    store.save(part_state(1), step=1)
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


def one_point(backend: Backend, n: int, k: int, fmt: int, memory: bool) -> dict[str, Any]:
    root = backend.url(f"commit-{n}-{k}-v{fmt}-{'mem' if memory else 'time'}")
    backend.remove(root)
    c = build_cut(root, n, k, backend.options)
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
        out["record_bytes"] = c["store"].storage.size(f"cuts/{c['cut']}/MANIFEST.json")
        out["fragment_bytes"] = c["fragment_bytes"]
        if not memory and fmt == 5:
            out["load"] = load_times(backend, root, n, k)
            out["put"] = backend.put_floor(out["record_bytes"])
    finally:
        c["store"].close()
    backend.remove(root)
    return out


def load_times(backend: Backend, root: str, n: int, k: int, repeats: int = 7) -> dict[str, float]:
    """Median seconds of ``load(rank=n-1)`` on the cut and of ``load()`` of a one-rank cut of that part."""
    import ckptstore

    one = backend.url(f"one-{n}-{k}")
    backend.remove(one)
    with ckptstore.Store.open(one, create=True, options=backend.options) as s:
        s.save(part_state(k), step=5)
    times: dict[str, list[float]] = {"ranks": [], "one": []}
    with ckptstore.Store.open(root, readonly=True, options=backend.options) as big, \
            ckptstore.Store.open(one, readonly=True, options=backend.options) as small:
        for i in range(repeats):
            for name, fn in (("ranks", lambda: big.load(rank=n - 1)), ("one", lambda: small.load())):
                t0 = time.perf_counter()
                fn()
                if i:  # the first of each warms the page cache and imports
                    times[name].append(time.perf_counter() - t0)
    backend.remove(one)
    return {name: statistics.median(v) for name, v in times.items()}


def report(points: list[dict[str, Any]], cmd: str, started: str, loads: tuple[str, str]) -> str:
    rows = ["| store | ranks | tensors a rank | format | commit latency, s | on S3: / one PUT of the record | rank 0 peak "
            "extra memory, MB | commit record, bytes (a rank) | fragment, bytes | load(rank=N-1) / one-rank load |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        if "skipped" in p:
            rows.append(f"| {p['store']} | {p['n']:,} | {p['k']:,} | {p['fmt']} | not run | — | — | — | — | {p['skipped']} |")
            continue
        put = f"{p['seconds'] / p['put']:.1f}x (PUT {p['put'] * 1e3:.1f} ms)" if p.get("put") else "—"
        load = p.get("load")
        ratio = f"{load['ranks'] / load['one']:.2f}x ({load['ranks'] * 1e3:.1f} / {load['one'] * 1e3:.1f} ms)" \
            if load else "—"
        rows.append(f"| {p['store']} | {p['n']:,} | {p['k']:,} | {p['fmt']} | {p['seconds']:.4f} | {put} | {p['peak'] / 1e6:.2f} | "
                    f"{p['record_bytes']:,} ({p['record_bytes'] / p['n']:.0f}) | {p['fragment_bytes']:,} | {ratio} |")
    return "\n".join([
        "## The commit against world size and tensors (issue 22): `benchmarks/bench_commit_scale.py`", "",
        f"Generated by `{cmd}` (do not edit by hand; rerun it), started {started}. One cut of N ranks on the "
        "local disk (and, with `--s3`, moto's S3 server on 127.0.0.1); every rank's fragment durable first, then rank 0 commits through the real code "
        "(format 5: `PendingCut.finish(parts=...)`, no fragment read; format 3: every record read, merged "
        "into one manifest, as before issue 22). Latency: parts durable -> LATEST moved, mark removed. "
        "Memory: tracemalloc's peak over the commit, in a run of its own.", "",
        *rows, "",
        "Targets (issue 22): at 4,096 ranks x 2,000 tensors a commit of at most 1 s on the local store, rank 0's "
        "peak extra memory at most 100 MB, on the S3 server at most 5x one PUT of the commit record, at most 256 bytes a rank in the commit record, `load(rank=r)` within "
        "1.2x of a one-rank cut's load.", "",
        f"* Load (`uptime`) before: {loads[0]}; after: {loads[1]}.",
    ]) + "\n"


def run_point(backend: Backend, n: int, k: int, formats: tuple[int, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    if n == 1:  # a cut of one rank is format 4, committed as before: nothing to compare
        return [{"store": backend.name, "n": n, "k": k, "fmt": 4, "skipped": "one rank: format 4, unchanged"}]
    for fmt in formats:
        point: dict[str, Any] = {"store": backend.name, "n": n, "k": k, "fmt": fmt}
        if fmt == 3 and n * k > args.v3_max_arrays:
            point["skipped"] = (f"{n * k:,} arrays in one manifest held by rank 0 (~{n * k * 300 / 1e9:.1f} GB "
                                "of JSON): past --v3-max-arrays")
            out.append(point)
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {backend.name} N={n} K={k} format {fmt} ...", flush=True)
        point.update(one_point(backend, n, k, fmt, memory=False))
        point["peak"] = one_point(backend, n, k, fmt, memory=True)["peak"]
        print(f"    {point}", flush=True)
        out.append(point)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,8,64,512,4096")
    ap.add_argument("--tensors", default="100,2000")
    ap.add_argument("--v3-max-arrays", type=int, default=1_100_000,
                    help="skip format 3 where its manifest would list more arrays (default 1.1M)")
    ap.add_argument("--out", help="replace the bench_commit_scale region of this markdown file")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"))
    ap.add_argument("--s3", action="store_true", help="also on moto's S3 server (format 5 only)")
    ap.add_argument("--s3-ranks", default="8,64,512", help="world sizes on the S3 server (default 8,64,512)")
    args = ap.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    cmd, started, before = command_line("bench_commit_scale.py", argv), started_at(), uptime()
    points: list[dict[str, Any]] = []
    backends = [("local", args.ranks, (5, 3))] + ([("s3", args.s3_ranks, (5,))] if args.s3 else [])
    for name, ranks, formats in backends:
        backend = Backend(name, args.scratch)
        try:
            for k in (int(x) for x in args.tensors.split(",") if x):
                for n in (int(x) for x in ranks.split(",") if x):
                    points.extend(run_point(backend, n, k, formats, args))
        finally:
            backend.close()
    body = report(points, cmd, started, (before, uptime()))
    print(body)
    if args.out:
        write_region(args.out, body, "bench_commit_scale")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
