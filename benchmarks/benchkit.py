"""Measurement helpers the benchmarks share, each in one place (issue 20: ``_free_port``, ``cpu_busy``,
``ratio_list``, ``_gbps``, ``write_doc``, ``uptime`` and ``settle`` were copied from file to file). No
import-time side effects, and nothing heavy at import: torch, ckptstore and psutil are imported lazily,
so bench_store.py and bench_dcp.py can call :func:`pin_malloc` before torch allocates, and bench_writer's
parent process imports this module without torch."""

from __future__ import annotations

import ctypes
import datetime as _dt
import gc
import hashlib
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

from benchfloors import AlignedImage, Timed, blake3_pass
from benchstate import fmt, fsync_path, machine_lines
from benchtargets import DASH

T = TypeVar("T")
GB = 1e9
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        import psutil

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


def timed_call(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``fn()`` timed, with this process's peak extra RSS while it ran: (its result, seconds, MB)."""
    with RssSampler() as rss:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return out, dt, rss.extra_mb


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


def settle(seconds: float) -> None:
    """os.sync(), then idle: the virtio disk's flush pays for whatever the host still has to persist (the
    previous write, the discards of deleted files), so every timed write starts from the same state."""
    os.sync()
    time.sleep(seconds)


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


def prime_cache(cold: bool, paths: list[str], notes: list[str], cold_ok: bool) -> bool:
    """Before a timed load: cold, sync + drop the page cache; warm, read ``paths`` once. Returns whether the
    cold figures are still cold: the first failure to drop the cache is noted and makes it False."""
    if not cold:
        read_files(paths)
        return cold_ok
    err = drop_caches()
    if err is not None and cold_ok:
        notes.append(f"drop_caches failed ({err}): the 'cold' load figures are WARM")
        return False
    return cold_ok


def sha256_file(path: str) -> str:
    """The file's sha256, read through a reused 8 MiB buffer (the torch.save baselines' re-read)."""
    h = hashlib.sha256()
    mv = memoryview(bytearray(8 << 20))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(mv):
            h.update(mv[:n])
    return h.hexdigest()


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


def measure_floors(image: AlignedImage) -> FloorRep:
    """The in-memory floors of one repetition: memcpy into the image, then blake3 over it (1 thread, AUTO)."""
    gc.collect()
    memcpy = image.copy_in()
    return FloorRep(memcpy, blake3_pass(image.view, threads=1), blake3_pass(image.view, threads=0))


def ordered(t: dict[str, Series]) -> list[tuple[str, Series]]:
    """Checkpoint methods first, the floor rows last."""
    return sorted(t.items(), key=lambda kv: kv[0].startswith("(floor)"))


def secs(t: dict[str, Series], name: str) -> list[float]:
    return t[name].seconds if name in t else []


def ratio(a: list[float], b: list[float], digits: int = 2, unit: str = "x") -> str:
    return fmt(paired(a, b), digits) + unit if a and b else "n/a"


def memory_floor_rows(floors: Sequence[FloorRep], threads: int, auto: str = "") -> list[list[str]]:
    """The floors tables' memcpy and blake3 rows (what, wall s, GB/s, CPU s/GiB); ``auto`` is said first in
    the AUTO row's parenthesis."""
    mc = [f.memcpy for f in floors]
    b1 = [f.blake3_1t for f in floors]
    ba = [f.blake3_auto for f in floors]
    return [
        [f"plain memcpy: `copy_` of every tensor into prefaulted page-aligned memory (torch threads {threads})",
         fmt([x.wall_s for x in mc], 3), fmt([x.gbps for x in mc]), DASH],
        ["bare blake3 pass over those bytes in memory, 1 thread", fmt([x.wall_s for x in b1], 3),
         fmt([x.gbps for x in b1]), fmt([x.cpu_s_per_gib for x in b1], 3)],
        [f"bare blake3 pass over those bytes in memory, AUTO threads ({auto}CPU: the whole process)",
         fmt([x.wall_s for x in ba], 3), fmt([x.gbps for x in ba]), fmt([x.cpu_s_per_gib for x in ba], 3)],
    ]


def timings_cell(timings: Sequence[dict[str, float]], digits: int = 3, keys: Sequence[str] | None = None,
                 unit: str = "") -> str:
    """``"name median (min-max)unit, ..."`` over timings dicts (a ``written`` event's, a writer's phases): the
    ``keys`` given, else every name any of them has, sorted; a dict without a name counts 0 for it."""
    names = sorted({k for t in timings for k in t}) if keys is None else keys
    return ", ".join(f"{k} {fmt([t.get(k, 0) for t in timings], digits)}{unit}" for k in names)


# ------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_busy() -> float:
    """System-wide busy CPU seconds (all cores) from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ reports


def load_cell(loads: Sequence[float]) -> str:
    """Load averages as a report shows them: ``1.00/0.50/0.25``."""
    return "/".join(f"{x:.2f}" for x in loads)


def uptime() -> str:
    """``uptime``'s line (the load before and after a run), or the load averages where it cannot run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return load_cell(os.getloadavg())


def host_line() -> str:
    """The Python version and host name, without importing anything measured (bench_writer's parent)."""
    return f"Python {platform.python_version()}; host {socket.gethostname()}"


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command a report prints: ``.venv/bin/python benchmarks/<script>`` and the arguments, quoted."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([".venv/bin/python", f"benchmarks/{script}", *map(shlex.quote, args)])


def started_at() -> str:
    """Now, local time with its offset, to the second (a report's "Started" line)."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_summary(repo: str) -> list[str]:
    """The machine lines plus the versions of everything measured."""
    import blake3
    import psutil
    import safetensors
    import torch

    import ckptstore

    return [
        *machine_lines(repo),
        f"Python {platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, "
        f"blake3 {getattr(blake3, '__version__', '?')}, psutil {psutil.__version__}, ckptstore {ckptstore.__version__}",
        f"Host: {socket.gethostname()}",
    ]


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def write_region(path: str, body: str, name: str) -> None:
    """Replaces the region between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` of the markdown
    file ``path`` with ``body`` (appends the region when missing); the rest is untouched."""
    begin, end = _markers(name)
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = _read(path)
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


def write_doc(path: str, head: Sequence[str], body: str, keep_region: str | None = None) -> None:
    """Writes the markdown report ``path``: the ``head`` lines, then ``body``. With ``keep_region``, the
    region of that name already in the file (another benchmark's, see :func:`write_region`) stays, last."""
    keep = ""
    if keep_region is not None:
        begin, end = _markers(keep_region)
        old = _read(path)
        if begin in old and end in old.split(begin, 1)[1]:
            keep = "\n" + begin + old.split(begin, 1)[1].split(end, 1)[0] + end + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n" + body + keep)


def publish(body: str, out: str | None, write: Callable[[str, str], None], wrote: str = "wrote {}") -> None:
    """Prints the report, and with ``out`` writes it there through ``write(out, body)`` and says so."""
    print()
    print(body)
    if out:
        write(out, body)
        print(wrote.format(out))
