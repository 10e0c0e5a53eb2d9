"""A Checkpointer's cuts over several ranks: agreement in the loop, a two-phase commit behind it.

In the training loop (collective calls, every rank at the same steps):

1. ``maybe_cut`` (or ``cut``) exchange: every rank says its step, whether its previous cut is still
   in flight, and whether one of its cuts failed unreported; rank 0 proposes the new cut id.
   Different steps are named; an earlier failure raises on every rank at this same call; if any rank
   is busy, a periodic cut is skipped on all ranks (``busy="skip"``) or all wait for their own cut
   first.
2. each rank captures its state into its own shared block;
3. ``captured`` exchange: a rank whose capture failed makes every rank drop the cut.

Behind the loop, each rank's commit thread runs the Checkpointer's one pipeline
(``Checkpointer._process``) over this side's :class:`~ckptstore.collective.Collective`: (rank 0 first
marks the cut) the writer process writes the rank's shards, the rank publishes its durable record
(``cuts/<cut>/rank<r>.json``) and posts "written"; rank 0 waits for every rank's post (a rank that shows
no sign of life for ``rank_timeout`` fails the cut), reads every record, commits one manifest and posts
the outcome, which the other ranks wait for (``Collective.gather``). So LATEST moves once, only when
every rank's files are durable, and every rank's handle ends with the same outcome.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from ckptstore import layout
from ckptstore.attached import FilesArg
from ckptstore.collective import Collective
from ckptstore.errors import StepConflict, UsageError
from ckptstore.info import CutInfo
from ckptstore.ranks import RankFailure, RankGroup, check_all_ok, check_same, outcome

from .capture import Captured, capture
from .committer import CutHandle, elapsed

if TYPE_CHECKING:
    from .checkpointer import Checkpointer


class RankedCuts:
    """The collective side of one rank's Checkpointer (made by it when its store has ranks)."""

    def __init__(self, ck: "Checkpointer", ranks: RankGroup) -> None:
        self.ck = ck
        self.ranks = ranks
        #: The cut's steps behind the loop (the Checkpointer's pipeline runs on it).
        self.collective = Collective(ranks, store=ck.store.url)

    @property
    def where(self) -> dict[str, Any]:
        return {"store": self.ck.store.url}

    # --------------------------------------------------------------------------------- agreement
    def agree_ready(self, err: BaseException | None) -> None:
        """The end of the collective constructor: every rank is ready, or every rank raises."""
        msgs = self.ranks.exchange("checkpointer-ready", outcome(err), **self.where)
        if err is None:
            check_all_ok(msgs, "starting the checkpointer", **self.where)

    def agree_close(self) -> None:
        """Collective close: every rank reports what failed unreported; all raise the same failure."""
        self._agree_failures(self.ranks.exchange("close", {"failed": self._unreported()}, **self.where))

    def _unreported(self) -> dict[str, Any] | None:
        for h in self.ck._handles:
            if h.done and h.error is not None and not h.reported:
                return {"cut": h.id, "step": h.step, "error": f"{type(h.error).__name__}: {h.error}"[:2000]}
        return None

    def _agree_failures(self, msgs: Sequence[Any]) -> None:
        """Raises on every rank when any rank's earlier cut failed: this rank's own error when it has
        one, else a RankFailure naming the ranks and the cut."""
        failed = {r: m["failed"] for r, m in enumerate(msgs) if m.get("failed")}
        if not failed:
            return
        mine = [h for h in self.ck._handles if h.done and h.error is not None and not h.reported]
        for h in mine:
            h.reported = True
        self.ck._handles = [h for h in self.ck._handles if not h.done]
        if mine:
            raise mine[0].error  # type: ignore[misc]
        first = failed[min(failed)]
        detail = "; ".join(f"rank {r}: {f['error']}" for r, f in sorted(failed.items()))
        raise RankFailure(f"cut {first['cut']} (step {first['step']}) failed on rank(s) {sorted(failed)}: {detail}",
                          ranks=list(failed), cut=first["cut"], **self.where)

    def take(self, step: int, state: Any, *, periodic: bool, **kw: Any) -> CutHandle | None:
        """``maybe_cut``/``cut``: beating throughout, as the others may wait while this rank captures
        its state or waits for its previous cut (issue 19 item 7)."""
        with self.ranks.busy():
            return self._take(step, state, periodic=periodic, **kw)

    def _take(self, step: int, state: Any, *, periodic: bool, final: bool = False, tags: Sequence[str] = (),
              metadata: dict[str, Any] | None = None, allow_pickle: bool = False, files: FilesArg | None = None
              ) -> CutHandle | None:
        ck = self.ck
        if ck._closed:
            raise UsageError("the checkpointer is closed", store=ck.store.url)
        current = ck._current
        local: BaseException | None = None
        try:
            layout.check_step(step, store=ck.store.url)
            if ck._last_step is not None and step <= ck._last_step:
                local = StepConflict(f"step {step} is not above the last cut's step {ck._last_step}",
                                     store=ck.store.url)
        except UsageError as exc:  # posted like any local failure: every rank raises at this call
            local = exc
        proposal = layout.new_cut_id(step) if self.ranks.rank == 0 and local is None else None
        # A rank lost here is named with the last cut taken, which is the one its loss fails.
        last = {"cut": current.id} if current is not None else {}
        # maybe_cut and cut are different calls: their exchanges are named apart (issue 19 item 5).
        msgs = self.ranks.exchange("maybe_cut" if periodic else "cut", {
            **outcome(local), "step": step if local is None else repr(step), "periodic": periodic, "final": final,
            "busy": current is not None and not current.done, "failed": self._unreported(), "cut": proposal,
        }, **self.where, **last)
        check_same(msgs, ("step", "periodic", "final"), "maybe_cut/cut", **self.where)
        self._agree_failures(msgs)
        if local is not None:
            raise local
        check_all_ok(msgs, f"taking the cut of step {step}", **self.where)
        if any(m["busy"] for m in msgs):
            busy_ranks = [r for r, m in enumerate(msgs) if m["busy"]]
            if periodic and ck.options.busy == "skip":
                ck.skipped += 1
                ck.events.emit("skipped", step=step, reason=f"the previous cut is still in flight on rank(s) {busy_ranks}",
                               skipped_total=ck.skipped, waited_total=ck.waited)
                return None
            ck.waited += 1
            t_wait = time.perf_counter()
            if current is not None:
                current._done.wait()
            ck.events.emit("waited", step=step, seconds=elapsed(t_wait), waited_total=ck.waited)
            self._agree_failures(self.ranks.exchange("cut-waited", {"failed": self._unreported()}, **self.where))
        # Every rank's previous cut has ended, so every rank has read its outcome posts.
        self.collective.forget_outcomes()
        handle = CutHandle(step, msgs[0]["cut"], final)
        err: BaseException | None = None
        captured: Captured | None = None
        try:
            captured = capture(state, ck._block_for, allow_pickle=allow_pickle, device_copy=ck.options.device_copy,
                               pinning=ck._pinning, files=files, where={"store": ck.store.url, "cut": handle.id})
        except BaseException as exc:  # noqa: BLE001 - every rank hears of it below
            err = exc
        msgs = self.ranks.exchange("captured", outcome(err), **self.where)
        if err is None:
            try:
                check_all_ok(msgs, f"capturing cut {handle.id}", cut=handle.id, **self.where)
            except RankFailure as exc:
                err = exc
        if err is not None:
            handle.to_failed(err)
            handle.reported = True
            ck.events.emit("failed", step=step, cut=handle.id, stage="capture", error=str(err),
                           error_type=type(err).__name__)
            raise err
        assert captured is not None
        return ck._launch(handle, captured, tags=tags, metadata=metadata, final=final, world_size=self.ranks.size)

    def wait_committed(self, handle: CutHandle) -> CutInfo:
        """``cut(final=True)``: every rank waits for the outcome, which is the same on every rank."""
        with self.ranks.busy():
            handle._done.wait()
            self._agree_failures(self.ranks.exchange("cut-final", {"failed": self._unreported()}, **self.where))
        return handle.wait()

__all__ = ["RankedCuts"]
