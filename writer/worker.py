"""The writer process: attaches the shared block, writes shards through the store's format, answers.

Started once per Checkpointer as a fresh interpreter (``python -m ckptstore.writer.worker``, the
spawn model: nothing inherited but one end of a Unix socket pair), at nice 10. It never imports torch: everything it
needs is bytes in the block plus the small request (names, dtypes, shapes, offsets). It never commits:
the trainer's commit thread does that once the files are durable.

It notices its parent's death two ways: the socket reaches EOF, and a watchdog thread sees its parent
pid change (even while a shard is being written). Either way it exits at once without committing; the
shared block has no name, so the kernel frees it with the last mapping; the cut's mark stays, so the
store's gc removes the partial files. (PR_SET_PDEATHSIG is not used: it fires when the *thread* that
started the process ends, such as a commit thread, not only when the trainer dies.)
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

from ckptstore.errors import CkptStoreError
from ckptstore.gcpause import pausing
from ckptstore.shards import Codec, write_shards
from ckptstore.storage import Storage, StorageSpec, open_spec

from . import protocol as P
from .shm import Block

IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_IDLE = 3
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


class Worker:
    def __init__(self, sock_fd: int, parent: int, hash_threads: int = 1) -> None:
        self.sock = sock_fd
        self.spec: StorageSpec | None = None
        self.parent = parent
        self.hash_threads = hash_threads
        self.blocks: dict[str, Block] = {}
        self.storage: Storage | None = None

    # lifecycle -------------------------------------------------------------------------------------
    def orphaned(self, *_: Any) -> None:
        """The trainer is gone: stop at once without committing (the kernel frees the block)."""
        os._exit(0)

    def watch_parent(self, interval: float = 0.2) -> None:
        """Runs in a daemon thread: exits the process as soon as the parent is gone."""
        while True:
            if os.getppid() != self.parent:
                self.orphaned()
            time.sleep(interval)

    def serve(self) -> int:
        self.send(P.Hello(pid=os.getpid(), nice=os.nice(0), modules_with_torch="torch" in sys.modules))
        while True:
            try:
                msg = P.recv(self.sock)
                if isinstance(msg, P.WriteRequest) and msg.block not in self.blocks:
                    self.attach(msg.block, msg.block_size, P.recv_fd(self.sock))
            except P.ChannelClosed:
                self.orphaned()
                return 0
            if isinstance(msg, P.OpenStore):
                self.spec, self.storage = StorageSpec(msg.url, msg.storage_options), None
                continue
            if isinstance(msg, P.Shutdown):
                for block in self.blocks.values():
                    block.close()
                return 0
            if isinstance(msg, P.WriteRequest):
                self.handle(msg)

    def send(self, msg: P.StrictModel) -> None:
        try:
            P.send(self.sock, msg)
        except P.ChannelClosed:
            self.orphaned()

    # work ------------------------------------------------------------------------------------------
    def attach(self, name: str, size: int, fd: int) -> None:
        for old in list(self.blocks):  # the trainer grew its block: the old one is gone for good
            self.blocks.pop(old).close()
        self.blocks[name] = Block.attach(fd, size, name)

    def handle(self, req: P.WriteRequest) -> None:
        try:
            done = self.write(req)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, typed, to the parent
            fields = {}
            if isinstance(exc, CkptStoreError):
                fields = {"store": exc.store, "cut": exc.cut, "path": exc.path, "hint": exc.hint,
                          "errno": getattr(exc, "errno", None)}
            self.send(P.WriteFailed(cut=req.cut, error_type=type(exc).__name__, message=getattr(
                exc, "message", str(exc)), fields=fields))
            return
        self.send(done)

    @pausing
    def write(self, req: P.WriteRequest) -> P.WriteDone:
        t0 = time.perf_counter()
        if self.storage is None:
            if self.spec is None:
                raise RuntimeError("the parent sent a write before naming the store")
            self.storage = open_spec(self.spec)
        block = self.blocks[req.block]
        items = [s.item(block.view) for s in req.slots]
        timings: dict[str, float] = {}
        files, tensors = write_shards(self.storage, req.cut, req.rank, items, codec=Codec(req.codec, req.zstd_level),
                                      max_shard_bytes=req.max_shard_bytes, on_bytes=self.progress(req),
                                      timings=timings, hash_threads=self.hash_threads)
        timings["total"] = time.perf_counter() - t0
        return P.WriteDone(cut=req.cut, files=files, tensors=tensors, timings=timings)

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
    args = ap.parse_args(argv)
    worker = Worker(args.sock_fd, args.parent, hash_threads=max(1, args.hash_threads))
    signal.signal(signal.SIGTERM, worker.orphaned)
    if os.getppid() != args.parent:  # the parent died before we got here
        return 0
    threading.Thread(target=worker.watch_parent, name="ckptstore-watch-parent", daemon=True).start()
    _lower_priority(args.nice, args.idle_io, [int(c) for c in args.cpus.split(",") if c])
    return worker.serve()


if __name__ == "__main__":
    sys.exit(main())
