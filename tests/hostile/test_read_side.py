"""Hostile input on the read side (issue 10, items 7, 8, 9 and 11's duplicate keys): manifests nested
100,000 deep, tree nodes that only a load would trip over, size claims a reader would allocate for, zstd
bombs and duplicate JSON keys. Each store is a real one (two cuts saved by ckptstore), damaged by hand the
way an attacker would, with LATEST's manifest hash kept in step so only the crafted content is wrong.

Every case asserts the named error (a DataError subclass naming the store, the cut and the file), that
the rest of the store keeps working, and that no committed or foreign file was touched."""

from __future__ import annotations

import base64
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ckptstore
from filekit import rewrite_manifest, snapshot, write_manifest
from ckptstore import Store, StoreOptions
from ckptstore.cli import main
from ckptstore.format import encode_header
from ckptstore.errors import CorruptCut, DataError, ManifestError, TruncatedFile, UnsupportedValue
from ckptstore.hashing import digest
from ckptstore.tree import MAX_DEPTH

FOREIGN = "NOTES.txt"


@dataclass
class Setup:
    url: str
    old: str
    new: str

    def manifest(self, cut: str) -> str:
        return os.path.join(self.url, "cuts", cut, "MANIFEST.json")

    def shard(self, cut: str) -> str:
        d = os.path.join(self.url, "cuts", cut)
        return os.path.join(d, sorted(n for n in os.listdir(d) if n != "MANIFEST.json")[0])


def _old_state() -> dict[str, Any]:
    return {"w": torch.arange(6, dtype=torch.float32), "step": 1}


def _build(url: str, options: StoreOptions | None = None) -> Setup:
    new_state = {"w": torch.ones(4), "np": np.zeros(3, dtype=np.complex128), "lr": 0.5, "z": 1 + 2j,
                 "dev": torch.device("cpu"), "dt": torch.float32, "n": np.float32(2.0), "big": 2**9000,
                 "step": 2}
    with Store.open(url, create=True, options=options) as s:
        old = s.save(_old_state(), step=1).id
        new = s.save(new_state, step=2).id
    with open(os.path.join(url, FOREIGN), "w") as f:
        f.write("a user's notes: not ckptstore's\n")
    return Setup(url, old, new)


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory) -> Setup:
    return _build(str(tmp_path_factory.mktemp("hostile") / "store"))


@pytest.fixture(scope="module")
def _pristine_zstd(tmp_path_factory) -> Setup:
    return _build(str(tmp_path_factory.mktemp("hostile-zstd") / "store"), StoreOptions(compression="zstd"))


@pytest.fixture
def setup(_pristine: Setup, tmp_path) -> Setup:
    url = str(tmp_path / "store")
    shutil.copytree(_pristine.url, url)
    return Setup(url, _pristine.old, _pristine.new)


@pytest.fixture
def setup_zstd(_pristine_zstd: Setup, tmp_path) -> Setup:
    url = str(tmp_path / "store")
    shutil.copytree(_pristine_zstd.url, url)
    return Setup(url, _pristine_zstd.old, _pristine_zstd.new)


def assert_untouched(before: dict[str, str], url: str) -> None:
    """Nothing committed or foreign changed or went; the only new files are records of bad cuts (a
    fallback load writes one for each cut it skips)."""
    after = snapshot(url)
    assert {k: after.get(k) for k in before} == before
    assert all(k.startswith("bad" + os.sep) for k in set(after) - set(before)), sorted(set(after) - set(before))


def assert_names(exc: BaseException, s: Setup, cut: str, file: str) -> None:
    assert isinstance(exc, DataError), type(exc)
    text = str(exc)
    assert s.url in text and cut in text and file in text, text


def assert_rest_works(s: Setup, bad: str) -> None:
    """The cut that is not ``bad`` still loads, and a fallback load gets past ``bad``."""
    good = s.old if bad == s.new else s.new
    out = ckptstore.load(s.url, cut=good)
    assert out["step"] == (1 if good == s.old else 2)
    fb = ckptstore.load(s.url, fallback=True)
    assert fb["step"] == (1 if bad == s.new else 2)


def item(tree: dict[str, Any], key: str) -> dict[str, Any]:
    return next(it["v"] for it in tree["items"] if it.get("k") == key)


