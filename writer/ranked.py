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
(:class:`~ckptstore.writer.pipeline.CommitPipeline`) over this side's
:class:`~ckptstore.collective.Collective`: (rank 0 first marks the cut) the writer process writes the
rank's shards, the rank publishes its durable record (``cuts/<cut>/rank<r>.json``) and posts "written";
rank 0 waits for every rank's post (a rank that shows no sign of life for ``rank_timeout`` fails the
cut), reads every record, commits one manifest and posts the outcome, which the other ranks wait for
(``Collective.gather``). So LATEST moves once, only when every rank's files are durable, and every
rank's handle ends with the same outcome.

This module reaches the Checkpointer's cuts only through the pipeline and its ledger (issue 20: it
used nine private members of the Checkpointer, the two importing each other under TYPE_CHECKING).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ckptstore import CutInfo, StepConflict, UsageError
from ckptstore.spi import layout
from ckptstore.spi import FilesArg
from ckptstore.spi import Collective
from ckptstore.spi import RankFailure, RankGroup, check_all_ok, check_same, outcome

from .capture import Captured
from .handle import CutHandle
from .pipeline import CommitPipeline


def agree_ready(ranks: RankGroup, err: BaseException | None, where: dict[str, Any]) -> None:
    """The end of the collective constructor: every rank is ready, or every rank raises."""
    msgs = ranks.exchange("checkpointer-ready", outcome(err), **where)
    if err is None:
        check_all_ok(msgs, "starting the checkpointer", **where)


