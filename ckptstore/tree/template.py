"""The structure half of a layout (``layoutcache``, issue 23): a template of a state's containers,
compiled from the state and its cold tree, and the walk that checks a new state against it container
by container, collecting its tensors and numpy arrays in tree order with list operations and encoding
its other values anew (with ``encode``'s flattener, so exactly as a full flatten would).

A template describes dicts, OrderedDicts, lists and tuples whose children are tensors, numpy arrays,
containers, or values without arrays; anything else (a DTensor, arrays inside a dataclass or a
namedtuple) raises :class:`Uncacheable` when compiling. A walk raises :class:`Miss` at the first
difference of structure (type, length, keys and their types, a value that now holds arrays); the
tensors themselves are compared by ``layoutcache``'s signature.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from .encode import Flattener
from .nodes import leaf_names

# Segment kinds of a container template (see Container.segs).
_RUN, _NUMPY, _SUB, _VALUE, _UNIFORM = range(5)


class Miss(Exception):
    """The state does not have the cached layout (raised inside a walk, caught by ``layoutcache.Layout.match``)."""


class Uncacheable(Exception):
    """The state holds something a layout cannot describe (a DTensor, arrays inside other values)."""


class Walk:
    """What one cached walk collects: the tensors and numpy arrays met, in tree order, and the
    flattener that encodes the values that are not arrays (made on first use)."""

    __slots__ = ("allow_pickle", "tensors", "arrays", "f")

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: list[Any] = []
        self.arrays: list[Any] = []
        self.f: Flattener | None = None

    def value(self, value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        """The node of a value without arrays, as a full flatten encodes it; a miss if it holds arrays
        now, or is refused (the full flatten then names every refused value)."""
        if self.f is None:
            self.f = Flattener(self.allow_pickle)
        f = self.f
        node = f.node(value, path)
        if f.leaves or f.refused:
            raise Miss
        return node


class Container:
    """A dict, OrderedDict, list or tuple of the layout. ``segs`` are its children in order: a run of
    tensors (collected with one ``extend``), a numpy array, a container, or a value re-encoded at every
    walk. ``node`` is the cold tree's node: returned as it is when nothing under it is re-encoded
    (``static``), else copied with the re-encoded children put in."""

    __slots__ = ("typ", "keys", "keytype", "keytypes", "n", "node", "segs", "static")

    def __init__(self, typ: type, keys: list[Any] | None, n: int, node: dict[str, Any]) -> None:
        self.typ = typ
        self.keys = keys
        #: The one type of every key (the common dict: all str), else None and each key's type in
        #: ``keytypes`` (issue 23: a list of 100,000 types was 0.8 MB kept between cuts for nothing).
        self.keytype: type | None = None
        self.keytypes: list[type] | None = None
        if keys:
            kinds = set(map(type, keys))
            if len(kinds) == 1:
                (self.keytype,) = kinds
            else:
                self.keytypes = [type(k) for k in keys]
        self.n = n
        self.node = node
        #: (kind, start, stop, sub-template, key field): children [start, stop) are a run of tensors
        #: (_RUN), one numpy array, one container (_SUB), one value (_VALUE), or all children, each a
        #: dict of tensors only with the same keys (_UNIFORM); a dict item's key is stored under its key
        #: field ("k" for a str key, "ik" for an int one), as in the cold node.
        self.segs: list[tuple[int, int, int, Any, str | None]] = []
        self.static = True

    def _same_keytypes(self, keys: list[Any]) -> bool:
        if self.keytypes is not None:
            return list(map(type, keys)) == self.keytypes
        return not keys or set(map(type, keys)) == {self.keytype}

    def walk(self, value: Any, path: tuple[Any, ...], w: Walk) -> dict[str, Any]:
        if type(value) is not self.typ or len(value) != self.n:
            raise Miss
        if self.keys is not None:
            keys = list(value)
            # Types too: 1 == 1.0 == True, but a float or bool key is refused and an int one is not.
            if keys != self.keys or not self._same_keytypes(keys):
                raise Miss
            vals = list(value.values())
        else:
            keys, vals = None, value
        items = None if self.static else list(self.node["items"])
        for kind, a, b, sub, keyfield in self.segs:
            if kind == _RUN:
                w.tensors.extend(vals if b - a == self.n else vals[a:b])
                continue
            if kind == _NUMPY:
                w.arrays.append(vals[a])
                continue
            if kind == _UNIFORM:
                sub.collect(vals, w)
                continue
            key = keys[a] if keys is not None else a
            if kind == _SUB:
                node = sub.walk(vals[a], path + (key,), w)
                if sub.static:
                    continue
            else:
                node = w.value(vals[a], path + (key,))
            assert items is not None
            items[a] = {keyfield: key, "v": node} if keyfield is not None else node
        if items is None:
            return self.node
        return {**self.node, "items": items}


def compile_template(value: Any, node: dict[str, Any], tensor: type) -> Container:
    """The template of a container of the state and its node in the cold tree (``tensor``: torch.Tensor)."""
    kind = node.get("t")
    typ = type(value)
    if kind == "dict" and typ in _DICTS:
        keys = list(value)
        if len(keys) != len(node["items"]):
            raise Uncacheable  # a refused key (never here: the walk raised)
        c = Container(typ, keys, len(keys), node)
        children = list(value.values())
        child_nodes = [item["v"] for item in node["items"]]
    elif kind in ("list", "tuple") and typ in _SEQS and (kind == "list") == (typ is list):
        c = Container(typ, None, len(value), node)
        children, child_nodes = list(value), node["items"]
    else:
        raise Uncacheable
    run = -1
    for i, (v, n) in enumerate(zip(children, child_nodes)):
        t = n.get("t")
        if t == "tensor" and isinstance(v, tensor):
            if run < 0:
                run = i
            continue
        if run >= 0:
            c.segs.append((_RUN, run, i, None, None))
            run = -1
        keyfield = ("k" if "k" in node["items"][i] else "ik") if c.keys is not None else None
        if t == "ndarray":
            c.segs.append((_NUMPY, i, i + 1, None, None))
        elif t in ("dict", "list", "tuple") and type(v) in _DICTS + _SEQS and leaf_names(n):
            # A container without arrays is one value, encoded anew at each walk (below): a template of
            # its own would keep a segment per child (an optimizer's param_groups list every parameter
            # id: 33,000 segments, ~12 MB kept between cuts, issue 23).
            sub = compile_template(v, n, tensor)
            c.segs.append((_SUB, i, i + 1, sub, keyfield))
            c.static = c.static and sub.static
        elif leaf_names(n):
            raise Uncacheable  # a DTensor, or arrays inside a dataclass, namedtuple, set, ...
        else:
            c.segs.append((_VALUE, i, i + 1, None, keyfield))
            c.static = False
    if run >= 0:
        c.segs.append((_RUN, run, len(children), None, None))
    _make_uniform(c)
    _drop_replaced(c)
    return c


def _drop_replaced(c: Container) -> None:
    """Gives a container that is not static its own copy of its node, without the children each walk
    puts in anew (they are None there): the cold tree's nodes of its values would otherwise stay alive
    with the layout, unused (an optimizer's 33,000 parameter ids: ~7 MB kept between cuts, issue 23).
    The cold tree itself is not touched (a tree is never modified once flatten returns it)."""
    if c.static:
        return
    items = list(c.node["items"])
    for kind, a, _b, sub, _keyfield in c.segs:
        if kind == _VALUE or (kind == _SUB and not sub.static):
            items[a] = None
    c.node = {**c.node, "items": items}


class _Uniform:
    """Children that are all dicts (or all OrderedDicts) of tensors only, with one key list of one key
    type: an optimizer's state, a dict of per-parameter dicts. One walk of them is a few C-level passes
    over all of them instead of a template walk each (13,000 of them cost ~30 ms that way)."""

    __slots__ = ("types", "keys", "keytype", "values")

    def __init__(self, first: Container, n: int) -> None:
        assert first.keys is not None and first.keytype is not None
        self.types = [first.typ] * n
        self.keys = [first.keys] * n
        self.keytype = first.keytype
        self.values = first.typ.values  # an OrderedDict's own order, not its dict's (move_to_end)

    def collect(self, children: Any, w: Walk) -> None:
        if list(map(type, children)) != self.types:
            raise Miss
        keys = list(map(list, children))
        if keys != self.keys or set(map(type, itertools.chain.from_iterable(keys))) != {self.keytype}:
            raise Miss
        w.tensors.extend(itertools.chain.from_iterable(map(self.values, children)))


def _make_uniform(c: Container) -> None:
    """Replaces ``c``'s segments by one _UNIFORM segment when its children allow it."""
    if len(c.segs) < 2 or len(c.segs) != c.n or any(seg[0] != _SUB for seg in c.segs):
        return
    subs = [seg[3] for seg in c.segs]
    first = subs[0]
    if first.keys is None or not first.keys or first.keytype is None:
        return
    for sub in subs:
        if (sub.typ is not first.typ or sub.keys != first.keys or not sub.static
                or sub.segs != [(_RUN, 0, sub.n, None, None)]):
            return
    c.segs = [(_UNIFORM, 0, c.n, _Uniform(first, c.n), None)]


_DICTS: tuple[type, ...] = (dict, collections.OrderedDict)
_SEQS: tuple[type, ...] = (list, tuple)


__all__ = ["Container", "Miss", "Uncacheable", "Walk", "compile_template"]
