"""DTensor state (FSDP2, tensor parallel): saved per rank as local shards plus "dtensor" tree nodes,
loaded back as plain local tensors, and rewrapped into live DTensors by ``ckptstore.dtensors``.

The distributed cases run real torch.distributed (gloo, 2 processes on CPU): one module fixture starts
both ranks as subprocesses of this file (``python test_dtensor.py RANK PORT DIR``) under a hard
timeout; each rank runs every scenario and writes what it observed to ``DIR/result{rank}.json``, and
the tests below assert on that. The tree cases need no process group.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest
import torch

from ckptstore.arrays import finish_tensor
from ckptstore.errors import CorruptCut
from ckptstore.tree import check_dtensor_node, has_pickle, leaf_names, unflatten

WORLD = 2
DIMS = [5, 7, 3, 1]  # Linear(5,7), Linear(7,3), Linear(3,1): dim-0 shards 4+3, 2+1, 1+0 (rank 1 empty)
TIMEOUT_S = 240  # the whole distributed run (both ranks, every scenario); a hang fails instead of blocking
HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------------------------------
# The tree: "dtensor" nodes without a process group
# --------------------------------------------------------------------------------------------------

def _node(**over: Any) -> dict[str, Any]:
    """Rank 1's node of a (7, 5) tensor sharded on dim 0 over 2 ranks."""
    node: dict[str, Any] = {
        "t": "dtensor", "name": "model/w", "global_shape": [7, 5], "global_stride": [5, 1], "offsets": [4, 0],
        "local_shape": [3, 5], "placements": [{"shard": 0}],
        "mesh": {"device_type": "cpu", "shape": [2], "ranks": [0, 1], "dim_names": None},
    }
    node.update(over)
    return node


def _mesh(**over: Any) -> dict[str, Any]:
    return {**_node()["mesh"], **over}


def _build(node: Any, array: Any = None) -> Any:
    arrays = {"model/w": torch.arange(15, dtype=torch.float32).reshape(3, 5) if array is None else array}
    tree = {"t": "dict", "ordered": False, "items": [{"k": "w", "v": node}]}
    return unflatten(tree, lambda name, n: finish_tensor(arrays[name], n, "cpu"), where={"store": "s", "cut": "c"})


def test_a_dtensor_node_loads_as_the_plain_local_tensor() -> None:
    out = _build(_node())["w"]
    assert type(out) is torch.Tensor and out.shape == (3, 5)
    assert torch.equal(out, torch.arange(15, dtype=torch.float32).reshape(3, 5))
    param = _build(_node(param=True, requires_grad=False))["w"]
    assert type(param) is torch.nn.Parameter and param.requires_grad is False
    assert _build(_node(param=True, requires_grad=True))["w"].requires_grad is True
    # An empty shard (rank 1 of a 1-row tensor): offset at the end of the dim, as DCP records it.
    empty = _node(global_shape=[1, 3], global_stride=[3, 1], offsets=[1, 0], local_shape=[0, 3])
    assert _build(empty, torch.zeros(0, 3))["w"].shape == (0, 3)
    two_d = _node(placements=[{"replicate": True}, {"strided_shard": 0, "split_factor": 2}],
                  mesh=_mesh(shape=[1, 2], dim_names=["dp", "tp"]))
    assert _build(two_d)["w"].shape == (3, 5)
    partial = _node(global_shape=[3, 5], offsets=[0, 0], placements=[{"partial": "sum"}])
    assert _build(partial)["w"].shape == (3, 5)


