"""The batched copy of a capture (issue 23): a state's tensors go into the block in a few calls, not
one Python round trip each.

:class:`BlockCopy` holds, for one plan and one block, the copies of each (dtype, device) group of
tensor slots: a *run* (at least ``MIN_RUN`` slots consecutive in the plan, back to back in the block,
of one trailing shape: 4 KB-multiple tensors, the issue's 40,000 of them) is one
``torch.cat(sources, out=<one view of the run>)``; the other slots get a destination view each, typed
and shaped like the tensor, and one ``torch._foreach_copy_``. Views cost ~600 bytes and ~1.7 us each to
make, so a capture keeps its BlockCopy while the state's layout and the block stay the same
(``capture.CaptureCache``); a new block (growth) makes a new one. Both primitives read any strides and
resolve conj and neg bits (tests compare every kind with the per-tensor copy).

Both also broadcast or convert what they are given (``_foreach_copy_`` broadcasts a source into its
view and converts dtypes; ``cat`` converts dtypes and splits its output by the sources' first
dimension), so the plan must describe the sources exactly: the layout's signature
(``ckptstore.tree.layoutcache``) guarantees it for a reused plan, and a fresh plan is made from the very
tensors copied. Numpy arrays (``np.copyto``) and zero-size tensors (nothing to copy) are in no group.

CUDA tensors: ``copy(..., device=True, non_blocking=True)`` copies them device-to-host straight into
the (pinned) block, one view each (``cuda-direct``). ``stage`` gathers them on the device into one
buffer laid out like their runs of consecutive slots in the block (runs and views as above, made in
that buffer, on the caller's stream: the loop may change the tensors once it is queued), and
``unstage`` copies each run of the buffer into the block (``cuda-device-copy``: one device-to-host copy
per run, on the side stream the caller picks). None of them knows about streams, and ``device_type``
says which tensors count as the device's, so every path runs, and is tested, on the CPU too
(``device_type="cpu"``).
"""

from __future__ import annotations

import bisect
import operator
from typing import Any, Callable, Sequence

from .plan import ALIGN, Slot, align
from .shm import Block

#: The fewest slots a ``cat`` run takes: below it a cat call (~4 us) costs more than the
#: ``_foreach_copy_`` entries it saves (~1 us each).
MIN_RUN = 8


def _picker(idx: list[int], n: int) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """``sources -> [sources[i] for i in idx]`` in one C call; ``sources`` itself when ``idx`` is all
    ``n`` of them in order."""
    if len(idx) == n and idx == list(range(n)):
        return lambda s: s
    if len(idx) == 1:
        i = idx[0]
        return lambda s: (s[i],)
    return operator.itemgetter(*idx)


