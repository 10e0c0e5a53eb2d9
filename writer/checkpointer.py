"""The trainer-facing facade: ``Checkpointer.maybe_cut`` / ``cut`` / ``mark_final`` / ``close``.

A cut costs the loop only :func:`~ckptstore.writer.capture.capture`. The commit pipeline
(:mod:`ckptstore.writer.pipeline`) then begins the cut in the store (a
:class:`~ckptstore.pending.PendingCut`), has the writer process write its shards from the shared
block, records them in the pending cut, commits it, and prunes. If the writer process dies or hangs,
the commit thread discards the partial files and writes the same shards itself from the same block
(event ``fallback``); a new writer process is started for the next cut. Shard settings (compression,
shard size) are the store's (``StoreOptions``), never the Checkpointer's.

With ``group=`` (several ranks of a torch.distributed job) the constructor, ``maybe_cut``, ``cut`` and
``close`` are collective: the ranks agree on every cut (the same step, skip-if-busy for all or none,
earlier failures reported everywhere at the same call), each rank's commit thread writes its part and
publishes its record, and rank 0's commit thread commits once every part is durable
(:mod:`ckptstore.writer.ranked`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any, Sequence

from ckptstore import CutInfo, JsonLinesFile, Policy, StepConflict, Store, StoreOptions, UsageError
from ckptstore.spi import layout
from ckptstore.spi import FilesArg
from ckptstore.spi import Collective
from ckptstore.spi import Emitter

from .errors import WriterError
from .handle import CutHandle, elapsed
from .mirror import MirrorTier, MirrorTimeout
from .remote_mirror import RemoteMirror, check_mirror_args, start_tier
from .options import UNSET, WriterOptions, resolve_options
from .pipeline import CommitPipeline, writer_spec
from .preemption import PreemptionWatch
from .process import WriterProcess
from .ranked import RankedCuts, agree_ready


def _open_store(url_or_store: str | Store, store_options: StoreOptions | None, group: Any,
                rank_timeout: float | None, mirror: str | None = None,
                mirror_options: StoreOptions | None = None) -> tuple[Store, bool]:
    """The writer store to cut into, and whether the Checkpointer opened it (so closes it). Opened from a
    URL with ``mirror=``, it knows its mirror, so ``restore(ck.store, ...)`` takes the newest verified
    cut of either tier (issue 21)."""
    if isinstance(url_or_store, Store):
        if store_options is not None:
            raise UsageError("store_options go with a URL; this store was opened with its own options",
                             store=url_or_store.url)
        if group is not None and url_or_store.ranks is None:
            raise UsageError("group= needs a store opened with group= (or pass the URL)", store=url_or_store.url)
        store, owns = url_or_store, False
    else:
        tiers = {"mirror": mirror, "mirror_options": mirror_options} if mirror is not None else {}
        store, owns = Store.open(url_or_store, create=True, options=store_options, group=group,
                                 rank_timeout=rank_timeout, **tiers), True
    if store.readonly:
        raise UsageError("a Checkpointer needs a store opened for writing", store=store.url)
    return store, owns


class Checkpointer:
    """Takes background cuts of a training state into a store (see docs/writer.md)."""

    def __init__(
        self,
        url_or_store: str | Store,
        *,
        every: int = UNSET,  # type: ignore[assignment]
        keep: Policy | None = UNSET,  # type: ignore[assignment]
        mode: str = UNSET,  # type: ignore[assignment]
        busy: str = UNSET,  # type: ignore[assignment]
        options: WriterOptions | None = None,
        store_options: StoreOptions | None = None,
        group: Any = None,
        rank_timeout: float | None = None,
        mirror: str | None = None,
        mirror_options: StoreOptions | None = None,
        **more: Any,
    ) -> None:
        """``url_or_store``: a URL (the store is opened, and created when missing, with
        ``store_options``: compression, shard size, storage_options) or an open writer ``Store``.
        ``group``: a torch.distributed process group whose ranks take cuts together (collective calls;
        ``rank_timeout`` as in ``Store.open``); None is one process. ``mirror``: the URL of a store each
        committed cut is copied into behind the loop (opened, and created, with ``mirror_options``;
        pruned with ``mirror_keep``; issue 21, docs/writer.md "A mirror tier")."""
        self.options = options = resolve_options(options, every=every, keep=keep, mode=mode, busy=busy, **more)
        check_mirror_args(mirror, mirror_options, options, group)
        self.store, self._owns_store = _open_store(url_or_store, store_options, group, rank_timeout, mirror,
                                                   mirror_options)
        try:
            spec = writer_spec(self.store, options.mode)
            if self.store.ranks is None or self.store.ranks.rank == 0:
                # A broken LATEST fails here, not at the first cut. Only rank 0 reads the store; the
                # others hear of its failure in the ready exchange (issue 24: only rank 0 lists).
                self.store.latest()
        except BaseException as exc:
            if self.store.ranks is not None:
                agree_ready(self.store.ranks, exc, {"store": self.store.url})
            if self._owns_store:
                self.store.close()
            raise
        self._jsonl = JsonLinesFile(options.events_path) if options.events_path else None
        self.events = Emitter(self.store.url, self._fan_out)
        #: How each cut's steps run over the ranks (world size 1: plain calls): one pipeline for both.
        self.collective = Collective(self.store.ranks, store=self.store.url)
        self._pipeline = CommitPipeline(self.store, options, self.collective, self.events, spec)
        self._cuts = self._pipeline.cuts
        #: The ranks this checkpointer cuts with (None: one process).
        ranks = self.store.ranks
        self.ranked: RankedCuts | None = RankedCuts(self._pipeline, ranks) if ranks is not None else None
        self._closed = False
        #: The mirror tier (``mirror=``; None without one).
        self.mirror: MirrorTier | RemoteMirror | None = self._start_mirror(mirror, mirror_options)
        self._pipeline.start()
        atexit.register(self._at_exit)
        #: True once a preemption cut (``preemption=True``) committed: the loop should end now.
        self.preempted = False
        self._preemption: PreemptionWatch | None = None
        self._finish_start(options)

    def _finish_start(self, options: WriterOptions) -> None:
        """The preemption watch (``preemption=True``), then, with ranks, the end of the collective
        constructor: every rank is ready, or every rank raises (and this one closes what it started)."""
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
            self._check_open()
            return self.ranked.take(step, state, periodic=True, **kw)
        self._cuts.raise_unreported()
        if step % self.options.every != 0:
            return None
        return self._take(step, state, periodic=True, **kw)

    def cut(self, step: int, state: Any, *, final: bool = False, **kw: Any) -> CutHandle:
        """Takes a cut now whatever ``every`` says; waits for one in flight first. With ``final`` it
        also marks the cut final and waits until it is committed."""
        if self.ranked is not None:
            self._check_open()
            handle = self.ranked.take(step, state, periodic=False, final=final, **kw)
            assert handle is not None
            if final:
                self.ranked.wait_committed(handle)
            return handle
        self._cuts.raise_unreported()
        handle = self._take(step, state, periodic=False, final=final, **kw)
        assert handle is not None
        if final:
            handle.wait()
            if self.mirror is not None:
                # The only wait for the mirror besides close() (issue 21), bounded: MirrorTimeout.
                self.mirror.wait(handle.id, self.options.mirror_timeout)
        return handle

    def mark_final(self, step: int | None = None) -> CutInfo:
        """Marks the last committed cut final without writing it again (``Store.mark_final``): for a loop
        whose last periodic cut already holds its final state, so ``resume-info`` reports the step
        where the run ended. Waits for a cut in flight first (its failure is raised). With ``step``,
        raises ``StepConflict`` (marking nothing) unless the last committed cut is of that step (a
        periodic cut of it may have been skipped: then take ``cut(step, state, final=True)``).
        Collective with ``group=``: rank 0 writes the mark, every rank returns the same CutInfo."""
        self._check_open()
        self._cuts.wait_current()
        if self.ranked is None:
            return self._mark_final(step)
        return self.ranked.mark_final(lambda: self._mark_final(step))

    def _mark_final(self, step: int | None) -> CutInfo:
        self._cuts.raise_unreported()
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
            notices = self.ranked.agree_preempt(step, own)
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
            self._cuts.wait_current(timeout)
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
        self._pipeline.stop(timeout)
        for closer in (self._drain_mirror, self._close_writer, self._close_block, self._close_mirror,
                       self._close_store):
            try:
                closer()
            except BaseException as exc:  # noqa: BLE001 - keep closing; report below
                cleanup_errors.append(exc)
        self._cuts.raise_unreported()
        timeouts = [e for e in cleanup_errors if isinstance(e, MirrorTimeout)]
        if timeouts:
            raise timeouts[0]  # its own type: every cut is committed locally, the mirror is behind
        if cleanup_errors:
            # The last cut taken, not the ledger's open cuts: raise_unreported above forgets committed ones.
            last = self._cuts.current
            final = last is not None and last.final and last.state == "committed"
            note = f" (the final cut {last.id} is committed and unaffected)" if final and last else ""
            raise WriterError(f"closing the checkpointer failed{note}: {cleanup_errors[0]}",
                              store=self.store.url) from cleanup_errors[0]

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer_pid(self) -> int | None:
        writer = self._pipeline.writer
        return writer.pid if writer is not None else None

    @property
    def skipped(self) -> int:
        """Periodic cuts skipped because one was in flight (``busy="skip"``)."""
        return self._cuts.skipped

    @property
    def waited(self) -> int:
        """Cuts that waited for the one in flight."""
        return self._cuts.waited

    # ------------------------------------------------------------------------------------ internals
    @property
    def _writer(self) -> WriterProcess | None:
        """The pipeline's writer process (tests look at it, and replace it: tests/writer/fault_worker.py)."""
        return self._pipeline.writer

    @_writer.setter
    def _writer(self, writer: WriterProcess | None) -> None:
        self._pipeline.writer = writer

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the checkpointer is closed", store=self.store.url)

    def _fan_out(self, event: dict[str, Any]) -> None:
        if self.store.ranks is not None:
            event.setdefault("rank", self.store.ranks.rank)
        if self.options.on_event is not None:
            self.options.on_event(event)
        if self._jsonl is not None:
            self._jsonl(event)

    def _take(self, step: int, state: Any, *, periodic: bool, final: bool = False,
              tags: Sequence[str] = (), metadata: dict[str, Any] | None = None, allow_pickle: bool = False,
              files: FilesArg | None = None) -> CutHandle | None:
        """One rank's ``maybe_cut``/``cut``: skip or wait for the cut in flight, check the step, capture, launch."""
        self._check_open()
        layout.check_step(step, store=self.store.url)
        current = self._cuts.current
        if current is not None and not current.done:
            if periodic and self.options.busy == "skip":
                self._cuts.skip(step, f"cut {current.id} (step {current.step}) is still {current.state}")
                return None
            self._cuts.wait_for_current(step)
            self._cuts.raise_unreported()
        last = self._cuts.last_step
        if last is None:
            # Before the first cut, LATEST as it is now: ``restore(ck.store, fallback=True)`` may have
            # moved it back to an older cut since construction (docs/resume.md).
            latest = self.store.latest()
            last = latest.step if latest is not None else None
        if last is not None and step <= last:
            raise StepConflict(f"step {step} is not above the last cut's step {last}", store=self.store.url)
        handle = CutHandle(step, layout.new_cut_id(step), final)
        try:
            captured = self._pipeline.capture(handle, state, allow_pickle=allow_pickle, files=files)
        except BaseException as exc:
            self._pipeline.capture_failed(handle, exc)
            raise
        return self._pipeline.launch(handle, captured, tags=tags, metadata=metadata, final=final)

    def _close_writer(self) -> None:
        self._pipeline.close_writer()

    def _close_block(self) -> None:
        self._pipeline.close_block()

    def _start_mirror(self, url: str | None, options: StoreOptions | None) -> MirrorTier | RemoteMirror | None:
        return None if url is None else start_tier(url, options, self.options, self.store, self.events, self._pipeline)

    def _drain_mirror(self) -> None:
        if self.mirror is not None:
            self.mirror.drain(self.options.mirror_timeout)

    def _close_mirror(self) -> None:
        if self.mirror is not None:
            self.mirror.close()

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


__all__ = ["Checkpointer"]
