"""A numpy-only trainer for kill sweeps and the soak (no torch import: starts in a fraction of a second).

Its state at step s is fully determined by s (``w == s``), so any loaded cut can be checked exactly.
Prints one JSON line per event (and ``{"event": "writer", "pid": ...}`` whenever its writer changes).
``--many N`` adds N small arrays of mixed dtypes, each filled with s % 250 (issue 23: the batched capture, the
bulk shard writes and the table manifest under kills); ``--torch`` makes them torch tensors (the
``torch.cat``/``_foreach_copy_`` capture; the trainer then imports torch and starts slower).

    python soak_trainer.py STORE [--steps N] [--kill-at PHASE:N] [--mode process] [--many N [--torch]]
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


#: The dtypes of the ``--many`` arrays, in turn; their lengths cycle through MANY_LENGTHS elements.
MANY_DTYPES = ("float32", "int64", "float16", "uint8", "int32")
MANY_LENGTHS = (1, 3, 17, 100, 1024)


def state_at(step: int, size: int, many: int = 0, use_torch: bool = False) -> dict:
    out = {"w": np.full(size, float(step), dtype=np.float32), "c": np.arange(8, dtype=np.int64) + step,
           "step": step}
    if many:
        arrays = [np.full(MANY_LENGTHS[i % len(MANY_LENGTHS)], step % 250, dtype=MANY_DTYPES[i % len(MANY_DTYPES)])
                  for i in range(many)]
        if use_torch:
            import torch

            arrays = [torch.from_numpy(a) for a in arrays]
        # Nested as a model and an optimizer lay theirs out: a dict of dicts keyed by int.
        out["many"] = {i // 3: {} for i in range(many)}
        for i, a in enumerate(arrays):
            out["many"][i // 3][f"t{i % 3}"] = a
    return out


def refill(state: dict, step: int) -> dict:
    """``state`` made the state of ``step`` in place, as a trainer's optimizer step updates its tensors: the
    layout (and every array's address) stays, so the writer's layout cache is warm from the second cut."""
    state["w"].fill(float(step))
    state["c"][:] = np.arange(8, dtype=np.int64) + step
    state["step"] = step
    for d in state["many"].values():
        for a in d.values():
            if isinstance(a, np.ndarray):
                a.fill(step % 250)
            else:  # a torch tensor
                a.fill_(step % 250)
    return state


def check_state(st: dict, step: int, many: int) -> None:
    """``st`` (a load) is the state of ``step``: every array holds the step's value."""
    assert st["step"] == step and np.all(st["w"] == step) and st["c"][0] == step, "not the state of its step"
    if many:
        got = [a for d in st["many"].values() for a in d.values()]
        assert len(got) == many, (len(got), many)
        for i, a in enumerate(got):
            a = np.asarray(a)
            assert a.dtype == np.dtype(MANY_DTYPES[i % len(MANY_DTYPES)]) and a.size == MANY_LENGTHS[i % len(MANY_LENGTHS)]
            assert np.all(a == step % 250), f"array {i} is not the state of step {step}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--size", type=int, default=250_000)
    ap.add_argument("--kill-at", default=None, help="PHASE:N: SIGKILL this process at the Nth PHASE")
    ap.add_argument("--mode", default="process")
    ap.add_argument("--busy", default="skip")
    ap.add_argument("--many", type=int, default=0)
    ap.add_argument("--torch", action="store_true")
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
        check_state(st, start, args.many)
    say({"event": "resumed", "step": start})
    writer_pid = None
    with Checkpointer(store, every=1, keep=ckptstore.KeepLast(2), mode=args.mode, busy=args.busy,
                      on_event=say) as ck:
        state = None
        for step in range(start + 1, args.steps + 1):
            if ck.writer_pid != writer_pid:
                writer_pid = ck.writer_pid
                say({"event": "writer", "pid": writer_pid})
            if state is None or not args.many:
                state = state_at(step, args.size, args.many, args.torch)
            else:  # the same arrays updated in place, as a model's are
                state = refill(state, step)
            ck.maybe_cut(step, state)
        ck.cut(args.steps + 1, state_at(args.steps + 1, args.size, args.many, args.torch), final=True)
    store.close()
    say({"event": "finished"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
