"""A save's flatten (issue 23): leaves are named from their container's prefix, a storage's identities
are recorded only once a second tensor over it is met, sequences of ints are encoded in one pass, and
the plain tensors are described on the way (``Leaf.item``). Each shortcut must give what the general
path gives: the names ``nodes.key_path`` defines (made unique with ``~~n`` in tree order, a tied tensor
reserving none), the nodes the per-value encoder makes, and the items ``describe`` makes; the shard
writer's spans and shard plan are those of the greedy loops they replace."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore import Store
from ckptstore.arrays import ArrayItem, describe, describe_all, plain_describer
from ckptstore.errors import UnsupportedValue
from ckptstore.shardwrite import BATCH, GATHER_BELOW, _spans, file_order, plan_shards
from ckptstore.tree import MAX_DEPTH, MAX_JSON_INT_BITS, Leaf, flatten, key_path
from ckptstore.tree.encode import walk


def reference_names(paths: list[tuple[Any, ...]]) -> list[str]:
    """Leaf names by the definition: each leaf's key path, ``~~n`` appended from 2 on while taken."""
    taken: set[str] = set()
    out = []
    for path in paths:
        base = key_path(path)
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}~~{n}"
        taken.add(name)
        out.append(name)
    return out


def test_leaf_names_are_the_key_paths_of_the_definition(tmp_path) -> None:
    t = [torch.full((2,), float(i)) for i in range(12)]
    state = {
        "": t[0],  # the root's empty key: "<root>"
        "a/b": t[1], "x~y": t[2], "a": {"": t[3], "b": t[4], 7: t[5]},
        1: t[6], "1": t[7],  # the same key path twice: the second gets "~~2"
        "seq": [t[8], (t[9], {"k/": t[10]})],
        "<root>": t[11],  # the name the empty key took: "<root>~~2"
    }
    paths = [("",), ("a/b",), ("x~y",), ("a", ""), ("a", "b"), ("a", 7), (1,), ("1",), ("seq", 0),
             ("seq", 1, 0), ("seq", 1, 1, "k/"), ("<root>",)]
    tree, leaves = flatten(state)
    assert [lf.name for lf in leaves] == reference_names(paths)
    assert [lf.obj for lf in leaves] == t
    url = str(tmp_path / "s")
    with Store.open(url, create=True) as st:
        st.save(state, step=1)
    back = ckptstore.load(url)
    assert torch.equal(back[""], t[0]) and torch.equal(back["a"][7], t[5]) and torch.equal(back["1"], t[7])
    assert torch.equal(back["seq"][1][1]["k/"], t[10]) and torch.equal(back["<root>"], t[11])


def test_a_tied_tensor_reserves_no_name_and_names_its_first() -> None:
    w, u = torch.randn(4), torch.randn(4)
    tree, leaves = flatten({"a": w, 1: w, "1": u})  # key 1 is tied to "a": "1" stays free for u
    assert [lf.name for lf in leaves] == ["a", "1"]
    assert [item["v"]["name"] for item in tree["items"]] == ["a", "a", "1"]
    # Tied to a tensor that is not the first over its storage (a new view object, same identity).
    base = torch.arange(10.0)
    tree, leaves = flatten({"w": base, "v": base[2:], "again": base[2:], "other": base[2:].clone()})
    names = [item["v"]["name"] for item in tree["items"]]
    assert names[1] == names[2] and len(leaves) == 2  # w and its view share one array; the clone is its own
    assert tree["items"][1]["v"]["view"] == tree["items"][2]["v"]["view"] == {"offset": 2, "shape": [8], "stride": [1]}


def test_sequences_of_ints_encode_as_the_per_value_encoder_does() -> None:
    big = 1 << (MAX_JSON_INT_BITS + 1)
    tree, _ = flatten({"ids": list(range(5)), "mixed": [1, True, big, -3], "wide": (big,), "empty": []})
    items = {item["k"]: item["v"] for item in tree["items"]}
    assert items["ids"] == {"t": "list", "items": [{"t": "int", "v": i} for i in range(5)]}
    assert items["mixed"]["items"] == [{"t": "int", "v": 1}, {"t": "bool", "v": True}, {"t": "int", "hex": hex(big)},
                                       {"t": "int", "v": -3}]
    assert items["wide"] == {"t": "tuple", "items": [{"t": "int", "hex": hex(big)}]}
    assert items["empty"] == {"t": "list", "items": []}


def nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


