"""The duplicate-key proof of a parsed manifest (issue 10, item 11; made cheap in issue 23): a document is
trusted from the fast parse only when ``raw_key_bound`` of its bytes equals ``doc_key_floor`` of what it
parsed to. The floor may leave keys out (a version 4 table's columns, a row's fields), but only where a
valid manifest holds none, so a duplicate hidden there still sends the document to the checked parse."""

from __future__ import annotations

import json
import random
import re

import pytest

from ckptstore.errors import ManifestError
from ckptstore.manifest import Manifest
from ckptstore.models import json_key_count, raw_key_bound


def _reference_count(value: object) -> int:
    """The object keys in a parsed document, one value at a time (the definition ``json_key_count`` meets)."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            n += len(v)
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
    return n


def _random_doc(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 6 or r < 0.3:
        return rng.choice([1, "a", None, 2.5, True, [], {}, ':"', "\\"])
    if r < 0.65:
        return {rng.choice(["k", "a:", 'q"', "\\", ""]) + str(rng.randrange(9)): _random_doc(rng, depth + 1)
                for _ in range(rng.randrange(5))}
    return [_random_doc(rng, depth + 1) for _ in range(rng.randrange(5))]


def test_json_key_count_is_the_count_of_every_key() -> None:
    rng = random.Random(23)
    for _ in range(2000):
        doc = _random_doc(rng)
        assert json_key_count(doc) == _reference_count(doc)
    deep: object = {"a": 1}
    for _ in range(3000):  # deeper than recursion would go
        deep = {"x": [deep]}
    assert json_key_count(deep) == 3001


_WS = re.compile(rb'"[ \t\r\n]+:')


def _reference_bound(data: bytes) -> int | None:
    """``raw_key_bound`` by its definition: every ``":`` after an even run of backslashes; None when a
    quote is followed by whitespace and a colon, or a run of nine backslashes or more precedes one."""
    if _WS.search(data):
        return None
    n = 0
    for m in re.finditer(rb'(\\*)":', data):
        run = len(m.group(1))
        if run >= 9:
            return None
        n += run % 2 == 0
    return n


def test_raw_key_bound_meets_its_definition() -> None:
    rng = random.Random(7)
    alphabet = [b'"', b":", b"\\", b" ", b"\n", b"\t", b"\r", b"a", b"{", b"}", b","]
    for _ in range(20000):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(16)))
        assert raw_key_bound(data) == _reference_bound(data), data
    for _ in range(500):
        doc = _random_doc(rng)
        for text in (json.dumps(doc, separators=(",", ":")), json.dumps(doc, indent=1), json.dumps(doc)):
            data = (text + "\n").encode()
            bound = raw_key_bound(data)
            assert bound == _reference_bound(data)
            assert bound is None or bound >= _reference_count(doc)


def _manifest_bytes(tmp_path) -> bytes:
    import torch

    import ckptstore

    with ckptstore.Store.open(str(tmp_path / "s"), create=True) as st:
        st.save({"a": torch.ones(3), "b": {"c": torch.zeros(2), "n": 5}}, step=1)
        return st.manifest().to_bytes()


def test_a_writer_manifest_takes_the_fast_path_exactly(tmp_path) -> None:
    data = _manifest_bytes(tmp_path)
    doc = json.loads(data)
    assert doc["format_version"] == 4
    # The floor leaves nothing out of a valid manifest: the proof holds, and the document is trusted.
    assert Manifest.doc_key_floor(doc) == _reference_count(doc) == raw_key_bound(data)
    Manifest.from_bytes(data)


@pytest.mark.parametrize("column", ["name", "shape", "offset", "dtypes"])
def test_a_duplicate_hidden_in_a_table_column_is_still_named(tmp_path, column: str) -> None:
    """An object inside a column is not counted by the floor: the bound then exceeds it, and the checked
    parse names the repeated key rather than trusting a parse that kept the last one."""
    doc = json.loads(_manifest_bytes(tmp_path))
    doc["tensors"][column][0] = {"x": 1, "y": 2}
    data = json.dumps(doc, separators=(",", ":")).replace('"y":2', '"x":2').encode()
    assert Manifest.doc_key_floor(json.loads(data)) < raw_key_bound(data)
    with pytest.raises(ManifestError, match="repeats the key 'x'"):
        Manifest.from_bytes(data)


def test_a_duplicate_in_a_row_of_a_version_2_manifest_is_named(tmp_path) -> None:
    doc = json.loads(_manifest_bytes(tmp_path))
    m = Manifest.from_bytes(json.dumps(doc).encode())
    rows = [t.row() for t in m.tensors]
    doc.update(format_version=2, tensors=rows)
    text = json.dumps(doc, separators=(",", ":"))
    Manifest.from_bytes(text.encode())  # control: the rows themselves parse
    crafted = text.replace('"offset":', '"offset":0,"offset":', 1).encode()
    with pytest.raises(ManifestError, match="repeats the key 'offset'"):
        Manifest.from_bytes(crafted)


def test_an_escaped_colon_cannot_hide_a_duplicate(tmp_path) -> None:
    """A string value starting with ``:`` counts in the bound only when written plainly; written as
    ``\\u003a`` it does not, and a duplicate key beside it still makes the bound exceed the floor."""
    doc = json.loads(_manifest_bytes(tmp_path))
    doc["metadata"] = {"note": ":x"}
    text = json.dumps(doc, separators=(",", ":")).replace('":x"', '"\\u003ax"')
    crafted = text.replace('"step":1,', '"step":1,"step":1,', 1).encode()
    with pytest.raises(ManifestError, match="repeats the key 'step'"):
        Manifest.from_bytes(crafted)
