"""A save's per-array work done in bulk (issue 23) writes the very bytes the format defines: the shards
and records of ``store.save`` and ``write_shards`` are compared with a reference built here from the
format's own definition (docs/format.md: a safetensors header as ``json.dumps`` writes it, the arrays
back to back in file order, blake3 per array, the v2 file digest), for states of many small arrays of
mixed dtypes and odd sizes, zero-size and 0-d arrays, numpy arrays, arrays split in pieces, several
shards, zstd; a gathered write that fails fails the save cleanly; ``describe``'s fast path gives the
bytes of the general one and keeps them alive."""

from __future__ import annotations

import errno
import gc
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from blake3 import blake3
from safetensors import safe_open

import ckptstore
from ckptstore import Store, layout
from ckptstore.arrays import ArrayItem, describe, describe_all
from ckptstore.format import SHARD_FORMAT, SHARD_FORMAT_VERSION, header_dtype
from ckptstore.shards import Codec, write_shards
from ckptstore.shardwrite import BATCH, GATHER_BELOW, PIECE
from ckptstore.storage import PosixSink, PosixStorage
from ckptstore.tree import Leaf, flatten

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.uint8, torch.float16, torch.int8]
SIZES = [0, 1, 3, 17, 1023, 1024, 4096, 5000]


