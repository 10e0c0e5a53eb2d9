"""The batched capture (issue 23): the block, the tree and the plan are those of the capture tensor by
tensor, for every kind of state, cold and with the layout cached; a cached layout is never used for a
state that differs from it (keys, shapes, dtypes, storages, ties, Parameters, bits), and a Checkpointer
whose cuts reuse it loads each cut back bit for bit. Real shared-memory blocks, a real Checkpointer."""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from ckptstore import Store
from ckptstore.writer import Checkpointer
from ckptstore.writer.blockcopy import BlockCopy
from ckptstore.writer.capture import CaptureCache, capture
from ckptstore.writer.plan import grown_size
from ckptstore.writer.shm import Block
from writerkit import BOUND

# ---------------------------------------------------------------------------------------------- states


def flat_state(n: int = 3000, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"block.{i:05d}.param": torch.randn(1024, generator=g) for i in range(n)}


def model_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2, "lr": 1e-3}


def dtypes_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 7, generator=g).half(),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.arange(-5, 12),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.rand(19, generator=g) > 0.5,
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
        "c128": torch.randn(2, 2, dtype=torch.complex128, generator=g),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["f8"] = torch.randn(10, generator=g).to(torch.float8_e4m3fn)
    return out


def strides_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 5, generator=g), torch.randn(4, 4, 3, generator=g)
    return {"t": a.t(), "cols": a[:, ::2], "perm": b.permute(2, 0, 1),
            "expanded": torch.randn(3, 1, generator=g).expand(3, 4), "strided": torch.randn(40, generator=g)[3::7]}


def bits_state() -> dict[str, Any]:
    c = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    d = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(4))
    return {"c": c, "conj": c.conj(), "neg": c.conj().imag, "alone_conj": d.conj(), "alone_neg": d.conj().imag}


def small_state() -> dict[str, Any]:
    return {"empty": torch.zeros(0), "empty2d": torch.zeros(3, 0, dtype=torch.int64), "scalar": torch.tensor(2.5),
            "scalar_i": torch.tensor(7), "one": torch.ones(1), "between": torch.arange(3.0), "last": torch.zeros(0, 4)}


def numpy_state() -> dict[str, Any]:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    return {"a": a, "t": a.T, "i": np.arange(5, dtype=">i4"), "zero_d": np.array(3.5), "empty": np.zeros((0, 3)),
            "t1": torch.arange(4.0), "np_scalar": np.float32(1.5), "t2": torch.ones(2, 2)}


def shared_state() -> dict[str, Any]:
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    lin = torch.nn.Linear(4, 4)
    emb = torch.nn.Embedding(3, 4)
    emb.weight = lin.weight  # tied weights: one leaf named twice
    return {"w": w, "tail": w[1:], "wt": w.t(), "lin": lin.state_dict(), "emb": emb.state_dict(),
            "twice": [w, w], "other": torch.randn(3)}


def params_state() -> dict[str, Any]:
    lin = torch.nn.Linear(3, 2)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    return {"weight": lin.weight, "bias": lin.bias, "frozen": frozen, "grad": torch.randn(3).requires_grad_(),
            "plain": torch.randn(3), "nested": {"p": lin.weight, "od": collections.OrderedDict(x=lin.bias, n=3)}}


def mixed_state() -> dict[str, Any]:
    """Containers of every kind, ints as keys, scalars between the tensors."""
    return {"list": [torch.ones(3), 1, {"x": torch.zeros(2), "y": "s"}, (torch.arange(2), None)],
            3: torch.full((2,), 3.0), "tuple": (1.5, float("nan"), -0.0, True, b"raw"),
            "od": collections.OrderedDict([("b", torch.ones(1)), ("a", [2, 3])]), "step": 10}


def optimizer_like_state() -> dict[str, Any]:
    """Containers of dicts that all hold the same tensor keys (an optimizer's per-parameter state), as
    dicts, as OrderedDicts reordered with move_to_end (their own order, not their storage's), in a list."""
    g = torch.Generator().manual_seed(6)
    ods = collections.OrderedDict(
        (i, collections.OrderedDict(m=torch.randn(3, generator=g), v=torch.randn(2, generator=g))) for i in range(4))
    for od in ods.values():
        od.move_to_end("m")
    return {"state": {i: {"exp_avg": torch.randn(4, generator=g), "exp_avg_sq": torch.randn(4, generator=g)}
                      for i in range(6)},
            "ods": ods, "in_list": [{"x": torch.randn(1, generator=g)} for _ in range(3)]}


