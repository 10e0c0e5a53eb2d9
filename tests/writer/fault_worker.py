"""A writer process with one injected fault, for tests only: ``python fault_worker.py --fault KIND
<the worker's own arguments>``. The fault fires once, halfway through the bytes of the first write
request: "exit-mid-shard", "sigkill-mid-shard", "hang-mid-shard", "raise-mid-shard" (EACCES),
"raise-rank-failure-mid-shard" (a ckptstore error that is no StorageError and is defined outside
ckptstore.errors, with fields of its own: ``RankFailure`` naming ranks 1 and 2) or "pause-mid-shard"
(3 s, then the write goes on: a slow disk; "pause-mid-shard:S" pauses S seconds).

The "orphan-..." faults hold the worker at one point of a hand-over until its trainer is dead (and one
second more, so its parent-pid watchdog has acted): "orphan-before-read" before it reads the first
request after ``open`` (sent but unread), "orphan-before-parse" between reading a request's frame and
parsing it, "orphan-before-handle" between parsing it and starting its write.

Start it with :func:`inject`; the production worker and its wire protocol
know nothing of faults.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ckptstore.writer import protocol, worker


class _HeldAdapter:
    """The protocol's parser, held before it parses the first write request until the trainer died."""

    def __init__(self, inner, parent: int) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.parent, self.fired = inner, parent, False

    def validate_json(self, body, **kw):  # type: ignore[no-untyped-def]
        if not self.fired and body.startswith(b'{"kind":"write"'):
            self.fired = True
            wait_orphaned(self.parent)
        return self.inner.validate_json(body, **kw)

FAULTS = ("exit-mid-shard", "sigkill-mid-shard", "hang-mid-shard", "raise-mid-shard", "raise-rank-failure-mid-shard",
          "pause-mid-shard")
HANDOVER = ("orphan-before-read", "orphan-before-parse", "orphan-before-handle")


def wait_orphaned(parent: int) -> None:
    """Until the parent is gone (bounded), then one second more: the watchdog polls every 0.2 s."""
    deadline = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)


def fire(kind: str) -> None:
    if kind == "exit-mid-shard":
        os._exit(17)
    if kind == "sigkill-mid-shard":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang-mid-shard":
        while True:
            time.sleep(3600)
    if kind == "raise-mid-shard":
        raise PermissionError(13, "injected fault: permission denied")
    if kind == "raise-rank-failure-mid-shard":
        from ckptstore.ranks import RankFailure

        raise RankFailure("injected fault: ranks 1 and 2 failed", ranks=[2, 1], exchange="save-written",
                          hint="injected by tests/writer/fault_worker.py")
    if kind.startswith("pause-mid-shard"):
        time.sleep(float(kind.partition(":")[2] or 3))
        return
    raise ValueError(f"unknown fault {kind!r}")


def inject(ck: object, kind: str) -> None:
    """Replaces a Checkpointer's writer process with one whose next request fails with ``kind``
    halfway through its bytes; the writers started after it are ordinary ones."""
    from ckptstore.writer.process import WriterProcess

    ck._close_writer()  # type: ignore[attr-defined]
    ck._writer = WriterProcess(ck.store.storage.spec(), ck.options,  # type: ignore[attr-defined]
                               command=[sys.executable, os.path.abspath(__file__), "--fault", kind],
                               lock=ck.store.lock_handoff())  # type: ignore[attr-defined]


def main(argv: list[str]) -> int:
    i = argv.index("--fault")
    kind = argv[i + 1]
    if kind.partition(":")[0] not in FAULTS + HANDOVER:
        raise SystemExit(f"unknown fault {kind!r}; one of {FAULTS + HANDOVER}")
    rest = argv[:i] + argv[i + 2 :]
    parent = int(rest[rest.index("--parent") + 1])
    if kind == "orphan-before-parse":
        protocol._ADAPTER = _HeldAdapter(protocol._ADAPTER, parent)

    class FaultyWorker(worker.Worker):
        fired = False

        def next_message(self):  # type: ignore[no-untyped-def]
            if kind == "orphan-before-read" and self.spec is not None and not FaultyWorker.fired:
                FaultyWorker.fired = True
                wait_orphaned(parent)
            return super().next_message()

        def handle(self, req):  # type: ignore[no-untyped-def]
            if kind == "orphan-before-handle" and not FaultyWorker.fired:
                FaultyWorker.fired = True
                wait_orphaned(parent)
            return super().handle(req)

        def progress(self, req):  # type: ignore[no-untyped-def]
            inner = super().progress(req)
            total = sum(s.nbytes for s in req.slots)

            def on_bytes(n: int) -> None:
                inner(n)
                if kind not in HANDOVER and not FaultyWorker.fired and inner.done * 2 >= total:
                    FaultyWorker.fired = True
                    fire(kind)

            return on_bytes

    worker.Worker = FaultyWorker  # type: ignore[misc]
    return worker.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
