"""Hand a cut to tools that know only safetensors or torch.save files."""

from __future__ import annotations

import json
import os
from typing import Any

from .arrays import describe
from .errors import UsageError
from .format import encode_header, header_dtype
from .store import CutSelector, Store, rank_manifest
from .tree import flatten


def export_cut(store: Store, cut: CutSelector, path: str, *, fmt: str, allow_pickle_format: bool = False,
               rank: int | None = None) -> dict[str, Any]:
    """Writes one cut (verified on the way) to ``path`` as a single safetensors file (no pickle; the
    non-tensor structure goes into ``__metadata__["ckptstore_tree"]``) or a torch.save file (needs
    ``allow_pickle_format``, since torch.load unpickles).

    A cut of several ranks holds one state per rank: ``rank`` picks the one to export (its safetensors
    metadata then also names ``ckptstore_rank`` and ``ckptstore_world_size``); without it such a cut
    raises ``UsageError`` naming its world size."""
    if fmt not in ("safetensors", "torch"):
        raise UsageError(f"unknown export format {fmt!r}: use safetensors or torch", store=store.url)
    if fmt == "torch" and not allow_pickle_format:
        raise UsageError("the torch format is a pickle that torch.load unpickles; pass --allow-pickle-format "
                         "(allow_pickle_format=True) to export it anyway", store=store.url)
    whole = store.manifest(cut)
    m = rank_manifest(whole, rank, store.url)
    state = store.load(m.cut, allow_pickle=fmt == "torch" and allow_pickle_format, rank=rank)
    done = {"cut": m.cut, "format": fmt, "path": path, "world_size": whole.world_size, "rank": rank}
    tmp = f"{path}.tmp-{os.getpid()}"
    if fmt == "torch":
        import torch

        torch.save(state, tmp)
        os.replace(tmp, path)
        return {**done, "tensors": len(m.tensors)}
    tree, leaves = flatten(state)
    items = [describe(leaf) for leaf in leaves]
    meta = {"ckptstore_cut": m.cut, "ckptstore_step": str(m.step), "ckptstore_tree": json.dumps(tree)}
    if whole.world_size > 1:
        meta.update(ckptstore_rank=str(rank), ckptstore_world_size=str(whole.world_size))
    header = encode_header(
        [(it.name, *header_dtype(it.kind, it.dtype, it.shape, it.nbytes), it.nbytes) for it in items], meta)
    with open(tmp, "wb") as f:
        f.write(header)
        for it in items:
            f.write(it.data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {**done, "tensors": len(items)}
