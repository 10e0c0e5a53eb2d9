"""A numpy-only trainer for kill sweeps and the soak (no torch import: starts in a fraction of a second).

Its state at step s is fully determined by s (``w == s``), so any loaded cut can be checked exactly.
Prints one JSON line per event (and ``{"event": "writer", "pid": ...}`` whenever its writer changes).

    python soak_trainer.py STORE [--steps N] [--kill-at PHASE:N] [--mode process]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import numpy as np

import ckptstore
from ckptstore.writer import Checkpointer


def state_at(step: int, size: int) -> dict:
    return {"w": np.full(size, float(step), dtype=np.float32), "c": np.arange(8, dtype=np.int64) + step,
            "step": step}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--size", type=int, default=250_000)
    ap.add_argument("--kill-at", default=None, help="PHASE:N: SIGKILL this process at the Nth PHASE")
    ap.add_argument("--mode", default="process")
    ap.add_argument("--busy", default="skip")
    args = ap.parse_args()
    out = sys.stdout

    def say(doc: dict) -> None:
        out.write(json.dumps(doc, default=str) + "\n")
        out.flush()

    seen: dict[str, int] = {}

    def on_phase(phase: str, cut: str) -> None:
        if args.kill_at is None:
            return
        name, n = args.kill_at.rsplit(":", 1)
        seen[phase] = seen.get(phase, 0) + 1
        if phase == name and seen[phase] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)

    store = ckptstore.Store.open(args.store, create=True, options=ckptstore.StoreOptions(on_phase=on_phase))
    latest = store.latest()
    start = 0
    if latest is not None:
        st = store.load()
        start = st["step"]
        assert st["w"][0] == start and st["c"][0] == start, "loaded state is not the state of its step"
    say({"event": "resumed", "step": start})
    writer_pid = None
    with Checkpointer(store, every=1, keep=ckptstore.KeepLast(2), mode=args.mode, busy=args.busy,
                      on_event=say) as ck:
        for step in range(start + 1, args.steps + 1):
            if ck.writer_pid != writer_pid:
                writer_pid = ck.writer_pid
                say({"event": "writer", "pid": writer_pid})
            ck.maybe_cut(step, state_at(step, args.size))
        ck.cut(args.steps + 1, state_at(args.steps + 1, args.size), final=True)
    store.close()
    say({"event": "finished"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