HOSTILE: dict[str, Callable[[], Any]] = {
    "name-int": lambda: _node(name=3),
    "name-empty": lambda: _node(name=""),
    "no-name": lambda: {k: v for k, v in _node().items() if k != "name"},
    "no-offsets": lambda: {k: v for k, v in _node().items() if k != "offsets"},
    "no-mesh": lambda: {k: v for k, v in _node().items() if k != "mesh"},
    "no-placements": lambda: {k: v for k, v in _node().items() if k != "placements"},
    "unknown-field": lambda: _node(extra=1),
    "shape-str": lambda: _node(global_shape="7,5"),
    "shape-negative": lambda: _node(global_shape=[7, -5]),
    "shape-bool": lambda: _node(global_shape=[7, True]),
    "shape-float": lambda: _node(global_shape=[7.0, 5]),
    "local-negative": lambda: _node(local_shape=[-3, 5]),
    "offset-negative": lambda: _node(offsets=[-1, 0]),
    "shard-outside": lambda: _node(offsets=[5, 0]),
    "local-longer": lambda: _node(local_shape=[3, 5, 1]),
    "stride-short": lambda: _node(global_stride=[5]),
    "unsharded-dim-partial": lambda: _node(placements=[{"replicate": True}]),
    "placements-empty": lambda: _node(placements=[]),
    "placements-too-many": lambda: _node(placements=[{"shard": 0}, {"replicate": True}]),
    "placement-str": lambda: _node(placements=["shard"]),
    "shard-dim-outside": lambda: _node(placements=[{"shard": 2}]),
    "shard-dim-negative": lambda: _node(placements=[{"shard": -1}]),
    "shard-dim-bool": lambda: _node(placements=[{"shard": False}]),
    "shard-extra-key": lambda: _node(placements=[{"shard": 0, "x": 1}]),
    "replicate-false": lambda: _node(placements=[{"replicate": False}]),
    "partial-int": lambda: _node(placements=[{"partial": 3}]),
    "partial-odd": lambda: _node(placements=[{"partial": "sum; rm -rf"}]),
    "split-factor-zero": lambda: _node(placements=[{"strided_shard": 0, "split_factor": 0}]),
    "unknown-placement": lambda: _node(placements=[{"ragged": 0}]),
    "mesh-list": lambda: _node(mesh=[2]),
    "mesh-extra": lambda: _node(mesh=_mesh(coordinate=[1])),
    "mesh-device-int": lambda: _node(mesh=_mesh(device_type=0)),
    "mesh-device-empty": lambda: _node(mesh=_mesh(device_type="")),
    "mesh-shape-zero": lambda: _node(mesh=_mesh(shape=[0], ranks=[])),
    "mesh-shape-huge": lambda: _node(mesh=_mesh(shape=[10**30, 10**30])),
    "mesh-ranks-dup": lambda: _node(mesh=_mesh(ranks=[0, 0])),
    "mesh-ranks-few": lambda: _node(mesh=_mesh(ranks=[0])),
    "mesh-ranks-negative": lambda: _node(mesh=_mesh(ranks=[-1, 0])),
    "mesh-names-count": lambda: _node(mesh=_mesh(dim_names=["dp", "tp"])),
    "mesh-names-int": lambda: _node(mesh=_mesh(dim_names=[1])),
    "param-str": lambda: _node(param="yes"),
    "param-false": lambda: _node(param=False),
    "requires-grad-alone": lambda: _node(requires_grad=True),
    "requires-grad-int": lambda: _node(param=True, requires_grad=1),
    "node-not-object": lambda: ["dtensor"],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_dtensor_nodes_raise_corrupt_cut(case: str) -> None:
    node = HOSTILE[case]()
    with pytest.raises(CorruptCut) as info:
        _build(node)
    assert info.value.store == "s" and info.value.cut == "c"
    if isinstance(node, dict):
        assert check_dtensor_node(node) is not None or case == "node-not-object"


def test_a_dtensor_node_whose_array_disagrees_raises_corrupt_cut() -> None:
    with pytest.raises(CorruptCut, match="local shape"):
        _build(_node(), torch.zeros(4, 5))  # the record holds another shape than the node says
    with pytest.raises(CorruptCut):
        _build(_node(), np.zeros((3, 5), dtype=np.float32))  # a dtensor node naming a numpy record


def test_unknown_kinds_are_still_refused() -> None:
    with pytest.raises(CorruptCut, match="unknown node kind"):
        _build({**_node(), "t": "dtensor2"})


def test_leaf_names_and_has_pickle_see_dtensor_nodes() -> None:
    tree = {"t": "dict", "ordered": False, "items": [
        {"k": "a", "v": {"t": "tensor", "name": "a"}},
        {"k": "m", "v": {"t": "list", "items": [_node(name="m/0"), {"t": "ndarray", "name": "m/1"}]}},
        {"ik": 7, "v": _node(name="7")},
    ]}
    assert leaf_names(tree) == ["a", "m/0", "m/1", "7"]
    assert has_pickle(tree) is False
    tree["items"].append({"k": "p", "v": {"t": "pickle", "v": ""}})
    assert has_pickle(tree) is True


def test_flattening_plain_tensors_never_imports_torch_distributed_tensor() -> None:
    code = ("import sys, torch\nfrom ckptstore.tree import flatten\n"
            "tree, leaves = flatten({'a': torch.ones(2), 'b': [torch.zeros(1)]})\n"
            "assert tree['items'][0]['v']['t'] == 'tensor' and len(leaves) == 2\n"
            "assert 'torch.distributed.tensor' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------------------------------
# Real torch.distributed: 2 gloo ranks
# --------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank observed in every scenario (see ``_worker``)."""
    tmp = tmp_path_factory.mktemp("dtensor")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, HERE, str(rank), str(port), str(tmp)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in range(WORLD)]
    deadline = time.monotonic() + TIMEOUT_S
    outs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {WORLD} ranks did not finish within {TIMEOUT_S}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, p in enumerate(procs):
        path = tmp / f"result{rank}.json"
        assert p.returncode == 0 and path.exists(), f"rank {rank} exited {p.returncode}:\n{outs[rank][-6000:]}"
        results.append(json.loads(path.read_text()))
    return results


def _scenario(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = []
    for rank, res in enumerate(results):
        facts = res[name]
        assert "error" not in facts, f"rank {rank}, scenario {name}:\n{facts['error']}"
        out.append(facts)
    return out


def _expected_dim0_shard(n: int, rank: int) -> tuple[int, int]:
    """(offset, size) of ``rank``'s dim-0 shard of ``n`` rows (torch.chunk; an empty shard sits at n)."""
    chunk = math.ceil(n / WORLD)
    size = max(0, min(chunk, n - rank * chunk))
    return (min(rank * chunk, n) if size else n), size


def _param_shapes() -> dict[str, list[int]]:
    shapes = {}
    for i, (fan_in, fan_out) in enumerate(zip(DIMS, DIMS[1:])):
        shapes[f"{i}.weight"] = [fan_out, fan_in]
        shapes[f"{i}.bias"] = [fan_out]
    return shapes


MESH_1D = {"device_type": "cpu", "shape": [WORLD], "ranks": list(range(WORLD)), "dim_names": None}


def test_fsdp2_state_is_saved_as_dtensor_nodes_with_the_right_layout(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(_scenario(ranks, "fsdp")):
        assert facts["verify_ok"] is True
        shapes = _param_shapes()
        assert sorted(facts["model_nodes"]) == sorted(shapes)
        for key, shape in shapes.items():
            offset, size = _expected_dim0_shard(shape[0], rank)
            for node in (facts["model_nodes"][key], facts["optim_nodes"][f"{key}/exp_avg"],
                         facts["optim_nodes"][f"{key}/exp_avg_sq"]):
                assert node["t"] == "dtensor"
                assert node["global_shape"] == shape
                assert node["offsets"] == [offset] + [0] * (len(shape) - 1), (rank, key)
                assert node["local_shape"] == [size] + shape[1:], (rank, key)
                assert node["placements"] == [{"shard": 0}]
                assert node["mesh"] == MESH_1D
                assert node["global_stride"] == ([shape[1], 1] if len(shape) == 2 else [1])
                assert "param" not in node  # state_dict() values are not Parameters
            assert facts["optim_nodes"][f"{key}/step"]["t"] == "tensor"
        # The empty shard of rank 1 is there too, and every dtensor leaf is a recorded array.
        assert facts["model_nodes"]["2.weight"]["local_shape"] == ([1, 3] if rank == 0 else [0, 3])
        assert facts["dtensor_leaves_recorded"] is True


def test_load_returns_plain_local_tensors(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(_scenario(ranks, "fsdp")):
        for key, shape in _param_shapes().items():
            _offset, size = _expected_dim0_shard(shape[0], rank)
            assert facts["loaded"][key] == {"type": "Tensor", "shape": [size] + shape[1:], "bits_equal": True}


def test_restore_into_the_same_fsdp2_model_and_optimizer_is_bitwise(ranks: list[dict[str, Any]]) -> None:
    for facts in _scenario(ranks, "fsdp"):
        assert facts["perturbed_differs"] is True  # control: the perturbation changed what restore fixes
        assert facts["same"] == {"params_equal": True, "params_are_dtensors": True, "optim_equal": True,
                                 "optim_are_dtensors": True}


def test_restore_into_a_fresh_fsdp2_model_and_optimizer_continues_bitwise(ranks: list[dict[str, Any]]) -> None:
    for facts in _scenario(ranks, "fsdp"):
        for variant in ("fresh", "fresh_without_tree"):
            assert facts[variant] == {"params_equal": True, "params_are_dtensors": True, "optim_equal": True,
                                      "optim_are_dtensors": True}, variant
        assert facts["fresh_differs_before_restore"] is True
        assert facts["continued_equal"] is True  # one more step from the restore == one more from the original


def test_the_background_writer_captures_dtensor_state(ranks: list[dict[str, Any]]) -> None:
    for facts in _scenario(ranks, "fsdp"):
        assert facts["writer"] == {"committed": True, "node_kinds": ["dtensor"], "bits_equal": True}


def test_shard1_replicate_partial_strided_and_2d_dtensors_round_trip(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(_scenario(ranks, "dist")):
        n = facts["nodes"]
        cols = (0, 4) if rank == 0 else (4, 3)  # 7 columns over 2 ranks: 4 + 3
        assert n["s1"]["placements"] == [{"shard": 1}]
        assert n["s1"]["global_shape"] == [5, 7] and n["s1"]["global_stride"] == [7, 1]
        assert n["s1"]["offsets"] == [0, cols[0]] and n["s1"]["local_shape"] == [5, cols[1]]
        assert n["rep"]["placements"] == [{"replicate": True}]
        assert n["rep"]["offsets"] == [0, 0] and n["rep"]["local_shape"] == [5, 7]
        assert n["part"]["placements"] == [{"partial": "sum"}] and n["part"]["local_shape"] == [3]
        assert n["strided"]["placements"] == [{"strided_shard": 0, "split_factor": 2}]
        assert n["strided"]["global_shape"] == [8] and n["strided"]["local_shape"] == [4]
        assert n["two_d"]["placements"] == [{"replicate": True}, {"shard": 0}]
        assert n["two_d"]["mesh"] == {"device_type": "cpu", "shape": [1, WORLD], "ranks": list(range(WORLD)),
                                      "dim_names": ["dp", "tp"]}
        assert n["param"]["param"] is True and n["param"]["requires_grad"] is False
        for key in ("s1", "rep", "part", "strided", "two_d", "param", "even"):
            assert n[key]["mesh"]["shape"] and check_dtensor_node(n[key]) is None, key
        # Two references to one DTensor share one stored array, and load shares the tensor again.
        assert n["again"]["name"] == n["s1"]["name"] and facts["loaded_shared"] is True
        assert facts["n_arrays"] == 8  # s1, rep, even, part, strided, param, two_d, plain
        assert facts["loaded_plain"] is True and facts["loaded_bits_equal"] is True
        assert facts["loaded_param"] == {"type": "Parameter", "requires_grad": False}
        assert facts["rewrapped"] == {"all_dtensors": True, "placements_equal": True, "param_is_parameter": True,
                                      "full_s1": True, "full_rep": True, "full_part": True, "full_strided": True,
                                      "full_two_d": True, "plain_untouched": True}


def _assert_usage_error(fact: dict[str, Any], key: str, *words: str) -> None:
    assert fact["type"] == "UsageError", fact
    assert repr(key) in fact["msg"] and "DCP reader" in fact["msg"], fact["msg"]
    for word in words:
        assert word in fact["msg"], (word, fact["msg"])


def test_a_mismatched_layout_raises_usage_error(ranks: list[dict[str, Any]]) -> None:
    for facts in _scenario(ranks, "dist"):
        m = facts["mismatch"]
        _assert_usage_error(m["other_ranks_store"], "even", "offsets do not match")
        _assert_usage_error(m["placements"], "rep", "placements do not match")
        _assert_usage_error(m["dtype"], "s1", "torch.float64")
        _assert_usage_error(m["shard_dim"], "s1", "shape")
        _assert_usage_error(m["shard_into_plain"], "s1", "plain tensor")
        assert m["whole_into_plain"] == {"type": None}  # a replicated shard is the whole tensor: fine
    for facts in _scenario(ranks, "fsdp"):
        _assert_usage_error(facts["into_plain_model"], "model/0.weight", "plain tensor")


# --------------------------------------------------------------------------------------------------
# The ranks (run as ``python test_dtensor.py RANK PORT DIR``)
# --------------------------------------------------------------------------------------------------

def _bits(t: Any) -> Any:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _bits_equal(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fsdp_model(mesh: Any, seed: int) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)  # the same on every rank: fully_shard shards one initialization
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:])])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train_step(model: Any, opt: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, DIMS[0], generator=gen)).pow(2).sum().backward()
    opt.step()


