"""Page-aligned staging buffers for O_DIRECT shard writes, and the pool a POSIX storage keeps them in.

Their own module (issue 20) so that :mod:`.posix` (which owns the pool) and :mod:`.sink` (which fills
the buffers) both import them publicly, and neither reaches into the other.
"""

from __future__ import annotations

import mmap

ALIGN = 4096
#: Ranged reads of object stores (``objects.py``) ask for at most this much at a time.
CHUNK = 8 << 20
#: Each of a sink's two staging buffers. 4 MiB O_DIRECT writes fill this disk as 8 MiB ones do (100,000
#: staged 4 KB arrays, 410 MB: 1.45 GB/s at 4 MiB, 1.25 at 8, 1.29 at 2, medians of 4 in one run), and a
#: cut of small arrays touches both buffers: in the thread and inline modes they are the trainer's
#: memory, 8 MiB less at 4 (issue 23).
STAGE = 4 << 20


class AlignedBuffer:
    """A page-aligned anonymous mapping, reused for every chunk of every shard (first touch of fresh
    memory is slow on this VM class, so it is allocated once per storage and kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size)
        self.view = memoryview(self.map)


class BufferPool:
    """The buffers one storage lends its sinks: ``take`` one (a new one when none is free), ``give_back``
    it when the sink is done. A sink holds two at a time; pools grow to the most sinks open at once."""

    def __init__(self, size: int = STAGE) -> None:
        self.size = size
        self._free: list[AlignedBuffer] = []

    def take(self) -> AlignedBuffer:
        return self._free.pop() if self._free else AlignedBuffer(self.size)

    def give_back(self, buf: AlignedBuffer) -> None:
        self._free.append(buf)
