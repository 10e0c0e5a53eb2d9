"""What a Checkpointer keeps between cuts, and the block it lays out (issue 23: the trainer's peak
memory during a cut of 100,000 small tensors). Sub-page arrays are packed into shared pages, with the
same bytes in the block as the per-tensor capture and the same shards as ``store.save``; the layout
cache keeps its tensor signature as compact columns and no per-child template for containers without
arrays, and still tells a state of its layout from any other exactly as before. Real blocks, real
stores, no mocks."""

from __future__ import annotations

import copy
import os
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from ckptstore import Store
from ckptstore.arrays import ArrayItem
from ckptstore.tree.encode import walk
from ckptstore.tree.layoutcache import LayoutCache, _Coded
from ckptstore.tree.template import Container, _SUB, _VALUE
from ckptstore.writer import Checkpointer
from ckptstore.writer.capture import CaptureCache, capture
from ckptstore.writer import heap
from ckptstore.writer.blockcopy import BlockCopy
from ckptstore.writer.plan import ALIGN, PACK, align, extend_plan, pack_align, plan_block
from ckptstore.writer.shm import Block


def tiny_state() -> dict[str, Any]:
    """Sub-page arrays of every size class beside page-sized and larger ones, numpy among them."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {f"tiny.{i:04d}": torch.randn(3, generator=g) for i in range(300)}  # 12 bytes each
    out.update({
        "i8": torch.arange(-2, 3, dtype=torch.int8), "c128": torch.randn(2, dtype=torch.complex128, generator=g),
        "bool": torch.rand(9, generator=g) > 0.5, "empty": torch.zeros(0), "scalar": torch.tensor(1.5),
        "page": torch.randn(1024, generator=g), "over_page": torch.randn(1025, generator=g),
        "np_small": np.arange(5, dtype=np.int16), "after": torch.randn(7, generator=g),
        "quarter": {f"q{i}": torch.randn(256, generator=g) for i in range(40)},  # 1 KiB, back to back: cat runs
    })
    return out


class Blocks:
    """``block_for`` of a capture: a new block for each, all kept (in ``made``) until closed."""

    def __init__(self) -> None:
        self.made: list[Block] = []

    def __call__(self, n: int) -> Block:
        self.made.append(Block.create(n))
        return self.made[-1]


@pytest.fixture
def block_maker() -> Iterator[Blocks]:
    blocks = Blocks()
    yield blocks
    for b in blocks.made:
        b.close()


def test_sub_page_arrays_share_pages_and_larger_ones_start_on_a_page():
    sizes = [12, 4096, 5, 0, 4097, 64, 1, 8192, 3, 100]
    plan = plan_block((f"a{i}", "torch", "uint8", (n,), n) for i, n in enumerate(sizes))
    end = 0
    for s in plan.slots:
        assert s.offset >= end  # in order, never overlapping
        assert s.offset % (ALIGN if s.nbytes >= ALIGN else pack_align(s.nbytes)) == 0
        assert s.nbytes >= ALIGN or s.offset - end < PACK  # packed: at most the alignment's padding
        end = s.offset + s.nbytes
    assert plan.nbytes % ALIGN == 0 and plan.nbytes >= end
    assert [pack_align(n) for n in (12, 5, 64, 1, 2, 6, 0)] == [4, 1, 16, 1, 2, 2, 16]
    # The case: 100,000 tensors of 12 bytes took 100,000 pages (410 MB); packed, back to back.
    many = plan_block((f"t{i}", "torch", "float32", (3,), 12) for i in range(100_000))
    assert [s.offset for s in many.slots] == list(range(0, 1_200_000, 12))
    assert many.nbytes == align(1_200_000)
    # Attached files appended to a reused plan land where one plan of everything puts them.
    files = [("~files/a", "torch", "uint8", (10,), 10), ("~files/b", "torch", "uint8", (5000,), 5000)]
    head = [(f"h{i}", "torch", "float32", (3,), 12) for i in range(5)]
    assert extend_plan(plan_block(head), files) == plan_block(head + files)


def test_a_packed_block_holds_the_bytes_of_the_per_tensor_capture(block_maker):
    state = tiny_state()
    cache = CaptureCache()
    batched = capture(state, block_maker, cache=cache)
    again = capture(state, block_maker, cache=cache)  # the cached layout's copy, into a second block
    each = capture(state, block_maker, batched=False)
    assert cache.layouts.hits == 1
    assert batched.plan == each.plan == again.plan
    assert batched.plan.nbytes <= 20 * ALIGN < len(batched.plan.slots) * ALIGN  # not a page per array any more
    views = [b.view for b in block_maker.made]
    for s in batched.plan.slots:
        got = [bytes(v[s.offset:s.offset + s.nbytes]) for v in views]
        assert got[0] == got[1] == got[2], s.name
    # The 12-byte tensors and the 1 KiB ones are back to back: cat runs, not a view each kept.
    assert cache._copy is not None and cache._copy.held[0] >= 2 and cache._copy.held[1] < 20


def test_the_device_paths_keep_the_alignment_of_packed_slots(block_maker):
    """The staged gather (``cuda-device-copy``) on CPU stand-ins: runs of device slots that start
    mid-page (packed) keep their place in a page in the stage buffer, so every typed view there is
    aligned, and the block gets the per-tensor capture's bytes."""
    g = torch.Generator().manual_seed(9)
    state: dict[str, Any] = {}
    for i in range(60):  # odd sizes and mixed element sizes: runs start at every alignment
        state[f"np.{i}"] = np.arange(i % 5 + 1, dtype=np.int16)  # splits the device runs: each starts
        state[f"i8.{i}"] = torch.arange(i % 7 + 1, dtype=torch.int8)  # at an int8, at any offset
        state[f"f64.{i}"] = torch.randn(i % 3 + 1, dtype=torch.float64, generator=g)
        state[f"c128.{i}"] = torch.randn(2, dtype=torch.complex128, generator=g)
    each = capture(state, block_maker, batched=False)
    cache = CaptureCache()
    captured = capture(state, block_maker, cache=cache)
    flat = cache.layouts.flatten(state)
    assert captured.plan == each.plan
    assert any(s.offset % ALIGN and s.offset % PACK for s in captured.plan.slots)
    for staged in (True, False):
        block = block_maker(captured.plan.nbytes)
        copy = BlockCopy(captured.plan.slots, flat.sources, block, device_type="cpu")
        assert copy.stage_runs > 1
        if staged:
            copy.unstage(copy.stage(flat.sources, "cpu"))
        else:
            copy.copy_device(flat.sources)
        copy.copy_numpy(flat.sources)
        n = captured.plan.nbytes
        assert bytes(block.view[:n]) == bytes(block_maker.made[0].view[:n]), f"staged={staged}"
        del copy
    cache.release()


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_cut_of_packed_slots_writes_the_shards_of_store_save(tmp_path, mode):
    state = tiny_state()
    ck = Checkpointer(str(tmp_path / "ck"), every=1, mode=mode)
    try:
        ck.cut(1, state).wait(60)
    finally:
        ck.close()
    ref = Store.open(str(tmp_path / "ref"), create=True)
    ref.save(state, step=1)
    ref.close()
    a, b = _shards(tmp_path / "ck"), _shards(tmp_path / "ref")
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name] == b[name], name
    with Store.open(str(tmp_path / "ck")) as st:
        back = st.load()
    for k, v in state.items():
        if isinstance(v, dict):
            assert all(torch.equal(back[k][q], t) for q, t in v.items())
        elif isinstance(v, np.ndarray):
            assert np.array_equal(back[k], v)
        else:
            assert torch.equal(back[k], v), k