class _Copies:
    """The copies of one (dtype, device) group's slots into ``base`` (a 1-D uint8 tensor: the block,
    or a stage buffer), a slot's bytes at ``at(slot.offset)`` in it."""

    def __init__(self, base: Any, dtype: Any, slots: Sequence[Slot], leaves: list[int], n: int,
                 at: Callable[[int], int] | None = None) -> None:
        es = dtype.itemsize
        typed = base[:base.numel() - base.numel() % es].view(dtype)
        # Offsets are multiples of the element size in the block (page-aligned, or packed at their
        # natural alignment: plan.pack_align) and in a stage buffer (a run keeps its place in a page).
        where = (lambda o: o // es) if at is None else (lambda o: at(o) // es)
        runs, rest = _runs_of(slots, leaves)
        self.runs = []
        for run in runs:
            first = slots[run[0]]
            shape = (sum(slots[i].shape[0] for i in run), *first.shape[1:])
            self.runs.append((_picker(run, n), typed.as_strided(shape, _contiguous(shape), where(first.offset))))
        self.pick = _picker(rest, n) if rest else None
        self.views = [typed.as_strided(slots[i].shape, _contiguous(slots[i].shape), where(slots[i].offset))
                      for i in rest]

    def run(self, sources: Sequence[Any], non_blocking: bool = False) -> None:
        import torch

        for pick, out in self.runs:
            torch.cat(pick(sources), out=out)
        if self.pick is not None:
            torch._foreach_copy_(self.views, self.pick(sources), non_blocking=non_blocking)


def _runs_of(slots: Sequence[Slot], leaves: list[int]) -> tuple[list[list[int]], list[int]]:
    """``leaves`` (plan order) split into ``cat`` runs and the rest: a run's slots are consecutive in
    the plan, each starts where the one before it ends (no padding between), and all have the same
    shape but for the first dimension (0-d slots are in no run)."""
    runs: list[list[int]] = []
    rest: list[int] = []
    cur: list[int] = []

    def close() -> None:
        (runs.append(list(cur)) if len(cur) >= MIN_RUN else rest.extend(cur))
        cur.clear()

    for i in leaves:
        s = slots[i]
        if cur:
            last = slots[cur[-1]]
            if i == cur[-1] + 1 and s.shape and s.shape[1:] == last.shape[1:] and last.offset + last.nbytes == s.offset:
                cur.append(i)
                continue
            close()
        if s.shape:
            cur.append(i)
        else:
            rest.append(i)
    close()
    return runs, rest


class BlockCopy:
    """The copies of the tensor slots ``slots`` (a plan's, in leaf order) into ``block``, grouped by
    (dtype, device); ``sources`` are the arrays the plan was made from (their dtypes and devices are
    read once, here)."""

    def __init__(self, slots: Sequence[Slot], sources: Sequence[Any], block: Block, *,
                 device_type: str = "cuda") -> None:
        self.block = block
        self.slots = slots
        self.numpy: list[int] = []
        by_key: dict[tuple[Any, Any], list[int]] = {}
        for i, (slot, src) in enumerate(zip(slots, sources)):
            if slot.kind == "numpy":
                self.numpy.append(i)
            elif slot.nbytes:
                by_key.setdefault((src.dtype, src.device), []).append(i)
        self._n = n = len(slots)
        self._base: Any = None
        if by_key:  # torch only where the state holds tensors: a numpy-only state runs without it
            import torch

            self._base = torch.frombuffer(block.map, dtype=torch.uint8)
        # The groups on a device of ``device_type`` (tests pass "cpu" to run the device paths here).
        host = {k: v for k, v in by_key.items() if k[1].type != device_type}
        self._device = {k: v for k, v in by_key.items() if k[1].type == device_type}
        self._host = [_Copies(self._base, dtype, slots, idx, n) for (dtype, _d), idx in host.items()]
        #: The devices of the device groups.
        self.devices = {device for _dtype, device in self._device}
        self._direct: list[tuple[Any, list[Any]]] | None = None  # made on first use (cuda-direct)
        self._runs = _block_runs(slots, sorted(i for idx in self._device.values() for i in idx))
        #: Bytes of the device buffer ``stage`` fills (the device slots' runs, padding included).
        self.stage_nbytes = self._runs[-1][2] + self._runs[-1][1] - self._runs[-1][0] if self._runs else 0

    @property
    def device_groups(self) -> int:
        """How many (dtype, device) groups are on the device."""
        return len(self._device)

    @property
    def held(self) -> tuple[int, int]:
        """(cat runs, views) held for the host tensors: a view costs ~600 bytes, a run one view."""
        return sum(len(c.runs) for c in self._host), sum(len(c.views) for c in self._host)

    @property
    def stage_runs(self) -> int:
        """How many device-to-host copies ``unstage`` makes."""
        return len(self._runs)

    def copy_host(self, sources: Sequence[Any]) -> None:
        """Copies the host (CPU) tensors into the block."""
        if not self._host:
            return
        import torch

        with torch.no_grad():  # a source that requires grad must not give the block's views a graph
            for c in self._host:
                c.run(sources)

    def copy_device(self, sources: Sequence[Any], *, non_blocking: bool = False) -> None:
        """Copies the device tensors into the block, device-to-host: one view each, one
        ``_foreach_copy_`` per group (``cuda-direct``; ``non_blocking`` into the pinned block)."""
        if not self._device:
            return
        import torch

        if self._direct is None:
            self._direct = [(_picker(idx, self._n), _views(self._base, dtype, self.slots, idx))
                            for (dtype, _d), idx in self._device.items()]
        with torch.no_grad():
            for pick, views in self._direct:
                torch._foreach_copy_(views, pick(sources), non_blocking=non_blocking)

    def copy_numpy(self, sources: Sequence[Any]) -> None:
        """The numpy arrays, one ``np.copyto`` each (states hold few)."""
        if not self.numpy:
            return
        import numpy as np

        for i in self.numpy:
            slot, a = self.slots[i], sources[i]
            if slot.nbytes:
                dst = np.ndarray(slot.shape, dtype=a.dtype, buffer=self.block.map, offset=slot.offset)
                np.copyto(dst, a, casting="no")

    def stage(self, sources: Sequence[Any], device: Any) -> Any:
        """The device slots' bytes gathered into one new buffer on ``device`` (padding zeroed), laid out
        like their runs of the block (:meth:`unstage` copies it in); queued on the current stream."""
        import torch

        buf = torch.zeros(self.stage_nbytes, dtype=torch.uint8, device=device)
        at = _stage_offsets(self._runs)
        with torch.no_grad():
            for (dtype, _d), idx in self._device.items():
                _Copies(buf, dtype, self.slots, idx, self._n, at).run(sources)
        return buf

    def unstage(self, buf: Any, *, non_blocking: bool = False) -> None:
        """Copies a :meth:`stage` buffer into the block: one copy per run of consecutive device slots."""
        for lo, hi, start in self._runs:
            self._base[lo:hi].copy_(buf[start:start + hi - lo], non_blocking=non_blocking)


def _block_runs(slots: Sequence[Slot], idx: list[int]) -> list[tuple[int, int, int]]:
    """(block start, block end, buffer start) of each run of slots ``idx`` (sorted) that are consecutive
    in the plan: one copy covers a run and the padding inside it. A run starts in the buffer at the
    place within a page its start has in the block (sub-page slots are packed, ``plan.pack_align``:
    a run may start mid-page), so every slot keeps its alignment."""
    runs: list[tuple[int, int, int]] = []
    prev = -2
    for i in idx:
        s = slots[i]
        if i == prev + 1:
            lo, _hi, at = runs[-1]
            runs[-1] = (lo, s.offset + s.nbytes, at)
        else:
            at = align(runs[-1][2] + runs[-1][1] - runs[-1][0]) if runs else 0
            runs.append((s.offset, s.offset + s.nbytes, at + s.offset % ALIGN))
        prev = i
    return runs


def _stage_offsets(runs: list[tuple[int, int, int]]) -> Callable[[int], int]:
    """block offset -> offset in the stage buffer, for an offset inside one of ``runs``."""
    starts = [lo for lo, _hi, _at in runs]

    def at(offset: int) -> int:
        lo, _hi, start = runs[bisect.bisect_right(starts, offset) - 1]
        return offset - lo + start

    return at


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a C-contiguous tensor of ``shape``."""
    strides = _STRIDES.get(shape)
    if strides is None:
        acc, out = 1, []
        for n in reversed(shape):
            out.append(acc)
            acc *= n
        strides = _STRIDES[shape] = tuple(reversed(out))
    return strides


def _views(base: Any, dtype: Any, slots: Sequence[Slot], idx: list[int]) -> list[Any]:
    """A view of ``base`` (the block) as ``dtype`` per slot in ``idx``, shaped like its tensor."""
    es = dtype.itemsize
    typed = base[:base.numel() - base.numel() % es].view(dtype)
    return [typed.as_strided(slots[i].shape, _contiguous(slots[i].shape), slots[i].offset // es) for i in idx]


__all__ = ["BlockCopy", "MIN_RUN"]
