"""Tensors and numpy arrays to raw bytes and back: the only code that touches torch's memory.

``describe`` turns a leaf of the state into an :class:`ArrayItem` (name, dtype, shape and a zero-copy
byte view of its data), ``describe_all`` every leaf of a save; ``empty_like_record`` allocates the destination a loader reads straight into.
torch is imported inside the functions, never at module import (``import ckptstore`` stays torch-free).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import operator
import sys
from dataclasses import dataclass
from itertools import compress, repeat, starmap
from operator import attrgetter
from typing import Any, NamedTuple, Sequence

from .errors import UsageError
from .format import TORCH_DTYPES
from .tree import Leaf, check_view


@dataclass(slots=True)  # slots: a cut of 100,000 arrays makes 100,000 of them (a dict each: 15 MB)
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
    if leaf.item is not None:  # described by the flatten that made it (``plain_describer``)
        return leaf.item
    if leaf.kind == "numpy":
        return _describe_numpy(leaf)
    item = _describe_plain(leaf, _plain_kit())
    return item if item is not None else _describe_tensor(leaf)


def describe_all(leaves: Sequence[Leaf]) -> list[ArrayItem]:
    """``describe`` of every leaf, in order (a save's prepare step): the items its flatten made
    (``plain_describer``) as they are; of the rest, plain contiguous CPU tensors in one loop of a few
    attribute reads a tensor."""
    items = [leaf.item for leaf in leaves]
    if None not in items:
        return items
    kit = _plain_kit() if any(leaf.kind == "torch" for leaf in leaves) else None
    out: list[ArrayItem] = []
    for leaf, item in zip(leaves, items):
        if item is None and kit is not None and leaf.kind == "torch":
            item = _describe_plain(leaf, kit)
        out.append(item if item is not None else describe(leaf))
    return out


def plain_describer() -> Any:
    """The describer a save's flatten takes (``tree.encode.walk``): the item ``_describe_plain`` makes
    of a leaf, from what the flatten has read already (a strided CPU tensor with elements and neither
    conjugate nor negative bit, its shape, dtype and ``data_ptr``), so that only the contiguity, the size
    and the byte view are read anew; None for a tensor the general path describes (issue 23)."""
    plain, _strided, names = _plain_kit()
    array_types: dict[int, Any] = {}  # nbytes -> its ctypes array type (making one costs 0.15 us)

    def item(name: str, t: Any, shape: Any, dtype: Any, ptr: int) -> ArrayItem | None:
        dtype_name = names.get(dtype)
        if dtype_name is None or type(t) not in plain or not t.is_contiguous():
            return None
        nbytes = t.nbytes
        kind = array_types.get(nbytes)
        if kind is None:
            kind = array_types[nbytes] = ctypes.c_ubyte * nbytes
        return ArrayItem(name, "torch", dtype_name, tuple(shape), nbytes, _view_at(kind, ptr, t))

    return item


def _describe_numpy(leaf: Leaf) -> ArrayItem:
    import numpy as np

    a = np.ascontiguousarray(leaf.obj)
    view = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
    # The shape of the leaf, not of ``a``: ascontiguousarray returns ndim >= 1, so a 0-d array
    # would come back from a load with shape (1,).
    return ArrayItem(leaf.name, "numpy", a.dtype.str, tuple(np.shape(leaf.obj)), a.nbytes, view)


def _describe_tensor(leaf: Leaf) -> ArrayItem:
    """The general case: any tensor, copied to contiguous CPU memory first where it is not there."""
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


#: (the plain tensor types, torch.strided, {torch dtype: name} of the dtypes ckptstore stores), once
#: torch is imported: what ``_describe_plain`` tests a tensor against.
_PLAIN_KIT: tuple[frozenset[type], Any, dict[Any, str]] | None = None


def _plain_kit() -> tuple[frozenset[type], Any, dict[Any, str]]:
    global _PLAIN_KIT
    if _PLAIN_KIT is None:
        import torch

        dtypes = {getattr(torch, n, None) for n in TORCH_DTYPES}
        names = {d: torch_dtype_name(d) for d in dtypes if isinstance(d, torch.dtype)}
        _PLAIN_KIT = (frozenset({torch.Tensor, torch.nn.Parameter}), torch.strided,
                      {d: n for d, n in names.items() if n in TORCH_DTYPES})
    return _PLAIN_KIT


def _describe_plain(leaf: Leaf, kit: tuple[frozenset[type], Any, dict[Any, str]]) -> ArrayItem | None:
    """The item of a plain tensor (``torch.Tensor`` or ``Parameter``, not a subclass, whose memory may
    not be its data) that is contiguous CPU memory with no conj or neg bit and a dtype ckptstore
    stores; None for every other tensor, which ``_describe_tensor`` handles (or refuses). The same
    item as that one, from four cheap checks and a byte view over the tensor's own memory (issue 23:
    the general path's eight torch calls and three views cost 9 us a tensor, 40,000 small tensors'
    save spent 0.4 s here)."""
    t = leaf.obj
    plain, strided, names = kit
    if (type(t) not in plain or not t.is_cpu or t.layout is not strided or not t.is_contiguous()
            or t.is_conj() or t.is_neg()):
        return None
    name = names.get(t.dtype)
    if name is None:
        return None
    nbytes = t.nbytes
    view = _memory_of(t, nbytes) if nbytes else memoryview(b"")
    return ArrayItem(leaf.name, "torch", name, tuple(t.shape), nbytes, view)


def _memory_of(t: Any, nbytes: int) -> memoryview:
    """A writable flat byte view of the ``nbytes`` at ``t.data_ptr()`` (contiguous) that keeps ``t``
    alive: the view holds the ctypes array it exports, the array holds ``t``, so no slice of the view
    can outlive the memory (half the cost of ``t.reshape(-1).view(torch.uint8).numpy()``)."""
    return _view_at(ctypes.c_ubyte * nbytes, t.data_ptr(), t)


def _view_at(kind: Any, ptr: int, owner: Any) -> memoryview:
    """A byte view of the ctypes array type ``kind`` at address ``ptr``, keeping ``owner`` alive."""
    array = kind.from_address(ptr)
    array.owner = owner
    return memoryview(array).cast("B")


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
    t = torch.empty(shape, dtype=tdtype, device="cpu")  # CPU memory whatever the default device
    if not nbytes:
        return t, memoryview(b"")
    if type(t) is not torch.Tensor or not t.is_cpu or t.nbytes != nbytes:
        raise ValueError(f"torch.empty returned a {type(t).__name__} of {t.nbytes} bytes on {t.device}, not "
                         f"{nbytes} bytes of CPU memory")
    # A byte view of the fresh tensor's own memory (not ``.numpy()``, which makes its storage
    # unresizable: a load's tensors resize like any fresh tensor, docs/design.md "A load's tensors").
    return t, _memory_of(t, nbytes)


def arrays_from(records: Sequence[Any], data: memoryview, starts: Sequence[int]) -> list[Any]:
    """Fresh arrays for ``records`` (anything with ``kind``, ``dtype``, ``shape``, ``nbytes``), each
    holding the bytes ``data[start:start + nbytes]`` in memory of its own: what a load of many small
    arrays read in one piece returns (issue 23). ``data`` must be writable (its address is taken).

    A tensor is ``torch.empty`` and one ``memmove`` of its bytes: a storage of its own, resizable, as
    ``torch.load`` returns it (docs/design.md, "A load's tensors"), both calls made from C (``starmap``,
    ``map``) for a whole run. The copy writes raw memory, so what makes it safe is checked first, for
    every tensor before any byte is copied: every span lies inside ``data``, every size is its shape
    times its dtype's item size, and each tensor is a plain CPU tensor of that size (allocated on "cpu"
    whatever the default device or mode). Raises ValueError when a check fails, TypeError or
    AttributeError when this torch or numpy lacks a dtype."""
    if not records:
        return []
    kinds, dtypes, shapes, sizes = (list(map(attrgetter(f), records)) for f in ("kind", "dtype", "shape", "nbytes"))
    if min(starts) < 0 or max(map(operator.add, starts, sizes)) > len(data):
        raise ValueError("an array's bytes lie outside the buffer")
    if data.readonly:
        data = memoryview(bytearray(data))
    if set(kinds) != {"torch"}:
        return _mixed_from(kinds, dtypes, shapes, sizes, data, starts)
    import torch

    by_name = {d: _torch_dtype(torch, d) for d in set(dtypes)}
    tdtypes = list(map(by_name.__getitem__, dtypes))
    if sizes != list(map(operator.mul, map(math.prod, shapes), map(attrgetter("itemsize"), tdtypes))):
        raise ValueError("an array's size is not its shape times its item size")
    out = _empties(torch, shapes, dtypes, by_name)
    # Every tensor is checked before any byte is written (a mode's tensor, fake or elsewhere, gets no raw
    # copy); its size too: a mode could hand back a smaller CPU tensor, and the copy trusts ``nbytes``.
    if (set(map(type, out)) != {torch.Tensor} or not all(map(attrgetter("is_cpu"), out))
            or list(map(attrgetter("nbytes"), out)) != sizes):
        bad = next(t for t, n in zip(out, sizes) if type(t) is not torch.Tensor or not t.is_cpu or t.nbytes != n)
        raise ValueError(f"torch.empty returned a {type(bad).__name__} of {bad.nbytes} bytes on {bad.device}, "
                         "not a CPU tensor of its record's size")
    if len(data):
        base = ctypes.addressof(ctypes.c_char.from_buffer(data))
        full = list(map(bool, sizes))  # an empty tensor may have no memory (data_ptr 0): nothing to copy
        # One memmove a tensor, called from C (``map``): a Python loop of the same calls cost 0.5 us a tensor
        # more. (A clone of each row of one view of the run's bytes saved 0.1 us more: not worth a second path.)
        collections.deque(map(ctypes.memmove, map(torch.Tensor.data_ptr, compress(out, full)),
                              map(operator.add, repeat(base), compress(starts, full)), compress(sizes, full)), 0)
    return out


def _empties(torch: Any, shapes: list[list[int]], dtypes: list[str], by_name: dict[str, Any]) -> list[Any]:
    """``torch.empty(shape, dtype=..., device="cpu")`` for each record, called from C (``starmap``) with the
    sizes as separate ints: a list argument cost 0.7 us a tensor to parse, the Python loop as much again."""
    args = shapes if all(shapes) else [s or [()] for s in shapes]  # a 0-d tensor: empty(())
    cpu = torch.device("cpu")  # CPU memory whatever the default device
    if len(by_name) == 1:
        return list(starmap(functools.partial(torch.empty, dtype=by_name[dtypes[0]], device=cpu), args))
    makers = {d: functools.partial(torch.empty, dtype=td, device=cpu) for d, td in by_name.items()}
    return [makers[d](*a) for d, a in zip(dtypes, args)]


def _mixed_from(kinds: list[str], dtypes: list[str], shapes: list[list[int]], sizes: list[int], data: memoryview,
                starts: Sequence[int]) -> list[Any]:
    """``arrays_from`` of a run holding numpy arrays too: the tensors as there, the arrays by ``empty_for``
    and a copy through its view, in the records' order."""
    tensors = iter(arrays_from([_Spec("torch", d, s, n) for k, d, s, n in zip(kinds, dtypes, shapes, sizes)
                                if k == "torch"], data, [a for k, a in zip(kinds, starts) if k == "torch"]))
    out = []
    for kind, dtype, shape, n, a in zip(kinds, dtypes, shapes, sizes, starts):
        if kind == "torch":
            out.append(next(tensors))
            continue
        obj, view = empty_for(kind, dtype, shape, n)
        view[:] = data[a : a + n]
        out.append(obj)
    return out


class _Spec(NamedTuple):
    kind: str
    dtype: str
    shape: list[int]
    nbytes: int


def _torch_dtype(torch: Any, name: str) -> Any:
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"torch.{name} is not a dtype")
    return dtype


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
