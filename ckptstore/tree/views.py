"""Views: tensors of a state that share one storage are saved as one array plus each tensor's view of
it (``share_storages``, the save side), and ``check_view`` bounds a recorded view on the read side.
Split out of tree.py (issue 20): the one place that knows what a "tensor" node's ``view`` means.
"""

from __future__ import annotations

from typing import Any

from .nodes import Leaf, children

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
