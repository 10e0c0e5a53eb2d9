"""What bench_writer measures a process by, from /proc (no torch, no side effects): PSS of a process tree
(sampled by a thread of the parent), CPU seconds of a process or a tree, and the cores other processes
use over a window. Split out of bench_writer.py (issue 20); the parent and the children both use it."""

from __future__ import annotations

import os
import threading
import time

from benchkit import cpu_busy
from benchstate import med


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


def writer_cpu(pid: int | None) -> tuple[float, float] | None:
    """(user, system) CPU seconds of a process, all its threads, from /proc/<pid>/stat; None if gone."""
    if pid is None:
        return None
    rest = stat_fields(pid)
    if rest is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(rest[11]) / tick, int(rest[12]) / tick


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
