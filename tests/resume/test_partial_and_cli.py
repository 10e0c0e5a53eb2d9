"""Partial loads (only the keys asked for, only the shards they live in) and the resume-side CLI:
``show --tensors``, ``resume-info``, ``diff`` and ``export``, run in-process through ``cli.main``."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import pytest
import torch

import ckptstore
from filekit import flip_byte
from ckptstore import DataError, Store, StoreOptions
from ckptstore.cli import main

MIB = 1 << 20


# ----------------------------------------------------------------------------------------- helpers
def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys, *argv: str) -> tuple[int, Any]:
    code, out, err = run(capsys, *argv, "--json")
    try:
        return code, json.loads(out)
    except json.JSONDecodeError:
        raise AssertionError(f"not JSON (exit {code}): {out!r} {err!r}") from None


def data_offset(path: str, name: str) -> int:
    """The absolute file offset of array ``name``'s first byte in a safetensors-layout shard."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: {list(a)} vs {b!r:.100}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def walk(state: Any, name: str) -> Any:
    """The value at a tensor's key path ("optimizer/state/0/step": int dict keys and list indices)."""
    node = state
    for part in name.split("/"):
        node = node[part] if isinstance(node, dict) and part in node else node[int(part)]
    return node


def shard_of(m, name: str) -> str:
    return next(t.file for t in m.tensors if t.name == name)


# ------------------------------------------------------------------------------------ partial loads
def sharded_state() -> dict[str, Any]:
    """About 2.4 MB over three 1 MiB shards: the model's arrays and a small optimizer array share the
    first shard; the optimizer's big arrays fill one shard each."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w1": torch.randn(200_000, generator=g), "w2": torch.randn(100, 100, generator=g).half()},
        "optimizer": {"small": torch.arange(1000, dtype=torch.int32),
                      "exp_avg": torch.randn(200_000, generator=g),
                      "exp_avg_sq": torch.rand(200_000, generator=g)},
        "step": 42,
    }


@pytest.fixture
def sharded(tmp_path):
    url = str(tmp_path / "store")
    state = sharded_state()
    with Store.open(url, create=True, options=StoreOptions(max_shard_bytes=MIB)) as s:
        info = s.save(state, step=42)
        m = s.manifest(info.id)
    model_files = {shard_of(m, "model/w1"), shard_of(m, "model/w2")}
    other_files = {f.name for f in m.files} - model_files
    # The layout this test relies on: one mixed shard, two optimizer-only shards.
    assert model_files == {shard_of(m, "optimizer/small")} and len(other_files) == 2, [
        (t.name, t.file) for t in m.tensors]
    return url, state, m, model_files, other_files


class ReadLog:
    """Records which cut files a store's storage reads from (every read verb)."""

    def __init__(self, store: Store) -> None:
        self.paths: list[str] = []
        st = store.storage
        for verb in ("read_bytes", "read_range", "open_reader"):
            setattr(st, verb, self._wrap(getattr(st, verb)))

    def _wrap(self, fn):
        def inner(rel, *a, **kw):
            self.paths.append(rel)
            return fn(rel, *a, **kw)
        return inner

    def shard_files(self, cut: str) -> set[str]:
        pre = f"cuts/{cut}/"
        return {p[len(pre):] for p in self.paths if p.startswith(pre) and not p.endswith("MANIFEST.json")}


def test_partial_load_returns_only_that_key_and_reads_only_its_shards(sharded):
    url, state, m, model_files, other_files = sharded
    with Store.open(url, readonly=True) as s:
        log = ReadLog(s)
        got = ckptstore.load(s, keys=["model"])
    assert list(got) == ["model"]
    assert_same(got["model"], state["model"])
    assert log.shard_files(m.cut) == model_files
    # A non-array key needs no shard at all.
    with Store.open(url, readonly=True) as s:
        log = ReadLog(s)
        assert ckptstore.load(s, keys=["step"]) == {"step": 42}
    assert log.shard_files(m.cut) == set()
    # Control: a full load reads every shard.
    with Store.open(url, readonly=True) as s:
        log = ReadLog(s)
        assert_same(ckptstore.load(s), state)
    assert log.shard_files(m.cut) == model_files | other_files


def test_partial_load_survives_damage_to_what_it_does_not_need(sharded):
    url, state, m, model_files, other_files = sharded
    cut_dir = os.path.join(url, "cuts", m.cut)
    gone, flipped = sorted(other_files)
    os.remove(os.path.join(cut_dir, gone))
    in_flipped = next(t.name for t in m.tensors if t.file == flipped)
    flip_byte(os.path.join(cut_dir, flipped), data_offset(os.path.join(cut_dir, flipped), in_flipped))
    (mixed,) = model_files
    flip_byte(os.path.join(cut_dir, mixed), data_offset(os.path.join(cut_dir, mixed), "optimizer/small") + 5)

    got = ckptstore.load(url, keys=["model", "step"])
    assert list(got) == ["model", "step"] and got["step"] == 42
    assert_same(got["model"], state["model"])
    # The damage is real: loads that need it refuse.
    with pytest.raises(DataError):
        ckptstore.load(url)
    with pytest.raises(DataError):
        ckptstore.load(url, keys=["optimizer"])


