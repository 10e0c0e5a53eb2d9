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
    _assert_acyclic(graph)


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    """Depth-first: raises naming the first import cycle found."""
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


# ------------------------------------------------------------------ the layer table (issue 20)
#: Every module of the three packages, by layer, lowest first: a module imports modules of its own
#: layer or of lower ones only (imports inside functions and under ``TYPE_CHECKING`` included). A new
#: module must be placed here: where it sits is a decision. ``pkg.*`` stands for a package and its modules.
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["errors", "kinds", "version", "ident", "hashing", "events", "gcpause", "metachecks", "layout",
              "retention"]),
    ("format", ["models", "format", "values", "tree.*", "arrays", "attached.*", "records", "jsontext", "fragments", "manifest", "latest", "marks",
                "labels", "info"]),
    ("storage", ["storage.*", "paths"]),
    ("cut", ["shardwrite", "shardarrays", "shardread", "shardcheck", "shards", "protocol", "options", "intent",
             "pending", "lease", "lock", "recovery", "verify", "selection", "pointed", "loader", "ranks", "collective",
             "rescue", "dtensors", "assemble"]),
    ("ops", ["core", "collect", "cutting", "opening", "reading", "pruning", "labeling", "repairing", "saving",
             "tierparts", "writeback"]),
    ("facade", ["store", "spi", "", "export", "resume", "dcp", "mirroring", "mirroring_ranks"]),
    ("cli", ["cli.*"]),
    ("writer", ["writer.*"]),
    ("integrations", ["integrations.*"]),
]
#: Modules kept one release for old import paths, which import the new home above them.
DEPRECATED_SHIMS = {"ckptstore.dcp"}
#: Imports for annotations only. Each is a decision: most hide a cycle (issue 20 found one).
TYPE_CHECKING_EDGES = {
    ("ckptstore.pending", "ckptstore.storage"),
    *{("ckptstore.integrations.dcp", f"ckptstore.integrations.dcp.{m}") for m in ("metadata", "native", "reader",
                                                                                  "writer")},
}
ROOTS = {"ckptstore": "ckptstore", "ckptstore.writer": "writer", "ckptstore.integrations": "integrations"}


def _all_modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (file, is a package), for ckptstore, ckptstore.writer and ckptstore.integrations."""
    mods: dict[str, tuple[str, bool]] = {}
    for pkg, root in ROOTS.items():
        for dirpath, _dirs, files in os.walk(os.path.join(REPO, root)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, f), os.path.join(REPO, root))[:-3].split(os.sep)
                is_pkg = parts[-1] == "__init__"
                mods[".".join([pkg] + (parts[:-1] if is_pkg else parts))] = (os.path.join(dirpath, f), is_pkg)
    return mods


def _edges() -> dict[str, dict[str, bool]]:
    """Module -> {imported module: only under TYPE_CHECKING}, every import wherever it stands."""
    import ast

    mods = _all_modules()
    graph: dict[str, dict[str, bool]] = {}
    for mod, (path, is_pkg) in mods.items():
        here = mod if is_pkg else mod.rsplit(".", 1)[0]
        deps: dict[str, bool] = {}
        todo = [(ast.parse(open(path, encoding="utf-8").read()), False)]
        while todo:
            node, typing_only = todo.pop()
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                targets = [f"{target}.{a.name}" for a in node.names] if target.startswith("ckptstore") else []
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("ckptstore")]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != mod:
                    deps[t] = deps.get(t, True) and typing_only
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                    todo += [(c, True) for c in child.body] + [(c, typing_only) for c in child.orelse]
                else:
                    todo.append((child, typing_only))
        graph[mod] = deps
    return graph


def _layer_of() -> dict[str, int]:
    out: dict[str, int] = {}
    for mod in _all_modules():
        short = mod[len("ckptstore."):] if mod != "ckptstore" else ""
        hits = [i for i, (_, names) in enumerate(LAYERS) for n in names
                if short == n or (n.endswith(".*") and (short == n[:-2] or short.startswith(n[:-1])))]
        assert len(hits) == 1, f"{mod} is in {len(hits)} layers of LAYERS: place it in exactly one"
        out[mod] = hits[0]
    return out


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones() -> None:
    layer, graph = _layer_of(), _edges()
    assert {"ckptstore.store", "ckptstore.writer.pipeline", "ckptstore.integrations.dcp.writer"} <= set(graph)
    upward = [f"{m} ({LAYERS[layer[m]][0]}) imports {d} ({LAYERS[layer[d]][0]})"
              for m, deps in graph.items() if m not in DEPRECATED_SHIMS for d in deps if layer[d] > layer[m]]
    assert upward == []


def test_no_import_cycle_across_the_packages_type_checking_imports_included() -> None:
    _assert_acyclic({m: set(d) for m, d in _edges().items()})


def test_type_checking_imports_are_the_counted_ones() -> None:
    found = {(m, d) for m, deps in _edges().items() for d, typing_only in deps.items() if typing_only}
    assert found == TYPE_CHECKING_EDGES, f"{len(found)} TYPE_CHECKING imports, {len(TYPE_CHECKING_EDGES)} counted"


#: What the writer and the integrations may import of the store layer (issue 20: "one module they
#: import, not 21 store modules"): the user API, the service interface and the exception tree.
STORE_SURFACE = {"ckptstore", "ckptstore.spi", "ckptstore.errors"}


def test_the_writer_and_the_integrations_reach_the_store_only_through_its_surface() -> None:
    layer, graph = _layer_of(), _edges()
    store_top = max(i for i, (name, _) in enumerate(LAYERS) if name == "cli")
    reaches = sorted(f"{m} imports {d}" for m, deps in graph.items() if layer[m] > store_top
                     for d in deps if layer[d] <= store_top and d not in STORE_SURFACE)
    assert reaches == []
