"""ckptstore as a torch.distributed.checkpoint backend: StoreWriter / StoreReader, real DCP, real ranks."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.cli import main as cli
from ckptstore.integrations.dcp import METADATA_KEY, StoreReader, StoreWriter, metadata_from_json, metadata_to_json
from ranks.rankkit import RankResult, describe, run_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_worker.py")


def run_dcp_job(out_dir: str, world: int, scenario: str, **kw: Any) -> list[RankResult]:
    return run_job(out_dir, world, scenario, worker=WORKER, **kw)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        yield


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).square().mean().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, note: str) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "note": note,
            "bf16": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) + step}


# ------------------------------------------------------------------------------------------ one process
def test_single_process_save_verify_load_bitwise(tmp_path, capsys):
    url = str(tmp_path / "store")
    model, opt = _model_and_opt(0)
    saved = _state(model, opt, 5, "five")
    writer = StoreWriter(url, step=5, tags=("dcp",), final=True)
    dcp.save(saved, storage_writer=writer)
    assert writer.info is not None and writer.info.step == 5

    with ckptstore.Store.open(url, readonly=True) as store:
        info = store.latest()
        assert info.step == 5 and info.tags == ("dcp",) and info.final and info.world_size == 1
        m = store.manifest()
        assert m.writer.mode == "dcp" and not m.pickled and METADATA_KEY in m.metadata
        # byte-IO values are stored as uint8 arrays under "byte_io", never unpickled by ckptstore
        raw = ckptstore.load(url, rank=0)
        assert set(raw) == {"tensors", "byte_io"}
        assert raw["byte_io"] and all(t.dtype == torch.uint8 and t.dim() == 1 for t in raw["byte_io"].values())
    capsys.readouterr()
    assert cli(["verify", url, "--json"]) == 0
    notices = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["kind"] == "dcp-byte-io"]
    assert len(notices) == 1 and notices[0]["severity"] == "notice", notices
    assert "14 value(s)" in notices[0]["message"] and "torch.save bytes" in notices[0]["message"]
    assert cli(["show", url, "--tensors"]) == 0
    capsys.readouterr()

    fresh_model, fresh_opt = _model_and_opt(1)
    target = _state(fresh_model, fresh_opt, 0, "")
    dcp.load(target, storage_reader=StoreReader(url, cut=5))
    assert target["step"] == 5 and target["note"] == "five"
    for k, v in saved["model"].items():
        assert torch.equal(target["model"][k], v) and target["model"][k].dtype == v.dtype
    for pid, st in saved["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(target["optim"]["state"][pid][k], v), (pid, k)
    assert target["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert torch.equal(target["bf16"], saved["bf16"])
    # in place: the model's own parameters now hold the saved values
    fresh_model.load_state_dict(target["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.state_dict().values(), model.state_dict().values()))


def test_single_process_steps_latest_keep_and_partial_reads(tmp_path):
    url = str(tmp_path / "store")
    model, opt = _model_and_opt(0)
    for step in (1, 2, 3):
        dcp.save(_state(model, opt, step, f"s{step}"), storage_writer=StoreWriter(url, step=step, keep=2))
    with ckptstore.Store.open(url, readonly=True) as store:
        assert [c.step for c in store.cuts()] == [2, 3] and store.latest().step == 3
    with pytest.raises(CheckpointException, match="not above the committed LATEST"):
        dcp.save(_state(model, opt, 3, "x"), storage_writer=StoreWriter(url, step=3))
    # a load of part of the state reads only those items (ranged reads, each array's blake3 checked)
    target = {"bf16": torch.zeros(3, 4, dtype=torch.bfloat16), "note": ""}
    dcp.load(target, storage_reader=StoreReader(url, cut=2))
    assert target["note"] == "s2" and torch.equal(target["bf16"], torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) + 2)
    with ckptstore.Store.open(url):  # a writer open (gc): nothing left over by the DCP saves
        pass
    assert cli(["verify", url]) == 0


def test_corrupted_array_is_refused_on_load(tmp_path):
    url = str(tmp_path / "store")
    model, opt = _model_and_opt(0)
    dcp.save(_state(model, opt, 1, "one"), storage_writer=StoreWriter(url, step=1))
    m = ckptstore.Store.open(url, readonly=True).manifest()
    t = next(t for t in m.tensors if t.name.startswith("model.0.weight@"))
    path = os.path.join(url, "cuts", m.cut, t.file)
    data = bytearray(open(path, "rb").read())
    data[len(data) - sum(x.nbytes for x in m.tensors if x.file == t.file) + t.offset] ^= 1
    open(path, "wb").write(bytes(data))
    target = {"model": _model_and_opt(1)[0].state_dict()}
    with pytest.raises(CheckpointException, match="blake3 mismatch"):
        dcp.load(target, storage_reader=StoreReader(url))


def test_metadata_json_round_trip_and_rejects_garbage(tmp_path):
    url = str(tmp_path / "store")
    model, opt = _model_and_opt(0)
    dcp.save(_state(model, opt, 1, "one"), storage_writer=StoreWriter(url, step=1))
    doc = ckptstore.Store.open(url, readonly=True).manifest().metadata[METADATA_KEY]
    md = metadata_from_json(doc)
    assert metadata_to_json(md) == doc
    assert md.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    bad = {**doc, "state_dict_metadata": [{"fqn": "x", "kind": "tensor", "dtype": "os.system"}]}
    with pytest.raises(ckptstore.CorruptCut):
        metadata_from_json(bad)


def test_reader_loads_a_cut_of_store_save(tmp_path):
    """A native cut (no DCP metadata) loads through synthesized metadata (issue 12; more in
    test_native_cuts.py); a value DCP sees as one object but that holds an array is left out."""
    import numpy as np

    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        store.save({"w": torch.arange(6.0).reshape(2, 3), "n": {"k": 7, "s": [1, "a"]}, "a": np.ones(2)}, step=1)
    state = {"w": torch.zeros(2, 3), "n": {"k": 0, "s": []}}
    dcp.load(state, storage_reader=StoreReader(url))
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3)) and state["n"] == {"k": 7, "s": [1, "a"]}
    with pytest.raises(CheckpointException, match="Missing key"):
        dcp.load({"a": np.zeros(2)}, storage_reader=StoreReader(url))


# ---------------------------------------------------------------------------------------------- ranks
def test_fsdp2_save_at_2_ranks_loads_at_4_and_1(tmp_path):
    url = str(tmp_path / "store")
    saved = run_dcp_job(str(tmp_path / "save"), 2, "fsdp_save", url=url)
    assert all(r.result and r.result["ok"] for r in saved), describe(saved)
    assert saved[0].result["cut"] == saved[1].result["cut"] and saved[0].result["info"]["world_size"] == 2
    ref = str(tmp_path / "save" / "full.pt")
    with ckptstore.Store.open(url, readonly=True) as store:
        info = store.latest()
        assert info.step == 3 and info.world_size == 2 and info.tags == ("dcp",)
        assert store.manifest().writer.mode == "dcp"
    assert cli(["verify", url]) == 0

    # (a load at 2 ranks of a DCP cut: test_fsdp_x_tp_saved_on_a_2x2_mesh_loads_on_2_ranks_and_1)
    for world in (4,):
        loaded = run_dcp_job(str(tmp_path / f"load{world}"), world, "fsdp_load", url=url, ref=ref)
        assert all(r.result and r.result["ok"] for r in loaded), describe(loaded)
        assert all(r.result["extra"] == {"step": 3, "note": "fsdp-run"} for r in loaded)
        assert loaded[0].result["compared"] >= 8 and loaded[0].result["differ"] == [], loaded[0].result

    # one process, no process group: the full (unsharded) state dict, resharded by DCP
    full = torch.load(ref, weights_only=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()},
              "optim": {"state": {fqn: {k: torch.zeros_like(v) for k, v in st.items()}
                                  for fqn, st in full["optim"]["state"].items()},
                        "param_groups": full["optim"]["param_groups"]},
              "extra": {"step": 0, "note": ""}}
    dcp.load(target, storage_reader=StoreReader(url))
    assert target["extra"] == {"step": 3, "note": "fsdp-run"}
    for k, v in full["model"].items():
        assert torch.equal(target["model"][k], v), k
    for fqn, st in full["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(target["optim"]["state"][fqn][k], v), (fqn, k)


def test_a_rank_whose_write_fails_makes_save_raise_and_leaves_latest(tmp_path):
    url = str(tmp_path / "store")
    res = run_dcp_job(str(tmp_path / "job"), 2, "write_fails", url=url, victim=1)
    assert all(r.result and r.result["ok"] for r in res), describe(res)
    for r in res:
        assert len(r.result["raised"]) == 2, describe(res)
        assert all(e and "No space left on device" in e for e in r.result["raised"]), describe(res)
    r0 = res[0].result
    # DCP never calls finish after a failed rank: rank 0 holds the lock until the writer is closed
    assert r0["locked_before_close"] is True
    assert r0["after_close"] == {"latest_step": 1, "leftovers": [], "cut_dirs": 1}, r0
    assert r0["after_retry"] == {"cuts": [1, 2], "latest_step": 2, "leftovers": [], "cut_dirs": 2}, r0
    assert res[1].result["retry_cut"] == r0["retry_cut"]
    with ckptstore.Store.open(url) as store:
        assert store.latest().step == 2 and [c.step for c in store.cuts()] == [1, 2]
        assert store.gc(dry_run=True).removed == []
    assert cli(["verify", url]) == 0


def test_compressed_store_round_trip_reads_whole_shards(tmp_path):
    url = str(tmp_path / "store")
    model, opt = _model_and_opt(0)
    saved = _state(model, opt, 4, "zstd")
    dcp.save(saved, storage_writer=StoreWriter(url, step=4, options=ckptstore.StoreOptions(compression="zstd")))
    m = ckptstore.Store.open(url, readonly=True).manifest()
    assert {f.codec for f in m.files} == {"zstd"}
    target = {"bf16": torch.zeros(3, 4, dtype=torch.bfloat16), "model": _model_and_opt(1)[0].state_dict(), "note": ""}
    dcp.load(target, storage_reader=StoreReader(url, cut=m.cut))
    assert target["note"] == "zstd" and torch.equal(target["bf16"], saved["bf16"])
    assert all(torch.equal(target["model"][k], v) for k, v in saved["model"].items())


def test_rank_part_for_on_a_readonly_handle_checks_its_arguments(tmp_path):
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as writer:
        pending = writer.begin_cut(1, world_size=2)
        with ckptstore.Store.open(url, readonly=True) as reader:
            for bad in [dict(rank=2, world_size=2), dict(rank=-1, world_size=2), dict(rank=0, world_size=0)]:
                with pytest.raises(ckptstore.UsageError):
                    reader.rank_part_for(pending.id, 1, **bad)
            with pytest.raises(ckptstore.UsageError, match="does not match step"):
                reader.rank_part_for(pending.id, 2, 0, 2)
            with pytest.raises(ckptstore.HostileInput):
                reader.rank_part_for("../x", 1, 0, 2)
            part = reader.rank_part_for(pending.id, 1, 1, 2)
            assert (part.rank, part.world_size, part.id) == (1, 2, pending.id)
        pending.abandon()


def _full_target(full: dict[str, Any]) -> dict[str, Any]:
    """A one-process (no process group) DCP target for the full state in ``full``: zeros of every tensor."""
    def zeros(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zeros(x) for k, x in v.items()}
        return v
    return zeros(full)


def _assert_equal_tensors(got: Any, ref: Any, path: str = "") -> int:
    if isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref), path
        return 1
    if isinstance(ref, dict):
        return sum(_assert_equal_tensors(got[k], v, f"{path}/{k}") for k, v in ref.items())
    return 0


def test_fsdp_x_tp_saved_on_a_2x2_mesh_loads_on_2_ranks_and_1(tmp_path):
    """4 ranks as a (dp, tp) mesh: an FSDP x TP model (_StridedShard and Shard placements) with Adam, and
    DTensors placed Shard(0)/Shard(1)/Replicate on both mesh dims. Saved through dcp.save, dcp.async_save
    (thread executor, several ranks) and the Checkpointer; loaded on a 1-D mesh of 2 ranks through DCP's
    get_state_dict/set_state_dict and in one process without a process group: bitwise the global tensors."""
    url, native = str(tmp_path / "dcp"), str(tmp_path / "native")
    saved = run_dcp_job(str(tmp_path / "save"), 4, "mesh2d_save", url=url, native_url=native, timeout=240)
    assert all(r.result and r.result["ok"] for r in saved), describe(saved)
    placements = saved[0].result["placements"]
    assert placements["model.0.weight"] == ["_S(0, 2)", "S(0)"]  # FSDP's strided shard of a TP shard
    assert {"S(1)", "R"} <= {p for ps in placements.values() for p in ps}
    with ckptstore.Store.open(url, readonly=True) as store:
        assert [(c.step, c.world_size, c.tags) for c in store.cuts()] == [(1, 4, ()), (2, 4, ("async",))]
    with ckptstore.Store.open(native, readonly=True) as store:
        assert store.latest().world_size == 4 and METADATA_KEY not in store.manifest().metadata
    assert cli(["verify", url]) == 0 and cli(["verify", native]) == 0

    ref = str(tmp_path / "save" / "full.pt")
    loaded = run_dcp_job(str(tmp_path / "load"), 2, "mesh_load", url=url, native_url=native, ref=ref, timeout=240)
    assert all(r.result and r.result["ok"] for r in loaded), describe(loaded)
    for label in ("dcp", "native"):
        res = loaded[0].result[label]
        assert res["compared"] >= 16 and res["differ"] == [] and res["extra"] == {"note": "mesh2d"}, (label, res)

    full = torch.load(ref, weights_only=True)
    for store_url in (url, native):
        target = {**_full_target(full), "extra": {"note": ""}}
        dcp.load(target, storage_reader=StoreReader(store_url))
        assert target["extra"] == {"note": "mesh2d"}
        assert _assert_equal_tensors({k: target[k] for k in full}, full) >= 16


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_save_leaves_latest_and_gc_cleans(tmp_path, victim):
    """A rank SIGKILLed halfway through writing its shards (rank 1, or the coordinator that holds the
    writer lock): the survivor's dcp.save raises (never a commit), LATEST stays at step 1, and after the
    next writer open (its gc) the store holds exactly the committed cut and verifies."""
    url = str(tmp_path / "store")
    res = run_dcp_job(str(tmp_path / "job"), 2, "killed_mid_save", url=url, victim=victim)
    dead, alive = res[victim], res[1 - victim]
    assert dead.killed and alive.result and alive.result["ok"], describe(res)
    assert alive.result["raised"] is not None and alive.result["latest_step"] == 1, describe(res)
    with ckptstore.Store.open(url) as store:  # the writer open's gc removes what the dead save left
        assert store.latest().step == 1 and [c.step for c in store.cuts()] == [1]
        assert store.classify().leftovers == [] and len(os.listdir(os.path.join(url, "cuts"))) == 1
        assert store.verify().ok
    assert cli(["verify", url]) == 0


def test_s3_save_process_executor_and_resharded_load(tmp_path, s3_url):
    """On the S3 server (moto): an FSDP2 job of 2 ranks saves through dcp.save, then dcp.async_save with
    DCP's process executor (the StoreWriter pickled into DCP's daemon, which commits, then prunes with
    keep=1); one process without a process group loads the latest cut resharded, bitwise; verify passes."""
    url, opts = s3_url
    res = run_dcp_job(str(tmp_path / "save"), 2, "s3_process_save", url=url, storage_options=opts, timeout=240)
    assert all(r.result and r.result["ok"] for r in res), describe(res)
    assert res[0].result == {"ok": True, "steps": [2], "world_size": 2}
    full = torch.load(str(tmp_path / "save" / "full2.pt"), weights_only=True)
    target = _full_target(full)
    dcp.load(target, storage_reader=StoreReader(url, storage_options=opts))
    assert _assert_equal_tensors(target, full) >= 8
    options = ckptstore.StoreOptions(storage_options=opts)
    with ckptstore.Store.open(url, readonly=True, options=options) as store:
        assert store.verify().ok and store.manifest().writer.mode == "dcp"
