"""The states of bench_many (issue 23): N float32 tensors of 4 KB, in benchsmall's flat dict or in the
nested layout of a model state_dict plus an Adam optimizer state_dict. torch is imported lazily."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import benchsmall

LAYOUTS = ("flat", "nested")


@dataclass(frozen=True)
class ManyState:
    """A state of ``count`` 4 KB tensors, and those tensors in one list (what the floors copy and write)."""

    layout: str
    state: Any
    tensors: list[Any]
    nbytes: int

    @property
    def count(self) -> int:
        return len(self.tensors)

    def as_small(self) -> benchsmall.SmallState:
        """benchsmall's view of it (its save and load methods take the state as it is)."""
        return benchsmall.SmallState(self.state, self.nbytes)


def build_nested_state(count: int, seed: int = 1) -> dict[str, Any]:
    """``{"model": {...}, "optim": {"state": {i: {"exp_avg", "exp_avg_sq"}}, "param_groups": [...]},
    "step": int}`` as ``model.state_dict()`` and ``Adam.state_dict()`` lay it out (integer parameter ids,
    the ids listed again in param_groups), with count // 3 parameters each holding two moments, and the
    remainder as model buffers without optimizer state, so the state has exactly ``count`` tensors, all
    of benchsmall.ELEMS float32 elements. (Adam's per-parameter ``step`` tensor is left out: every tensor
    of the issue's state is 4 KB.)"""
    import torch

    g = torch.Generator().manual_seed(seed)
    params, buffers = count // 3, count % 3
    width = len(str(max(params, 1) - 1))
    n = benchsmall.ELEMS
    model: dict[str, Any] = {f"layers.{i:0{width}d}.weight": torch.randn(n, generator=g).mul_(0.02)
                             for i in range(params)}
    model.update({f"buffers.{j}.running_mean": torch.randn(n, generator=g) for j in range(buffers)})
    moments = {i: {"exp_avg": torch.randn(n, generator=g).mul_(1e-4),
                   "exp_avg_sq": torch.randn(n, generator=g).square_().mul_(1e-8)} for i in range(params)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(params))}]
    return {"model": model, "optim": {"state": moments, "param_groups": groups}, "step": 12000}


def nested_tensors(state: dict[str, Any]) -> list[Any]:
    out = list(state["model"].values())
    for moments in state["optim"]["state"].values():
        out.extend(moments.values())
    return out


def build(layout: str, count: int) -> ManyState:
    """The state of ``layout`` ("flat": benchsmall.build_small_state; "nested": :func:`build_nested_state`)."""
    if layout == "flat":
        s = benchsmall.build_small_state(count)
        tensors = list(s.state.values())
        state: Any = s.state
    elif layout == "nested":
        state = build_nested_state(count)
        tensors = nested_tensors(state)
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return ManyState(layout, state, tensors, sum(t.numel() * t.element_size() for t in tensors))


def check_roundtrip(s: ManyState, out: Any) -> None:
    """``out`` (a load of ``s``) holds the same tensors, bit for bit, and the same plain values."""
    import torch

    if s.layout == "flat":
        benchsmall.check_roundtrip(s.as_small(), out)
        return
    got = nested_tensors(out)
    assert len(got) == s.count, (len(got), s.count)
    assert all(torch.equal(a, b) for a, b in zip(got, s.tensors))
    assert out["optim"]["param_groups"] == s.state["optim"]["param_groups"]
    assert out["step"] == s.state["step"]