# --------------------------------------------------------------------------------------------------
# item 7: deep nesting


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def test_manifest_nested_100k_deep_in_an_old_cut_breaks_only_that_cut(setup: Setup, capsys) -> None:
    s = setup
    data = open(s.manifest(s.old), "rb").read().decode()
    poisoned = data.replace('"metadata":{}', '"metadata":{"x":%s}' % _deep(100_000), 1)
    assert poisoned != data
    write_manifest(s.url, s.old, poisoned.encode())
    before = snapshot(s.url)

    with pytest.raises(ManifestError) as ei:
        ckptstore.load(s.url, cut=s.old)
    assert_names(ei.value, s, s.old, "MANIFEST.json")
    assert "nested too deeply" in str(ei.value)
    assert ckptstore.load(s.url)["step"] == 2
    assert ckptstore.load(s.url, fallback=True)["step"] == 2
    with Store.open(s.url) as w:  # the writer opens over it
        report = w.verify()
    assert [(f.kind, f.cut) for f in report.errors] == [("manifest-broken", s.old)]

    # Every command answers, none with a traceback; the broken cut is reported, the rest works.
    codes = {}
    for argv in (["ls", s.url], ["show", s.url, s.new], ["show", s.url, s.old], ["verify", s.url],
                 ["repair", s.url], ["gc", s.url], ["resume-info", s.url]):
        codes[argv[0] + (" old" if s.old in argv else "")] = main(argv)
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err and "RecursionError" not in out.out + out.err, (argv, out)
    assert codes == {"ls": 0, "show": 0, "show old": 1, "verify": 1, "repair": 0, "gc": 0, "resume-info": 0}
    assert_untouched(before, s.url)  # the poisoned cut is kept, the foreign file too


def test_deep_latest_is_a_latest_error_not_a_crash(setup: Setup) -> None:
    s = setup
    latest = os.path.join(s.url, "LATEST")
    with open(latest, "w") as f:
        f.write('{"x":%s}' % _deep(100_000))
    before = snapshot(s.url)
    with pytest.raises(DataError) as ei:
        ckptstore.load(s.url)
    assert s.url in str(ei.value) and "LATEST" in str(ei.value)
    assert ckptstore.load(s.url, cut=s.old)["step"] == 1
    assert_untouched(before, s.url)


def _nested(depth: int) -> Any:
    state: Any = torch.full((2,), float(depth))
    for i in range(depth):
        state = {"k": state} if i % 2 else [state]
    return state


def test_a_state_nested_exactly_max_depth_saves_and_loads(tmp_path) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        s.save(_nested(MAX_DEPTH), step=1)
    out = ckptstore.load(url)
    for i in reversed(range(MAX_DEPTH)):
        out = out["k"] if i % 2 else out[0]
    assert torch.equal(out, torch.full((2,), float(MAX_DEPTH)))
    with Store.open(url, readonly=True) as ro:
        assert ro.verify().ok


def test_a_state_one_level_deeper_is_refused_naming_its_key_path(tmp_path) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        with pytest.raises(UnsupportedValue) as ei:
            s.save(_nested(MAX_DEPTH + 1), step=1)
        assert "0/k/0/k" in str(ei.value) and str(MAX_DEPTH) in str(ei.value)
        assert s.cuts() == []
    assert not any(n.startswith("step-") for n in os.listdir(os.path.join(url, "cuts")))


def test_a_tree_nested_past_max_depth_is_corrupt_not_a_crash(setup: Setup) -> None:
    s = setup
    deep: dict[str, Any] = {"t": "none"}
    for _ in range(MAX_DEPTH + 5):
        deep = {"t": "list", "items": [deep]}
    rewrite_manifest(s.url, s.new, lambda doc: doc["tree"]["items"].append({"k": "deep", "v": deep}))
    before = snapshot(s.url)
    with pytest.raises(CorruptCut) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert_names(ei.value, s, s.new, "")
    with Store.open(s.url, readonly=True) as ro:
        assert [(f.kind, f.cut) for f in ro.verify().errors] == [("tree-invalid", s.new)]
    assert_rest_works(s, bad=s.new)
    assert_untouched(before, s.url)


