"""Resume tooling: build the state of a training loop, restore it into live objects, choose the cut.

``training_state`` gathers what an exact continuation needs: module, optimizer, LR scheduler and
gradient-scaler state dicts, the torch (CPU and CUDA), numpy and python RNG states, the step and any
user metadata (data-loader position, sample counters). ``restore`` loads a cut and puts all of it back;
with ``fallback=True`` it walks back past cuts that fail verification, records them in ``bad/`` so a
restart never tries them again, and points LATEST at the cut it resumed from so the next save continues
from there.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from .core import Role, StoreCore
from .errors import CkptStoreError, CutNotFound, UsageError
from .events import log
from .info import CutInfo
from .collective import Collective
from . import reading, spi, tierparts, writeback
from .manifest import Manifest
from .options import StoreOptions
from .store import Store, core_of


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
    """Where a run resumed: the cut, its step, the user's ``extra``, the cuts skipped (id -> why) and the
    ``tier`` whose verified copy it resumed from ("local", or "mirror": issue 21). ``write_back``: a cut
    restored from the mirror that the local tier lacked, being written back there behind the restore
    (``wait(timeout)`` returns the local ``CutInfo`` or raises what stopped it); None when nothing is."""

    cut: CutInfo
    step: int
    extra: dict[str, Any]
    state: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)
    tier: str = "local"
    write_back: writeback.WriteBack | None = field(default=None, compare=False)


def restore(
    url_or_store: str | os.PathLike[str] | Store,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    fallback: bool = False,
    map_location: Any = "cpu",
    rng: bool = True,
    group: Any = None,
    rank_timeout: float | None = None,
    allowed_types: Sequence[type] | None = None,
    files_to: str | os.PathLike[str] | None = None,
    mirror: str | os.PathLike[str] | None = None,
    mirror_options: StoreOptions | None = None,
) -> Resumed | None:
    """Loads the cut to resume from into the live objects; None for an empty store.

    With ``fallback`` and a writable store, a cut that fails verification is recorded bad and LATEST is
    pointed at the cut resumed from, so the run's next cuts continue from there. DTensors (FSDP2,
    tensor parallel) are copied back into the model's and optimizer's own DTensors, which needs the
    layout of the save (a different one raises ``UsageError`` naming the key).

    With ``group`` (or a store opened with ``group=``) it is collective: rank 0 chooses the cut
    (fallback decisions included), every rank restores its own part of it, and every rank raises if
    any rank failed. The cut's world size must be the group's. With a mirror too, the ranks agree on
    the newest cut whose every part verifies in some tier, and each rank reads its part from the tier
    that holds a verified copy of it (:mod:`ckptstore.tierparts`).

    ``allowed_types`` names the user classes (enums, dataclasses, namedtuples) the state's values may
    come back as (see :func:`ckptstore.load`).

    ``files_to``: put the files attached to the cut (``files=``) back under this directory
    (``Store.restore_files``: this rank's, replacing what is there), after the state was restored.

    ``mirror`` (with a URL; a ``Store`` brings its own, ``Store.open(mirror=)``): the store's mirror tier
    (issue 21): the newest cut that verifies in either tier (docs/resume.md, "Two tiers"), a mirror's read
    once, verified as it loads, and written back into a local tier that lacks it in the background
    (``Resumed.write_back``; the store's close waits for it, bounded, so a URL's waits here)."""
    own = not isinstance(url_or_store, Store)  # a str, a pathlib.Path (issue 19 item 11); Store.open checks the rest
    if not own and mirror is not None:
        raise UsageError("mirror= goes with a URL; open the store with Store.open(url, mirror=...) instead",
                         store=url_or_store.url)
    store = Store.open(url_or_store, create=True, group=group, rank_timeout=rank_timeout, mirror=mirror,
                       mirror_options=mirror_options) if own else url_or_store
    try:
        if group is not None and store.ranks is None and _group_size(group) > 1:
            raise UsageError("restore(group=) needs a store opened with the same group= (or a URL)", store=store.url)
        objs = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        if store.ranks is None:
            return _restore_one(store, fallback, objs, map_location, rng, allowed_types, files_to)
        with store.ranks.busy():  # beating while rank 0 chooses (fallback verifies) and each rank loads
            if store.mirror is not None:
                return _restore_ranks_tiers(store, fallback, objs, map_location, rng, allowed_types, files_to)
            return _restore_ranks(store, fallback, objs, map_location, rng, allowed_types, files_to)
    finally:
        if own:
            store.close()


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _restore_one(store: Store, fallback: bool, objs: dict[str, Any], map_location: Any, rng: bool,
                 allowed_types: Sequence[type] | None, files_to: str | os.PathLike[str] | None) -> Resumed | None:
    """One process's restore: the cut chosen in either tier, read from the tier that holds it. A mirror
    copy is loaded as its check (one download, tapped into the write-back: ``writeback.MirrorLoad``)."""
    mirror = None if store.mirror is None else writeback.MirrorLoad(
        core_of(store), core_of(store.mirror), map_location=map_location, allowed_types=allowed_types)
    chosen = _choose(store, fallback, mirror)
    if chosen.info is None:
        return None
    loaded = mirror.take(chosen.info.id) if mirror is not None and chosen.tier == "mirror" else None
    m = reading.named_manifest(chosen.core, chosen.info.id)
    resumed = _restore_part(chosen.core, m, chosen.info, chosen.skipped, None, objs, map_location, rng, allowed_types,
                            files_to, tier=chosen.tier, state=None if loaded is None else loaded.state)
    return resumed if loaded is None else replace(resumed, write_back=loaded.write_back)


def _choose(store: Store, fallback: bool, mirror: writeback.MirrorLoad | None = None) -> reading.Chosen:
    """The cut to resume from, in either tier (issue 21; ``mirror`` checks the mirror's copies by loading
    them). With ``fallback`` LATEST is pointed at the cut resumed from, so the next cuts continue from
    its step (a local LATEST on a newer, damaged cut would refuse them with ``StepConflict``)."""
    core = core_of(store)
    latest = core.classify().latest
    chosen = reading.choose_tiers(core, None if store.mirror is None else core_of(store.mirror), fallback=fallback,
                                  mirror_check=None if mirror is None else mirror.check)
    if chosen.info is None or store.readonly or not fallback or (latest is not None and latest.cut == chosen.info.id):
        return chosen
    held = chosen.tier == "local"  # the local tier holds the cut (a copy recorded bad there counts)
    if not held and store.role is Role.WRITER:
        held = core.classify().find(chosen.info.id) is not None
    if held:
        spi.point_latest(store, chosen.info.id)
    elif latest is not None and latest.step > chosen.info.step and mirror is not None:
        _point_after_write_back(store, mirror, chosen.info.id)
    return chosen


def _point_after_write_back(store: Store, mirror: writeback.MirrorLoad, cut: str) -> None:
    """LATEST names a newer cut than the one resumed from (its copies proven damaged): the next cut's
    step check would refuse the run's next steps. So here the restore waits for the write-back (the
    one case it does, bounded) and points LATEST back at the cut; a write-back that failed leaves
    LATEST where it was, with a warning."""
    loaded = mirror.peek(cut)
    if loaded is None or loaded.write_back is None:
        return
    try:
        loaded.write_back.wait(writeback.CLOSE_WAIT_S)
    except (CkptStoreError, OSError) as exc:
        log.warning("ckptstore: LATEST of %s stays on a newer cut than %s (not written back: %s)", store.url, cut, exc)
        return
    spi.point_latest(store, cut)


def _restore_ranks(store: Store, fallback: bool, objs: dict[str, Any], map_location: Any, rng: bool,
                   allowed_types: Sequence[type] | None, files_to: str | os.PathLike[str] | None) -> Resumed | None:
    ranks = store.ranks
    assert ranks is not None
    c = Collective(ranks, store=store.url)

    def choose() -> dict[str, Any]:
        chosen = _choose(store, fallback)
        return {"cut": chosen.info.id if chosen.info else None, "skipped": chosen.skipped}

    chosen = c.coordinate("restore-choose", choose, doing="to choose the cut to resume from")
    if chosen["cut"] is None:
        return None
    c.at(cut=chosen["cut"])

    def restore_part() -> Resumed:
        # Rank 0 classified the store to choose the cut; every rank reads the one manifest it named, so
        # no other rank lists the store (issue 24).
        m = reading.named_manifest(core_of(store), chosen["cut"])
        if m.world_size != ranks.size:
            raise UsageError(f"cut {m.cut} holds {m.world_size} rank(s) but this job has {ranks.size}; a per-rank "
                             "restore needs the world size of the save (resharding needs the DCP reader)",
                             store=store.url, cut=m.cut)
        return _restore_part(core_of(store), m, CutInfo.from_manifest(m), dict(chosen["skipped"]), ranks.rank, objs,
                             map_location, rng, allowed_types, files_to)

    return c.all("restore-done", restore_part, doing=f"restoring cut {chosen['cut']}")


def _restore_ranks_tiers(store: Store, fallback: bool, objs: dict[str, Any], map_location: Any, rng: bool,
                         allowed_types: Sequence[type] | None,
                         files_to: str | os.PathLike[str] | None) -> Resumed | None:
    """A restore of several ranks across a mirror tier (issue 21, "Several ranks"): the group agrees on
    the newest cut whose every part verifies in some tier, and each rank reads its part from the tier
    whose copy of it verified (:mod:`ckptstore.tierparts`): rank 1's local copy may be gone while rank
    0's is fine. With ``fallback`` rank 0 then points the local LATEST at the cut when the local tier
    holds it, as a restore of one process does."""
    ranks = store.ranks
    assert ranks is not None and store.mirror is not None
    cores = {"local": core_of(store), "mirror": core_of(store.mirror)}
    c = Collective(ranks, store=store.url)
    plan = c.coordinate("restore-choose", lambda: tierparts.candidates(cores, fallback=fallback),
                        doing="to list the cuts to resume from in either tier")
    chosen = tierparts.agree(ranks, cores, plan, fallback=fallback, store=store.url)
    if chosen is None:
        return None
    c.at(cut=chosen.cut)
    tier = chosen.tiers[ranks.rank]

    def restore_part() -> Resumed:
        if fallback and ranks.rank == 0 and store.role is Role.WRITER:
            cls = cores["local"].classify()
            if cls.find(chosen.cut) is not None and (cls.latest is None or cls.latest.cut != chosen.cut):
                spi.point_latest(store, chosen.cut)
        m = reading.named_manifest(cores[tier], chosen.cut)
        return _restore_part(cores[tier], m, CutInfo.from_manifest(m), dict(chosen.skipped), ranks.rank, objs,
                             map_location, rng, allowed_types, files_to, tier=tier)

    return c.all("restore-done", restore_part, doing=f"restoring cut {chosen.cut}")


def _restore_part(core: StoreCore, m: Manifest, info: CutInfo, skipped: dict[str, str], rank: int | None,
                  objs: dict[str, Any], map_location: Any, rng: bool, allowed_types: Sequence[type] | None,
                  files_to: str | os.PathLike[str] | None = None, tier: str = "local", state: Any = None) -> Resumed:
    """Restores this rank's part of the chosen cut ``m`` (its manifest, read once: no rank classifies
    the store again to find it) from ``core``, the handle of the tier that holds it; ``state``: that
    part already loaded (and verified) by the choice, not read again."""
    from .dtensors import node_at, restore_into

    mine = reading.rank_manifest(m, rank, core.url, core.storage, core.parts)  # what load(rank=rank) reads
    part = mine if m.world_size > 1 or rank is not None else m.for_rank(0)
    if state is None:
        state = reading.load_part(core, mine, map_location=map_location, verify=True, keys=None, allow_pickle=False,
                                  allowed_types=allowed_types)
    where = {"store": core.url, "cut": info.id}
    for key, obj in objs.items():
        if obj is not None:
            if not isinstance(state, dict) or key not in state:
                raise CutNotFound(f"cut has no {key!r} state to restore", **where)
            if key in ("model", "optimizer"):
                restore_into(obj, state[key], where=where, tree=node_at(part.tree, key), prefix=(key,))
            else:
                obj.load_state_dict(state[key])
    if rng and isinstance(state, dict) and "rng" in state:
        restore_rng(state["rng"])
    if files_to is not None:
        reading.restore_part_files(core, mine, files_to, overwrite=True, verify=True)
    return Resumed(cut=info, step=int(state.get("step", info.step)), extra=dict(state.get("extra", {})),
                   state=state, skipped=skipped, tier=tier)
