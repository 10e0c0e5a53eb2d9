"""Resume tooling: build the state of a training loop, restore it into live objects, choose the cut.

``training_state`` gathers what an exact continuation needs: module, optimizer, LR scheduler and
gradient-scaler state dicts, the torch (CPU and CUDA), numpy and python RNG states, the step and any
user metadata (data-loader position, sample counters). ``restore`` loads a cut and puts all of it back;
with ``fallback=True`` it walks back past cuts that fail verification, records them in ``bad/`` so a
restart never tries them again, and points LATEST at the cut it resumed from so the next save continues
from there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .errors import CutNotFound
from .info import CutInfo
from .store import Store


def capture_rng() -> dict[str, Any]:
    """The RNG states of torch (CPU, and every initialized CUDA device), numpy's global generator and
    python's ``random``."""
    import numpy as np
    import torch

    out: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(rng: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def training_state(
    *,
    step: int,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
) -> dict[str, Any]:
    """A state dict for ``save``/``maybe_cut`` holding everything an exact continuation needs."""
    state: dict[str, Any] = {"step": step, "extra": dict(extra or {})}
    for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            state[key] = obj.state_dict()
    if rng:
        state["rng"] = capture_rng()
    return state


@dataclass(frozen=True)
class Resumed:
    """Where a run resumed: the cut, its step, the user's ``extra`` and the cuts skipped (id -> why)."""

    cut: CutInfo
    step: int
    extra: dict[str, Any]
    state: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)


def restore(
    url_or_store: str | Store,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    fallback: bool = False,
    map_location: Any = "cpu",
    rng: bool = True,
) -> Resumed | None:
    """Loads the cut to resume from into the live objects; None for an empty store.

    With ``fallback`` and a writable store, a cut that fails verification is recorded bad and LATEST is
    pointed at the cut resumed from, so the run's next cuts continue from there.
    """
    own = isinstance(url_or_store, str)
    store = Store.open(url_or_store, create=True) if own else url_or_store  # type: ignore[arg-type]
    try:
        latest = store.classify().latest
        info, skipped = store.choose(fallback=fallback)
        if info is None:
            return None
        state = store.load(info.id, map_location=map_location)
        if fallback and not store.readonly and (latest is None or latest.cut != info.id):
            store.point_latest(info.id)
        for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                if key not in state:
                    raise CutNotFound(f"cut has no {key!r} state to restore", store=store.url, cut=info.id)
                obj.load_state_dict(state[key])
        if rng and "rng" in state:
            restore_rng(state["rng"])
        return Resumed(cut=info, step=int(state.get("step", info.step)), extra=dict(state.get("extra", {})),
                       state=state, skipped=skipped)
    finally:
        if own:
            store.close()
