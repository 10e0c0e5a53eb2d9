"""The many-small-tensors case of bench_store: N float32 tensors of 1024 elements (4 KB) each, in one flat dict.

What it stresses is the per-tensor cost (manifest records, header entries, one slot per tensor), not the
disk: at the default 40,000 tensors the payload is only 164 MB. The methods here are plain functions of a
directory and the state; bench_store times them (settle, fsync, rotation, drop_caches) as it does its main
case, and its main case uses the DCP save and the loads too (one copy of each, issue 20). torch is imported
lazily.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Callable

from benchstate import fsync_path

ELEMS = 1024  # float32: 4 KB per tensor, exactly one page
DEFAULT_COUNT = 40_000


@dataclass(frozen=True)
class SmallState:
    state: dict[str, Any]  # flat {name: tensor}: safetensors, DCP and ckptstore all take it as is
    nbytes: int

    @property
    def count(self) -> int:
        return len(self.state)


def build_small_state(count: int, seed: int = 1) -> SmallState:
    """``count`` independent float32 tensors of ELEMS elements (each owns its storage: safetensors refuses
    tensors that share one)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    width = len(str(count - 1))
    state = {f"block.{i:0{width}d}.param": torch.randn(ELEMS, generator=g) for i in range(count)}
    return SmallState(state, count * ELEMS * 4)


# ------------------------------------------------------------------------------------------ saves


def save_store(d: str, s: SmallState, step: int) -> Callable[[], None]:
    """store.save of the dict; Store.open is outside the timed call, as in the main case."""
    import ckptstore

    store = ckptstore.Store.open(d, create=True)

    def run() -> None:
        try:
            store.save(s.state, step=step)
        finally:
            store.close()

    return run


def save_safetensors(d: str, s: SmallState) -> Callable[[], None]:
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "state.safetensors")

    def run() -> None:
        save_file(s.state, path)
        fsync_path(path)
        fsync_path(d)

    return run


def save_dcp(d: str, state: Any) -> Callable[[], None]:
    """dcp.save of ``state`` without a process group (single-process mode), FileSystemWriter defaults, for
    both of bench_store's cases; FileSystemWriter fsyncs its files, the directory is fsynced here."""
    import torch.distributed.checkpoint as dcp

    def run() -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d))
        fsync_path(d)

    return run


# ------------------------------------------------------------------------------------------ loads


def load_store(d: str, *, verify: bool = True) -> Callable[[], Any]:
    import ckptstore

    return lambda: ckptstore.load(d, verify=verify)


def load_safetensors_materialized(path: str) -> Callable[[], Any]:
    """load_file, then a clone of every tensor: load_file may map the file lazily, and a load that has not
    touched the bytes has not loaded them."""
    from safetensors.torch import load_file

    def run() -> dict[str, Any]:
        lazy = load_file(path)
        out = {k: v.clone() for k, v in lazy.items()}
        del lazy
        return out

    return run


def check_roundtrip(s: SmallState, out: dict[str, Any]) -> None:
    import torch

    assert len(out) == s.count, (len(out), s.count)
    for k, v in s.state.items():
        assert torch.equal(out[k], v), k


def manifest_bytes(store_dir: str) -> int:
    """Size of the (single) committed cut's MANIFEST.json."""
    paths = glob.glob(os.path.join(store_dir, "cuts", "*", "MANIFEST.json"))
    if len(paths) != 1:
        raise RuntimeError(f"expected one manifest under {store_dir}, found {len(paths)}")
    return os.path.getsize(paths[0])
