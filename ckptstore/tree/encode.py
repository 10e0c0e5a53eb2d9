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
from typing import Any

from ..errors import UnsupportedValue
from ..values import encode, why_refused
from .decode import plain_shape
from .dtensor import dtensor_layout
from .nodes import MAX_DEPTH, Leaf, key_path, leaf_names
from .views import share_storages

MAX_NAME = 4000  # array names (key paths) stay below the manifest's 4096-character bound
MAX_LISTED = 20  # refused values named in one UnsupportedValue; the rest are counted


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


def _key_path(path: tuple[Any, ...]) -> str:
    """``nodes.key_path`` (the same string) at half the cost: most keys need no escaping, and a str
    key is its own ``str``. Every leaf of a state is named through it."""
    parts = []
    for k in path:
        s = k if type(k) is str else str(k)
        if "~" in s or "/" in s:
            s = s.replace("~", "~0").replace("/", "~1")
        parts.append(s)
    return "/".join(parts) or "<root>"


class Flattener:
    """One ``flatten`` walk: the leaves and names so far, the identities that make a shared tensor one
    leaf, and the DTensor layouts already computed; ``node`` encodes one value."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        # The name of each "tensor" and each "ndarray" node made, in tree order (before share_storages
        # renames merged views): how ``layoutcache`` maps a state's tensors to its leaves.
        self.tensor_names: list[str] = []
        self.array_names: list[str] = []
        self.names: set[str] = set()
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

    def _name(self, path: tuple[Any, ...]) -> str:
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
        if type(value) in (dict, collections.OrderedDict):
            items = []
            for k, v in value.items():
                if type(k) is str:
                    items.append({"k": k, "v": self.node(v, path + (k,))})
                elif type(k) is int and k.bit_length() <= MAX_JSON_INT_BITS:
                    items.append({"ik": k, "v": self.node(v, path + (k,))})
                elif type(k) is int:
                    self.refuse(path, f"a dict key is an int wider than {MAX_JSON_INT_BITS} bits; use a str key")
                else:
                    self.refuse(path, f"dict key {repr(k)[:60]} is a {type(k).__name__}; keys must be str or int")
            return {"t": "dict", "ordered": type(value) is collections.OrderedDict, "items": items}
        if type(value) in (list, tuple):
            kind = "list" if type(value) is list else "tuple"
            return {"t": kind, "items": [self.node(v, path + (i,)) for i, v in enumerate(value)]}
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

    def _fallback(self, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if not self.allow_pickle:
            return self.refuse(path, why_refused(value))
        return {"t": "pickle", "v": base64.b64encode(pickle.dumps(value, protocol=5)).decode()}

    def _tensor(self, t: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        # Each attribute of a tensor costs 0.15-0.5 us, so each is read once (issue 23). A sparse tensor
        # has a sparse layout, so the layout check covers is_sparse too.
        if t.layout != self.strided or t.is_quantized or t.is_nested:
            return self._fallback(t, path)
        device = t.device
        devtype = self.devtypes.get(device)
        if devtype is None:
            devtype = self.devtypes[device] = device.type
        if devtype == "meta":
            return self._fallback(t, path)
        shape, dtype = t.shape, t.dtype
        # The identity of a tensor: its storage (by address: data_ptr less the offset, the same number as
        # ``untyped_storage().data_ptr()`` at a third of the cost), offset, shape, stride, dtype, device.
        # Zero-size tensors have none (each is its own leaf), and neither has a conjugate or negative view:
        # its bytes are its base's with a lazy bit, so as a view of a shared storage (or tied to its base)
        # it would load as its base; as its own leaf it is written resolved (``describe``, the batched copy).
        if 0 in shape or t.is_conj() or t.is_neg():
            key = None
        else:
            offset = t.storage_offset()
            key = (t.data_ptr() - offset * dtype.itemsize, offset, shape, t.stride(), dtype, devtype)
        node: dict[str, Any] = {"t": "tensor"}
        # ``isinstance(t, Parameter)`` costs ~0.3 us through Parameter's metaclass: a plain tensor skips it.
        if type(t) is not self.tensor_type and isinstance(t, self.param_type):
            node["param"] = True
            node["requires_grad"] = bool(t.requires_grad)
        elif t.requires_grad:
            node["requires_grad"] = True  # a plain tensor's flag (issue 10, item 14); absent means False
        if key is not None:
            name = self.by_identity.get(key)
            if name is not None:
                node["name"] = name
                self.tensor_names.append(name)
                return node
        name = self._name(path)
        leaf = Leaf(name, "torch", t)
        if key is not None:
            self.by_identity[key] = name
            skey = (key[0], devtype)
            first = self.by_storage.setdefault(skey, leaf)
            if first is not leaf:
                self.shared.setdefault(skey, [first]).append(leaf)
        self.leaves.append(leaf)
        self.tensor_names.append(name)
        node["name"] = name
        return node

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


def walk(state: Any, allow_pickle: bool) -> Flattener:
    """One ``flatten`` walk, with what it found on the way (``layoutcache`` reads the storage groups)."""
    f = Flattener(allow_pickle)
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

