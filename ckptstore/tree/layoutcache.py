"""A flatten that is cheap while the layout of a state repeats (issue 23): a training loop cuts the same
structure of tensors every time, and only its values (and its scalars: the step) change.

:class:`LayoutCache` keeps the :class:`Layout` of the last state it flattened: the tree's structure (a
template of its containers, ``template``), what each array node was made from, and a *signature* of
every tensor met (per tensor node in tree order: type, data_ptr, storage offset, shape, stride, dtype,
device, requires_grad). The next state is walked container by container (never tensor by tensor: the
tensors of a container are collected with one list operation, and their signature is read with one
``map`` per attribute and compared column by column: the layout keeps each column compact, see
``_Coded``). If the
structure and the signature match, the tree is the cached one with its non-array values encoded anew,
and the arrays are the same leaves; anything else (a key, an order, a container type, a shape, a dtype,
a storage, a Parameter that is no longer one, a value that became a tensor) is a miss, and the state is
flattened in full (``encode.walk``), which also replaces the layout.

Why a match gives the tree a full flatten would: ``encode``'s tree and leaves are a function of the
structure, of each tensor's type, requires_grad and identity key (storage address, offset, shape,
stride, dtype, device type: the storage address is ``data_ptr - offset * itemsize``), and, for the
tensors of a storage that holds several of them (``views.share_storages``), of their conj and neg bits,
which are compared too. Python identity is no key: ``model.state_dict()`` returns new tensor objects at
each call. A layout is built only from a state whose own cached walk reproduces its full tree and leaves
(checked when the layout is made), and only states made of dicts, OrderedDicts, lists, tuples, tensors,
numpy arrays and values without arrays are cached: DTensors and arrays inside other values (dataclasses,
namedtuples) always take the full flatten.

The cache holds no reference to any tensor of the state (only numbers, shapes, dtypes and the tree).
Invariant: a tree is never modified once flatten returns it; a tree from the cache shares its
subtrees without re-encoded values with the cached layout and with earlier cuts' trees. torch is
never imported here.
"""

from __future__ import annotations

import array
import operator
import sys
from dataclasses import dataclass
from typing import Any

from .encode import Flattener, walk
from .nodes import Leaf
from .template import Container, Miss, Uncacheable, Walk, compile_template


def _getters() -> tuple[Any, ...]:
    """The attributes of a tensor that a signature holds, after its type: each read with one ``map``
    over all tensors (~0.15-0.25 us a tensor). Only called with tensors met, so torch is loaded."""
    T = sys.modules["torch"].Tensor
    return (T.data_ptr, T.storage_offset, T.size, T.stride, _DTYPE, _DEVICE, _REQUIRES_GRAD)


_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
#: Signature attributes kept as machine integers (8 bytes each, not a 32-byte int object): the
#: addresses and storage offsets. The others (type, shape, stride, dtype, device, requires_grad) take
#: few distinct values: each is kept as a :class:`_Coded` column (issue 23: the plain lists cost 48
#: bytes a tensor between cuts; coded, ~0-6).
_AS_ARRAY = {0: "Q", 1: "q"}


def _read(k: int, get: Any, tensors: list[Any]) -> Any:
    code = _AS_ARRAY.get(k)
    return array.array(code, map(get, tensors)) if code is not None else list(map(get, tensors))


class _Coded:
    """A column of few distinct values, compact: the one value of a uniform column (the common state:
    one dtype, one device, one type), else each value's index into the table of its distinct values,
    in a machine-integer array. ``same`` compares a fresh list of values with C-level passes, with
    ``==`` as the lists compared before (equal values hash alike for every attribute held here)."""

    __slots__ = ("n", "one", "table", "codes")

    def __init__(self, values: list[Any]) -> None:
        self.n = len(values)
        self.one: Any = values[0] if values else None
        self.table: dict[Any, int] | None = None
        self.codes: Any = None
        if values and values.count(self.one) != self.n:
            table: dict[Any, int] = {}
            for v in values:
                table.setdefault(v, len(table))
            self.table = table
            self.codes = array.array(_code_for(len(table)), map(table.__getitem__, values))

    def same(self, values: list[Any]) -> bool:
        if len(values) != self.n:
            return False
        if self.table is None:
            return not values or values.count(self.one) == self.n
        try:
            codes = array.array(self.codes.typecode, map(self.table.__getitem__, values))
        except KeyError:  # a value this column never held
            return False
        return codes == self.codes


def _code_for(distinct: int) -> str:
    return "B" if distinct <= 1 << 8 else "H" if distinct <= 1 << 16 else "I"


def _signature(tensors: list[Any]) -> list[Any]:
    """Per attribute, its value for every tensor in ``tensors`` (type first): arrays of the addresses
    and offsets, lists of the rest (what :func:`_compact` keeps and :func:`_flag_shared` reads)."""
    if not tensors:
        return [[] for _ in range(8)]
    sig: list[Any] = [list(map(type, tensors))]
    for k, get in enumerate(_getters()):
        sig.append(_read(k, get, tensors))
    return sig


