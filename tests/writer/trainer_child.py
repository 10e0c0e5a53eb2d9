"""A trainer process for test_trainer_killed.py: takes one committed cut in process mode, then starts a
second cut that the writer hangs in (the "hang-mid-shard" fault), reports both on stdout, and waits to
be SIGKILLed by the test. Not collected by pytest (no test_ prefix)."""

from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np

from ckptstore.writer import Checkpointer
from fault_worker import inject


def say(**doc: object) -> None:
    print(json.dumps(doc), flush=True)


def main() -> int:
    url = sys.argv[1]
    # numpy arrays: the same capture path as CPU tensors, without paying torch's import in a subprocess
    state = {f"w{i}": np.full(64 * 1024, float(i), dtype=np.float32) for i in range(4)}
    # write_timeout bounds how long the orphaned, hung writer tries to finish the cut alone (the rescue)
    ck = Checkpointer(url, every=1, mode="process", write_timeout=6)
    info = ck.cut(1, state).wait(60)
    inject(ck, "hang-mid-shard")  # a writer process that hangs halfway through its next cut
    say(event="first", cut=info.id, pid=os.getpid(), writer_pid=ck.writer_pid)
    for a in state.values():
        a += 1.0
    h = ck.maybe_cut(2, state)
    assert h is not None
    say(event="second", cut=h.id)
    # Bounded: if the test never kills us, end by ourselves (without the atexit drain, which would wait
    # for the hung cut) so no stray process outlives the test run.
    threading.Event().wait(120)
    say(event="not-killed")
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
