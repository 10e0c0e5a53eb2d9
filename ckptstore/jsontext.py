"""The JSON text of manifests, made fast for states of many arrays (issue 23): compact JSON
(``compact_json``, the bytes every manifest of versions 2-4 is written as), a state tree's text that
reuses the text of the subtrees it shares with the last tree the writer captured (``TreeText``), and a
version 4 table's text that reuses its unchanged columns (``_TableText``). Every text is byte for byte
what ``compact_json`` makes of the same value."""

from __future__ import annotations

import json
from typing import Any


def compact_json(value: Any) -> str:
    """``value`` as the manifest writes it: compact separators, ASCII (``json.dumps``' defaults)."""
    return json.dumps(value, separators=(",", ":"))


class TreeText:
    """The JSON text of state trees, reusing the text of every container met in the last remembered
    call when the same object comes again (issue 23: a tree of 40,000 arrays is 3-4.5 MB of JSON,
    0.1-0.15 s of ``json.dumps`` at every cut, though a repeated layout shares all of its big
    subtrees with the previous cut's tree: ``ckptstore.tree.layoutcache``).

    Invariant relied on: a tree that is remembered is never modified (layoutcache's invariant for the
    trees a capture returns), so an object seen again has the text it had. Only the writer's
    pipeline remembers trees (``remember_tree_text``): a tree passed to ``PendingCut.commit`` by a
    user may be changed in place between two commits, and is always encoded anew. Containers of at
    most ``SMALL`` children are walked (the spine: a root dict, its items list, a model/optim split);
    bigger ones are encoded whole and remembered whole, so a call costs a few hundred Python steps
    plus the encoding of what is new. The text is byte for byte ``compact_json(tree)``, UTF-8
    (json.dumps joins a dict's items the same way); ``dumps`` encodes what is not remembered another
    way, as bytes (any JSON: the writer's hand-over, where pydantic's encoder is several times faster)."""

    SMALL = 16
    #: Walked containers per call at most (a deep tree of small dicts is encoded whole past it).
    WALK = 512

    def __init__(self) -> None:
        #: id -> (container, the pieces of its text, the entries of the containers walked inside it).
        self._memo: dict[int, tuple[Any, tuple[bytes, ...], tuple[Any, ...]]] = {}

    def text(self, tree: Any, *, remember: bool = False, dumps: Any = None) -> bytes:
        """The UTF-8 JSON of ``tree``; ``dumps`` gives the bytes of what is not remembered."""
        return b"".join(self.pieces(tree, remember=remember, dumps=dumps))

    def pieces(self, tree: Any, *, remember: bool = False, dumps: Any = None) -> list[bytes]:
        """``text`` as pieces to join: the text of a big subtree is one remembered piece, so the text
        of a tree is copied once, when its pieces are joined (joining at every level of the spine
        copied 4 MB five times over)."""
        memo, small = self._memo, self.SMALL
        dumps = dumps or compact_bytes
        if remember and dumps is not compact_bytes:
            raise ValueError("only compact_json text is remembered")
        seen: dict[int, Any] | None = {} if remember else None
        budget = [self.WALK]

        def keep(entry: tuple[Any, tuple[bytes, ...], tuple[Any, ...]]) -> None:
            # A hit keeps what lies inside it too: a copy of this subtree's parent (pydantic copies a
            # tree's root dict) finds its children next time.
            assert seen is not None
            seen[id(entry[0])] = entry
            for kid in entry[2]:
                keep(kid)

        def enc(node: Any, depth: int, out: list[bytes], into: list[Any]) -> None:
            hit = memo.get(id(node))
            if hit is not None and hit[0] is node:
                if seen is not None:
                    keep(hit)
                into.append(hit)
                out.extend(hit[1])
                return
            kind = type(node)
            if kind is not dict and kind is not list:
                out.append(dumps(node))
                return
            walk = len(node) <= small and depth < 32 and budget[0] > 0
            kids: list[Any] = []
            mine: list[bytes] = []
            if walk and kind is dict and all(type(k) is str for k in node):
                budget[0] -= 1
                mine.append(b"{")
                for i, (k, v) in enumerate(node.items()):
                    mine.append((b"," if i else b"") + compact_bytes(k) + b":")
                    enc(v, depth + 1, mine, kids)
                mine.append(b"}")
            elif walk and kind is list:
                budget[0] -= 1
                mine.append(b"[")
                for i, v in enumerate(node):
                    if i:
                        mine.append(b",")
                    enc(v, depth + 1, mine, kids)
                mine.append(b"]")
            else:
                mine.append(dumps(node))
            entry = (node, tuple(mine), tuple(kids))
            if seen is not None:
                seen[id(node)] = entry
            into.append(entry)
            out.extend(mine)

        out: list[bytes] = []
        enc(tree, 0, out, [])
        if seen is not None:
            self._memo = seen  # one assignment: a concurrent call reads the old memo or the new, whole
        return out