def _compact(sig: list[Any]) -> list[Any]:
    """``sig`` as a layout keeps it: the arrays as they are, every list as a :class:`_Coded` column."""
    return [col if isinstance(col, array.array) else _Coded(col) for col in sig]


def _same_signature(tensors: list[Any], sig: list[Any]) -> bool:
    """Whether ``tensors`` have the signature ``sig`` (:func:`_compact`'s): attribute by attribute,
    stopping at the first that differs (a wrong type stops it before a getter could raise)."""
    if len(tensors) != sig[0].n:
        return False
    if not tensors:
        return True
    if not sig[0].same(list(map(type, tensors))):
        return False
    for k, (get, want) in enumerate(zip(_getters(), sig[1:])):
        got = _read(k, get, tensors)
        if not (got == want if k in _AS_ARRAY else want.same(got)):
            return False
    return True


def _bits(t: Any) -> tuple[bool, bool]:
    return t.is_conj(), t.is_neg()


@dataclass(frozen=True)
class Flat:
    """One flattened state: its tree, and per leaf (in ``layout``'s order) the array to store: the
    state's own tensor or numpy array, or, for views merged into one array (``share_storages``), the
    1-D view over their span."""

    tree: dict[str, Any]
    layout: "Layout"
    sources: list[Any]
    #: The full flatten's own leaves, when it made this Flat (not made twice: 100,000 leaves are ~15 MB).
    made: list[Leaf] | None = None

    def leaves(self) -> list[Leaf]:
        """The leaves ``flatten`` returns for this state."""
        if self.made is not None:
            return self.made
        return [Leaf(n, k, s) for n, k, s in zip(self.layout.names, self.layout.kinds, self.sources)]


class Layout:
    """The layout of one state (see the module docstring); ``names`` and ``kinds`` are its leaves'.
    ``reusable`` is False for a state that only the full flatten describes (``match`` always misses)."""

    def __init__(self, names: list[str], kinds: list[str], allow_pickle: bool) -> None:
        self.names = names
        self.kinds = kinds
        self.allow_pickle = allow_pickle
        self.reusable = False
        self._root: Container | None = None
        self._sig: list[Any] = []  # _compact(_signature(...)): arrays and coded columns
        self._array_sig: list[tuple[Any, Any, Any]] = []  # (type, dtype, shape) of each numpy array met
        self._flagged: list[tuple[int, tuple[bool, bool]]] = []  # (tensor, its conj and neg bits)
        self._pick: Any = None  # tensors + arrays met -> the leaf sources (None: they are the leaves)
        self._views: list[tuple[int, int, int]] = []  # (leaf, element count, storage offset) of merged views

    def match(self, state: Any) -> Flat | None:
        """``state``'s flatten if it has this layout, else None (then only the full flatten can tell)."""
        if not self.reusable or self._root is None:
            return None
        w = Walk(self.allow_pickle)
        try:
            tree = self._root.walk(state, (), w)
            if not self._same_arrays(w):
                return None
        except Exception:  # noqa: BLE001 - a miss (a getter on something else, a refused value, ...):
            return None  # the full flatten decides, and raises what it raises
        return Flat(tree, self, self._sources(w))

    def _same_arrays(self, w: Walk) -> bool:
        if not _same_signature(w.tensors, self._sig):
            return False
        if any(_bits(w.tensors[i]) != bits for i, bits in self._flagged):
            return False
        return [(type(a), a.dtype, a.shape) for a in w.arrays] == self._array_sig

    def _sources(self, w: Walk) -> list[Any]:
        if self._pick is None:  # the arrays met are the leaves, in order
            return w.tensors + w.arrays if w.arrays else w.tensors
        sources = self._pick(w.tensors + w.arrays)
        for leaf, n, offset in self._views:
            sources[leaf] = sources[leaf].detach().as_strided((n,), (1,), offset)
        return sources

    @classmethod
    def of(cls, state: Any, f: Flattener) -> "Layout":
        """The layout of ``state``, given its full flatten ``f``; not ``reusable`` when the state holds
        something a layout cannot describe, or when its cached walk does not give back ``f``'s result."""
        leaves = f.leaves
        layout = cls([lf.name for lf in leaves], [lf.kind for lf in leaves], f.allow_pickle)
        try:
            # No torch: no tensor node either (a class no value is an instance of stands in).
            root = compile_template(state, f.tree, f.tensor_type or Miss)
            w = Walk(f.allow_pickle)
            tree = root.walk(state, (), w)
        except (Uncacheable, Miss):
            return layout
        # The walk met every array node of the tree (the names say which leaf each is), and gives the
        # same tree back: what ``match`` returns for a state of this layout is what ``f`` found.
        if (tree != f.tree or len(w.tensors) != len(f.tensor_names) or len(w.arrays) != len(f.array_names)
                or not layout._map_leaves(f, w)):
            return layout
        layout._root = root
        sig = _signature(w.tensors)
        layout._array_sig = [(type(a), a.dtype, a.shape) for a in w.arrays]
        torch_leaves = len(leaves) - len(w.arrays)
        # Some storage holds two of the tensors met, or one is a conjugate/negative view (its own leaf,
        # whose base's storage it shares: the same view without the bit would be a view of the base).
        if f.shared or len(w.tensors) != torch_leaves or any(_bits(t) != (False, False) for t in w.tensors):
            layout._flagged = _flag_shared(w.tensors, sig)
        layout._sig = _compact(sig)
        layout.reusable = _same_objects(layout._sources(w), leaves)
        return layout

    def _map_leaves(self, f: Flattener, w: Walk) -> bool:
        """Which tensor or array met gives each leaf (tied tensors: the first; merged views: one of
        them, viewed over the span). False when some leaf has none (the layout is then not reusable)."""
        names = f.tensor_names + f.array_names  # the names of ``w.tensors + w.arrays``, in that order
        met = w.tensors + w.arrays
        if names == self.names and all(map(operator.is_, met, (lf.obj for lf in f.leaves))):
            return True  # every array met is a leaf of its own, in order: the common state
        first = dict(zip(reversed(names), range(len(names) - 1, -1, -1)))  # name -> its first array met
        pick = [first.get(name, -1) for name in self.names]
        if -1 in pick:
            return False
        for i, (j, lf) in enumerate(zip(pick, f.leaves)):
            if lf.obj is met[j]:
                continue
            # share_storages' 1-D view over the span of views merged into one array (named as the
            # first of them, so ``met[j]`` is over the same storage).
            t = lf.obj
            if lf.kind != "torch" or t.dim() != 1 or t.stride() != (1,):
                return False
            self._views.append((i, t.shape[0], t.storage_offset()))
        self._pick = _picker(pick)
        return True


