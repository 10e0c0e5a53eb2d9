"""Round trips through a real store on disk: ``store.save`` then ``ckptstore.load`` gives back the same
structure, the same types and bit-identical values; partial loads read only what they need."""

from __future__ import annotations

import collections
import math
import os
import pickle
import random
import re
import struct
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pytest
import torch

import ckptstore
from filekit import flip_byte
from ckptstore import CutInfo, Store, StoreOptions
from ckptstore.format import TORCH_DTYPES

# --------------------------------------------------------------------------------------------------
# helpers


def _next_step(store: Store) -> int:
    latest = store.latest()
    return 0 if latest is None else latest.step + 1


def roundtrip(store: Store, state: Any, **load_kw: Any) -> Any:
    """Saves ``state`` as a new cut and loads that cut back through the public ``ckptstore.load``."""
    info = store.save(state, step=_next_step(store))
    return ckptstore.load(store.url, cut=info.id, **load_kw)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy().tobytes()) if t.numel() else b""


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(expected: Any, got: Any, path: str = "<root>") -> None:
    """Same type, same structure, bit-identical leaves (nan payloads and -0.0 included)."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, path
        assert got.shape == expected.shape, path
        assert _tensor_bytes(got) == _tensor_bytes(expected), f"{path}: tensor bytes differ"
        if isinstance(expected, torch.nn.Parameter):
            assert got.requires_grad == expected.requires_grad, path
        assert not got.is_conj(), path
    elif isinstance(expected, np.ndarray):
        assert got.dtype.str == expected.dtype.str, f"{path}: {got.dtype.str} != {expected.dtype.str}"
        assert got.shape == expected.shape, f"{path}: {got.shape} != {expected.shape}"
        assert got.tobytes() == expected.tobytes(), f"{path}: array bytes differ"
    elif isinstance(expected, np.generic):
        assert got.dtype.str == expected.dtype.str, path
        assert got.tobytes() == expected.tobytes(), path
    elif isinstance(expected, float):
        assert _float_bits(got) == _float_bits(expected), f"{path}: {got!r} != {expected!r}"
    elif isinstance(expected, complex):
        assert _float_bits(got.real) == _float_bits(expected.real), path
        assert _float_bits(got.imag) == _float_bits(expected.imag), path
    elif isinstance(expected, dict):
        assert list(got.keys()) == list(expected.keys()), path
        for k in expected:
            assert type(next(x for x in got if x == k)) is type(k), f"{path}: key {k!r} changed type"
            assert_same(expected[k], got[k], f"{path}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{path}/{i}")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bit patterns (nan payloads, subnormals, ...)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


# --------------------------------------------------------------------------------------------------
# containers and python values


def test_containers_keep_structure_types_and_order(store: Store) -> None:
    state = {
        "str": {"b": 1, "a": 2, "": 3, "with/slash~tilde": 4, "ünï©ødé ✓": 5},
        "int_keys": {3: "three", -1: "minus one", 0: "zero", 10**30: "huge key"},
        "mixed_keys": {1: "int", "1": "str"},
        "ordered": collections.OrderedDict([("z", 1), ("a", [1, 2]), ("m", {"x": None})]),
        "list": [1, "two", 3.0, [4, [5, (6,)]], {"k": (7, 8)}],
        "tuple": (1, (2, (3, [4])), {"t": ()}),
        "empty": {"d": {}, "l": [], "t": (), "od": collections.OrderedDict()},
        "deep": {"a": {"b": {"c": {"d": [{"e": (torch.arange(3),)}]}}}},
    }
    out = roundtrip(store, state)
    assert_same(state, out)
    assert type(out["ordered"]) is collections.OrderedDict
    assert type(out["str"]) is dict
    assert out["mixed_keys"][1] == "int" and out["mixed_keys"]["1"] == "str"


def test_top_level_non_dict_states(store: Store) -> None:
    for state in ([torch.ones(2), {"a": 1}], (1, 2), torch.arange(4), 7, None, "just a string"):
        assert_same(state, roundtrip(store, state))


@pytest.mark.parametrize(
    "value",
    [
        0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**1000 + 12345, -(10**1200) - 7,
        True, False, None,
        "", "plain", "ünï©ødé ✓ 日本語 🚀", "nul\x00inside", "lone surrogate \ud800", "\"quotes\" and \\",
        b"", bytes(range(256)), bytearray(b"mutable\x00\xff"), bytearray(),
    ],
    ids=repr,
)
def test_python_scalars(store: Store, value: Any) -> None:
    out = roundtrip(store, {"v": value})
    assert_same({"v": value}, out)


def test_huge_int_beyond_decimal_conversion_limit(store: Store) -> None:
    """Ints with more digits than CPython converts to decimal by default (4300) must round-trip too,
    and the manifest must stay loadable in a process that keeps the default limit."""
    big = {"pos": 10**5000 + 1, "neg": -(3**12000), "in_list": [2**8193, -(2**8192)], "edge": 2**8192 - 1}
    out = roundtrip(store, big)
    assert_same(big, out)
    # Keys that wide are refused up front, naming where (never a raw ValueError from json).
    with pytest.raises(ckptstore.UnsupportedValue) as ei:
        store.save({"cfg": {2**20000: "big key"}}, step=_next_step(store))
    assert "cfg" in str(ei.value)


def test_huge_int_saved_under_raised_limit_loads_under_default(store: Store) -> None:
    """A process that raised sys.set_int_max_str_digits must not write a manifest that a default
    process cannot parse (that would be a committed cut nobody can load)."""
    import subprocess
    import sys

    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        info = store.save({"x": 10**6000 + 3}, step=0)
    finally:
        sys.set_int_max_str_digits(old)
    code = (
        "import sys, ckptstore\n"
        f"s = ckptstore.load({store.url!r}, cut={info.id!r})\n"
        "assert s['x'] == 10**6000 + 3\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def _nan_with_payload() -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]


def test_floats_bit_exact(store: Store) -> None:
    floats = [0.0, -0.0, 0.1, -1.5, math.inf, -math.inf, math.nan, -math.nan, _nan_with_payload(), 5e-324,
              -5e-324, 1.7976931348623157e308, 2.2250738585072014e-308, 1 / 3]
    state = {"floats": floats, "complex": [complex(0.1, -0.0), complex(math.nan, math.inf), complex(-0.0, 0.0),
                                           complex(_nan_with_payload(), -math.inf)]}
    out = roundtrip(store, state)
    assert_same(state, out)
    assert math.copysign(1.0, out["floats"][1]) == -1.0
    assert struct.pack("<d", out["floats"][8]) == struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF)


def test_torch_size_and_dtype(store: Store) -> None:
    state = {"size": torch.Size([3, 0, 5]), "empty_size": torch.Size([]),
             "dtypes": [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64,
                        torch.float8_e4m3fn]}
    out = roundtrip(store, state)
    assert_same(state, out)
    assert isinstance(out["size"], torch.Size)
    assert all(isinstance(d, torch.dtype) for d in out["dtypes"])


# --------------------------------------------------------------------------------------------------
# tensors

REQUESTED_DTYPES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", REQUESTED_DTYPES)
def test_every_dtype_roundtrips_bit_exact(store: Store, name: str) -> None:
    dtype = getattr(torch, name)
    state = {
        "t": _random_tensor(dtype, (3, 5), seed=1),
        "zero_dim": _random_tensor(dtype, (), seed=2),
        "empty": torch.empty((0, 5), dtype=dtype),
        "transposed": _random_tensor(dtype, (4, 6), seed=3).t(),
        "strided": _random_tensor(dtype, (10, 7), seed=4)[::3, 1::2],
    }
    assert not state["transposed"].is_contiguous() and not state["strided"].is_contiguous()
    out = roundtrip(store, state)
    assert_same(state, out)
    assert out["zero_dim"].dim() == 0
    assert out["empty"].shape == (0, 5)


def _all_torch_dtypes() -> list[torch.dtype]:
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_torch_dtype_roundtrips_or_is_refused_cleanly(store: Store) -> None:
    """Whatever dtype torch has: either it round-trips, or save raises UnsupportedValue naming the key
    and leaves the store untouched (never a raw exception, never a leftover)."""
    assert set(REQUESTED_DTYPES) <= {str(d).removeprefix("torch.") for d in _all_torch_dtypes()}
    refused = []
    for dtype in _all_torch_dtypes():
        name = str(dtype).removeprefix("torch.")
        try:
            t = torch.zeros(4, dtype=dtype)
        except Exception:  # noqa: BLE001 - dtypes torch cannot even allocate plainly are out of scope
            continue
        before = store.cuts()
        if name in TORCH_DTYPES:
            out = roundtrip(store, {"x": t})
            assert out["x"].dtype == dtype
            continue
        with pytest.raises(ckptstore.UnsupportedValue) as ei:
            store.save({"model": {"w": t}}, step=_next_step(store))
        assert "model/w" in str(ei.value), str(ei.value)
        assert store.cuts() == before
        assert os.listdir(os.path.join(store.url, "marks")) == []
        refused.append(name)
    assert set(refused).isdisjoint(REQUESTED_DTYPES)


def test_conj_and_neg_views_load_as_their_values(store: Store) -> None:
    torch.manual_seed(5)
    z = torch.complex(torch.randn(4, 3), torch.randn(4, 3))
    conj = z.conj()
    assert conj.is_conj()
    state = {"conj": conj, "conj_t": z.t().conj(), "imag_of_conj": conj.imag}
    out = roundtrip(store, state)
    assert torch.equal(out["conj"], conj.resolve_conj())
    assert not out["conj"].is_conj()
    assert torch.equal(out["conj_t"], z.t().conj().resolve_conj())
    assert torch.equal(out["imag_of_conj"], -z.imag)
    assert_same(state, out)


def test_parameters_stay_parameters(store: Store) -> None:
    p_grad = torch.nn.Parameter(torch.randn(3, 2))
    p_frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    state = {"model": {"w": p_grad, "frozen": p_frozen, "buffer": torch.ones(2)}}
    out = roundtrip(store, state)
    assert_same(state, out)
    assert isinstance(out["model"]["w"], torch.nn.Parameter) and out["model"]["w"].requires_grad
    assert isinstance(out["model"]["frozen"], torch.nn.Parameter) and not out["model"]["frozen"].requires_grad
    assert not isinstance(out["model"]["buffer"], torch.nn.Parameter)


def test_module_state_dict_roundtrip(store: Store) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 8))  # moves the BatchNorm running stats and its int64 0-dim counter
    # An optimizer-shaped state (a real optimizer costs seconds of imports on this machine).
    optim = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 8)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                               "amsgrad": False, "foreach": None, "params": [0, 1, 2]}]}
    state = {"model": model.state_dict(), "optim": optim}
    out = roundtrip(store, state)
    assert_same(state, out)
    assert type(out["model"]) is collections.OrderedDict
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model2.load_state_dict(out["model"])
    x = torch.randn(3, 8)
    model.eval(), model2.eval()
    assert torch.equal(model(x), model2(x))


def test_shared_tensors_load_as_one_object(store: Store) -> None:
    t = torch.randn(4, 4)
    p = torch.nn.Parameter(torch.randn(3))
    state = {"a": t, "b": t, "nested": [t, {"again": t}], "p1": p, "p2": p, "row": t[1], "other": t.clone()}
    info = store.save(state, step=0)
    assert info.tensors == 3  # t (with t[1], a view of it: one array, docs/format.md), p, t.clone()
    out = ckptstore.load(store.url)
    assert out["a"] is out["b"] is out["nested"][0] is out["nested"][1]["again"]
    assert out["p1"] is out["p2"] and isinstance(out["p1"], torch.nn.Parameter)
    assert out["row"] is not out["a"] and torch.equal(out["row"], t[1])
    assert out["row"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()  # still a view
    assert out["other"] is not out["a"] and torch.equal(out["other"], t)
    out["a"].add_(1)
    assert torch.equal(out["b"], t + 1)


def test_tied_weights_of_a_module_stay_tied(store: Store) -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    state = {"emb": emb.weight, "head": head.weight}
    out = roundtrip(store, state)
    assert out["emb"] is out["head"]


# --------------------------------------------------------------------------------------------------
# numpy


@pytest.mark.parametrize("dtype", ["?", "i1", "u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4",
                                   "<f8", "<c8", "<c16", ">f4", ">i8", ">c16", "<M8[ns]", "<m8[s]"])
def test_numpy_arrays(store: Store, dtype: str) -> None:
    rng = np.random.default_rng(7)
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=12 * dt.itemsize, dtype=np.uint8)
    base = raw.view(dt).reshape(3, 4) if dt != np.bool_ else (raw % 2).astype(bool).reshape(3, 4)
    state = {
        "a": base,
        "f_order": np.asfortranarray(base),
        "strided": base[::2, ::-1],
        "empty": np.empty((0, 5), dtype=dt),
        "zero_dim": np.array(base[1, 2]),
    }
    assert state["zero_dim"].shape == ()
    out = roundtrip(store, state)
    assert_same(state, out)
    assert out["zero_dim"].shape == ()


def test_numpy_scalars(store: Store) -> None:
    values = [np.float32(1.5), np.float16(-0.0), np.float64(np.nan), np.int8(-5), np.uint64(2**64 - 1),
              np.int64(-(2**63)), np.bool_(True), np.complex64(1 - 2j), np.complex128(complex(-0.0, np.inf)),
              np.datetime64("2024-01-02T03:04:05", "s"), np.dtype(">f4").type(2.5)]
    out = roundtrip(store, {"v": values})
    assert_same({"v": values}, out)
    assert [type(v) for v in out["v"]] == [type(v) for v in values]


# --------------------------------------------------------------------------------------------------
# RNG states


def test_rng_states_roundtrip_and_reproduce(store: Store) -> None:
    torch.manual_seed(1234)
    np.random.seed(99)
    random.seed(42)
    gen = np.random.default_rng(2024)
    gen.random(3)
    state = {
        "torch": torch.get_rng_state(),
        "numpy_legacy": np.random.get_state(),
        "numpy_legacy_dict": np.random.get_state(legacy=False),
        "numpy_gen": gen.bit_generator.state,
        "python": random.getstate(),
    }
    expected = {
        "torch": torch.rand(5),
        "numpy": np.random.rand(5),
        "gen": gen.random(5),
        "python": [random.random() for _ in range(5)],
    }
    out = roundtrip(store, state)
    assert_same(state, out)

    # Scramble every generator, then restore from the loaded states only.
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    torch.set_rng_state(out["torch"])
    np.random.set_state(out["numpy_legacy"])
    random.setstate(out["python"])
    gen2 = np.random.default_rng()
    gen2.bit_generator.state = out["numpy_gen"]
    assert torch.equal(torch.rand(5), expected["torch"])
    assert np.array_equal(np.random.rand(5), expected["numpy"])
    assert np.array_equal(gen2.random(5), expected["gen"])
    assert [random.random() for _ in range(5)] == expected["python"]
    np.random.seed(0)
    np.random.set_state(out["numpy_legacy_dict"])
    assert np.array_equal(np.random.rand(5), expected["numpy"])


# --------------------------------------------------------------------------------------------------
# selecting cuts and partial loads


def test_load_by_step_id_and_latest(store: Store) -> None:
    infos = [store.save({"step": s, "w": torch.full((3,), float(s))}, step=s) for s in (5, 10, 1000)]
    for info in infos:
        by_step = ckptstore.load(store.url, cut=info.step)
        by_id = ckptstore.load(store.url, cut=info.id)
        assert by_step["step"] == by_id["step"] == info.step
        assert torch.equal(by_id["w"], torch.full((3,), float(info.step)))
    assert ckptstore.load(store.url, cut="latest")["step"] == 1000
    assert ckptstore.load(store.url)["step"] == 1000
    assert ckptstore.load(store)["step"] == 1000
    with pytest.raises(ckptstore.CutNotFound):
        ckptstore.load(store.url, cut=7)
    with pytest.raises(ckptstore.CutNotFound):
        ckptstore.load(store.url, cut="step-000000000005-00000000")
    with pytest.raises(ckptstore.HostileInput):
        ckptstore.load(store.url, cut="../../etc/passwd")


def test_load_on_empty_store_and_missing_store(store: Store, tmp_path) -> None:
    with pytest.raises(ckptstore.CutNotFound):
        ckptstore.load(store.url)
    with pytest.raises(ckptstore.StoreNotFound):
        ckptstore.load(str(tmp_path / "nowhere"))


def test_partial_load_returns_only_requested_keys(store: Store) -> None:
    state = {"model": {"w": torch.randn(4, 4), "b": torch.zeros(4)}, "optim": {"m": torch.randn(4, 4)},
             "step": 3, 7: "int key", "rng": torch.get_rng_state()}
    store.save(state, step=3)
    out = ckptstore.load(store.url, keys=["model"])
    assert list(out) == ["model"]
    assert_same(state["model"], out["model"])
    out = ckptstore.load(store.url, keys=["step", 7, "model"])
    assert list(out) == ["model", "step", 7]  # saved order, not request order
    assert out[7] == "int key" and out["step"] == 3
    with pytest.raises(ckptstore.UsageError):
        ckptstore.load(store.url, keys=["nope"])


def _multi_shard_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    mb = 1 << 20
    return {
        "model": {f"layer{i}": torch.randn(mb // 8, generator=g) for i in range(3)},  # 3 x 512 KiB
        "optim": {f"m{i}": torch.randn(mb // 4, generator=g) for i in range(4)},  # 4 x 1 MiB
        "extra": np.arange(mb // 8, dtype=np.float64),  # 1 MiB
    }


@pytest.fixture
def small_shard_store(store_url: str):
    s = Store.open(store_url, create=True, options=StoreOptions(max_shard_bytes=1 << 20))
    try:
        yield s
    finally:
        s.close()


def test_partial_load_reads_only_needed_shards(small_shard_store: Store) -> None:
    store = small_shard_store
    state = _multi_shard_state()
    info = store.save(state, step=1)
    m = store.manifest(info.id)
    assert len(m.files) >= 4
    model_files = {t.file for t in m.tensors if t.name.startswith("model/")}
    other_files = [f.name for f in m.files if f.name not in model_files]
    assert other_files, "the state must spread over files the model keys do not use"
    cut_dir = os.path.join(store.url, "cuts", info.id)

    # Damage a shard that holds no model tensor: the partial load never touches it, a full load refuses.
    victim = os.path.join(cut_dir, other_files[0])
    flip_byte(victim, os.path.getsize(victim) - 1)
    out = ckptstore.load(store.url, keys=["model"])
    assert_same(state["model"], out["model"])
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(store.url)
    assert other_files[0] in str(ei.value)

    # Even without the file at all.
    os.remove(victim)
    out = ckptstore.load(store.url, keys=["model"])
    assert_same(state["model"], out["model"])
    with pytest.raises(ckptstore.MissingFile) as ei:
        ckptstore.load(store.url)
    assert other_files[0] in str(ei.value)


def test_partial_load_checks_the_bytes_it_reads(small_shard_store: Store) -> None:
    """Within a shard shared by wanted and unwanted arrays, only the wanted arrays' bytes matter."""
    store = small_shard_store
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.arange(1000, dtype=torch.int64)}
    info = store.save(state, step=1)
    m = store.manifest(info.id)
    assert len(m.files) == 1
    rec = {t.name: t for t in m.tensors}
    path = os.path.join(store.url, "cuts", info.id, m.files[0].name)
    with open(path, "rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
    flip_byte(path, data_start + rec["b"].offset + 5)
    out = ckptstore.load(store.url, keys=["a"])
    assert torch.equal(out["a"], state["a"])
    with pytest.raises(ckptstore.CorruptCut) as ei:
        ckptstore.load(store.url, keys=["b"])
    assert info.id in str(ei.value) and m.files[0].name in str(ei.value)
    with pytest.raises(ckptstore.CorruptCut):
        ckptstore.load(store.url)


def test_zstd_roundtrip(store_url: str) -> None:
    with Store.open(store_url, create=True, options=StoreOptions(compression="zstd", max_shard_bytes=1 << 20)) as s:
        state = _multi_shard_state()
        state["zeros"] = torch.zeros(1 << 18)
        state["py"] = {"x": [1, 2.5, "s"], "rng": torch.get_rng_state()}
        info = s.save(state, step=1)
        m = s.manifest(info.id)
        assert all(f.codec == "zstd" and f.name.endswith(".safetensors.zst") for f in m.files)
        assert all(os.path.getsize(os.path.join(store_url, "cuts", info.id, f.name)) == f.nbytes for f in m.files)
        assert any(f.nbytes < f.raw_nbytes for f in m.files)
        assert_same(state, ckptstore.load(store_url))
        assert_same(state["model"], ckptstore.load(store_url, keys=["model"])["model"])
        assert s.verify().ok


def test_uncompressed_shards_are_plain_safetensors(store: Store) -> None:
    from safetensors import safe_open

    state: dict[str, Any] = {n: _random_tensor(getattr(torch, n), (2, 3), seed=i)
                             for i, n in enumerate(TORCH_DTYPES) if TORCH_DTYPES[n][0] != "U8" or n == "uint8"}
    state["np_f32"] = np.linspace(0, 1, 7, dtype=np.float32)
    state["np_i64"] = np.arange(-3, 3, dtype=np.int64)
    state["np_bool"] = np.array([True, False, True])
    state["bytes_only"] = _random_tensor(torch.complex128, (2, 2), seed=99)
    info = store.save(state, step=0)
    m = store.manifest(info.id)
    checked = 0
    for rec in m.files:
        with safe_open(os.path.join(store.url, "cuts", info.id, rec.name), "pt") as f:
            assert f.metadata()["format"] == "ckptstore-shard"
            names = set(f.keys())
            for t in m.tensors:
                if t.file != rec.name:
                    continue
                assert t.name in names
                got = f.get_tensor(t.name)
                want = state[t.name]
                if t.name == "bytes_only":  # no safetensors name: raw bytes as U8
                    assert got.dtype == torch.uint8 and bytes(got.numpy().tobytes()) == _tensor_bytes(want)
                elif isinstance(want, np.ndarray):
                    assert np.array_equal(got.numpy(), want)
                else:
                    assert got.dtype == want.dtype and _tensor_bytes(got) == _tensor_bytes(want), t.name
                checked += 1
    assert checked == len(state)


# --------------------------------------------------------------------------------------------------
# values that need pickle


class Custom:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.x == self.x


def test_arbitrary_objects_are_refused_with_their_key_path(store: Store) -> None:
    store.save({"ok": 1}, step=0)
    for bad, where in [({"model": {"obj": Custom(1)}}, "model/obj"),
                       ({"opt": [1, {"s": lambda: 0}]}, "opt/1/s"),  # sets are storable since issue 13
                       ({"cfg": {(1, 2): "tuple key"}}, "cfg"),
                       ({"f": iter(())}, "f")]:
        with pytest.raises(ckptstore.UnsupportedValue) as ei:
            store.save(bad, step=1)
        assert where in str(ei.value), str(ei.value)
        assert isinstance(ei.value, TypeError)
    assert [c.step for c in store.cuts()] == [0]
    assert os.listdir(os.path.join(store.url, "marks")) == []


def test_allow_pickle_saves_and_needs_allow_pickle_to_load(store: Store) -> None:
    state = {"obj": Custom(5), "set": {1, 2, 3}, "t": torch.ones(2)}
    info = store.save(state, step=0, allow_pickle=True)
    with pytest.raises(ckptstore.HostileInput) as ei:
        ckptstore.load(store.url)
    assert info.id in str(ei.value)
    with pytest.raises(ckptstore.HostileInput):
        ckptstore.load(store.url, keys=["t"])
    out = ckptstore.load(store.url, allow_pickle=True)
    assert out["obj"] == Custom(5) and out["set"] == {1, 2, 3} and torch.equal(out["t"], torch.ones(2))
    # A cut without pickled values loads without the flag.
    store.save({"t": torch.ones(2)}, step=1, allow_pickle=True)
    assert torch.equal(ckptstore.load(store.url)["t"], torch.ones(2))


# --------------------------------------------------------------------------------------------------
# steps and cut listings


def test_step_must_increase(store: Store) -> None:
    store.save({"x": 1}, step=10)
    for step in (10, 9, 0):
        with pytest.raises(ckptstore.StepConflict) as ei:
            store.save({"x": 2}, step=step)
        assert isinstance(ei.value, ckptstore.UsageError)
        assert "10" in str(ei.value)
    assert [c.step for c in store.cuts()] == [10]
    assert ckptstore.load(store.url)["x"] == 1
    store.save({"x": 3}, step=11)
    assert ckptstore.load(store.url)["x"] == 3
    for step in (-1, 10**12, True, 1.5):
        with pytest.raises(ckptstore.UsageError):
            store.save({"x": 4}, step=step)  # type: ignore[arg-type]


def test_the_step_check_after_a_save_takes_what_the_handle_wrote(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handle remembers (digest, cut, step) of the manifest it wrote, not the manifest (issue 23: 40,000
    records kept between cuts): its next step check parses no manifest while LATEST's manifest is those
    bytes, still refuses a step that does not increase, and names the cut; a LATEST moved by someone
    else (other bytes) is read and parsed."""
    import ckptstore.pointed as pointed
    from ckptstore.store import core_of

    parsed: list[str] = []
    real = pointed.parse_manifest
    monkeypatch.setattr(pointed, "parse_manifest", lambda url, cut, body: parsed.append(cut) or real(url, cut, body))
    info = store.save({"x": 1}, step=10)
    digest, cut, step = core_of(store).protocol.last_written  # type: ignore[misc]
    assert (cut, step) == (info.id, 10) and len(digest) == 64
    with pytest.raises(ckptstore.StepConflict) as ei:
        store.save({"x": 2}, step=10)
    assert ei.value.cut == info.id and parsed == []
    store.close()
    with Store.open(store.url) as other:  # another handle: it did not write LATEST's manifest
        with pytest.raises(ckptstore.StepConflict):
            other.save({"x": 2}, step=9)
        assert parsed == [info.id]
        other.save({"x": 3}, step=11)
    assert ckptstore.load(store.url)["x"] == 3


def test_cutinfo_fields(store: Store) -> None:
    before = datetime.now(timezone.utc)
    info = store.save({"w": torch.ones(100)}, step=42, tags=["best", "epoch-1"], final=True,
                      metadata={"loss": 0.5})
    after = datetime.now(timezone.utc)
    assert isinstance(info, CutInfo)
    assert re.fullmatch(r"step-000000000042-[0-9a-f]{8}", info.id)
    assert info.step == 42
    assert info.tags == ("best", "epoch-1")
    assert info.final is True
    assert info.created_at.tzinfo is not None and before <= info.created_at <= after
    cut_dir = os.path.join(store.url, "cuts", info.id)
    shard_bytes = sum(os.path.getsize(os.path.join(cut_dir, n)) for n in os.listdir(cut_dir) if n != "MANIFEST.json")
    assert info.nbytes == shard_bytes > 400
    assert info.metadata == {"loss": 0.5}
    assert store.latest() == info
    assert store.cuts() == [info]
    plain = store.save({"w": torch.ones(1)}, step=43)
    assert plain.tags == () and plain.final is False


def test_cuts_ascending_by_step_and_latest(store: Store) -> None:
    assert store.latest() is None
    assert store.cuts() == []
    for s in (3, 10, 200, 1999, 10000):
        store.save({"s": s}, step=s)
    assert [c.step for c in store.cuts()] == [3, 10, 200, 1999, 10000]
    assert store.latest().step == 10000  # type: ignore[union-attr]
    with Store.open(store.url, readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == [c.id for c in store.cuts()]
        assert ro.latest() == store.latest()


def test_a_conjugate_or_negative_view_beside_its_base_keeps_its_own_values(tmp_path) -> None:
    """``c.conj()`` and ``x._neg_view()`` share their base's storage and bytes and differ by a lazy bit:
    identified as their base (tied) or saved as views of its storage, they loaded as the base (found
    in issue 23's review). Each is its own leaf now, saved resolved, by ``save`` and by the
    Checkpointer's batched capture at every cut."""
    from ckptstore.writer import Checkpointer

    c = torch.randn(4, dtype=torch.complex64)
    x = torch.randn(3)
    state = {"a": c, "b": c.conj(), "n": x, "m": x._neg_view(), "again": c}
    want = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    with Store.open(str(tmp_path / "s"), create=True) as s:
        s.save(state, step=1)
    got = ckptstore.load(str(tmp_path / "s"))
    assert all(torch.equal(got[k], want[k]) for k in state), got
    with Checkpointer(str(tmp_path / "c"), every=1) as ck:
        for step in (1, 2, 3):
            ck.cut(step, state).wait()
            got = ckptstore.load(str(tmp_path / "c"))
            assert all(torch.equal(got[k], want[k]) for k in state), (step, got)
