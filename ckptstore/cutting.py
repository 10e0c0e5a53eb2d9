"""Beginning a cut and writing a rank's part of one; the writer lock as a helper inherits it; the shard
codec (moved out of store.py, issue 20). The writer, the rescue and DCP reach these through
:mod:`ckptstore.spi`; ``Store.begin_cut`` is the user's."""

from __future__ import annotations

from typing import Any

from . import layout
from .collect import ensure_recovered
from .core import Role, StoreCore
from .errors import UsageError
from .intent import ShardSpec
from .pending import PendingCut, RankPart
from .shards import Codec


def begin_cut(core: StoreCore, step: int, *, writer: str, cut: str | None, world_size: int,
              above_latest: bool = True) -> PendingCut:
    """See :meth:`ckptstore.Store.begin_cut`. ``above_latest=False`` lets the step be at or below
    LATEST's: a mirror's copy of an older cut, which ``PendingCut.commit_copy`` commits without moving
    LATEST (issue 21)."""
    core.require_writer("begin_cut")
    ensure_recovered(core)
    if above_latest:
        core.check_step(step)
    else:
        layout.check_step(step, store=core.url)
    if cut is None:
        cut = layout.new_cut_id(step)
    elif layout.check_cut_id(cut, store=core.url) and layout.step_of_cut_id(cut) != step:
        raise UsageError(f"cut id {cut} does not match step {step}", store=core.url, cut=cut)
    pending = PendingCut(core.protocol, core.storage, cut, step, writer, on_end=core.ended, world_size=world_size,
                         shards=ShardSpec.of(core.options), publishing=core.publishing)
    core.in_flight[cut] = pending
    try:
        core.own_dirs(layout.MARKS_DIR)
        core.protocol.mark(cut, step, writer)
    except BaseException:
        core.protocol.abandon(cut)
        core.in_flight.pop(cut, None)
        raise
    return pending


def lock_handoff(core: StoreCore) -> tuple[dict[str, Any], int | None]:
    """The writer lock as a helper process inherits it (``ckptstore.lock.InheritedLock``): a
    description and, for a flock, the descriptor to pass along (a handle that holds none: kind "none")."""
    if core.role is not Role.WRITER:
        return {"kind": "none"}, None
    return core.lock.handoff(), core.lock.lock_fd()


def group_rank_part(core: StoreCore, cut: str, step: int) -> RankPart:
    """This rank's share of cut ``cut`` that rank 0 marked (stores opened with ``group=``)."""
    core.require_writer("writing a rank's part", participant_ok=True)
    if core.ranks is None:
        raise UsageError("rank parts belong to stores opened with group=", store=core.url)
    return rank_part(core, cut, step, core.ranks.rank, core.ranks.size)


def rank_part(core: StoreCore, cut: str, step: int, rank: int, world_size: int, *,
              reader_ok: bool = False) -> RankPart:
    """Rank ``rank``'s share of cut ``cut`` of ``world_size`` ranks that a coordinator marked: a writer's
    or a participant's. A reader writes nothing, rank parts included (issue 20); ``reader_ok`` is the
    deprecated ``Store.rank_part_for``'s, which allowed it, for one release."""
    if core.closed:
        raise UsageError("writing a rank's part on a closed store", store=core.url)
    if core.role is Role.READER and not reader_ok:
        raise UsageError("writing a rank's part needs a writer or a participant (ckptstore.spi.open_participant); "
                         "this store was opened readonly", store=core.url, cut=cut)
    layout.check_cut_id(cut, store=core.url)
    for what, v, low in (("rank", rank, 0), ("world_size", world_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= layout.MAX_WORLD_SIZE:
            raise UsageError(f"{what} must be an int in [{low}, {layout.MAX_WORLD_SIZE}], got {v!r}", store=core.url)
    if rank >= world_size:
        raise UsageError(f"rank {rank} is outside world size {world_size}", store=core.url, cut=cut)
    if layout.step_of_cut_id(cut) != step:
        raise UsageError(f"cut id {cut} does not match step {step}", store=core.url, cut=cut)
    core.protocol.open_rank_dir(cut)
    return RankPart(core.protocol, core.storage, cut, step, rank, world_size, shards=ShardSpec.of(core.options))


def shard_codec(core: StoreCore) -> Codec:
    """How this store's shards are encoded (the one source of shard settings)."""
    return ShardSpec.of(core.options).make_codec()


__all__ = ["begin_cut", "group_rank_part", "lock_handoff", "rank_part", "shard_codec"]