def _shards(root: Any) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(".safetensors") or ".shard" in f or f.startswith("rank"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    out[f] = fh.read()
    return out


def test_a_coded_column_compares_as_the_list_it_stands_for():
    shapes = [torch.Size([4]), torch.Size([2, 2]), torch.Size([4])] * 100
    col = _Coded(shapes)
    assert col.table is not None and col.codes.typecode == "B" and len(col.codes) == 300
    assert col.same([torch.Size(list(s)) for s in shapes])  # new objects, equal values
    changed = list(shapes)
    changed[150] = torch.Size([2, 2])  # a value it holds, elsewhere
    assert not col.same(changed)
    changed[150] = torch.Size([8])  # a value it never held
    assert not col.same(changed)
    assert not col.same(shapes[:-1])
    one = _Coded([torch.float32] * 1000)
    assert one.table is None and one.codes is None  # uniform: nothing per value
    assert one.same([torch.float32] * 1000) and not one.same([torch.float32] * 999 + [torch.float64])
    assert _Coded([]).same([]) and not _Coded([]).same([torch.float32])


def test_the_layout_keeps_a_few_bytes_a_tensor_and_still_tells_every_change():
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(4 if i % 3 else 8, generator=g) for i in range(9000)}
    lc = LayoutCache()
    lc.flatten(state)
    sig = lc.layout._sig
    per_tensor = sum(c.itemsize * len(c) if hasattr(c, "itemsize") else
                     (len(c.codes) * c.codes.itemsize if c.codes is not None else 0) for c in sig) / 9000
    assert per_tensor <= 16 + 1  # the addresses and offsets, and one byte for the two shapes (was 64)
    assert lc.flatten(state).layout is lc.layout and lc.hits == 1
    for change in ("shape", "dtype", "grad", "type"):
        other = dict(state)
        t = other["w4"]
        other["w4"] = {"shape": torch.randn(8, generator=g), "dtype": t.double(),
                       "grad": t.clone().requires_grad_(), "type": torch.nn.Parameter(t.clone())}[change]
        lc2 = LayoutCache()
        lc2.flatten(state)
        got = lc2.flatten(other)
        assert lc2.misses == 2, change
        full = walk(other, False)
        assert got.tree == full.tree and [s is lf.obj for s, lf in zip(got.sources, full.leaves)] == [True] * 9000


