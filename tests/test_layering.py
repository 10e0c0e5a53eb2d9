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
