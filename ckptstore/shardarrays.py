"""A shard's data section read array by array (issue 23, split from ``shardread.py``): small arrays in
runs of up to ``PIECE`` bytes through one scratch buffer, larger ones piece by piece straight into their
memory, and format v2's per-array digests (``TensorHashes``), each byte hashed once. What comes before
and after the data section (the file, its header, its lengths and digests) is ``shardread``'s.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from operator import attrgetter
from typing import Any, Callable, Protocol, Sequence

from . import hashing
from .manifest import TensorRecord
from .shardwrite import PIECE

#: Arrays smaller than this are read in runs (``_read_run``); larger ones straight into their memory,
#: hashed on every core (the size below which ``hashing`` hashes inline anyway).
BATCH_BELOW = hashing.SMALL

#: ``take(run, data, starts)``: a run of small arrays whose bytes are ``data[starts[k]:][:run[k].nbytes]``.
Take = Callable[[Sequence[TensorRecord], memoryview, list[int]], None]


class ArrayStream(Protocol):
    """The raw bytes of a shard's data section, in order (``shardread``'s stream)."""

    def readinto_exact(self, view: memoryview) -> None: ...


class ArraySink(Protocol):
    """Where :func:`read_shard_into` hands each array's bytes as they are read (unverified until it
    returns)."""

    def begin(self, t: TensorRecord) -> None: ...
    def write(self, piece: memoryview) -> None: ...
    def end(self, t: TensorRecord) -> None: ...


class TensorHashes:
    """Format v2 reads: each array's blake3, hashed once as its bytes are read. With ``overlap`` (the
    caller never reuses a buffer), arrays of ``hashing.SMALL`` bytes or more are hashed on a helper
    thread while the next piece is read; smaller ones inline (a hand-off per 4 KB array would cost more
    than it saves)."""

    def __init__(self, overlap: bool) -> None:
        self._overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._updates: list[Future[None]] = []
        self._done: list[tuple[TensorRecord, bytes | Future[bytes]]] = []
        self._hasher: Any = None  # the current array's
        self._pooled = False
        self._futures = False  # whether ``_done`` holds a Future

    def begin(self, t: TensorRecord) -> None:
        self._hasher = hashing.new_hasher(threads=hashing.AUTO if t.nbytes >= hashing.SMALL else 1)
        self._pooled = self._overlap and t.nbytes >= hashing.SMALL
        if self._pooled and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-hash")

    def update(self, piece: memoryview) -> None:
        if self._pooled:
            assert self._pool is not None
            self._updates.append(self._pool.submit(self._hasher.update, piece))
        else:
            self._hasher.update(piece)

    def end(self, t: TensorRecord) -> None:
        if self._pooled:
            assert self._pool is not None
            self._done.append((t, self._pool.submit(self._hasher.digest)))
            self._futures = True
        else:
            self._done.append((t, self._hasher.digest()))

    def spans(self, run: Sequence[TensorRecord], data: memoryview, starts: list[int], ends: list[int]) -> None:
        """The arrays of ``run`` (each under ``hashing.SMALL``), whose bytes are ``data[start:end]``:
        hashed now, inline, one call each."""
        self._done.extend(zip(run, hashing.digest_each(map(data.__getitem__, map(slice, starts, ends)))))

    def digests(self) -> list[tuple[TensorRecord, bytes]]:
        """Every array's raw digest, in the order they were read; waits for the helper thread."""
        self.close()
        for f in self._updates:
            f.result()
        if not self._futures:  # every digest hashed inline (a shard of small arrays): no pass over 40,000
            return self._done
        return [(t, d if isinstance(d, bytes) else d.result()) for t, d in self._done]

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True)


