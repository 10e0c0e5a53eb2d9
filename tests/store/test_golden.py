"""Golden stores (tests/golden/, made by tests/golden/make_golden.py): every format version this
ckptstore reads keeps verifying and loading to the same values, and the current version's bytes never
drift silently. Also the format-v2 digest rules: each tensor is named when its bytes are damaged, the
header bytes (padding included) are covered, v1 and v2 cuts live side by side, and each byte is hashed
once on write and on load."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from blake3 import blake3

import ckptstore
from ckptstore import Store, hashing
from filekit import flip_byte

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "format.md"
sys.path.insert(0, str(GOLDEN))
import make_golden  # noqa: E402

CUT7, CUT8 = make_golden.CUTS[0][0], make_golden.CUTS[1][0]


def _copy(version: int, tmp_path: Path) -> str:
    """A copy of a golden store (a writer open would leave lock files in the checked-in one)."""
    dst = tmp_path / f"v{version}"
    shutil.copytree(GOLDEN / f"v{version}", dst)
    for d in ("marks", "bad"):  # git keeps no empty directories; a created store has them
        (dst / d).mkdir()
    return str(dst)


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Bit-exact equality, types included (Parameter, dtype, numpy scalar, tuple vs list)."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.detach().view(torch.uint8) if got.numel() else got,
                           want.detach().view(torch.uint8) if want.numel() else want), where
        assert got.requires_grad == want.requires_grad, where
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), where
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, where


@pytest.mark.parametrize("version", [1, 2, 4])
def test_golden_store_verifies_and_loads(tmp_path: Path, version: int) -> None:
    url = _copy(version, tmp_path)
    with Store.open(url, readonly=True) as ro:
        report = ro.verify()
        assert report.ok and report.findings == [], report.findings
        assert report.cuts_checked == [CUT7, CUT8] and report.files_checked == 4
        assert [ro.manifest(c).format_version for c in (CUT7, CUT8)] == [version, version]
        assert ro.latest().id == CUT8  # type: ignore[union-attr]
    states = make_golden.golden_states()
    assert_same(ckptstore.load(url, cut=CUT7), states[7])
    assert_same(ckptstore.load(url), states[8])
    assert_same(ckptstore.load(url, cut=7, verify=False), states[7])
    part = ckptstore.load(url, cut=CUT7, keys=["opt", "np"])
    assert_same(part, {"opt": states[7]["opt"], "np": states[7]["np"]})


def test_v1_golden_keeps_plain_file_hashes(tmp_path: Path) -> None:
    """Format v1's meaning is unchanged: a file record is the b3sum of the file."""
    url = _copy(1, tmp_path)
    m = json.loads((Path(url) / "cuts" / CUT7 / "MANIFEST.json").read_bytes())
    for f in m["files"]:
        data = (Path(url) / "cuts" / CUT7 / f["name"]).read_bytes()
        assert f["blake3"] == f["raw_blake3"] == blake3(data).hexdigest()


