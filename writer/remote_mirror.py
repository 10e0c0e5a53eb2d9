"""The mirror tier in the writer process (issue 21: "the upload runs in the writer process (niced),
never in the training loop"): :class:`WorkerMirror` runs :class:`~ckptstore.writer.mirror.MirrorTier`
inside the worker, and :class:`RemoteMirror` is the Checkpointer's side of it, with the same face as
the tier (``submit``, ``hold``, ``wait``, ``drain``, ``close``).

- The trainer sends ``mirror-open`` once per writer process (the mirror's URL, its options' plain
  fields, ``mirror_keep`` in its JSON form: no pickle crosses), then ``mirror-submit`` for each cut it
  commits locally, numbered. The worker's mirror thread answers with ``mirror-update`` frames at any
  time: each of its events (re-emitted here, so the JSON-lines log reads as with a thread) and the
  tier's state (looked at both stores yet, the cuts waiting, those the local prune must keep, the
  highest submit number it has taken in).
- **What the local prune spares** is the worker's ``held`` plus every cut submitted after the number
  its last state took in (sent, not yet seen there); before the worker's first look at both stores,
  and from a writer's death until the next one has looked, every cut.
- **A writer that dies** takes its backlog with it; the next writer process (the next cut's, or the one
  ``wait``/``drain`` start) looks at both stores again, so nothing committed locally is forgotten.
- **A trainer that dies**: the orphaned writer finishes the cut in hand (the rescue), looks at both
  stores again and uploads what the mirror lacks, bounded by ``mirror_timeout``, then exits
  (:meth:`WorkerMirror.finish`); what it does not get to, the next Checkpointer open catches up.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Callable

from ckptstore import CutInfo, StoreOptions, UsageError
from ckptstore import spi
from ckptstore.spi import Emitter, Policy, Storage

from . import protocol as P
from .errors import WriterError
from .gate import Gate
from .mirror import Hold, MirrorTier, MirrorTimeout
from .mirror_ranks import FollowerTier, agreed_wait, make_tier

#: How long a writer told to shut down lets an upload under way end before it exits anyway (the
#: mirror's next writer open removes what a cut-off upload left).
STOP_JOIN_S = 2.0


def open_message(url: str, options: StoreOptions | None, keep: Policy | None, *, retry_s: float,
                 timeout_s: float, ranks: Any = None) -> P.MirrorOpen:
    """The ``mirror-open`` frame; a UsageError when the mirror's settings cannot reach another process."""
    doc: dict[str, Any] = {}
    if options is not None:
        if options.on_event is not None or options.on_phase is not None:
            raise UsageError("mirror_options with on_event or on_phase cannot reach the writer process that "
                             "uploads to the mirror", store=url,
                             hint="watch the Checkpointer's events (mirrored, mirror-failed), or use mode='thread'")
        doc = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
               if f.name not in ("on_event", "on_phase")}
        try:
            json.dumps(doc)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"mirror_options cannot travel to the writer process as JSON: {exc}", store=url) from None
    try:
        keep_doc = None if keep is None else spi.policy_to_json(keep)
    except TypeError as exc:
        raise UsageError(f"mirror_keep: {exc}; the writer process applies it", store=url,
                         hint="compose ckptstore's policies, or use mode='thread'") from None
    where = {} if ranks is None else {"rank": ranks.rank, "world_size": ranks.size, "rank_timeout": ranks.rank_timeout}
    return P.MirrorOpen(url=url, options=doc, keep=keep_doc, retry_s=retry_s, timeout_s=timeout_s, **where)


