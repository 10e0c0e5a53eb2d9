"""Tensors and numpy arrays to raw bytes and back: the only code that touches torch's memory.

``describe`` turns a leaf of the state into an :class:`ArrayItem` (name, dtype, shape and a zero-copy
byte view of its data); ``empty_like_record`` allocates the destination a loader reads straight into.
torch is imported inside the functions, never at module import (``import ckptstore`` stays torch-free).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .errors import UsageError
from .format import TORCH_DTYPES
from .tree import Leaf, check_view


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


def resolve_map_location(map_location: Any, where: dict[str, Any]) -> Any:
    """What ``torch.load`` accepts as ``map_location``, as the one device every tensor of a cut goes to
    (ckptstore stores tensors as host arrays, so their saved location is "cpu"): None or "cpu" -> "cpu";
    a str or ``torch.device`` -> itself; a dict -> its entry for "cpu" (else "cpu"); a callable ->
    called once as ``f(storage, "cpu")`` with an empty CPU storage, and the device of the storage it
    returns (None -> "cpu"). Anything else is a UsageError naming the store."""
    if map_location is None:
        return "cpu"
    if isinstance(map_location, str):
        return map_location
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(map_location, torch.device):
        return map_location
    if isinstance(map_location, dict):
        target = map_location.get("cpu", "cpu")
        if not isinstance(target, str) and not (torch is not None and isinstance(target, torch.device)):
            raise UsageError(f"map_location maps 'cpu' to {target!r}, not a device", **where)
        return target
    if callable(map_location):
        if torch is None:
            raise UsageError("a callable map_location needs torch", **where)
        moved = map_location(torch.UntypedStorage(0), "cpu")
        if moved is None:
            return "cpu"
        device = getattr(moved, "device", None)
        if device is None:
            raise UsageError(f"map_location returned {type(moved).__name__}, not a storage or tensor", **where)
        return device
    raise UsageError(f"map_location must be a device, a str, a dict or a callable (as for torch.load), "
                     f"got {type(map_location).__name__}", **where)


def finish_tensor(obj: Any, node: dict[str, Any], map_location: Any) -> Any:
    """Applies what the tree records about a tensor (its ``view`` of a shared array, Parameter,
    requires_grad) and moves it. A "dtensor" node is finished the same way: its array is the rank's
    local shard, returned as a plain tensor (a reader has no device mesh; ``ckptstore.dtensors.rewrap``
    makes it a DTensor again). Each call returns a new tensor object over ``obj``'s storage when the
    node asks for more than the plain array, so a Parameter and a plain tensor over one storage keep
    their own types and still share it (issue 10, item 14)."""
    if node.get("t") not in ("tensor", "dtensor"):
        return obj
    import torch

    if not isinstance(obj, torch.Tensor):
        # A damaged or hostile tree pointing a tensor node at a numpy record (the builder reports the
        # TypeError as a malformed node).
        raise TypeError(f"a {node.get('t')!r} node names a {type(obj).__name__}, not a tensor")
    if map_location is not None and str(map_location) != "cpu" and str(obj.device) != str(map_location):
        obj = obj.to(map_location)
    if node.get("t") == "tensor" and "view" in node:
        obj = apply_view(obj, node["view"])
    if node.get("param"):
        obj = torch.nn.Parameter(obj, requires_grad=bool(node.get("requires_grad", True)))
    elif node.get("t") == "tensor" and node.get("requires_grad") is True:
        obj = obj.detach().requires_grad_(True)  # a new object: the array may back other nodes too
    return obj




def apply_view(base: Any, view: Any) -> Any:
    """The tensor a "tensor" node's ``view`` describes over ``base`` (a contiguous array): ``offset``,
    ``shape`` and ``stride`` in elements, checked to stay inside ``base`` (ValueError otherwise, which
    the tree builder reports as a malformed node)."""
    if not base.is_contiguous():
        raise ValueError("view of an array that is not contiguous")
    check_view(view, base.numel())
    return base.as_strided(view["shape"], view["stride"], base.storage_offset() + view["offset"])
