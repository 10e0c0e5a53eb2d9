"""Capture: the only code the training loop waits for. Copies every array of a state into the block.

A capture is batched (issue 23): the state is flattened through the pipeline's :class:`CaptureCache`,
so a state of the last layout reuses its tree, plan and destination views of the block
(``ckptstore.tree.layoutcache``), and the tensors are copied with one ``torch._foreach_copy_`` per
(dtype, device) group (:mod:`~ckptstore.writer.blockcopy`). Numpy arrays are copied one by one;
``batched=False`` keeps the copy tensor by tensor of before, the reference the tests compare with.

CPU tensors and numpy arrays are copied straight into their slot. CUDA tensors take one of two paths:

* ``cuda-device-copy``: when the device has room (free >= 2x the bytes to copy + 1 GiB), the CUDA
  tensors are gathered on the device into one buffer laid out like their slots (fast; the loop may
  continue right after), then copied to the host block on a side stream, one copy per run of slots;
  the writer waits for that copy (``Captured.ready``) before it reads the block.
* ``cuda-direct``: otherwise device-to-host straight into the block, finished before capture returns.

Either way the host side is the shared block itself, pinned once with cudaHostRegister, so there is no
second host copy. CUDA tensors on several devices take the copy tensor by tensor. Non-tensor state is
turned into the JSON tree here, at capture time, so a cut holds its own step's values, and files
attached to the cut (``files=``, :mod:`ckptstore.attached`) are read into the block here too, so it
holds their bytes as of this step. When :func:`capture` returns, the caller may modify every tensor in
place and rewrite every attached file.
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
from ckptstore.spi import Leaf, has_pickle
from ckptstore.spi import pausing
from ckptstore.spi import Flat, LayoutCache

from .blockcopy import BlockCopy
from .plan import BlockPlan, Slot, extend_plan, plan_block
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
        """Waits until every byte is in the block (CUDA device-copy path); drops the device copy."""
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


class CaptureCache:
    """What the captures of one pipeline reuse while the state keeps its layout (issue 23): the layout
    (``ckptstore.tree.layoutcache``), the plan of its arrays, and, while the block is the same object,
    the block's destination views (:class:`~ckptstore.writer.blockcopy.BlockCopy`). A state of another
    layout makes a new plan; a new block (growth) new views. :meth:`release` drops the views: they keep
    the block's mapping alive, so it comes before the block is closed."""

    def __init__(self) -> None:
        self.layouts = LayoutCache()
        self._layout: object = None  # the Layout the plan was made for
        self._plan: BlockPlan | None = None
        self._copy: BlockCopy | None = None

    def plan(self, flat: Flat) -> BlockPlan:
        """The plan of ``flat``'s arrays (raises UnsupportedValue for a dtype ckptstore cannot store)."""
        if flat.layout is not self._layout or self._plan is None:
            plan = plan_block(map(describe_leaf, flat.leaves()))  # no list of 100,000 descriptions
            self._layout, self._plan, self._copy = flat.layout, plan, None
        return self._plan

    def copier(self, flat: Flat, block: Block) -> BlockCopy:
        """The views of ``block`` for the plan of ``flat`` (made by :meth:`plan` just before)."""
        assert self._plan is not None and flat.layout is self._layout
        if self._copy is None or self._copy.block is not block:
            self._copy = None  # the old views go first
            self._copy = BlockCopy(self._plan.slots, flat.sources, block)
        return self._copy

    def release(self) -> None:
        """Drops the views of the block (call before closing it)."""
        self._copy = None


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
    cache: CaptureCache | None = None,
    batched: bool = True,
) -> Captured:
    """Flattens ``state`` and copies its arrays, then the ``files`` attached to the cut, into the block
    ``block_for(nbytes)`` returns. ``cache`` (one per pipeline) makes a state of the last layout cheap;
    ``batched=False`` copies tensor by tensor, as before issue 23 (tests compare the two)."""
    t0 = time.perf_counter()
    cache = cache if cache is not None else CaptureCache()
    flat = cache.layouts.flatten(state, allow_pickle=allow_pickle)
    sources = open_sources(files, where=where or {})
    try:
        captured = _capture(flat, sources, block_for, cache, allow_pickle=allow_pickle, device_copy=device_copy,
                            pinning=pinning, where=where or {}, batched=batched)
    finally:
        close_sources(sources)
    captured.seconds = time.perf_counter() - t0
    return captured