def test_partial_load_of_a_damaged_needed_array_raises(sharded):
    url, state, m, model_files, _ = sharded
    (mixed,) = model_files
    path = os.path.join(url, "cuts", m.cut, mixed)
    flip_byte(path, data_offset(path, "model/w2") + 7)
    with pytest.raises(DataError):
        ckptstore.load(url, keys=["model"])


def test_partial_load_of_an_unknown_key_is_a_usage_error(sharded):
    url = sharded[0]
    with pytest.raises(ckptstore.UsageError, match="nope"):
        ckptstore.load(url, keys=["nope"])


# --------------------------------------------------------------------------------------------- show
def cli_state(scale: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
                      "b": torch.ones(4, dtype=torch.float16)},
            "counts": torch.tensor([1, 2, 3], dtype=torch.int64),
            "step": scale}


@pytest.fixture
def two_runs(tmp_path):
    """An interrupted run (last cut not final) and a finished one (last cut final)."""
    interrupted, finished = str(tmp_path / "interrupted"), str(tmp_path / "finished")
    with Store.open(interrupted, create=True) as s:
        s.save(cli_state(1), step=10)
        s.save(cli_state(2), step=20)
    with Store.open(finished, create=True) as s:
        s.save(cli_state(1), step=10)
        s.save(cli_state(2), step=20, final=True)
    return interrupted, finished


def test_show_tensors_json_lists_every_tensor_and_says_final(two_runs, capsys):
    interrupted, finished = two_runs
    want = {"model/w": ("float32", [3, 4], 48), "model/b": ("float16", [4], 8), "counts": ("int64", [3], 24)}
    for url, final in ((interrupted, False), (finished, True)):
        code, doc = run_json(capsys, "show", url, "20", "--tensors")
        assert code == 0
        assert doc["step"] == 20 and doc["final"] is final and doc["latest"] is True
        assert {t["name"]: (t["dtype"], t["shape"], t["nbytes"]) for t in doc["tensors"]} == want
        code, doc = run_json(capsys, "show", url, "10", "--tensors")
        assert code == 0 and doc["final"] is False and doc["latest"] is False
    code, out, _ = run(capsys, "show", finished, "latest", "--tensors")
    assert code == 0 and "final     yes" in out and "model/w" in out
    code, out, _ = run(capsys, "show", interrupted)
    assert code == 0 and "final     no" in out


def test_show_of_a_missing_cut_exits_2(two_runs, capsys):
    code, doc = run_json(capsys, "show", two_runs[0], "15")
    assert code == 2 and doc["error"] == "CutNotFound"


# -------------------------------------------------------------------------------------- resume-info
def test_resume_info_of_an_empty_store(tmp_path, capsys):
    url = str(tmp_path / "empty")
    Store.open(url, create=True).close()
    code, doc = run_json(capsys, "resume-info", url)
    assert code == 0
    assert doc["resume_step"] is None and doc["cut"] is None
    assert doc["finished"] is False and doc["healthy"] is True and doc["skipped"] == []


def test_resume_info_of_healthy_stores(two_runs, capsys):
    interrupted, finished = two_runs
    for url, done in ((interrupted, False), (finished, True)):
        code, doc = run_json(capsys, "resume-info", url)
        assert code == 0
        with Store.open(url, readonly=True) as s:
            latest = s.latest()
        assert doc["resume_step"] == 20 and doc["cut"] == latest.id and doc["latest"] == latest.id
        assert doc["finished"] is done and doc["healthy"] is True and doc["skipped"] == []
        assert {"resume_step", "cut", "finished", "healthy", "skipped"} <= set(doc)


def test_resume_info_of_a_corrupted_latest_is_unhealthy_and_names_the_bad_cut(two_runs, capsys):
    url = two_runs[1]
    with Store.open(url, readonly=True) as s:
        cuts = {c.step: c.id for c in s.cuts()}
        m = s.manifest(cuts[20])
    path = os.path.join(url, "cuts", cuts[20], m.files[0].name)
    flip_byte(path, data_offset(path, "model/w"))
    code, doc = run_json(capsys, "resume-info", url)
    assert code == 1
    assert doc["healthy"] is False
    assert doc["resume_step"] == 10 and doc["cut"] == cuts[10] and doc["finished"] is False
    assert [s["cut"] for s in doc["skipped"]] == [cuts[20]]
    assert "hash-mismatch" in doc["skipped"][0]["reason"]
    assert os.listdir(os.path.join(url, "bad")) == []  # an audit records nothing
    code, out, _ = run(capsys, "resume-info", url)
    assert code == 1 and "NOT healthy" in out and cuts[20] in out


