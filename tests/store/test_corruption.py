"""Bad input on disk: every damaged, truncated, missing or hostile file gets a clear error (a
CkptStoreError subclass naming the store, the cut and the file), ``verify`` reports it, and nothing is
lost: the previous cut still loads and no damaged file is deleted behind the user's back."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
import filekit
from filekit import flip_byte, snapshot
from ckptstore import Store, StoreOptions
from ckptstore.hashing import digest
from ckptstore.store import open_for_repair

# --------------------------------------------------------------------------------------------------
# helpers: build a store with two cuts, then damage it by hand the way a disk, a user or an attacker
# would; the manifest and LATEST hashes are rewritten where a test wants only one check to fire.


@dataclass
class Setup:
    url: str
    old: ckptstore.CutInfo
    new: ckptstore.CutInfo
    old_state: dict[str, Any]
    new_state: dict[str, Any]

    def cut_dir(self, cut: str) -> str:
        return os.path.join(self.url, "cuts", cut)

    def shard(self, cut: str, index: int = 0) -> str:
        names = sorted(n for n in os.listdir(self.cut_dir(cut)) if n != "MANIFEST.json")
        return os.path.join(self.cut_dir(cut), names[index])

    def manifest_path(self, cut: str) -> str:
        return os.path.join(self.cut_dir(cut), "MANIFEST.json")


def _states() -> tuple[dict[str, Any], dict[str, Any]]:
    old = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}, "step": 1}
    new = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2, "b": torch.zeros(4)},
           "np": np.arange(6, dtype=np.int64), "step": 2}
    return old, new


def _make(url: str, options: StoreOptions | None = None) -> Setup:
    old_state, new_state = _states()
    with Store.open(url, create=True, options=options) as s:
        old = s.save(old_state, step=1)
        new = s.save(new_state, step=2)
    return Setup(url, old, new, old_state, new_state)


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory) -> Setup:
    return _make(str(tmp_path_factory.mktemp("pristine") / "store"))


@pytest.fixture(scope="module")
def _pristine_zstd(tmp_path_factory) -> Setup:
    return _make(str(tmp_path_factory.mktemp("pristine-zstd") / "store"), StoreOptions(compression="zstd"))


def _copy(p: Setup, url: str) -> Setup:
    """A byte-for-byte copy of a pristine store (saving afresh for each test would cost fsyncs)."""
    shutil.copytree(p.url, url)
    return Setup(url, p.old, p.new, p.old_state, p.new_state)


@pytest.fixture
def setup(_pristine: Setup, store_url: str) -> Setup:
    return _copy(_pristine, store_url)


def assert_names(exc: BaseException, url: str, cut: str | None, file: str | None) -> None:
    assert isinstance(exc, ckptstore.CkptStoreError), type(exc)
    text = str(exc)
    assert url in text, text
    if cut is not None:
        assert cut in text, text
    if file is not None:
        assert os.path.basename(file) in text, text


def assert_old_cut_loads(s: Setup) -> None:
    out = ckptstore.load(s.url, cut=s.old.id)
    assert torch.equal(out["model"]["w"], s.old_state["model"]["w"])
    assert out["step"] == 1
    with Store.open(s.url, readonly=True) as ro:
        report = ro.verify(s.old.id)
        assert report.cuts_checked == [s.old.id]
        # Store-level findings (a broken LATEST) may show; nothing may be wrong with the old cut itself.
        assert [f for f in report.errors if not f.kind.startswith("latest-")] == []


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def rewrite_manifest(s: Setup, cut: str, mutate: Callable[[dict[str, Any]], Any]) -> None:
    """Applies ``mutate`` to the manifest JSON (it may return raw bytes instead) and keeps LATEST's
    hash in step with the new bytes, so only the manifest's own content is wrong."""
    filekit.rewrite_manifest(s.url, cut, mutate, indent=1)


