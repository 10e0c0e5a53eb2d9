"""A trainer process for test_mirror_crash.py (issue 21, "Crash safety"): a Checkpointer with an S3
mirror reached through the test's fault proxy takes one cut, waits for its local commit, reports its
own pid and its writer's on stdout, and waits to be SIGKILLed. Not collected by pytest (no test_ prefix).

Its one argument is a JSON document: ``local`` (the local tier's directory), ``mirror`` (the mirror's
URL), ``storage_options`` (s3fs options through the proxy), ``lease_ttl_s`` (the mirror's writer lease:
short, so the restart's open does not wait 30 s for a dead holder), ``events`` (the JSON-lines file) and
``state`` ("small" or "big", see :func:`state`), ``mirror_timeout`` (how long an orphaned writer goes
on uploading) and ``then``: absent, wait to be killed; "rescue", hand cut 2 over and SIGKILL itself."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import numpy as np

#: float32 elements of the "big" state: 16 MiB and 4 KiB, one shard just over the 16 MiB multipart part
#: (ckptstore/storage/multipart.py PART_BYTES), so its upload to the mirror is a multipart upload of two parts
BIG = (4 << 20) + 1024


def state(kind: str, step: int) -> dict:
    """The state the child cuts at ``step`` (numpy arrays: the capture path of CPU tensors, without
    paying torch's import in a subprocess); the test rebuilds it to compare a loaded cut bitwise."""
    if kind == "big":
        return {"w": np.arange(BIG, dtype=np.float32) + step, "step": step}
    return {**{f"w{i}": np.arange(16 * 1024, dtype=np.float32) * step + i for i in range(4)}, "step": step}


def main() -> int:
    from ckptstore import StoreOptions
    from ckptstore.writer import Checkpointer

    cfg = json.loads(sys.argv[1])
    mopts = StoreOptions(storage_options=cfg["storage_options"], lease_ttl_s=cfg["lease_ttl_s"])
    # mirror_retry_s: a failed first open (the proxy's rules are set before this child starts) is tried
    # again soon; the test kills the child long before any retry could finish an upload.
    ck = Checkpointer(cfg["local"], every=1, mode="process", mirror=cfg["mirror"], mirror_options=mopts,
                      mirror_retry_s=0.2, mirror_timeout=cfg.get("mirror_timeout", 600.0), events_path=cfg["events"])
    info = ck.cut(1, state(cfg["state"], 1)).wait(60)  # committed locally; its upload runs behind
    print(json.dumps({"event": "committed", "cut": info.id, "pid": os.getpid(), "writer_pid": ck.writer_pid}),
          flush=True)
    if cfg.get("then") == "rescue":
        # Cut 2 handed over (maybe_cut returned), then this trainer dies at once: its writer finishes the
        # cut alone (the rescue), and mirrors it too (issue 21).
        handed = ck.maybe_cut(2, state(cfg["state"], 2))
        print(json.dumps({"event": "handed", "cut": handed.id}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    # Bounded: if the test never kills us, end by ourselves (without the atexit close, which would wait
    # for the mirror) so no stray process outlives the test run.
    threading.Event().wait(120)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
