"""A writer process with one injected fault, for tests only: ``python fault_worker.py --fault KIND
<the worker's own arguments>``. The fault fires once, halfway through the bytes of the first write
request: "exit-mid-shard", "sigkill-mid-shard", "hang-mid-shard", "raise-mid-shard" (EACCES) or
"pause-mid-shard" (3 s, then the write goes on: a slow disk).

Start it with :func:`inject`; the production worker and its wire protocol
know nothing of faults.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ckptstore.writer import worker

FAULTS = ("exit-mid-shard", "sigkill-mid-shard", "hang-mid-shard", "raise-mid-shard", "pause-mid-shard")


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
    if kind == "pause-mid-shard":
        time.sleep(3)
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
    if kind not in FAULTS:
        raise SystemExit(f"unknown fault {kind!r}; one of {FAULTS}")
    rest = argv[:i] + argv[i + 2 :]

    class FaultyWorker(worker.Worker):
        fired = False

        def progress(self, req):  # type: ignore[no-untyped-def]
            inner = super().progress(req)
            total = sum(s.nbytes for s in req.slots)

            def on_bytes(n: int) -> None:
                inner(n)
                if not FaultyWorker.fired and inner.done * 2 >= total:
                    FaultyWorker.fired = True
                    fire(kind)

            return on_bytes

    worker.Worker = FaultyWorker  # type: ignore[misc]
    return worker.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