def _rehash_as_laid_out(doc: dict[str, Any], name: str, data: bytes) -> str:
    """Rewrites the tensor digests of shard ``name`` to the bytes at the manifest's offsets and returns
    the format-v2 file digest over that layout (docs/format.md; the bytes before the data section are
    the header): exactly what ``verify`` hashes, so only the shard's structure can be refused."""
    from ckptstore.hashing import file_digest_v2

    ts = sorted((t for t in doc["tensors"] if t["file"] == name), key=lambda t: (t["offset"], t["nbytes"]))
    start = len(data) - sum(t["nbytes"] for t in ts)
    parts = []
    for t in ts:
        d = blake3(data[start + t["offset"] : start + t["offset"] + t["nbytes"]]).digest()
        t["blake3"] = d.hex()
        parts.append((t["nbytes"], d))
    return file_digest_v2(data[: max(start, 0)], parts)


def rewrite_shard(s: Setup, cut: str, path: str, data: bytes) -> None:
    """Replaces a shard's bytes and records them in the manifest (sizes, hashes) and LATEST, so the
    file passes every hash check and only its own structure can be refused."""
    _write(path, data)
    name = os.path.basename(path)

    def fix(doc: dict[str, Any]) -> None:
        for rec in doc["files"]:
            if rec["name"] == name:
                rec["nbytes"] = len(data)
                rec["blake3"] = digest(data)
                if rec["codec"] == "none":
                    rec["raw_nbytes"] = len(data)
                    rec["raw_blake3"] = digest(data)
                    if doc["format_version"] >= 2:
                        rec["blake3"] = rec["raw_blake3"] = _rehash_as_laid_out(doc, name, data)

    rewrite_manifest(s, cut, fix)


def split_shard(path: str) -> tuple[int, dict[str, Any], bytes]:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def build_shard(header: bytes, n: int, body: bytes, *, length: int | None = None) -> bytes:
    """A shard whose header bytes are ``header`` space-padded to ``n`` (so the data section stays at the
    same offset) and whose length prefix says ``length`` (default: ``n``)."""
    assert len(header) <= n, "the test header must fit in the original header's room"
    return struct.pack("<Q", n if length is None else length) + header + b" " * (n - len(header)) + body


def findings(url: str) -> list[ckptstore.Finding]:
    with Store.open(url, readonly=True) as ro:
        return ro.verify().findings


def errors_for(url: str, cut: str) -> list[ckptstore.Finding]:
    return [f for f in findings(url) if f.severity == "error" and f.cut == cut]


# --------------------------------------------------------------------------------------------------
# shard damage


