"""What every part of the tree shares: the array leaf, key paths, the depth bound, and the walkers
that read a tree before (or without) decoding it. Split out of tree.py (issue 20) so that the encoder,
the decoder, views and DTensor nodes each import these from one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 200


@dataclass(slots=True)  # slots: a flatten of 100,000 tensors makes 100,000 of them (a dict each: 10 MB)
class Leaf:
    """An array leaf of the state: ``kind`` is "torch" or "numpy"; ``obj`` the tensor or array.
    ``item``: its ``arrays.ArrayItem`` when the flatten that made it described it on the way (a save's
    flatten reads the attributes a description needs anyway, issue 23), else None."""

    name: str
    kind: str
    obj: Any
    item: Any = field(default=None, compare=False, repr=False)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def key_path(path: tuple[Any, ...]) -> str:
    """The name a key path gives an array, and the key errors name: keys joined by "/", escaped as in
    a JSON pointer ("~" as "~0", "/" as "~1")."""
    return "/".join(_escape(str(k)) for k in path) or "<root>"


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
