"""DCP's adapter lives with the integrations and the store layer knows nothing of DCP (issue 20).

``ckptstore.integrations.dcp`` is the adapter; ``ckptstore.dcp`` re-exports it for one release and warns.
verify's DCP notice comes from the integration through a generic hook (``ckptstore.metachecks``) that
``ckptstore verify`` loads by the metadata key, without torch, so its output on DCP cuts is unchanged.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
import ckptstore.integrations.dcp as integration
from ckptstore import Finding, Store
from ckptstore.metachecks import NoticeKind, register

REPO = Path(__file__).resolve().parents[2]
#: verify's notice on a DCP cut with one byte-IO item "step", word for word as before issue 20.
BYTE_IO_NOTICE = ("1 value(s) saved through DCP as torch.save bytes (e.g. 'step'): stored and hashed as uint8 "
                  "arrays, never unpickled by ckptstore; DCP's loader unpickles them (weights_only=False), so "
                  "load this cut through DCP only from a store you trust")


def test_the_old_path_warns_and_is_the_same_adapter() -> None:
    sys.modules.pop("ckptstore.dcp", None)  # imported by an earlier test: import it afresh
    with pytest.warns(DeprecationWarning, match="ckptstore.integrations.dcp"):
        old = importlib.import_module("ckptstore.dcp")
    for name in integration.__all__:
        assert getattr(old, name) is getattr(integration, name), name
    assert old.METADATA_KEY == "ckptstore.dcp"  # the manifest key (on disk) is unchanged


def _code_names(tree: ast.AST) -> set[str]:
    """Identifiers, imported modules and string constants other than docstrings."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.update(filter(None, (n.name, n.asname)))
        elif isinstance(n, ast.ImportFrom) and n.module:
            names.add(n.module)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            names.add(n.value)
    return names


def test_the_store_layer_names_no_dcp_in_its_code() -> None:
    """Only the deprecated shim imports the adapter; no other store module names DCP in code (its DCP
    key, notice kind and checks were in verify.py). Messages that point users at the DCP reader are
    words, not knowledge of DCP: a name, a key or an import is."""
    offending = {}
    for path in sorted((REPO / "ckptstore").rglob("*.py")):
        if path.name == "dcp.py" and path.parent.name == "ckptstore":
            continue
        hits = {n for n in _code_names(ast.parse(path.read_text()))
                if "dcp" in n.lower() and not any(c.isspace() for c in n)}  # a name or key, not a message
        if hits:
            offending[str(path.relative_to(REPO))] = sorted(hits)
    assert offending == {}


class ExampleNotice(NoticeKind):
    NOTE = "example-note"


def _example_check(doc: object) -> list[tuple[ExampleNotice, str]]:
    return [(ExampleNotice.NOTE, f"{len(doc)} note(s)")] if isinstance(doc, list) and doc else []


def test_an_integration_registers_a_notice_check_for_its_metadata_key(tmp_path: Path) -> None:
    register("example.notes", _example_check, ExampleNotice)
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as store:
        noted = store.save({"a": np.arange(4)}, step=1, metadata={"example.notes": ["x", "y"]})
        store.save({"a": np.arange(4)}, step=2, metadata={"other": ["x"]})
        report = store.verify()
    assert report.ok
    assert [(f.severity, f.kind, f.cut, f.message) for f in report.findings] == [
        ("notice", ExampleNotice.NOTE, noted.id, "2 note(s)")]
    assert report.findings[0].path == f"cuts/{noted.id}/MANIFEST.json"
    assert '"kind": "example-note"' in json.dumps(report.to_json())
    assert Finding("notice", "example-note", "m").kind is ExampleNotice.NOTE  # its spelling, as the store's kinds


def test_cli_verify_of_a_dcp_cut_reports_the_same_notice_without_torch(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP without a process group says so
        dcp.save({"w": torch.arange(6.0), "step": 3}, storage_writer=integration.StoreWriter(url, step=1))
    code = ("import json, sys\nfrom ckptstore.cli import main\n"
            f"rc = main(['verify', {url!r}, '--json'])\n"
            "print('RESULT=' + json.dumps({'rc': rc, 'mods': sorted(sys.modules)}))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    result = json.loads(next(ln for ln in lines if ln.startswith("RESULT="))[len("RESULT="):])
    report = json.loads("\n".join(ln for ln in lines if not ln.startswith("RESULT=")))
    assert result["rc"] == 0 and report["ok"]
    cut = ckptstore.Store.open(url, readonly=True).latest().id
    assert [(f["severity"], f["kind"], f["cut"], f["message"]) for f in report["findings"]] == [
        ("notice", "dcp-byte-io", cut, BYTE_IO_NOTICE)]
    assert "ckptstore.integrations.dcp.checks" in result["mods"]
    assert not any(m == "torch" or m.startswith("torch.") for m in result["mods"]), "verify imported torch"
