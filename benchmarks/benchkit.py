"""Measurement helpers shared by bench_store.py and bench_dcp.py (neither imports the other: each pins
glibc's mmap threshold when imported). No import-time side effects; torch and ckptstore are imported
lazily (``machine_summary``), so a benchmark can call :func:`pin_malloc` before torch allocates."""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import threading
from dataclasses import dataclass, field

import psutil

from benchfloors import Timed
from benchstate import fmt, fsync_path, machine_lines

GB = 1e9


def pin_malloc() -> bool:
    """mallopt(M_MMAP_THRESHOLD, 128 KiB): disables glibc's dynamic threshold, so freed big blocks go
    back to the kernel and the next allocation is fresh memory (like a new process)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        return bool(libc.mallopt(m_mmap_threshold, 128 * 1024))
    except OSError:
        return False


class RssSampler:
    """Peak RSS of this process while a block runs, sampled every ``interval`` s by a thread."""

    def __init__(self, interval: float = 0.01) -> None:
        self.proc = psutil.Process()
        self.interval = interval
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def __enter__(self) -> "RssSampler":
        self.base = self.peak = self.proc.memory_info().rss
        self._stop.clear()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._t is not None
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 1e6


@dataclass
class Series:
    """One method's timings, one entry per repetition (``phases``: seconds inside named methods)."""

    seconds: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class FloorRep:
    """The in-memory floors of one repetition, on the state's own bytes (benchfloors.py)."""

    memcpy: Timed
    blake3_1t: Timed
    blake3_auto: Timed


def fsync_dcp_dir(d: str) -> None:
    """DCP fsyncs its files; the directory entries (the files', the directory's own) need these."""
    fsync_path(d)
    fsync_path(os.path.dirname(d))


def drop_caches() -> str | None:
    """sync + drop the page cache; returns an error string when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def read_files(paths: list[str]) -> None:
    """Reads every file once through a reused 8 MiB buffer (warms the page cache; the raw-read floor)."""
    buf = bytearray(8 << 20)
    mv = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(mv):
                pass


def files_under(root: str) -> list[str]:
    return sorted(os.path.join(dp, f) for dp, _d, fs in os.walk(root) for f in fs)


def shard_files(store_dir: str) -> list[str]:
    return [p for p in files_under(os.path.join(store_dir, "cuts")) if p.endswith(".safetensors")]


def rotate(items: list, k: int) -> list:
    """The list rotated by k places: each repetition starts with a different method."""
    k %= len(items)
    return items[k:] + items[:k]


def paired(a: list[float], b: list[float]) -> list[float]:
    """Per-repetition ratio a/b."""
    return [x / y for x, y in zip(a, b)]


def gbps(nbytes: int, secs: list[float]) -> list[float]:
    return [nbytes / GB / s for s in secs]


def ordered(t: dict[str, Series]) -> list[tuple[str, Series]]:
    """Checkpoint methods first, the floor rows last."""
    return sorted(t.items(), key=lambda kv: kv[0].startswith("(floor)"))


def secs(t: dict[str, Series], name: str) -> list[float]:
    return t[name].seconds if name in t else []


def ratio(a: list[float], b: list[float], digits: int = 2, unit: str = "x") -> str:
    return fmt(paired(a, b), digits) + unit if a and b else "n/a"


def machine_summary(repo: str) -> list[str]:
    """The machine lines plus the versions of everything measured."""
    import blake3
    import safetensors
    import torch

    import ckptstore

    return [
        *machine_lines(repo),
        f"Python {platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, "
        f"blake3 {getattr(blake3, '__version__', '?')}, psutil {psutil.__version__}, ckptstore {ckptstore.__version__}",
        f"Host: {socket.gethostname()}",
    ]


def write_region(path: str, body: str, name: str) -> None:
    """Replaces the region between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` of the markdown
    file ``path`` with ``body`` (appends the region when missing); the rest is untouched."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if begin in text and end in text.split(begin, 1)[1]:
        pre, rest = text.split(begin, 1)
        post = rest.split(end, 1)[1]
        text = pre + block.rstrip("\n") + post
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)

