"""Layering, checked in a fresh interpreter: ``import ckptstore`` and the CLI load neither torch nor the
writer, so ``ckptstore verify`` runs on a machine without torch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("torch", "ckptstore.writer")


def _modules_after(code: str) -> set[str]:
    """Runs ``code`` in a fresh interpreter (from the repo root) and returns its sys.modules."""
    script = code + "\nimport sys, json\nprint('MODULES=' + json.dumps(sorted(sys.modules)))\n"
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("MODULES=")][-1]
    return set(json.loads(line[len("MODULES="):]))


def _loaded(mods: set[str], name: str) -> bool:
    return name in mods or any(m.startswith(name + ".") for m in mods)


def test_import_ckptstore_loads_neither_torch_nor_writer() -> None:
    mods = _modules_after(
        "import ckptstore\n"
        # The real package (not an empty namespace package that imported nothing).
        "assert ckptstore.__file__.endswith('__init__.py'), ckptstore.__file__\n"
        "assert ckptstore.Store and ckptstore.load\n"
    )
    assert "ckptstore.store" in mods
    for name in FORBIDDEN:
        assert not _loaded(mods, name), f"import ckptstore loaded {name}"


def test_import_cli_loads_neither_torch_nor_writer() -> None:
    if importlib.util.find_spec("ckptstore.cli") is None:
        pytest.skip("ckptstore/cli.py does not exist yet")
    mods = _modules_after("import ckptstore.cli\nassert callable(ckptstore.cli.main)\n")
    assert "ckptstore.cli" in mods
    for name in FORBIDDEN:
        assert not _loaded(mods, name), f"import ckptstore.cli loaded {name}"


def test_the_check_sees_what_it_looks_for() -> None:
    """Control: the names checked above are the real module names, so the checks can fail."""
    mods = _modules_after("import ckptstore.writer\n")
    assert _loaded(mods, "ckptstore.writer")


def test_numpy_only_save_verify_load_never_imports_torch(tmp_path) -> None:
    """A store used without torch (numpy state, audits, the CLI's verify) never imports it."""
    url = str(tmp_path / "store")
    code = (
        "import numpy as np, ckptstore\n"
        f"url = {url!r}\n"
        "with ckptstore.Store.open(url, create=True) as s:\n"
        "    s.save({'a': np.arange(10), 'x': 1.5, 'n': [np.float32(2)]}, step=1)\n"
        "    assert s.verify().ok\n"
        "out = ckptstore.load(url)\n"
        "assert (out['a'] == np.arange(10)).all() and out['x'] == 1.5\n"
    )
    if importlib.util.find_spec("ckptstore.cli") is not None:
        code += "from ckptstore.cli import main\nassert main(['verify', url]) == 0\n"
    mods = _modules_after(code)
    for name in FORBIDDEN:
        assert not _loaded(mods, name), f"a numpy-only session loaded {name}"


def _walk_runtime(tree):  # type: ignore[no-untyped-def]
    """ast.walk, minus ``if TYPE_CHECKING:`` blocks (imports for annotations only never run)."""
    import ast

    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _package_imports() -> dict[str, set[str]]:
    """Static import graph of the store package (every import, also those inside functions): module ->
    the ckptstore modules it imports. ``from . import x`` counts as importing ``ckptstore.x`` when x is
    a module, and as importing the package itself otherwise."""
    import ast
    import pkgutil

    pkg_dir = os.path.join(REPO, "ckptstore")
    modules = {"ckptstore." + m.name for m in pkgutil.walk_packages([pkg_dir])}
    for m in list(modules):
        sub = os.path.join(pkg_dir, m.split(".", 1)[1])
        if os.path.isdir(sub):
            modules |= {f"{m}.{s.name}" for s in pkgutil.iter_modules([sub])}
    graph: dict[str, set[str]] = {}
    for mod in sorted(modules):
        rel = mod.split(".")[1:]
        path = os.path.join(pkg_dir, *rel)
        is_pkg = os.path.isdir(path)
        path = os.path.join(path, "__init__.py") if is_pkg else path + ".py"
        tree = ast.parse(open(path, encoding="utf-8").read())
        here = mod if is_pkg else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in _walk_runtime(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("ckptstore"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("ckptstore")}
        graph[mod] = {d for d in deps if d != mod}
    return graph


def test_store_modules_form_no_import_cycle_and_never_import_the_package_or_the_writer() -> None:
    graph = _package_imports()
    assert "ckptstore.store" in graph and "ckptstore.storage.posix" in graph  # control: the graph is real
    for mod, deps in graph.items():
        assert not any(d.startswith("ckptstore.writer") for d in deps), f"{mod} imports the writer"
        if mod not in ("ckptstore", "ckptstore.cli"):  # the CLI is the one layer above the public facade
            assert "ckptstore" not in deps, f"{mod} imports the package __init__ (e.g. __version__)"
    graph.pop("ckptstore", None)
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for dep in sorted(graph.get(node, ())):
            if seen.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in seen:
                visit(dep, stack + [dep])
        seen[node] = 2

    for mod in sorted(graph):
        if mod not in seen:
            visit(mod, [mod])
