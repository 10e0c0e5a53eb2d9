"""Capture: the only code the training loop waits for. Copies every array of a state into the block.

CPU tensors and numpy arrays are copied straight into their slot. CUDA tensors take one of two paths:

* ``cuda-device-copy``: when the device has room (free >= 2x the CUDA bytes + 1 GiB), each tensor is
  cloned on the device (fast; the loop may continue right after), then copied to the host block on a
  side stream; the writer waits for that copy (``Captured.ready``) before it reads the block.
* ``cuda-direct``: otherwise device-to-host straight into the block, finished before capture returns.

Either way the host side is the shared block itself, pinned once with cudaHostRegister, so there is no
second host copy. Non-tensor state is turned into the JSON tree here, at capture time, so a cut holds
its own step's values, and files attached to the cut (``files=``, :mod:`ckptstore.attached`) are read
into the block here too, so it holds their bytes as of this step. When :func:`capture` returns, the
caller may modify every tensor in place and rewrite every attached file.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptstore.spi import torch_dtype_name
from ckptstore.spi import AttachedFile, FilesArg, Source, close_sources, open_sources
from ckptstore.spi import TORCH_DTYPES
from ckptstore.errors import UnsupportedValue
from ckptstore.spi import Leaf, flatten, has_pickle
from ckptstore.spi import pausing

from .plan import BlockPlan, plan_block
from .shm import Block

GIB = 1 << 30


@dataclass
class Captured:
    plan: BlockPlan
    tree: dict[str, Any]
    mode: str
    reason: str
    seconds: float
    pickled: bool
    #: The files attached to the cut; their bytes are the block's last slots.
    attached: list[AttachedFile] = field(default_factory=list)
    _pending: list[Any] = field(default_factory=list)
    _event: Any = None

    @property
    def complete(self) -> bool:
        """Whether every byte is in the block already (no device copy in flight)."""
        return self._event is None

    def ready(self) -> None:
        """Waits until every byte is in the block (CUDA device-copy path); drops the device clones."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._pending.clear()


def describe_leaf(leaf: Leaf) -> tuple[str, str, str, tuple[int, ...], int]:
    """(name, kind, dtype, shape, nbytes) of a leaf, without touching its data."""
    if leaf.kind == "numpy":
        a = leaf.obj
        return leaf.name, "numpy", a.dtype.str, tuple(a.shape), int(a.nbytes)
    t = leaf.obj
    name = torch_dtype_name(t.dtype)
    if name not in TORCH_DTYPES:
        raise UnsupportedValue(f"tensor {leaf.name!r} has dtype {t.dtype}, which ckptstore cannot store")
    return leaf.name, "torch", name, tuple(t.shape), t.numel() * t.element_size()


class Pinning:
    """Registers a block's memory with CUDA once (page-locked host memory for async copies)."""

    def __init__(self) -> None:
        self.block: Block | None = None
        self.ptr = 0

    def ensure(self, block: Block) -> None:
        if self.block is block:
            return
        self.release()
        block.ensure(block.size)  # back the headroom too before pinning: ShmTooSmall, never SIGBUS
        import ctypes

        import torch

        ptr = ctypes.addressof(ctypes.c_char.from_buffer(block.map))
        err = torch.cuda.cudart().cudaHostRegister(ptr, block.size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
        self.block, self.ptr = block, ptr

    def release(self) -> None:
        if self.block is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.block, self.ptr = None, 0


@pausing  # flattening tens of thousands of tensors: the collector would make it quadratic
def capture(
    state: Any,
    block_for: Callable[[int], Block],
    *,
    allow_pickle: bool = False,
    device_copy: bool = True,
    pinning: Pinning | None = None,
    files: FilesArg | None = None,
    where: dict[str, Any] | None = None,
) -> Captured:
    """Flattens ``state`` and copies its arrays, then the ``files`` attached to the cut, into the block
    ``block_for(nbytes)`` returns."""
    t0 = time.perf_counter()
    tree, leaves = flatten(state, allow_pickle=allow_pickle)
    sources = open_sources(files, where=where or {})
    try:
        captured = _capture(tree, leaves, sources, block_for, allow_pickle=allow_pickle, device_copy=device_copy,
                            pinning=pinning, where=where or {})
    finally:
        close_sources(sources)
    captured.seconds = time.perf_counter() - t0
    return captured


def _capture(tree: dict[str, Any], leaves: list[Leaf], sources: list[Source], block_for: Callable[[int], Block], *,
             allow_pickle: bool, device_copy: bool, pinning: Pinning | None, where: dict[str, Any]) -> Captured:
    plan = plan_block([describe_leaf(leaf) for leaf in leaves] + [s.describe() for s in sources])
    block = block_for(plan.nbytes)
    torch = sys.modules.get("torch")
    cuda_leaves = [lf for lf in leaves if lf.kind == "torch" and lf.obj.device.type == "cuda"]
    mode, reason = "cpu-copy", "all arrays are in host memory"
    captured = Captured(plan, tree, mode, reason, 0.0, pickled=allow_pickle and has_pickle(tree),
                        attached=[s.record() for s in sources])
    if cuda_leaves:
        assert torch is not None and pinning is not None
        pinning.ensure(block)
        need = sum(lf.obj.numel() * lf.obj.element_size() for lf in cuda_leaves)
        device = cuda_leaves[0].obj.device
        free, _total = torch.cuda.mem_get_info(device)
        if device_copy and free >= 2 * need + GIB:
            captured.mode, captured.reason = "cuda-device-copy", f"{free} bytes free >= 2x{need} + 1 GiB"
        else:
            captured.mode = "cuda-direct"
            captured.reason = ("device copy disabled" if not device_copy
                               else f"{free} bytes free < 2x{need} + 1 GiB: copying device-to-host directly")
    side = None
    if captured.mode == "cuda-device-copy":
        side = torch.cuda.Stream(device=cuda_leaves[0].obj.device)  # type: ignore[union-attr]
        side.wait_stream(torch.cuda.current_stream())  # type: ignore[union-attr]
    for slot, leaf in zip(plan.slots, leaves):
        if slot.nbytes == 0:
            continue
        if leaf.kind == "numpy":
            import numpy as np

            dst = np.ndarray(slot.shape, dtype=leaf.obj.dtype, buffer=block.map, offset=slot.offset)
            np.copyto(dst, leaf.obj, casting="no")
            continue
        assert torch is not None
        t = leaf.obj.detach()
        dst = torch.frombuffer(block.map, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
        dst = dst.view(t.dtype).view(t.shape)
        if t.device.type == "cuda" and side is not None:
            clone = t.clone()  # device-to-device on the loop's stream: the loop may continue after it
            captured._pending.append(clone)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dst.copy_(clone, non_blocking=True)
                clone.record_stream(side)
        elif t.device.type == "cuda":
            dst.copy_(t, non_blocking=True)
        else:
            dst.copy_(t)
    # The files last: their reads overlap the device-to-host copies just queued.
    for slot, src in zip(plan.slots[len(leaves):], sources):
        src.read_into(block.view[slot.offset:slot.offset + slot.nbytes], where=where)
    if captured.mode == "cuda-direct":
        torch.cuda.synchronize(cuda_leaves[0].obj.device)  # type: ignore[union-attr]
    elif side is not None:
        captured._event = torch.cuda.Event()  # type: ignore[union-attr]
        captured._event.record(side)
    return captured
