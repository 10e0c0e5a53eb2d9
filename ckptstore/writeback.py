"""A cut restored from the mirror, written back into the local tier behind the restore (issue 21:
"Reading from the mirror never waits for the local tier, and a cut restored from the mirror is written
back into the local tier in the background so the next restart is local").

The restore's load reads the mirror's copy once, verifying it, and hands every stored byte of each
file on as it passes (a :class:`~ckptstore.loader.FileTaps`: ``begin``, the tap, ``end``) to a
:class:`WriteBack`: a thread that commits the same cut in the local tier through the local store's own
protocol, as ``mirror_cut`` does (mark, files, names, the mirror's manifest bytes unchanged, then LATEST
only forward: ``PendingCut.commit_copy``). Each file's sink is closed (made durable) only after the
restore's read of it verified; the manifest goes only after every file did. So each byte is downloaded
once, and the local tier only ever gets bytes the load checked.

The restore never waits for the local tier beyond a bounded buffer (:data:`BUFFER_BYTES` of bytes
handed on and not yet written): a local tier that falls that far behind, or fails (a full disk), makes
the write-back give up with a warning; what it began is abandoned (files, then mark), and what a failed
removal leaves is a marked cut the local store's next writer open removes. Nothing is ever committed
half. The restore goes on either way; only the next restart reads the mirror again.

:meth:`WriteBack.wait` returns the local :class:`~ckptstore.info.CutInfo` or raises what stopped it; the
handle's ``close`` waits for it (bounded by :data:`CLOSE_WAIT_S`), then abandons it, before its lock goes.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import cutting, layout, reading
from .core import Role, StoreCore
from .errors import CkptStoreError, DataError, UsageError
from .events import log
from .info import CutInfo
from .manifest import FileRecord, Manifest, TensorRecord
from .pending import PendingCut
from .storage import Sink

#: The most bytes the restore hands on ahead of the local tier's writes (then the write-back gives up).
BUFFER_BYTES = 64 << 20
#: How long a handle's ``close`` waits for its write-back before abandoning it.
CLOSE_WAIT_S = 120.0
#: How long the write-back waits for the restore's next bytes before it gives up (the restore hands on
#: a file's pieces as its reads return; each read has its own deadline on an object store).
IDLE_S = 600.0

_LOADED = ("loaded",)


class WriteBackAbandoned(CkptStoreError, wire="write-back-abandoned"):
    """The write-back gave up before its commit: the restore failed, the local tier fell behind by more
    than the buffer, or the handle closed first. Nothing was committed in the local tier."""


class WriteBack:
    """One cut of the mirror written back into the local tier ``local`` (a writer handle) by a thread,
    fed by the restore's read (``begin``/tap/``end``, then :meth:`loaded`). ``data`` is the mirror's
    manifest of it, byte for byte."""

    def __init__(self, local: StoreCore, source: str, m: Manifest, data: bytes, *,
                 buffer_bytes: int = BUFFER_BYTES) -> None:
        local.require_writer("writing a cut back from the mirror")
        self._local, self._source, self._m, self._data = local, source, m, data
        self._budget = buffer_bytes
        self._cv = threading.Condition()
        self._items: collections.deque[tuple] = collections.deque()
        self._queued = 0
        self._stop: str | None = None  # why it was abandoned
        self._info: CutInfo | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        local.background.append(self.close)
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-write-back-{m.cut}", daemon=True)
        self._thread.start()

    # the restore's side (FileTaps) ---------------------------------------------------------------------
    def begin(self, rec: FileRecord) -> Callable[[memoryview | bytes], None] | None:
        if not self._put(("begin", rec), 0):
            return None

        def tap(piece: memoryview | bytes) -> None:
            # The piece is the reader's buffer or the tensor's own memory: the copy is what crosses.
            self._put(("piece", bytes(piece)), len(piece))

        return tap

    def end(self, rec: FileRecord, ok: bool) -> None:
        self._put(("end", rec, ok), 0)

    def loaded(self) -> None:
        """The restore read (and verified) every file of the cut: the write-back may commit."""
        self._put(_LOADED, 0)

    def abandon(self, why: str) -> None:
        """Gives the write-back up (the restore failed, the handle closes): nothing is committed."""
        with self._cv:
            if self._stop is None and not self._done.is_set():
                self._stop = why
                self._cv.notify_all()

    def _put(self, item: tuple, size: int) -> bool:
        with self._cv:
            if self._stop is not None or self._done.is_set():
                return False
            if self._queued + size > self._budget:
                # Never block the restore on the local tier (issue 21): give up instead.
                self._stop = f"the local tier fell more than {self._budget} bytes behind the restore"
            else:
                self._items.append(item)
                self._queued += size
            self._cv.notify_all()
            return self._stop is None

    # the handle's side ---------------------------------------------------------------------------------
    @property
    def cut(self) -> str:
        return self._m.cut

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CutInfo:
        """The local tier's info of the cut once committed there; raises what stopped the write-back,
        ``TimeoutError`` while it is still running after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the write-back of cut {self._m.cut} into {self._local.url} is still running")
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Waits for the write-back (``timeout``), then abandons what is left of it and waits briefly for
        its thread; what stays is a marked cut the local store's next writer open removes."""
        if not self._done.wait(timeout):
            self.abandon(f"the store closed before the write-back ended ({timeout:g} s)")
            self._done.wait(min(timeout, 10.0))

    # the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        started = time.monotonic()
        pending: PendingCut | None = None
        sink: list[Sink | None] = [None]
        try:
            m = self._m
            pending = cutting.begin_cut(self._local, m.step, writer="mirror", cut=m.cut, world_size=m.world_size,
                                        above_latest=False)
            got = self._files(pending, sink)
            by_file: dict[str, list[TensorRecord]] = {}
            for t in m.tensors:
                by_file.setdefault(t.file, []).append(t)
            for rank in sorted({f.rank for f in got}):
                files = [f for f in got if f.rank == rank]
                pending.add_files(files, [t for f in files for t in by_file.get(f.name, [])], rank=rank)
            pending.files_durable()
            self._info = pending.commit_copy(self._data)
            self._local.events.emit("mirrored", cut=m.cut, step=m.step, source=self._source, nbytes=m.nbytes,
                                    seconds=round(time.monotonic() - started, 6))
        except BaseException as exc:  # noqa: BLE001 - kept for wait(); the restore has moved on
            self._fail(exc, pending, sink[0])
        finally:
            with self._cv:
                self._done.set()
                self._items.clear()
            if self.close in self._local.background:
                self._local.background.remove(self.close)

    def _files(self, pending: PendingCut, sink: list[Sink | None]) -> list[FileRecord]:
        """Writes each file as the restore hands it on, closing its sink once the read verified it;
        returns the files in the manifest's order once the restore read them all."""
        written: dict[str, FileRecord] = {}
        while True:
            item = self._next()
            if item[0] == "begin":
                sink[0] = self._local.storage.open_sink(layout.cut_file(self._m.cut, item[1].name))
            elif item[0] == "piece":
                assert sink[0] is not None
                sink[0].write(item[1])
            elif item[0] == "end":
                s, sink[0] = sink[0], None
                assert s is not None
                if not item[2]:
                    s.abort()
                    raise WriteBackAbandoned(f"the restore's read of {item[1].name} did not verify",
                                             store=self._local.url, cut=self._m.cut,
                                             path=layout.cut_file(self._m.cut, item[1].name))
                s.close()
                written[item[1].name] = item[1]
            else:
                break
        missing = [f.name for f in self._m.files if f.name not in written]
        if missing:
            raise UsageError(f"the restore handed on no bytes of {missing[:3]}", store=self._local.url,
                             cut=self._m.cut)
        return [written[f.name] for f in self._m.files]

    def _next(self) -> tuple:
        with self._cv:
            deadline = time.monotonic() + IDLE_S
            while not self._items and self._stop is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stop = f"the restore handed on nothing for {IDLE_S:g} s"
                    break
                self._cv.wait(left)
            if self._stop is not None:
                raise WriteBackAbandoned(f"write-back abandoned: {self._stop}", store=self._local.url,
                                         cut=self._m.cut)
            item = self._items.popleft()
            if item[0] == "piece":
                self._queued -= len(item[1])
            return item

    def _fail(self, exc: BaseException, pending: PendingCut | None, sink: Sink | None) -> None:
        self._error = exc
        if sink is not None:
            sink.abort()
        if pending is not None:
            try:
                pending.abandon()  # files, then the mark: a failed removal stays marked, for recovery
            except CkptStoreError as again:
                log.warning("ckptstore: could not remove the write-back's leftovers of cut %s in %s (the next "
                            "writer open does): %s", self._m.cut, self._local.url, again)
        log.warning("ckptstore: the write-back of cut %s from %s into %s failed; the next restart reads the "
                    "mirror again: %s", self._m.cut, self._source, self._local.url, exc)