def _data_start(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("where", ["data-first", "data-last", "data-middle", "header-json", "header-padding"])
def test_flipped_byte_in_shard(setup: Setup, where: str) -> None:
    s = setup
    path = s.shard(s.new.id)
    size, start = os.path.getsize(path), _data_start(path)
    offset = {"data-first": start, "data-last": size - 1, "data-middle": (start + size) // 2,
              "header-json": 20, "header-padding": start - 2}[where]
    flip_byte(path, offset)
    before = snapshot(s.url)

    expected = ckptstore.CorruptCut if where.startswith("data") else ckptstore.DataError
    with pytest.raises(expected) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    # A partial load refuses too when it needs the damaged bytes: a header byte is needed by every
    # key, a data byte by the key whose array holds it (test_roundtrip covers the keys that do not).
    with Store.open(s.url, readonly=True) as ro:
        owners = [t.name.split("/")[0] for t in ro.manifest(s.new.id).tensors
                  if start + t.offset <= offset < start + t.offset + t.nbytes]
    for key in owners if where.startswith("data") else ["model", "np"]:
        with pytest.raises(expected) as ei:
            ckptstore.load(s.url, keys=[key])
        assert_names(ei.value, s.url, s.new.id, path)

    errs = errors_for(s.url, s.new.id)
    assert [f.kind for f in errs] == ["hash-mismatch"]
    assert errs[0].path is not None and errs[0].path.endswith(os.path.basename(path))
    assert errs[0].expected is not None and errs[0].found is not None
    assert errs[0].expected != errs[0].found
    assert_old_cut_loads(s)
    assert snapshot(s.url) == before, "a failed load or verify must not change or delete anything"


@pytest.mark.parametrize("keep", [0, 4, 8, 100, -1])
def test_truncated_shard(setup: Setup, keep: int) -> None:
    s = setup
    path = s.shard(s.new.id)
    size = os.path.getsize(path)
    new_size = size - 1 if keep == -1 else keep
    with open(path, "r+b") as f:
        f.truncate(new_size)
    before = snapshot(s.url)
    with pytest.raises((ckptstore.TruncatedFile, ckptstore.CorruptCut)) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    with pytest.raises((ckptstore.TruncatedFile, ckptstore.CorruptCut)):
        ckptstore.load(s.url, keys=["np"])
    errs = errors_for(s.url, s.new.id)
    assert len(errs) == 1 and errs[0].kind in ("size-mismatch", "truncated")
    assert errs[0].path.endswith(os.path.basename(path))  # type: ignore[union-attr]
    assert_old_cut_loads(s)
    assert snapshot(s.url) == before


def test_deleted_shard(setup: Setup) -> None:
    s = setup
    path = s.shard(s.new.id)
    os.remove(path)
    before = snapshot(s.url)
    with pytest.raises(ckptstore.MissingFile) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, ckptstore.DataError)
    with pytest.raises(ckptstore.MissingFile):
        ckptstore.load(s.url, keys=["model"])
    errs = errors_for(s.url, s.new.id)
    assert [f.kind for f in errs] == ["missing-file"]
    assert errs[0].path.endswith(os.path.basename(path))  # type: ignore[union-attr]
    assert_old_cut_loads(s)
    # Opening as the writer (which runs recovery and gc) keeps the damaged cut for a human to look at.
    with Store.open(s.url) as w:
        assert [c.id for c in w.cuts()] == [s.old.id, s.new.id]
    assert snapshot(s.url) == before


