"""Lays the arrays of a state out in one shared block (pure: no I/O, no torch).

Each array gets a page-aligned region, so the writer can hand any region to an O_DIRECT write and a
CUDA copy lands on an aligned host address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

from ckptstore.spi import ArrayItem

ALIGN = 4096


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
        return ArrayItem(self.name, self.kind, self.dtype, self.shape, self.nbytes,
                         block[self.offset : self.offset + self.nbytes])


@dataclass(frozen=True)
class BlockPlan:
    slots: tuple[Slot, ...]
    nbytes: int  # bytes the block needs (aligned end of the last slot)

    @property
    def payload(self) -> int:
        return sum(s.nbytes for s in self.slots)


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def plan_block(arrays: Iterable[tuple[str, str, str, tuple[int, ...], int]], start: int = 0) -> BlockPlan:
    """``arrays`` are (name, kind, dtype, shape, nbytes) in state order; returns their slots, the first
    at ``start`` (aligned)."""
    slots = []
    offset = start
    seen: dict[Any, Any] = {}  # one object per distinct shape and size (a state has few of them)
    for name, kind, dtype, shape, nbytes in arrays:
        shape = tuple(shape)
        slots.append(Slot(name, kind, dtype, seen.setdefault(shape, shape), seen.setdefault(nbytes, nbytes), offset))
        offset = align(offset + nbytes)
    return BlockPlan(tuple(slots), max(offset, ALIGN))


def extend_plan(plan: BlockPlan, arrays: list[tuple[str, str, str, tuple[int, ...], int]]) -> BlockPlan:
    """``plan`` with ``arrays`` laid out after its slots: the plan ``plan_block`` gives for all of them,
    without laying out ``plan``'s slots again (a capture reuses its state's plan and appends the
    attached files, which may change at every cut)."""
    if not arrays:
        return plan
    last = plan.slots[-1] if plan.slots else None
    more = plan_block(arrays, start=align(last.offset + last.nbytes) if last is not None else 0)
    return BlockPlan(plan.slots + more.slots, more.nbytes)


def grown_size(needed: int, current: int) -> int:
    """The size to allocate when the state no longer fits: 1/8 headroom so small growth (an optimizer
    state appearing after the first step) does not reallocate every cut."""
    if needed <= current:
        return current
    return align(needed + needed // 8, 1 << 20)