@dataclass(frozen=True)
class Loaded:
    """A mirror copy a restore loaded as its check: the state, and its write-back (None: none)."""

    state: Any
    write_back: WriteBack | None


class MirrorLoad:
    """The mirror tier's check in a restore of one process (a ``selection.Check``): the copy is loaded,
    verified as it is read, instead of verified and then loaded, so each byte is downloaded once; on a
    writer handle whose local tier lacks the cut its bytes are tapped into a :class:`WriteBack`."""

    def __init__(self, local: StoreCore, mirror: StoreCore, *, map_location: Any,
                 allowed_types: Sequence[type] | None) -> None:
        self._local, self._mirror = local, mirror
        self._map_location, self._allowed_types = map_location, allowed_types
        self._loaded: dict[str, Loaded] = {}

    def check(self, m: Manifest) -> DataError | None:
        if m.pickled:
            return None  # the restore's own load refuses it (HostileInput), as it always did
        mine = reading.rank_manifest(m, None, self._mirror.url, self._mirror.storage)
        wb = self._write_back(m)
        try:
            state = reading.load_part(self._mirror, mine, map_location=self._map_location, verify=True, keys=None,
                                      allow_pickle=False, allowed_types=self._allowed_types, taps=wb)
        except DataError as exc:
            if wb is not None:
                wb.abandon(f"the mirror's copy did not verify: {exc.message}")
            return exc
        except BaseException:
            if wb is not None:
                wb.abandon("the restore's read of the mirror's copy failed")
            raise
        if wb is not None:
            wb.loaded()
        self._loaded[m.cut] = Loaded(state, wb)
        return None

    def peek(self, cut: str) -> Loaded | None:
        """What :meth:`check` loaded of ``cut`` (None: it was not loaded here)."""
        return self._loaded.get(cut)

    def take(self, cut: str) -> Loaded | None:
        """:meth:`peek`, and let go of it (the state is the restore's now)."""
        return self._loaded.pop(cut, None)

    def _write_back(self, m: Manifest) -> WriteBack | None:
        """A write-back of ``m`` when this handle writes the local tier and the local tier lacks the cut
        (a copy it holds, recorded bad or not, stays as it is); another cut at its step there keeps
        the restore on the mirror's copy, with a warning (it is not this run's)."""
        if self._local.role is not Role.WRITER:
            return None
        cls = self._local.classify()
        if cls.find(m.cut) is not None:
            return None
        other = [x.cut for x in cls.committed if x.step == m.step]
        if other:
            log.warning("ckptstore: not writing cut %s back into %s: it holds cut %s at step %d; reading the "
                        "mirror's copy", m.cut, self._local.url, other[0], m.step)
            return None
        data = self._mirror.storage.read_bytes(layout.manifest_path(m.cut))
        if Manifest.from_bytes(data, store=self._mirror.url, cut=m.cut, path=layout.manifest_path(m.cut)) != m:
            return None  # replaced since the classification read it: the restore's own read decides
        return WriteBack(self._local, self._mirror.url, m, data)


__all__ = ["BUFFER_BYTES", "CLOSE_WAIT_S", "IDLE_S", "Loaded", "MirrorLoad", "WriteBack", "WriteBackAbandoned"]