def compact_bytes(value: Any) -> bytes:
    """``compact_json`` of ``value``, UTF-8."""
    return compact_json(value).encode()


_TREE_TEXT = TreeText()


def remember_tree_text(tree: dict[str, Any]) -> None:
    """Remembers the text of a captured tree (never modified: ``TreeText``), so the manifest that
    commits it, and the next cut's tree, reuse the text of what they share with it. The pieces are
    not joined here: the manifest joins them once (a joined copy was 7 MB of a commit's peak memory at
    100,000 arrays, issue 23)."""
    _TREE_TEXT.pieces(tree, remember=True)


def tree_text(tree: dict[str, Any], dumps: Any = None) -> bytes:
    """The JSON of ``tree`` (UTF-8), with the remembered text of the subtrees it shares with the last
    remembered tree; the rest encoded by ``dumps`` (bytes; default: ``compact_json``'s, the manifest's)."""
    return _TREE_TEXT.text(tree, dumps=dumps)


class _TableText:
    """``compact_json`` of a version 4 table as pieces to join, reusing the text of each column equal to
    the same column of the last table: the cuts of one layout repeat names, dtypes, shapes, files and
    offsets and differ only in digests (30 ms of a manifest's encoding at 40,000 arrays). Equal columns
    have equal text: the manifest's checks allow only strings in ``name`` and ints (never bools or
    floats) in the others, the only values where ``==`` could hide a different text. Each column is
    encoded to bytes on its own and never joined here (the manifest joins its pieces once): the
    table's text as one str, then as bytes, then joined again cost 16 MB of a commit's peak memory at
    100,000 arrays (issue 23)."""

    REUSED = ("name", "dtype", "shape", "file", "offset")

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, bytes]] = {}

    def pieces(self, table: dict[str, Any]) -> list[bytes]:
        last, now, parts = self._last, {}, [b"{"]
        for i, (k, v) in enumerate(table.items()):
            hit = last.get(k) if k in self.REUSED else None
            text = hit[1] if hit is not None and hit[0] == v else compact_bytes(v)
            if k in self.REUSED:
                now[k] = (v, text)
            parts += ((b"," if i else b"") + compact_bytes(k) + b":", text)
        parts.append(b"}")
        self._last = now
        return parts


_TABLE_TEXT = _TableText()


def tree_pieces(tree: Any) -> list[bytes]:
    """``tree_text`` of a manifest's tree as pieces to join (``TreeText.pieces``)."""
    return _TREE_TEXT.pieces(tree)


def table_pieces(table: dict[str, Any]) -> list[bytes]:
    """``compact_json`` of a version 4 table as pieces to join, reusing the unchanged columns of the
    last one."""
    return _TABLE_TEXT.pieces(table)


__all__ = ["TreeText", "compact_bytes", "compact_json", "remember_tree_text", "table_pieces", "tree_pieces", "tree_text"]