def test_v4_golden_bytes_do_not_drift(tmp_path: Path) -> None:
    """The same states with the same identity give byte-identical shards, manifests and LATEST to the
    checked-in v4 store (the version written today; v2 was, up to issue 23). A zstd shard's compressed bytes are only compared under the zstandard release
    the golden was made with (zstd may compress differently without any format change); its decoded
    bytes always are."""
    fresh = tmp_path / "fresh"
    assert make_golden.build_store(str(fresh)) == 4
    golden = GOLDEN / "v4"
    files = sorted(p.relative_to(golden) for p in golden.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    same_zstd = zstandard.__version__ == make_golden.ZSTANDARD_VERSION
    for rel in files:
        a, b = (golden / rel).read_bytes(), (fresh / rel).read_bytes()
        in_zstd_cut = CUT8 in str(rel) or str(rel) == "LATEST"
        if same_zstd or not in_zstd_cut:
            assert a == b, f"{rel} drifted from the checked-in v4 golden"
        elif str(rel).endswith(".zst"):
            dec = zstandard.ZstdDecompressor()
            assert dec.stream_reader(a).read() == dec.stream_reader(b).read(), rel
        elif rel.name == "MANIFEST.json":
            ma, mb = json.loads(a), json.loads(b)
            for m in (ma, mb):
                for f in m["files"]:
                    del f["nbytes"], f["blake3"]  # the compressed bytes' size and digest
            assert ma == mb, rel


def test_the_v4_golden_is_the_v2_golden_with_its_arrays_as_a_table() -> None:
    """Version 4 changed the manifest's tensor list only: the same states give the same shard bytes
    and the same records (hex digests, sizes, offsets), the table holding exactly the rows' values."""
    from ckptstore.manifest import Manifest

    for cut in (CUT7, CUT8):
        v2, v4 = (GOLDEN / f"v{v}" / "cuts" / cut for v in (2, 4))
        assert sorted(p.name for p in v2.iterdir()) == sorted(p.name for p in v4.iterdir())
        for p in v2.iterdir():
            if p.name != "MANIFEST.json" and (zstandard.__version__ == make_golden.ZSTANDARD_VERSION
                                              or not p.name.endswith(".zst")):
                assert p.read_bytes() == (v4 / p.name).read_bytes(), p.name
        d2, d4 = (json.loads((d / "MANIFEST.json").read_bytes()) for d in (v2, v4))
        assert (d2["format_version"], d4["format_version"]) == (2, 4)
        assert {k: v for k, v in d2.items() if k not in ("format_version", "tensors", "files")} == \
            {k: v for k, v in d4.items() if k not in ("format_version", "tensors", "files")}
        table = d4["tensors"]
        assert table["name"] == [t["name"] for t in d2["tensors"]]
        assert table["shape"] == [t["shape"] for t in d2["tensors"]]
        assert table["offset"] == [t["offset"] for t in d2["tensors"]]
        assert [table["dtypes"][i] for i in table["dtype"]] == [[t["kind"], t["dtype"]] for t in d2["tensors"]]
        assert [d4["files"][i]["name"] for i in table["file"]] == [t["file"] for t in d2["tensors"]]
        assert __import__("base64").b64decode(table["blake3"]).hex() == "".join(t["blake3"] for t in d2["tensors"])
        if zstandard.__version__ == make_golden.ZSTANDARD_VERSION:
            m2, m4 = (Manifest.from_bytes((d / "MANIFEST.json").read_bytes()) for d in (v2, v4))
            assert m2.tensors == m4.tensors and m2.files == m4.files


def test_docs_reference_code_computes_the_v2_file_digests() -> None:
    """The snippet in docs/format.md is the definition: it reproduces every v2 golden record."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    code = [b for b in blocks if "def v2_file_digest" in b]
    assert len(code) == 1
    ns: dict[str, Any] = {}
    exec(code[0], ns)
    checked = 0
    for cut in (CUT7, CUT8):
        m = json.loads((GOLDEN / "v2" / "cuts" / cut / "MANIFEST.json").read_bytes())
        for f in m["files"]:
            stored = (GOLDEN / "v2" / "cuts" / cut / f["name"]).read_bytes()
            raw = zstandard.ZstdDecompressor().stream_reader(stored).read() if f["codec"] == "zstd" else stored
            assert ns["v2_file_digest"](raw) == f["raw_blake3"]
            if f["codec"] == "zstd":
                assert f["blake3"] == blake3(stored).hexdigest()
            else:
                assert f["blake3"] == f["raw_blake3"] != blake3(stored).hexdigest()  # not a b3sum any more
            checked += 1
    assert checked == 4


# --------------------------------------------------------------------------------------------------
# damage to v2 shards


def _shard_and_record(url: str, cut: str, tensor: str) -> tuple[str, Any, int]:
    """The shard path holding ``tensor``, its TensorRecord, and the file offset of its data section."""
    with Store.open(url, readonly=True) as ro:
        t = ro.manifest(cut).tensor_index()[tensor]
    path = os.path.join(url, "cuts", cut, t.file)
    with open(path, "rb") as fh:
        data_start = 8 + int.from_bytes(fh.read(8), "little")
    return path, t, data_start


def _verify_errors(url: str, *, streaming: bool = False) -> list[ckptstore.Finding]:
    with Store.open(url, readonly=True) as ro:
        if streaming:  # the object-store path: stream the file instead of mapping it
            ro.storage.local_path = lambda rel: None  # type: ignore[method-assign]
        return ro.verify().errors


@pytest.mark.parametrize("tensor", ["model/b", "model/w", "opt/state/0/exp_avg", "np_be"])
def test_flipped_byte_in_a_v2_tensor_names_the_tensor(tmp_path: Path, tensor: str) -> None:
    url = _copy(2, tmp_path)
    path, t, data_start = _shard_and_record(url, CUT7, tensor)
    flip_byte(path, data_start + t.offset + t.nbytes - 1)
    for streaming in (False, True):
        errs = _verify_errors(url, streaming=streaming)
        assert [(f.kind, f.cut) for f in errs] == [("hash-mismatch", CUT7)], errs
        assert repr(tensor) in errs[0].message and errs[0].path.endswith(t.file)  # type: ignore[union-attr]
        if not streaming:
            assert errs[0].expected == t.blake3 and errs[0].found not in (None, t.blake3)
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(url, cut=CUT7)
    assert repr(tensor) in str(ei.value) and t.file in str(ei.value)
    top = tensor.split("/")[0]
    with pytest.raises(ckptstore.CorruptCut):
        ckptstore.load(url, cut=CUT7, keys=[top])
    # The other cut, and keys whose arrays are intact, still load.
    assert_same(ckptstore.load(url), make_golden.golden_states()[8])
    other = "np" if top != "np" else "model"
    ckptstore.load(url, cut=CUT7, keys=[other])


@pytest.mark.parametrize("change", ["flip", "newline"])
def test_header_padding_is_covered_by_the_v2_file_digest(tmp_path: Path, change: str) -> None:
    """The padding is part of H. A newline instead of a padding space still parses as the same header,
    so only the file digest can notice; verify (both paths) and load must."""
    url = _copy(2, tmp_path)
    path, t, data_start = _shard_and_record(url, CUT7, "model/w")
    with open(path, "rb") as fh:
        assert fh.read(data_start)[-2:] == b"  "
    if change == "flip":
        flip_byte(path, data_start - 2)
    else:
        with open(path, "r+b") as fh:
            fh.seek(data_start - 2)
            fh.write(b"\n")
    for streaming in (False, True):
        errs = _verify_errors(url, streaming=streaming)
        assert len(errs) == 1 and errs[0].cut == CUT7 and errs[0].path.endswith(t.file), errs  # type: ignore[union-attr]
        assert errs[0].kind == ("hash-mismatch" if change == "newline" or not streaming else "corrupt-file"), errs
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(url, cut=CUT7)
    assert t.file in str(ei.value)
    if change == "newline":
        assert "blake3 mismatch" in str(ei.value)


def test_v1_golden_damage_is_found_as_before(tmp_path: Path) -> None:
    url = _copy(1, tmp_path)
    path, t, data_start = _shard_and_record(url, CUT7, "model/b")
    flip_byte(path, data_start + t.offset)
    errs = _verify_errors(url)
    assert [(f.kind, f.cut) for f in errs] == [("hash-mismatch", CUT7)]
    assert errs[0].found == blake3(Path(path).read_bytes()).hexdigest()  # v1: the plain file hash
    with pytest.raises(ckptstore.CorruptCut):
        ckptstore.load(url, cut=CUT7)
    assert [(f.kind, f.cut) for f in _verify_errors(url, streaming=True)] == [("hash-mismatch", CUT7)]


def test_v1_and_v2_cuts_in_one_store(tmp_path: Path) -> None:
    url = _copy(1, tmp_path)
    state = {"w": torch.arange(5000, dtype=torch.float32), "odd": torch.ones(3, dtype=torch.int8), "step": 9}
    with Store.open(url) as w:
        info = w.save(state, step=9)
        assert w.manifest(info.id).format_version == 4
        report = w.verify()
        assert report.ok and report.cuts_checked == [CUT7, CUT8, info.id], report.findings
    with Store.open(url, readonly=True) as ro:
        assert [ro.manifest(c).format_version for c in (CUT7, CUT8, info.id)] == [1, 1, 4]
    states = make_golden.golden_states()
    assert_same(ckptstore.load(url, cut=7), states[7])
    assert_same(ckptstore.load(url, cut=8), states[8])
    assert_same(ckptstore.load(url), state)
    # Damage to the v1 cut is reported against it alone.
    path, t, data_start = _shard_and_record(url, CUT7, "model/w")
    flip_byte(path, data_start + 5)
    assert [(f.kind, f.cut) for f in _verify_errors(url)] == [("hash-mismatch", CUT7)]


# --------------------------------------------------------------------------------------------------
# each byte hashed once; write_shards


class _Counting:
    def __init__(self, inner: Any, counts: list[int]) -> None:
        self.inner, self.counts = inner, counts

    def update(self, data: Any) -> Any:
        self.counts.append(memoryview(data).nbytes)
        return self.inner.update(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_each_byte_is_hashed_once_on_save_and_load(tmp_path: Path, monkeypatch, compression: str | None) -> None:
    counts: list[int] = []
    real = hashing.new_hasher
    monkeypatch.setattr(hashing, "new_hasher", lambda **kw: _Counting(real(**kw), counts))
    state = {"big": torch.arange(3 << 18, dtype=torch.float32), "small": torch.ones(7), "n": np.arange(5)}
    url = str(tmp_path / "s")
    with Store.open(url, create=True, options=ckptstore.StoreOptions(compression=compression)) as w:
        w.save(state, step=1)
        m = w.manifest()
    data = sum(t.nbytes for t in m.tensors)
    stored = sum(f.nbytes for f in m.files) if compression else 0
    assert sum(counts) == data + stored  # the composite hashes only the header and 40 bytes a tensor
    counts.clear()
    assert_same(ckptstore.load(url), state)
    assert sum(counts) == data + stored
    counts.clear()
    ckptstore.load(url, verify=False)
    assert counts == []


def test_write_shards_plans_names_and_records(tmp_path: Path) -> None:
    from ckptstore.arrays import ArrayItem
    from ckptstore.shards import Codec, write_shards
    from ckptstore.storage import open_storage

    storage = open_storage(str(tmp_path))
    storage.make_dir("cuts")
    storage.make_dir("cuts/c")
    arrays = [np.full(3000, i, dtype=np.uint8) for i in range(5)]
    items = [ArrayItem(f"a{i}", "numpy", "|u1", (3000,), 3000, memoryview(a)) for i, a in enumerate(arrays)]
    shards: list[int] = []
    timings: dict[str, float] = {}
    files, tensors = write_shards(storage, "c", 3, items, codec=Codec(), max_shard_bytes=6000,
                                  timings=timings, on_shard=lambda: shards.append(1))
    assert [f.name for f in files] == [f"rank00003-0000{i}.safetensors" for i in range(3)]
    assert len(shards) == 3 and {f.rank for f in files} == {3} and {"hash", "write", "fsync"} <= set(timings)
    assert [t.name for t in tensors] == [f"a{i}" for i in range(5)]
    for t in tensors:
        assert t.blake3 == blake3(arrays[int(t.name[1:])].tobytes()).hexdigest()
    zfiles, _ = write_shards(storage, "c", 0, items, codec=Codec("zstd"), max_shard_bytes=1 << 20)
    assert [f.name for f in zfiles] == ["rank00000-00000.safetensors.zst"]


# --------------------------------------------------------------------------------------------------
# v5: a cut of several ranks (a commit record and one fragment per rank, issue 22)

CUT9, STEP9, WORLD9 = make_golden.RANKS_CUT[:3]


def test_v5_golden_verifies_and_loads_each_rank(tmp_path: Path) -> None:
    url = _copy(5, tmp_path)
    states = make_golden.golden_rank_states()
    shards = sorted(p.name for p in (Path(url) / "cuts" / CUT9).iterdir() if ".safetensors" in p.name)
    assert shards == ["rank00000-00000.safetensors", "rank00000-00001.safetensors", "rank00001-00000.safetensors"]
    with Store.open(url, readonly=True) as ro:
        report = ro.verify()
        assert report.ok and report.findings == [], report.findings
        assert report.cuts_checked == [CUT9] and report.files_checked == len(shards)
        assert ro.latest().id == CUT9  # type: ignore[union-attr]
        m = ro.manifest()
        assert (m.cut, m.step, m.world_size) == (CUT9, STEP9, WORLD9)
        assert sorted(f.name for f in m.files) == shards
        assert sorted({f.rank for f in m.files}) == [0, 1]
        assert [sum(t.file.startswith(f"rank{r:05d}-") for t in m.tensors) for r in range(WORLD9)] == [5, 6]
        assert ro.manifest(CUT9).files == m.files
        for r in range(WORLD9):
            assert_same(ro.load(rank=r), states[r], f"rank {r}")
            assert_same(ro.load(CUT9, rank=r, keys=["model", "np"]),
                        {"model": states[r]["model"], "np": states[r]["np"]}, f"rank {r} keys")
        with pytest.raises(ckptstore.UsageError, match="world size 2"):
            ro.load()
        with pytest.raises(ckptstore.UsageError):
            ro.load(CUT9)
    for r in range(WORLD9):
        assert_same(ckptstore.load(url, rank=r), states[r], f"rank {r}")
        assert_same(ckptstore.load(url, cut=STEP9, rank=r, verify=False), states[r], f"rank {r}")
    with pytest.raises(ckptstore.UsageError):
        ckptstore.load(url)


def test_v5_golden_bytes_do_not_drift(tmp_path: Path) -> None:
    """The same ranks' states with the same identity give byte-identical shards, fragments, commit
    record and LATEST to the checked-in v5 store (the version a cut of several ranks is written in
    today). Uncompressed shards only: no zstd release can change these bytes."""
    fresh = tmp_path / "fresh"
    assert make_golden.build_ranks_store(str(fresh)) == 5
    golden = GOLDEN / "v5"
    files = sorted(p.relative_to(golden) for p in golden.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    names = {rel.name for rel in files}
    assert {"MANIFEST.json", "rank00000.json", "rank00001.json", "LATEST", "STORE.json"} <= names
    for rel in files:
        assert (golden / rel).read_bytes() == (fresh / rel).read_bytes(), f"{rel} drifted from the checked-in v5 golden"


def test_the_v5_commit_record_references_its_fragments() -> None:
    """The commit record holds the cut's fields and the parts table only, O(ranks) bytes: each entry is
    its fragment's size, blake3 and counts; each fragment is RankRecord format 2 of its rank. Both parse
    back to the same bytes, and each fragment's tree is the one a save of its state writes."""
    from ckptstore.manifest import Manifest, RankRecord
    from ckptstore.saving import prepare_state

    cut = GOLDEN / "v5" / "cuts" / CUT9
    data = (cut / "MANIFEST.json").read_bytes()
    assert len(data) < 1024, len(data)  # two ranks; well under 2 KB
    doc = json.loads(data)
    assert doc["format_version"] == 5 and doc["world_size"] == WORLD9
    assert not {"files", "tensors", "tree", "attached"} & doc.keys()
    m = Manifest.from_bytes(data)
    assert m.fragmented and m.to_bytes() == data
    latest = json.loads((GOLDEN / "v5" / "LATEST").read_bytes())
    assert (latest["cut"], latest["step"], latest["manifest_blake3"]) == (CUT9, STEP9, hashing.digest(data))
    states = make_golden.golden_rank_states()
    for r, ref in enumerate(m.parts):
        frag = (cut / f"rank{r:05d}.json").read_bytes()
        assert (ref.name, ref.nbytes, ref.blake3) == (f"rank{r:05d}.json", len(frag), hashing.digest(frag))
        rec = RankRecord.from_bytes(frag)
        assert (rec.format_version, rec.cut, rec.step, rec.rank, rec.world_size) == (2, CUT9, STEP9, r, WORLD9)
        assert rec.to_bytes() == frag and rec.part_ref(frag) == ref
        assert json.loads(frag)["tensors"].keys() >= {"name", "dtype", "shape", "file", "offset", "blake3"}
        shard_bytes = sum((cut / f.name).stat().st_size for f in rec.files)
        assert (ref.data_nbytes, ref.files, ref.arrays, ref.attached, ref.pickled) == \
            (shard_bytes, len(rec.files), len(rec.tensors), 0, False)
        tree, _, pickled, _ = prepare_state(states[r], None, False, "golden")
        assert rec.tree == tree and not pickled