# --------------------------------------------------------------------------------------------------
# item 8: what verify accepts, load loads


def _set(key: str, node: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        item(doc["tree"], key).clear()
        item(doc["tree"], key).update(node)
    return mutate


def _retype_np(doc: dict[str, Any]) -> None:
    # 3 complex128 (48 bytes, stored as U8 [48]) recorded as 16 items of "<i3": the pattern of a numpy
    # dtype, yet np.dtype refuses it. Bytes, header and digests stay as they are.
    rec = next(t for t in doc["tensors"] if t["name"] == "np")
    rec["dtype"], rec["shape"] = "<i3", [16]


TREE_DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "float-odd-bits": _set("lr", {"t": "float", "v": "bits:00"}),
    "float-overflow": _set("lr", {"t": "float", "v": "0x1p99999"}),
    "float-not-text": _set("lr", {"t": "float", "v": 0.5}),
    "complex-int-part": _set("z", {"t": "complex", "re": 1, "im": "0x0p+0"}),
    "device-bogus": _set("dev", {"t": "device", "v": "bogus"}),
    "device-index-too-big": _set("dev", {"t": "device", "v": "cuda:128"}),
    "dtype-bogus": _set("dt", {"t": "dtype", "v": "__class__"}),
    "npscalar-i3": _set("n", {"t": "npscalar", "dtype": "<i3", "v": base64.b64encode(b"abc").decode()}),
    "npscalar-short": _set("n", {"t": "npscalar", "dtype": "<f4", "v": base64.b64encode(b"ab").decode()}),
    "int-hex-not-hex": _set("big", {"t": "int", "hex": "0x 1_0"}),
    "size-of-strs": _set("step", {"t": "size", "v": ["1"]}),
    "dict-key-not-str": _set("step", {"t": "dict", "items": [{"k": 1, "v": {"t": "none"}}]}),
    "bytes-mutable-not-bool": _set("step", {"t": "bytes", "v": "", "mutable": "yes"}),
    "ndarray-names-a-tensor": _set("step", {"t": "ndarray", "name": "w"}),
    "tensor-names-an-ndarray": _set("step", {"t": "tensor", "name": "np"}),
}


@pytest.mark.parametrize("damage", sorted(TREE_DAMAGE))
def test_verify_refuses_every_node_load_would_refuse(setup: Setup, damage: str) -> None:
    s = setup
    rewrite_manifest(s.url, s.new, TREE_DAMAGE[damage])
    before = snapshot(s.url)
    with Store.open(s.url, readonly=True) as ro:
        errors = ro.verify().errors
    assert [(f.kind, f.cut) for f in errors] == [("tree-invalid", s.new)], errors
    with pytest.raises(CorruptCut) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert_names(ei.value, s, s.new, "")
    assert "manifest tree" in str(ei.value)
    assert_rest_works(s, bad=s.new)
    assert_untouched(before, s.url)


def test_a_numpy_record_of_a_dtype_numpy_refuses_breaks_the_manifest(setup: Setup) -> None:
    s = setup
    rewrite_manifest(s.url, s.new, _retype_np)
    before = snapshot(s.url)
    with pytest.raises(ManifestError) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert_names(ei.value, s, s.new, "MANIFEST.json")
    assert "<i3" in str(ei.value)
    with Store.open(s.url, readonly=True) as ro:
        assert ("manifest-broken", s.new) in [(f.kind, f.cut) for f in ro.verify().errors]
    assert ckptstore.load(s.url, cut=s.old)["step"] == 1
    assert_untouched(before, s.url)


def test_the_pristine_store_passes_the_shared_decoder(setup: Setup) -> None:
    """Control for the table above: the undamaged cut (every node kind it uses) verifies and loads."""
    with Store.open(setup.url, readonly=True) as ro:
        assert ro.verify().errors == []
    out = ckptstore.load(setup.url)
    assert out["dev"] == torch.device("cpu") and out["dt"] is torch.float32 and out["big"] == 2**9000
    assert out["z"] == 1 + 2j and out["n"] == np.float32(2.0) and out["np"].dtype == np.complex128


# --------------------------------------------------------------------------------------------------
# item 9: size claims and zstd bombs