def _snapshot(model: Any, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    params = {k: _local(v).clone() for k, v in model.state_dict().items()}
    optim = {f"{pid}/{k}": _local(v).clone() for pid, st in opt.state_dict()["state"].items() for k, v in st.items()}
    return params, optim


def _compare(model: Any, opt: Any, saved: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor

    params, optim = saved
    live_params = dict(model.named_parameters())
    state = opt.state_dict()["state"]
    live_optim = {f"{pid}/{k}": v for pid, st in state.items() for k, v in st.items()}
    return {
        "params_equal": sorted(live_params) == sorted(params)
                        and all(_bits_equal(_local(live_params[k]), v) for k, v in params.items()),
        "params_are_dtensors": all(isinstance(p, DTensor) for p in live_params.values()),
        "optim_equal": sorted(live_optim) == sorted(optim)
                       and all(_bits_equal(_local(live_optim[k]), v) for k, v in optim.items()),
        "optim_are_dtensors": all(isinstance(v, DTensor) for k, v in live_optim.items() if not k.endswith("/step")),
    }


def _error(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:  # what was raised is the fact under test
        return {"type": type(exc).__name__, "msg": str(exc)}
    return {"type": None}


def _scenario_fsdp(rank: int, tmp: str) -> dict[str, Any]:
    import ckptstore
    from ckptstore.dtensors import node_at, restore_into
    from ckptstore.writer import Checkpointer
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    model, opt = _fsdp_model(mesh, seed=0)
    _train_step(model, opt, seed=1)
    saved = _snapshot(model, opt)
    url = f"{tmp}/rank{rank}"
    facts: dict[str, Any] = {}
    with ckptstore.Store.open(url, create=True) as store:
        store.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=1)
        m = store.manifest("latest")
        facts["verify_ok"] = store.verify().ok
    tree = m.tree
    names = {p: i for i, p in enumerate(n for n, _ in model.named_parameters())}
    facts["model_nodes"] = {k: node_at(tree, "model", k) for k in model.state_dict()}
    facts["optim_nodes"] = {f"{k}/{s}": node_at(tree, "optim", "state", i, s)
                            for k, i in names.items() for s in ("exp_avg", "exp_avg_sq", "step")}
    recorded = {t.name for t in m.tensors}
    facts["dtensor_leaves_recorded"] = all(n["name"] in recorded for n in facts["model_nodes"].values())

    loaded = ckptstore.load(url)
    facts["loaded"] = {k: {"type": type(v).__name__, "shape": list(v.shape), "bits_equal": _bits_equal(v, saved[0][k])}
                       for k, v in loaded["model"].items()}

    where = {"store": url, "cut": m.cut}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for st in opt.state.values():
            st["exp_avg"].mul_(3.0)
    perturbed = _compare(model, opt, saved)
    facts["perturbed_differs"] = not perturbed["params_equal"] and not perturbed["optim_equal"]
    restore_into(model, loaded["model"], where=where, tree=node_at(tree, "model"))
    restore_into(opt, loaded["optim"], where=where, tree=node_at(tree, "optim"))
    facts["same"] = _compare(model, opt, saved)

    model2, opt2 = _fsdp_model(mesh, seed=5)
    facts["fresh_differs_before_restore"] = not _compare(model2, opt2, saved)["params_equal"]
    restore_into(model2, ckptstore.load(url)["model"], where=where, tree=node_at(tree, "model"))
    restore_into(opt2, ckptstore.load(url)["optim"], where=where, tree=node_at(tree, "optim"))
    facts["fresh"] = _compare(model2, opt2, saved)
    model3, opt3 = _fsdp_model(mesh, seed=6)
    again = ckptstore.load(url)
    restore_into(model3, again["model"])
    restore_into(opt3, again["optim"])
    facts["fresh_without_tree"] = _compare(model3, opt3, saved)

    _train_step(model, opt, seed=2)
    _train_step(model2, opt2, seed=2)
    facts["continued_equal"] = _compare(model2, opt2, _snapshot(model, opt))["params_equal"]

    plain = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:])])
    facts["into_plain_model"] = _error(lambda: restore_into(plain, ckptstore.load(url)["model"], where=where,
                                                            tree=node_at(tree, "model"), prefix=("model",)))

    ck_url = f"{tmp}/writer{rank}"
    with Checkpointer(ck_url, every=1, mode="thread") as ck:
        handle = ck.cut(3, {"model": model.state_dict()})
        committed = handle.wait(60).step == 3 and handle.state == "committed"
    with ckptstore.Store.open(ck_url, readonly=True) as store:
        ck_tree = store.manifest("latest").tree
    ck_loaded = ckptstore.load(ck_url)["model"]
    facts["writer"] = {
        "committed": committed,
        "node_kinds": sorted({node_at(ck_tree, "model", k)["t"] for k in ck_loaded}),
        "bits_equal": all(_bits_equal(v, _local(model.state_dict()[k])) for k, v in ck_loaded.items()),
    }
    return facts