@pytest.mark.parametrize("container", ["dict", "list"])
def test_the_depth_bound_holds_for_tensors_in_every_container(container: str) -> None:
    t = torch.ones(2)
    inner = [t] if container == "list" else {"k": t}
    flatten(nested(MAX_DEPTH - 1, inner))  # the tensor sits at depth MAX_DEPTH: stored
    with pytest.raises(UnsupportedValue, match="nested deeper"):
        flatten(nested(MAX_DEPTH, inner))


def test_a_quantized_tensor_is_refused_or_pickled_as_before() -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedValue, match="'q'"):
        flatten({"q": q})
    tree, leaves = flatten({"q": q}, allow_pickle=True)
    assert leaves == [] and tree["items"][0]["v"]["t"] == "pickle"


def test_a_save_flatten_describes_each_plain_tensor_as_describe_does() -> None:
    cases = {
        "contiguous": torch.randn(3, 4), "empty": torch.empty(0, 5), "scalar": torch.tensor(1.5),
        "transposed": torch.randn(5, 6).t(), "grad": torch.randn(4, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(7)), "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "bf16": torch.randn(8).to(torch.bfloat16), "offset": torch.arange(10)[2:7], "bool": torch.tensor([True]),
        "channels_last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last), "np": np.arange(5),
        "f8": torch.randn(6).to(torch.float8_e5m2), "c128": torch.randn(2, dtype=torch.complex128),
    }
    f = walk(cases, False, plain_describer())
    described = {lf.name for lf in f.leaves if lf.item is not None}
    # The plain contiguous CPU tensors with elements are described on the way; the rest later.
    assert described == {"contiguous", "scalar", "grad", "param", "bf16", "offset", "bool", "f8", "c128"}
    fresh = describe_all([Leaf(lf.name, lf.kind, lf.obj) for lf in f.leaves])
    for got, want in zip(describe_all(f.leaves), fresh):
        assert (got.name, got.kind, got.dtype, got.shape, got.nbytes) == (want.name, want.kind, want.dtype,
                                                                          want.shape, want.nbytes)
        assert got.data.format == "B" and bytes(got.data) == bytes(want.data)
    assert describe(f.leaves[0]) is f.leaves[0].item
    tree, leaves = flatten(cases)  # no describer: no items
    assert all(lf.item is None for lf in leaves) and tree == f.tree


def test_merged_views_are_described_from_their_span_not_from_a_member() -> None:
    w = torch.arange(12.0)
    f = walk({"w": w[2:], "v": w[:6]}, False, plain_describer())
    [leaf] = f.leaves
    assert leaf.item is None  # share_storages' span view is a new leaf
    [item] = describe_all(f.leaves)
    assert bytes(item.data) == w[:12].numpy().tobytes()


def reference_spans(sizes: list[int]) -> list[tuple[int, int, int | None]]:
    """The greedy loop ``_spans`` replaces (issue 23's first bulk write)."""
    out: list[tuple[int, int, int | None]] = []
    i = 0
    while i < len(sizes):
        if sizes[i] >= GATHER_BELOW:
            out.append((i, i + 1, None))
            i += 1
            continue
        j, run = i, 0
        while j < len(sizes) and sizes[j] < GATHER_BELOW and run + sizes[j] <= BATCH:
            run += sizes[j]
            j += 1
        out.append((i, j, run))
        i = j
    return out


def test_write_spans_and_shard_plans_are_those_of_the_greedy_loops() -> None:
    rng = random.Random(3)
    choices = [0, 1, 4096, GATHER_BELOW - 1, GATHER_BELOW, 3 * GATHER_BELOW, BATCH // 3]
    for _ in range(300):
        sizes = [rng.choice(choices) for _ in range(rng.randrange(0, 60))]
        assert list(_spans(sizes)) == reference_spans(sizes)
        items = [ArrayItem(str(i), "numpy", "|u1", (n,), n, memoryview(b"")) for i, n in enumerate(sizes)]
        limit = rng.choice([1, GATHER_BELOW, BATCH, sum(sizes) or 1, 1 << 40])
        want: list[list[ArrayItem]] = [[]]
        size = 0
        for it in items:
            if want[-1] and size + it.nbytes > limit:
                want.append([])
                size = 0
            want[-1].append(it)
            size += it.nbytes
        assert plan_shards(items, limit) == want
        assert file_order(items) == sorted(items, key=lambda it: it.nbytes % 4096 != 0)
