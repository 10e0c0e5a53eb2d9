"""The cuts one Checkpointer took whose outcome a caller has still to hear, and the loop's counters.

One object that the facade (:mod:`ckptstore.writer.checkpointer`), the commit pipeline and the ranks'
agreement (:mod:`ckptstore.writer.ranked`) share through its methods, so none of them reaches into
another's private members (issue 20: ranked.py used nine of the Checkpointer's).
"""

from __future__ import annotations

import time

from ckptstore.spi import Emitter

from .handle import CutHandle, elapsed


class CutLedger:
    """The last cut taken (at most one is in flight), the cuts whose failure nobody saw yet, and how
    many periodic cuts were skipped or waited for."""

    def __init__(self, events: Emitter) -> None:
        self.events = events
        #: The last cut taken; None before the first.
        self.current: CutHandle | None = None
        #: The step of this checkpointer's last cut; None before its first.
        self.last_step: int | None = None
        self.skipped = 0
        self.waited = 0
        self._open: list[CutHandle] = []

    def add(self, handle: CutHandle) -> None:
        """``handle`` was captured and is on its way: it is the one in flight now."""
        self.last_step = handle.step
        self.current = handle
        self._open.append(handle)

    @property
    def busy(self) -> bool:
        """Whether the last cut taken is still being written or committed."""
        return self.current is not None and not self.current.done

    def wait_current(self, timeout: float | None = None) -> None:
        """Waits (bounded by ``timeout`` when given) for the last cut taken to end; raises nothing."""
        if self.current is not None:
            self.current.wait_ended(timeout)

    def skip(self, step: int, reason: str) -> None:
        """A periodic cut of ``step`` is skipped because one is in flight (``busy="skip"``)."""
        self.skipped += 1
        self.events.emit("skipped", step=step, reason=reason, skipped_total=self.skipped, waited_total=self.waited)

    def wait_for_current(self, step: int) -> None:
        """The cut of ``step`` waits for the one in flight (``busy="wait"``, or a cut that is never skipped)."""
        self.waited += 1
        t_wait = time.perf_counter()
        current = self.current
        if current is not None:
            current.wait_ended()
        for_cut = {"for_cut": current.id} if current is not None else {}
        self.events.emit("waited", step=step, seconds=elapsed(t_wait), **for_cut, waited_total=self.waited)

    def first_unreported(self) -> CutHandle | None:
        """The first cut that failed and whose error no caller has been given yet."""
        return next((h for h in self._open if h.unreported_error is not None), None)

    def raise_unreported(self) -> None:
        """Raises the first unreported failure (once), and forgets the cuts that need no more hearing."""
        first = self.first_unreported()
        if first is not None:
            err = first.unreported_error
            first.mark_reported()
            raise err  # type: ignore[misc]
        # A cut that failed since the search above stays (dropping it by ``done`` alone would lose its error).
        self._open = [h for h in self._open if not h.done or h.unreported_error is not None]

    def claim_unreported(self) -> list[BaseException]:
        """Every unreported failure, each marked reported (every rank is about to raise because of
        them), and only the cuts still in flight are kept."""
        errors = []
        for h in self._open:
            err = h.unreported_error
            if err is not None:
                h.mark_reported()
                errors.append(err)
        self._open = [h for h in self._open if not h.done or h.unreported_error is not None]
        return errors


__all__ = ["CutLedger"]