def _scenario_dist(rank: int, tmp: str) -> dict[str, Any]:
    import ckptstore
    from ckptstore.dtensors import node_at, rewrap
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    x = torch.arange(35, dtype=torch.float32).reshape(5, 7)
    s1 = distribute_tensor(x, mesh, [Shard(1)])
    state: dict[str, Any] = {
        "s1": s1,
        "again": s1,
        "rep": distribute_tensor(x * 2, mesh, [Replicate()]),
        "even": distribute_tensor(torch.arange(8, dtype=torch.float32), mesh, [Shard(0)]),
        "part": DTensor.from_local(torch.full((3,), float(rank + 1)), mesh, [Partial()], run_check=False),
        "strided": DTensor.from_local(torch.arange(4, dtype=torch.float32) + 10 * rank, mesh,
                                      [_StridedShard(0, split_factor=2)], run_check=False, shape=(8,), stride=(1,)),
        "param": torch.nn.Parameter(distribute_tensor(x.T.contiguous(), mesh, [Shard(0)]), requires_grad=False),
        "two_d": distribute_tensor(x, mesh2, [Replicate(), Shard(0)]),
        "plain": torch.ones(2),
    }
    url = f"{tmp}/dist{rank}"
    with ckptstore.Store.open(url, create=True) as store:
        store.save(state, step=1)
        m = store.manifest("latest")
    tree = m.tree
    facts: dict[str, Any] = {"nodes": {k: node_at(tree, k) for k in state if k != "plain"}, "n_arrays": len(m.tensors)}
    loaded = ckptstore.load(url)
    facts["loaded_shared"] = loaded["again"] is loaded["s1"]
    facts["loaded_plain"] = all(type(v) in (torch.Tensor, torch.nn.Parameter) for v in loaded.values())
    facts["loaded_bits_equal"] = all(_bits_equal(loaded[k], _local(v)) for k, v in state.items())
    facts["loaded_param"] = {"type": type(loaded["param"]).__name__, "requires_grad": loaded["param"].requires_grad}

    back = rewrap(loaded, state, where={"store": url, "cut": m.cut}, tree=tree)
    dts = {k: v for k, v in back.items() if k != "plain"}
    facts["rewrapped"] = {
        "all_dtensors": all(isinstance(v, DTensor) for v in dts.values()),
        "placements_equal": all(v.placements == state[k].placements and v.shape == state[k].shape
                                and v.stride() == state[k].stride() and _bits_equal(v.to_local(), _local(state[k]))
                                for k, v in dts.items()),
        "param_is_parameter": isinstance(back["param"], torch.nn.Parameter) and not back["param"].requires_grad,
        "full_s1": torch.equal(back["s1"].full_tensor(), x),
        "full_rep": torch.equal(back["rep"].full_tensor(), x * 2),
        "full_part": torch.equal(back["part"].full_tensor(), torch.full((3,), float(sum(range(1, WORLD + 1))))),
        "full_strided": torch.equal(back["strided"].full_tensor(), state["strided"].full_tensor()),
        "full_two_d": torch.equal(back["two_d"].full_tensor(), x),
        "plain_untouched": back["plain"] is loaded["plain"],
    }

    other = f"{tmp}/dist{(rank + 1) % WORLD}"
    dist_barrier()  # the other rank's store is committed
    with ckptstore.Store.open(other, readonly=True) as store:
        other_tree = store.manifest("latest").tree
    other_loaded = ckptstore.load(other)
    where = {"store": other, "cut": "x"}
    facts["mismatch"] = {
        "other_ranks_store": _error(lambda: rewrap({"even": other_loaded["even"]}, {"even": state["even"]}, where=where,
                                                   tree=other_tree)),
        "placements": _error(lambda: rewrap({"rep": loaded["rep"]}, {"rep": DTensor.from_local(
            torch.zeros(5, 7), mesh, [Partial()], run_check=False)}, where=where, tree=tree)),
        "dtype": _error(lambda: rewrap({"s1": loaded["s1"]}, {"s1": distribute_tensor(x.double(), mesh, [Shard(1)])},
                                       where=where, tree=tree)),
        "shard_dim": _error(lambda: rewrap({"s1": loaded["s1"]}, {"s1": distribute_tensor(x, mesh, [Shard(0)])},
                                           where=where)),
        "shard_into_plain": _error(lambda: rewrap({"s1": loaded["s1"]}, {"s1": x.clone()}, where=where, tree=tree)),
        "whole_into_plain": _error(lambda: rewrap({"rep": loaded["rep"]}, {"rep": x.clone()}, where=where, tree=tree)),
    }
    return facts


def dist_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


SCENARIOS: list[tuple[str, Callable[[int, str], dict[str, Any]]]] = [("fsdp", _scenario_fsdp), ("dist", _scenario_dist)]


def _worker(rank: int, port: int, tmp: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS:
            try:
                results[name] = scenario(rank, tmp)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(tmp, f"result{rank}.json.tmp"), "w") as f:
            json.dump(results, f)
        os.replace(os.path.join(tmp, f"result{rank}.json.tmp"), os.path.join(tmp, f"result{rank}.json"))
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
