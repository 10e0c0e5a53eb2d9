"""The local cut first (issue 21): the mirror's uploads yield to the writes of local cuts."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class Gate:
    """The local cut first (issue 21: "stall and capture-to-committed within 1.05x of the same
    Checkpointer without a mirror"): while a cut's shards are written (``busy``), the mirror's upload
    pauses between its pieces (``wait_idle``, bounded: a write that outlasts ``PAUSE_MAX_S`` lets the
    upload go on), so the two never share the disk and the cores for the cut the loop may wait for."""

    PAUSE_MAX_S = 60.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writes = 0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self._cond:
            self._writes += 1
        try:
            yield
        finally:
            with self._cond:
                self._writes -= 1
                self._cond.notify_all()

    def wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._writes == 0, self.PAUSE_MAX_S)


__all__ = ["Gate"]
