"""The save side of the tree: ``flatten`` walks a state and returns its JSON tree plus the array leaves,
each named by its key path (the module docstring of ``ckptstore.tree`` lists what a state may hold).
Values it cannot store are collected, and one UnsupportedValue lists them all with their key paths and
why. Floats are stored as ``float.hex`` so they round-trip bit-exactly (nan payloads and -0.0 included).

torch is never imported here: a state can only hold tensors if its caller imported torch already, so
``sys.modules`` tells whether to look for them (and DTensors only when torch.distributed.tensor is
loaded). Split out of tree.py (issue 20).
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import struct
import sys
from typing import Any, Callable

from ..errors import UnsupportedValue
from ..format import TORCH_DTYPES
from ..values import encode, why_refused
from .decode import plain_shape
from .dtensor import dtensor_layout
from .nodes import MAX_DEPTH, Leaf, key_path, leaf_names
from .views import share_storages

MAX_NAME = 4000  # array names (key paths) stay below the manifest's 4096-character bound
MAX_LISTED = 20  # refused values named in one UnsupportedValue; the rest are counted
#: ``walk``'s describer: (name, tensor, shape, dtype, data_ptr) -> the leaf's item, or None.
Describer = Callable[[str, Any, Any, Any, int], Any]


def _float_node(v: float) -> dict[str, Any]:
    return {"t": "float", "v": v.hex() if math.isfinite(v) else _special(v)}


#: Ints wider than this are stored as hex strings. CPython converts at most 4300 decimal digits by
#: default (sys.set_int_max_str_digits): a longer JSON number makes the manifest unwritable, or, from
#: a process that raised the limit, a committed cut that no default process can parse. 8192 bits is
#: about 2466 digits; hex conversion has no limit.
MAX_JSON_INT_BITS = 8192


def _int_node(v: int) -> dict[str, Any]:
    if v.bit_length() > MAX_JSON_INT_BITS:
        return {"t": "int", "hex": hex(v)}
    return {"t": "int", "v": v}


def _special(v: float) -> str:
    return "bits:" + struct.pack("<d", v).hex()


def _part(k: Any) -> str:
    """One key of a key path, escaped as ``nodes.key_path`` escapes it (most keys need nothing)."""
    s = k if type(k) is str else str(k)
    if "~" in s or "/" in s:
        s = s.replace("~", "~0").replace("/", "~1")
    return s


def _joined(path: tuple[Any, ...]) -> str:
    return "/".join(map(_part, path))


def _key_path(path: tuple[Any, ...]) -> str:
    """``nodes.key_path`` (the same string) at half the cost: most keys need no escaping, and a str
    key is its own ``str``."""
    return _joined(path) or "<root>"


def _identity(t: Any, skey: tuple[int, str]) -> tuple[Any, ...]:
    """What makes two tensors over one storage (``skey``: its address and device type) one array."""
    return (skey[0], t.storage_offset(), t.shape, t.stride(), t.dtype, skey[1])


class Flattener:
    """One ``flatten`` walk: the leaves and names so far, the identities that make a shared tensor one
    leaf, and the DTensor layouts already computed; ``node`` encodes one value."""

    def __init__(self, allow_pickle: bool, describer: Describer | None = None) -> None:
        self.allow_pickle = allow_pickle
        # A save's flatten describes each plain leaf as it meets it (``Leaf.item``), from the attributes
        # read here anyway (issue 23: describing again read ten of them a second time).
        self.describer = describer
        self.leaves: list[Leaf] = []
        # The name of each "tensor" and each "ndarray" node made, in tree order (before share_storages
        # renames merged views): how ``layoutcache`` maps a state's tensors to its leaves.
        self.tensor_names: list[str] = []
        self.array_names: list[str] = []
        self.names: set[str] = set()
        # ``_identity`` -> the leaf name, for the tensors over a storage that holds more than one (``_tied``),
        # and the DTensor local shards.
        self.by_identity: dict[tuple[Any, ...], str] = {}
        # (storage data_ptr, device type) -> the first torch leaf over that storage; a second distinct view
        # of it starts a group in ``shared`` (see share_storages). One dict lookup a tensor: the common
        # state of distinct tensors pays nothing more.
        self.by_storage: dict[tuple[int, str], Leaf] = {}
        self.shared: dict[tuple[int, str], list[Leaf]] = {}
        self.torch = torch = sys.modules.get("torch")
        self.np = sys.modules.get("numpy")
        # Looked up once a walk, not once a tensor (issue 23: 40,000 tensors at a few us each).
        self.tensor_type = torch.Tensor if torch is not None else None
        self.param_type = torch.nn.Parameter if torch is not None else None
        self.strided = torch.strided if torch is not None else None
        self.stored_dtypes = frozenset(getattr(torch, n) for n in TORCH_DTYPES if hasattr(torch, n)) \
            if torch is not None else frozenset()
        self.devtypes: dict[Any, str] = {}  # torch.device -> its type ("cuda"): ``device.type`` costs ~0.4 us
        # DTensor only if the caller loaded torch.distributed.tensor (a state cannot hold one otherwise).
        self.dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        # (global shape, stride, id(mesh), placements) -> layout; computing one costs ~100 us and an FSDP2 state
        # repeats the same few layouts (exp_avg and exp_avg_sq share their parameter's).
        self.layouts: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.meshes: dict[int, dict[str, Any]] = {}  # id(mesh) -> its JSON (the meshes live while we run)
        # (key path, why) of every value refused: one error names them all (issue 13), not the first only.
        self.refused: list[tuple[str, str]] = []
        self.tree: dict[str, Any] = {}  # set once the walk is over

    def refuse(self, path: tuple[Any, ...], why: str) -> dict[str, Any]:
        """Records a value that cannot be stored; its placeholder node is never written (flatten raises)."""
        self.refused.append((key_path(path), why))
        return {"t": "none"}

    def plain(self, node: dict[str, Any]) -> Any:
        """What verify's check mode decodes ``node`` to (the plain shape, torch values as None)."""
        return plain_shape(node)

    def holds_arrays(self, node: dict[str, Any]) -> bool:
        return bool(leaf_names(node))

    def _name(self, path: tuple[Any, ...], base: str | None = None) -> str:
        """The leaf name of ``path``: its key path (``base``, when the caller built it from its
        container's prefix), made unique with a ``~~n`` suffix."""
        if base is None:
            base = _key_path(path)
        if len(base) > MAX_NAME:
            raise UnsupportedValue(f"key path {base[:80]!r}... is {len(base)} characters; the limit is {MAX_NAME}")
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}~~{n}"
        self.names.add(name)
        return name

    def node(self, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if len(path) > MAX_DEPTH:
            raise UnsupportedValue(f"state is nested deeper than {MAX_DEPTH} levels at {key_path(path)!r}")
        typ = type(value)
        if typ is self.tensor_type:  # the common leaf first: a plain tensor is no DTensor, no bool
            return self._tensor(value, path)
        # Exact scalar types before the isinstance checks below, which none of them passes (an optimizer's
        # param_groups list every parameter's int id).
        if typ is int:
            return _int_node(value)
        if typ is float:
            return _float_node(value)
        if typ is str:
            return {"t": "str", "v": value}
        if typ is dict or typ is collections.OrderedDict:
            return self._dict(value, path)
        if typ is list or typ is tuple:
            return self._seq(value, path)
        torch, np = self.torch, self.np
        if value is None:
            return {"t": "none"}
        if isinstance(value, bool):
            return {"t": "bool", "v": value}
        # Before the Tensor branch: a DTensor is a Tensor subclass whose storage cannot be touched.
        if self.dtensor is not None and isinstance(value, self.dtensor):
            return self._dtensor(value, path)
        if torch is not None and isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if np is not None and isinstance(value, np.ndarray):
            return self._ndarray(value, path)
        if np is not None and isinstance(value, np.generic):
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                return self._fallback(value, path)
            return {"t": "npscalar", "dtype": arr.dtype.str, "v": base64.b64encode(arr.tobytes()).decode()}
        if type(value) is int:
            return _int_node(value)
        if type(value) is float:
            return _float_node(value)
        if type(value) is complex:
            return {"t": "complex", "re": _float_node(value.real)["v"], "im": _float_node(value.imag)["v"]}
        if type(value) is str:
            return {"t": "str", "v": value}
        if type(value) in (bytes, bytearray):
            return {"t": "bytes", "v": base64.b64encode(value).decode(), "mutable": type(value) is bytearray}
        if torch is not None and isinstance(value, torch.Size):
            return {"t": "size", "v": list(value)}
        if torch is not None and isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if torch is not None and isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        # Issue 13: paths, enums, dataclasses, ... After every fast branch, so a tensor or a dict pays
        # nothing for them.
        node = encode(self, value, path)
        return node if node is not None else self._fallback(value, path)

    def _prefix(self, path: tuple[Any, ...]) -> str | None:
        """The key path of ``path`` plus "/", the start of its children's names (issue 23: joining each
        leaf's whole path again cost ~1 us a tensor); None where its children are too deep to store
        (``node`` raises for them)."""
        if len(path) >= MAX_DEPTH:
            return None
        return _joined(path) + "/" if path else ""

    def _dict(self, value: dict[Any, Any], path: tuple[Any, ...]) -> dict[str, Any]:
        """A "dict" node: each item's key is a str ("k") or an int ("ik"); any other key is refused."""
        items = []
        tensor, prefix = self.tensor_type, self._prefix(path)
        for k, v in value.items():
            if type(k) is str:
                field = "k"
            elif type(k) is int and k.bit_length() <= MAX_JSON_INT_BITS:
                field = "ik"
            elif type(k) is int:
                self.refuse(path, f"a dict key is an int wider than {MAX_JSON_INT_BITS} bits; use a str key")
                continue
            else:
                self.refuse(path, f"dict key {repr(k)[:60]} is a {type(k).__name__}; keys must be str or int")
                continue
            if type(v) is tensor and prefix is not None:
                node = self._tensor(v, path + (k,), prefix + _part(k) or "<root>")
            else:
                node = self.node(v, path + (k,))
            items.append({field: k, "v": node})
        return {"t": "dict", "ordered": type(value) is collections.OrderedDict, "items": items}

    def _seq(self, value: list[Any] | tuple[Any, ...], path: tuple[Any, ...]) -> dict[str, Any]:
        """A "list" or "tuple" node. A sequence of JSON-sized ints (an optimizer's param_groups list
        every parameter id) is encoded in one comprehension, after C-level checks of its items."""
        kind = "list" if type(value) is list else "tuple"
        prefix = self._prefix(path)
        if prefix is None:
            return {"t": kind, "items": [self.node(v, path + (i,)) for i, v in enumerate(value)]}
        if value and set(map(type, value)) == {int} and max(map(int.bit_length, value)) <= MAX_JSON_INT_BITS:
            return {"t": kind, "items": [{"t": "int", "v": v} for v in value]}
        tensor, items = self.tensor_type, []
        for i, v in enumerate(value):
            if type(v) is tensor:
                items.append(self._tensor(v, path + (i,), f"{prefix}{i}"))
            else:
                items.append(self.node(v, path + (i,)))
        return {"t": kind, "items": items}

    def _fallback(self, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if not self.allow_pickle:
            return self.refuse(path, why_refused(value))
        return {"t": "pickle", "v": base64.b64encode(pickle.dumps(value, protocol=5)).decode()}

    def _tensor(self, t: Any, path: tuple[Any, ...], base: str | None = None) -> dict[str, Any]:
        """A "tensor" node and, unless ``t`` is a tensor met before (tied), its leaf (``base``: the
        leaf's key path, when the caller built it)."""
        # Each attribute of a tensor costs 0.07-0.25 us, so each is read once (issue 23). A sparse tensor
        # has a sparse layout, so the layout check covers is_sparse too; a quantized one has a quantized
        # dtype, none of which ckptstore stores, so only those dtypes ask ``is_quantized``.
        dtype = t.dtype
        if (t.layout is not self.strided or t.is_nested
                or (dtype not in self.stored_dtypes and t.is_quantized)):
            return self._fallback(t, path)
        device = t.device
        devtype = self.devtypes.get(device)
        if devtype is None:
            devtype = self.devtypes[device] = device.type
        if devtype == "meta":
            return self._fallback(t, path)
        shape = t.shape
        # The storage of a tensor, by address (data_ptr less the offset: the same number as
        # ``untyped_storage().data_ptr()`` at a third of the cost) and device type. Zero-size tensors
        # have none (each is its own leaf), and neither has a conjugate or negative view: its bytes are
        # its base's with a lazy bit, so as a view of a shared storage (or tied to its base) it would
        # load as its base; as its own leaf it is written resolved (``describe``, the batched copy).
        if 0 in shape or t.is_conj() or t.is_neg():
            skey = None
        else:
            offset, ptr = t.storage_offset(), t.data_ptr()
            skey = (ptr - offset * dtype.itemsize, devtype)
        node: dict[str, Any] = {"t": "tensor"}
        # ``isinstance(t, Parameter)`` costs ~0.3 us through Parameter's metaclass: a plain tensor skips it.
        if type(t) is not self.tensor_type and isinstance(t, self.param_type):
            node["param"] = True
            node["requires_grad"] = bool(t.requires_grad)
        elif t.requires_grad:
            node["requires_grad"] = True  # a plain tensor's flag (issue 10, item 14); absent means False
        first = self.by_storage.get(skey) if skey is not None else None
        if first is not None:
            name = self._tied(t, first, skey)  # type: ignore[arg-type]
            if name is not None:
                node["name"] = name
                self.tensor_names.append(name)
                return node
        name = self._name(path, base)
        leaf = Leaf(name, "torch", t)
        if skey is not None:
            if first is None:
                self.by_storage[skey] = leaf
            else:
                self.by_identity[_identity(t, skey)] = name
                self.shared.setdefault(skey, [first]).append(leaf)
            if self.describer is not None and devtype == "cpu":
                leaf.item = self.describer(name, t, shape, dtype, ptr)
        self.leaves.append(leaf)
        self.tensor_names.append(name)
        node["name"] = name
        return node

    def _tied(self, t: Any, first: Leaf, skey: tuple[int, str]) -> str | None:
        """The name of the leaf ``t`` is tied to (the same storage, offset, shape, stride and dtype:
        one array), or None, for a tensor over the storage of ``first``, the first leaf over it. A
        storage's identities are recorded only once a second tensor over it is met (issue 23: a state
        of distinct tensors pays one dict lookup a tensor)."""
        self.by_identity.setdefault(_identity(first.obj, skey), first.name)
        return self.by_identity.get(_identity(t, skey))

    def _dtensor(self, dt: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        """A "dtensor" node: the layout of ``dt`` plus the name of its local shard, stored as an
        ordinary torch leaf (so shards, hashing and the writer's capture handle it like any tensor)."""
        torch = self.torch
        local = dt.to_local().detach()  # flatten runs this under no_grad: no autograd node
        if local.is_sparse or local.layout != torch.strided or local.is_quantized or local.device.type == "meta":
            raise UnsupportedValue(
                f"DTensor at key {key_path(path)!r} has a {local.layout} {local.device.type} local shard "
                f"(quantized={local.is_quantized}); ckptstore stores dense local shards only (materialize it first)"
            )
        layout = self._layout(dt, path)
        if layout["local_shape"] != list(local.shape):
            raise UnsupportedValue(
                f"DTensor at key {key_path(path)!r} has a local shard of shape {list(local.shape)}, but its "
                f"placements {layout['placements']} on mesh {layout['mesh']['shape']} give "
                f"{layout['local_shape']} on this rank; only DTensors sharded the way torch chunks them (what DCP "
                "can also save) can be stored"
            )
        key = (("dtensor", local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
                tuple(local.stride()), local.dtype, local.device.type) if local.numel() else None)
        if key is not None and key in self.by_identity:
            name = self.by_identity[key]
        else:
            name = self._name(path)
            if key is not None:
                self.by_identity[key] = name
            self.leaves.append(Leaf(name, "torch", local))
        node: dict[str, Any] = {
            "t": "dtensor",
            "name": name,
            "global_shape": list(layout["global_shape"]),
            "global_stride": list(layout["global_stride"]),
            "offsets": list(layout["offsets"]),
            "local_shape": list(layout["local_shape"]),
            "placements": [dict(p) for p in layout["placements"]],
            "mesh": layout["mesh"],  # shared by the nodes of one mesh (read-only JSON; can be large)
        }
        if isinstance(dt, torch.nn.Parameter):
            node["param"] = True
            node["requires_grad"] = bool(dt.requires_grad)
        return node

    def _layout(self, dt: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        mesh = dt.device_mesh
        cache_key = (tuple(dt.shape), tuple(dt.stride()), id(mesh), tuple(dt.placements))
        layout = self.layouts.get(cache_key)
        if layout is None:
            layout = dtensor_layout(dt, what=f"key {key_path(path)!r}", mesh_json=self.meshes.get(id(mesh)))
            self.layouts[cache_key] = layout
            self.meshes[id(mesh)] = layout["mesh"]
        return layout

    def _ndarray(self, a: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if a.dtype.hasobject or a.dtype.fields is not None or a.dtype.kind not in "biufcmM":
            return self._fallback(a, path)
        name = self._name(path)
        self.leaves.append(Leaf(name, "numpy", a))
        self.array_names.append(name)
        return {"t": "ndarray", "name": name}


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[dict[str, Any], list[Leaf]]:
    """The JSON tree of ``state`` and its array leaves, in a stable order."""
    f = walk(state, allow_pickle)
    return f.tree, f.leaves


def walk(state: Any, allow_pickle: bool, describer: Describer | None = None) -> Flattener:
    """One ``flatten`` walk, with what it found on the way (``layoutcache`` reads the storage groups).
    ``describer`` (a save's): called as ``describer(name, tensor, shape, dtype, data_ptr)`` for each new
    leaf that is a strided CPU tensor with elements and neither a conjugate nor a negative bit; what it
    returns (an ``arrays.ArrayItem``, or None for "describe it later") becomes the leaf's ``item``."""
    f = Flattener(allow_pickle, describer)
    if f.dtensor is not None:
        # DTensor.to_local without an autograd node: ~5 us a DTensor instead of ~18. One context for
        # the whole walk (entering it per DTensor cost as much as it saved).
        with f.torch.no_grad():  # type: ignore[union-attr]
            tree = f.node(state, ())
    else:
        tree = f.node(state, ())
    if f.refused:
        raise UnsupportedValue(refusal_message(f.refused))
    if f.shared:
        share_storages(tree, f.leaves, f.shared)
    f.tree = tree
    return f


def refusal_message(refused: list[tuple[str, str]]) -> str:
    """One message naming every refused value (the first MAX_LISTED, then a count) with its key path."""
    lines = [f"  {key!r}: {why}" for key, why in refused[:MAX_LISTED]]
    if len(refused) > MAX_LISTED:
        lines.append(f"  ... and {len(refused) - MAX_LISTED} more")
    return (f"cannot store {len(refused)} value{'s' if len(refused) > 1 else ''} without pickle:\n" + "\n".join(lines)
            + "\nconvert them to tensors, dicts, lists or scalars, or pass allow_pickle=True for values pickle "
            "can store (loading then needs allow_pickle=True too)")

