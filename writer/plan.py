"""Lays the arrays of a state out in one shared block (pure: no I/O, no torch).

An array of at least a page (``ALIGN`` bytes) gets a page-aligned region, so the writer can hand it to
an O_DIRECT write and a CUDA copy lands on an aligned host address. A smaller one is packed: it starts
right where the slot before it ends, rounded up to its natural alignment (``pack_align``), sharing its
page with its neighbours (issue 23: 100,000 tensors of 12 bytes took a page each, 410 MB of block for
1.2 MB of data; packed, 1.2 MB, and back to back they are one ``cat`` run of the batched copy, not
100,000 views of ~600 bytes kept between cuts). Nothing relies on a wider alignment of so small a slot:
the shard sink copies any piece under its zero-copy minimum (64 KiB) into its own aligned buffers, a
typed view needs its offset to be a multiple of the element size only, numpy takes any offset, and the
shards' bytes do not depend on offsets in the block at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

from ckptstore.spi import ArrayItem

ALIGN = 4096
#: The widest alignment a packed (sub-page) slot gets: the largest element size (complex128).
PACK = 16


@dataclass(frozen=True, slots=True)  # slots: a plan of 100,000 arrays holds 100,000 of them
class Slot:
    """Where one array lives in the block: the one record of an array from the plan, over the wire to
    the writer process (``WriteRequest.slots`` validates this very type), to the shard writer
    (:meth:`item`), which turns it into the manifest's TensorRecord."""

    name: str
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int

    def item(self, block: memoryview) -> ArrayItem:
        """The array's bytes in ``block`` (the shared block's view), ready for ``write_shards``."""
        return BlockItem(self, block)


class BlockItem(ArrayItem):
    """The :class:`ArrayItem` of a slot, whose ``data`` (its bytes in the block) is sliced when it is
    read: the shard writer reads each array's data once, a run at a time, so a cut holds a few hundred
    such views at once instead of one per array (issue 23: a memoryview is 184 bytes, 18 MB of a cut
    of 100,000 arrays in the trainer, and the writer process keeps its items between cuts)."""

    __slots__ = ("_block", "_offset")

    def __init__(self, slot: Slot, block: memoryview) -> None:  # not ArrayItem's: ``data`` is a property here
        self.name, self.kind, self.dtype, self.shape, self.nbytes = (slot.name, slot.kind, slot.dtype, slot.shape,
                                                                     slot.nbytes)
        self._block, self._offset = block, slot.offset

    @property  # type: ignore[override]
    def data(self) -> memoryview:
        return self._block[self._offset:self._offset + self.nbytes]


@dataclass(frozen=True)
class BlockPlan:
    slots: tuple[Slot, ...]
    nbytes: int  # bytes the block needs (aligned end of the last slot)

    @property
    def payload(self) -> int:
        return sum(s.nbytes for s in self.slots)


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def pack_align(nbytes: int) -> int:
    """The alignment of a sub-page array of ``nbytes``: the largest power of two dividing its size, at
    most ``PACK``. Every element size is a power of two up to ``PACK`` and divides the array's size,
    so this is a multiple of it: ``nbytes`` alone says it, without the dtype."""
    return min(nbytes & -nbytes, PACK) if nbytes else PACK


def slot_start(end: int, nbytes: int) -> int:
    """Where an array of ``nbytes`` goes when the slot before it ends at ``end``: the next page for
    an array of a page or more, the next multiple of :func:`pack_align` for a smaller one."""
    return align(end, ALIGN if nbytes >= ALIGN else pack_align(nbytes))


def plan_block(arrays: Iterable[tuple[str, str, str, tuple[int, ...], int]], start: int = 0) -> BlockPlan:
    """``arrays`` are (name, kind, dtype, shape, nbytes) in state order; returns their slots, laid out
    from ``start`` on (the end of the slots before them), each aligned as :func:`slot_start` says."""
    slots = []
    end = start
    seen: dict[Any, Any] = {}  # one object per distinct shape and size (a state has few of them)
    for name, kind, dtype, shape, nbytes in arrays:
        shape = tuple(shape)
        offset = slot_start(end, nbytes)
        slots.append(Slot(name, kind, dtype, seen.setdefault(shape, shape), seen.setdefault(nbytes, nbytes), offset))
        end = offset + nbytes
    return BlockPlan(tuple(slots), max(align(end), ALIGN))


def extend_plan(plan: BlockPlan, arrays: list[tuple[str, str, str, tuple[int, ...], int]]) -> BlockPlan:
    """``plan`` with ``arrays`` laid out after its slots: the plan ``plan_block`` gives for all of them,
    without laying out ``plan``'s slots again (a capture reuses its state's plan and appends the
    attached files, which may change at every cut)."""
    if not arrays:
        return plan
    last = plan.slots[-1] if plan.slots else None
    more = plan_block(arrays, start=last.offset + last.nbytes if last is not None else 0)
    return BlockPlan(plan.slots + more.slots, more.nbytes)


def grown_size(needed: int, current: int) -> int:
    """The size to allocate when the state no longer fits: 1/8 headroom so small growth (an optimizer
    state appearing after the first step) does not reallocate every cut."""
    if needed <= current:
        return current
    return align(needed + needed // 8, 1 << 20)
