"""What the ``ckptstore`` command prints: tables, ``--json`` documents, sizes, dtype names and the
progress line (issue 20: the rendering half of the old 531-line cli.py, so each command reads as
"call one library function, then render")."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from ..info import CutInfo
from ..manifest import Manifest


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Progress:
    """A byte-progress line on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.enabled = sys.stderr.isatty()
        self._last = -1

    def __call__(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        pct = min(100, int(100 * self.done / self.total))
        if pct != self._last:
            self._last = pct
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {pct:3d}% {human_bytes(self.done)}/{human_bytes(self.total)}")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self._last >= 0:
            sys.stderr.write("\n")


def emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    """Prints ``doc`` as JSON under ``--json``, else the text for people."""
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(text)


CUT_HEADERS = ["step", "cut", "state", "tags", "size", "tensors", "ranks", "created (UTC)"]


def cut_rows(cuts: Sequence[CutInfo], latest: str | None) -> list[list[Any]]:
    """The rows of :data:`CUT_HEADERS` (``ls``, ``prune``)."""
    return [
        [c.step, c.id, ("LATEST " if c.id == latest else "") + ("final" if c.final else ""), ",".join(c.tags),
         human_bytes(c.nbytes), c.tensors, c.world_size, c.created_at.strftime("%Y-%m-%d %H:%M:%S")]
        for c in cuts
    ]


def file_ranks(m: Manifest) -> dict[str, int]:
    """File name -> the rank it belongs to."""
    return {f.name: f.rank for f in m.files}


def rank_counts(m: Manifest) -> list[dict[str, int]]:
    """Per rank: its files, tensors and stored bytes (of a commit record, format 5, from its table)."""
    if m.fragmented:
        return [{"rank": r, "files": p.files, "tensors": p.arrays, "nbytes": p.data_nbytes} for r, p in enumerate(m.parts)]
    counts = [{"rank": r, "files": 0, "tensors": 0, "nbytes": 0} for r in range(m.world_size)]
    ranks = file_ranks(m)
    for f in m.files:
        counts[f.rank]["files"] += 1
        counts[f.rank]["nbytes"] += f.nbytes
    for t in m.tensors:
        counts[ranks[t.file]]["tensors"] += 1
    return counts


_NUMPY_KINDS = {"f": "float", "i": "int", "u": "uint", "b": "bool", "c": "complex", "m": "timedelta", "M": "datetime"}


def dtype_label(kind: str, dtype: str) -> str:
    """One naming for both kinds of arrays: ``torch.float32``, ``numpy.float32`` (the manifest keeps
    numpy's ``dtype.str``, ``<f4``, which says the byte order too)."""
    if kind == "torch":
        return f"torch.{dtype}"
    code, size = dtype[1:2], dtype[2:].split("[")[0]
    base = _NUMPY_KINDS.get(code)
    if base is None or not size.isdigit():
        return f"numpy.{dtype}"
    if base == "bool":
        return "numpy.bool"
    unit = dtype[dtype.index("["):] if "[" in dtype else ""
    order = " (big-endian)" if dtype.startswith(">") else ""
    bits = int(size) * 8 if base in ("float", "int", "uint", "complex") else ""
    return f"numpy.{base}{bits}{'64' if not bits else ''}{unit}{order}"


__all__ = ["CUT_HEADERS", "Progress", "cut_rows", "dtype_label", "emit", "file_ranks", "human_bytes", "rank_counts",
           "table"]