# --------------------------------------------------------------------------------------------- diff
def test_diff_of_identical_tensor_sets_exits_0(tmp_path, capsys):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        s.save(cli_state(1), step=1)
        s.save(cli_state(1), step=2)
    code, doc = run_json(capsys, "diff", url, "1", "2")
    assert code == 0
    assert doc["changed"] == [] and doc["added"] == [] and doc["removed"] == []
    assert doc["unchanged"] == ["counts", "model/b", "model/w"]


def test_diff_lists_changed_added_removed_and_exits_1(tmp_path, capsys):
    url = str(tmp_path / "store")
    a = cli_state(1)
    b = cli_state(1)
    b["model"]["w"] = b["model"]["w"].clone()
    b["model"]["w"][0, 0] = 99.0  # same dtype and shape, different bytes
    b["counts"] = b["counts"].to(torch.int32)  # same values, different dtype
    del b["model"]["b"]
    b["model"]["extra"] = torch.zeros(2)
    with Store.open(url, create=True) as s:
        ida = s.save(a, step=1).id
        idb = s.save(b, step=2).id
    code, doc = run_json(capsys, "diff", url, ida, idb)
    assert code == 1
    assert doc["a"] == ida and doc["b"] == idb
    assert doc["changed"] == ["counts", "model/w"]
    assert doc["unchanged"] == [] and doc["added"] == ["model/extra"] and doc["removed"] == ["model/b"]
    code, out, _ = run(capsys, "diff", url, "1", "2")
    assert code == 1 and "2 changed, 0 unchanged, 1 added, 1 removed" in out


# ------------------------------------------------------------------------------------------- export
def export_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(6, 5, generator=g)
    return {
        "model": {
            "f32": torch.randn(4, 3, generator=g),
            "f64": torch.randn(3, generator=g, dtype=torch.float64),
            "f16": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(5, generator=g).bfloat16(),
            "i64": torch.tensor([-(2**40), 0, 2**40]),
            "i32": torch.tensor([-7, 7], dtype=torch.int32),
            "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "u8": torch.arange(10, dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "transposed": base.t(),  # not contiguous
        },
        "optimizer": {"state": {0: {"step": torch.tensor(12.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 12,
    }


@pytest.fixture
def export_store(tmp_path):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        s.save({"model": {"f32": torch.zeros(2)}, "step": 1}, step=1)
        info = s.save(export_state(), step=12)
    return url, info.id


def test_export_safetensors_reads_back_equal(export_store, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    url, cut = export_store
    out = str(tmp_path / "model.safetensors")
    code, doc = run_json(capsys, "export", url, "12", "--to", out)
    assert code == 0 and doc["cut"] == cut and doc["format"] == "safetensors" and doc["path"] == out
    loaded = load_file(out)
    stored = ckptstore.load(url, 12)
    with Store.open(url, readonly=True) as s:
        names = {t.name for t in s.manifest(cut).tensors}
    assert set(loaded) == names
    want = export_state()
    for name, t in loaded.items():
        node = walk(want, name)
        assert t.dtype == node.dtype and t.shape == node.shape, name
        assert torch.equal(t, node), name
    assert torch.equal(loaded["model/transposed"], stored["model"]["transposed"])
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == names
        assert torch.equal(f.get_tensor("model/bf16"), want["model"]["bf16"])
    assert meta["ckptstore_cut"] == cut and meta["ckptstore_step"] == "12"
    assert json.loads(meta["ckptstore_tree"])["t"] == "dict"


def test_export_defaults_to_latest(export_store, tmp_path, capsys):
    from safetensors.torch import load_file

    url, cut = export_store
    out = str(tmp_path / "latest.safetensors")
    code, doc = run_json(capsys, "export", url, "--to", out)
    assert code == 0 and doc["cut"] == cut
    assert torch.equal(load_file(out)["model/i64"], export_state()["model"]["i64"])


def test_export_torch_format_needs_the_pickle_flag(export_store, tmp_path, capsys):
    url, cut = export_store
    out = str(tmp_path / "model.pt")
    code, _, err = run(capsys, "export", url, "--to", out, "--format", "torch")
    assert code == 2 and "allow-pickle-format" in err
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["store"]
    code, doc = run_json(capsys, "export", url, cut, "--to", out, "--format", "torch", "--allow-pickle-format")
    assert code == 0 and doc["format"] == "torch"
    assert_same(torch.load(out, weights_only=False), ckptstore.load(url, cut))
    got = torch.load(out, weights_only=False)
    assert_same(got["model"]["transposed"], export_state()["model"]["transposed"].contiguous())
    assert got["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_export_of_a_damaged_cut_fails_and_writes_nothing(export_store, tmp_path, capsys):
    url, cut = export_store
    with Store.open(url, readonly=True) as s:
        m = s.manifest(cut)
    path = os.path.join(url, "cuts", cut, m.files[0].name)
    flip_byte(path, data_offset(path, "model/f32"))
    out = str(tmp_path / "model.safetensors")
    code, _, _ = run(capsys, "export", url, cut, "--to", out)
    assert code == 1
    assert os.listdir(tmp_path) == ["store"]  # neither the file nor a temp file