def read_arrays(
    stream: ArrayStream, ordered: Sequence[TensorRecord], dest: Callable[[TensorRecord], memoryview | None], *,
    reuses_buffers: bool, hashes: TensorHashes | None, sink: ArraySink | None, on_bytes: Callable[[int], None] | None,
    take: Take | None = None,
) -> None:
    """Each array's bytes, in file order (``ordered``: the header was checked against them, so they tile
    the data section), from ``stream``: a run of small arrays in one read (``_read_run``), a larger one
    into ``dest(t)`` (or the one scratch buffer) piece by piece, each piece handed to the hashes and the
    sink as soon as it is read. The arguments are :func:`~ckptstore.shardread.read_shard_into`'s."""
    runs = _runs(ordered)
    # One scratch buffer for the whole shard: the longest run, or a piece of an array read for no one.
    need = [n for _, _, n, small in runs if small or reuses_buffers]
    scratch = memoryview(bytearray(min(PIECE, max(need)))) if need else None
    for i, j, _, small in runs:
        if small:
            assert scratch is not None
            _read_run(stream, ordered[i:j], scratch, dest, reuses_buffers=reuses_buffers, hashes=hashes, sink=sink,
                      on_bytes=on_bytes, take=take)
            continue
        t = ordered[i]
        view = dest(t)
        if view is None and not reuses_buffers:
            raise ValueError("dest returned no buffer; pass reuses_buffers=True")
        if hashes is not None:
            hashes.begin(t)
        if sink is not None:
            sink.begin(t)
        for start in range(0, t.nbytes, PIECE):
            piece = view[start : start + PIECE] if view is not None else scratch[: min(PIECE, t.nbytes - start)]  # type: ignore[index]
            stream.readinto_exact(piece)
            if hashes is not None:
                hashes.update(piece)
            if sink is not None:
                sink.write(piece)
            if on_bytes is not None:
                on_bytes(len(piece))
        if sink is not None:
            sink.end(t)
        if hashes is not None:
            hashes.end(t)


def _runs(ordered: Sequence[TensorRecord]) -> list[tuple[int, int, int, bool]]:
    """``ordered`` cut into ``(i, j, nbytes, small)``: the index range ``[i, j)`` holding ``nbytes``
    bytes, either consecutive arrays under ``BATCH_BELOW`` bytes holding at most ``PIECE`` together
    (``small``), or one larger array alone."""
    runs: list[tuple[int, int, int, bool]] = []
    start, size = 0, 0
    for k, t in enumerate(ordered):
        n = t.nbytes
        if n < BATCH_BELOW and size + n <= PIECE:
            size += n
            continue
        if k > start:
            runs.append((start, k, size, True))
        if n >= BATCH_BELOW:
            runs.append((k, k + 1, n, False))
            start, size = k + 1, 0
        else:
            start, size = k, n
    if len(ordered) > start:
        runs.append((start, len(ordered), size, True))
    return runs


def _read_run(
    stream: ArrayStream, run: Sequence[TensorRecord], scratch: memoryview,
    dest: Callable[[TensorRecord], memoryview | None], *, reuses_buffers: bool, hashes: TensorHashes | None,
    sink: ArraySink | None, on_bytes: Callable[[int], None] | None,
    take: Take | None,
) -> None:
    """A run of small arrays, contiguous in the file (the header was checked against the manifest),
    read in one call into ``scratch``, then hashed, handed to the sink and to ``take`` (else copied into
    ``dest(t)``) array by array."""
    ends = list(itertools.accumulate(map(attrgetter("nbytes"), run)))
    starts = [0, *ends[:-1]]
    data = scratch[: ends[-1]]
    views = None if take is not None else [dest(t) for t in run]
    if views is not None and not reuses_buffers and any(v is None for v in views):
        raise ValueError("dest returned no buffer; pass reuses_buffers=True")
    stream.readinto_exact(data)
    if hashes is not None:
        hashes.spans(run, data, starts, ends)
    if sink is not None:
        for t, a, b in zip(run, starts, ends):
            sink.begin(t)
            if b > a:
                sink.write(data[a:b])
            sink.end(t)
    if take is not None:
        take(run, data, starts)
    else:
        for view, a, b in zip(views, starts, ends):  # type: ignore[arg-type]
            if view is not None:
                (view if view.format == "B" and view.ndim == 1 else view.cast("B"))[:] = data[a:b]
    if on_bytes is not None:
        on_bytes(len(data))
