"""The writer's modules reach each other through public names only and import each other without a
cycle, ``TYPE_CHECKING`` imports included (issue 20: ``ranked.py`` used nine private members of the
Checkpointer, and the two imported each other under ``TYPE_CHECKING``, which tests/test_layering.py
skips). Static (``ast``), so it costs no import."""

from __future__ import annotations

import ast
from pathlib import Path

WRITER = Path(__file__).resolve().parents[2] / "writer"

#: Private-looking names that are public elsewhere (``os._exit``; ``torch._foreach_copy_``, torch's batched
#: copy, which the batched capture is built on: issue 23).
PUBLIC_ELSEWHERE = {"_exit", "_foreach_copy_"}


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(WRITER.glob("*.py"))}


def _own_private_names(tree: ast.Module) -> set[str]:
    """The ``_names`` this module defines: its functions and classes' members and ``self._x`` attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_")}


def private_reaches(modules: dict[str, ast.Module]) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is not this module's own."""
    found = []
    for name, tree in modules.items():
        own = _own_private_names(tree) | PUBLIC_ELSEWHERE
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in own):
                found.append(f"writer/{name}.py:{node.lineno}: {ast.unparse(node)}")
    return found


def import_edges(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Which writer modules each imports, wherever the import stands (``TYPE_CHECKING`` blocks too)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    targets = {node.module.split(".")[0]}
                elif node.level == 1:
                    targets = {a.name for a in node.names}
                elif node.module and node.module.startswith("ckptstore.writer."):
                    targets = {node.module.split(".")[2]}
                else:
                    continue
                edges[name] |= targets & set(modules)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, path = [], []

    def visit(node: str) -> None:
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        path.append(node)
        for nxt in sorted(edges[node]):
            visit(nxt)
        path.pop()

    for start in sorted(edges):
        visit(start)
    return found


def test_the_checks_see_what_they_look_for() -> None:
    tree = ast.parse("class A:\n    _mine = 1\n    def f(self, ck):\n        self._x = ck._theirs + A._mine\n")
    assert private_reaches({"m": tree}) == ["writer/m.py:4: ck._theirs"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()})[0] == ["a", "b", "a"]
    edges = import_edges({"a": ast.parse("if TYPE_CHECKING:\n    from .b import B\n"), "b": ast.parse("")})
    assert edges == {"a": {"b"}, "b": set()}


def test_no_writer_module_uses_another_modules_private_members() -> None:
    assert private_reaches(_modules()) == []


def test_writer_modules_import_each_other_without_a_cycle_not_even_under_type_checking() -> None:
    assert cycles(import_edges(_modules())) == []


#: Private names of other libraries with no public spelling (torch keeps the default group's store private).
FOREIGN_PRIVATE = {"dist.distributed_c10d._get_default_store"}


def test_no_module_of_the_store_or_the_integrations_uses_another_modules_private_members() -> None:
    """The same rule for ``ckptstore/`` and ``integrations/`` (issue 20: sink.py drove PosixStorage's
    privates, posix.py imported sink's private buffer)."""
    root = WRITER.parent
    found = []
    for package in ("ckptstore", "integrations"):
        modules = {str(p.relative_to(root / package).with_suffix("")): ast.parse(p.read_text(encoding="utf-8"))
                   for p in sorted((root / package).rglob("*.py"))}
        found += [f.replace("writer/", f"{package}/", 1) for f in private_reaches(modules)
                  if f.split(": ", 1)[1] not in FOREIGN_PRIVATE]
    assert found == []
