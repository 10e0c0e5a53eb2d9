"""The trainer-facing facade: ``Checkpointer.maybe_cut`` / ``cut`` / ``close``.

A cut costs the loop only :func:`~ckptstore.writer.capture.capture`. A commit thread then begins the
cut in the store (a :class:`~ckptstore.pending.PendingCut`), has the writer process write its shards
from the shared block, records them in the pending cut, commits it, and prunes. If the writer process
dies or hangs, the commit thread discards the partial files and writes the same shards itself from the
same block (event ``fallback``); a new writer process is started for the next cut. Shard settings
(compression, shard size) are the store's (``StoreOptions``), never the Checkpointer's.

With ``group=`` (several ranks of a torch.distributed job) the constructor, ``maybe_cut``, ``cut`` and
``close`` are collective: the ranks agree on every cut (the same step, skip-if-busy for all or none,
earlier failures reported everywhere at the same call), each rank's commit thread writes its part and
publishes its record, and rank 0's commit thread commits once every part is durable
(:mod:`ckptstore.writer.ranked`).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from typing import Any, Sequence

from ckptstore import layout
from ckptstore.attached import FilesArg
from ckptstore.errors import StepConflict, UsageError
from ckptstore.events import Emitter, JsonLinesFile
from ckptstore.collective import Collective
from ckptstore.manifest import FileRecord, TensorRecord
from ckptstore.options import StoreOptions
from ckptstore.pending import PendingCut, RankPart
from ckptstore.info import CutInfo
from ckptstore.intent import CutIntent, ShardSpec
from ckptstore.ranks import check_all_ok, check_same, outcome
from ckptstore.retention import Policy
from ckptstore.storage import StorageSpec
from ckptstore.store import Store

from . import protocol as P
from .capture import Captured, Pinning, capture
from .committer import CutHandle, elapsed
from .errors import WriterDied, WriterError, WriterTimeout
from .options import WriterOptions
from .plan import grown_size
from .preemption import PreemptionWatch
from .process import WriterProcess
from .ranked import RankedCuts
from .shm import Block


#: An argument not passed (``None`` is a value ``keep`` takes).
_UNSET: Any = object()


def _writer_options(options: WriterOptions | None, **given: Any) -> WriterOptions:
    """``options``, or the WriterOptions the keywords make. Both at once is a UsageError naming the
    keywords: ``options`` silently won before, so ``every``, ``keep``, ``mode`` and ``busy`` were
    ignored (issue 20)."""
    given = {k: v for k, v in given.items() if v is not _UNSET}
    if options is None:
        try:
            return WriterOptions(**given)
        except (TypeError, ValueError) as exc:  # an unknown keyword, a value out of range
            raise UsageError(f"Checkpointer: {exc}") from None
    if given:
        raise UsageError(f"Checkpointer takes options= or its keywords, not both: {sorted(given)} would be "
                         "ignored", hint="put them in the WriterOptions: dataclasses.replace(options, ...)")
    return options


class Checkpointer:
    """Takes background cuts of a training state into a store (see docs/writer.md)."""

    def __init__(
        self,
        url_or_store: str | Store,
        *,
        every: int = _UNSET,  # type: ignore[assignment]
        keep: Policy | None = _UNSET,  # type: ignore[assignment]
        mode: str = _UNSET,  # type: ignore[assignment]
        busy: str = _UNSET,  # type: ignore[assignment]
        options: WriterOptions | None = None,
        store_options: StoreOptions | None = None,
        group: Any = None,
        rank_timeout: float | None = None,
        **more: Any,
    ) -> None:
        """``url_or_store``: a URL (the store is opened, and created when missing, with
        ``store_options``: compression, shard size, storage_options) or an open writer ``Store``.
        ``group``: a torch.distributed process group whose ranks take cuts together (collective calls;
        ``rank_timeout`` as in ``Store.open``); None is one process."""
        self.options = options = _writer_options(options, every=every, keep=keep, mode=mode, busy=busy, **more)
        if isinstance(url_or_store, Store):
            if store_options is not None:
                raise UsageError("store_options go with a URL; this store was opened with its own options",
                                 store=url_or_store.url)
            if group is not None and url_or_store.ranks is None:
                raise UsageError("group= needs a store opened with group= (or pass the URL)", store=url_or_store.url)
            self.store, self._owns_store = url_or_store, False
        else:
            self.store, self._owns_store = Store.open(url_or_store, create=True, options=store_options, group=group,
                                                      rank_timeout=rank_timeout), True
        if self.store.readonly:
            raise UsageError("a Checkpointer needs a store opened for writing", store=self.store.url)
        #: The ranks this checkpointer cuts with (None: one process).
        self.ranked: RankedCuts | None = RankedCuts(self, self.store.ranks) if self.store.ranks is not None else None
        #: How each cut's steps run over the ranks (world size 1: plain calls): one pipeline for both.
        self.collective = self.ranked.collective if self.ranked is not None else Collective(None, store=self.store.url)
        try:
            spec = self._writer_spec(options)
        except BaseException as exc:
            if self.ranked is not None:
                self.ranked.agree_ready(exc)
            if self._owns_store:
                self.store.close()
            raise
        self._spec = spec
        self._jsonl = JsonLinesFile(options.events_path) if options.events_path else None
        self.events = Emitter(self.store.url, self._fan_out)
        self._block: Block | None = None
        self._pinning = Pinning()
        self._writer: WriterProcess | None = None
        self._current: CutHandle | None = None
        self._handles: list[CutHandle] = []
        self.store.latest()  # a broken LATEST fails here, not at the first cut
        self._last_step: int | None = None  # this checkpointer's last cut; None before its first
        self.skipped = 0
        self.waited = 0
        self._closed = False
        self._jobs: queue.Queue[tuple[CutHandle, Captured, dict[str, Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if options.mode == "process":
            self._writer = self._start_writer()
        if options.mode in ("process", "thread"):
            self._thread = threading.Thread(target=self._run, name="ckptstore-commit", daemon=True)
            self._thread.start()
        atexit.register(self._at_exit)
        #: True once a preemption cut (``preemption=True``) committed: the loop should end now.
        self.preempted = False
        self._preemption: PreemptionWatch | None = None
        try:
            if options.preemption:
                self._preemption = PreemptionWatch(store=self.store.url)
        except BaseException as exc:
            if self.ranked is not None:
                self.ranked.agree_ready(exc)
            self.close_locally()
            raise
        if self.ranked is not None:
            try:
                self.ranked.agree_ready(None)
            except BaseException:
                self.close_locally()
                raise

    # ------------------------------------------------------------------------------------ public API
    def maybe_cut(self, step: int, state: Any, **kw: Any) -> CutHandle | None:
        """Takes a cut when ``step % every == 0`` and none is in flight (``busy="skip"``); returns its
        handle, or None when no cut is due or it was skipped. Keywords: ``tags``, ``metadata``,
        ``allow_pickle`` as in ``Store.save``, and ``files`` (files that belong to the cut, read here
        at capture: ``ckptstore.attached``; put back with ``restore(..., files_to=)``).

        With ``preemption=True``, after SIGTERM or SIGUSR1 (on any rank) it instead takes a cut of this
        step whatever ``every`` says, tagged "preempted", waits until it is committed and sets
        :attr:`preempted` (docs/writer.md, "Preemption")."""
        if self._preemption is not None:
            handle = self._preempt(step, state, **kw)
            if handle is not None:
                return handle
        if self.ranked is not None:
            if step % self.options.every != 0:
                return None
            return self.ranked.take(step, state, periodic=True, **kw)
        self._raise_unreported()
        if step % self.options.every != 0:
            return None
        return self._take(step, state, periodic=True, **kw)

    def cut(self, step: int, state: Any, *, final: bool = False, **kw: Any) -> CutHandle:
        """Takes a cut now whatever ``every`` says; waits for one in flight first. With ``final`` it
        also marks the cut final and waits until it is committed."""
        if self.ranked is not None:
            handle = self.ranked.take(step, state, periodic=False, final=final, **kw)
            assert handle is not None
            if final:
                self.ranked.wait_committed(handle)
            return handle
        self._raise_unreported()
        handle = self._take(step, state, periodic=False, final=final, **kw)
        assert handle is not None
        if final:
            handle.wait()
        return handle

    def mark_final(self, step: int | None = None) -> CutInfo:
        """Marks the last committed cut final without writing it again (``Store.mark_final``): for a loop
        whose last periodic cut already holds its final state, so ``resume-info`` reports the step
        where the run ended. Waits for a cut in flight first (its failure is raised). With ``step``,
        raises ``StepConflict`` (marking nothing) unless the last committed cut is of that step (a
        periodic cut of it may have been skipped: then take ``cut(step, state, final=True)``).
        Collective with ``group=``: rank 0 writes the mark, every rank returns the same CutInfo."""
        if self._closed:
            raise UsageError("the checkpointer is closed", store=self.store.url)
        if self._current is not None:
            self._current._done.wait()
        if self.ranked is None:
            self._raise_unreported()
            return self._mark_final(step)
        err: BaseException | None = None
        info: CutInfo | None = None
        if self.store.ranks is not None and self.store.ranks.rank == 0:
            try:
                self._raise_unreported()
                info = self._mark_final(step)
            except BaseException as exc:  # noqa: BLE001 - every rank hears of it below
                err = exc
        msgs = self.ranked.ranks.exchange("mark-final", {**outcome(err), "info": info.to_json() if info else None},
                                          **self.ranked.where)
        if err is not None:
            raise err
        check_all_ok(msgs, "marking the last cut final", **self.ranked.where)
        return CutInfo.from_json(msgs[0]["info"])

    def _mark_final(self, step: int | None) -> CutInfo:
        latest = self.store.latest()
        if latest is None or step is not None and latest.step != step:
            have = "no cut" if latest is None else f"step {latest.step}"
            raise StepConflict(f"the last committed cut is {have}, not step {step}: nothing marked final",
                               store=self.store.url, hint="take cut(step, state, final=True) instead")
        return self.store.mark_final(latest.id)

    def _preempt(self, step: int, state: Any, *, tags: Sequence[str] = (), **kw: Any) -> CutHandle | None:
        """The preemption cut of ``step`` when a notice arrived (on any rank: agreed every call), else None."""
        assert self._preemption is not None
        own = self._preemption.signal_name
        if self.ranked is not None:
            where = self.ranked.where
            msgs = self.ranked.ranks.exchange("preempt", {"step": step if isinstance(step, int) else repr(step),
                                                          "signal": own}, **where)
            check_same(msgs, ("step",), "maybe_cut", **where)
            notices = {r: m["signal"] for r, m in enumerate(msgs) if m["signal"]}
        else:
            notices = {0: own} if own else {}
        if not notices:
            return None
        t0 = time.perf_counter()
        handle = self.cut(step, state, tags=(*tags, "preempted"), **kw)
        if self.ranked is not None:
            self.ranked.wait_committed(handle)
        else:
            handle.wait()
        self._preemption.clear()
        self.preempted = True
        self.events.emit("preempted", step=step, cut=handle.id, signals=sorted(set(notices.values())),
                         ranks=sorted(notices), seconds=elapsed(t0))
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Drains the cut in flight, stops the writer, frees the block; raises what failed and was not
        yet reported. A failure here after a final cut committed does not touch that cut."""
        if self._closed:
            return
        if self.ranked is not None:
            if self._current is not None:
                self._current._done.wait(timeout)
            try:
                self.ranked.agree_close()
            except BaseException:
                self.close_locally(timeout)
                raise
        self.close_locally(timeout)

    def close_locally(self, timeout: float | None = None) -> None:
        """``close`` without agreeing with the other ranks (what is left when they are gone)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if self._preemption is not None:
            self._preemption.close()
        cleanup_errors: list[BaseException] = []
        if self._current is not None:
            self._current._done.wait(timeout)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
        for closer in (self._close_writer, self._close_block, self._close_store):
            try:
                closer()
            except BaseException as exc:  # noqa: BLE001 - keep closing; report below
                cleanup_errors.append(exc)
        self._raise_unreported()
        if cleanup_errors:
            # The last cut taken, not _handles: _raise_unreported above drops committed handles from it.
            final = [h for h in (self._current,) if h is not None and h.final and h.state == "committed"]
            note = f" (the final cut {final[-1].id} is committed and unaffected)" if final else ""
            raise WriterError(f"closing the checkpointer failed{note}: {cleanup_errors[0]}",
                              store=self.store.url) from cleanup_errors[0]

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer_pid(self) -> int | None:
        return self._writer.pid if self._writer is not None else None

    # ------------------------------------------------------------------------------------ internals
    def _writer_spec(self, options: WriterOptions) -> StorageSpec | None:
        """How the writer process reaches the store; a UsageError when process mode cannot."""
        spec = self.store.storage.spec()
        if options.mode != "process":
            return spec
        if spec is None:
            raise UsageError(
                "a writer process cannot reach this store: its storage lives in this process (fsspec's "
                "memory file system, or a Storage object passed to Store.open)", store=self.store.url,
                hint='use Checkpointer(..., mode="thread") for such stores')
        spec.check_json()
        return spec

    def _fan_out(self, event: dict[str, Any]) -> None:
        if self.store.ranks is not None:
            event.setdefault("rank", self.store.ranks.rank)
        if self.options.on_event is not None:
            self.options.on_event(event)
        if self._jsonl is not None:
            self._jsonl(event)

    def _start_writer(self) -> WriterProcess:
        assert self._spec is not None
        return WriterProcess(self._spec, self.options, lock=self.store.lock_handoff())

    def _raise_unreported(self) -> None:
        for h in self._handles:
            if h.done and h.error is not None and not h.reported:
                h.reported = True
                raise h.error
        self._handles = [h for h in self._handles if not h.done or (h.error is not None and not h.reported)]

    def _take(self, step: int, state: Any, *, periodic: bool, final: bool = False,
              tags: Sequence[str] = (), metadata: dict[str, Any] | None = None, allow_pickle: bool = False,
              files: FilesArg | None = None) -> CutHandle | None:
        if self._closed:
            raise UsageError("the checkpointer is closed", store=self.store.url)
        layout.check_step(step, store=self.store.url)
        current = self._current
        if current is not None and not current.done:
            if periodic and self.options.busy == "skip":
                self.skipped += 1
                self.events.emit("skipped", step=step, reason=f"cut {current.id} (step {current.step}) is still "
                                 f"{current.state}", skipped_total=self.skipped, waited_total=self.waited)
                return None
            self.waited += 1
            t_wait = time.perf_counter()
            current._done.wait()
            self.events.emit("waited", step=step, seconds=elapsed(t_wait), for_cut=current.id,
                             waited_total=self.waited)
            self._raise_unreported()
        last = self._last_step
        if last is None:
            # Before the first cut, LATEST as it is now: ``restore(ck.store, fallback=True)`` may have
            # moved it back to an older cut since construction (docs/resume.md).
            latest = self.store.latest()
            last = latest.step if latest is not None else None
        if last is not None and step <= last:
            raise StepConflict(f"step {step} is not above the last cut's step {last}", store=self.store.url)
        handle = CutHandle(step, layout.new_cut_id(step), final)
        try:
            captured = capture(state, self._block_for, allow_pickle=allow_pickle, device_copy=self.options.device_copy,
                               pinning=self._pinning, files=files, where={"store": self.store.url, "cut": handle.id})
        except BaseException as exc:
            handle.to_failed(exc)
            handle.reported = True
            self.events.emit("failed", step=step, cut=handle.id, stage="capture", error=str(exc),
                             error_type=type(exc).__name__)
            raise
        return self._launch(handle, captured, tags=tags, metadata=metadata, final=final)

    def _launch(self, handle: CutHandle, captured: Captured, *, tags: Sequence[str], metadata: dict[str, Any] | None,
                final: bool, **event: Any) -> CutHandle:
        """A captured cut goes on its way: recorded as the one in flight, announced (``captured``),
        handed to the writer process, queued for the commit thread (or processed here, inline)."""
        handle.to_writing()
        self._last_step = handle.step
        self._current = handle
        self._handles.append(handle)
        self.events.emit("captured", step=handle.step, cut=handle.id, stall_s=round(captured.seconds, 6),
                         bytes=captured.plan.payload, tensors=len(captured.plan.slots) - len(captured.attached),
                         attached_files=len(captured.attached), capture_mode=captured.mode,
                         capture_reason=captured.reason, writer_mode=self.options.mode,
                         skipped_total=self.skipped, waited_total=self.waited, **event)
        intent = CutIntent(tree=captured.tree, pickled=captured.pickled, attached=list(captured.attached),
                           tags=list(tags), final=final, metadata=metadata, mode=self.options.mode,
                           world_size=self.collective.size)
        job = (handle, captured, intent)
        self._hand_over(handle, captured, intent)
        if self.options.mode == "inline":
            self._process(*job)
        else:
            self._jobs.put(job)
        return handle

    def _block_for(self, nbytes: int) -> Block:
        """The shared block, grown (a new one, prefaulted) only when the state no longer fits. Only
        called when no cut is in flight, so no region still being written is ever reused. Its 1/8
        headroom is reserved and prefaulted only once a cut needs it (``Block.ensure``), so it costs
        no host memory until then."""
        if self._block is None or self._block.size < nbytes:
            size = grown_size(nbytes, self._block.size if self._block is not None else 0)
            self._close_block()
            self._block = Block.create(size, backed=nbytes)
        else:
            self._block.ensure(nbytes)
        return self._block

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._process(*job)

    def _process(self, handle: CutHandle, captured: Captured, intent: CutIntent) -> None:
        """One cut behind the loop, for one rank and many (issue 20): mark (rank 0), write this rank's
        part (writer process, else this thread) and publish it, commit (rank 0, once every rank's part
        is durable), prune (rank 0). Never raises: the outcome lands in the handle, and unreported
        failures surface at the next call (agreed by every rank at its next collective call) or at
        close."""
        c = self.collective
        t0 = time.perf_counter()
        pending: PendingCut | None = None
        t_commit = t0

        def part() -> None:
            nonlocal pending
            if c.coordinator:
                pending = self.store.begin_cut(handle.step, writer=f"checkpointer:{self.options.mode}", cut=handle.id,
                                               world_size=c.size)
            captured.ready()
            target: PendingCut | RankPart = pending if c.size == 1 else self.store.rank_part(handle.id, handle.step)  # type: ignore[assignment]
            files, tensors, timings = self._write(handle, captured, target)
            target.publish(files, tensors, intent)
            handle.timings.update(timings)
            self.events.emit("written", step=handle.step, cut=handle.id, bytes=sum(f.nbytes for f in files),
                             timings={k: round(v, 6) for k, v in timings.items()}, writer_mode=self.options.mode,
                             fallback=handle.fallback)
            handle.to_committing()

        def commit() -> CutInfo:
            nonlocal t_commit
            assert pending is not None
            t_commit = time.perf_counter()
            return pending.finish(intent)

        with c.busy():
            try:
                info = c.gather(handle.id, part, commit, share=lambda i: {**i.to_json(), "metadata": i.metadata},
                                receive=CutInfo.from_json, doing=f"cut {handle.id}",
                                note=lambda: PendingCut.left_as(pending))
            except BaseException as exc:  # noqa: BLE001 - recorded in the handle, raised later
                self._fail(handle, pending, exc)
                return
        self._end_cut(handle)
        handle.to_committed(info)
        ranked = {"world_size": c.size} if c.size > 1 else {}
        self.events.emit("committed", step=handle.step, cut=handle.id, bytes=info.nbytes,
                         timings={"commit": elapsed(t_commit) if c.coordinator else None, "total": elapsed(t0)},
                         writer_mode=self.options.mode, fallback=handle.fallback, final=intent.final, **ranked)
        if c.coordinator and self.options.keep is not None:
            try:
                self.store.prune(self.options.keep)
            except BaseException as exc:  # noqa: BLE001 - a failed prune never fails a committed cut
                self.events.emit("warning", step=handle.step, message=f"prune failed: {exc}")

    def _fail(self, handle: CutHandle, pending: PendingCut | None, exc: BaseException) -> None:
        if pending is not None:
            # Before the commit point its files go now; once LATEST may name it, the pending cut has
            # already ended (committed, or left to recovery) and this does nothing.
            try:
                pending.abandon()
            except BaseException:  # noqa: BLE001 - the cut stays marked; gc removes it
                pass
        self._end_cut(handle)
        if not handle.done:
            handle.to_failed(exc)
        self.events.emit("failed", step=handle.step, cut=handle.id, error=str(exc), error_type=type(exc).__name__,
                         writer_mode=self.options.mode, fallback=handle.fallback)

    def _write(self, handle: CutHandle, captured: Captured, pending: PendingCut | RankPart
               ) -> tuple[list[FileRecord], list[TensorRecord], dict[str, float]]:
        """This rank's shards of the cut, written by the writer process (else here) into ``pending``
        (the cut, or this rank's part of it), which the caller publishes them to."""
        if self.options.mode == "process":
            try:
                if self._writer is not None and not self._writer.alive:
                    # It died between cuts (OOM killer, operator): handled like a death mid-cut, with a
                    # fallback event naming it; a silent respawn would hide it. The next cut gets a new one.
                    raise self._writer._death(handle.step, handle.id)
                if self._writer is None:
                    self._writer = self._start_writer()
                assert self._block is not None
                submitted = handle.request
                if submitted is not None:
                    handle.request = None  # answered below, one way or another
                    # The cut is marked (rank 0 and one rank: begin_cut came first) and its bytes are in
                    # the block (captured.ready()): the writer may begin. No shard precedes the mark.
                    self._writer.marked(submitted.cut)
                    done = self._writer.wait_done(submitted)  # type: ignore[arg-type]
                else:
                    done = self._writer.write(self._request(handle, captured), self._block.fd)
                return done.files, done.tensors, dict(done.timings)
            except (WriterDied, WriterTimeout) as exc:
                handle.fallback = str(exc)
                self.events.emit("fallback", step=handle.step, cut=handle.id, reason=str(exc),
                                 error_type=type(exc).__name__)
                self._close_writer()
                # Partial files of the dead writer go; the mark stays (the cut is still in flight here).
                pending.discard_files()
        return self._write_here(captured, pending)

    def _hand_over(self, handle: CutHandle, captured: Captured, intent: CutIntent) -> None:
        """Process mode: hands the cut to the writer process before the loop goes on, with what it
        needs to finish the cut alone should this process die from here on (``ckptstore.rescue``).
        A writer that is gone is left to the commit thread (its fallback)."""
        if self.options.mode != "process" or self._writer is None or not self._writer.alive:
            return
        req = self._request(handle, captured, intent)
        try:
            assert self._block is not None
            self._writer.submit(req, self._block.fd)
        except (WriterDied, OSError):
            return
        handle.request = req
        handle.handed_over = True

    def _end_cut(self, handle: CutHandle) -> None:
        """The cut is committed or abandoned: the writer process forgets it (nothing to rescue). A
        request handed over but never written (the cut failed before its write, so it never got its
        ``marked``) has no answer to wait for: the writer drops it at ``end``."""
        handle.request = None
        if handle.handed_over and self._writer is not None:
            self._writer.end(handle.id)

    def _request(self, handle: CutHandle, captured: Captured, intent: CutIntent | None = None) -> P.WriteRequest:
        """A write of the captured block; with ``intent``, what the writer needs to finish the cut alone."""
        assert self._block is not None
        ranks = self.store.ranks
        finish = None if intent is None else P.Finish(
            **dict(intent), rank_timeout=ranks.rank_timeout if ranks else 300.0,
            stall_timeout=self.options.write_timeout)
        return P.WriteRequest(cut=handle.id, step=handle.step, block=self._block.name, block_size=self._block.size,
                              slots=list(captured.plan.slots), shards=ShardSpec.of(self.store.options),
                              rank=ranks.rank if ranks is not None else 0, finish=finish,
                              after_mark=finish is not None, block_complete=captured.complete)

    def _write_here(self, captured: Captured, pending: PendingCut | RankPart
                    ) -> tuple[list[FileRecord], list[TensorRecord], dict[str, float]]:
        """The same shards the writer process would write, from the same block, in this process."""
        assert self._block is not None
        t0 = time.perf_counter()
        view = self._block.view
        items = [s.item(view) for s in captured.plan.slots]
        timings: dict[str, float] = {}
        files, tensors = pending.write(items, timings=timings)
        timings["total"] = time.perf_counter() - t0
        return files, tensors, timings

    def _close_writer(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def _close_block(self) -> None:
        if self._block is not None:
            if self._pinning.block is self._block:
                self._pinning.release()
            block, self._block = self._block, None
            block.close()

    def _close_store(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._owns_store:
            self.store.close()

    def _at_exit(self) -> None:
        """Interpreter exit: drain and commit what is in flight; a failure that nobody saw must not end
        the process with status 0 and no checkpoint (failure-modes rows 26, 30)."""
        try:
            self.close()
        except BaseException as exc:  # noqa: BLE001
            sys.stderr.write(f"ckptstore: a checkpoint failed and was never reported: {exc}\n")
            sys.stderr.flush()
            os._exit(70)