STATES: dict[str, Callable[[], Any]] = {
    "flat": flat_state, "model+adamw": model_state, "dtypes": dtypes_state, "strides": strides_state,
    "conj+neg": bits_state, "zero-size+0-d": small_state, "numpy": numpy_state, "tied+views": shared_state,
    "params": params_state, "mixed": mixed_state, "optimizer-like": optimizer_like_state,
    "runs": lambda: runs_state(),
}

# ---------------------------------------------------------------------------------------------- helpers


@dataclass
class Snap:
    """What a capture leaves: the block's bytes up to the plan's end, the tree and the plan's slots."""

    data: bytes
    tree: str
    slots: tuple[Any, ...]
    mode: str

    def same_as(self, other: "Snap") -> None:
        assert self.slots == other.slots
        assert self.tree == other.tree
        assert self.data == other.data, "the blocks differ"
        assert self.mode == other.mode


@contextlib.contextmanager
def blocks() -> Iterator[Callable[[int], Block]]:
    """A ``block_for`` as the pipeline's: a fresh (zeroed) block, a new bigger one when the state no
    longer fits; all closed at the end."""
    made: list[Block] = []

    def block_for(nbytes: int) -> Block:
        if not made or made[-1].size < nbytes:
            made.append(Block.create(grown_size(nbytes, made[-1].size if made else 0)))
        return made[-1]

    try:
        yield block_for
    finally:
        for b in made:
            b.close()


def snap(state: Any, *, batched: bool = True, cache: CaptureCache | None = None, **kw: Any) -> Snap:
    """One capture of ``state`` into a fresh block (its views released before the block closes)."""
    own = cache is None
    cache = CaptureCache() if cache is None else cache
    with blocks() as block_for:
        captured = capture(state, block_for, batched=batched, cache=cache, **kw)
        block = block_for(captured.plan.nbytes)
        out = Snap(bytes(block.view[: captured.plan.nbytes]), json.dumps(captured.tree), captured.plan.slots,
                   captured.mode)
        cache.release()
    if own:
        cache.layouts.forget()
    return out


def reference(state: Any, **kw: Any) -> Snap:
    """The capture tensor by tensor, cold: what every other capture must equal."""
    return snap(state, batched=False, **kw)


# ------------------------------------------------------------------------------- batched == per tensor


@pytest.mark.parametrize("name", list(STATES))
def test_batched_capture_gives_the_blocks_trees_and_plans_of_the_per_tensor_one(name):
    state = STATES[name]()
    expected = reference(state)
    snap(state).same_as(expected)  # cold
    cache = CaptureCache()
    snap(state, cache=cache).same_as(expected)
    for _ in range(2):  # warm: from the cached layout
        snap(state, cache=cache).same_as(expected)
    assert cache.layouts.hits == 2 and cache.layouts.misses == 1


def test_every_kind_of_state_together_with_pickle_allowed():
    state = {name: make() for name, make in STATES.items() if name != "flat"}
    state["set"] = {1, 2, 3}
    expected = reference(state, allow_pickle=True)
    cache = CaptureCache()
    for _ in range(3):
        snap(state, cache=cache, allow_pickle=True).same_as(expected)
    assert cache.layouts.hits == 2
    # The same state without pickle allowed is another layout (its values may encode differently).
    snap(state, cache=cache).same_as(reference(state))
    assert cache.layouts.misses == 2


def test_states_only_the_full_flatten_describes_are_never_cached():
    """Arrays inside a dataclass or a namedtuple: every capture flattens in full, and is right."""
    from dataclasses import dataclass as dc

    @dc
    class Holder:
        w: Any
        n: int

    Pair = collections.namedtuple("Pair", "a b")
    state = {"h": Holder(torch.ones(3), 1), "p": Pair(torch.zeros(2), 5), "x": torch.arange(3)}
    cache = CaptureCache()
    for _ in range(2):
        snap(state, cache=cache).same_as(reference(state))
    assert cache.layouts.hits == 0 and cache.layouts.misses == 2


