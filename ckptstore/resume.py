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

from .errors import CutNotFound, DataError, LatestError, StorageError
from .events import log
from .info import CutInfo
from .recovery import Classification
from .store import Store
from .verify import verify_store


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


def choose_cut(store: Store, *, fallback: bool, record: bool) -> tuple[CutInfo | None, dict[str, str], Classification]:
    """The newest committed cut to resume from. Without ``fallback`` it is LATEST's target, verified
    (a failure raises). With it, cuts recorded bad are skipped outright and cuts that fail verification
    are skipped (and, with ``record``, recorded bad)."""
    cls = store.classify()
    if cls.latest_problem is not None and not fallback:
        raise LatestError(cls.latest_problem, store=store.url, hint=f"run `ckptstore repair {store.url}`")
    if not cls.committed:
        return None, {}, cls
    skipped: dict[str, str] = {}
    if not fallback:
        m = cls.find(cls.latest.cut) if cls.latest else None
        if m is None:
            return None, {}, cls
        report = verify_store(store.storage, cls, cut=m.cut)
        if not report.ok:
            f = report.errors[0]
            raise DataError(f"LATEST cut fails verification: {f.message}", store=store.url, cut=m.cut, path=f.path,
                            hint="load(..., fallback=True) resumes from the newest cut that verifies")
        return CutInfo.from_manifest(m), skipped, cls
    latest_step = cls.latest.step if cls.latest else None
    for m in reversed(cls.committed):
        if latest_step is not None and m.step > latest_step and m.cut not in cls.bad:
            skipped[m.cut] = "newer than LATEST"
            continue
        if m.cut in cls.bad:
            skipped[m.cut] = "recorded bad by an earlier load"
            continue
        report = verify_store(store.storage, cls, cut=m.cut)
        errors = [f for f in report.errors if not f.kind.startswith("latest-")]
        if errors:
            skipped[m.cut] = f"{errors[0].kind}: {errors[0].message}"
            if record:
                # Readers record too (``load(url, fallback=True)`` opens one): ``bad/`` is add-only, and
                # without the record every restart re-verifies the bad cut.
                try:
                    store.record_bad(m.cut, skipped[m.cut])
                except StorageError as exc:
                    if not store.readonly:
                        raise
                    log.warning("ckptstore: could not record bad cut %s of %s: %s", m.cut, store.url, exc)
            continue
        return CutInfo.from_manifest(m), skipped, cls
    raise CutNotFound("no committed cut verifies", store=store.url, hint=f"skipped: {skipped}")


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
        info, skipped, cls = choose_cut(store, fallback=fallback, record=True)
        if info is None:
            return None
        state = store.load(info.id, map_location=map_location)
        if fallback and not store.readonly and (cls.latest is None or cls.latest.cut != info.id):
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