def mixed_state(count: int = 1500) -> dict[str, Any]:
    """Many small tensors of every size class and dtype, a 0-d tensor, numpy arrays (0-d too), a
    non-contiguous tensor, a Parameter, and arrays at and above the gathering and piece sizes."""
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {}
    for i in range(count):
        dtype, n = DTYPES[i % len(DTYPES)], SIZES[i % len(SIZES)]
        t = torch.randn(n, generator=g) * 50
        state[f"layer.{i:05d}"] = t > 0 if dtype is torch.bool else t.to(dtype)
    state["shaped"] = torch.randn(3, 5, 7, generator=g)
    state["scalar"] = torch.tensor(2.5)
    state["np"] = np.arange(11, dtype=np.int16)
    state["np0"] = np.float64(3.0)
    state["np_u1"] = np.arange(256, dtype=np.uint8)
    state["transposed"] = torch.randn(40, 30, generator=g).t()
    state["param"] = torch.nn.Parameter(torch.randn(100, generator=g))
    state["at_gather"] = torch.randn(GATHER_BELOW // 4, generator=g)
    state["below_gather"] = torch.randn(GATHER_BELOW // 4 - 1, generator=g)
    state["pieces"] = torch.randn(PIECE // 4 + 12345, generator=g)
    return state


def raw_bytes(item: ArrayItem) -> bytes:
    return bytes(item.data)


def reference_order(items: list[ArrayItem]) -> list[ArrayItem]:
    """docs/format.md: arrays whose size is a multiple of 4096 first, each group in state order."""
    return [it for it in items if it.nbytes % 4096 == 0] + [it for it in items if it.nbytes % 4096]


def reference_header(items: list[ArrayItem]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION}}
    offset = 0
    for it in items:
        st, shape = header_dtype(it.kind, it.dtype, it.shape, it.nbytes)
        header[it.name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + it.nbytes]}
        offset += it.nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    body += b" " * (-(8 + len(body)) % 4096)
    return struct.pack("<Q", len(body)) + body


def reference_digest_v2(header: bytes, items: list[ArrayItem]) -> str:
    body = b"".join(struct.pack("<Q", it.nbytes) + blake3(raw_bytes(it)).digest() for it in items)
    return blake3(b"ckptstore-file-v2\0" + struct.pack("<Q", len(header)) + header + body).hexdigest()


def check_shards(root: str, cut: str, items: list[ArrayItem], files: list[Any], tensors: list[Any]) -> None:
    """Every shard file, file record and tensor record against the reference, shard by shard (the
    records say which arrays each shard holds; the reference says where and what they must be)."""
    by_name = {it.name: it for it in items}
    assert sorted(t.name for t in tensors) == sorted(by_name)
    for f in files:
        # A shard holds a run of the state's arrays (plan_shards): those its records name, in state order.
        held = {t.name for t in tensors if t.file == f.name}
        group = reference_order([it for it in items if it.name in held])
        header = reference_header(group)
        raw = header + b"".join(raw_bytes(it) for it in group)
        with open(os.path.join(root, layout.cut_file(cut, f.name)), "rb") as fh:
            stored = fh.read()
        digest = reference_digest_v2(header, group)
        assert (f.raw_nbytes, f.raw_blake3) == (len(raw), digest)
        if f.codec == "zstd":  # the stored bytes are hashed once more, plainly
            assert zstandard.ZstdDecompressor().stream_reader(stored).read() == raw
            assert (f.nbytes, f.blake3) == (len(stored), blake3(stored).hexdigest())
        else:
            assert stored == raw and (f.nbytes, f.blake3) == (len(raw), digest)
        offset = 0
        for it in group:
            rec = next(t for t in tensors if t.name == it.name)
            assert (rec.kind, rec.dtype, rec.shape, rec.nbytes, rec.file, rec.offset) == (
                it.kind, it.dtype, list(it.shape), it.nbytes, f.name, offset)
            assert rec.blake3 == blake3(raw_bytes(it)).hexdigest()
            offset += it.nbytes


def expected_items(state: dict[str, Any]) -> list[ArrayItem]:
    """The arrays of ``state`` with their bytes taken independently of ``describe``."""
    _, leaves = flatten(state, allow_pickle=False)
    out = []
    for leaf, item in zip(leaves, describe_all(leaves)):
        assert raw_bytes(item) == general_bytes(leaf.obj), leaf.name
        out.append(item)
    return out


def general_bytes(obj: Any) -> bytes:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return np.ascontiguousarray(obj).tobytes()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_store_save_writes_the_reference_bytes(tmp_path: Path, compression: str | None) -> None:
    state = mixed_state()
    url = str(tmp_path / "s")
    # Small shards: several files, and gathered runs cut at shard ends as well as at BATCH.
    options = ckptstore.StoreOptions(compression=compression, max_shard_bytes=3 << 20)
    with Store.open(url, create=True, options=options) as w:
        info = w.save(state, step=1)
        m = w.manifest()
    assert len(m.files) > 2
    check_shards(url, info.id, expected_items(state), m.files, m.tensors)
    loaded = ckptstore.load(url)
    for k, v in state.items():
        got = loaded[k]
        assert general_bytes(got) == general_bytes(v), k


@pytest.mark.parametrize("hash_threads", [1, -1])
def test_write_shards_matches_the_reference_across_batches(tmp_path: Path, hash_threads: int) -> None:
    """More small arrays than one gathering batch holds, so runs end at BATCH; large arrays between
    them; both hashing modes (inline, and on the helper thread beside the copy)."""
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {f"a{i:05d}": torch.randn(1024 + i % 3, generator=g) for i in range(3 * BATCH // 4096)}
    state["mid"] = torch.randn(PIECE // 2, generator=g)
    state.update({f"b{i:05d}": torch.randn(7, generator=g).to(torch.float64) for i in range(300)})
    storage = PosixStorage(str(tmp_path))
    storage.make_dir(layout.CUTS_DIR)
    storage.make_dir(layout.cut_dir("c"))
    items = expected_items(state)
    timings: dict[str, float] = {}
    seen: list[int] = []
    files, tensors = write_shards(storage, "c", 0, items, codec=Codec(), max_shard_bytes=1 << 30,
                                  hash_threads=hash_threads, timings=timings, on_bytes=seen.append)
    check_shards(str(tmp_path), "c", items, files, tensors)
    assert sum(seen) == sum(it.nbytes for it in items) and {"hash", "write", "fsync"} <= set(timings)


def test_the_shards_read_as_plain_safetensors(tmp_path: Path) -> None:
    state = {k: v for k, v in mixed_state(300).items() if isinstance(v, torch.Tensor)}
    url = str(tmp_path / "s")
    with Store.open(url, create=True) as w:
        info = w.save(state, step=1)
        m = w.manifest()
    (f,) = m.files
    with safe_open(os.path.join(url, layout.cut_file(info.id, f.name)), framework="pt") as st:
        names = set(st.keys())
        assert names == set(state)
        for name in names:
            got, want = st.get_tensor(name), state[name].detach().contiguous()
            if got.dtype == torch.uint8 and want.dtype != torch.uint8:  # a dtype stored as its U8 bytes
                assert got.numpy().tobytes() == general_bytes(want), name
            else:
                assert got.dtype == want.dtype and torch.equal(got, want), name


class _FullSink(PosixSink):
    writes = 0
    fail_at = 0

    def write(self, data):  # type: ignore[no-untyped-def]
        _FullSink.writes += 1
        if _FullSink.writes == _FullSink.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(data)


class _FullDisk(PosixStorage):
    """A real POSIX store whose shard writes fail with ENOSPC at the ``fail_at``-th write."""

    def open_sink(self, rel: str):  # type: ignore[no-untyped-def]
        return _FullSink(self, rel)


@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_failed_gathered_write_fails_the_save_cleanly(tmp_path: Path, fail_at: int) -> None:
    """40 KB of small arrays a batch: the header, then gathered batches, each one sink write."""
    state = {f"w{i:04d}": torch.full((1024,), float(i)) for i in range(2000)}
    url = str(tmp_path / "s")
    with Store.open(url, create=True) as w:
        w.save({"x": torch.ones(3)}, step=1)
    _FullSink.writes, _FullSink.fail_at = 0, fail_at
    with Store.open(_FullDisk(url)) as w:
        with pytest.raises(ckptstore.StorageError) as err:
            w.save(state, step=2)
        assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
        assert w.latest().step == 1
    _FullSink.fail_at = 0
    assert len(list(Path(url).rglob("*.safetensors"))) == 1  # the committed cut's: the partial one is gone
    with Store.open(url) as w:
        w.save(state, step=3)
    loaded = ckptstore.load(url)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_describe_fast_path_keeps_the_tensor_memory_alive() -> None:
    t = torch.arange(4096, dtype=torch.float32)
    item = describe(Leaf("t", "torch", t))
    tail = item.data[-8:]
    del t, item
    gc.collect()
    torch.randn(1 << 20)  # reuse freed memory, were the view's owner gone
    assert bytes(tail) == struct.pack("<2f", 4094.0, 4095.0)


def test_describe_gives_the_general_bytes_for_every_kind_of_tensor() -> None:
    cases = {
        "contiguous": torch.randn(3, 4), "empty": torch.empty(0, 5), "scalar": torch.tensor(1.5),
        "transposed": torch.randn(5, 6).t(), "grad": torch.randn(4, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(7)), "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "neg": torch.randn(3, dtype=torch.complex64).conj().imag, "bf16": torch.randn(8).to(torch.bfloat16),
        "offset": torch.arange(10)[2:7], "channels_last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "bool": torch.tensor([True, False]),
    }
    for name, t in cases.items():
        item = describe(Leaf(name, "torch", t))
        assert (item.kind, item.shape, item.nbytes) == ("torch", tuple(t.shape), t.numel() * t.element_size()), name
        assert item.dtype == str(t.dtype).removeprefix("torch."), name
        assert item.data.format == "B" and item.data.ndim == 1 and bytes(item.data) == general_bytes(t), name
    assert [i.name for i in describe_all([Leaf(n, "torch", t) for n, t in cases.items()])] == list(cases)


def test_headers_and_file_digests_made_in_chunks_are_the_reference_bytes(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The header text and the v2 file digest are made a few thousand arrays at a time (issue 23: whole,
    they were tens of MB of a cut's peak at 100,000 arrays). With chunks of 7 and 5 arrays, runs of
    mixed dtypes and shapes cross many chunk ends, and a chunk ends exactly at the last array too."""
    import ckptstore.format as fmt
    import ckptstore.hashing as hashing

    monkeypatch.setattr(fmt, "_CHUNK", 7)
    monkeypatch.setattr(hashing, "DIGEST_CHUNK", 5)
    g = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {}
    for i in range(70):  # 70: a multiple of both chunks' sizes
        dtype = DTYPES[i % len(DTYPES)]
        t = torch.randn(1 + i % 4, 3, generator=g) * 9
        state[f"m.{i:03d}"] = t > 0 if dtype is torch.bool else t.to(dtype)
    storage = PosixStorage(str(tmp_path))
    storage.make_dir(layout.CUTS_DIR)
    items = expected_items(state)
    for n in (70, 69, 1):  # whole chunks, a chunk short of one, a single array
        cut = f"c{n}"
        storage.make_dir(layout.cut_dir(cut))
        files, tensors = write_shards(storage, cut, 0, items[:n], codec=Codec(), max_shard_bytes=1 << 30)
        check_shards(str(tmp_path), cut, items[:n], files, tensors)