class RankedCuts:
    """The collective side of one rank's Checkpointer (made by it when its store has ranks)."""

    def __init__(self, pipeline: CommitPipeline, ranks: RankGroup) -> None:
        self.pipeline = pipeline
        self.cuts = pipeline.cuts
        self.ranks = ranks
        self.where: dict[str, Any] = {"store": pipeline.store.url}

    # --------------------------------------------------------------------------------- agreement
    def agree_ready(self, err: BaseException | None) -> None:
        """The end of the collective constructor: every rank is ready, or every rank raises."""
        agree_ready(self.ranks, err, self.where)

    def agree_close(self) -> None:
        """Collective close: every rank reports what failed unreported; all raise the same failure."""
        self._agree_failures(self.ranks.exchange("close", {"failed": self._unreported()}, **self.where))

    def agree_preempt(self, step: int, signal: str | None) -> dict[int, str]:
        """Every ``maybe_cut`` with ``preemption``: the ranks that received a notice, by rank, and its signal."""
        msgs = self.ranks.exchange("preempt", {"step": step if isinstance(step, int) else repr(step),
                                               "signal": signal}, **self.where)
        check_same(msgs, ("step",), "maybe_cut", **self.where)
        return {r: m["signal"] for r, m in enumerate(msgs) if m["signal"]}

    def mark_final(self, mark: Callable[[], CutInfo]) -> CutInfo:
        """Collective ``mark_final``: rank 0 runs ``mark``; every rank returns its CutInfo or raises."""
        return Collective(self.ranks, **self.where).coordinate(
            "mark-final", mark, share=lambda i: {**i.to_json(), "metadata": i.metadata}, receive=CutInfo.from_json,
            doing="to mark the last cut final")

    def _unreported(self) -> dict[str, Any] | None:
        h = self.cuts.first_unreported()
        if h is None:
            return None
        return {"cut": h.id, "step": h.step, "error": f"{type(h.error).__name__}: {h.error}"[:2000]}

    def _agree_failures(self, msgs: Sequence[Any]) -> None:
        """Raises on every rank when any rank's earlier cut failed: this rank's own error when it has
        one, else a RankFailure naming the ranks and the cut."""
        failed = {r: m["failed"] for r, m in enumerate(msgs) if m.get("failed")}
        if not failed:
            return
        mine = self.cuts.claim_unreported()
        if mine:
            raise mine[0]
        first = failed[min(failed)]
        detail = "; ".join(f"rank {r}: {f['error']}" for r, f in sorted(failed.items()))
        raise RankFailure(f"cut {first['cut']} (step {first['step']}) failed on rank(s) {sorted(failed)}: {detail}",
                          ranks=list(failed), cut=first["cut"], **self.where)

    # ------------------------------------------------------------------------------------ a cut
    def take(self, step: int, state: Any, *, periodic: bool, **kw: Any) -> CutHandle | None:
        """``maybe_cut``/``cut``: beating throughout, as the others may wait while this rank captures
        its state or waits for its previous cut (issue 19 item 7)."""
        with self.ranks.busy():
            return self._take(step, state, periodic=periodic, **kw)

    def _take(self, step: int, state: Any, *, periodic: bool, final: bool = False, tags: Sequence[str] = (),
              metadata: dict[str, Any] | None = None, allow_pickle: bool = False, files: FilesArg | None = None
              ) -> CutHandle | None:
        cut = self._agree_cut(step, periodic=periodic, final=final)
        if cut is None:
            return None
        handle = CutHandle(step, cut, final)
        captured = self._capture(handle, state, allow_pickle=allow_pickle, files=files)
        return self.pipeline.launch(handle, captured, tags=tags, metadata=metadata, final=final)

    def _check_step(self, step: int) -> UsageError | None:
        """This rank's objection to a cut of ``step``, posted like any local failure (every rank raises)."""
        try:
            layout.check_step(step, store=self.where["store"])
        except UsageError as exc:
            return exc
        last = self.cuts.last_step
        if last is not None and step <= last:
            return StepConflict(f"step {step} is not above the last cut's step {last}", **self.where)
        return None

    def _agree_cut(self, step: int, *, periodic: bool, final: bool) -> str | None:
        """The exchange that opens a cut of ``step`` on every rank: the agreed cut id, or None when a
        periodic cut is skipped because a rank is busy; raises on every rank what any rank objects to."""
        current = self.cuts.current
        local = self._check_step(step)
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
            if periodic and self.pipeline.options.busy == "skip":
                self.cuts.skip(step, f"the previous cut is still in flight on rank(s) {busy_ranks}")
                return None
            self.cuts.wait_for_current(step)
            self._agree_failures(self.ranks.exchange("cut-waited", {"failed": self._unreported()}, **self.where))
        # Every rank's previous cut has ended, so every rank has read its outcome posts.
        self.pipeline.collective.forget_outcomes()
        return msgs[0]["cut"]

    def _capture(self, handle: CutHandle, state: Any, *, allow_pickle: bool, files: FilesArg | None) -> Captured:
        """This rank's capture, then the ``captured`` exchange: a capture failed on any rank fails the
        cut on every rank, at this call."""
        c = Collective(self.ranks, **self.where, cut=handle.id)
        try:
            return c.all("captured", lambda: self.pipeline.capture(handle, state, allow_pickle=allow_pickle,
                                                                   files=files), doing=f"capturing cut {handle.id}")
        except BaseException as err:
            self.pipeline.capture_failed(handle, err)
            raise

    def wait_committed(self, handle: CutHandle) -> CutInfo:
        """``cut(final=True)``: every rank waits for the outcome, which is the same on every rank; with a
        mirror, a final cut then waits for its mirror commit on every rank (issue 21: rank 0's wait,
        agreed through the group; bounded by ``mirror_timeout``; ``MirrorTimeout`` on every rank)."""
        with self.ranks.busy():
            handle.wait_ended()
            self._agree_failures(self.ranks.exchange("cut-final", {"failed": self._unreported()}, **self.where))
        info = handle.wait()
        mirror = self.pipeline.mirror
        if handle.final and mirror is not None:
            mirror.wait(handle.id, self.pipeline.options.mirror_timeout)
        return info


__all__ = ["RankedCuts", "agree_ready"]