def test_the_device_paths_run_on_cpu_stand_ins_and_give_the_same_bytes():
    """BlockCopy's device paths with CPU tensors standing in for CUDA ones (``device_type="cpu"``):
    the staged gather (``cuda-device-copy``: one buffer laid out like the block's runs of slots, then
    one copy per run) and the direct copy (``cuda-direct``) fill the block as the per-tensor copy does.
    Numpy arrays and zero-size tensors between the tensors split the runs."""
    state = {**small_state(), **numpy_state(), **dtypes_state(), **strides_state(), **bits_state()}
    expected = reference(state)
    cache = CaptureCache()
    with blocks() as block_for:
        captured = capture(state, block_for, cache=cache)  # the plan, and the sources it was made from
        flat = cache.layouts.flatten(state)
        for staged in (True, False):
            with blocks() as fresh:
                block = fresh(captured.plan.nbytes)
                copy = BlockCopy(captured.plan.slots, flat.sources, block, device_type="cpu")
                assert copy.held == (0, 0) and copy.devices == {torch.device("cpu")}
                assert copy.stage_runs > 1
                if staged:
                    buf = copy.stage(flat.sources, "cpu")
                    assert buf.numel() == copy.stage_nbytes
                    copy.unstage(buf, non_blocking=True)
                else:
                    copy.copy_device(flat.sources, non_blocking=True)
                copy.copy_numpy(flat.sources)
                assert bytes(block.view[: captured.plan.nbytes]) == expected.data, f"staged={staged}"
                del copy
        cache.release()


