"""``Store.save``: one path for one rank and for many (issue 20).

Four named steps over a :class:`~ckptstore.collective.Collective`, the shape of DCP's
``_save_state_dict``: prepare (every rank: its tree, arrays and attached files), begin (rank 0 marks the
cut and tells every rank its id), write (every rank: its shards, then its part: kept in memory for one
rank, a durable rank record for several), commit (rank 0: collect the parts, make the names durable,
manifest, LATEST). With one rank each step is a plain call; with several each is followed by one
exchange, so any rank's failure leaves LATEST where it was and raises on every rank at the same call.
The bytes on disk are those of the protocol's steps (:mod:`ckptstore.protocol`), whatever the world size.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Sequence

from .arrays import ArrayItem, describe_all, plain_describer
from .attached import AttachedFile, FilesArg, close_sources, open_sources
from .collective import Collective
from .core import StoreCore
from .cutting import begin_cut, group_rank_part
from .errors import StorageError, UsageError
from .info import CutInfo
from .intent import CutIntent
from .pending import PendingCut, RankPart
from .tree import has_pickle
from .tree.encode import walk


def save(store: StoreCore, state: Any, *, step: int, tags: Sequence[str], final: bool,
         metadata: dict[str, Any] | None, allow_pickle: bool, files: FilesArg | None) -> CutInfo:
    """See :meth:`ckptstore.Store.save`. ``store`` is the handle's core (:mod:`ckptstore.core`): this
    module never imports store.py, so the two form no import cycle."""
    store.require_writer("save", participant_ok=store.ranks is not None)
    c = Collective(store.ranks, store=store.url)
    rank = {"rank": c.rank, "world_size": c.size} if c.size > 1 else {}
    marks = [time.perf_counter()]  # start, prepared, written, committed
    with c.busy():
        try:
            info = _save(store, c, state, step=step, tags=tags, final=final, metadata=metadata,
                         allow_pickle=allow_pickle, files=files, marks=marks)
        except BaseException as exc:
            if len(marks) > 1:  # a cut was attempted (a state that cannot be stored is no cut)
                store.events.emit("failed", cut=c.where.get("cut"), step=step, error=str(exc),
                                  error_type=type(exc).__name__, **({"rank": c.rank} if c.size > 1 else {}))
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                # A raw OSError from below the storage seam still names the store and the cut.
                raise StorageError.from_os_error(exc, "saving", store=store.url, cut=c.where.get("cut"),
                                                 path=getattr(exc, "filename", None)) from exc
            raise
    t0, t_prep, t_write, t_end = marks
    timings = {"flatten": t_prep - t0, "write": t_write - t_prep, "commit": t_end - t_write, "total": t_end - t0}
    store.events.emit("committed", cut=info.id, step=step, bytes=info.nbytes, tensors=info.tensors, files=info.files,
                      timings=timings, writer_mode="sync", **rank)
    return info


def _save(store: StoreCore, c: Collective, state: Any, *, step: int, tags: Sequence[str], final: bool,
          metadata: dict[str, Any] | None, allow_pickle: bool, files: FilesArg | None,
          marks: list[float]) -> CutInfo:
    def prepare() -> tuple[dict[str, Any], list[ArrayItem], bool, list[AttachedFile]]:
        check_cut_fields(tags, metadata, store.url)
        return prepare_state(state, files, allow_pickle, store.url)

    tree, items, pickled, attached = c.all("save-prepare", prepare, same={"step": step, "final": bool(final)},
                                           doing=f"preparing the cut of step {step}")
    marks.append(time.perf_counter())
    intent = CutIntent(tags=list(tags), final=bool(final), metadata=metadata, mode="sync", world_size=c.size)
    pending: PendingCut | None = None
    parts: list[Any] | None = None

    def begin() -> str:
        nonlocal pending
        pending = begin_cut(store, step, writer="store.save", cut=None, world_size=c.size)
        return pending.id

    def write() -> dict[str, Any] | None:
        part: PendingCut | RankPart = (pending if c.size == 1  # type: ignore[assignment]
                                       else group_rank_part(store, cut, step))
        written, arrays = part.write(items)
        part.publish(written, arrays, intent.model_copy(update={"tree": tree, "pickled": pickled, "attached": attached}))
        # Of several ranks: what the commit record lists of this rank's fragment, for rank 0 (issue 22).
        return part.ref.to_json() if isinstance(part, RankPart) and part.ref is not None else None

    def commit() -> CutInfo:
        assert pending is not None
        return pending.finish(intent, parts=parts if c.size > 1 else None)

    try:
        cut = c.coordinate("save-begin", begin, doing=f"to begin the cut of step {step}")
        c.at(cut=cut)
        parts = c.all_to_coordinator("save-written", write, doing=f"writing cut {cut}")
        marks.append(time.perf_counter())
        info = c.coordinate("save-commit", commit, share=lambda i: {**i.to_json(), "metadata": i.metadata},
                            receive=CutInfo.from_json, doing=f"to commit cut {cut}", note=lambda: PendingCut.left_as(pending),
                            lost=f"cut {cut} may or may not be committed: the next writer open decides")
    except BaseException:
        if pending is not None:
            pending.abandon()  # a no-op once committed or left to recovery
        raise
    marks.append(time.perf_counter())
    return info


def prepare_state(state: Any, files: FilesArg | None, allow_pickle: bool, url: str
                  ) -> tuple[dict[str, Any], list[ArrayItem], bool, list[AttachedFile]]:
    """What a synchronous save writes: the state's tree and arrays, then the attached files' bytes."""
    # The flatten describes the plain tensors it meets (issue 23): one read of each attribute a tensor.
    f = walk(state, allow_pickle, plain_describer() if sys.modules.get("torch") is not None else None)
    tree, items = f.tree, describe_all(f.leaves)
    sources = open_sources(files, where={"store": url})
    try:
        items += [s.item(where={"store": url}) for s in sources]
        attached = [s.record() for s in sources]
    finally:
        close_sources(sources)
    return tree, items, allow_pickle and has_pickle(tree), attached


def check_cut_fields(tags: Sequence[str], metadata: dict[str, Any] | None, url: str) -> None:
    if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags):
        raise UsageError(f"tags must be a sequence of non-empty strings, got {tags!r}", store=url)
    try:
        json.dumps(metadata or {}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"metadata must be JSON-serializable: {exc}", store=url) from None


__all__ = ["save", "prepare_state", "check_cut_fields"]