def test_extra_bytes_after_a_shard(setup: Setup) -> None:
    s = setup
    path = s.shard(s.new.id)
    with open(path, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    assert [f.kind for f in errors_for(s.url, s.new.id)] == ["size-mismatch"]


# --------------------------------------------------------------------------------------------------
# manifest damage


def _garbage(doc: dict[str, Any]) -> bytes:
    return b"\x00\xff this is not json {"


def _array(doc: dict[str, Any]) -> bytes:
    return b"[1, 2, 3]"


def _wrong_kind(doc: dict[str, Any]) -> None:
    doc["kind"] = "ckptstore.latest"


def _future_version(doc: dict[str, Any]) -> None:
    doc["format_version"] = 3


def _extra_field(doc: dict[str, Any]) -> None:
    doc["surprise"] = True


def _rename_file(new_name: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        old = doc["files"][0]["name"]
        doc["files"][0]["name"] = new_name
        for t in doc["tensors"]:
            if t["file"] == old:
                t["file"] = new_name

    return mutate


def _past_the_end(doc: dict[str, Any]) -> None:
    doc["tensors"][0]["offset"] = doc["files"][0]["raw_nbytes"]


def _wrong_cut(doc: dict[str, Any]) -> None:
    doc["cut"] = doc["cut"][:-8] + "00000000"


def _step_mismatch(doc: dict[str, Any]) -> None:
    doc["step"] = doc["step"] + 1


def _bad_hash(doc: dict[str, Any]) -> None:
    doc["files"][0]["blake3"] = "not-a-hash"


def _negative_size(doc: dict[str, Any]) -> None:
    doc["tensors"][0]["shape"] = [-1, 4]


MANIFEST_DAMAGE = {
    "garbage": _garbage,
    "json-array": _array,
    "wrong-kind": _wrong_kind,
    "future-format-version": _future_version,
    "extra-field": _extra_field,
    "traversal-file-name": _rename_file("../../etc/passwd"),
    "absolute-file-name": _rename_file("/abs"),
    "dot-dot-in-name": _rename_file("..hidden"),
    "tensor-past-its-file": _past_the_end,
    "cut-id-of-another-dir": _wrong_cut,
    "step-mismatch": _step_mismatch,
    "bad-hash": _bad_hash,
    "negative-shape": _negative_size,
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_damaged_manifest(setup: Setup, damage: str) -> None:
    s = setup
    rewrite_manifest(s, s.new.id, MANIFEST_DAMAGE[damage])
    before = snapshot(s.url)

    with pytest.raises(ckptstore.DataError) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, "MANIFEST.json")
    with pytest.raises(ckptstore.DataError) as ei:
        ckptstore.load(s.url, cut=s.new.id)
    assert_names(ei.value, s.url, s.new.id, "MANIFEST.json")
    with pytest.raises(ckptstore.DataError):
        ckptstore.load(s.url, cut=2)

    fs = findings(s.url)
    broken = [f for f in fs if f.kind == "manifest-broken"]
    assert len(broken) == 1 and broken[0].severity == "error"
    assert broken[0].cut == s.new.id and broken[0].path.endswith("MANIFEST.json")  # type: ignore[union-attr]
    with Store.open(s.url, readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == [s.old.id]
        assert not ro.verify().ok
    assert_old_cut_loads(s)
    assert snapshot(s.url) == before

    # The writer refuses to open over a LATEST that names a damaged cut, and says what to do.
    with pytest.raises(ckptstore.LatestError) as ei:
        Store.open(s.url)
    assert "ckptstore repair" in str(ei.value)
    # repair falls back to the newest cut that verifies; the damaged cut stays on disk for a human.
    with open_for_repair(s.url) as r:
        fixed = r.repair()
    assert fixed is not None and fixed.id == s.old.id
    with Store.open(s.url) as w:
        assert w.latest().id == s.old.id  # type: ignore[union-attr]
        w.gc()
    assert os.path.exists(s.manifest_path(s.new.id)) and os.path.exists(s.shard(s.new.id))
    assert ckptstore.load(s.url)["step"] == 1


def test_manifest_of_an_older_cut_damaged(setup: Setup) -> None:
    """Damage to an older cut never blocks the newest one, and is reported."""
    s = setup
    rewrite_manifest(s, s.old.id, _garbage)
    assert ckptstore.load(s.url)["step"] == 2
    with Store.open(s.url) as w:
        assert w.latest().id == s.new.id  # type: ignore[union-attr]
        report = w.verify()
        assert [f.kind for f in report.errors] == ["manifest-broken"] and report.errors[0].cut == s.old.id
        w.gc()
        w.prune(ckptstore.KeepLast(1))
    assert os.path.exists(s.manifest_path(s.old.id)), "damage is reported, never deleted as a leftover"


def test_manifest_tree_naming_unknown_array(setup: Setup) -> None:
    s = setup

    def mutate(doc: dict[str, Any]) -> None:
        doc["tree"]["items"][0]["v"]["items"][0]["v"]["name"] = "no-such-array"

    rewrite_manifest(s, s.new.id, mutate)
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, None)


# --------------------------------------------------------------------------------------------------
# hostile shard headers (sizes and hashes rewritten to match, so the header is all that is wrong)


def _hostile(s: Setup, make: Callable[[int, dict[str, Any], bytes], bytes]) -> str:
    path = s.shard(s.new.id)
    n, header, body = split_shard(path)
    rewrite_shard(s, s.new.id, path, make(n, header, body))
    return path


def _dump(header: Any) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _tensor_keys(header: dict[str, Any]) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _with(header: dict[str, Any], key_index: int, field: str, value: Any) -> dict[str, Any]:
    header = json.loads(json.dumps(header))
    header[_tensor_keys(header)[key_index]][field] = value
    return header


HOSTILE_HEADERS: dict[str, Callable[[int, dict[str, Any], bytes], bytes]] = {
    "length-near-2**63": lambda n, h, b: build_shard(_dump(h), n, b, length=2**63 - 8),
    "length-2**64-1": lambda n, h, b: build_shard(_dump(h), n, b, length=2**64 - 1),
    "length-past-file": lambda n, h, b: build_shard(_dump(h), n, b, length=8 + n + len(b) + 1),
    "length-zero": lambda n, h, b: build_shard(_dump(h), n, b, length=0),
    "not-json": lambda n, h, b: build_shard(b"{this is not json", n, b),
    "not-utf8": lambda n, h, b: build_shard(b'{"\xff\xfe":1}', n, b),
    "json-list": lambda n, h, b: build_shard(b"[1,2,3]", n, b),
    "duplicate-keys": lambda n, h, b: build_shard(
        _dump(h)[:-1] + b"," + json.dumps(_tensor_keys(h)[0]).encode() + b":"
        + _dump(h[_tensor_keys(h)[0]]) + b"}", n, b),
    "overlapping-offsets": lambda n, h, b: build_shard(
        _dump(_with(h, 1, "data_offsets", [h[_tensor_keys(h)[0]]["data_offsets"][0],
                                           h[_tensor_keys(h)[0]]["data_offsets"][0]
                                           + h[_tensor_keys(h)[1]]["data_offsets"][1]
                                           - h[_tensor_keys(h)[1]]["data_offsets"][0]])), n, b),
    "gap-in-offsets": lambda n, h, b: build_shard(
        _dump(_with(h, 0, "data_offsets", [4, h[_tensor_keys(h)[0]]["data_offsets"][1] + 4])), n, b),
    "offsets-reversed": lambda n, h, b: build_shard(_dump(_with(h, 0, "data_offsets", [8, 0])), n, b),
    "offsets-huge": lambda n, h, b: build_shard(_dump(_with(h, 0, "data_offsets", [0, 2**63])), n, b),
    "offsets-not-ints": lambda n, h, b: build_shard(_dump(_with(h, 0, "data_offsets", [0.0, True])), n, b),
    "negative-shape": lambda n, h, b: build_shard(_dump(_with(h, 0, "shape", [-1, 4])), n, b),
    "huge-shape": lambda n, h, b: build_shard(_dump(_with(h, 0, "shape", [2**40, 2**40, 2**40])), n, b),
    "shape-past-2**62": lambda n, h, b: build_shard(_dump(_with(h, 0, "shape", [2**62])), n, b),
    "shape-not-list": lambda n, h, b: build_shard(_dump(_with(h, 0, "shape", "3x4")), n, b),
    "too-many-dims": lambda n, h, b: build_shard(_dump(_with(h, 0, "shape", [1] * 65)), n, b),
    "unknown-dtype": lambda n, h, b: build_shard(_dump(_with(h, 0, "dtype", "F128")), n, b),
    "wrong-dtype": lambda n, h, b: build_shard(_dump(_with(h, 0, "dtype", "I32")), n, b),
    "extra-entry-field": lambda n, h, b: build_shard(_dump(_with(h, 0, "pickle", "x")), n, b),
    "metadata-not-strings": lambda n, h, b: build_shard(_dump({**h, "__metadata__": {"a": 1}}), n, b),
    "renamed-tensor": lambda n, h, b: build_shard(
        _dump({("evil" if k == _tensor_keys(h)[0] else k): v for k, v in h.items()}), n, b),
    "trailing-bytes": lambda n, h, b: build_shard(_dump(h), n, b + b"\0" * 8),
    "missing-data": lambda n, h, b: build_shard(_dump(h), n, b[:-4]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_shard_header(setup: Setup, case: str) -> None:
    s = setup
    path = _hostile(s, HOSTILE_HEADERS[case])
    before = snapshot(s.url)
    for kw in ({}, {"keys": ["np"]}, {"keys": ["model"]}, {"verify": False}):
        try:
            ckptstore.load(s.url, **kw)
        except (ckptstore.HostileInput, ckptstore.CorruptCut) as exc:
            assert_names(exc, s.url, s.new.id, path)
        else:
            pytest.fail(f"{case}: load({kw}) accepted a hostile shard")
    errs = errors_for(s.url, s.new.id)
    assert len(errs) == 1, errs
    assert errs[0].path.endswith(os.path.basename(path))  # type: ignore[union-attr]
    assert_old_cut_loads(s)
    assert snapshot(s.url) == before


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300), claimed=st.integers(min_value=0, max_value=2**64 - 1))
def test_decode_header_never_raises_anything_but_data_errors(data: bytes, claimed: int) -> None:
    from ckptstore.format import decode_header

    raw = struct.pack("<Q", claimed) + data
    for size in (len(raw), len(raw) + 100):
        try:
            decode_header(lambda a, b: raw[a:b], size, where={"store": "s", "cut": "c", "path": "p"})
        except ckptstore.DataError as exc:
            assert "file=p" in str(exc)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_decode_header_survives_mutated_valid_headers(data: st.DataObject) -> None:
    from ckptstore.format import decode_header, encode_header

    raw = encode_header([("a", "F32", [2, 3], 24), ("b", "I64", [4], 32)]) + bytes(56)
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, 200))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        decode_header(lambda a, b: bytes(raw[a:b]), len(raw), where={"store": "s", "cut": "c", "path": "p"})
    except ckptstore.DataError:
        pass


