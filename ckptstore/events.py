"""Structured events: one JSON object per thing that happened, for callbacks and JSON-lines files.

Every event has ``event`` (its kind), ``ts`` (unix seconds) and ``store``; cut events add ``cut`` and
``step`` plus timings in seconds and byte counts. Kinds from the store: ``committed``, ``failed``,
``pruned``, ``recovered`` (a leftover cleaned on open), ``gc``, ``mirrored`` (on a mirror: a cut copied in
from ``source``; issue 21). The writer adds ``captured``,
``written``, ``skipped`` (docs/writer.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import IO, Any, Callable

log = logging.getLogger("ckptstore")


class Emitter:
    """Sends events to an optional callback and logs them at DEBUG; a failing callback is logged,
    never allowed to break a save."""

    def __init__(self, store: str, sink: Callable[[dict[str, Any]], None] | None) -> None:
        self.store = store
        self.sink = sink

    def emit(self, kind: str, /, **fields: Any) -> dict[str, Any]:
        event = {"event": kind, "ts": round(time.time(), 6), "store": self.store, **fields}
        log.debug("%s", event)
        if self.sink is not None:
            try:
                self.sink(event)
            except Exception:  # noqa: BLE001 - observers must not break saves
                log.exception("ckptstore event callback failed for %s", kind)
        return event


class JsonLinesFile:
    """An event sink that appends one JSON object per line to a file (thread-safe)."""

    def __init__(self, path: str) -> None:
        self._f: IO[str] = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()
