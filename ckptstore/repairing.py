"""Repairing LATEST, pointing it at a committed cut, and recording cuts proven damaged (moved out of
store.py, issue 20). ``repair`` is the user's; ``point_latest`` and ``record_bad`` are the resume
tooling's, reached through :mod:`ckptstore.spi`."""

from __future__ import annotations

import errno
from contextlib import contextmanager
from typing import Iterator

from . import hashing, layout
from .core import Role, StoreCore
from .errors import CorruptCut, LatestError, StorageError
from .events import log
from .info import CutInfo
from .marks import BadCut
from .protocol import now_iso
from .selection import raise_io_errors
from .verify import Progress, verify_store


def repair(core: StoreCore, *, progress: Progress | None) -> CutInfo | None:
    """See :meth:`ckptstore.Store.repair`."""
    core.require_writer("repair")
    cls = core.classify()
    for m in reversed(cls.committed):
        report = verify_store(core.storage, cls, cut=m.cut, progress=progress)
        raise_io_errors(report)
        if report.ok or all(f.kind.about_latest for f in report.errors):
            with _latest_must_be_a_file(core.url):
                info = point_latest(core, m.cut)
            core.events.emit("repaired", cut=m.cut, step=m.step)
            return info
    if cls.committed:
        raise CorruptCut("no committed cut verifies; LATEST left as it was", store=core.url,
                         hint="run `ckptstore verify` to see what is damaged")
    with _latest_must_be_a_file(core.url):
        core.protocol.remove_latest()
    return None


def point_latest(core: StoreCore, cut: str) -> CutInfo:
    """Durably points LATEST at a committed cut (repair, and resuming from a fallback cut so the next
    saves continue from it), clearing a stale mark of that cut. Writers only."""
    core.require_writer("point_latest")
    m = core.manifest(cut)
    data = core.storage.read_bytes(layout.manifest_path(m.cut))
    core.protocol.point_latest(m.cut, m.step, hashing.digest(data))
    try:
        core.protocol.unmark(m.cut)
    except StorageError:
        pass  # LATEST names it: a stale mark cannot demote it (protocol Rule M)
    return core.classify().info(m)


def record_bad(core: StoreCore, cut: str, reason: str) -> None:
    """Records that a committed cut is proven damaged, so restarts skip it (no retry loop).
    Allowed on readonly handles too: ``bad/`` is only ever added to, and writers never read it
    for anything but skipping."""
    m = core.manifest(cut)
    core.protocol.record_bad(BadCut(cut=m.cut, step=m.step, reason=reason, recorded_at=now_iso()))


def record_bad_quietly(core: StoreCore, cut: str, reason: str) -> None:
    """``record_bad``, where a reader that may not write logs the refusal instead of raising."""
    try:
        record_bad(core, cut, reason)
    except StorageError as exc:
        # A reader may lack write access; the record only saves later fallbacks a verification.
        if core.role is not Role.READER:
            raise
        log.warning("ckptstore: could not record bad cut %s of %s: %s", cut, core.url, exc)


@contextmanager
def _latest_must_be_a_file(url: str) -> Iterator[None]:
    """Turns the file system's refusal to read, replace or delete a LATEST that is a directory or a
    FIFO into a ``LatestError`` that says what to do: repair never deletes what may be someone's data."""
    try:
        yield
    except StorageError as exc:
        if exc.path != layout.LATEST_FILE or exc.errno not in (errno.EISDIR, errno.EINVAL, errno.ENOTEMPTY):
            raise
        raise LatestError("LATEST is not a regular file (a directory or FIFO stands in its place); repair does not "
                          "remove it", store=url, path=layout.LATEST_FILE,
                          hint="move it aside, then run `ckptstore repair` again") from exc


__all__ = ["point_latest", "record_bad", "record_bad_quietly", "repair"]
