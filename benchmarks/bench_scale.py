"""Thousands of simulated ranks (issue 22), part 1: the latency of one agreement exchange against world size.

N simulated ranks run the real ``ckptstore.ranks.RankGroup`` code (``RankGroup.of_ranks``): threads spread
over a few processes, each rank with its own client of one real ``TCPStore`` that this process serves.
Every client connects first (on this VM class a connect takes 5 s about once in 25), then all ranks make
``--exchanges`` exchanges of a small message. An exchange's latency is the time from the last rank to
enter it to the last rank to leave it (what a job pays at a collective call), on one clock
(``CLOCK_MONOTONIC`` is the machine's). Also reported: the keys each rank reads per exchange (rank 0
reads every rank's message, every other rank the answer alone). The commit of a cut against world size
(format 5) is ``bench_commit_scale.py``'s.

    .venv/bin/python benchmarks/bench_scale.py --ranks 1,8,64,512 --out docs/benchmarks-scale.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import command_line, started_at, uptime, write_region  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Counting:
    """A real TCPStore client that counts the keys its reads name (get, multi_get)."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.read = 0

    def get(self, key: str) -> bytes:
        self.read += 1
        return self.kv.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.read += len(keys)
        return self.kv.multi_get(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)


def child(args: argparse.Namespace) -> int:
    """Ranks ``args.first`` .. ``args.first + args.count - 1`` of ``args.n`` as threads of this process."""
    from torch.distributed import TCPStore

    from ckptstore.ranks import RankGroup

    timeout = datetime.timedelta(seconds=args.timeout)
    results: dict[int, Any] = {}

    def one(r: int) -> None:
        kv = Counting(TCPStore("127.0.0.1", args.port, None, False, timeout=timeout))
        kv.add("connected", 1)
        deadline = time.monotonic() + args.timeout
        while int(kv.add("connected", 0)) < args.n:  # every client connects before any rank starts
            if time.monotonic() > deadline:
                results[r] = {"error": f"the {args.n} clients did not all connect within {args.timeout:g} s"}
                return
            time.sleep(0.05)
        try:
            g = RankGroup.of_ranks(r, args.n, kv, namespace=args.namespace, rank_timeout=args.rank_timeout)
        except Exception as exc:  # noqa: BLE001 - reported
            results[r] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            return
        enter, leave, reads = [], [], []
        try:
            for i in range(args.exchanges):
                before = kv.read
                enter.append(time.monotonic())
                got = g.exchange("cut", {"ok": True, "step": i})
                leave.append(time.monotonic())
                reads.append(kv.read - before)
                assert len(got) == args.n and got[-1] == {"ok": True, "step": i}
            results[r] = {"enter": enter, "leave": leave, "reads": reads}
        except Exception as exc:  # noqa: BLE001 - reported
            results[r] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            g.close()

    threads = [threading.Thread(target=one, args=(r,), daemon=True)
               for r in range(args.first, args.first + args.count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.timeout)
    with open(args.json, "w") as f:
        json.dump({str(r): v for r, v in results.items()}, f)
    return 0


def run_point(n: int, procs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One world size: the ranks split over ``procs`` children, one TCPStore served here."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=args.timeout),
                      wait_for_workers=False)
    procs = max(1, min(procs, n))
    per = -(-n // procs)
    children, paths = [], []
    t0 = time.monotonic()
    for p in range(procs):
        first = p * per
        count = min(per, n - first)
        if count <= 0:
            break
        path = os.path.join(args.scratch, f"scale-{n}-{p}.json")
        paths.append(path)
        children.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "--n", str(n), "--first", str(first),
             "--count", str(count), "--port", str(server.port), "--json", path, "--namespace", f"scale-{n}",
             "--exchanges", str(args.exchanges), "--rank-timeout", str(args.rank_timeout),
             "--timeout", str(args.timeout)], cwd=REPO))
    for c in children:
        try:
            c.wait(args.timeout + 60)
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    ranks: dict[int, Any] = {}
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                ranks.update({int(r): v for r, v in json.load(f).items()})
            os.unlink(path)
    wall = time.monotonic() - t0
    errors = sorted({v["error"] for v in ranks.values() if "error" in v})
    missing = n - len(ranks)
    point: dict[str, Any] = {"n": n, "procs": len(children), "wall": wall, "errors": errors, "missing": missing}
    if errors or missing:
        return point
    lat = []
    for i in range(1, args.exchanges):  # the first exchange after the open is warm-up
        lat.append(max(v["leave"][i] for v in ranks.values()) - max(v["enter"][i] for v in ranks.values()))
    point["latency"] = lat
    # Medians over a rank's exchanges (a look at slow ranks reads a few keys more now and then).
    point["reads_rank0"] = statistics.median(ranks[0]["reads"])
    point["reads_other"] = max((statistics.median(v["reads"]) for r, v in ranks.items() if r), default=0)
    return point


