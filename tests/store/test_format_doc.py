"""docs/format.md's table of records and versions is the code's (issue 20: the doc said readers accept
1 and 2 while they accept 1, 2 and 3)."""

from __future__ import annotations

import os
import re

from ckptstore.format import SHARD_FORMAT_VERSION
from ckptstore.labels import Label
from ckptstore.latest import Pointer, StoreIdentity
from ckptstore.manifest import FRAGMENTS_FORMAT_VERSION, Manifest, RankRecord
from ckptstore.marks import BadCut, FinalMark, Mark

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "format.md")
MODELS = [Manifest, RankRecord, Pointer, StoreIdentity, Label, Mark, FinalMark, BadCut]


def _table() -> dict[str, tuple[list[int], list[int]]]:
    rows = {}
    for line in open(DOC, encoding="utf-8"):
        m = re.match(r"\| [^|]+ \| `(ckptstore\.\w+)` \| ([^|]+) \| ([^|]+) \|$", line.strip())
        if m:
            rows[m.group(1)] = ([int(v) for v in re.findall(r"\d+", m.group(2))],
                                [int(v) for v in re.findall(r"\d+", m.group(3))])
    return rows


def test_every_record_kind_and_version_is_in_the_doc_as_the_code_has_it() -> None:
    rows = _table()
    assert set(rows) == {m.KIND for m in MODELS}
    for model in MODELS:
        written, read = rows[model.KIND]
        expected = [model.FORMAT_VERSION] + ([FRAGMENTS_FORMAT_VERSION] if model is Manifest else [])
        assert written == expected, model.KIND
        assert read == list(model.READ_VERSIONS), model.KIND


def test_the_shard_layout_version_in_the_doc_is_the_code_s() -> None:
    assert f'"format_version": "{SHARD_FORMAT_VERSION}"' in open(DOC, encoding="utf-8").read()
