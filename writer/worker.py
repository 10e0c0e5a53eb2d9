"""The writer process: attaches the shared block, writes shards through the store's format, answers.

Started once per Checkpointer as a fresh interpreter (``python -m ckptstore.writer.worker``, the
spawn model: nothing inherited but one end of a Unix socket pair), at nice 10. It never imports torch: everything it
needs is bytes in the block plus the small request (names, dtypes, shapes, offsets). While its
trainer lives it never commits: the trainer's commit thread does that once the files are durable.

It notices its parent's death two ways: the socket reaches EOF, and a watchdog thread sees its parent
pid change (even while a shard is being written). Either way it first reads every frame its trainer
left in the socket: a cut is handed over once its request is there (``maybe_cut`` returned), read or
not. A request handed over at capture is held, unwritten, until the trainer's commit thread says the
cut is marked and in the block (``marked``), so no shard ever precedes its cut's mark. With no cut in
hand it then exits. With a cut handed over and not yet ended by the trainer (a request carrying its
``finish`` plan), it **finishes the cut alone** (:mod:`ckptstore.rescue`): it marks it if the trainer
had not, completes the write, then commits (one rank) or publishes
its rank record and, on rank 0, commits once every rank's record is there, under the writer lock it
inherited, and exits. A rescue that makes no progress for the plan's ``stall_timeout`` ends the
process anyway, so nothing is orphaned; what it leaves is marked and the store's gc removes it. The
shared block has no name, so the kernel frees it with the last mapping. (PR_SET_PDEATHSIG is not used:
it fires when the *thread* that started the process ends, such as a commit thread, not only when the
trainer dies.)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any

from ckptstore.spi import pausing
from ckptstore.spi import InheritedLock
from ckptstore.spi import CommitProtocol
from ckptstore.spi import write_shards
from ckptstore.spi import Storage, StorageSpec, open_spec
from ckptstore.spi import FileRecord, TensorRecord

from . import protocol as P
from .gate import Gate
from .remote_mirror import WorkerMirror
from .shm import Block

#: What this process wrote of a cut: its files and the manifest records of its arrays.
Written = tuple[list[FileRecord], list[TensorRecord]]

IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_IDLE = 3
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


#: How long the main loop waits for a frame before it looks again at its trainer and at SIGTERM.
POLL_S = 0.2
#: How long an orphan with nothing in hand may take to read what its trainer sent before it died.
DRAIN_S = 60.0


class Worker:
    def __init__(self, sock_fd: int, parent: int, hash_threads: int = 1) -> None:
        self.sock = sock_fd
        self.spec: StorageSpec | None = None
        self.parent = parent
        self.hash_threads = hash_threads
        self.blocks: dict[str, Block] = {}
        self.storage: Storage | None = None
        self.lock: dict[str, Any] = {"kind": "none"}
        self.lock_fd: int | None = None
        #: The trainer's lock, held by this process from the trainer's death on (``hold_lock``).
        self.inherited: InheritedLock | None = None
        self._mutex = threading.Lock()  # the watchdog and the main thread may both open the storage
        #: The cut handed over and not yet ended by the trainer, with this process's result once written.
        self.pending: tuple[P.WriteRequest, Written | None] | None = None
        #: The slots of the last request that listed them, and their number (``WriteRequest.layout``).
        self.layout: tuple[int, list[Any]] | None = None
        self._items: tuple[tuple[Any, str], list[Any]] | None = None
        #: The request being written now (a write without a ``finish`` plan is dropped at the trainer's death).
        self.writing: P.WriteRequest | None = None
        #: A request handed over at capture, held until its ``marked`` (no shard before the cut's mark).
        self.held: P.WriteRequest | None = None
        self.parent_gone = False
        self.terminating = False
        self.last_progress = time.monotonic()
        #: The mirror tier this process uploads each committed cut into (issue 21; ``mirror-open``).
        self.mirror: WorkerMirror | None = None
        #: Held while a cut's shards are written: the mirror's uploads wait for it (the local cut first).
        self.gate = Gate()
        self._send_lock = threading.Lock()  # the main thread and the mirror thread both send

    # lifecycle -------------------------------------------------------------------------------------
    def orphaned(self, *_: Any) -> None:
        """The trainer is gone. A write nobody can finish stops at once (the kernel frees the block).
        Otherwise the main thread reads every frame the trainer sent before it died (a cut is handed over
        once its request is in the socket, read or not: issue 19 item 2), then finishes the cut in hand
        (``rescue``) or exits, under a stall deadline; the trainer's lock is held from now on."""
        if self.writing is not None and self.writing.finish is None:
            os._exit(0)
        if self.parent_gone:
            return
        self.last_progress = time.monotonic()
        self.parent_gone = True
        threading.Thread(target=self.rescue_deadline, name="ckptstore-rescue-deadline", daemon=True).start()
        self.hold_lock()

    def rescue_deadline(self) -> None:
        while True:
            pending = self.pending
            limit = pending[0].finish.stall_timeout if pending is not None and pending[0].finish else DRAIN_S
            if time.monotonic() - self.last_progress > limit:
                break
            time.sleep(0.2)
        sys.stderr.write(f"ckptstore writer {os.getpid()}: no progress for {limit:g} s finishing a dead "
                         "trainer's cut; exiting (the store's gc removes what is left)\n")
        os._exit(0)

    def watch_parent(self, interval: float = 0.2) -> None:
        """Runs in a daemon thread: reacts as soon as the parent is gone."""
        while True:
            if os.getppid() != self.parent:
                self.orphaned()
                return
            time.sleep(interval)

    def open_storage(self) -> Storage:
        with self._mutex:
            if self.storage is None:
                if self.spec is None:
                    raise RuntimeError("the parent sent a write before naming the store")
                self.storage = open_spec(self.spec)
            return self.storage

    def hold_lock(self) -> None:
        """Holds the dead trainer's lock from its death on: its lease is renewed from here (the trainer's
        renewals died with it, and a rescue writing for longer than the ttl lost the store to a restart:
        issue 19 item 3); its flock through the inherited descriptor."""
        if self.spec is None:
            return  # it died before naming the store: nothing can be in hand
        try:
            storage = self.open_storage()
        except Exception as exc:  # noqa: BLE001 - rescue() tries again, and says why it cannot
            sys.stderr.write(f"ckptstore writer {os.getpid()}: cannot reach the store to hold its lock: {exc}\n")
            return
        with self._mutex:
            if self.inherited is None:
                self.inherited = InheritedLock(storage, self.lock, self.lock_fd)
                self.lock_fd = None
                self.inherited.start_renewing()

    def rescue(self) -> int:
        """Finishes the cut in hand after the trainer died, then exits (see the module docstring)."""
        held, self.held = self.held, None
        if held is not None:
            self.write_held(held)
        pending = self.pending
        if pending is not None and pending[1] is not None and pending[0].finish is not None:
            self.finish(*pending)  # type: ignore[arg-type]
        if self.mirror is not None:
            self.mirror.finish()  # the rescued cut and whatever else the mirror lacks (issue 21)
        if self.inherited is not None:
            self.inherited.release()
        self._items = None
        for block in self.blocks.values():
            block.close()
        return 0

    def write_held(self, req: P.WriteRequest) -> None:
        """A handed-over request its trainer died before releasing (``marked``): marked here first (one
        rank, or rank 0; rank 0 marks a cut of several), then written. A block whose device copy may
        not have finished is not written: that cut is lost, as if the trainer had died in maybe_cut."""
        log = f"ckptstore writer {os.getpid()}: the trainer died before its cut {req.cut} was "
        if not req.block_complete:
            sys.stderr.write(log + "in the block (a device copy in flight); dropping it\n")
            self.pending = None
            return
        try:
            self.hold_lock()
            if req.rank == 0 and self.inherited is not None and req.finish is not None:
                from ckptstore.spi import ensure_marked

                ensure_marked(self.open_storage(), self.inherited.ensure_held, cut=req.cut, step=req.step,
                              mode=req.finish.mode)
        except BaseException as exc:  # noqa: BLE001 - nothing to report to: the store's gc cleans up
            sys.stderr.write(log + f"marked, and it cannot be marked: {type(exc).__name__}: {exc}\n")
            self.pending = None
            return
        self.handle(req)

    def finish(self, req: P.WriteRequest, done: Written) -> None:
        assert req.finish is not None and self.storage is not None
        self.hold_lock()
        lock = self.inherited
        from ckptstore.spi import finish_orphaned_cut

        def log(message: str) -> None:
            sys.stderr.write(f"ckptstore writer {os.getpid()}: {message}\n")

        try:
            if lock is None:
                raise RuntimeError("the store's lock could not be taken over")
            f = req.plan()  # its tree, parsed only now (it travelled as raw JSON after the frame)
            assert f is not None
            outcome = finish_orphaned_cut(
                self.storage, lock.ensure_held, cut=req.cut, step=req.step, rank=req.rank, files=done[0],
                tensors=done[1], intent=f, rank_timeout=f.rank_timeout, log=log)
            log(f"the trainer died; finished cut {req.cut}: {outcome}")
        except BaseException as exc:  # noqa: BLE001 - nothing to report to: the store's gc cleans up
            log(f"the trainer died; could not finish cut {req.cut}: {type(exc).__name__}: {exc}")

    def next_message(self) -> P.Message | None:
        """The trainer's next frame; None once nothing more will come: the trainer is gone and every frame
        it sent has been read (the socket keeps what a dead sender wrote), or SIGTERM asked an idle
        writer to stop. A frame broken off while the trainer lives: None too (the trainer falls back)."""
        while True:
            gone = self.parent_gone  # read before polling: a trainer seen gone has sent all it ever will
            try:
                msg = P.recv(self.sock, timeout=POLL_S)
                if isinstance(msg, P.WriteRequest) and msg.block not in self.blocks:
                    self.attach(msg.block, msg.block_size, P.recv_fd(self.sock))
                if isinstance(msg, P.WriteRequest):
                    msg = self.with_slots(msg)
                if isinstance(msg, P.OpenStore) and msg.lock.get("kind") == "flock":
                    self.lock_fd = P.recv_fd(self.sock)
                return msg
            except P.FrameTimeout as exc:  # a frame broken off (a trainer dead mid-send, its socket kept open)
                sys.stderr.write(f"ckptstore writer {os.getpid()}: {exc}; stopping\n")
                return None
            except TimeoutError:
                if gone or (self.terminating and self.pending is None):
                    return None
            except P.ChannelClosed:
                self.orphaned()
                return None

    def serve(self) -> int:
        self.send(P.Hello(pid=os.getpid(), nice=os.nice(0), modules_with_torch="torch" in sys.modules))
        while (msg := self.next_message()) is not None:
            if isinstance(msg, P.OpenStore):
                self.spec, self.storage = StorageSpec(msg.url, msg.storage_options, msg.io), None
                self.lock = dict(msg.lock)
            elif isinstance(msg, P.Marked):
                if self.held is not None and self.held.cut == msg.cut:
                    req, self.held = self.held, None
                    self.handle(req)
            elif isinstance(msg, P.CutEnded):
                if self.pending is not None and self.pending[0].cut == msg.cut:
                    self.pending = None
                if self.held is not None and self.held.cut == msg.cut:
                    self.held = None  # it failed before its write: nothing was written, nothing to answer
            elif isinstance(msg, P.MirrorOpen):
                self.start_mirror(msg)
            elif isinstance(msg, P.MirrorSubmit):
                if self.mirror is not None:
                    self.mirror.submit(msg)
            elif isinstance(msg, P.Shutdown):
                break
            elif isinstance(msg, P.WriteRequest) and msg.after_mark:
                self.pending, self.held = (msg, None), msg
            elif isinstance(msg, P.WriteRequest):
                self.handle(msg)
        if self.parent_gone:
            return self.rescue()
        if self.mirror is not None:
            self.mirror.stop()
        self._items = None
        for block in self.blocks.values():
            block.close()
        return 0

    def start_mirror(self, msg: P.MirrorOpen) -> None:
        """The mirror tier, in this (niced) process: issue 21, "the upload runs in the writer process"."""
        if self.mirror is not None:
            return
        try:
            self.mirror = WorkerMirror(msg, self.open_storage(), self.send, self.uploaded, self.gate)
        except Exception as exc:  # noqa: BLE001 - bad settings: the trainer hears of it as an event
            self.send(P.MirrorUpdate(event={"event": "mirror-failed", "cut": None, "step": None, "error": str(exc),
                                            "error_type": type(exc).__name__, "attempt": 1, "retry_in": None},
                                     state={"scanned": False, "waiting": [], "held": None,
                                            "last_error": f"{type(exc).__name__}: {exc}", "seq": 0}))

    def uploaded(self, _n: int) -> None:
        """The mirror's uploads are progress too: an orphan draining them is not stalled."""
        self.last_progress = time.monotonic()

    def send(self, msg: P.StrictModel) -> None:
        if self.parent_gone:
            return
        try:
            with self._send_lock:
                P.send(self.sock, msg)
        except P.ChannelClosed:
            self.orphaned()

    # work ------------------------------------------------------------------------------------------
    def with_slots(self, req: P.WriteRequest) -> P.WriteRequest:
        """``req`` with its slots: those it lists (remembered under its ``layout`` number), or those
        of the last request that listed them under that number. A number this process was never
        sent leaves the slots None: ``handle`` answers with an error (the trainer's bookkeeping of
        what it sent is broken; nothing is written)."""
        if req.slots is not None:
            self.layout = (req.layout, req.slots)
            return req
        if self.layout is not None and self.layout[0] == req.layout:
            return req.model_copy(update={"slots": self.layout[1]})
        return req

    def attach(self, name: str, size: int, fd: int) -> None:
        self._items = None  # views of the old block: released first, or its map could not close
        for old in list(self.blocks):  # the trainer grew its block: the old one is gone for good
            self.blocks.pop(old).close()
        self.blocks[name] = Block.attach(fd, size, name)

    def items(self, req: P.WriteRequest) -> list[Any]:
        """The request's arrays as views of its block, made once per slots and block: a repeated
        layout writes the same regions (40,000 views cost 50 ms a cut, issue 23)."""
        assert req.slots is not None
        key = (req.slots, req.block)
        if self._items is None or self._items[0][0] is not req.slots or self._items[0][1] != req.block:
            view = self.blocks[req.block].view
            self._items = (key, [s.item(view) for s in req.slots])
        return self._items[1]

    def handle(self, req: P.WriteRequest) -> None:
        self.pending = (req, None) if req.finish is not None else None
        self.writing = req
        try:
            with self.gate.busy():
                done, written = self.write(req)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, typed, to the parent
            self.pending = None  # nothing to finish: the mark stays and gc removes what was written
            self.send(P.WriteFailed.of(req.cut, exc))  # as its own type, by its wire key (issue 20)
            return
        finally:
            self.writing = None
        if self.pending is not None:
            self.pending = (req, written)
        self.send(done)

    @pausing
    def write(self, req: P.WriteRequest) -> tuple[P.WriteDone, Written]:
        """Writes the request's shards; the answer (where each slot went) and the records kept here
        for a rescue. Raises for a request whose slots this process does not have."""
        if req.slots is None:
            raise RuntimeError(f"the request of cut {req.cut} names slots (layout {req.layout}) this writer "
                               "was never sent")
        t0 = time.perf_counter()
        storage = self.open_storage()
        # Marked by now (one rank, or rank 0), but another rank's directory may not exist yet.
        CommitProtocol(storage).open_rank_dir(req.cut)
        items = self.items(req)
        timings: dict[str, float] = {}
        files, tensors = write_shards(storage, req.cut, req.rank, items, codec=req.shards.make_codec(),
                                      max_shard_bytes=req.shards.max_shard_bytes, on_bytes=self.progress(req),
                                      timings=timings, hash_threads=self.hash_threads)
        done = P.WriteDone(cut=req.cut, files=files, placed=P.place(req.slots, files, tensors), timings=timings)
        done.timings["total"] = time.perf_counter() - t0
        return done, (files, tensors)

    def progress(self, req: P.WriteRequest) -> "_Progress":
        """The byte counter of one request: sends liveness frames (tests wrap it to inject faults)."""
        return _Progress(req, self)


