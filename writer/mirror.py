"""The Checkpointer's mirror tier (issue 21, second part): each cut committed locally is copied into a
mirror store behind the loop, oldest first, with :func:`ckptstore.spi.mirror_cut` (byte for byte,
through the mirror's own protocol, every byte checked against the local manifest as it streams).

One thread (``ckptstore-mirror``) does every upload, so the loop never waits for the mirror except at
``cut(final=True)`` and ``close()`` (:meth:`MirrorTier.wait`, :meth:`MirrorTier.drain`, bounded by
``mirror_timeout``; a timeout is :class:`MirrorTimeout` and leaves every cut committed locally).

- **Backlog.** Cuts wait in step order. When more than one waits, those ``mirror_keep`` would not keep
  (among the mirror's cuts and the waiting ones) are skipped (event ``mirror-skipped``), the newest
  never: a slow mirror costs lag, never trainer time.
- **Retries.** A failed upload (the mirror unreachable, throttling, a full disk) is event
  ``mirror-failed`` and is retried after a backoff (``mirror_retry_s``, doubling up to 30 s), with the
  mirror's handle opened again (its recovery removes what the failed copy left). A cut whose local
  bytes do not verify (recorded bad locally) or that conflicts with the mirror is not retried.
- **Retention across tiers.** After each upload the mirror is pruned with ``mirror_keep`` (the store's
  prune never removes LATEST's target, so the mirror's newest cut stays). :meth:`MirrorTier.hold` is
  what the local prune must also keep: every cut waiting for the mirror or being uploaded (and, until
  the first look at both stores is done, every cut).
- **Catch-up.** The thread's first act is to compare the two stores: every local committed cut the
  mirror lacks joins the backlog, so a cut committed by a trainer that died before its upload (or by
  its writer's rescue) reaches the mirror after the next Checkpointer open.

The local tier is read through a reader handle of its own (the commit thread keeps the writer handle),
over the same storage. With several ranks this is rank 0's tier, its ``upload`` rank 0's share of
``mirror_rank``; the others follow its marks (:mod:`ckptstore.writer.mirror_ranks`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ckptstore import CutInfo, Store, StoreOptions
from ckptstore.errors import CutNotFound, DataError
from ckptstore import spi
from ckptstore.spi import Emitter, MirrorConflict, Policy, Storage

from .errors import WriterError
from .gate import Gate

#: The longest wait between two attempts at a mirror that keeps failing.
RETRY_MAX_S = 30.0
#: How long ``close`` waits for the mirror thread to end once told to stop (an upload under way ends first).
JOIN_S = 30.0


class MirrorTimeout(WriterError, wire="mirror-timeout"):
    """A cut did not reach the mirror within ``mirror_timeout``; every cut stays committed locally, and
    the next Checkpointer open uploads what the mirror lacks (its catch-up)."""


@dataclass(frozen=True)
class Hold(Policy):
    """Keeps the cuts named; ``None``: those ``unseen`` (``mirror_keep``) would keep among the local
    cuts and the newest, every cut without it (before a look at the mirror: what it lacks is unknown,
    and a policy of ckptstore's keeps no fewer of these among the local cuts alone than among the
    mirror's and the local ones). ORed into the local ``keep``."""

    ids: frozenset[str] | None
    unseen: Policy | None = None

    def keep(self, cuts: Sequence[Any]) -> set[str]:
        if self.ids is not None:
            return {c.id for c in cuts if c.id in self.ids}
        if self.unseen is None or not cuts:
            return {c.id for c in cuts}
        return self.unseen.keep(cuts) | {max(cuts, key=lambda c: c.step).id}


class MirrorTier:
    """The backlog of cuts for the mirror and the thread that uploads them (see the module docstring)."""

    def __init__(self, source: Storage, url: str, options: StoreOptions | None, keep: Policy | None,
                 events: Emitter, *, retry_s: float, source_options: StoreOptions | None = None,
                 progress: Callable[[int], None] | None = None,
                 on_state: Callable[[], None] | None = None, gate: Gate | None = None,
                 upload: Callable[[Store, Store, CutInfo, Callable[[int], None]], CutInfo] | None = None) -> None:
        """``source``: the local tier's storage (read through a reader handle of its own); ``progress``:
        called with each count of bytes uploaded (the writer process's liveness, issue 21); ``on_state``:
        called when :meth:`state` changed other than by an event (after a look at both stores, a prune);
        ``upload``: one cut onto the mirror (``mirror_cut``; rank 0 of several: ``mirror_ranks``)."""
        self.url = url
        self._upload_cut = upload or (lambda r, m, info, progress: spi.mirror_cut(r, m, info.id, progress=progress))
        self._source, self._options, self._keep, self._events = source, options, keep, events
        self._source_options, self._progress, self._on_state = source_options, progress, on_state
        #: The writes of local cuts this upload yields to (``Gate``).
        self.gate = gate if gate is not None else Gate()
        self._retry_s = retry_s
        self._rescan = False
        self._cond = threading.Condition()
        self._backlog: dict[str, CutInfo] = {}  # committed locally, not yet on the mirror
        self._uploading: CutInfo | None = None
        self._on_mirror: dict[str, CutInfo] = {}  # what the mirror holds, as far as this tier knows
        self._gone: dict[str, BaseException | str] = {}  # cut -> why it will not reach the mirror
        self._scanned = False
        self._stopping = False
        self._failures = 0
        self._last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptstore-mirror", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------------ the Checkpointer's side
    def submit(self, info: CutInfo) -> None:
        """A cut just committed locally (the commit thread, after its ``committed`` event). One the
        tier already uploaded or gave up is not queued again: the look at both stores may have found
        it, and uploaded it, before its submit came (a second ``mirrored`` event, seen in a test)."""
        with self._cond:
            if info.id not in self._on_mirror and info.id not in self._gone:
                self._backlog[info.id] = info
            self._cond.notify_all()

    def hold(self) -> Policy:
        """What the local prune keeps besides ``keep`` (issue 21: a local cut that ``mirror_keep`` would
        keep and that is not yet on the mirror is never pruned locally; until the first look at both
        stores, what ``mirror_keep`` keeps of the local cuts, every cut without it)."""
        held = self.held()
        return Hold(None if held is None else frozenset(held), self._keep)

    def held(self) -> set[str] | None:
        """The ids :meth:`hold` keeps (None: every cut). A waiting cut that ``mirror_keep`` would not
        keep (among the mirror's cuts and the waiting ones) is not held, the newest waiting one always:
        so a mirror that is down costs the local tier at most what ``mirror_keep`` keeps."""
        with self._cond:
            if not self._scanned:
                return None
            waiting = self._waiting()
            if self._keep is None or not waiting:
                return set(waiting)
            kept = self._keep.keep([*self._on_mirror.values(), *waiting.values()])
            newest = max(waiting.values(), key=lambda c: c.step)
            return {i for i in waiting if i in kept or i == newest.id}

    def _waiting(self) -> dict[str, CutInfo]:
        out = dict(self._backlog)
        if self._uploading is not None:
            out[self._uploading.id] = self._uploading
        return out

    def state(self) -> dict[str, Any]:
        """What the Checkpointer's side needs to know of this tier (the writer process sends it with
        each of its events, issue 21): whether both stores were looked at, the cuts waiting or
        uploading, those the local prune must keep (None: every cut), the last error."""
        with self._cond:
            held = self.held()
            return {"scanned": self._scanned, "waiting": sorted(self._waiting()),
                    "held": None if held is None else sorted(held),
                    "last_error": None if self._last_error is None else
                    f"{type(self._last_error).__name__}: {self._last_error}"}

    def rescan(self) -> None:
        """Looks at both stores again before the next upload (a cut committed by the rescue, which never
        passed through ``submit``)."""
        with self._cond:
            self._rescan = True
            self._cond.notify_all()

    def wait(self, cut: str, timeout: float) -> CutInfo:
        """Returns the mirror's info of ``cut`` once it is there; ``MirrorTimeout`` after ``timeout``
        seconds, or the error that ended its upload for good."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while cut not in self._on_mirror:
                why = self._gone.get(cut)
                if isinstance(why, BaseException):
                    raise why
                if why is not None:
                    raise WriterError(f"cut {cut} will not reach the mirror {self.url}: {why}", store=self.url, cut=cut)
                if not self._cond.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    raise self._timeout(timeout, [cut])
            return self._on_mirror[cut]

    def drain(self, timeout: float) -> None:
        """Waits until nothing is left to upload; ``MirrorTimeout`` naming what is left after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._backlog or self._uploading is not None:
                if not self._cond.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    left = sorted(self._backlog.values(), key=lambda c: c.step)
                    if self._uploading is not None:
                        left.insert(0, self._uploading)
                    raise self._timeout(timeout, [c.id for c in left])

    def close(self, join_s: float = JOIN_S) -> None:
        """Stops the thread (after the upload under way, bounded by ``join_s``); what is left waiting
        stays committed locally, for the next open's catch-up."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(join_s)

    def _timeout(self, timeout: float, cuts: list[str]) -> MirrorTimeout:
        last = f"; last error: {type(self._last_error).__name__}: {self._last_error}" if self._last_error else ""
        return MirrorTimeout(f"{len(cuts)} cut(s) did not reach the mirror {self.url} within {timeout:g} s "
                             f"({', '.join(cuts)}){last}; every cut stays committed locally", store=self.url,
                             cut=cuts[0], hint="the next Checkpointer open uploads what the mirror lacks")

    # ------------------------------------------------------------------------------- the mirror thread
    def _run(self) -> None:
        stores: tuple[Store, Store] | None = None
        try:
            while True:
                if stores is None:
                    stores = self._connect()
                    if stores is None:
                        return
                try:
                    info = self._next(stores)
                except Exception as exc:  # noqa: BLE001 - the rescan failed: reported, retried
                    self._failed(None, exc, retry=True)
                    self.rescan()
                    close_both(stores)
                    stores = None
                    self._back_off()
                    continue
                if info is None:
                    return
                if not self._upload(*stores, info):
                    close_both(stores)
                    stores = None  # opened again: its recovery removes what the failed copy left
                    self._back_off()
        finally:
            if stores is not None:
                close_both(stores)
            with self._cond:
                self._uploading = None
                self._cond.notify_all()

    def _connect(self) -> tuple[Store, Store] | None:
        """A reader of the local tier and the mirror's writer handle, and (the first time) the catch-up;
        retried with backoff while the mirror cannot be reached. None once told to stop."""
        while not self._stopping:
            reader: Store | None = None
            try:
                reader = Store.open(self._source, readonly=True, options=self._source_options)
                mirror = Store.open(self.url, create=True, options=self._options)
            except Exception as exc:  # noqa: BLE001 - reported, retried
                if reader is not None:
                    reader.close()
                self._failed(None, exc, retry=True)
                self._back_off()
                continue
            try:
                if not self._scanned:
                    self._scan(reader, mirror)
                return reader, mirror
            except Exception as exc:  # noqa: BLE001 - reported, retried
                close_both((reader, mirror))
                self._failed(None, exc, retry=True)
                self._back_off()
        return None

    def _scan(self, reader: Store, mirror: Store) -> None:
        """The catch-up: every local committed cut the mirror lacks (a cut recorded bad left out) joins
        the backlog; what the mirror holds is remembered for ``mirror_keep``'s choices."""
        have = spi.classify(mirror)
        local = spi.classify(reader)
        with self._cond:
            self._on_mirror.update({m.cut: have.info(m) for m in have.committed})
            for m in local.committed:
                if m.cut not in self._on_mirror and m.cut not in local.bad:
                    self._backlog.setdefault(m.cut, local.info(m))
            self._scanned = True
            self._cond.notify_all()
        self._changed()

    def _next(self, stores: tuple[Store, Store]) -> CutInfo | None:
        """The oldest cut left to upload once the backlog's unkept cuts are skipped (after a rescan,
        when one was asked for: outside the lock, so the loop's submit and hold never wait on I/O);
        None once stopping."""
        while True:
            with self._cond:
                while not self._backlog and not self._stopping and not self._rescan:
                    self._cond.wait()
                if self._stopping:
                    return None
                rescan, self._rescan = self._rescan, False
                if not rescan:
                    skipped = self._skip_unkept()
                    info = min(self._backlog.values(), key=lambda c: c.step)
                    del self._backlog[info.id]
                    self._uploading = info
            if not rescan:
                # Emitted outside the lock: the writer process's sink takes a lock of its own and
                # then this one (for the state it sends), so emitting under it could deadlock.
                for c in skipped:
                    self._events.emit("mirror-skipped", step=c.step, cut=c.id, reason=self._gone[c.id])
                return info
            self._scan(*stores)  # an error: the caller reports it and asks for the rescan again

    def _skip_unkept(self) -> list[CutInfo]:
        """Behind (more than one cut waiting): drops those ``mirror_keep`` would not keep, never the
        newest; returns them (under the lock: the caller emits their events after it)."""
        if self._keep is None or len(self._backlog) < 2:
            return []
        kept = self._keep.keep([*self._on_mirror.values(), *self._backlog.values()])
        newest = max(self._backlog.values(), key=lambda c: c.step)
        out = []
        for info in sorted(self._backlog.values(), key=lambda c: c.step):
            if info.id not in kept and info is not newest:
                del self._backlog[info.id]
                self._gone[info.id] = f"skipped: the mirror fell behind and mirror_keep keeps step {newest.step}"
                out.append(info)
        return out

    def _upload(self, reader: Store, mirror: Store, info: CutInfo) -> bool:
        """One cut onto the mirror, then the mirror's prune; False when it should be tried again."""
        t0 = time.perf_counter()
        try:
            got = self._upload_cut(reader, mirror, info, self._piece)
        except CutNotFound as exc:  # pruned locally meanwhile: nothing to upload
            self._end(info, exc)
            self._events.emit("mirror-skipped", step=info.step, cut=info.id, reason=str(exc))
            return True
        except (DataError, MirrorConflict) as exc:  # proven damage, or another run's mirror: not retried
            self._end(info, exc)
            self._failed(info, exc, retry=False)
            return True
        except Exception as exc:  # noqa: BLE001 - the mirror failed: back in the backlog, tried again
            with self._cond:
                self._backlog[info.id] = info
                self._uploading = None
                self._cond.notify_all()
            self._failed(info, exc, retry=True)
            return False
        self._failures, self._last_error = 0, None
        seconds = round(time.perf_counter() - t0, 6)
        with self._cond:
            self._on_mirror[info.id] = got
            self._uploading = None
            self._cond.notify_all()
        # After the state changed: the event carries the state that follows it (the writer process's).
        self._events.emit("mirrored", step=info.step, cut=info.id, bytes=got.nbytes, seconds=seconds)
        self._prune_mirror(mirror, info)
        return True

    def _piece(self, n: int) -> None:
        """After each piece uploaded: a local cut being written goes first (``Gate``)."""
        if self._progress is not None:
            self._progress(n)
        self.gate.wait_idle()

    def _prune_mirror(self, mirror: Store, info: CutInfo) -> None:
        if self._keep is None:
            return
        try:
            removed = mirror.prune(self._keep)
        except Exception as exc:  # noqa: BLE001 - the upload stands; say so and go on
            self._events.emit("warning", step=info.step, message=f"mirror prune failed: {exc}")
            return
        with self._cond:
            for c in removed:
                self._on_mirror.pop(c.id, None)
        self._changed()

    def _changed(self) -> None:
        if self._on_state is not None:
            self._on_state()

    def _end(self, info: CutInfo, why: BaseException) -> None:
        with self._cond:
            self._gone[info.id] = why
            self._uploading = None
            self._cond.notify_all()

    def _failed(self, info: CutInfo | None, exc: BaseException, *, retry: bool) -> None:
        self._last_error = exc
        if retry:
            self._failures += 1
        self._events.emit("mirror-failed", step=info.step if info else None, cut=info.id if info else None,
                          error=str(exc), error_type=type(exc).__name__, attempt=self._failures,
                          retry_in=round(self._delay(), 3) if retry else None)

    def _delay(self) -> float:
        return min(self._retry_s * 2 ** max(0, self._failures - 1), RETRY_MAX_S)

    def _back_off(self) -> None:
        """Waits before the next attempt; a stop ends the wait at once."""
        deadline = time.monotonic() + self._delay()
        with self._cond:
            while not self._stopping and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())


def close_both(stores: tuple[Store, Store]) -> None:
    for store in stores:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - a handle that cannot close releases nothing more
            pass


__all__ = ["Hold", "MirrorTier", "MirrorTimeout", "close_both"]
