"""The store invariant after a crash, checked on a real directory (issue 5):

1. the store opens for reading without repair, and for writing after the automatic cleanup;
2. LATEST names a committed cut that verifies, and loading it gives exactly the state saved at its step;
3. no cut reported committed before the crash is lost: LATEST's step >= that cut's step;
4. every leftover is classified, and the writer open (gc) removes it; foreign files stay;
5. the next save into the same store works.
"""

from __future__ import annotations

import os

import numpy as np

import ckptstore
from ckptstore import layout


class InvariantBroken(AssertionError):
    pass


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if hasattr(a, "dtype") and hasattr(a, "shape") and type(a).__module__.startswith("torch"):
        import torch

        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def check_invariant(root: str, saved: dict[int, dict], committed_before: int | None, *, next_step: int) -> int | None:
    """Checks the invariant on the store at ``root``; ``saved`` maps step -> the state saved at it;
    ``committed_before`` is the highest step whose save had returned before the crash. Returns the step
    LATEST names (None for an empty store)."""
    foreign = os.path.join(root, "operator-notes.txt")
    if os.path.exists(os.path.join(root, layout.STORE_FILE)):
        with open(foreign, "w") as f:
            f.write("not the store's")
    try:
        with ckptstore.Store.open(root, readonly=True) as reader:
            cls = reader.classify()
            if cls.latest_problem is not None:
                raise InvariantBroken(f"LATEST broken after crash: {cls.latest_problem}")
            latest = reader.latest()
            report = reader.verify()
            if not report.ok:
                raise InvariantBroken(f"verify failed after crash: {[f.message for f in report.errors]}")
            kinds = {lo.kind for lo in cls.leftovers}
            if not kinds <= {"in-progress", "abandoned", "stale-mark", "temp-file", "orphan-mark"}:
                raise InvariantBroken(f"unclassified leftovers {kinds}")
    except ckptstore.StoreNotFound:
        if committed_before is not None:
            raise InvariantBroken("store vanished although a cut was committed") from None
        with ckptstore.Store.open(root, create=True) as writer:  # a half-created store is finished
            writer.save({"next": np.arange(3)}, step=next_step)
        return None
    step = latest.step if latest is not None else None
    if committed_before is not None and (step is None or step < committed_before):
        raise InvariantBroken(f"committed step {committed_before} lost: LATEST is {step}")
    if latest is not None:
        if step not in saved:
            raise InvariantBroken(f"LATEST names step {step}, which was never saved")
        # A cut of several ranks was saved as a list of per-rank states; each rank loads its own.
        per_rank = saved[step] if isinstance(saved[step], list) else None
        if per_rank is not None and latest.world_size != len(per_rank):
            raise InvariantBroken(f"LATEST's cut holds {latest.world_size} ranks, {len(per_rank)} were saved")
        for rank, want in enumerate(per_rank or [saved[step]]):
            state = ckptstore.load(root, rank=rank if per_rank is not None else None)
            if not _equal(want, state):
                raise InvariantBroken(f"loaded state of rank {rank} differs from what was saved at step {step}")
    with ckptstore.Store.open(root) as writer:  # recovery + gc
        cls = writer.classify()
        if cls.leftovers:
            raise InvariantBroken(f"leftovers after recovery: {cls.leftovers}")
        if not os.path.exists(foreign):
            raise InvariantBroken("a foreign file was deleted")
        writer.save({"next": np.arange(3)}, step=next_step)
        if writer.latest().step != next_step or not writer.verify().ok:
            raise InvariantBroken("the next save after recovery did not commit cleanly")
    stray = [n for n in os.listdir(os.path.join(root, layout.MARKS_DIR))]
    if stray:
        raise InvariantBroken(f"marks left after a clean save: {stray}")
    return step