# --------------------------------------------------------------------------------------------------
# LATEST damage


def _latest_doc(s: Setup) -> dict[str, Any]:
    return json.loads(open(os.path.join(s.url, "LATEST"), "rb").read())


LATEST_DAMAGE: dict[str, Callable[[Setup], bytes | None]] = {
    "garbage": lambda s: b"\x00garbage\xff",
    "empty": lambda s: b"",
    "dangling": lambda s: json.dumps({**_latest_doc(s), "cut": "step-000000000002-deadbeef"}).encode(),
    "traversal": lambda s: json.dumps({**_latest_doc(s), "cut": "../x"}).encode(),
    "absolute": lambda s: json.dumps({**_latest_doc(s), "cut": "/etc/passwd"}).encode(),
    "wrong-hash": lambda s: json.dumps({**_latest_doc(s), "manifest_blake3": "0" * 64}).encode(),
    "wrong-kind": lambda s: json.dumps({**_latest_doc(s), "kind": "ckptstore.manifest"}).encode(),
    "extra-field": lambda s: json.dumps({**_latest_doc(s), "x": 1}).encode(),
    "missing": lambda s: None,
}


@pytest.mark.parametrize("damage", sorted(LATEST_DAMAGE))
def test_damaged_latest(setup: Setup, damage: str) -> None:
    s = setup
    latest = os.path.join(s.url, "LATEST")
    data = LATEST_DAMAGE[damage](s)
    if data is None:
        os.remove(latest)
    else:
        _write(latest, data)
    before = snapshot(s.url)

    with pytest.raises(ckptstore.LatestError) as ei:
        Store.open(s.url)
    assert "ckptstore repair" in str(ei.value) and s.url in str(ei.value) and "LATEST" in str(ei.value)
    with pytest.raises(ckptstore.LatestError) as ei:
        ckptstore.load(s.url)
    assert s.url in str(ei.value) and "LATEST" in str(ei.value)
    with Store.open(s.url, readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == [s.old.id, s.new.id]
        with pytest.raises(ckptstore.LatestError):
            ro.latest()
        report = ro.verify()
        assert not report.ok
        assert [f.kind for f in report.errors] == [f"latest-{ro.classify().latest_problem_kind}"]
    # An explicit cut still loads while LATEST is broken.
    assert ckptstore.load(s.url, cut=s.new.id)["step"] == 2
    assert snapshot(s.url) == before  # refusing to open touched nothing

    with open_for_repair(s.url) as r:
        fixed = r.repair()
    assert fixed is not None and fixed.id == s.new.id
    with Store.open(s.url) as w:
        assert w.latest().id == s.new.id  # type: ignore[union-attr]
        assert w.verify().ok
        w.save({"after": "repair"}, step=3)
    assert ckptstore.load(s.url) == {"after": "repair"}


def test_repair_skips_a_newest_cut_that_does_not_verify(setup: Setup) -> None:
    s = setup
    flip_byte(s.shard(s.new.id), os.path.getsize(s.shard(s.new.id)) - 1)
    _write(os.path.join(s.url, "LATEST"), b"garbage")
    with open_for_repair(s.url) as r:
        fixed = r.repair()
    assert fixed is not None and fixed.id == s.old.id
    assert ckptstore.load(s.url)["step"] == 1
    assert os.path.exists(s.shard(s.new.id)), "repair never deletes the damaged cut"


def test_repair_with_no_cut_that_verifies(setup: Setup) -> None:
    s = setup
    for cut in (s.old.id, s.new.id):
        flip_byte(s.shard(cut), os.path.getsize(s.shard(cut)) - 1)
    _write(os.path.join(s.url, "LATEST"), b"")
    before = snapshot(s.url)
    with open_for_repair(s.url) as r:
        with pytest.raises(ckptstore.CorruptCut) as ei:
            r.repair()
    assert s.url in str(ei.value)
    assert snapshot(s.url) == before


# --------------------------------------------------------------------------------------------------
# planted pickle


class _Canary:
    """Unpickling this creates the file at ``path``: proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
def test_planted_pickle_is_never_unpickled(setup: Setup, tmp_path, declared: bool) -> None:
    s = setup
    canary = str(tmp_path / "canary")
    payload = base64.b64encode(pickle.dumps(_Canary(canary))).decode()

    def plant(doc: dict[str, Any]) -> None:
        doc["tree"]["items"].append({"k": "evil", "v": {"t": "pickle", "v": payload}})
        doc["tree"]["items"][0]["v"]["items"].append({"k": "evil", "v": {"t": "pickle", "v": payload}})
        doc["pickled"] = declared

    rewrite_manifest(s, s.new.id, plant)
    with Store.open(s.url, readonly=True) as ro:
        assert ro.latest().id == s.new.id, "the planted manifest must be a committed cut"  # type: ignore[union-attr]

    for kw in ({}, {"keys": ["evil"]}, {"keys": ["model"]}, {"verify": False}, {"cut": s.new.id}, {"cut": 2}):
        with pytest.raises(ckptstore.HostileInput) as ei:
            ckptstore.load(s.url, **kw)
        assert_names(ei.value, s.url, s.new.id, None)
        assert not os.path.exists(canary), f"load({kw}) ran the pickle"
    with Store.open(s.url) as w:
        w.verify()
        w.gc()
        w.cuts()
        w.prune(ckptstore.KeepLast(5))
    assert not os.path.exists(canary), "verify/gc/prune ran the pickle"
    # Cuts without the pickle still load.
    assert ckptstore.load(s.url, cut=s.old.id)["step"] == 1

    # The payload is real: opting in runs it (the test above could not pass by accident).
    out = ckptstore.load(s.url, allow_pickle=True)
    assert os.path.exists(canary)
    assert out["step"] == 2


# --------------------------------------------------------------------------------------------------
# compressed shards


@pytest.fixture
def zstd_setup(_pristine_zstd: Setup, store_url: str) -> Setup:
    return _copy(_pristine_zstd, store_url)


def test_truncated_zstd_shard(zstd_setup: Setup) -> None:
    s = zstd_setup
    path = s.shard(s.new.id)
    assert path.endswith(".zst")
    data = open(path, "rb").read()
    _write(path, data[:-10])
    with pytest.raises((ckptstore.TruncatedFile, ckptstore.CorruptCut)) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    errs = errors_for(s.url, s.new.id)
    assert len(errs) == 1 and errs[0].kind in ("size-mismatch", "truncated")
    assert_old_cut_loads(s)


@pytest.mark.parametrize("cut_bytes", [10, 1, 3])
def test_truncated_zstd_frame_with_matching_manifest(zstd_setup: Setup, cut_bytes: int) -> None:
    """Even when the manifest records the shorter file (sizes and hash), the torn zstd frame is refused:
    the decoded length must match too."""
    s = zstd_setup
    path = s.shard(s.new.id)
    data = open(path, "rb").read()[:-cut_bytes]
    rewrite_shard(s, s.new.id, path, data)
    with pytest.raises((ckptstore.TruncatedFile, ckptstore.CorruptCut)) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    with pytest.raises((ckptstore.TruncatedFile, ckptstore.CorruptCut)):
        ckptstore.load(s.url, keys=["model"])
    errs = errors_for(s.url, s.new.id)
    assert len(errs) == 1 and errs[0].kind in ("truncated", "corrupt-file", "hash-mismatch")
    assert_old_cut_loads(s)


def test_flipped_byte_in_zstd_shard(zstd_setup: Setup) -> None:
    s = zstd_setup
    path = s.shard(s.new.id)
    flip_byte(path, os.path.getsize(path) // 2)
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(s.url)
    assert_names(ei.value, s.url, s.new.id, path)
    assert [f.kind for f in errors_for(s.url, s.new.id)] in (["hash-mismatch"], ["corrupt-file"])
    assert_old_cut_loads(s)


# --------------------------------------------------------------------------------------------------
# foreign files


def test_foreign_files_are_reported_and_never_deleted(setup: Setup) -> None:
    s = setup
    foreign_files = ["notes.txt", "cuts/README", "cuts/step-1000", "marks/mine.txt", "bad/x.json"]
    foreign_dirs = ["my-backup", "cuts/not-a-cut", "cuts/step-000000000009-0000000g"]
    for d in foreign_dirs:
        os.makedirs(os.path.join(s.url, d))
        _write(os.path.join(s.url, d, "keep-me.bin"), b"precious")
    for f in foreign_files:
        _write(os.path.join(s.url, f), b"precious")
    # A stranger's file inside a committed cut that is later pruned.
    _write(os.path.join(s.cut_dir(s.old.id), "user-notes.txt"), b"precious")
    before = snapshot(s.url)

    report = Store.open(s.url, readonly=True).verify()
    assert report.ok, report.errors
    reported = {f.path for f in report.findings if f.kind == "foreign"}
    assert {f for f in foreign_files} | set(foreign_dirs) <= reported, reported
    assert all(f.severity == "notice" for f in report.findings if f.kind == "foreign")

    with Store.open(s.url) as w:  # recovery on open runs gc
        gc = w.gc()
        assert set(foreign_files) | set(foreign_dirs) <= set(gc.foreign)
        assert not gc.removed
        pruned = w.prune(ckptstore.KeepLast(1))
        assert [c.id for c in pruned] == [s.old.id]
        gc = w.gc()
        assert f"cuts/{s.old.id}/user-notes.txt" in gc.foreign
    after = snapshot(s.url)
    for rel, h in before.items():
        if rel.startswith(os.path.join("cuts", s.old.id)) and not rel.endswith("user-notes.txt"):
            continue  # the pruned cut's own files
        assert after.get(rel) == h, f"{rel} was changed or deleted"
    assert os.path.exists(os.path.join(s.cut_dir(s.old.id), "user-notes.txt"))
    assert ckptstore.load(s.url)["step"] == 2
    with Store.open(s.url, readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == [s.new.id]
        report = ro.verify()
        assert report.ok
        # The pruned cut's directory stays (it holds a stranger's file) and is reported, not hidden.
        assert any(f.severity == "notice" and f.cut == s.old.id for f in report.findings), report.findings


def test_verify_false_skips_hashes_but_never_the_size_and_header_checks(tmp_path):
    """load(verify=False) trusts the bytes (no blake3) yet still refuses a truncated shard."""
    import numpy as np

    url = str(tmp_path / "nv")
    with ckptstore.Store.open(url, create=True) as store:
        info = store.save({"w": np.arange(4096, dtype=np.float32)}, step=1)
        m = store.manifest()
    shard = os.path.join(url, "cuts", info.id, m.files[0].name)
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ckptstore.CorruptCut):
        ckptstore.load(url)
    flipped = ckptstore.load(url, verify=False)  # the caller asked not to hash: the flip goes through
    assert flipped["w"].shape == (4096,) and flipped["w"][-1] != 4095.0
    open(shard, "wb").write(bytes(data[:-3]))
    with pytest.raises((ckptstore.TruncatedFile, ckptstore.CorruptCut)):
        ckptstore.load(url, verify=False)
