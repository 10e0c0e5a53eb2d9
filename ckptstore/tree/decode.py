"""The load side of the tree: ``unflatten`` rebuilds a state from its tree, ``check_tree`` runs the same
decoder for verify without torch or numpy. Every node is an object with a ``t`` kind, decoded by the
one method its kind names (``_Builder._KINDS``, then ``values.decode`` for the kinds of plain Python
values); unknown kinds are refused. Split out of tree.py (issue 20).
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import re
import struct
from typing import Any, Callable, ClassVar, Mapping

from ..errors import CkptStoreError, CorruptCut, HostileInput
from ..format import TORCH_DTYPE_NAMES, check_device, numpy_itemsize
from ..values import VALUE_KINDS, allowed_map
from ..values import decode as decode_value
from .dtensor import check_dtensor_node
from .nodes import MAX_DEPTH
from .views import check_view

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


#: What decoding a malformed node raises (torch's parsers raise RuntimeError, struct.error and
#: OverflowError come from floats); the builder reports each as CorruptCut naming the node, so a load
#: falls back from the cut instead of crashing (issue 10, item 8).
_DECODE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError,
                  struct.error)
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_LEAF_KINDS = {"tensor": "torch", "dtensor": "torch", "ndarray": "numpy"}
_MISSING = object()
_INT64 = (-(2**63), 2**63)


class _Builder:
    """The one decoder of a tree, used by loads and by ``verify`` alike so the two cannot drift: every
    node is checked exactly as a load needs it. With ``materialize`` False (``check_tree``) the same
    checks run without torch or numpy and nothing is built for arrays, torch values or pickles.
    ``records`` (array name -> its manifest record) lets each leaf be checked against the array it names."""

    def __init__(self, leaf: Callable[[str, dict[str, Any]], Any], allow_pickle: bool, where: dict[str, Any],
                 *, records: Mapping[str, Any] | None = None, materialize: bool = True,
                 allowed: Mapping[str, type] | None = None, plain: Mapping[str, Any] | None = None):
        self.leaf = leaf
        self.plain = plain  # name -> what a plain array node decodes to (``unflatten``'s ``plain``)
        self.allowed = allowed or {}  # qualified name -> a class the caller named in allowed_types
        self.allow_pickle = allow_pickle
        self.where = where
        self.records = records
        self.materialize = materialize
        self._children: dict[int, Callable[[Any], Any]] = {}  # depth -> ``child`` (``_child_of``)

    def run(self, tree: Any) -> Any:
        """``build(tree)``, then the children's decoders dropped: they refer to this builder, and the
        cycle would keep the records and arrays it holds alive until the collector runs (issue 23)."""
        try:
            return self.build(tree)
        finally:
            self._children.clear()

    def bad(self, msg: str) -> CorruptCut:
        return CorruptCut(f"manifest tree: {msg}", **self.where)

    def build(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH or type(node) is not dict:
            raise self.bad(f"node is not an object or is nested deeper than {MAX_DEPTH}")
        t = node.get("t")
        try:
            # Only a str is looked up: a list or dict kind then fails in ``t in VALUE_KINDS`` exactly as the
            # chain of comparisons this table replaced did (issue 20), whatever dict lookup would say.
            kind = self._KINDS.get(t) if type(t) is str else None
            if kind is not None:
                return kind(self, t, node, depth)
            if t in VALUE_KINDS:
                return decode_value(self, t, node, depth)
        except (CkptStoreError, RecursionError):
            raise
        except _DECODE_ERRORS as exc:
            raise self.bad(f"malformed {t!r} node: {exc}") from None
        raise self.bad(f"unknown node kind {str(t)[:40]!r}")

    # ------------------------------------------------------------- one decoder per kind: (t, node, depth)
    def _none(self, t: str, node: dict[str, Any], depth: int) -> Any:
        return None

    def _bool(self, t: str, node: dict[str, Any], depth: int) -> Any:
        return self._typed(node["v"], bool)

    def _int(self, t: str, node: dict[str, Any], depth: int) -> Any:
        if "hex" in node:
            text = self._typed(node["hex"], str)
            if not _HEX_INT.fullmatch(text):
                raise ValueError(f"{text[:40]!r} is not a hex int")
            return int(text, 16)
        return self._typed(node["v"], int)

    def _float(self, t: str, node: dict[str, Any], depth: int) -> Any:
        return _float_value(node["v"])

    def _complex(self, t: str, node: dict[str, Any], depth: int) -> Any:
        return complex(_float_value(node["re"]), _float_value(node["im"]))

    def _str(self, t: str, node: dict[str, Any], depth: int) -> Any:
        return self._typed(node["v"], str)

    def _bytes(self, t: str, node: dict[str, Any], depth: int) -> Any:
        raw = base64.b64decode(self._typed(node["v"], str), validate=True)
        return bytearray(raw) if self._flag(node, "mutable") else raw

    def _dict(self, t: str, node: dict[str, Any], depth: int) -> Any:
        out: dict[Any, Any] = collections.OrderedDict() if self._flag(node, "ordered") else {}
        child = self._child_of(depth + 1)
        for item in self._typed(node["items"], list):
            # ``_typed``'s checks inline (it raises): a state of 40,000 leaves walks this loop 40,000 times.
            if type(item) is not dict:
                self._typed(item, dict)
            if "k" in item:
                key = item["k"]
                if type(key) is not str:
                    self._typed(key, str)
            else:
                key = self._typed(item["ik"], int)
            out[key] = child(item["v"])
        return out

    def _sequence(self, t: str, node: dict[str, Any], depth: int) -> Any:
        items = list(map(self._child_of(depth + 1), self._typed(node["items"], list)))
        return items if t == "list" else tuple(items)

    def _child_of(self, depth: int) -> Callable[[Any], Any]:
        """``build(node, depth)`` for the children of a dict or sequence at ``depth``, with the two commonest
        leaves of a state decoded inline: a plain array ``{"t": "tensor" | "ndarray", "name": <str>}`` whose
        record is of the node's kind, and an ``{"t": "int", "v": <int>}`` (a state of 40,000 tensors has
        40,000 of the first; the general path, a call per kind and per check, cost 2-3 us each, issue 23).
        Each is exactly what ``_array`` and ``_int`` accept and return for such a node; anything else,
        including every node these would refuse, goes to ``build``, which names what is wrong."""
        child = self._children.get(depth)
        if child is not None:
            return child
        build, leaf, records, materialize, bad = self.build, self.leaf, self.records, self.materialize, self.bad
        plain = self.plain

        def general(node: Any) -> Any:
            return build(node, depth)

        if records is None or depth > MAX_DEPTH:
            child = self._children[depth] = general
            return child

        def child(node: Any) -> Any:
            if type(node) is dict and len(node) == 2:
                t = node.get("t")
                if t == "tensor" or t == "ndarray":
                    name = node.get("name")
                    rec = records.get(name) if type(name) is str else None
                    if rec is not None and rec.kind == _LEAF_KINDS[t]:
                        if not materialize:
                            return None
                        if plain is not None:
                            obj = plain.get(name, _MISSING)
                            if obj is not _MISSING:
                                return obj
                        try:
                            return leaf(name, node)
                        except (CkptStoreError, RecursionError):
                            raise
                        except _DECODE_ERRORS as exc:  # as ``build`` reports what a leaf raises
                            raise bad(f"malformed {t!r} node: {exc}") from None
                elif t == "int":
                    v = node.get("v")
                    if type(v) is int:
                        return v
            return build(node, depth)

        self._children[depth] = child
        return child

    def _array(self, t: str, node: dict[str, Any], depth: int) -> Any:
        """A "tensor" or "ndarray" leaf: its flags, its record, and a tensor's view inside that array."""
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

    def _dtensor(self, t: str, node: dict[str, Any], depth: int) -> Any:
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

    def _npscalar(self, t: str, node: dict[str, Any], depth: int) -> Any:
        dtype = self._typed(node["dtype"], str)
        itemsize = numpy_itemsize(dtype)  # the dtypes np.dtype accepts, checked without numpy
        raw = base64.b64decode(self._typed(node["v"], str), validate=True)
        if len(raw) != itemsize:
            raise ValueError(f"{len(raw)} bytes for a {dtype} scalar")
        if not self.materialize:
            return None
        import numpy as np

        return np.frombuffer(raw, dtype=np.dtype(dtype))[0]

    def _size(self, t: str, node: dict[str, Any], depth: int) -> Any:
        dims = self._typed(node["v"], list)
        if any(type(n) is not int or not _INT64[0] <= n < _INT64[1] for n in dims):
            raise ValueError("a size is a list of int64 values")
        if not self.materialize:
            return None
        import torch

        return torch.Size(dims)

    def _dtype(self, t: str, node: dict[str, Any], depth: int) -> Any:
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

    def _device(self, t: str, node: dict[str, Any], depth: int) -> Any:
        spec = self._typed(node["v"], str)
        check_device(spec)  # what torch.device parses, checked without torch
        if not self.materialize:
            return None
        import torch

        return torch.device(spec)

    def _pickle(self, t: str, node: dict[str, Any], depth: int) -> Any:
        if not self.allow_pickle:
            raise HostileInput(
                "cut holds a pickled value; refusing to unpickle it (pass allow_pickle=True only "
                "for cuts you trust)",
                **self.where,
            )
        raw = base64.b64decode(self._typed(node["v"], str), validate=True)
        return pickle.loads(raw) if self.materialize else None

    #: The decoder of each kind that is not one of ``values.VALUE_KINDS``.
    _KINDS: ClassVar[dict[str, Callable[..., Any]]] = {
        "none": _none, "bool": _bool, "int": _int, "float": _float, "complex": _complex, "str": _str,
        "bytes": _bytes, "dict": _dict, "list": _sequence, "tuple": _sequence, "tensor": _array,
        "ndarray": _array, "dtensor": _dtensor, "npscalar": _npscalar, "size": _size, "dtype": _dtype,
        "device": _device, "pickle": _pickle,
    }

    # ------------------------------------------------------------------------------------ checks
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