def optim_state(n: int, lr: float = 1e-3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"model": {f"p{i}": torch.randn(4, generator=g) for i in range(n)},
            "optim": {"state": {i: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)} for i in range(n)},
                      "param_groups": [{"lr": lr, "betas": (0.9, 0.95), "params": list(range(n))}]},
            "step": 3}


def _containers(c: Container) -> Iterator[Container]:
    yield c
    for kind, _a, _b, sub, _k in c.segs:
        if kind == _SUB:
            yield from _containers(sub)


def test_a_container_without_arrays_is_one_value_and_the_template_drops_its_cold_nodes():
    state = optim_state(3000)
    lc = LayoutCache()
    cold = lc.flatten(state).tree
    kept = copy.deepcopy(cold)
    root = lc.layout._root
    segs = sum(len(c.segs) for c in _containers(root))
    assert segs < 20  # param_groups' 3,000 ids are one value, not 3,000 segments
    for c in _containers(root):
        if not c.static:  # the children re-encoded at each walk are not kept from the cold tree
            for kind, a, _b, sub, _k in c.segs:
                if kind == _VALUE or (kind == _SUB and not sub.static):
                    assert c.node["items"][a] is None
    other = optim_state(3000, lr=5e-4)
    other["optim"]["param_groups"][0]["params"] = list(range(3000))[::-1]
    other["step"] = 4
    other["model"] = state["model"]
    other["optim"]["state"] = state["optim"]["state"]
    warm = lc.flatten(other)
    assert lc.hits == 1 and warm.tree == walk(other, False).tree
    assert cold == kept  # the cold tree is never modified
    # A container that now holds an array is no longer this layout.
    other["optim"]["param_groups"][0]["params"] = [torch.zeros(1)]
    miss = lc.flatten(other)
    assert lc.misses == 2 and miss.tree == walk(other, False).tree


def test_a_slot_item_reads_its_bytes_from_the_block_when_asked(block_maker):
    """A slot's item keeps no view of its own (issue 23: 184 bytes a memoryview, 18 MB at 100,000 arrays):
    its ``data`` is the block's bytes at its slot, read when asked, so it sees what the block holds then."""
    state = tiny_state()
    got = capture(state, block_maker)
    view = block_maker.made[0].view
    items = [s.item(view) for s in got.plan.slots]
    for s, it in zip(got.plan.slots, items):
        assert isinstance(it, ArrayItem) and not hasattr(it, "__dict__")
        assert (it.name, it.kind, it.dtype, it.shape, it.nbytes) == (s.name, s.kind, s.dtype, s.shape, s.nbytes)
        assert bytes(it.data) == bytes(view[s.offset:s.offset + s.nbytes]) and len(it.data) == s.nbytes
    first = next(it for it in items if it.nbytes)
    slot = got.plan.slots[items.index(first)]
    view[slot.offset] ^= 0xFF  # the item reads the block now, not a copy taken when it was made
    assert bytes(first.data)[0] == view[slot.offset]
    view[slot.offset] ^= 0xFF


def test_giving_the_heap_back_is_safe_between_allocations():
    """``heap.give_back`` trims glibc's free pages (and says it could), or does nothing elsewhere; live
    objects are untouched by it."""
    keep = [bytearray(b"x" * 1000) for _ in range(1000)]
    dropped = [bytearray(1 << 20) for _ in range(16)]
    del dropped
    could = heap.give_back()
    assert could is (heap._trim is not None)
    if os.uname().sysname == "Linux" and os.path.exists("/lib/x86_64-linux-gnu/libc.so.6"):
        assert could  # glibc: the call is there
    assert all(b == b"x" * 1000 for b in keep)
