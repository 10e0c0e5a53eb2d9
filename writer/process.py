"""Parent side of the writer process: spawn, handshake, one request at a time, liveness, shutdown.

Every wait is bounded: a request waits for ``done``/``error`` frames with a timeout that each
``progress`` frame renews; a dead writer (closed socket, exit status) raises ``WriterDied`` at once, a
silent one ``WriterTimeout`` after ``write_timeout`` (and is killed). ``close()`` asks for a shutdown,
waits briefly, then kills: no zombie and no orphan survives it.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from typing import Any, Callable, Sequence

from ckptstore.errors import CkptStoreError, from_wire
from ckptstore.spi import StorageSpec  # spi loads protocol, which defines CommitUnknown: see rebuild_error

from . import protocol as P
from .errors import WriterDied, WriterError, WriterTimeout
from .options import WriterOptions


class WriterProcess:
    """One persistent writer subprocess."""

    #: The worker's command line before its arguments. Tests start a fault-injecting worker instead
    #: (tests/writer/fault_worker.py) by passing ``command``; nothing of that travels in the protocol.
    COMMAND = (sys.executable, "-m", "ckptstore.writer.worker")

    def __init__(self, spec: StorageSpec, options: WriterOptions, *, command: Sequence[str] | None = None,
                 lock: tuple[dict[str, Any], int | None] = ({"kind": "none"}, None)) -> None:
        """``lock``: the trainer's writer lock as ``Store.lock_handoff()`` describes it, inherited by the
        process so it can finish a cut should the trainer die (``ckptstore.rescue``)."""
        self.store_url = store_url = spec.url
        self.options = options
        self._send_lock = threading.Lock()  # the commit thread and the loop both send
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [*(command or self.COMMAND), "--sock-fd", str(child_end.fileno()),
               "--parent", str(os.getpid()), "--nice", str(options.nice),
               "--hash-threads", str(options.write_threads)]
        if options.preemption:
            cmd.append("--stay-on-term")
        if options.idle_io:
            cmd.append("--idle-io")
        if options.cpu_affinity:
            cmd += ["--cpus", ",".join(str(c) for c in options.cpu_affinity)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL,
                                         close_fds=True)
        finally:
            child_end.close()
        self._sock = parent_end
        self._req = self._rep = parent_end.fileno()
        self._block_sent: str | None = None
        #: The slots last sent to this writer and their number: a request of the same slots (a repeated
        #: layout's plan, the same tuple) names them by number (issue 23: 2.6 MB a cut at 40,000 arrays).
        self._layout: tuple[Any, int] = (None, 0)
        self.last_phase = "starting"
        try:
            hello = P.recv(self._rep, timeout=options.handshake_timeout)
        except (TimeoutError, P.ChannelClosed) as exc:
            self.kill()
            raise WriterDied(f"writer process failed its handshake ({type(exc).__name__}); exit status "
                             f"{self.proc.returncode}", store=store_url) from None
        if not isinstance(hello, P.Hello):
            self.kill()
            raise WriterError(f"writer process sent {hello.kind!r} instead of hello", store=store_url)
        self.hello = hello
        self.pid = self.proc.pid
        handoff, lock_fd = lock
        if handoff.get("kind") == "flock" and lock_fd is None:
            handoff = {"kind": "none"}
        try:
            P.send(self._req, P.OpenStore(url=spec.url, storage_options=spec.storage_options, io=spec.io, lock=handoff))
            if handoff.get("kind") == "flock":
                P.send_fd(self._req, lock_fd)  # type: ignore[arg-type]
        except (P.ChannelClosed, OSError):
            raise self.death(None, None) from None
        self.last_phase = "idle"
        #: Where the worker's ``mirror-update`` frames go (issue 21; None with the channel's end).
        self.on_mirror: Callable[[P.MirrorUpdate | None], None] | None = None
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="ckptstore-writer-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """The only reader of the socket after the handshake (issue 21: the worker's mirror thread
        speaks at any time): answers to requests go to the inbox ``wait_done`` reads, mirror updates
        to ``on_mirror``. The end of the channel (or a broken frame) goes to both, and stays in the
        inbox for every later wait."""
        while True:
            try:
                msg = P.recv(self._rep)
            except BaseException as exc:  # noqa: BLE001 - ChannelClosed, FrameTimeout, a bad frame
                self._inbox.put(exc)
                self._to_mirror(None)
                return
            if isinstance(msg, P.MirrorUpdate):
                self._to_mirror(msg)
            else:
                self._inbox.put(msg)

    def _to_mirror(self, msg: P.MirrorUpdate | None) -> None:
        sink = self.on_mirror
        if sink is not None:
            try:
                sink(msg)
            except Exception:  # noqa: BLE001 - the tier's bookkeeping must not end the reader
                pass

    def send(self, msg: P.StrictModel) -> None:
        """Sends one frame that needs no answer (``mirror-open``, ``mirror-submit``); a dead writer
        raises ``WriterDied``."""
        try:
            with self._send_lock:
                P.send(self._req, msg)
        except (P.ChannelClosed, OSError):
            raise self.death(None, None) from None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def death(self, step: int | None, cut: str | None) -> WriterDied:
        """The WriterDied for this process, once it is gone (its exit status waited for, briefly; then
        killed), naming what it was doing; the commit thread raises it for a writer found dead."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit code {code}"
        return WriterDied(f"writer process {self.pid} died while {self.last_phase} ({how})",
                          step=step, store=self.store_url, cut=cut)

    def write(self, req: P.WriteRequest, block_fd: int) -> P.WriteDone:
        """Sends one request (and the block's descriptor, the first time this writer sees that block)
        and waits for its answer (bounded; see the module docstring)."""
        self.submit(req, block_fd)
        return self.wait_done(req)

    def submit(self, req: P.WriteRequest, block_fd: int) -> None:
        """Hands a request over (the trainer may die from here on: with ``req.finish`` the writer
        finishes the cut alone)."""
        self.last_phase = f"writing {req.cut}"
        sent, number = self._layout
        known = sent is req.slots and type(sent) is tuple
        wire, tail = P.on_the_wire(req, layout=number if known else number + 1, slots_known=known)
        try:
            with self._send_lock:
                P.send(self._req, wire, tail)
                self._layout = (req.slots, wire.layout)
                if self._block_sent != req.block:
                    P.send_fd(self._req, block_fd)
                    self._block_sent = req.block
        except (P.ChannelClosed, OSError):
            raise self.death(req.step, req.cut) from None

    def marked(self, cut: str) -> None:
        """Tells the writer that ``cut`` is marked and in the block: it may write the request it holds."""
        try:
            with self._send_lock:
                P.send(self._req, P.Marked(cut=cut))
        except (P.ChannelClosed, OSError):
            raise self.death(None, cut) from None

    def end(self, cut: str) -> None:
        """Tells the writer that ``cut`` was committed or abandoned (nothing left to rescue). Best
        effort: a writer that cannot hear it is dead or will be replaced."""
        try:
            with self._send_lock:
                P.send(self._req, P.CutEnded(cut=cut))
        except (P.ChannelClosed, OSError):
            pass

    def wait_done(self, req: P.WriteRequest) -> P.WriteDone:
        """Waits for the answer to a submitted request (bounded; see the module docstring)."""
        while True:
            try:
                msg = self._inbox.get(timeout=self.options.write_timeout)
            except queue.Empty:
                msg = TimeoutError()
            if isinstance(msg, BaseException):
                if not isinstance(msg, TimeoutError) or isinstance(msg, P.FrameTimeout):
                    self._inbox.put(msg)  # the channel's end stays for every later wait
                if isinstance(msg, P.ChannelClosed):
                    raise self.death(req.step, req.cut) from None
                if not isinstance(msg, TimeoutError):
                    raise msg
                self.kill()
                raise WriterTimeout(
                    f"writer process {self.pid} made no progress for {self.options.write_timeout:.0f} s while "
                    f"{self.last_phase}; killed it", step=req.step, store=self.store_url, cut=req.cut,
                ) from None
            if isinstance(msg, P.Progress):
                self.last_phase = f"writing {req.cut} ({msg.bytes_done} bytes done)"
                continue
            if isinstance(msg, P.WriteDone) and msg.cut == req.cut:
                self.last_phase = "idle"
                return msg
            if isinstance(msg, P.WriteFailed):
                self.last_phase = "idle"
                raise rebuild_error(msg, req.step)
            raise WriterError(f"unexpected message {msg.kind!r} from writer", store=self.store_url, cut=req.cut)

    def close(self, timeout: float = 10.0) -> None:
        """Graceful shutdown, then kill. Idempotent."""
        if self.proc.returncode is None:
            try:
                with self._send_lock:
                    P.send(self._req, P.Shutdown())
                self.proc.wait(timeout=timeout)
            except (P.ChannelClosed, subprocess.TimeoutExpired, OSError):
                self.kill()
        self._close_fds()

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._close_fds()

    def _close_fds(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            # The reader thread ends on the shutdown (EOF) before the descriptor is closed, so it never
            # reads a number the process reuses for another file.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            reader = getattr(self, "_reader", None)
            if reader is not None and reader is not threading.current_thread():
                reader.join(5.0)
            sock.close()
            self._sock = None
            self._req = self._rep = -1


def rebuild_error(msg: P.WriteFailed, step: int) -> CkptStoreError:
    """The writer's error as its own type with its fields, by its wire key (issue 20); a
    ``WriterError`` naming what came when it was no ckptstore error (or a key unknown here). The
    modules that define errors outside ckptstore.errors (and writer.errors) are imported above, so
    their keys are registered wherever this runs."""
    exc = from_wire(msg.key, msg.message, msg.fields) if msg.key is not None else None
    if isinstance(exc, WriterError) and exc.step is None:
        exc.step = step
    if exc is not None:
        return exc
    fields = {k: v for k, v in msg.fields.items() if k in ("store", "cut", "path", "hint") and v is not None}
    fields.setdefault("cut", msg.cut)
    return WriterError(f"writer failed: {msg.error_type}: {msg.message}", step=step, **fields)


def wait_gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` no longer exists (tests and leak checks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False
