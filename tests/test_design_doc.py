"""docs/design.md is true to the code (issue 20): its layer map names every module of the three
packages, and its list of the modules that import torch is exactly the modules that do."""

from __future__ import annotations

import ast
import os
import re

from test_layering import REPO, _all_modules

DOC = os.path.join(REPO, "docs", "design.md")


def _layer_map() -> str:
    text = open(DOC, encoding="utf-8").read()
    section = text.split("## Layers", 1)[1]
    return section.split("```", 2)[1]


def _imports_torch(path: str) -> bool:
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import) and any(a.name == "torch" or a.name.startswith("torch.") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def _doc_name(mod: str, is_pkg: bool) -> str:
    """How the map names a module: ``name.py``, a package as ``name/``."""
    last = mod.rsplit(".", 1)[-1]
    return f"{last}/" if is_pkg else f"{last}.py"


def test_the_layer_map_names_every_module() -> None:
    words = set(re.findall(r"[\w]+(?:\.py|/)", _layer_map()))
    missing = sorted(mod for mod, (_, is_pkg) in _all_modules().items()
                     if "." in mod and not mod.rsplit(".", 1)[-1].startswith("__")
                     and _doc_name(mod, is_pkg) not in words)
    assert missing == [], f"docs/design.md's layer map does not name {missing}"


def test_the_doc_lists_exactly_the_modules_that_import_torch() -> None:
    text = open(DOC, encoding="utf-8").read()
    m = re.search(r"Modules that import torch[^:]*:(.*?)\n\n", text, re.S)
    assert m, "docs/design.md has no 'Modules that import torch:' paragraph"
    listed = set(re.findall(r"`(ckptstore[\w.]*)`", m.group(1)))
    actual = {mod for mod, (path, _) in _all_modules().items() if _imports_torch(path)}
    assert actual, "control: some module imports torch"
    assert listed == actual
