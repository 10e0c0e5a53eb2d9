"""Hostile shard headers in a cut of many small arrays (issue 23). Such a shard is read in runs and its
header is accepted at once when it is byte for byte what the writer writes for the manifest's records
(``shardcheck.header_is_written_form``); every other header gets the full check. These cases craft a
header that is valid safetensors but disagrees with the manifest, and rewrite the manifest's file
digest and sizes to match it (an attacker or a buggy tool that "fixed" the digests), so only the
header/manifest agreement can catch them. Each must be a DataError naming the store, the cut and the
shard, reported by verify, with the older cut still loading and nothing touched."""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import ckptstore
from ckptstore import Store, StoreOptions
from ckptstore.errors import DataError
from ckptstore.format import DATA_ALIGN
from ckptstore.hashing import file_digest_v2_columns
from filekit import rewrite_manifest, snapshot

COUNT = 600


@dataclass
class Setup:
    url: str
    old: str
    new: str

    def shards(self) -> list[str]:
        d = os.path.join(self.url, "cuts", self.new)
        return sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))


def _new_state() -> dict[str, Any]:
    # Same-sized neighbours (so offsets can be swapped without changing any size) and a few dtypes.
    g = torch.Generator().manual_seed(23)
    out: dict[str, Any] = {f"f{i:03d}": torch.randn(64, generator=g) for i in range(COUNT // 2)}
    out.update({f"i{i:03d}": torch.arange(i, i + 64, dtype=torch.int32) for i in range(COUNT // 2)})
    out["step"] = 2
    return out


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory) -> Setup:
    url = str(tmp_path_factory.mktemp("hostile-many") / "store")
    with Store.open(url, create=True, options=StoreOptions(max_shard_bytes=64 << 10)) as s:
        old = s.save({"w": torch.arange(6.0), "step": 1}, step=1).id
        new = s.save(_new_state(), step=2).id
    return Setup(url, old, new)


@pytest.fixture
def setup(_pristine: Setup, tmp_path) -> Setup:
    url = str(tmp_path / "store")
    shutil.copytree(_pristine.url, url)
    return Setup(url, _pristine.old, _pristine.new)


def _read_header(path: str) -> tuple[dict[str, Any], bytes]:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _rewrite_shard(s: Setup, shard: str, header_text: str) -> None:
    """Writes ``shard`` with ``header_text`` as its header (padded as the writer pads) over its own data
    section, and makes the manifest's record of the file agree: sizes and the v2 file digest."""
    path = os.path.join(s.url, "cuts", s.new, shard)
    _, body = _read_header(path)
    text = header_text.encode()
    padded = -(-(8 + len(text)) // DATA_ALIGN) * DATA_ALIGN
    text += b" " * (padded - 8 - len(text))
    head = struct.pack("<Q", len(text)) + text
    with open(path, "wb") as f:
        f.write(head + body)

    def fix(doc: dict[str, Any]) -> None:
        rows = sorted((t for t in doc["tensors"] if t["file"] == shard), key=lambda t: t["offset"])
        digest = file_digest_v2_columns(head, [t["nbytes"] for t in rows], [bytes.fromhex(t["blake3"]) for t in rows])
        for f in doc["files"]:
            if f["name"] == shard:
                f.update(nbytes=len(head) + len(body), raw_nbytes=len(head) + len(body), blake3=digest,
                         raw_blake3=digest)

    rewrite_manifest(s.url, s.new, fix)


def _two_same_sized(header: dict[str, Any]) -> tuple[str, str]:
    names = [k for k in header if k != "__metadata__"]
    for a in names:
        for b in names:
            if a < b and header[a]["dtype"] == header[b]["dtype"] and header[a]["shape"] == header[b]["shape"]:
                return a, b
    raise AssertionError("no two arrays of one dtype and shape in the shard")


def swap_offsets(h: dict[str, Any]) -> str:
    a, b = _two_same_sized(h)
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return json.dumps(h, separators=(",", ":"))


def other_dtype(h: dict[str, Any]) -> str:
    name = next(k for k in h if k != "__metadata__")
    h[name]["dtype"] = {"F32": "I32", "I32": "F32"}[h[name]["dtype"]]  # same size, other meaning
    return json.dumps(h, separators=(",", ":"))


def other_shape(h: dict[str, Any]) -> str:
    name = next(k for k in h if k != "__metadata__")
    h[name]["shape"] = [8, 8]
    return json.dumps(h, separators=(",", ":"))


def renamed(h: dict[str, Any]) -> str:
    name = next(k for k in h if k != "__metadata__")
    h["x" + name] = h.pop(name)
    return json.dumps(h, separators=(",", ":"))


def dropped(h: dict[str, Any]) -> str:
    name = [k for k in h if k != "__metadata__"][-1]  # the last: the data section stays contiguous
    del h[name]
    return json.dumps(h, separators=(",", ":"))


def duplicated(h: dict[str, Any]) -> str:
    # The same name twice, the second pointing at its neighbour's bytes: which one counts would depend
    # on the parser.
    a, b = _two_same_sized(h)
    text = json.dumps(h, separators=(",", ":"))
    return text[:-1] + "," + json.dumps(a) + ":" + json.dumps(h[b], separators=(",", ":")) + "}"


def spaced(h: dict[str, Any]) -> str:
    # The same header written with other whitespace: valid and equal in meaning, so it must load (the
    # full check, not the byte comparison, decides).
    return json.dumps(h, indent=1)


CASES: dict[str, Callable[[dict[str, Any]], str]] = {
    "swapped-offsets": swap_offsets, "other-dtype": other_dtype, "other-shape": other_shape,
    "renamed": renamed, "dropped": dropped, "duplicate-name": duplicated,
}


def _assert_rest_works(s: Setup) -> None:
    assert ckptstore.load(s.url, cut=s.old)["step"] == 1
    assert ckptstore.load(s.url, fallback=True)["step"] == 1


def test_the_cut_has_many_shards_of_many_arrays(setup: Setup) -> None:
    shards = setup.shards()
    assert len(shards) >= 3
    header, _ = _read_header(os.path.join(setup.url, "cuts", setup.new, shards[1]))
    assert len(header) > 50  # runs of small arrays: the bulk paths, not one array a file
    with Store.open(setup.url, readonly=True) as ro:
        assert ro.manifest(setup.new).format_version == 4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("which", [0, -1], ids=["first-shard", "last-shard"])
def test_a_header_that_disagrees_with_the_manifest_is_refused_by_name(setup: Setup, case: str, which: int) -> None:
    shard = setup.shards()[which]
    header, _ = _read_header(os.path.join(setup.url, "cuts", setup.new, shard))
    _rewrite_shard(setup, shard, CASES[case](header))
    before = snapshot(setup.url)
    with pytest.raises(DataError) as info:
        ckptstore.load(setup.url, cut=setup.new)
    text = str(info.value)
    assert setup.url in text and setup.new in text and shard in text, text
    with Store.open(setup.url, readonly=True) as ro:
        report = ro.verify(cut=setup.new)
    assert not report.ok and any((f.path or "").endswith(shard) for f in report.errors)
    assert snapshot(setup.url) == before  # the load and the verify changed nothing
    _assert_rest_works(setup)


def test_a_header_written_with_other_whitespace_still_loads(setup: Setup) -> None:
    shard = setup.shards()[2]
    header, _ = _read_header(os.path.join(setup.url, "cuts", setup.new, shard))
    _rewrite_shard(setup, shard, spaced(header))
    out = ckptstore.load(setup.url, cut=setup.new)
    want = _new_state()
    assert out.keys() == want.keys()
    assert all(torch.equal(out[k], want[k]) for k in want if k != "step")
    with Store.open(setup.url, readonly=True) as ro:
        assert ro.verify(cut=setup.new).ok
