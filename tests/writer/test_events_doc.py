"""docs/writer.md lists every event the writer and ``Store.save`` emit, with every field they set: the
code's ``emit("<kind>", field=...)`` calls are read with ``ast`` and compared with the doc's tables
(issue 20: "every event kind in writer.md"; ``warning`` was filed under the store's kinds and
``committed.world_size`` was missing)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "writer.md"

#: Each events table of docs/writer.md (by the words of its heading) and the code whose events it lists.
TABLES = {
    "Checkpointer": sorted((ROOT / "writer").glob("*.py")),
    "Store.save": [ROOT / "ckptstore" / "saving.py"],
}


def _dict_keys(node: ast.expr) -> set[str]:
    """The keys of ``**{...}`` and ``**({...} if c else {...})`` (other ``**`` values are not read)."""
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, ast.IfExp):
        return _dict_keys(node.body) | _dict_keys(node.orelse)
    return set()


def emitted(paths: list[Path]) -> dict[str, set[str]]:
    """Every ``<x>.emit("<kind>", ...)`` in ``paths``: kind -> the field names any such call sets."""
    kinds: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                continue
            fields = kinds.setdefault(node.args[0].value, set())
            for kw in node.keywords:
                fields |= {kw.arg} if kw.arg is not None else _dict_keys(kw.value)
    return kinds


def documented(text: str) -> dict[str, dict[str, set[str]]]:
    """The ``## Events`` section's tables, by heading word: kind -> the backticked names of its row."""
    section = text.split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, set[str]]] = {}
    rows: dict[str, set[str]] | None = None
    for line in section.splitlines():
        if line.startswith("### "):
            name = next((n for n in TABLES if n in line), None)
            rows = tables.setdefault(name, {}) if name else None
        elif rows is not None and line.startswith("| `"):
            kinds_cell, fields_cell = line.strip("|").split("|", 1)
            for kind in re.findall(r"`([^`]+)`", kinds_cell):
                rows[kind] = set(re.findall(r"`([^`]+)`", fields_cell))
    return tables


def test_the_parsers_see_what_they_look_for() -> None:
    code = emitted([Path(__file__)])  # this file's own emit below (never run)
    assert code == {"probe": {"step", "cut", "world_size"}}
    doc = documented("# x\n## Events\n### Checkpointer\n| event | fields |\n|---|---|\n"
                     "| `a`, `b` | `step`, `timings` {`total`} |\n## Next\n| `c` | `d` |\n")
    assert doc == {"Checkpointer": {"a": {"step", "timings", "total"}, "b": {"step", "timings", "total"}}}


def _never_run(events) -> None:  # noqa: ANN001 - a fixture for the parser test above
    events.emit("probe", step=1, cut="c", **({"world_size": 2} if events else {}))


def test_writer_md_lists_every_event_kind_and_field_the_code_emits() -> None:
    doc = documented(DOC.read_text(encoding="utf-8"))
    problems = []
    for table, paths in TABLES.items():
        rows = doc.get(table)
        if rows is None:
            problems.append(f"no events table for {table} under '## Events'")
            continue
        code = emitted(paths)
        for kind, fields in sorted(code.items()):
            if kind not in rows:
                problems.append(f"{table}: event {kind!r} is emitted but not listed")
            elif fields - rows[kind]:
                problems.append(f"{table}: event {kind!r} sets {sorted(fields - rows[kind])}, not listed")
        problems += [f"{table}: event {kind!r} is listed but never emitted" for kind in sorted(set(rows) - set(code))]
    assert not problems, "docs/writer.md, '## Events':\n" + "\n".join(problems)