def unflatten(
    tree: dict[str, Any],
    leaf: Callable[[str, dict[str, Any]], Any],
    *,
    allow_pickle: bool = False,
    where: dict[str, Any] | None = None,
    records: Mapping[str, Any] | None = None,
    allowed_types: Any = None,
    plain: Mapping[str, Any] | None = None,
) -> Any:
    """Rebuilds a state from its tree; ``leaf(name, node)`` returns the array for a tensor, ndarray or
    dtensor node (for a dtensor node, its local shard: the caller gets the plain local tensor).
    ``records`` (name -> manifest record) checks each leaf against the array it names first. Any
    malformed node raises CorruptCut (HostileInput for a refused pickle). ``allowed_types`` (a list of
    classes) are the user classes that enum, dataclass, namedtuple, class and omegaconf nodes may come
    back as, matched by qualified name; nothing is ever imported by a name the tree holds. ``plain``
    (name -> object, with ``records``) is what ``leaf`` returns for a plain array node ``{"t": "tensor" |
    "ndarray", "name"}`` of that name, taken without the call (names it lacks still go to ``leaf``)."""
    allowed = allowed_map(allowed_types, where)
    return _Builder(leaf, allow_pickle, where or {}, records=records, allowed=allowed, plain=plain).run(tree)


def check_tree(tree: Any, records: Mapping[str, Any], *, where: dict[str, Any] | None = None) -> None:
    """Raises CorruptCut unless ``unflatten`` would decode ``tree``: the same decoder, run without torch
    or numpy, building no array and unpickling nothing (pickle nodes must still be valid base64).
    ``records`` maps each array name to its manifest record (``kind``, ``shape``)."""
    _Builder(lambda name, node: None, True, where or {}, records=records, materialize=False).run(tree)


def plain_shape(node: dict[str, Any]) -> Any:
    """What verify's check mode decodes ``node`` to: the plain shape, with arrays and torch values as
    None and pickles left unpickled (the encoder hashes a set element in this shape, so that what verify
    accepts, load loads)."""
    return _Builder(lambda name, n: None, True, {}, materialize=False).run(node)