def _claim_huge(doc: dict[str, Any]) -> None:
    # A 2**44-byte array, and a file record that agrees with it: only the file on disk says otherwise.
    rec = next(t for t in doc["tensors"] if t["name"] == "w")
    rec["shape"], rec["nbytes"] = [2**42], 2**44
    f = doc["files"][0]
    f["nbytes"] = f["raw_nbytes"] = f["nbytes"] + 2**44


def test_a_claimed_2_44_byte_array_is_refused_before_allocation(setup: Setup) -> None:
    s = setup
    rewrite_manifest(s.url, s.new, _claim_huge)
    before = snapshot(s.url)
    with pytest.raises(TruncatedFile) as ei:
        ckptstore.load(s.url, cut=s.new)  # a raw RuntimeError from the allocator before
    assert_names(ei.value, s, s.new, os.path.basename(s.shard(s.new)))
    with Store.open(s.url, readonly=True) as ro:
        assert [(f.kind, f.cut) for f in ro.verify().errors] == [("size-mismatch", s.new)]
    assert_rest_works(s, bad=s.new)
    assert_untouched(before, s.url)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_raw_sizes_the_stored_bytes_cannot_hold_break_the_manifest(request, codec: str) -> None:
    s: Setup = request.getfixturevalue("setup" if codec == "none" else "setup_zstd")

    def claim(doc: dict[str, Any]) -> None:
        doc["files"][0]["raw_nbytes"] = 2**44

    rewrite_manifest(s.url, s.new, claim)
    before = snapshot(s.url)
    with pytest.raises(ManifestError) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert_names(ei.value, s, s.new, "MANIFEST.json")
    assert str(2**44) in str(ei.value)
    assert ckptstore.load(s.url, fallback=True)["step"] == 1
    assert_untouched(before, s.url)


def _rle_frame(raw: bytes, zero_blocks: int) -> bytes:
    """A zstd frame (no content size, 128 KiB window) of ``raw`` in raw blocks, then ``zero_blocks``
    RLE blocks of 128 KiB zeros: 4 bytes each, so 32,768 of them (131 KB) decode to 4 GiB."""
    out = [struct.pack("<I", 0xFD2FB528), bytes([0x00, 7 << 3])]
    blocks: list[bytes] = []
    for i in range(0, len(raw), 1 << 17):
        part = raw[i : i + (1 << 17)]
        blocks.append(struct.pack("<I", len(part) << 3)[:3] + part)
    blocks += [struct.pack("<I", ((1 << 17) << 3) | (1 << 1))[:3] + b"\0"] * zero_blocks
    last = bytearray(blocks[-1])
    last[0] |= 1
    blocks[-1] = bytes(last)
    return b"".join(out + blocks)


def _zstd_raw(path: str) -> bytes:
    import zstandard

    with open(path, "rb") as f:
        return zstandard.ZstdDecompressor().stream_reader(f).read()


def _record_stored(s: Setup, data: bytes) -> None:
    """Installs ``data`` as the new cut's zstd shard and records its size and hash (stored bytes)."""
    path = s.shard(s.new)
    with open(path, "wb") as f:
        f.write(data)

    def fix(doc: dict[str, Any]) -> None:
        doc["files"][0]["nbytes"], doc["files"][0]["blake3"] = len(data), digest(data)

    rewrite_manifest(s.url, s.new, fix)


def test_a_zstd_bomb_past_the_recorded_raw_length_is_refused(setup_zstd: Setup) -> None:
    """The honest shard's bytes, then 4 GiB of zeros in 131 KB: refused one byte past the claim."""
    s = setup_zstd
    raw = _zstd_raw(s.shard(s.new))
    bomb = _rle_frame(raw, 32_768)
    assert len(bomb) < 140_000
    _record_stored(s, bomb)
    before = snapshot(s.url)
    with pytest.raises(CorruptCut) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert_names(ei.value, s, s.new, os.path.basename(s.shard(s.new)))
    assert "past its recorded raw length" in str(ei.value)
    with Store.open(s.url, readonly=True) as ro:
        assert [(f.kind, f.cut) for f in ro.verify().errors] == [("corrupt-file", s.new)]
    assert_rest_works(s, bad=s.new)
    assert_untouched(before, s.url)