class WorkerMirror:
    """The mirror tier inside the writer process, reporting to its trainer through ``send``."""

    def __init__(self, msg: P.MirrorOpen, source: Storage, send: Callable[[P.StrictModel], None],
                 progress: Callable[[int], None], gate: Gate) -> None:
        """``gate``: held by the worker while it writes a cut's shards, which the uploads yield to."""
        self._send, self._seq, self.timeout_s = send, 0, msg.timeout_s
        self._lock = threading.Lock()
        keep = None if msg.keep is None else spi.policy_from_json(msg.keep)
        self.tier = make_tier(source, msg.url, StoreOptions(**msg.options), keep, Emitter(msg.url, self._event),
                              rank=msg.rank, world_size=msg.world_size, rank_timeout=msg.rank_timeout,
                              retry_s=msg.retry_s, progress=progress, on_state=lambda: self._update(None), gate=gate)
        self.tier.start()

    def submit(self, msg: P.MirrorSubmit) -> None:
        # In the tier first, then numbered: a state that carries this number holds the cut (waiting,
        # or already ended with its event sent before it).
        self.tier.submit(CutInfo.from_json(msg.cut))
        with self._lock:
            self._seq = int(msg.cut.get("seq", self._seq + 1))
        self._update(None)

    def finish(self) -> None:
        """The trainer is gone: what the mirror lacks (the rescued cut among it) is uploaded, bounded by
        ``mirror_timeout``; then the tier stops."""
        self.tier.rescan()
        try:
            self.tier.drain(self.timeout_s)
        except MirrorTimeout:
            pass  # what is left waits for the next Checkpointer open's catch-up
        self.tier.close()

    def stop(self) -> None:
        self.tier.close(STOP_JOIN_S)

    def _event(self, event: dict[str, Any]) -> None:
        self._update({k: v for k, v in event.items() if k not in ("ts", "store")})

    def _update(self, event: dict[str, Any] | None) -> None:
        """One frame; the state is taken and sent under one lock, so frames arrive in the order their
        states were taken (two threads send: a state older than the last one sent never follows it).
        Never called under the tier's lock (lock order: this one, then the tier's)."""
        doc = json.loads(json.dumps(event, default=str)) if event else None
        with self._lock:
            self._send(P.MirrorUpdate(event=doc, state={**self.tier.state(), "seq": self._seq}))


