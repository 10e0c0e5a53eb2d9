"""The typed JSON tree of a state: what ``save`` stores instead of a pickle.

``flatten`` walks a state (dicts with str or int keys, lists, tuples, tensors, numpy arrays, python
scalars, str, bytes, None) and returns a JSON tree plus the list of array leaves, each named by its key
path. ``unflatten`` rebuilds the same structure with the same types. Every node is an object with a
``t`` kind; unknown kinds are refused on load. Floats are stored as ``float.hex`` so they round-trip
bit-exactly (nan payloads and -0.0 included).

torch is never imported here: a state can only hold tensors if its caller imported torch already, so
``sys.modules`` tells whether to look for them.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .errors import CorruptCut, HostileInput, UnsupportedValue

MAX_DEPTH = 200
MAX_NAME = 4000  # array names (key paths) stay below the manifest's 4096-character bound


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
    import struct

    return "bits:" + struct.pack("<d", v).hex()


def _float_value(s: str) -> float:
    if s.startswith("bits:"):
        import struct

        return struct.unpack("<d", bytes.fromhex(s[5:]))[0]
    return float.fromhex(s)


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        self.names: set[str] = set()
        self.by_identity: dict[tuple[Any, ...], str] = {}
        self.torch = sys.modules.get("torch")
        self.np = sys.modules.get("numpy")

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
                    raise UnsupportedValue(f"dict key at {_key_path(path)!r} is an int wider than "
                                           f"{MAX_JSON_INT_BITS} bits; use a str key")
                else:
                    raise UnsupportedValue(
                        f"dict key {k!r} at {_key_path(path)!r} is a {type(k).__name__}; keys must be str or int"
                    )
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
        return self._fallback(value, path)

    def _fallback(self, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if not self.allow_pickle:
            raise UnsupportedValue(
                f"cannot store {type(value).__module__}.{type(value).__qualname__} at key "
                f"{_key_path(path)!r} without pickle; convert it to tensors/dicts/scalars, or pass "
                "allow_pickle=True (loading then needs allow_pickle=True too)"
            )
        return {"t": "pickle", "v": base64.b64encode(pickle.dumps(value, protocol=5)).decode()}

    def _tensor(self, t: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        torch = self.torch
        if t.is_sparse or t.layout != torch.strided:
            return self._fallback(t, path)
        if t.is_quantized or t.device.type == "meta":
            return self._fallback(t, path)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t.device.type) if t.numel() else None
        node: dict[str, Any] = {"t": "tensor"}
        if isinstance(t, torch.nn.Parameter):
            node["param"] = True
            node["requires_grad"] = bool(t.requires_grad)
        if key is not None and key in self.by_identity:
            node["name"] = self.by_identity[key]
            return node
        name = self._name(path)
        if key is not None:
            self.by_identity[key] = name
        self.leaves.append(Leaf(name, "torch", t))
        node["name"] = name
        return node

    def _ndarray(self, a: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        if a.dtype.hasobject or a.dtype.fields is not None or a.dtype.kind not in "biufcmM":
            return self._fallback(a, path)
        name = self._name(path)
        self.leaves.append(Leaf(name, "numpy", a))
        return {"t": "ndarray", "name": name}


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[dict[str, Any], list[Leaf]]:
    """The JSON tree of ``state`` and its array leaves, in a stable order."""
    f = _Flattener(allow_pickle)
    return f.node(state, ()), f.leaves


class _Builder:
    def __init__(self, leaf: Callable[[str, dict[str, Any]], Any], allow_pickle: bool, where: dict[str, Any]):
        self.leaf = leaf
        self.allow_pickle = allow_pickle
        self.where = where

    def bad(self, msg: str) -> CorruptCut:
        return CorruptCut(f"manifest tree: {msg}", **self.where)

    def build(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH or not isinstance(node, dict):
            raise self.bad(f"node is not an object or is nested deeper than {MAX_DEPTH}")
        t = node.get("t")
        try:
            if t == "none":
                return None
            if t == "bool":
                return self._typed(node["v"], bool)
            if t == "int":
                if "hex" in node:
                    return int(self._typed(node["hex"], str), 16)
                return self._typed(node["v"], int)
            if t == "float":
                return _float_value(self._typed(node["v"], str))
            if t == "complex":
                return complex(_float_value(node["re"]), _float_value(node["im"]))
            if t == "str":
                return self._typed(node["v"], str)
            if t == "bytes":
                raw = base64.b64decode(self._typed(node["v"], str), validate=True)
                return bytearray(raw) if node.get("mutable") else raw
            if t == "dict":
                out: dict[Any, Any] = collections.OrderedDict() if node.get("ordered") else {}
                for item in node["items"]:
                    key = item["k"] if "k" in item else self._typed(item["ik"], int)
                    out[key] = self.build(item["v"], depth + 1)
                return out
            if t in ("list", "tuple"):
                items = [self.build(v, depth + 1) for v in node["items"]]
                return items if t == "list" else tuple(items)
            if t in ("tensor", "ndarray"):
                return self.leaf(self._typed(node["name"], str), node)
            if t == "npscalar":
                import numpy as np

                dtype = np.dtype(self._typed(node["dtype"], str))
                if dtype.hasobject:
                    raise HostileInput("npscalar with an object dtype", **self.where)
                return np.frombuffer(base64.b64decode(node["v"], validate=True), dtype=dtype)[0]
            if t == "size":
                import torch

                return torch.Size(node["v"])
            if t == "dtype":
                import torch

                dt = getattr(torch, self._typed(node["v"], str), None)
                if not isinstance(dt, torch.dtype):
                    raise self.bad(f"unknown torch dtype {node['v']!r}")
                return dt
            if t == "device":
                import torch

                return torch.device(self._typed(node["v"], str))
            if t == "pickle":
                if not self.allow_pickle:
                    raise HostileInput(
                        "cut holds a pickled value; refusing to unpickle it (pass allow_pickle=True only "
                        "for cuts you trust)",
                        **self.where,
                    )
                return pickle.loads(base64.b64decode(node["v"], validate=True))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, (CorruptCut, HostileInput)):
                raise
            raise self.bad(f"malformed {t!r} node: {exc}") from None
        raise self.bad(f"unknown node kind {t!r}")

    def _typed(self, v: Any, typ: type) -> Any:
        if type(v) is not typ:
            raise self.bad(f"expected {typ.__name__}, found {type(v).__name__}")
        return v


def unflatten(
    tree: dict[str, Any],
    leaf: Callable[[str, dict[str, Any]], Any],
    *,
    allow_pickle: bool = False,
    where: dict[str, Any] | None = None,
) -> Any:
    """Rebuilds a state from its tree; ``leaf(name, node)`` returns the array for a tensor node."""
    return _Builder(leaf, allow_pickle, where or {}).build(tree)


def leaf_names(tree: Any) -> list[str]:
    """Every array name a tree references (for partial loads and checks), in tree order."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("t") in ("tensor", "ndarray") and isinstance(node.get("name"), str):
            out.append(node["name"])
        items = node.get("items") if isinstance(node.get("items"), list) else []
        if node.get("t") == "dict":
            items = [item.get("v") for item in items if isinstance(item, dict)]
        stack.extend(reversed(items))
    return out


def has_pickle(tree: Any) -> bool:
    """Whether any node of a tree is a pickled value (the manifest then says ``pickled``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("t") == "pickle":
            return True
        items = node.get("items") if isinstance(node.get("items"), list) else []
        stack.extend(item.get("v") if node.get("t") == "dict" and isinstance(item, dict) else item for item in items)
    return False