_VERIFY_RSS = textwrap.dedent("""
    import resource, sys
    import ckptstore
    ro = ckptstore.Store.open(sys.argv[1], readonly=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = ro.verify()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(before, after, ",".join(sorted({f.kind for f in report.errors})))
""")


def test_verify_streams_a_zstd_array_through_a_bounded_buffer(setup_zstd: Setup) -> None:
    """A 20 KB shard whose manifest claims one 512 MiB array (its header agrees): verify hashes every
    byte, in pieces; it once allocated the whole array (a 131 KB shard cost 4.2 GB). Peak RSS of the
    verifying process is measured in it, before and after the audit."""
    s = setup_zstd
    size = 1 << 29
    header = encode_header([("w", "U8", [size], size)])
    bomb = _rle_frame(header, size >> 17)
    assert len(bomb) < 24_000
    _record_stored(s, bomb)

    def claim(doc: dict[str, Any]) -> None:
        doc["tensors"] = [{"name": "w", "kind": "torch", "dtype": "uint8", "shape": [size], "nbytes": size,
                           "file": doc["files"][0]["name"], "offset": 0, "blake3": "0" * 64}]
        doc["files"][0]["raw_nbytes"] = len(header) + size
        doc["tree"] = {"t": "dict", "ordered": False, "items": [{"k": "w", "v": {"t": "tensor", "name": "w"}}]}

    rewrite_manifest(s.url, s.new, claim)
    before = snapshot(s.url)
    res = subprocess.run([sys.executable, "-c", _VERIFY_RSS, s.url], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rss_before, rss_after, kinds = res.stdout.split()
    assert kinds == "hash-mismatch"  # it read all 512 MiB: the zeros do not match "000..."
    grew_mib = (int(rss_after) - int(rss_before)) / 1024  # ru_maxrss is in KiB on Linux
    assert grew_mib < 200, f"verify's peak RSS grew {grew_mib:.0f} MiB for a 512 MiB array"
    assert_untouched(before, s.url)


# --------------------------------------------------------------------------------------------------
# item 11: duplicate keys


DUPLICATES: dict[str, Callable[[str], str]] = {
    "top-level": lambda d: d.replace('"step":2,', '"step":2,"step":2,', 1),
    "writer": lambda d: d.replace('"pid":', '"pid":1,"pid":', 1),
    "file-record": lambda d: d.replace('"codec":"none",', '"codec":"none","codec":"none",', 1),
    "tensor-table": lambda d: d.replace('"offset":[', '"offset":[7],"offset":[', 1),  # format 4's table
    "tree-node": lambda d: d.replace('"t":"int","v":2}', '"t":"int","v":3,"v":2}', 1),
    "with-spaces": lambda d: d.replace('"step":2,', '"step" : 1, "step" :2,', 1),
}


@pytest.mark.parametrize("where", sorted(DUPLICATES))
def test_duplicate_json_keys_in_a_manifest_break_the_cut(setup: Setup, where: str) -> None:
    s = setup
    data = open(s.manifest(s.new), "rb").read().decode()
    crafted = DUPLICATES[where](data)
    assert crafted != data
    write_manifest(s.url, s.new, crafted.encode())
    before = snapshot(s.url)
    with pytest.raises(ManifestError) as ei:
        ckptstore.load(s.url, cut=s.new)
    assert_names(ei.value, s, s.new, "MANIFEST.json")
    assert "repeats the key" in str(ei.value)
    with Store.open(s.url, readonly=True) as ro:
        assert ("manifest-broken", s.new) in [(f.kind, f.cut) for f in ro.verify().errors]
    assert ckptstore.load(s.url, cut=s.old)["step"] == 1
    assert_untouched(before, s.url)


def test_a_manifest_without_duplicates_still_takes_the_fast_path(setup: Setup) -> None:
    """Control: keys inside strings (escaped quotes, a colon) are not mistaken for duplicates."""
    s = setup
    rewrite_manifest(s.url, s.new, lambda doc: doc["metadata"].update({'a\\":"b': 'x":"y', "q": ':"', 'e\\': 1}))
    assert ckptstore.load(s.url, cut=s.new)["step"] == 2
