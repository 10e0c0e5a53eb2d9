"""Preemption notices: SIGTERM and SIGUSR1 handlers that only raise a flag.

Clusters announce the end of a job with a signal and kill it after a grace period: SLURM sends
SIGTERM (and SIGUSR1 first with ``--signal=USR1@<secs>``), Kubernetes and spot instances SIGTERM. A
:class:`~ckptstore.writer.Checkpointer` built with ``preemption=True`` installs :class:`PreemptionWatch`;
its handlers record the signal and chain to the handler that was installed before them when that one
is a Python callable (a framework's own handler keeps working). The default actions (terminate) and
``SIG_IGN`` are not chained: the point is to live until the next step boundary, where ``maybe_cut``
takes the preemption cut. Nothing else happens in the handler: no I/O, no lock, so it is safe whatever
the main thread was doing when the signal arrived.

Python runs signal handlers in the main thread only, and only the main thread may install them, so a
Checkpointer with ``preemption=True`` must be built there.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable, Sequence

from ckptstore.errors import UsageError

#: The signals a preemption notice arrives as.
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """Installs flag-raising handlers for ``signals``; :meth:`close` puts the previous ones back (where
    nobody replaced ours meanwhile)."""

    def __init__(self, signals: Sequence[signal.Signals] = PREEMPTION_SIGNALS, *, store: str | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise UsageError("preemption=True installs signal handlers, which Python allows in the main thread "
                             "only: build the Checkpointer there", store=store)
        #: The first preemption signal received (its number), or None.
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        for sig in signals:
            self._previous[int(sig)] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        prev = self._previous.get(signum)
        if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
            chained: Callable[[int, FrameType | None], Any] = prev
            chained(signum, frame)

    @property
    def signal_name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def clear(self) -> None:
        """Forgets a notice that was acted on (a second signal raises the flag again)."""
        self.received = None

    def close(self) -> None:
        """Reinstalls the handlers found at construction, for each signal whose handler is still ours.
        Only from the main thread (elsewhere the handlers stay; they only raise a flag)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, prev in self._previous.items():
            current = signal.getsignal(signum)
            if getattr(current, "__self__", None) is self:
                signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()


__all__ = ["PREEMPTION_SIGNALS", "PreemptionWatch"]