def report(points: list[dict[str, Any]], cmd: str, started: str, loads: tuple[str, str]) -> str:
    rows = ["| simulated ranks | processes | exchange latency, s: median (min-max) | keys read per exchange (median): rank 0 / "
            "the most of any other rank | set-up + run wall s | note |", "|---|---|---|---|---|---|"]
    for p in points:
        if "latency" in p:
            lat = p["latency"]
            cell = f"{statistics.median(lat):.4f} ({min(lat):.4f}-{max(lat):.4f})"
            rows.append(f"| {p['n']:,} | {p['procs']} | {cell} | {p['reads_rank0']:g} / {p['reads_other']:g} | "
                        f"{p['wall']:.0f} | |")
        else:
            why = "; ".join(p["errors"])[:200] or f"{p['missing']} ranks reported nothing"
            rows.append(f"| {p['n']:,} | {p['procs']} | not measured | — | {p['wall']:.0f} | {why} |")
    return "\n".join([
        "## Agreement exchanges against world size (issue 22): `benchmarks/bench_scale.py`", "",
        f"Generated by `{cmd}` (do not edit by hand; rerun it), started {started}. Every simulated rank runs "
        "the real `RankGroup` code (`RankGroup.of_ranks`) as a thread, with its own client of one real "
        "`TCPStore` served by the parent; latency = last rank out - last rank in, per exchange after the "
        "first; the ranks' threads share this machine's cores, so large N measures the simulation too.", "",
        *rows, "",
        "Target (issue 22): at most 0.5 s at 4,096 ranks, growing at most linearly. The commit's curve is "
        "`bench_commit_scale.py`'s, below.", "",
        f"* Load (`uptime`) before: {loads[0]}; after: {loads[1]}.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,8,64,512", help="comma list of world sizes (default 1,8,64,512)")
    ap.add_argument("--procs", type=int, default=4, help="processes the ranks are spread over (default 4)")
    ap.add_argument("--exchanges", type=int, default=6, help="exchanges per world size, the first untimed")
    ap.add_argument("--rank-timeout", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a world size may take")
    ap.add_argument("--out", help="replace the bench_scale region of this markdown file")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("n", "first", "count", "port"):
        ap.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--namespace", default="scale", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    os.makedirs(args.scratch, exist_ok=True)
    cmd, started, before = command_line("bench_scale.py", argv), started_at(), uptime()
    points = []
    for n in (int(x) for x in args.ranks.split(",") if x):
        print(f"[{time.strftime('%H:%M:%S')}] {n} simulated ranks ...", flush=True)
        points.append(run_point(n, args.procs, args))
        print(f"    {points[-1].get('latency') or points[-1].get('errors')}", flush=True)
    body = report(points, cmd, started, (before, uptime()))
    print(body)
    if args.out:
        write_region(args.out, body, "bench_scale")
        print(f"wrote {args.out}")
    return 0 if all("latency" in p for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