def runs_state() -> dict[str, Any]:
    """Slots back to back (4 KB-multiple tensors: cat runs, first dimensions differing) between padded
    ones, 0-d ones and a run too short for cat."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {f"pad{i}": torch.randn(1000, generator=g) for i in range(3)}  # padded: views
    out.update({f"a{i}": torch.randn(1024, generator=g) for i in range(20)})  # run 1
    out.update({f"rows{i}": torch.randn(i % 3 + 1, 1024, generator=g) for i in range(9)})  # run 2
    out.update({f"t{i}": torch.randn(512, 4, generator=g).t() for i in range(8)})  # run 3, transposed sources
    out["step"] = torch.tensor(4.0)  # 0-d: a view
    out.update({f"short{i}": torch.randn(1024, generator=g) for i in range(3)})  # < MIN_RUN: views
    out["i64"] = torch.arange(512 * 8)  # another dtype: its own group
    return out


def test_back_to_back_slots_are_one_cat_each_run_and_the_others_views():
    """A run of slots back to back (at least MIN_RUN) holds one view of the block, not one a tensor:
    the issue's 40,000 4 KB tensors hold one view. The bytes are the per-tensor copy's."""
    from ckptstore.writer.blockcopy import MIN_RUN

    state = runs_state()
    assert MIN_RUN == 8
    cache = CaptureCache()
    with blocks() as block_for:
        captured = capture(state, block_for, cache=cache)
        assert cache._copy is not None and cache._copy.held == (3, 3 + 1 + 3 + 1)
        assert bytes(block_for(captured.plan.nbytes).view[: captured.plan.nbytes]) == reference(state).data
        capture(flat_state(), block_for, cache=cache)
        assert cache._copy.held == (1, 0)
        cache.release()
    snap(state, cache=cache).same_as(reference(state))


# ------------------------------------------------------------------------------- the cache stays sound


def _warm(state: Any) -> CaptureCache:
    cache = CaptureCache()
    snap(state, cache=cache)
    snap(state, cache=cache)
    assert cache.layouts.hits == 1
    return cache


def _after(cache: CaptureCache, state: Any, *, hit: bool) -> None:
    """A capture with the warm cache equals a cold one; ``hit``: whether the cached layout served it."""
    hits = cache.layouts.hits
    got = snap(state, cache=cache)
    got.same_as(reference(state))
    assert (cache.layouts.hits == hits + 1) == hit


def test_a_scalar_that_changes_is_encoded_anew_from_the_cached_layout():
    state = model_state()
    cache = _warm(state)
    for step, lr in ((3, 5e-4), (4, float("inf")), (5, -0.0)):
        state["step"], state["lr"] = step, lr
        state["optim"]["param_groups"][0]["lr"] = lr
        _after(cache, state, hit=True)
        assert f'"v": {step}' in snap(state, cache=cache).tree


@pytest.mark.parametrize("change", [
    "shape", "shape-broadcastable", "dtype", "key-added", "key-removed", "keys-reordered", "key-type",
    "container-type", "untied", "new-storage", "value-becomes-tensor", "tensor-becomes-value", "parameter",
    "requires-grad", "conj-bit-of-a-shared-view", "numpy-dtype", "numpy-shape", "list-longer",
    "uniform-key-renamed", "uniform-keys-reordered", "uniform-child-gets-a-value", "uniform-child-type",
])
def test_a_state_that_differs_from_the_cached_layout_gives_what_a_cold_capture_gives(change):
    state = {**shared_state(), **numpy_state(), **params_state(), **bits_state(), "list": [torch.ones(2), 1],
             "step": 1, "k": {"a": torch.ones(4), "b": torch.zeros(4)}, "grid": torch.randn(2, 3),
             "opt": {i: {"m": torch.randn(2), "v": torch.randn(2)} for i in range(3)}}
    cache = _warm(state)
    # The first three keep the tensor's storage, data_ptr and strides: only what they name changes.
    if change == "shape":
        state["other"] = state["other"][:2]
    elif change == "shape-broadcastable":  # _foreach_copy_ would broadcast a (1, 3) source into a (2, 3) view
        state["grid"] = state["grid"][:1]
    elif change == "dtype":  # _foreach_copy_ would convert silently
        state["other"] = state["other"].view(torch.int32)
    elif change == "key-added":
        state["zzz"] = torch.ones(1)
    elif change == "key-removed":
        del state["plain"]
    elif change == "keys-reordered":
        state["k"] = {"b": state["k"]["b"], "a": state["k"]["a"]}
    elif change == "key-type":  # 1 == 1.0 == True: equal keys, but another tree
        state["k"] = {"a": state["k"]["a"], 1: state["k"]["b"]}
    elif change == "container-type":
        state["k"] = collections.OrderedDict(state["k"])
    elif change == "untied":
        state["twice"] = [state["w"], state["w"].clone()]
    elif change == "new-storage":  # same shape and dtype, another storage (a new data_ptr)
        state["other"] = torch.randn(3)
    elif change == "value-becomes-tensor":
        state["step"] = torch.tensor(2)
    elif change == "tensor-becomes-value":
        state["plain"] = 3
    elif change == "parameter":
        state["plain"] = torch.nn.Parameter(state["plain"])
    elif change == "requires-grad":
        state["plain"].requires_grad_()
    elif change == "conj-bit-of-a-shared-view":  # shares its storage with "c": share_storages reads the bit
        state["conj"] = state["c"].conj().conj()
    elif change == "numpy-dtype":
        state["a"] = state["a"].astype(np.float64)
    elif change == "numpy-shape":
        state["a"] = state["a"].reshape(6, 4)
    elif change == "list-longer":
        state["list"].append(torch.zeros(1))
    elif change == "uniform-key-renamed":
        state["opt"][1] = {"m": state["opt"][1]["m"], "w": state["opt"][1]["v"]}
    elif change == "uniform-keys-reordered":
        state["opt"][2] = {"v": state["opt"][2]["v"], "m": state["opt"][2]["m"]}
    elif change == "uniform-child-gets-a-value":
        state["opt"][0]["step"] = 3
    elif change == "uniform-child-type":
        state["opt"][0] = collections.OrderedDict(state["opt"][0])
    _after(cache, state, hit=False)
    _after(cache, state, hit=True)  # the new layout is the cached one now


def test_the_conj_and_neg_bits_of_views_sharing_a_storage_are_part_of_the_layout():
    c = torch.randn(4, dtype=torch.complex64)
    state = {"c": c, "v": c[1:]}
    cache = _warm(state)
    state["v"] = c[1:].conj()  # same storage, offset, shape, stride: only the bit differs
    _after(cache, state, hit=False)
    state["v"] = c[1:]
    _after(cache, state, hit=False)


def test_state_dict_returns_new_tensors_each_call_and_the_layout_still_matches():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    model[2].weight = model[0].weight
    cache = CaptureCache()
    snap({"m": model.state_dict()}, cache=cache)
    for _ in range(2):
        state = {"m": model.state_dict()}
        _after(cache, state, hit=True)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # values change, the layout does not
    _after(cache, {"m": model.state_dict()}, hit=True)
    model[2].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # untied
    _after(cache, {"m": model.state_dict()}, hit=False)


def test_a_grown_block_gets_new_views_and_the_same_bytes():
    small, big = flat_state(10), flat_state(300, seed=1)
    cache = CaptureCache()
    with blocks() as block_for:
        first = capture(small, block_for, cache=cache)
        old = block_for(first.plan.nbytes)
        copy = cache._copy
        grown = capture(big, block_for, cache=cache)  # a miss, and a bigger block
        new = block_for(grown.plan.nbytes)
        assert new is not old and cache._copy is not copy and cache._copy.block is new
        again = capture(big, block_for, cache=cache)  # a hit, with the views of the grown block
        assert cache.layouts.hits == 1 and cache._copy.block is new
        assert bytes(new.view[: again.plan.nbytes]) == reference(big).data
        cache.release()


def test_the_cache_keeps_no_tensor_of_the_state_alive():
    """Neither the layout nor the views of the block hold a tensor of the state (a training run's old
    optimizer state must be freed once the loop drops it)."""
    import gc
    import weakref

    state = {**flat_state(5), **shared_state(), **optimizer_like_state()}
    cache = CaptureCache()
    with blocks() as block_for:
        for _ in range(2):
            capture(state, block_for, cache=cache)
        assert cache.layouts.hits == 1 and cache._copy is not None
        refs = [weakref.ref(t) for t in _tensors(state)]
        del state
        gc.collect()
        assert all(r() is None for r in refs)
        cache.release()


def _tensors(x: Any) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def test_a_numpy_only_state_is_captured_without_importing_torch(url):
    """The writer never needs torch for a state without tensors (a numpy trainer; ``ckptstore`` itself
    runs without torch): a real Checkpointer in a fresh interpreter, three cuts, the last two warm."""
    code = (
        "import sys, numpy as np\n"
        "from ckptstore.writer import Checkpointer\n"
        f"with Checkpointer({url!r}, every=1, mode='inline') as ck:\n"
        "    for step in (1, 2, 3):\n"
        "        ck.cut(step, {'w': np.arange(10.0) + step, 'n': step}).wait(30)\n"
        "    assert ck._pipeline._captures.layouts.hits == 2\n"
        "assert 'torch' not in sys.modules, 'the capture imported torch'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    with Store.open(url, readonly=True) as store:
        assert np.array_equal(store.load(store.latest().id)["w"], np.arange(10.0) + 3)


# ------------------------------------------------------------------------------------- the Checkpointer


@pytest.mark.parametrize("mode", ["process", "inline"])
def test_a_checkpointer_with_a_warm_cache_loads_every_cut_bit_identical(url, mode):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    extra = flat_state(500)
    snaps, infos = [], []
    with Checkpointer(url, every=1, mode=mode) as ck:
        for step in (1, 2, 3, 4):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            for t in extra.values():
                t.add_(1.0)
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra, "step": step,
                     "note": f"step {step}"}
            snaps.append(_clone(state))
            infos.append(ck.cut(step, state).wait(BOUND))
        # Steps 2-4 reused the layout of step 1 (AdamW's state exists from the first step on).
        assert ck._pipeline._captures.layouts.hits == 3
    with Store.open(url, readonly=True) as store:
        assert store.verify().ok
        for info, expected in zip(infos, snaps):
            _assert_bitwise(store.load(info.id), expected)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def _assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where  # bits
    elif isinstance(b, dict):
        assert list(a) == list(b), where
        for k in b:
            _assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_a_reused_plan_extended_by_attached_files_is_the_plan_of_all_of_them():
    from ckptstore.writer.plan import extend_plan, plan_block

    arrays = [("a", "torch", "float32", (3,), 12), ("b", "torch", "int64", (1024,), 8192),
              ("z", "torch", "bool", (0,), 0)]
    files = [("f1", "numpy", "|u1", (5000,), 5000), ("f2", "numpy", "|u1", (0,), 0), ("f3", "numpy", "|u1", (1,), 1)]
    for head in (arrays, arrays[:1], []):
        assert extend_plan(plan_block(head), files) == plan_block(head + files)
        assert extend_plan(plan_block(head), []) == plan_block(head)


def test_attached_files_follow_the_reused_plan(url, tmp_path):
    """A cut with files= reuses the state's plan and appends the files' slots; both load back."""
    f = tmp_path / "notes.txt"
    with Checkpointer(url, every=1, mode="inline") as ck:
        for step in (1, 2, 3):
            f.write_text("x" * (step * 3000))  # another size at every cut
            ck.cut(step, flat_state(20, seed=step), files=[str(f)]).wait(BOUND)
        assert ck._pipeline._captures.layouts.hits == 0  # new storages each cut: the layout misses...
        state = flat_state(20)
        for step in (4, 5):
            f.write_text("y" * (step * 1000))
            ck.cut(step, state, files=[str(f)]).wait(BOUND)
        assert ck._pipeline._captures.layouts.hits == 1  # ...and hits for the same tensors
    with Store.open(url, readonly=True) as store:
        assert store.verify().ok
        _assert_bitwise(store.load(store.latest().id), state)
