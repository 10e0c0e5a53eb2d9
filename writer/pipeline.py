"""The commit pipeline: one cut from capture to commit behind the training loop, for one rank and many.

``capture`` copies the state into the shared block (the only part the loop waits for); ``launch``
hands the cut to the writer process (process mode: with what it needs to finish the cut alone,
``ckptstore.rescue``) and queues it for the commit thread, which runs one cut at a time over a
:class:`~ckptstore.collective.Collective` (world size 1: plain calls), the same code for one rank and
many (issue 20):

1. rank 0 marks the cut (``Store.begin_cut``) while the other ranks wait for its word; then every
   rank waits until every byte is in the block (``Captured.ready``) and only then tells the writer
   ``marked`` (the request was handed over with ``after_mark``), so no shard of any rank precedes
   its cut's mark (issue 20);
2. this rank's part is written by the writer process, else (it died or hung: event ``fallback``) by
   the commit thread from the same block, and published (one rank: to the pending cut; several: a
   durable rank record);
3. rank 0 commits once every part is durable (``PendingCut.finish``); every rank hears the outcome;
4. with a mirror, rank 0 hands the committed cut to the mirror tier (:mod:`ckptstore.writer.mirror`;
   the other ranks' tiers follow rank 0's marks on the mirror: :mod:`ckptstore.writer.mirror_ranks`);
5. rank 0 prunes (``keep``, sparing what the mirror still needs): a failed prune never fails a committed cut.

Nothing here raises to the loop: the outcome lands in the cut's handle, and the ledger
(:class:`~ckptstore.writer.ledger.CutLedger`) raises an unreported failure at the next call.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ckptstore import CutInfo, Store, UsageError
from ckptstore import spi
from ckptstore.spi import FilesArg
from ckptstore.spi import Collective
from ckptstore.spi import Emitter
from ckptstore.spi import FileRecord, TensorRecord
from ckptstore.spi import CutIntent, PendingCut, RankPart
from ckptstore.spi import StorageSpec

from . import heap
from . import protocol as P
from .capture import CaptureCache, Captured, Pinning, capture
from .errors import WriterDied, WriterError, WriterTimeout
from .handle import CutHandle, elapsed
from .ledger import CutLedger
from .mirror import MirrorTier
from .remote_mirror import RankedMirror, RemoteMirror
from .options import WriterOptions
from .plan import grown_size
from .process import WriterProcess
from .shm import Block

Written = tuple[list[FileRecord], list[TensorRecord], dict[str, float]]


@dataclass
class _Job:
    """One cut for the commit thread, with what was handed to the writer process at capture."""

    handle: CutHandle
    captured: Captured
    intent: CutIntent
    #: The request handed to the writer process at capture (process mode), until its answer is read.
    request: P.WriteRequest | None = None
    #: Whether the writer process holds the cut (and must hear ``end`` once it is committed or abandoned).
    handed_over: bool = False


def writer_spec(store: Store, mode: str) -> StorageSpec | None:
    """How a writer process reaches ``store``; a UsageError when ``mode`` is "process" and none can."""
    spec = store.storage.spec()
    if mode != "process":
        return spec
    if spec is None:
        raise UsageError(
            "a writer process cannot reach this store: its storage lives in this process (fsspec's "
            "memory file system, or a Storage object passed to Store.open)", store=store.url,
            hint='use Checkpointer(..., mode="thread") for such stores')
    spec.check_json()
    return spec


class CommitPipeline:
    """The block, the writer process and the commit thread of one Checkpointer, and the cuts they carry."""

    def __init__(self, store: Store, options: WriterOptions, collective: Collective, events: Emitter,
                 spec: StorageSpec | None) -> None:
        """``spec``: how the writer process reaches ``store`` (process mode)."""
        self.store = store
        self.options = options
        self.collective = collective
        self.events = events
        #: The cuts taken and what is left to report of them.
        self.cuts = CutLedger(events)
        #: The writer process (process mode; None before it starts, and after it died until the next cut).
        self.writer: WriterProcess | None = None
        self._spec = spec
        self._block: Block | None = None
        self._pinning = Pinning()
        #: The last state's layout, plan and views of the block: a cut of the same layout reuses them.
        self._captures = CaptureCache()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._payload_of: tuple[Any, int] = (None, 0)
        self._thread: threading.Thread | None = None
        #: The mirror tier each committed cut is handed to (issue 21; None: no mirror): in process mode
        #: the writer process's (each writer started is attached to it), else a thread of this process.
        self.mirror: MirrorTier | RemoteMirror | RankedMirror | None = None

    def start(self) -> None:
        """Starts the writer process (process mode) and the commit thread (process and thread mode)."""
        if self.options.mode == "process":
            self.writer = self._start_writer()
        if self.options.mode in ("process", "thread"):
            self._thread = threading.Thread(target=self._run, name="ckptstore-commit", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Lets the cut in flight end, then ends the commit thread (each wait bounded by ``timeout``)."""
        self.cuts.wait_current(timeout)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)

    # ---------------------------------------------------------------------------- the loop's side
    def capture(self, handle: CutHandle, state: Any, *, allow_pickle: bool, files: FilesArg | None) -> Captured:
        """Copies ``state`` into the shared block for ``handle``'s cut (``ckptstore.writer.capture``)."""
        return capture(state, self._block_for, allow_pickle=allow_pickle, device_copy=self.options.device_copy,
                       pinning=self._pinning, files=files, where={"store": self.store.url, "cut": handle.id},
                       cache=self._captures)

    def capture_failed(self, handle: CutHandle, err: BaseException) -> None:
        """The cut failed at capture (here, or on another rank): the caller raises ``err`` now."""
        handle.to_failed(err)
        handle.mark_reported()
        self.events.emit("failed", step=handle.step, cut=handle.id, stage="capture", error=str(err),
                         error_type=type(err).__name__)

    def launch(self, handle: CutHandle, captured: Captured, *, tags: Sequence[str], metadata: dict[str, Any] | None,
               final: bool) -> CutHandle:
        """A captured cut goes on its way: recorded as the one in flight, announced (``captured``),
        handed to the writer process, queued for the commit thread (or processed here, inline). A
        failure on the way fails the cut at once and is raised (``_launch_failed``)."""
        handle.to_writing()
        self.cuts.add(handle)
        job: _Job | None = None
        try:
            size = self.collective.size
            self.events.emit("captured", step=handle.step, cut=handle.id, stall_s=round(captured.seconds, 6),
                             bytes=self._payload(captured), tensors=len(captured.plan.slots) - len(captured.attached),
                             attached_files=len(captured.attached), capture_mode=captured.mode,
                             capture_reason=captured.reason, writer_mode=self.options.mode,
                             skipped_total=self.cuts.skipped, waited_total=self.cuts.waited,
                             **({"world_size": size} if size > 1 else {}))
            intent = CutIntent(tree=captured.tree, pickled=captured.pickled, attached=list(captured.attached),
                               tags=list(tags), final=final, metadata=metadata, mode=self.options.mode,
                               world_size=size)
            job = _Job(handle, captured, intent)
            self._hand_over(job)
            if self.options.mode == "inline":
                self._process(job)
            else:
                self._jobs.put(job)
        except BaseException as exc:
            self._launch_failed(handle, job, exc)
            raise
        return handle

    def _launch_failed(self, handle: CutHandle, job: _Job | None, exc: BaseException) -> None:
        """The cut was recorded as the one in flight, then its launch failed (a request that cannot be
        encoded, a KeyboardInterrupt in an event sink): it fails now, reported by the raise that
        follows, and a writer that holds it forgets it. Before, it stayed "writing" with no commit
        thread to end it, and ``close()`` waited for it forever."""
        if job is not None:
            self._end_cut(job)
        if not handle.done:
            handle.to_failed(exc)
        handle.mark_reported()
        try:
            self.events.emit("failed", step=handle.step, cut=handle.id, stage="launch", error=str(exc),
                             error_type=type(exc).__name__, writer_mode=self.options.mode)
        except BaseException:  # noqa: BLE001 - the raise that follows reports it
            pass

    def _payload(self, captured: Captured) -> int:
        """The plan's array bytes, summed once per plan (a repeated layout reuses its plan: 40,000
        slots summed at every cut cost the loop 5-25 ms)."""
        slots = captured.plan.slots
        if self._payload_of[0] is not slots:
            self._payload_of = (slots, captured.plan.payload)
        return self._payload_of[1]

    def _block_for(self, nbytes: int) -> Block:
        """The shared block, grown (a new one, prefaulted) only when the state no longer fits. Only
        called when no cut is in flight, so no region still being written is ever reused. Its 1/8
        headroom is reserved and prefaulted only once a cut needs it (``Block.ensure``), so it costs
        no host memory until then."""
        if self._block is None or self._block.size < nbytes:
            size = grown_size(nbytes, self._block.size if self._block is not None else 0)
            self.close_block()
            self._block = Block.create(size, backed=nbytes)
        else:
            self._block.ensure(nbytes)
        return self._block

    def _hand_over(self, job: _Job) -> None:
        """Process mode: hands the cut to the writer process before the loop goes on, with what it
        needs to finish the cut alone should this process die from here on (``ckptstore.rescue``).
        A writer that is gone is left to the commit thread (its fallback)."""
        if self.options.mode != "process" or self.writer is None or not self.writer.alive:
            return
        req = self._request(job, finish=True)
        try:
            assert self._block is not None
            self.writer.submit(req, self._block.fd)
        except (WriterDied, OSError):
            return
        job.request = req
        job.handed_over = True

    # ----------------------------------------------------------------------------- the commit thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._process(job)

    def _process(self, job: _Job) -> None:
        """One cut behind the loop, for one rank and many (issue 20): mark (rank 0), write this rank's
        part (writer process, else this thread) and publish it, commit (rank 0, once every rank's part
        is durable), prune (rank 0). Never raises: the outcome lands in the handle, and unreported
        failures surface at the next call (agreed by every rank at its next collective call) or at
        close."""
        c, handle, captured, intent = self.collective, job.handle, job.captured, job.intent
        t0 = time.perf_counter()
        pending: PendingCut | None = None
        t_commit = t0

        def mark() -> None:  # rank 0, before any rank's part (Collective.gather's ``first``)
            nonlocal pending
            pending = self.store.begin_cut(handle.step, writer=f"checkpointer:{self.options.mode}", cut=handle.id,
                                           world_size=c.size)

        def part() -> None:
            # Invariant (issue 20): the writer hears ``marked`` (in _write) only after rank 0's mark
            # (every rank waits for it: no rank's shard precedes the mark) and once every byte is in
            # the block; a rescue without it writes nothing.
            captured.ready()
            target: PendingCut | RankPart = (pending if c.size == 1  # type: ignore[assignment]
                                             else spi.rank_part(self.store, handle.id, handle.step))
            # The C heap's free memory goes back before the write and after it (``heap``: what the
            # capture's and the hand-over's buffers left, then the answer's), so the manifest's build
            # does not pile on top of it (issue 23: the trainer's peak at 100,000 arrays, -49 MB).
            heap.give_back()
            files, tensors, timings = self._write(job, target)
            heap.give_back()
            target.publish(files, tensors, intent)
            handle.timings.update(timings)
            self.events.emit("written", step=handle.step, cut=handle.id, bytes=sum(f.nbytes for f in files),
                             timings={k: round(v, 6) for k, v in timings.items()}, writer_mode=self.options.mode,
                             fallback=handle.fallback)
            handle.to_committing()
            # Of several ranks: what the commit record lists of this rank's fragment, posted to rank 0
            # with "written", so the commit reads no fragment (issue 22).
            ref = getattr(target, "ref", None)
            return ref.to_json() if ref is not None else None

        def commit(parts: list[Any]) -> CutInfo:
            nonlocal t_commit
            assert pending is not None
            t_commit = time.perf_counter()
            return pending.finish(intent, parts=parts if c.size > 1 else None)

        with c.busy():
            try:
                info = c.gather(handle.id, part, commit, first=mark,
                                share=lambda i: {**i.to_json(), "metadata": i.metadata},
                                receive=CutInfo.from_json, doing=f"cut {handle.id}",
                                note=lambda: PendingCut.left_as(pending))
            except BaseException as exc:  # noqa: BLE001 - recorded in the handle, raised later
                self._fail(job, pending, exc)
                return
        self._end_cut(job)
        handle.to_committed(info)
        self.events.emit("committed", step=handle.step, cut=handle.id, bytes=info.nbytes,
                         timings={"commit": elapsed(t_commit) if c.coordinator else None, "total": elapsed(t0)},
                         writer_mode=self.options.mode, fallback=handle.fallback, final=intent.final,
                         **({"world_size": c.size} if c.size > 1 else {}))
        if self.mirror is not None and c.coordinator:
            self.mirror.submit(info)  # after "committed", before the prune, which must now spare it
        self._prune(handle.step)

    def _prune(self, step: int) -> None:
        """Rank 0 applies ``keep`` after a commit; a failed prune never fails the committed cut. With a
        mirror, a cut still waiting for it is kept too (issue 21: never pruned before it is mirrored)."""
        if not self.collective.coordinator or self.options.keep is None:
            return
        keep = self.options.keep if self.mirror is None else self.options.keep | self.mirror.hold()
        try:
            self.store.prune(keep)
        except BaseException as exc:  # noqa: BLE001 - the cut is committed; say so and go on
            self.events.emit("warning", step=step, message=f"prune failed: {exc}")

    def _fail(self, job: _Job, pending: PendingCut | None, exc: BaseException) -> None:
        handle = job.handle
        if pending is not None:
            # Before the commit point its files go now; once LATEST may name it, the pending cut has
            # already ended (committed, or left to recovery) and this does nothing.
            try:
                pending.abandon()
            except BaseException:  # noqa: BLE001 - the cut stays marked; gc removes it
                pass
        self._end_cut(job)
        if not handle.done:
            handle.to_failed(exc)
        self.events.emit("failed", step=handle.step, cut=handle.id, error=str(exc), error_type=type(exc).__name__,
                         writer_mode=self.options.mode, fallback=handle.fallback)

    def _write(self, job: _Job, target: PendingCut | RankPart) -> Written:
        """This rank's shards of the cut, written by the writer process (else here) into ``target``
        (the cut, or this rank's part of it), which the caller publishes them to."""
        gate = self.mirror.gate if isinstance(self.mirror, (MirrorTier, RankedMirror)) else None
        if gate is not None:  # thread mode: the tier's uploads yield to this write
            with gate.busy():
                return self._write_unmirrored(job, target)
        return self._write_unmirrored(job, target)

    def _write_unmirrored(self, job: _Job, target: PendingCut | RankPart) -> Written:
        handle = job.handle
        if self.options.mode == "process":
            try:
                return self._write_in_writer(job)
            except (WriterDied, WriterTimeout) as exc:
                handle.fallback = str(exc)
                self.events.emit("fallback", step=handle.step, cut=handle.id, reason=str(exc),
                                 error_type=type(exc).__name__)
                self.close_writer()
                # Partial files of the dead writer go; the mark stays (the cut is still in flight here).
                target.discard_files()
        return self._write_here(job.captured, target)

    def _write_in_writer(self, job: _Job) -> Written:
        """The writer process writes the cut: the request handed over at capture, released now that
        the cut is marked, or (nothing handed over) a request sent now."""
        handle = job.handle
        if self.writer is not None and not self.writer.alive:
            # It died between cuts (OOM killer, operator): handled like a death mid-cut, with a
            # fallback event naming it; a silent respawn would hide it. The next cut gets a new one.
            raise self.writer.death(handle.step, handle.id)
        if self.writer is None:
            self.writer = self._start_writer()
        assert self._block is not None
        submitted, job.request = job.request, None  # answered below, one way or another
        if submitted is not None:
            # The cut is marked (rank 0 and one rank: begin_cut came first) and its bytes are in the
            # block (captured.ready()): the writer may begin. No shard precedes the mark.
            self.writer.marked(submitted.cut)
            req = submitted
        else:
            req = self._request(job, finish=False)
            self.writer.submit(req, self._block.fd)
        # While the writer writes: the tree's text, which the manifest of this cut then reuses whole
        # and the next cut's hand-over in part (issue 23: 0.1-0.15 s of json.dumps per cut otherwise).
        spi.remember_tree_text(job.captured.tree)
        done = self.writer.wait_done(req)
        assert req.slots is not None
        try:
            tensors = done.records(req.slots)
        except ValueError as exc:
            raise WriterError(f"the writer's answer does not fit its request: {exc}", step=handle.step,
                              store=self.store.url, cut=handle.id) from None
        return done.files, tensors, dict(done.timings)

    def _write_here(self, captured: Captured, target: PendingCut | RankPart) -> Written:
        """The same shards the writer process would write, from the same block, in this process."""
        assert self._block is not None
        spi.remember_tree_text(captured.tree)  # the manifest's tree text, as _write_in_writer says
        t0 = time.perf_counter()
        view = self._block.view
        items = [s.item(view) for s in captured.plan.slots]
        timings: dict[str, float] = {}
        files, tensors = target.write(items, timings=timings)
        timings["total"] = time.perf_counter() - t0
        return files, tensors, timings

    def _end_cut(self, job: _Job) -> None:
        """The cut is committed or abandoned: the writer process forgets it (nothing to rescue). A
        request handed over but never written (the cut failed before its write, so it never got its
        ``marked``) has no answer to wait for: the writer drops it at ``end``."""
        job.request = None
        if job.handed_over and self.writer is not None:
            self.writer.end(job.handle.id)

    def _request(self, job: _Job, *, finish: bool) -> P.WriteRequest:
        """A write of the captured block; with ``finish``, what the writer needs to finish the cut alone."""
        assert self._block is not None
        ranks = self.store.ranks
        fin = P.Finish(**dict(job.intent), rank_timeout=ranks.rank_timeout if ranks else 300.0,
                       stall_timeout=self.options.write_timeout) if finish else None
        return P.WriteRequest(cut=job.handle.id, step=job.handle.step, block=self._block.name,
                              block_size=self._block.size, slots=job.captured.plan.slots,
                              shards=spi.shard_spec(self.store), rank=ranks.rank if ranks is not None else 0,
                              finish=fin, after_mark=finish, block_complete=job.captured.complete)

    # ---------------------------------------------------------------------------------- resources
    def _start_writer(self) -> WriterProcess:
        assert self._spec is not None
        writer = WriterProcess(self._spec, self.options, lock=spi.lock_handoff(self.store))
        if isinstance(self.mirror, (RemoteMirror, RankedMirror)):
            self.mirror.attach(writer)  # it uploads to the mirror, after looking at both stores
        return writer

    def ensure_writer(self) -> None:
        """A writer process for the mirror's uploads when none runs (process mode: the mirror tier's
        ``wait`` and ``drain`` after a writer died; the next cut would start one too)."""
        if self.options.mode != "process":
            return
        if self.writer is not None and not self.writer.alive:
            self.close_writer()
        if self.writer is None:
            self.writer = self._start_writer()

    def close_writer(self) -> None:
        """Stops the writer process, if one runs (the next cut in process mode starts another)."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def close_block(self) -> None:
        """Frees the shared block (unpinned first); only when no cut is in flight."""
        if self._block is not None:
            if self._pinning.block is self._block:
                self._pinning.release()
            self._captures.release()  # its views of the block would keep the block mapped
            block, self._block = self._block, None
            block.close()


__all__ = ["CommitPipeline", "writer_spec"]
