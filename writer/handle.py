"""One cut in flight, as its caller sees it: :class:`CutHandle`, the cut's state machine.

States::

    capturing -> writing -> committing -> committed
        |           |            |
        +-> skipped +-> failed <-+     (and aborted, from capturing or writing, at close)

Any other transition raises ``IllegalTransition``. Terminal states never change again, so retrying the
cleanup of a failed cut can never turn a committed outcome into anything else. The commit pipeline
(:mod:`ckptstore.writer.pipeline`) moves the handle; the commit thread lives there, not here (issue 20:
this module was ``committer.py``, whose docstring claimed it).
"""

from __future__ import annotations

import threading
import time

from ckptstore.spi import CutInfo

from .errors import IllegalTransition, WriterError

CAPTURING, WRITING, COMMITTING = "capturing", "writing", "committing"
COMMITTED, SKIPPED, FAILED, ABORTED = "committed", "skipped", "failed", "aborted"
TERMINAL = frozenset({COMMITTED, SKIPPED, FAILED, ABORTED})
_ALLOWED = {
    CAPTURING: {WRITING, SKIPPED, FAILED, ABORTED},
    WRITING: {COMMITTING, FAILED, ABORTED},
    COMMITTING: {COMMITTED, FAILED},
}


class CutHandle:
    """One cut taken by a Checkpointer. ``wait()`` returns its CutInfo or raises its error."""

    def __init__(self, step: int, cut: str, final: bool) -> None:
        self.step = step
        self.id = cut
        self.final = final
        self._state = CAPTURING
        self._info: CutInfo | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        # The error reached a caller (wait, maybe_cut, cut, close): it is never raised a second time.
        self._reported = False
        self.timings: dict[str, float] = {}
        self.fallback: str | None = None

    @property
    def state(self) -> str:
        return self._state

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _move(self, new: str, *, info: CutInfo | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if new not in _ALLOWED.get(self._state, set()):
                raise IllegalTransition(f"cut {self.id}: {self._state} -> {new} is not allowed", step=self.step,
                                        cut=self.id)
            # Outcome fields only after the check: a refused move must not change a terminal outcome
            # (a late to_failed on a committed cut would otherwise make its wait() raise).
            if info is not None:
                self._info = info
            if error is not None:
                self._error = error
            self._state = new
            if new in TERMINAL:
                self._done.set()

    def to_writing(self) -> None:
        self._move(WRITING)

    def to_committing(self) -> None:
        self._move(COMMITTING)

    def to_committed(self, info: CutInfo) -> None:
        self._move(COMMITTED, info=info)

    def to_failed(self, error: BaseException) -> None:
        self._move(FAILED, error=error)

    def to_aborted(self, reason: str) -> None:
        self._move(ABORTED, error=WriterError(f"cut aborted: {reason}", step=self.step, cut=self.id))

    def wait(self, timeout: float | None = None) -> CutInfo:
        """Blocks until the cut is committed (returns its CutInfo) or failed (raises its error)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"cut {self.id} (step {self.step}) still {self._state} after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._info is not None
        return self._info

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Blocks until the cut ended, whatever its outcome, without raising or reporting its error
        (``wait`` reports it); False when ``timeout`` passed first."""
        return self._done.wait(timeout)

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def unreported_error(self) -> BaseException | None:
        """The error of a cut that ended in failure and that no caller has been given yet, else None."""
        return self._error if self._done.is_set() and not self._reported else None

    def mark_reported(self) -> None:
        """Its error is about to reach a caller (raised now, or on every rank as a RankFailure)."""
        self._reported = True

    def __repr__(self) -> str:
        return f"CutHandle(step={self.step}, id={self.id!r}, state={self._state!r})"


def elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 6)


__all__ = ["CutHandle", "TERMINAL", "elapsed"]
