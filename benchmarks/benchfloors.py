"""The physical floors both benchmarks judge against, measured in the same run on the state's own bytes.

* **memcpy**: ``copy_`` of every tensor into one prefaulted, page-aligned anonymous mapping, each tensor in
  a 4 KiB-aligned slot (the layout of the writer's shared block). What a capture cannot beat. For many
  small tensors, the same copy as one ``torch._foreach_copy_`` (bench_many.py's stall floor).
* **blake3**: one bare pass over those bytes in memory, 1 thread (what the writer process hashes with by
  default) or blake3's AUTO pool. Its CPU seconds per GiB are the floor of the writer's CPU per GiB.
* **disk**: those same bytes written with O_DIRECT straight from the page-aligned mapping (8 MiB
  requests), then fsync of the file and of its directory. What any durable save of them cannot beat.

No import-time side effects; torch and blake3 are imported lazily (bench_writer's parent process imports
this module's dataclasses without torch).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

PAGE = 4096
DIRECT_CHUNK = 8 << 20
GIB = float(1 << 30)


@dataclass(frozen=True)
class Timed:
    """Wall and CPU seconds of one floor pass over ``nbytes`` bytes."""

    nbytes: int
    wall_s: float
    cpu_s: float | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / 1e9 / self.wall_s

    @property
    def cpu_s_per_gib(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / (self.nbytes / GIB)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class AlignedImage:
    """The tensors' bytes packed into one prefaulted, page-aligned anonymous mapping (4 KiB-aligned slots).

    ``copy_in()`` is the memcpy floor; ``view`` is what the blake3 and disk floors read. Its length is a
    multiple of the page size, as O_DIRECT needs; the padding between slots is zeros and counts as written.
    Call ``close()`` when done (the torch views pin the mapping until then)."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        import torch

        self.tensors = list(tensors)
        offsets, off = [], 0
        for t in self.tensors:
            offsets.append(off)
            off = _round_up(off + t.numel() * t.element_size(), PAGE)
        self.payload = sum(t.numel() * t.element_size() for t in self.tensors)
        self.size = max(PAGE, off)
        self._map = mmap.mmap(-1, self.size)
        self._flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._flat.fill_(0)  # prefault: first touch of fresh memory is slow on this VM class (limits.md)
        self._views = [self._flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                       for o, t in zip(offsets, self.tensors)]
        self.view = memoryview(self._map)

    def copy_in(self) -> Timed:
        """The memcpy floor: ``copy_`` of every tensor into its slot (torch's thread count as set)."""
        t0 = time.perf_counter()
        for v, t in zip(self._views, self.tensors):
            v.copy_(t)
        return Timed(self.payload, time.perf_counter() - t0)

    def foreach_copy_in(self) -> Timed:
        """The same copy as one ``torch._foreach_copy_`` call (issue 23's stall floor): the per-tensor
        Python loop of :meth:`copy_in` costs microseconds a tensor, which is what a state of tens of
        thousands of small tensors measures, not the memory bandwidth."""
        import torch

        t0 = time.perf_counter()
        torch._foreach_copy_(self._views, self.tensors)
        return Timed(self.payload, time.perf_counter() - t0)

    def close(self) -> None:
        self.view.release()
        del self._views, self._flat
        self._map.close()


def blake3_pass(view: memoryview, *, threads: int = 1) -> Timed:
    """One bare blake3 pass over ``view``. With 1 thread the hash runs in the calling thread, so the CPU
    figure is this thread's; with more it is the whole process's (blake3's pool threads are in it)."""
    import blake3

    n = None if threads == 1 else (blake3.blake3.AUTO if threads <= 0 else threads)
    clock = time.thread_time if n is None else time.process_time
    h = blake3.blake3() if n is None else blake3.blake3(max_threads=n)
    c0, t0 = clock(), time.perf_counter()
    h.update(view)
    h.hexdigest()
    return Timed(len(view), time.perf_counter() - t0, clock() - c0)


def odirect_write(directory: str, view: memoryview, *, chunk: int = DIRECT_CHUNK) -> Timed:
    """The disk floor: ``view`` (page-aligned, a multiple of the page size long) written to a new file in
    ``directory`` with O_DIRECT in ``chunk``-byte requests, then fsync of the file and of the directory;
    the file is deleted afterwards (outside the timing). Raises OSError where O_DIRECT is refused (tmpfs,
    some FUSE). The caller runs ``os.sync()`` and any settling pause first."""
    if len(view) % PAGE:
        raise ValueError("an O_DIRECT source must be a multiple of the page size long")
    path = os.path.join(directory, f"disk-floor-{os.getpid()}.bin")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        off = 0
        while off < len(view):
            off += os.write(fd, view[off:off + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    secs = time.perf_counter() - t0
    os.unlink(path)
    return Timed(len(view), secs)
