"""Tensors and numpy arrays to raw bytes and back: the only code that touches torch's memory.

``describe`` turns a leaf of the state into an :class:`ArrayItem` (name, dtype, shape and a zero-copy
byte view of its data); ``empty_like_record`` allocates the destination a loader reads straight into.
torch is imported inside the functions, never at module import (``import ckptstore`` stays torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .format import TORCH_DTYPES
from .tree import Leaf


@dataclass
class ArrayItem:
    """One array ready to be written: ``data`` is a flat byte view of its contents (C order)."""

    name: str
    kind: str  # "torch" | "numpy"
    dtype: str  # torch dtype name, or numpy dtype.str
    shape: tuple[int, ...]
    nbytes: int
    data: memoryview


_DTYPE_NAMES: dict[Any, str] = {}


def torch_dtype_name(dtype: Any) -> str:
    """"float32" for torch.float32 (``str(dtype)`` costs 13 us; a save of 40,000 tensors asks 40,000 times)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def describe(leaf: Leaf) -> ArrayItem:
    """The bytes of a leaf, without a copy when it is already contiguous on the CPU."""
    if leaf.kind == "numpy":
        import numpy as np

        a = np.ascontiguousarray(leaf.obj)
        view = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        # The shape of the leaf, not of ``a``: ascontiguousarray returns ndim >= 1, so a 0-d array
        # would come back from a load with shape (1,).
        return ArrayItem(leaf.name, "numpy", a.dtype.str, tuple(np.shape(leaf.obj)), a.nbytes, view)
    import torch

    t = leaf.obj.detach()
    name = torch_dtype_name(t.dtype)
    if name not in TORCH_DTYPES:
        from .errors import UnsupportedValue

        raise UnsupportedValue(f"tensor {leaf.name!r} has dtype {t.dtype}, which ckptstore cannot store")
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        view = memoryview(b"")
    else:
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return ArrayItem(leaf.name, "torch", name, tuple(t.shape), nbytes, view)


def empty_for(kind: str, dtype: str, shape: list[int], nbytes: int) -> tuple[Any, memoryview]:
    """A fresh array of the record's type and shape, plus a writable byte view over its memory (the
    loader ``readinto``s it)."""
    import numpy as np

    if kind == "numpy":
        buf = np.empty(nbytes, dtype=np.uint8)
        arr = buf.view(np.dtype(dtype)).reshape(shape) if nbytes else np.empty(shape, dtype=np.dtype(dtype))
        return arr, memoryview(buf)
    import torch

    tdtype = getattr(torch, dtype)
    t = torch.empty(shape, dtype=tdtype)
    if not nbytes:
        return t, memoryview(b"")
    # reshape(-1) of a fresh contiguous tensor is a view; its bytes as uint8 are what readinto fills.
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())


def finish_tensor(obj: Any, node: dict[str, Any], map_location: Any) -> Any:
    """Applies what the tree records about a tensor (Parameter, requires_grad) and moves it. A
    "dtensor" node is finished the same way: its array is the rank's local shard, returned as a plain
    tensor (a reader has no device mesh; ``ckptstore.dtensors.rewrap`` makes it a DTensor again)."""
    if node.get("t") not in ("tensor", "dtensor"):
        return obj
    import torch

    if not isinstance(obj, torch.Tensor):
        # A damaged or hostile tree pointing a tensor node at a numpy record (the builder reports the
        # TypeError as a malformed node).
        raise TypeError(f"a {node.get('t')!r} node names a {type(obj).__name__}, not a tensor")
    if map_location is not None and str(map_location) != "cpu" and str(obj.device) != str(map_location):
        obj = obj.to(map_location)
    if node.get("param"):
        obj = torch.nn.Parameter(obj, requires_grad=bool(node.get("requires_grad", True)))
    return obj
