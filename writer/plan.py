"""Lays the arrays of a state out in one shared block (pure: no I/O, no torch).

Each array gets a page-aligned region, so the writer can hand any region to an O_DIRECT write and a
CUDA copy lands on an aligned host address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptstore.spi import ArrayItem

ALIGN = 4096


@dataclass(frozen=True)
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


def plan_block(arrays: list[tuple[str, str, str, tuple[int, ...], int]]) -> BlockPlan:
    """``arrays`` are (name, kind, dtype, shape, nbytes) in state order; returns their slots."""
    slots = []
    offset = 0
    for name, kind, dtype, shape, nbytes in arrays:
        slots.append(Slot(name, kind, dtype, tuple(shape), nbytes, offset))
        offset = align(offset + nbytes)
    return BlockPlan(tuple(slots), max(offset, ALIGN))


def grown_size(needed: int, current: int) -> int:
    """The size to allocate when the state no longer fits: 1/8 headroom so small growth (an optimizer
    state appearing after the first step) does not reallocate every cut."""
    if needed <= current:
        return current
    return align(needed + needed // 8, 1 << 20)
