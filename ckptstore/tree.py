"""The typed JSON tree of a state: what ``save`` stores instead of a pickle.

``flatten`` walks a state (dicts with str or int keys, lists, tuples, tensors, DTensors, numpy arrays,
python scalars, str, bytes, None, and the values of ``values.py``: paths, enums, dataclasses,
namedtuples, Namespaces, datetimes, sets, OmegaConf containers, classes) and returns a JSON tree plus
the list of array leaves, each named by its key path. Values it cannot store are collected, and one
UnsupportedValue lists them all with their key paths and why. ``unflatten`` rebuilds the same
structure with the same types. Every node is an object with a ``t`` kind; unknown kinds are refused on
load. Floats are stored as ``float.hex`` so they
round-trip bit-exactly (nan payloads and -0.0 included).

A ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel) is stored as its rank's local shard (an
ordinary torch leaf) plus a "dtensor" node recording the layout: global shape and stride, the shard's
offsets and local shape (as DCP computes them), placements and mesh. A reader has no device mesh, so
the node loads back as the plain local tensor; ``ckptstore.dtensors.rewrap`` puts it back into a live
DTensor.

torch is never imported here: a state can only hold tensors if its caller imported torch already, so
``sys.modules`` tells whether to look for them (and DTensors only when torch.distributed.tensor is
loaded).
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import CkptStoreError, CorruptCut, HostileInput, UnsupportedValue
from .format import TORCH_DTYPE_NAMES, check_device, numpy_itemsize
from .values import VALUE_KINDS, allowed_map, decode, encode, why_refused

MAX_DEPTH = 200
MAX_NAME = 4000  # array names (key paths) stay below the manifest's 4096-character bound
MAX_LISTED = 20  # refused values named in one UnsupportedValue; the rest are counted


@dataclass
class Leaf:
    """An array leaf of the state: ``kind`` is "torch" or "numpy"; ``obj`` the tensor or array."""

    name: str
    kind: str
    obj: Any


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _key_path(path: tuple[Any, ...]) -> str:
    return "/".join(_escape(str(k)) for k in path) or "<root>"


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


_FLOAT_BITS = re.compile(r"bits:[0-9a-f]{16}")


def _float_value(s: Any) -> float:
    """The float a node stores: ``float.hex`` text, or ``bits:`` and the 16 hex digits of its 8 bytes.
    ValueError for anything else (an int, odd bits, an exponent that overflows)."""
    if type(s) is not str:
        raise ValueError(f"a float is stored as text, not a {type(s).__name__}")
    if s.startswith("bits:"):
        if not _FLOAT_BITS.fullmatch(s):
            raise ValueError(f"float bits {s[:40]!r} are not 16 hex digits")
        return struct.unpack("<d", bytes.fromhex(s[5:]))[0]
    try:
        return float.fromhex(s)
    except OverflowError:
        raise ValueError(f"float {s[:40]!r} overflows") from None


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        self.names: set[str] = set()
        self.by_identity: dict[tuple[Any, ...], str] = {}
        # (storage data_ptr, device type) -> the first torch leaf over that storage; a second distinct view
        # of it starts a group in ``shared`` (see share_storages). One dict lookup a tensor: the common
        # state of distinct tensors pays nothing more.
        self.by_storage: dict[tuple[int, str], Leaf] = {}
        self.shared: dict[tuple[int, str], list[Leaf]] = {}
        self.torch = sys.modules.get("torch")
        self.np = sys.modules.get("numpy")
        # DTensor only if the caller loaded torch.distributed.tensor (a state cannot hold one otherwise).
        self.dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        # (global shape, stride, id(mesh), placements) -> layout; computing one costs ~100 us and an FSDP2 state
        # repeats the same few layouts (exp_avg and exp_avg_sq share their parameter's).
        self.layouts: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.meshes: dict[int, dict[str, Any]] = {}  # id(mesh) -> its JSON (the meshes live while we run)
        # (key path, why) of every value refused: one error names them all (issue 13), not the first only.
        self.refused: list[tuple[str, str]] = []

    def refuse(self, path: tuple[Any, ...], why: str) -> dict[str, Any]:
        """Records a value that cannot be stored; its placeholder node is never written (flatten raises)."""
        self.refused.append((_key_path(path), why))
        return {"t": "none"}

    def plain(self, node: dict[str, Any]) -> Any:
        """What verify's check mode decodes ``node`` to (the plain shape, torch values as None)."""
        return _Builder(lambda name, n: None, True, {}, materialize=False).build(node)

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
            raise UnsupportedValue(f"state is nested deeper than {MAX_DEPTH} levels at {_key_path(path)!r}")
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
        torch = self.torch
        if t.is_sparse or t.layout != torch.strided:
            return self._fallback(t, path)
        if t.is_quantized or t.device.type == "meta" or t.is_nested:
            return self._fallback(t, path)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t.device.type) if t.numel() else None
        node: dict[str, Any] = {"t": "tensor"}
        if isinstance(t, torch.nn.Parameter):
            node["param"] = True
            node["requires_grad"] = bool(t.requires_grad)
        elif t.requires_grad:
            node["requires_grad"] = True  # a plain tensor's flag (issue 10, item 14); absent means False
        if key is not None and key in self.by_identity:
            node["name"] = self.by_identity[key]
            return node
        name = self._name(path)
        leaf = Leaf(name, "torch", t)
        if key is not None:
            self.by_identity[key] = name
            skey = (key[0], key[5])
            first = self.by_storage.setdefault(skey, leaf)
            if first is not leaf:
                self.shared.setdefault(skey, [first]).append(leaf)
        self.leaves.append(leaf)
        node["name"] = name
        return node

    def _dtensor(self, dt: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        """A "dtensor" node: the layout of ``dt`` plus the name of its local shard, stored as an
        ordinary torch leaf (so shards, hashing and the writer's capture handle it like any tensor)."""
        torch = self.torch
        local = dt.to_local().detach()  # flatten runs this under no_grad: no autograd node
        if local.is_sparse or local.layout != torch.strided or local.is_quantized or local.device.type == "meta":
            raise UnsupportedValue(
                f"DTensor at key {_key_path(path)!r} has a {local.layout} {local.device.type} local shard "
                f"(quantized={local.is_quantized}); ckptstore stores dense local shards only (materialize it first)"
            )
        layout = self._layout(dt, path)
        if layout["local_shape"] != list(local.shape):
            raise UnsupportedValue(
                f"DTensor at key {_key_path(path)!r} has a local shard of shape {list(local.shape)}, but its "
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
            layout = dtensor_layout(dt, what=f"key {_key_path(path)!r}", mesh_json=self.meshes.get(id(mesh)))
            self.layouts[cache_key] = layout
            self.meshes[id(mesh)] = layout["mesh"]
        return layout

    def _ndarray(self, a: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if a.dtype.hasobject or a.dtype.fields is not None or a.dtype.kind not in "biufcmM":
            return self._fallback(a, path)
        name = self._name(path)
        self.leaves.append(Leaf(name, "numpy", a))
        return {"t": "ndarray", "name": name}


def placement_json(p: Any, ndim: int) -> dict[str, Any] | None:
    """The JSON form of a DTensor placement, or None for one ckptstore cannot record: ``{"shard": d}``,
    ``{"strided_shard": d, "split_factor": k}``, ``{"replicate": true}``, ``{"partial": "sum"}`` (the
    reduce op). Exact types: a subclass (``_MaskPartial``...) carries state this form would drop."""
    from torch.distributed.tensor import placement_types as pt

    strided = getattr(pt, "_StridedShard", None)
    if strided is not None and type(p) is strided:
        return {"strided_shard": _dim(p.dim, ndim), "split_factor": int(p.split_factor)}
    if type(p) is pt.Shard:
        return {"shard": _dim(p.dim, ndim)}
    if type(p) is pt.Replicate:
        return {"replicate": True}
    if type(p) is pt.Partial and isinstance(p.reduce_op, str):
        return {"partial": p.reduce_op}
    return None


def _dim(d: int, ndim: int) -> int:
    return int(d) + ndim if d < 0 else int(d)


def dtensor_layout(dt: Any, *, what: str = "DTensor", mesh_json: dict[str, Any] | None = None) -> dict[str, Any]:
    """The layout fields of ``dt``'s "dtensor" node: ``global_shape``, ``global_stride``, this rank's
    ``offsets`` and ``local_shape`` (torch's ``compute_local_shape_and_global_offset``, what DCP records),
    ``placements`` and ``mesh`` (device type, shape, its global ranks row-major, dim names or None).
    ``mesh_json`` reuses an already computed mesh entry. Raises UnsupportedValue naming ``what`` for a
    placement it cannot record or a rank outside the mesh."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    global_shape = [int(n) for n in dt.shape]
    ndim = len(global_shape)
    encoded = [placement_json(p, ndim) for p in placements]
    if any(e is None for e in encoded):
        bad = [p for p, e in zip(placements, encoded) if e is None]
        raise UnsupportedValue(f"DTensor at {what} has placements {bad!r} that ckptstore cannot record "
                               "(Shard, _StridedShard, Replicate and Partial are supported)")
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    if len(offsets) != ndim or len(local_shape) != ndim:
        raise UnsupportedValue(f"DTensor at {what}: this rank is not part of its device mesh")
    if mesh_json is None:
        names = mesh.mesh_dim_names
        mesh_json = {
            "device_type": str(mesh.device_type),
            "shape": [int(n) for n in mesh.shape],
            "ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
            "dim_names": [str(n) for n in names] if names else None,
        }
    return {
        "global_shape": global_shape,
        "global_stride": [int(n) for n in dt.stride()],
        "offsets": [int(n) for n in offsets],
        "local_shape": [int(n) for n in local_shape],
        "placements": encoded,
        "mesh": mesh_json,
    }


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[dict[str, Any], list[Leaf]]:
    """The JSON tree of ``state`` and its array leaves, in a stable order."""
    f = _Flattener(allow_pickle)
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
    return tree, f.leaves


def refusal_message(refused: list[tuple[str, str]]) -> str:
    """One message naming every refused value (the first MAX_LISTED, then a count) with its key path."""
    lines = [f"  {key!r}: {why}" for key, why in refused[:MAX_LISTED]]
    if len(refused) > MAX_LISTED:
        lines.append(f"  ... and {len(refused) - MAX_LISTED} more")
    return (f"cannot store {len(refused)} value{'s' if len(refused) > 1 else ''} without pickle:\n" + "\n".join(lines)
            + "\nconvert them to tensors, dicts, lists or scalars, or pass allow_pickle=True for values pickle "
            "can store (loading then needs allow_pickle=True too)")


def _byte_span(t: Any) -> tuple[int, int]:
    """[first, last + 1) bytes of its storage that a non-empty strided tensor reaches."""
    es = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset() * es, (t.storage_offset() + last + 1) * es


def share_storages(tree: dict[str, Any], leaves: list[Leaf], shared: dict[tuple[int, str], list[Leaf]]) -> None:
    """Views whose bytes overlap in one storage (``w`` and ``w[1:]``, ``w`` and ``w.t()``) become one
    array, the span of the storage they reach, and each of their tensor nodes gains a ``view``
    (``offset``, ``shape``, ``stride`` in elements of that array), so a load gives them one storage
    again, as torch.save does (issue 10, item 14). Views of different dtypes, or with the conj/neg bit,
    stay separate arrays (their values round-trip; their aliasing does not). Rewrites ``leaves`` and
    ``tree`` in place; runs only when some storage holds two distinct views."""
    merged: dict[str, tuple[str, dict[str, Any]]] = {}  # leaf name -> (array name, its view)
    dropped: set[str] = set()
    replace: dict[str, Leaf] = {}
    for group in shared.values():
        if len({lf.obj.dtype for lf in group}) != 1 or any(lf.obj.is_conj() or lf.obj.is_neg() for lf in group):
            continue
        spans = sorted((_byte_span(lf.obj), i) for i, lf in enumerate(group))
        components: list[list[int]] = []
        end = -1
        for (lo, hi), i in spans:
            if lo < end:
                components[-1].append(i)
            else:
                components.append([i])
            end = max(end, hi) if lo < end else hi
        for comp in components:
            if len(comp) > 1:
                _merge([group[i] for i in sorted(comp)], merged, dropped, replace)
    if not merged:
        return
    leaves[:] = [replace.get(lf.name, lf) for lf in leaves if lf.name not in dropped]
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        t = node.get("t")
        if t == "tensor" and node.get("name") in merged:
            node["name"], view = merged[node["name"]]
            if view:
                node["view"] = view
        else:
            stack.extend(children(node))


def _merge(members: list[Leaf], merged: dict[str, tuple[str, dict[str, Any]]], dropped: set[str],
           replace: dict[str, Leaf]) -> None:
    """One array for ``members`` (views of one dtype whose spans overlap), named as the first of them
    in state order; records each member's view of it."""
    first = members[0]
    es = first.obj.element_size()
    spans = [_byte_span(lf.obj) for lf in members]
    lo, hi = min(s[0] for s in spans) // es, max(s[1] for s in spans) // es
    base = first.obj.detach().as_strided((hi - lo,), (1,), lo)
    replace[first.name] = Leaf(first.name, "torch", base)
    for lf in members:
        t = lf.obj
        view = {"offset": t.storage_offset() - lo, "shape": list(t.shape), "stride": list(t.stride())}
        whole = view["offset"] == 0 and view["shape"] == [hi - lo] and view["stride"] == [1]
        merged[lf.name] = (first.name, {} if whole else view)
        if lf is not first:
            dropped.add(lf.name)


#: What decoding a malformed node raises (torch's parsers raise RuntimeError, struct.error and
#: OverflowError come from floats); the builder reports each as CorruptCut naming the node, so a load
#: falls back from the cut instead of crashing (issue 10, item 8).
_DECODE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError,
                  struct.error)
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_LEAF_KINDS = {"tensor": "torch", "dtensor": "torch", "ndarray": "numpy"}
_INT64 = (-(2**63), 2**63)


class _Builder:
    """The one decoder of a tree, used by loads and by ``verify`` alike so the two cannot drift: every
    node is checked exactly as a load needs it. With ``materialize`` False (``check_tree``) the same
    checks run without torch or numpy and nothing is built for arrays, torch values or pickles.
    ``records`` (array name -> its manifest record) lets each leaf be checked against the array it names."""

    def __init__(self, leaf: Callable[[str, dict[str, Any]], Any], allow_pickle: bool, where: dict[str, Any],
                 *, records: Mapping[str, Any] | None = None, materialize: bool = True,
                 allowed: Mapping[str, type] | None = None):
        self.leaf = leaf
        self.allowed = allowed or {}  # qualified name -> a class the caller named in allowed_types
        self.allow_pickle = allow_pickle
        self.where = where
        self.records = records
        self.materialize = materialize

    def bad(self, msg: str) -> CorruptCut:
        return CorruptCut(f"manifest tree: {msg}", **self.where)

    def build(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH or type(node) is not dict:
            raise self.bad(f"node is not an object or is nested deeper than {MAX_DEPTH}")
        t = node.get("t")
        try:
            return self._decode(t, node, depth)
        except (CkptStoreError, RecursionError):
            raise
        except _DECODE_ERRORS as exc:
            raise self.bad(f"malformed {t!r} node: {exc}") from None

    def _decode(self, t: Any, node: dict[str, Any], depth: int) -> Any:
        if t == "none":
            return None
        if t == "bool":
            return self._typed(node["v"], bool)
        if t == "int":
            if "hex" in node:
                text = self._typed(node["hex"], str)
                if not _HEX_INT.fullmatch(text):
                    raise ValueError(f"{text[:40]!r} is not a hex int")
                return int(text, 16)
            return self._typed(node["v"], int)
        if t == "float":
            return _float_value(node["v"])
        if t == "complex":
            return complex(_float_value(node["re"]), _float_value(node["im"]))
        if t == "str":
            return self._typed(node["v"], str)
        if t == "bytes":
            raw = base64.b64decode(self._typed(node["v"], str), validate=True)
            return bytearray(raw) if self._flag(node, "mutable") else raw
        if t == "dict":
            out: dict[Any, Any] = collections.OrderedDict() if self._flag(node, "ordered") else {}
            for item in self._typed(node["items"], list):
                self._typed(item, dict)
                key = self._typed(item["k"], str) if "k" in item else self._typed(item["ik"], int)
                out[key] = self.build(item["v"], depth + 1)
            return out
        if t in ("list", "tuple"):
            items = [self.build(v, depth + 1) for v in self._typed(node["items"], list)]
            return items if t == "list" else tuple(items)
        if t in ("tensor", "ndarray"):
            name = self._typed(node["name"], str)
            for key in ("param", "requires_grad"):
                if key in node:
                    self._typed(node[key], bool)
            rec = self._record(t, name)
            if "view" in node:
                if t != "tensor":
                    raise self.bad(f"an {t!r} node has a view")
                if rec is not None:
                    try:
                        check_view(node["view"], math.prod(rec.shape))
                    except ValueError as exc:
                        raise self.bad(f"tensor {name[:200]!r}: {exc}") from None
            return self.leaf(name, node) if self.materialize else None
        if t == "dtensor":
            return self._dtensor(node)
        if t == "npscalar":
            dtype = self._typed(node["dtype"], str)
            itemsize = numpy_itemsize(dtype)  # the dtypes np.dtype accepts, checked without numpy
            raw = base64.b64decode(self._typed(node["v"], str), validate=True)
            if len(raw) != itemsize:
                raise ValueError(f"{len(raw)} bytes for a {dtype} scalar")
            if not self.materialize:
                return None
            import numpy as np

            return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
        if t == "size":
            dims = self._typed(node["v"], list)
            if any(type(n) is not int or not _INT64[0] <= n < _INT64[1] for n in dims):
                raise ValueError("a size is a list of int64 values")
            if not self.materialize:
                return None
            import torch

            return torch.Size(dims)
        if t == "dtype":
            name = self._typed(node["v"], str)
            if name not in TORCH_DTYPE_NAMES:
                raise self.bad(f"unknown torch dtype {name[:40]!r}")
            if not self.materialize:
                return None
            import torch

            dt = getattr(torch, name, None)
            if not isinstance(dt, torch.dtype):
                raise self.bad(f"torch {torch.__version__} has no dtype {name!r}")
            return dt
        if t == "device":
            spec = self._typed(node["v"], str)
            check_device(spec)  # what torch.device parses, checked without torch
            if not self.materialize:
                return None
            import torch

            return torch.device(spec)
        if t == "pickle":
            if not self.allow_pickle:
                raise HostileInput(
                    "cut holds a pickled value; refusing to unpickle it (pass allow_pickle=True only "
                    "for cuts you trust)",
                    **self.where,
                )
            raw = base64.b64decode(self._typed(node["v"], str), validate=True)
            return pickle.loads(raw) if self.materialize else None
        if t in VALUE_KINDS:
            return decode(self, t, node, depth)
        raise self.bad(f"unknown node kind {str(t)[:40]!r}")

    def _typed(self, v: Any, typ: type) -> Any:
        if type(v) is not typ:
            raise self.bad(f"expected {typ.__name__}, found {type(v).__name__}")
        return v

    def _flag(self, node: dict[str, Any], key: str) -> bool:
        return self._typed(node.get(key, False), bool)

    def _record(self, t: str, name: str) -> Any:
        """The manifest record of the array a leaf node names, checked to be of the node's kind."""
        if self.records is None:
            return None
        rec = self.records.get(name)
        if rec is None:
            raise self.bad(f"names arrays the manifest does not record: [{name[:200]!r}]")
        if rec.kind != _LEAF_KINDS[t]:
            raise self.bad(f"a {t!r} node names {name[:200]!r}, a {rec.kind} array")
        return rec

    def _dtensor(self, node: dict[str, Any]) -> Any:
        """The local shard a "dtensor" node names, after checking every field of the node (see
        ``check_dtensor_node``) and that its array has the recorded local shape."""
        problem = check_dtensor_node(node)
        if problem is not None:
            raise self.bad(f"malformed 'dtensor' node: {problem}")
        rec = self._record("dtensor", node["name"])
        if rec is not None and list(rec.shape) != node["local_shape"]:
            raise self.bad(f"dtensor {node['name']!r}: its array has shape {list(rec.shape)}, "
                           f"the node records local shape {node['local_shape']}")
        if not self.materialize:
            return None
        obj = self.leaf(node["name"], node)
        shape = getattr(obj, "shape", None)
        if shape is None or list(shape) != node["local_shape"]:
            raise self.bad(f"dtensor {node['name']!r}: its array has shape {None if shape is None else list(shape)}, "
                           f"the node records local shape {node['local_shape']}")
        return obj


_DTENSOR_KEYS = frozenset({"t", "name", "global_shape", "global_stride", "offsets", "local_shape", "placements",
                           "mesh", "param", "requires_grad"})
_MESH_KEYS = frozenset({"device_type", "shape", "ranks", "dim_names"})
_REDUCE_OP = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _int_list(v: Any, what: str, minimum: int) -> str | None:
    if type(v) is not list or any(type(n) is not int or n < minimum for n in v):
        return f"{what} is not a list of ints >= {minimum}"
    return None


def check_dtensor_node(node: Any) -> str | None:
    """Why a "dtensor" tree node is malformed, or None. Every field is type-checked (ints are never
    bools), sizes and offsets are non-negative and each shard lies inside the global shape, placements
    are one of the four recorded forms with a dim inside the tensor, there is one placement per mesh
    dimension, and the mesh lists one distinct rank per device. Unknown fields are refused."""
    if type(node) is not dict or node.get("t") != "dtensor":
        return "not a dtensor node"
    extra = set(node) - _DTENSOR_KEYS
    if extra:
        return f"unknown fields {sorted(extra)[:3]}"
    missing = sorted(_DTENSOR_KEYS - {"param", "requires_grad"} - set(node))
    if missing:
        return f"missing fields {missing}"
    if type(node["name"]) is not str or not node["name"]:
        return "name is not a non-empty str"
    for field, minimum in (("global_shape", 0), ("global_stride", 0), ("offsets", 0), ("local_shape", 0)):
        problem = _int_list(node[field], field, minimum)
        if problem:
            return problem
    shape, local, offsets = node["global_shape"], node["local_shape"], node["offsets"]
    ndim = len(shape)
    if not len(node["global_stride"]) == len(offsets) == len(local) == ndim:
        return "global_shape, global_stride, offsets and local_shape differ in length"
    if any(o + n > g for o, n, g in zip(offsets, local, shape)):
        return f"a shard of shape {local} at offsets {offsets} lies outside the global shape {shape}"
    for key in ("param", "requires_grad"):
        if key in node and type(node[key]) is not bool:
            return f"{key} is not a bool"
    if node.get("param") is False or ("requires_grad" in node and "param" not in node):
        return "requires_grad without param, or param false"
    mesh = node["mesh"]
    if type(mesh) is not dict or set(mesh) != _MESH_KEYS:
        return f"mesh is not an object with exactly the fields {sorted(_MESH_KEYS)}"
    if type(mesh["device_type"]) is not str or not mesh["device_type"]:
        return "mesh device_type is not a non-empty str"
    if _int_list(mesh["shape"], "mesh shape", 1) or not mesh["shape"]:
        return "mesh shape is not a non-empty list of ints >= 1"
    if _int_list(mesh["ranks"], "mesh ranks", 0):
        return "mesh ranks is not a list of ints >= 0"
    devices = 1
    for n in mesh["shape"]:  # stops early: a hostile shape of huge ints never builds a huge product
        devices *= n
        if devices > len(mesh["ranks"]):
            break
    if len(mesh["ranks"]) != devices or len(set(mesh["ranks"])) != len(mesh["ranks"]):
        return f"mesh ranks are not {mesh['shape']} distinct ranks"
    names = mesh["dim_names"]
    if names is not None and (type(names) is not list or any(type(n) is not str for n in names)
                              or len(names) != len(mesh["shape"]) or len(set(names)) != len(names)):
        return "mesh dim_names is neither null nor one distinct str per mesh dimension"
    placements = node["placements"]
    if type(placements) is not list or len(placements) != len(mesh["shape"]):
        return "placements is not a list with one entry per mesh dimension"
    sharded: set[int] = set()
    for p in placements:
        problem = _check_placement(p, ndim)
        if problem:
            return problem
        dim = p.get("shard", p.get("strided_shard"))
        if dim is not None:
            sharded.add(dim)
    for d in range(ndim):
        if d not in sharded and (local[d] != shape[d] or offsets[d] != 0):
            return f"dim {d} is not sharded, yet the shard is {local[d]} of {shape[d]} at offset {offsets[d]}"
    return None


def _check_placement(p: Any, ndim: int) -> str | None:
    if type(p) is not dict:
        return "a placement is not an object"
    keys = set(p)
    if keys == {"shard"} or keys == {"strided_shard", "split_factor"}:
        dim = p.get("shard", p.get("strided_shard"))
        if type(dim) is not int or not 0 <= dim < ndim:
            return f"placement {p!r} shards a dim outside the tensor's {ndim}"
        if "split_factor" in p and (type(p["split_factor"]) is not int or p["split_factor"] < 1):
            return f"placement {p!r} has a split_factor that is not an int >= 1"
        return None
    if keys == {"replicate"}:
        return None if p["replicate"] is True else f"placement {p!r} is not {{'replicate': true}}"
    if keys == {"partial"}:
        op = p["partial"]
        return None if type(op) is str and _REDUCE_OP.fullmatch(op) else f"placement {p!r} has no valid reduce op"
    return f"unknown placement {p!r}"


def unflatten(
    tree: dict[str, Any],
    leaf: Callable[[str, dict[str, Any]], Any],
    *,
    allow_pickle: bool = False,
    where: dict[str, Any] | None = None,
    records: Mapping[str, Any] | None = None,
    allowed_types: Any = None,
) -> Any:
    """Rebuilds a state from its tree; ``leaf(name, node)`` returns the array for a tensor, ndarray or
    dtensor node (for a dtensor node, its local shard: the caller gets the plain local tensor).
    ``records`` (name -> manifest record) checks each leaf against the array it names first. Any
    malformed node raises CorruptCut (HostileInput for a refused pickle). ``allowed_types`` (a list of
    classes) are the user classes that enum, dataclass, namedtuple, class and omegaconf nodes may come
    back as, matched by qualified name; nothing is ever imported by a name the tree holds."""
    allowed = allowed_map(allowed_types, where)
    return _Builder(leaf, allow_pickle, where or {}, records=records, allowed=allowed).build(tree)


MAX_VIEW_DIMS = 64  # torch's own limit on dimensions


def check_view(view: Any, numel: int) -> None:
    """Raises ValueError unless ``view`` (a "tensor" node's ``view``: ``offset``, ``shape``, ``stride``
    in elements) stays inside an array of ``numel`` elements. Shared by load (``arrays.apply_view``) and
    verify (``check_tree``), so what verify accepts, load loads."""
    if type(view) is not dict or set(view) != {"offset", "shape", "stride"}:
        raise ValueError("view is not an object with exactly offset, shape and stride")
    offset, shape, stride = view["offset"], view["shape"], view["stride"]
    ints = [offset, *shape, *stride] if type(shape) is list and type(stride) is list else None
    if ints is None or any(type(n) is not int or n < 0 for n in ints):
        raise ValueError("view offset, shape and stride are not non-negative ints")
    if len(shape) != len(stride) or len(shape) > MAX_VIEW_DIMS:
        raise ValueError(f"view shape and stride differ in length or exceed {MAX_VIEW_DIMS} dimensions")
    if all(shape) and offset + sum((n - 1) * st for n, st in zip(shape, stride)) >= numel:
        raise ValueError(f"view {view} reaches past the {numel} elements of its array")
    if not all(shape) and offset > numel:
        raise ValueError(f"view {view} starts past the {numel} elements of its array")


def check_tree(tree: Any, records: Mapping[str, Any], *, where: dict[str, Any] | None = None) -> None:
    """Raises CorruptCut unless ``unflatten`` would decode ``tree``: the same decoder, run without torch
    or numpy, building no array and unpickling nothing (pickle nodes must still be valid base64).
    ``records`` maps each array name to its manifest record (``kind``, ``shape``)."""
    _Builder(lambda name, node: None, True, where or {}, records=records, materialize=False).build(tree)


def leaf_names(tree: Any) -> list[str]:
    """Every array name a tree references (for partial loads and checks), in tree order."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("t") in ("tensor", "ndarray", "dtensor") and isinstance(node.get("name"), str):
            out.append(node["name"])
        stack.extend(reversed(children(node)))
    return out


def children(node: dict[str, Any]) -> list[Any]:
    """The child nodes of a node of any kind: a dict's item values, the ``items`` of lists, tuples, sets,
    dataclasses, namedtuples and Namespaces, the ``value`` of an enum or omegaconf node. Tolerates
    malformed nodes (the walkers run before the tree is checked)."""
    items = node.get("items")
    items = items if isinstance(items, list) else []
    if node.get("t") == "dict":
        items = [item.get("v") for item in items if isinstance(item, dict)]
    value = node.get("value")
    return [*items, value] if isinstance(value, dict) else items


def has_pickle(tree: Any) -> bool:
    """Whether any node of a tree is a pickled value (the manifest then says ``pickled``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("t") == "pickle":
            return True
        stack.extend(children(node))
    return False
