"""The commit record of a cut of several ranks (format 5, issue 22): its table of part references is
checked as strictly as the arrays' table; a bad reference a rank posts commits nothing and names the
rank; a commit record holds no part of a rank (its fragments do)."""

from __future__ import annotations

import base64
import json

import pytest

from ckptstore.errors import CorruptCut, ManifestError
from ckptstore.fragments import BadPart, PartRef, parts_from_json, parts_to_table, table_to_parts
from ckptstore.manifest import Manifest
import ckptstore
from ckptstore import cutting
from ckptstore.store import core_of

DIGEST = "ab" * 32


def refs(n: int) -> list[PartRef]:
    return [PartRef(f"rank{r:05d}.json", 100 + r, DIGEST, 4096, 1, 3, 0, False) for r in range(n)]


def test_references_round_trip_through_the_table():
    parts = refs(5)
    table = parts_to_table(parts)
    assert table["name"][3] == "rank00003.json" and len(base64.b64decode(table["blake3"])) == 5 * 32
    assert table_to_parts(json.loads(json.dumps(table))) == parts
    assert parts_from_json([p.to_json() for p in parts]) == parts


@pytest.mark.parametrize("field, value", [("name", "rank00009.json"), ("name", "../MANIFEST.json"),
                                          ("nbytes", -1), ("files", True), ("arrays", 1.0), ("attached", 9),
                                          ("blake3", "AB" * 32), ("blake3", "ab" * 31), ("pickled", 0)])
def test_a_bad_reference_names_its_rank(field, value):
    docs = [p.to_json() for p in refs(4)]
    docs[2][field] = value
    with pytest.raises(BadPart) as exc:
        parts_from_json(docs)
    assert exc.value.rank == 2 and str(exc.value).startswith("rank 2")


def test_a_reference_with_a_missing_or_extra_key_names_its_rank():
    docs = [p.to_json() for p in refs(3)]
    docs[1]["extra"] = 1
    with pytest.raises(BadPart) as exc:
        parts_from_json(docs)
    assert exc.value.rank == 1


@pytest.mark.parametrize("change", ["short column", "padding", "not base64", "extra key"])
def test_a_bad_table_is_refused(change):
    table = parts_to_table(refs(3))
    if change == "short column":
        table["files"] = table["files"][:2]
    elif change == "padding":
        table["blake3"] = table["blake3"] + "=="
    elif change == "not base64":
        table["blake3"] = "!" * len(table["blake3"])
    else:
        table["ranks"] = [0, 1, 2]
    with pytest.raises(ValueError):
        table_to_parts(table)


def _record(**change) -> bytes:
    doc = {"kind": "ckptstore.manifest", "format_version": 5, "cut": "step-000000000003-0123abcd", "step": 3,
           "tags": [], "final": False, "created_at": "2024-01-02T03:04:05+00:00",
           "writer": {"host": "h", "pid": 1, "ckptstore_version": "x", "mode": "sync"}, "world_size": 3,
           "metadata": {}, "pickled": False, "parts": parts_to_table(refs(3))}
    doc.update(change)
    return json.dumps(doc).encode()


def test_a_commit_record_parses_and_holds_no_part():
    m = Manifest.from_bytes(_record())
    assert m.fragmented and m.world_size == 3 and m.file_count == 3 and m.array_count == 9
    assert m.files == [] and m.tensors == [] and m.nbytes == 3 * 4096
    assert json.loads(m.to_bytes()) == json.loads(_record())
    with pytest.raises(ValueError, match="fragments"):
        m.for_rank(0)


@pytest.mark.parametrize("change", [{"world_size": 2}, {"world_size": 1, "parts": parts_to_table(refs(1))},
                                    {"pickled": True}, {"tree": {"t": "ranks", "ranks": []}},
                                    {"files": [{"name": "x"}]}, {"format_version": 4}])
def test_a_commit_record_that_is_not_one_is_refused(change):
    with pytest.raises(ManifestError):
        Manifest.from_bytes(_record(**change))


def test_a_bad_reference_posted_to_the_coordinator_commits_nothing(tmp_path):
    store = ckptstore.Store.open(str(tmp_path), create=True)
    pending = cutting.begin_cut(core_of(store), 3, writer="test", cut=None, world_size=3)
    cut = pending.id
    docs = [p.to_json() for p in refs(3)]
    docs[1]["name"] = "rank00000.json"
    with pytest.raises(CorruptCut) as exc:
        pending.take_parts(docs)
    assert exc.value.path == f"cuts/{cut}/rank00001.json" and "rank 1" in exc.value.message
    pending.abandon()
    assert not (tmp_path / "cuts" / cut).exists() and store.latest() is None
    store.close()
