"""Tree nodes for the plain Python values that hyperparameters hold, stored without pickle (issue 13).

pathlib paths, enum members, dataclass instances, namedtuples, ``argparse.Namespace``, ``datetime``
values, sets, OmegaConf containers and class objects each get a node kind (docs/format.md, "The
tree"). ``encode`` is the save side (called by the flattener of ``tree.encode`` after its fast branches, so
tensors, dicts, lists and scalars pay nothing for it); ``decode`` the load side (called by the builder of
``tree.decode``, in load and in verify's check mode alike).

Nothing is ever imported by a name the store holds (a cut is data, not code). Standard-library values
come back as themselves; a user class (an Enum, a dataclass, a namedtuple, a class object, an OmegaConf
container) comes back as itself only when the caller names the class in ``allowed_types``, matched by
its qualified name; otherwise the value comes back in its plain shape: an enum member as its value, a
namedtuple as a tuple, a dataclass as a dict of its fields, a class as its qualified name, an OmegaConf
container as its plain dict or list.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime as dt
import enum
import io
import json
import os
import pathlib
import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

from .errors import UsageError

_PATHS: dict[str, type] = {"PosixPath": pathlib.PosixPath, "WindowsPath": pathlib.WindowsPath,
                           "PurePosixPath": pathlib.PurePosixPath, "PureWindowsPath": pathlib.PureWindowsPath}
_PATH_NAMES = {cls: name for name, cls in _PATHS.items()}
_TIMES: dict[type, str] = {dt.datetime: "datetime", dt.date: "date", dt.time: "time", dt.timedelta: "timedelta"}
_TIME_TYPES = {kind: cls for cls, kind in _TIMES.items()}
#: The OmegaConf container classes by qualified name, and the node kind of the plain container each holds.
_OMEGACONF = {"omegaconf.dictconfig.DictConfig": "dict", "omegaconf.listconfig.ListConfig": "list"}
#: A qualified name: module path and __qualname__ joined by dots ("<locals>" included for local classes).
_QUALNAME = re.compile(r"[^\W\d][\w.<>]{0,499}")
MAX_ISO = 64  # the longest isoformat() of a datetime with a sub-minute UTC offset is 48 characters


def qualified_name(cls: type) -> str:
    """``module.qualname`` of a class: what a node records and what ``allowed_types`` is matched by."""
    return f"{cls.__module__}.{cls.__qualname__}"


def allowed_map(allowed_types: Any, where: dict[str, Any] | None = None) -> dict[str, type]:
    """Qualified name -> class for ``allowed_types`` (a list of classes, or None). UsageError for a single
    class or a str passed bare, a non-class entry, or two different classes of one qualified name."""
    if allowed_types is None:
        return {}
    where = where or {}
    if isinstance(allowed_types, (type, str, bytes)) or not isinstance(allowed_types, Iterable):
        raise UsageError(f"allowed_types must be a list of classes (allowed_types=[Color, OptimCfg]), "
                         f"not {allowed_types!r}", **where)
    out: dict[str, type] = {}
    for cls in allowed_types:
        if not isinstance(cls, type):
            raise UsageError(f"allowed_types holds {cls!r}, which is not a class; only classes can be allowed",
                             **where)
        name = qualified_name(cls)
        if out.setdefault(name, cls) is not cls:
            raise UsageError(f"allowed_types holds two different classes named {name!r}", **where)
    return out


# ------------------------------------------------------------------------------------------- save side
def encode(f: Any, value: Any, path: tuple[Any, ...]) -> dict[str, Any] | None:
    """The node of ``value``, one the fast branches of the flattener's ``node`` did not take, or None when no
    kind fits (the flattener then pickles or refuses it). ``f`` is the flattener: ``f.node`` encodes a
    child, ``f.refuse`` records a refused value, ``f.plain`` decodes a node as verify does,
    ``f.holds_arrays`` tells whether a node names arrays."""
    cls = type(value)
    name = _PATH_NAMES.get(cls)
    if name is not None:
        return {"t": "path", "type": name, "v": str(value)}
    kind = _TIMES.get(cls)  # exact types: a subclass (pandas.Timestamp) carries more than these fields
    if kind is not None:
        return _time_node(kind, value)
    if cls is set or cls is frozenset:
        return _set_node(f, value, path)
    if isinstance(value, enum.Enum):
        return {"t": "enum", "type": qualified_name(cls), "name": value.name, "value": f.node(value.value, path)}
    if isinstance(value, type):
        return {"t": "class", "type": qualified_name(value)}
    om = sys.modules.get("omegaconf")  # an OmegaConf container exists only if omegaconf is loaded
    if om is not None and (cls is om.DictConfig or cls is om.ListConfig):
        return _omegaconf_node(f, om, value, path)
    ap = sys.modules.get("argparse")
    if ap is not None and cls is ap.Namespace:
        attrs = vars(value)
        return {"t": "namespace", "fields": list(attrs), "items": [f.node(v, path + (k,)) for k, v in attrs.items()]}
    if isinstance(value, tuple) and _is_namedtuple(cls):
        return {"t": "namedtuple", "type": qualified_name(cls), "fields": list(cls._fields),
                "items": [f.node(v, path + (k,)) for k, v in zip(cls._fields, value)]}
    if dataclasses.is_dataclass(value):
        return _dataclass_node(f, value, path)
    return None


def _time_node(kind: str, v: Any) -> dict[str, Any]:
    if kind == "timedelta":
        return {"t": "timedelta", "days": v.days, "seconds": v.seconds, "microseconds": v.microseconds}
    node: dict[str, Any] = {"t": kind, "v": v.isoformat()}  # an aware value's UTC offset is part of it
    if kind != "date" and v.fold:
        node["fold"] = 1  # isoformat drops it; it picks the second of two repeated wall times
    return node


def _set_node(f: Any, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
    """A set's elements in a deterministic order: sorted when all are str, all int or all bytes, else by
    the canonical JSON of their nodes (a set's own iteration order changes with string hashing)."""
    where = path + ("{}",)
    pairs = [(v, f.node(v, where)) for v in value]
    kinds = {type(v) for v in value}
    if len(kinds) == 1 and kinds <= {str, int, bytes}:
        pairs.sort(key=lambda p: p[0])
    else:
        pairs.sort(key=lambda p: json.dumps(p[1], sort_keys=True))
    for v, node in pairs:
        if f.holds_arrays(node):
            f.refuse(where, f"a set element holds an array ({type(v).__name__}); store it in a list")
            continue
        try:
            hash(f.plain(node))
        except TypeError:
            # What verify accepts, load loads: verify rebuilds the plain shape, so it must hash too.
            f.refuse(where, f"set element {_short(v)} is not hashable in its plain shape (a dataclass loads "
                            "as a dict without allowed_types); store the set as a list")
    return {"t": type(value).__name__, "items": [node for _, node in pairs]}


def _omegaconf_node(f: Any, om: Any, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
    # resolve=False: the config as written ("${model.lr}" stays an interpolation), as pickle would keep
    # it. Resolving would run resolvers (env vars, custom ones) on the save path, where they can fail,
    # and freeze values a reloaded DictConfig would compute again.
    container = om.OmegaConf.to_container(value, resolve=False)
    name = qualified_name(type(value))
    if type(container) is not (dict if _OMEGACONF.get(name) == "dict" else list):
        return f.refuse(path, f"an OmegaConf {type(value).__name__} whose content is {_short(container)}")
    return {"t": "omegaconf", "type": name, "value": f.node(container, path)}


def _dataclass_node(f: Any, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
    names, items = [], []
    for fld in dataclasses.fields(value):  # init and non-init fields; ClassVar and InitVar are not fields
        try:
            v = getattr(value, fld.name)
        except AttributeError:
            return f.refuse(path, f"dataclass {qualified_name(type(value))} has no value for field {fld.name!r}")
        names.append(fld.name)
        items.append(f.node(v, path + (fld.name,)))
    return {"t": "dataclass", "type": qualified_name(type(value)), "fields": names, "items": items}


def _is_namedtuple(cls: type) -> bool:
    fields = getattr(cls, "_fields", None)
    return (type(fields) is tuple and all(type(n) is str for n in fields) and callable(getattr(cls, "_make", None)))


def why_refused(value: Any) -> str:
    """Why ``value`` cannot be stored without pickle, in words a user can act on."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            return f"sparse tensor (layout {value.layout}): call .to_dense()"
        if value.is_nested:
            return "nested tensor: store .unbind() (a list of tensors)"
        if value.is_quantized:
            return f"quantized tensor ({value.qscheme()}): call .dequantize()"
        if value.device.type == "meta":
            return "meta tensor (it has no data): materialize it first"
        return f"tensor with layout {value.layout}: call .to_dense()"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return f"numpy value of dtype {value.dtype} (object, structured and void dtypes need pickle)"
    if isinstance(value, types.FunctionType) and value.__name__ == "<lambda>":
        return "a lambda"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"a function ({getattr(value, '__qualname__', value)})"
    if isinstance(value, io.IOBase):
        return "an open file" if not value.closed else "a file object"
    if isinstance(value, types.ModuleType):
        return f"a module ({value.__name__})"
    if isinstance(value, types.GeneratorType):
        return "a generator"
    name = qualified_name(type(value))
    for base in (dict, list, tuple, set, str, int, float, dt.datetime, dt.date, pathlib.PurePath):
        if isinstance(value, base):
            return f"an instance of {name}, a subclass of {base.__name__}: convert it to a plain {base.__name__}"
    return f"an instance of {name} (not a dataclass, enum or namedtuple)"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------- load side
def decode(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    """The value of a node of one of ``VALUE_KINDS``. ``b`` is the tree builder: ``b.build`` decodes a
    child, ``b.bad`` makes the CorruptCut, ``b.allowed`` maps qualified names to the caller's classes
    (empty in verify's check mode, so verify checks exactly what a load without allowed_types does)."""
    decoder = _DECODERS.get(t)  # one function per kind (issue 20: was one 84-line chain)
    if decoder is None:
        raise b.bad(f"unknown node kind {t[:40]!r}")
    return decoder(b, t, node, depth)


def _decode_path(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("type", "v"))
    cls = _PATHS.get(_str(b, node["type"]))
    if cls is None:
        raise b.bad(f"unknown path type {node['type'][:40]!r}")
    # A concrete path of the other OS cannot be instantiated here: its pure counterpart can.
    if cls is pathlib.WindowsPath and os.name != "nt":
        cls = pathlib.PureWindowsPath
    elif cls is pathlib.PosixPath and os.name == "nt":
        cls = pathlib.PurePosixPath
    return cls(_str(b, node["v"]))


def _decode_time(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("v",), ("fold",) if t != "date" else ())
    text = _str(b, node["v"])
    if len(text) > MAX_ISO:
        raise b.bad(f"a {t} of {len(text)} characters")
    value = _TIME_TYPES[t].fromisoformat(text)
    if value.isoformat() != text:  # only the form isoformat() writes
        raise b.bad(f"{text!r} is not a {t} in the form isoformat() writes")
    if "fold" in node:
        if node["fold"] != 1 or type(node["fold"]) is not int:
            raise b.bad("fold is not 1")
        value = value.replace(fold=1)
    return value


def _decode_timedelta(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("days", "seconds", "microseconds"))
    parts = [node["days"], node["seconds"], node["microseconds"]]
    if any(type(n) is not int for n in parts):
        raise b.bad("timedelta fields are not ints")
    value = dt.timedelta(days=parts[0], seconds=parts[1], microseconds=parts[2])
    if [value.days, value.seconds, value.microseconds] != parts:
        raise b.bad(f"timedelta fields {parts} are not normalized "
                    "(0 <= seconds < 86400, 0 <= microseconds < 10**6)")
    return value


def _decode_set(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("items",))
    items = [b.build(v, depth + 1) for v in _list(b, node["items"])]
    return set(items) if t == "set" else frozenset(items)  # TypeError (unhashable) -> CorruptCut


def _decode_enum(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("type", "name", "value"))
    name = _qualname(b, node)
    member = node["name"]
    if member is not None:
        _str(b, member)
    value = b.build(node["value"], depth + 1)
    cls = b.allowed.get(name)
    return value if cls is None else _member(b, cls, name, member, value)


def _decode_class(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("type",))
    name = _qualname(b, node)
    builtin = getattr(builtins, name[len("builtins."):], None) if name.startswith("builtins.") else None
    if isinstance(builtin, type):
        return builtin  # int, float, dict...: there without importing anything
    return b.allowed.get(name, name)


def _decode_record(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    """A dataclass, namedtuple or Namespace node: named fields, one item each."""
    _fields(b, node, ("fields", "items") if t == "namespace" else ("type", "fields", "items"))
    name = _qualname(b, node) if t != "namespace" else ""
    names = _list(b, node["fields"])
    items = _list(b, node["items"])
    if any(type(n) is not str for n in names) or len(set(names)) != len(names) or len(names) != len(items):
        raise b.bad("fields are not distinct strs, one per item")
    values = [b.build(v, depth + 1) for v in items]
    if t == "namespace":
        import argparse  # noqa: PLC0415 - only for cuts that hold one

        return argparse.Namespace(**dict(zip(names, values)))
    cls = b.allowed.get(name)
    if cls is None:
        return dict(zip(names, values)) if t == "dataclass" else tuple(values)
    return _dataclass(b, cls, name, names, values) if t == "dataclass" else _namedtuple(b, cls, name, names, values)


def _decode_omegaconf(b: Any, t: str, node: dict[str, Any], depth: int) -> Any:
    _fields(b, node, ("type", "value"))
    name = _qualname(b, node)
    inner = node["value"]
    if name not in _OMEGACONF or type(inner) is not dict or inner.get("t") != _OMEGACONF[name]:
        raise b.bad(f"an omegaconf node of type {name[:60]!r} holds no {_OMEGACONF.get(name, 'dict or list')} node")
    plain = b.build(inner, depth + 1)
    cls = b.allowed.get(name)
    return plain if cls is None else cls(plain)


_DECODERS: dict[str, Callable[[Any, str, dict[str, Any], int], Any]] = {
    "path": _decode_path, "date": _decode_time, "time": _decode_time, "datetime": _decode_time,
    "timedelta": _decode_timedelta, "set": _decode_set, "frozenset": _decode_set, "enum": _decode_enum,
    "class": _decode_class, "dataclass": _decode_record, "namedtuple": _decode_record,
    "namespace": _decode_record, "omegaconf": _decode_omegaconf,
}
#: The node kinds this module encodes and decodes: those of ``_DECODERS``, so the two cannot drift.
VALUE_KINDS = frozenset(_DECODERS)


def _fields(b: Any, node: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Every required field present, nothing unknown: a new kind is strict from its first version."""
    missing = [k for k in required if k not in node]
    extra = sorted(set(node) - {"t", *required, *optional})
    if missing or extra:
        problem = f"lacks {missing}" if missing else f"has unknown fields {extra[:3]}"
        raise b.bad(f"a {node['t']!r} node {problem}")


def _str(b: Any, v: Any) -> str:
    if type(v) is not str:
        raise b.bad(f"expected str, found {type(v).__name__}")
    return v


def _list(b: Any, v: Any) -> list[Any]:
    if type(v) is not list:
        raise b.bad(f"expected list, found {type(v).__name__}")
    return v


def _qualname(b: Any, node: dict[str, Any]) -> str:
    name = _str(b, node["type"])
    if not _QUALNAME.fullmatch(name):
        raise b.bad(f"{name[:60]!r} is not a qualified class name")
    return name


def _mismatch(b: Any, msg: str) -> UsageError:
    """The caller's class in ``allowed_types`` does not fit what the cut recorded (a renamed member, a
    changed dataclass): the cut is fine, so this is a UsageError (a fallback must never record a good
    cut bad for it), naming the store and cut."""
    return UsageError(msg + "; load without it in allowed_types to get the plain value", **b.where)


def _member(b: Any, cls: type, name: str, member: str | None, value: Any) -> Any:
    """The member of the caller's enum class that a node records, looked up by name (a composite Flag
    by its value, checked against the recorded name)."""
    if not issubclass(cls, enum.Enum):
        raise _mismatch(b, f"the cut records an enum member of {name}, but the class given in allowed_types is not an Enum")
    if member is not None and member in cls.__members__:
        return cls.__members__[member]
    if issubclass(cls, enum.Flag):
        try:
            found = cls(value)
        except ValueError:
            found = None
        if found is not None and found.name == member:
            return found
    raise _mismatch(b, f"enum {name} (the class given in allowed_types) has no member {member!r}")


def _dataclass(b: Any, cls: type, name: str, names: list[str], values: list[Any]) -> Any:
    """An instance of the caller's dataclass: init fields through the constructor (so __post_init__
    runs), then the others set as a frozen dataclass's own __init__ sets them."""
    if not dataclasses.is_dataclass(cls):
        raise _mismatch(b, f"the cut records a dataclass {name}, but the class given in allowed_types is not one")
    declared = dataclasses.fields(cls)
    if sorted(fld.name for fld in declared) != sorted(names):
        raise _mismatch(b, f"dataclass {name} has fields {[fld.name for fld in declared]}; the cut records {names}")
    by_name = dict(zip(names, values))
    try:
        obj = cls(**{fld.name: by_name[fld.name] for fld in declared if fld.init})
    except (TypeError, ValueError) as exc:
        raise _mismatch(b, f"dataclass {name} refused the recorded fields: {exc}") from None
    for fld in declared:
        if not fld.init:
            object.__setattr__(obj, fld.name, by_name[fld.name])
    return obj


def _namedtuple(b: Any, cls: type, name: str, names: list[str], values: list[Any]) -> Any:
    if not (issubclass(cls, tuple) and _is_namedtuple(cls)):
        raise _mismatch(b, f"the cut records a namedtuple {name}, but the class given in allowed_types is not one")
    declared = list(cls._fields)  # type: ignore[attr-defined]
    if declared != names:
        raise _mismatch(b, f"namedtuple {name} has fields {declared}; the cut records {names}")
    return cls(*values)
