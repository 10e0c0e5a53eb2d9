"""Hostile format-4 tensor tables (issue 23): the table is parsed column by column, so each of its own
rules (exactly its keys, one entry per array in every column, indexes inside their lists, canonical
base64 digests) and every rule the rows had (sizes, dtypes, unique names, arrays inside their files)
must still refuse a crafted manifest by name. Each case damages a real store's newest cut by hand,
with LATEST's hash kept in step, and asserts a ManifestError naming the store, the cut and
MANIFEST.json, that verify reports the cut broken, that the older cut still loads and that nothing
was touched. Also: a table's digest that does not match the bytes is a CorruptCut naming the array."""

from __future__ import annotations

import base64
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore import Store
from ckptstore.errors import CorruptCut, ManifestError
from filekit import snapshot, write_manifest


@dataclass
class Setup:
    url: str
    old: str
    new: str

    def manifest_path(self) -> str:
        return os.path.join(self.url, "cuts", self.new, "MANIFEST.json")


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory) -> Setup:
    url = str(tmp_path_factory.mktemp("table") / "store")
    with Store.open(url, create=True) as s:
        old = s.save({"w": torch.arange(6, dtype=torch.float32), "step": 1}, step=1).id
        new = s.save({"a": torch.ones(4), "b": torch.zeros(2, 3, dtype=torch.int64),
                      "c": np.arange(5, dtype=np.int16), "d": torch.tensor(1.5, dtype=torch.float64),
                      "step": 2}, step=2).id
    return Setup(url, old, new)


@pytest.fixture
def setup(_pristine: Setup, tmp_path) -> Setup:
    url = str(tmp_path / "store")
    shutil.copytree(_pristine.url, url)
    return Setup(url, _pristine.old, _pristine.new)


def _doc(s: Setup) -> dict[str, Any]:
    return json.loads(open(s.manifest_path(), "rb").read())


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["tensors"][key] = value
    return mutate


def _noncanonical(doc: dict[str, Any]) -> None:
    """The same digest bytes, but the last base64 character's unused low bits set: decoders that do
    not check canonical form read the same bytes, so only an exact re-encoding notices."""
    s = doc["tensors"]["blake3"]
    n = len(base64.b64decode(s))
    assert n % 3 != 0  # 4 arrays x 32 bytes: the last quantum has spare bits (3 arrays would have none)
    body = s.rstrip("=")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(body[-1])
    doc["tensors"]["blake3"] = body[:-1] + alphabet[last | 1] + s[len(body):]


def _rows_in_v4(doc: dict[str, Any]) -> None:
    t = doc["tensors"]
    doc["tensors"] = [{"name": n, "kind": t["dtypes"][d][0], "dtype": t["dtypes"][d][1], "shape": sh, "nbytes": 0,
                       "file": doc["files"][f]["name"], "offset": o, "blake3": "0" * 64}
                      for n, d, sh, f, o in zip(t["name"], t["dtype"], t["shape"], t["file"], t["offset"])]


def _table_in_v2(doc: dict[str, Any]) -> None:
    doc["format_version"] = 2


DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "missing-key": lambda d: d["tensors"].pop("offset"),
    "extra-key": _set("nbytes", [16, 48, 10, 8]),
    "not-an-object": lambda d: d.update(tensors="a,b,c"),
    "short-column": lambda d: d["tensors"]["shape"].pop(),
    "dtype-index-past-the-list": lambda d: d["tensors"]["dtype"].__setitem__(0, len(d["tensors"]["dtypes"])),
    "dtype-index-negative": lambda d: d["tensors"]["dtype"].__setitem__(0, -1),
    "dtype-index-a-bool": lambda d: d["tensors"]["dtype"].__setitem__(0, False),
    "file-index-past-the-list": lambda d: d["tensors"]["file"].__setitem__(1, 1),
    "unknown-dtype": lambda d: d["tensors"]["dtypes"].__setitem__(0, ["torch", "float99"]),
    "unknown-kind": lambda d: d["tensors"]["dtypes"].__setitem__(0, ["jax", "float32"]),
    "dtype-pair-too-long": lambda d: d["tensors"]["dtypes"][0].append("x"),
    "digests-not-base64": _set("blake3", "not base64!"),
    "digests-one-short": lambda d: d["tensors"].update(blake3=_b64(base64.b64decode(d["tensors"]["blake3"])[:-32])),
    "digests-non-canonical": _noncanonical,
    "negative-size": lambda d: d["tensors"]["shape"].__setitem__(0, [-4]),
    "size-a-float": lambda d: d["tensors"]["shape"].__setitem__(0, [4.0]),
    "shape-not-a-list": lambda d: d["tensors"]["shape"].__setitem__(0, 4),
    "too-many-dims": lambda d: d["tensors"]["shape"].__setitem__(0, [1] * 65),
    "wrong-size-for-the-file": lambda d: d["tensors"]["shape"].__setitem__(0, [400000]),
    "duplicate-name": lambda d: d["tensors"]["name"].__setitem__(1, d["tensors"]["name"][0]),
    "empty-name": lambda d: d["tensors"]["name"].__setitem__(0, ""),
    "name-not-a-string": lambda d: d["tensors"]["name"].__setitem__(0, 7),
    "offset-past-the-file": lambda d: d["tensors"]["offset"].__setitem__(0, d["files"][0]["raw_nbytes"]),
    "offset-negative": lambda d: d["tensors"]["offset"].__setitem__(0, -1),
    "rows-in-a-v4-manifest": _rows_in_v4,
    "table-in-a-v2-manifest": _table_in_v2,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_crafted_table_is_a_named_manifest_error_and_loses_nothing(setup: Setup, damage: str) -> None:
    s = setup
    doc = _doc(s)
    assert doc["format_version"] == 4 and len(doc["tensors"]["name"]) == 4
    DAMAGE[damage](doc)
    write_manifest(s.url, s.new, json.dumps(doc, separators=(",", ":")).encode())
    before = snapshot(s.url)
    with pytest.raises(ManifestError) as ei:
        ckptstore.load(s.url, cut=s.new)
    err = ei.value
    assert (err.store, err.cut) == (s.url, s.new) and str(err.path).endswith("MANIFEST.json"), (damage, err)
    with Store.open(s.url, readonly=True) as ro:
        assert ("manifest-broken", s.new) in [(f.kind, f.cut) for f in ro.verify().errors]
    assert ckptstore.load(s.url, cut=s.old)["step"] == 1
    assert snapshot(s.url) == before


def test_a_table_digest_that_does_not_match_its_bytes_names_the_array(setup: Setup) -> None:
    """The digests are still per array: one wrong digest in the base64 string fails that array only."""
    s = setup
    doc = _doc(s)
    raw = bytearray(base64.b64decode(doc["tensors"]["blake3"]))
    second = doc["tensors"]["name"][1]
    raw[32 + 5] ^= 0xFF
    doc["tensors"]["blake3"] = _b64(bytes(raw))
    write_manifest(s.url, s.new, json.dumps(doc, separators=(",", ":")).encode())
    with pytest.raises(CorruptCut) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert repr(second) in str(ei.value)
    with Store.open(s.url, readonly=True) as ro:
        errs = ro.verify().errors
    assert [(f.kind, f.cut) for f in errs] == [("hash-mismatch", s.new)] and repr(second) in errs[0].message


def test_the_table_holds_the_records_the_api_shows(setup: Setup) -> None:
    """What the table encodes is what the manifest model gives back: hex digests, sizes, kinds."""
    s = setup
    doc = _doc(s)
    with Store.open(s.url, readonly=True) as ro:
        recs = ro.manifest(s.new).tensors
    t = doc["tensors"]
    assert [r.name for r in recs] == t["name"]
    assert [[r.kind, r.dtype] for r in recs] == [t["dtypes"][i] for i in t["dtype"]]
    assert "".join(r.blake3 for r in recs) == base64.b64decode(t["blake3"]).hex()
    assert {r.name: r.nbytes for r in recs} == {"a": 16, "b": 48, "c": 10, "d": 8}