class _Progress:
    """Sends a progress frame at most every 0.2 s: the parent's liveness signal."""

    def __init__(self, req: P.WriteRequest, worker: Worker) -> None:
        self.req = req
        self.worker = worker
        self.done = 0
        self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        self.worker.last_progress = now
        if now - self.last >= 0.2:
            self.last = now
            self.worker.send(P.Progress(cut=self.req.cut, bytes_done=self.done))


def _lower_priority(nice: int, idle_io: bool, cpus: list[int] | None) -> None:
    os.nice(max(0, nice - os.nice(0)))
    if idle_io:
        nr = _SYS_IOPRIO_SET.get(os.uname().machine)
        if nr is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(nr, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << 13)
    if cpus:
        os.sched_setaffinity(0, cpus)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ckptstore.writer.worker")
    ap.add_argument("--sock-fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--idle-io", action="store_true")
    ap.add_argument("--cpus", default="")
    ap.add_argument("--hash-threads", type=int, default=1)
    ap.add_argument("--stay-on-term", action="store_true")
    args = ap.parse_args(argv)
    worker = Worker(args.sock_fd, args.parent, hash_threads=max(1, args.hash_threads))
    # A preemption notice is the trainer's to act on (its next maybe_cut takes a cut, through this
    # process): SIGUSR1 never ends a writer, nor SIGTERM under preemption=True. Without it an idle
    # writer ends on SIGTERM; either way it ends when its parent does (watch_parent).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if args.stay_on_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        # Stop once idle: nothing in hand and no request unread (the main loop decides; exiting here
        # could drop a request its trainer handed over just before the same SIGTERM ended it).
        signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "terminating", True))
    if os.getppid() != args.parent:  # the parent died before we got here
        return 0
    threading.Thread(target=worker.watch_parent, name="ckptstore-watch-parent", daemon=True).start()
    _lower_priority(args.nice, args.idle_io, [int(c) for c in args.cpus.split(",") if c])
    return worker.serve()


if __name__ == "__main__":
    sys.exit(main())
