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

from ckptstore.arrays import ArrayItem
from ckptstore.errors import CkptStoreError
from ckptstore.fs import Storage, open_storage
from ckptstore.layout import shard_name
from ckptstore.shards import Codec, write_shard

from . import protocol as P
from .shm import Block

IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_IDLE = 3
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


class Worker:
    def __init__(self, sock_fd: int, store_url: str, parent: int, hash_threads: int = 1) -> None:
        self.sock = sock_fd
        self.store_url = store_url
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

    def write(self, req: P.WriteRequest) -> P.WriteDone:
        t0 = time.perf_counter()
        if self.storage is None:
            self.storage = open_storage(self.store_url)
        block = self.blocks[req.block]
        codec = Codec(req.codec, req.zstd_level)
        files, tensors = [], []
        timings: dict[str, float] = {}
        progress = _Progress(req, self)
        for i, idx in enumerate(req.shards):
            items = [
                ArrayItem(s.name, s.kind, s.dtype, tuple(s.shape), s.nbytes, block.view[s.offset : s.offset + s.nbytes])
                for s in (req.slots[j] for j in idx)
            ]
            name = shard_name(req.rank, i, compressed=codec.name == "zstd")
            rec, trecs = write_shard(self.storage, req.cut, name, req.rank, items, codec,
                                     on_bytes=progress, timings=timings, hash_threads=self.hash_threads)
            files.append(rec)
            tensors.extend(trecs)
        timings["total"] = time.perf_counter() - t0
        return P.WriteDone(cut=req.cut, files=files, tensors=tensors, timings=timings)


class _Progress:
    """Sends a progress frame at most every 0.2 s (liveness), and runs test-only faults mid-shard."""

    def __init__(self, req: P.WriteRequest, worker: Worker) -> None:
        self.req = req
        self.worker = worker
        self.done = 0
        self.last = time.monotonic()
        self.total = sum(s.nbytes for s in req.slots)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.req.fault and self.done * 2 >= self.total:
            _fault(self.req.fault)
        now = time.monotonic()
        if now - self.last >= 0.2:
            self.last = now
            self.worker.send(P.Progress(cut=self.req.cut, bytes_done=self.done))


def _fault(kind: str) -> None:
    if kind == "exit-mid-shard":
        os._exit(17)
    if kind == "sigkill-mid-shard":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang-mid-shard":
        while True:
            time.sleep(3600)
    if kind == "raise-mid-shard":
        raise PermissionError(13, "injected fault: permission denied")


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
    ap.add_argument("--store", required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--idle-io", action="store_true")
    ap.add_argument("--cpus", default="")
    ap.add_argument("--hash-threads", type=int, default=1)
    args = ap.parse_args(argv)
    worker = Worker(args.sock_fd, args.store, args.parent, hash_threads=max(1, args.hash_threads))
    signal.signal(signal.SIGTERM, worker.orphaned)
    if os.getppid() != args.parent:  # the parent died before we got here
        return 0
    threading.Thread(target=worker.watch_parent, name="ckptstore-watch-parent", daemon=True).start()
    _lower_priority(args.nice, args.idle_io, [int(c) for c in args.cpus.split(",") if c])
    return worker.serve()


if __name__ == "__main__":
    sys.exit(main())