def _capture(flat: Flat, sources: list[Source], block_for: Callable[[int], Block], cache: CaptureCache, *,
             allow_pickle: bool, device_copy: bool, pinning: Pinning | None, where: dict[str, Any],
             batched: bool) -> Captured:
    leaf_plan = cache.plan(flat)
    plan = extend_plan(leaf_plan, [s.describe() for s in sources])
    block = block_for(plan.nbytes)
    captured = Captured(plan, flat.tree, "cpu-copy", "all arrays are in host memory", 0.0,
                        pickled=allow_pickle and has_pickle(flat.tree), attached=[s.record() for s in sources])
    copy = cache.copier(flat, block) if batched else None
    if copy is None or len(copy.devices) > 1:  # CUDA tensors on several devices: one by one, as before
        device = _copy_each(leaf_plan.slots, flat.sources, block, captured, pinning, device_copy)
    else:
        device = _copy_batched(copy, flat.sources, block, captured, pinning, device_copy)
    # The files last: their reads overlap the device-to-host copies just queued.
    for slot, src in zip(plan.slots[len(leaf_plan.slots):], sources):
        src.read_into(block.view[slot.offset:slot.offset + slot.nbytes], where=where)
    if captured.mode == "cuda-direct":
        sys.modules["torch"].cuda.synchronize(device)
    return captured


def _cuda_mode(need: int, device: Any, device_copy: bool) -> tuple[str, str]:
    """The capture mode for CUDA tensors needing ``need`` bytes of device memory to copy, and why."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    if device_copy and free >= 2 * need + GIB:
        return "cuda-device-copy", f"{free} bytes free >= 2x{need} + 1 GiB"
    return "cuda-direct", ("device copy disabled" if not device_copy
                           else f"{free} bytes free < 2x{need} + 1 GiB: copying device-to-host directly")


def _copy_batched(copy: BlockCopy, srcs: list[Any], block: Block, captured: Captured, pinning: Pinning | None,
                  device_copy: bool) -> Any:
    """The batched copy (:class:`BlockCopy`). CUDA tensors (of one device) first, so their
    copies run while the host ones are made: ``cuda-device-copy`` gathers them into one device buffer
    laid out like the block, on the loop's stream, then one device-to-host copy per run of slots on a
    side stream and one event; ``cuda-direct`` copies them into the pinned block (the caller waits).
    Returns the CUDA device, if any."""
    device = None
    if copy.device_groups:
        import torch

        assert pinning is not None
        pinning.ensure(block)
        (device,) = copy.devices
        captured.mode, captured.reason = _cuda_mode(copy.stage_nbytes, device, device_copy)
        if captured.mode == "cuda-device-copy":
            buf = copy.stage(srcs, device)  # on the loop's stream: the loop may change the tensors after it
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                copy.unstage(buf, non_blocking=True)
            buf.record_stream(side)
            captured._pending.append(buf)  # dropped by ready(), once the event says the copy is done
            captured._event = torch.cuda.Event()
            captured._event.record(side)
        else:
            copy.copy_device(srcs, non_blocking=True)
    copy.copy_host(srcs)
    copy.copy_numpy(srcs)
    return device


def _copy_each(slots: tuple[Slot, ...], srcs: list[Any], block: Block, captured: Captured, pinning: Pinning | None,
               device_copy: bool) -> Any:
    """The copy tensor by tensor (before issue 23): the reference the batched copy is tested against,
    and the path of a state with CUDA tensors on several devices. Returns the first CUDA device."""
    torch = sys.modules.get("torch")
    cuda = [(slot, t) for slot, t in zip(slots, srcs) if slot.kind == "torch" and t.device.type == "cuda"]
    device = cuda[0][1].device if cuda else None
    if cuda:
        assert torch is not None and pinning is not None
        pinning.ensure(block)
        captured.mode, captured.reason = _cuda_mode(sum(t.numel() * t.element_size() for _s, t in cuda), device,
                                                    device_copy)
    side = None
    if captured.mode == "cuda-device-copy":
        side = torch.cuda.Stream(device=device)  # type: ignore[union-attr]
        side.wait_stream(torch.cuda.current_stream())  # type: ignore[union-attr]
    for slot, src in zip(slots, srcs):
        if slot.nbytes == 0:
            continue
        if slot.kind == "numpy":
            import numpy as np

            dst = np.ndarray(slot.shape, dtype=src.dtype, buffer=block.map, offset=slot.offset)
            np.copyto(dst, src, casting="no")
            continue
        assert torch is not None
        t = src.detach()
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
    if side is not None:
        captured._event = torch.cuda.Event()  # type: ignore[union-attr]
        captured._event.record(side)
    return device