class RemoteMirror:
    """The Checkpointer's side of the tier its writer process runs (see the module docstring)."""

    def __init__(self, url: str, open_msg: P.MirrorOpen, events: Emitter,
                 restart: Callable[[], Any]) -> None:
        """``restart``: starts a writer process when none runs (its start calls :meth:`attach`)."""
        self.url, self._open, self._events, self._restart = url, open_msg, events, restart
        self._keep = None if open_msg.keep is None else spi.policy_from_json(open_msg.keep)
        self._cond = threading.Condition()
        self._writer: Any = None
        self._state: dict[str, Any] = _UNSEEN
        self._seq = 0
        self._sent: dict[str, int] = {}  # cut -> its submit number, to this writer
        self._mirrored: set[str] = set()
        self._gone: dict[str, str] = {}

    def start(self) -> None:
        """Nothing to start here: the tier starts with each writer process (:meth:`attach`)."""

    def attach(self, writer: Any) -> None:
        """A writer process started: it is told of the mirror and looks at both stores (its catch-up
        covers every cut the last one did not upload)."""
        with self._cond:
            self._writer, self._state, self._sent = writer, _UNSEEN, {}
        writer.on_mirror = self._update
        writer.send(self._open)

    def submit(self, info: CutInfo) -> None:
        """A cut just committed locally (the commit thread): sent to the writer's tier."""
        with self._cond:
            self._seq += 1
            seq, writer = self._seq, self._writer
            self._sent[info.id] = seq
        if writer is not None:
            try:
                writer.send(P.MirrorSubmit(cut={**info.to_json(), "metadata": info.metadata, "seq": seq}))
            except WriterError:
                pass  # dead: the next writer's look at both stores finds the cut

    def hold(self) -> Policy:
        with self._cond:
            state = self._state
            if not state["scanned"] or state["held"] is None:
                return Hold(None, self._keep)
            unseen = {c for c, n in self._sent.items() if n > state["seq"]}
            return Hold(frozenset(set(state["held"]) | unseen))

    def wait(self, cut: str, timeout: float) -> None:
        """Returns once ``cut`` is on the mirror; ``MirrorTimeout`` after ``timeout``, or a WriterError
        naming why its upload ended for good."""
        self._wait(lambda: self._settled(cut), timeout, [cut])
        if cut in self._gone:
            raise WriterError(f"cut {cut} will not reach the mirror {self.url}: {self._gone[cut]}",
                              store=self.url, cut=cut)

    def drain(self, timeout: float) -> None:
        """Waits until nothing is left to upload; ``MirrorTimeout`` naming what is left after ``timeout``."""
        self._wait(lambda: not self._pending(), timeout, None)

    def close(self) -> None:
        """Nothing here: the writer process's shutdown stops its tier."""

    # ---------------------------------------------------------------------------------------- internals
    def _pending(self) -> list[str]:
        state = self._state
        if not state["scanned"]:
            return ["(the writer has not looked at both stores yet)"]
        unseen = [c for c, n in self._sent.items() if n > state["seq"]]
        return sorted(set(state["waiting"]) | set(unseen))

    def _settled(self, cut: str) -> bool:
        if cut in self._mirrored or cut in self._gone:
            return True
        return self._state["scanned"] and cut not in self._pending()

    def _wait(self, done: Callable[[], bool], timeout: float, cuts: list[str] | None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.ensure_writer()
            with self._cond:
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout(timeout, cuts or self._pending())
                self._cond.wait(min(left, 1.0))  # a second at most: a writer that died is started again

    def ensure_writer(self) -> None:
        """A writer process (so this tier) runs: one that died is started again."""
        with self._cond:
            writer = self._writer
        if writer is None or not writer.alive:
            self._restart()

    def _update(self, msg: P.MirrorUpdate | None) -> None:
        """A frame from the writer's mirror thread (None: its channel ended, the writer is gone)."""
        with self._cond:
            if msg is None:
                self._writer, self._state = None, _UNSEEN
                self._cond.notify_all()
                return
            self._state = msg.state
            event = msg.event
            cut = event.get("cut") if event else None
            if event and cut and event.get("event") == "mirrored":
                self._mirrored.add(cut)
            elif event and cut and (event.get("event") == "mirror-skipped"
                                    or event.get("event") == "mirror-failed" and event.get("retry_in") is None):
                self._gone[cut] = str(event.get("reason") or f"{event.get('error_type')}: {event.get('error')}")
            self._cond.notify_all()
        if event:
            fields = {k: v for k, v in event.items() if k != "event"}
            self._events.emit(event["event"], **fields)

    def _timeout(self, timeout: float, cuts: list[str]) -> MirrorTimeout:
        last = self._state.get("last_error")
        return MirrorTimeout(f"{len(cuts)} cut(s) did not reach the mirror {self.url} within {timeout:g} s "
                             f"({', '.join(cuts)}){f'; last error: {last}' if last else ''}; every cut stays "
                             "committed locally", store=self.url, cut=cuts[0] if cuts else None,
                             hint="the next Checkpointer open uploads what the mirror lacks")


def check_mirror_args(mirror: str | None, mirror_options: StoreOptions | None, options: Any, group: Any) -> None:
    """The Checkpointer's mirror arguments make sense together (issue 21; with ``group=`` every rank's
    tier uploads its own files: ``mirror_ranks``)."""
    if mirror is None and (mirror_options is not None or options.mirror_keep is not None):
        raise UsageError("mirror_options and mirror_keep go with mirror=URL")
    if mirror is not None and options.mode == "process":
        # Before the store is opened: a refused setting must not leave it locked.
        open_message(mirror, mirror_options, options.mirror_keep, retry_s=options.mirror_retry_s,
                     timeout_s=options.mirror_timeout)


class RankedMirror:
    """The tier of one rank of a Checkpointer with ``group=`` (issue 21): this rank's tier (rank 0's
    backlog, or a follower of its marks: ``mirror_ranks``), whose waits every rank takes together:
    rank 0 alone knows when a cut is on the mirror, and posts it (``agreed_wait``)."""

    def __init__(self, tier: MirrorTier | FollowerTier | RemoteMirror, ranks: Any,
                 last_cut: Callable[[], str | None]) -> None:
        """``last_cut``: the id of the last cut taken (the same on every rank), naming the close's wait."""
        self.tier, self.url, self._ranks, self._last_cut = tier, tier.url, ranks, last_cut

    @property
    def gate(self) -> Gate | None:
        """The tier's gate when it runs in this process (thread mode), else None."""
        return None if isinstance(self.tier, RemoteMirror) else self.tier.gate

    def start(self) -> None:
        self.tier.start()

    def attach(self, writer: Any) -> None:
        if isinstance(self.tier, RemoteMirror):
            self.tier.attach(writer)

    def submit(self, info: CutInfo) -> None:
        self.tier.submit(info)

    def hold(self) -> Policy:
        """What rank 0's local prune spares (only rank 0 prunes: issue 24's shared local store)."""
        return self.tier.hold() if not isinstance(self.tier, FollowerTier) else Hold(frozenset())

    def wait(self, cut: str, timeout: float) -> None:
        """Every rank returns once ``cut`` is committed on the mirror, or raises what rank 0 raised."""
        agreed_wait(self._ranks, f"mirror-wait/{cut}", lambda: self.tier.wait(cut, timeout),
                    f"rank 0's wait for cut {cut} on the mirror", self.url, before=self._ensure)

    def drain(self, timeout: float) -> None:
        """Every rank returns once rank 0's backlog is done (this rank's tier serving it meanwhile), or
        raises what rank 0 raised."""
        agreed_wait(self._ranks, f"mirror-drain/{self._last_cut() or 'none'}", lambda: self.tier.drain(timeout),
                    "rank 0's wait for the mirror's backlog", self.url, before=self._ensure)

    def close(self) -> None:
        self.tier.close()

    def _ensure(self) -> None:
        if isinstance(self.tier, RemoteMirror):
            self.tier.ensure_writer()  # rank 0 may wait for this rank's part: its writer must run


def start_tier(url: str, options: StoreOptions | None, o: Any, store: Any, events: Emitter,
               pipeline: Any) -> MirrorTier | RemoteMirror | RankedMirror:
    """The Checkpointer's mirror tier (issue 21), attached to its commit pipeline and started: in
    process mode the writer process uploads (niced, off the trainer's interpreter), else a thread here;
    with ``group=``, every rank's (``RankedMirror``)."""
    ranks = store.ranks
    tier: MirrorTier | FollowerTier | RemoteMirror
    if o.mode == "process":
        msg = open_message(url, options, o.mirror_keep, retry_s=o.mirror_retry_s, timeout_s=o.mirror_timeout,
                           ranks=ranks)
        tier = RemoteMirror(url, msg, events, restart=pipeline.ensure_writer)
    else:
        where = {"rank": 0, "world_size": 1, "rank_timeout": 300.0} if ranks is None else {
            "rank": ranks.rank, "world_size": ranks.size, "rank_timeout": ranks.rank_timeout}
        tier = make_tier(store.storage, url, options, o.mirror_keep, events, retry_s=o.mirror_retry_s,
                         source_options=store.options, **where)
    out: Any = tier if ranks is None else RankedMirror(tier, ranks, lambda: _last_id(pipeline.cuts.current))
    pipeline.mirror = out
    out.start()
    return out


def _last_id(handle: Any) -> str | None:
    return None if handle is None else handle.id


_UNSEEN: dict[str, Any] = {"scanned": False, "waiting": [], "held": None, "last_error": None, "seq": 0}

__all__ = ["RankedMirror", "RemoteMirror", "WorkerMirror", "check_mirror_args", "open_message", "start_tier"]