def _picker(pick: list[int]) -> Any:
    """``met -> [met[j] for j in pick]`` in one C call (itemgetter returns a bare item for one index)."""
    if len(pick) == 1:
        j = pick[0]
        return lambda met: [met[j]]
    get = operator.itemgetter(*pick)
    return lambda met: list(get(met))


def _same_objects(sources: list[Any], leaves: list[Leaf]) -> bool:
    """The cached walk's sources are the full flatten's leaves (the same objects, or equal views)."""
    if len(sources) != len(leaves):
        return False
    if all(map(operator.is_, sources, (lf.obj for lf in leaves))):
        return True
    for s, lf in zip(sources, leaves):
        o = lf.obj
        if s is not o and (lf.kind != "torch" or (s.data_ptr(), s.shape, s.stride(), s.dtype)
                           != (o.data_ptr(), o.shape, o.stride(), o.dtype)):
            return False
    return True


def _flag_shared(tensors: list[Any], sig: list[Any]) -> list[tuple[int, tuple[bool, bool]]]:
    """The tensors whose storage holds another tensor met (a tied one included): share_storages reads
    their conj and neg bits, so a match compares those bits too."""
    storages: dict[tuple[int, Any], list[int]] = {}
    for i, (ptr, offset, size, dtype, device) in enumerate(zip(sig[1], sig[2], sig[3], sig[5], sig[6])):
        if 0 in size:
            continue  # zero-size: no identity, never shared
        storages.setdefault((ptr - offset * dtype.itemsize, device.type), []).append(i)
    return [(i, _bits(tensors[i])) for group in storages.values() if len(group) > 1 for i in group]


class LayoutCache:
    """``flatten`` with the last state's layout kept: a state of the same layout is flattened without
    visiting its tensors one by one. One cache per stream of cuts (a Checkpointer's pipeline)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        #: Flattens answered from the cached layout, and in full (tests and benchmarks read them).
        self.hits = 0
        self.misses = 0

    def flatten(self, state: Any, *, allow_pickle: bool = False) -> Flat:
        """The tree and leaf sources of ``state``: from the cached layout if it matches, else from a full
        flatten (raising what ``flatten`` raises), whose layout then replaces the cached one."""
        layout = self.layout
        if layout is not None and layout.allow_pickle == allow_pickle:
            flat = layout.match(state)
            if flat is not None:
                self.hits += 1
                return flat
        self.misses += 1
        f = walk(state, allow_pickle)
        layout = Layout.of(state, f)
        self.layout = layout if layout.reusable else None
        return Flat(f.tree, layout, [lf.obj for lf in f.leaves], f.leaves)

    def forget(self) -> None:
        self.layout = None


__all__ = ["Flat", "Layout", "LayoutCache"]
