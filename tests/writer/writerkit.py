"""Helpers shared by the writer tests: an event log that can be waited on, small states, and /proc
readers for processes, threads, file descriptors and memory (no psutil: /proc is the ground truth)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ckptstore import Store
from prockit import has_exited  # noqa: F401 - re-exported for the tests

from fault_worker import inject as inject_fault  # noqa: E402,F401 - re-exported for the tests


#: Upper bound for anything that should take well under a second here; generous for a loaded 2-core box.
BOUND = 30.0


class EventLog:
    """An ``on_event`` sink that records every event and lets a test wait for one (bounded)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def __call__(self, event: dict[str, Any]) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]

    def kinds(self, **match: Any) -> list[str]:
        with self._cond:
            return [e["event"] for e in self.events if all(e.get(k) == v for k, v in match.items())]

    def wait_for(self, kind: str, timeout: float = BOUND, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self.events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {kind!r} event matching {match} within {timeout} s; saw "
                                         f"{[(e['event'], e.get('step')) for e in self.events]}")
                self._cond.wait(left)


def small_state(seed: float = 0.0, n: int = 4, numel: int = 4096) -> dict[str, Any]:
    """A few KB-sized CPU tensors, a numpy array and plain values. Several arrays, so a fault injected
    "mid-shard" (after half the bytes) really lands between arrays of one shard."""
    state: dict[str, Any] = {
        f"layer{i}": torch.arange(numel, dtype=torch.float32) + seed + i for i in range(n)
    }
    state["opt"] = {"exp_avg": torch.full((17, 3), seed, dtype=torch.float64), "count": torch.tensor(7 + int(seed))}
    state["rng"] = np.arange(33, dtype=np.int64) + int(seed)
    state["step_note"] = f"seed={seed}"
    return state


def assert_state_equal(loaded: Any, expected: Any, path: str = "") -> None:
    """Bit-exact structural equality of a loaded state with an expected one."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), path
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape, path
        assert torch.equal(loaded.cpu(), expected.cpu()), f"tensor {path} differs"
    elif isinstance(expected, np.ndarray):
        assert isinstance(loaded, np.ndarray), path
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape, path
        assert np.array_equal(loaded, expected), f"array {path} differs"
    elif isinstance(expected, dict):
        assert isinstance(loaded, dict) and set(loaded) == set(expected), path
        for k in expected:
            assert_state_equal(loaded[k], expected[k], f"{path}/{k}")
    else:
        assert loaded == expected, path


def clone_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    return state


def mutate_in_place(state: Any) -> None:
    """Adds 1.0 to every tensor and numpy array of ``state`` in place (the next training step)."""
    for v in state.values():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            v += 1
        elif isinstance(v, dict):
            mutate_in_place(v)


def check_store(url: str) -> Store:
    """Opens ``url`` readonly and asserts the store invariant: LATEST fine, every cut verifies."""
    store = Store.open(url, readonly=True)
    cls = store.classify()
    assert cls.latest_problem is None, cls.latest_problem
    report = store.verify()
    assert report.ok, report
    return store


def wait_until(pred: Callable[[], bool], timeout: float = BOUND, what: str = "condition") -> None:
    """Polls a condition with a deadline (a bounded wait on state we cannot block on)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------ /proc
def proc_nice(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[16])  # field 19 of stat(5); fields here start at field 3


def child_pids(pid: int | None = None) -> set[int]:
    pid = os.getpid() if pid is None else pid
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
        except FileNotFoundError:
            continue
        out |= {int(x) for x in text.split()}
    return out


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
