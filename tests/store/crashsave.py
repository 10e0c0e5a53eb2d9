"""A writer that dies on purpose: the crash half of the real-process crash tests.

Run as ``python tests/store/crashsave.py URL [options]``. It opens the store at URL as its writer,
saves ``--pre`` cuts normally (steps 1..N, states from :func:`state_for`), then, with
``StoreOptions(on_phase=hook)``, does one more save (step N+1) or, with ``--prune``, a
``prune(KeepLast(1))``, and SIGKILLs itself:

* ``--phase NAME --occurrence K``: in the protocol hook, at the K-th time phase NAME fires
  (``ckptstore.protocol.SAVE_PHASES`` / ``PRUNE_PHASES``); a phase that only cuts of several ranks
  have ("rank-written") is crashed in a cut of two ranks, both written from this process (as DCP's
  writer writes rank parts: ``save_as_ranks``);
* ``--kill-at-bytes N``: from a helper thread, once the shard files of the new cut hold N bytes or more
  (a mid-write state; if the thread has not fired by the time every shard is synced, the
  ``shards-synced`` hook waits for it, so the kill always lands before the manifest);
* ``--kill-at-fraction F``: from a timer, F times the duration of the last normal save after the
  crashing save starts (any state, commit included; the save may also win the race and finish);
* ``--hold-at NAME``: at phase NAME, print ``HOLD`` and block (holding the writer lock, mid-save) until
  stdin closes; the test kills it.

It imports numpy and ckptstore only (never torch), so it starts in well under a second. What it did is
printed one fact per line (``PID``, ``SAVED step cut``, ``CUT cut``, ``KILL phase cut``, ``BYTES n``,
``HOLD cut``, ``DONE cut``), flushed before every kill. Exit codes when it is not killed: 0 (only
``--kill-at-fraction``: the save won), 3 (the phase never fired), 4 (stdin closed while holding).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

SHARD_BYTES = 1 << 20


def state_for(step: int) -> dict[str, Any]:
    """The state saved at ``step``: about 3.6 MB of numpy arrays of several dtypes and shapes, different
    for every step (so a load that returns the wrong cut cannot pass)."""
    rng = np.random.default_rng(1000 + step)
    return {
        "model": {
            "w1": rng.standard_normal(300_000, dtype=np.float32),
            "w2": rng.standard_normal((256, 512)).astype(np.float16),
            "emb": rng.integers(-(2**40), 2**40, size=(1000, 100), dtype=np.int64),
        },
        "opt": {
            "m": rng.standard_normal(200_000, dtype=np.float32),
            "count": rng.integers(0, 255, size=500_000, dtype=np.uint8),
        },
        "mask": rng.random(1000) > 0.5,
        "step": np.array(step, dtype=np.int64),
    }


def shard_count(state: Any, max_shard_bytes: int = SHARD_BYTES) -> int:
    """How many shard files ``Store.save`` writes for ``state`` (the "shard-written" occurrences)."""
    from ckptstore.arrays import describe
    from ckptstore.shards import plan_shards
    from ckptstore.tree import flatten

    _, leaves = flatten(state)
    return len(plan_shards([describe(leaf) for leaf in leaves], max_shard_bytes))


_SAY = threading.Lock()


def say(*words: object) -> None:
    """One whole line, flushed: the watcher thread and the hook both report, and ``print(a, b)``
    writes its pieces separately, so unlocked lines from two threads can interleave."""
    with _SAY:
        sys.stdout.write(" ".join(map(str, words)) + "\n")
        sys.stdout.flush()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class PhaseKiller:
    """The on_phase hook: counts occurrences of one phase and kills (or holds) at the chosen one."""

    def __init__(self, phase: str | None, occurrence: int, hold: bool) -> None:
        self.phase = phase
        self.occurrence = occurrence
        self.hold = hold
        self.seen = 0
        self.await_watcher = False  # --kill-at-bytes: hold at shards-synced until the watcher kills

    def __call__(self, name: str, cut: str) -> None:
        if name == "mark-written" or name == "prune-uncommitted":
            say("CUT", cut)
        if name == "shards-synced" and self.await_watcher:
            # --kill-at-bytes: every shard is written, so the watcher's threshold has been reached;
            # wait for its kill so that the sampled state is always a mid-write one.
            threading.Event().wait(30)  # never set: a bounded wait for the watcher's SIGKILL
            say("WATCHER-LATE")
            sys.exit(5)
        if name != self.phase:
            return
        self.seen += 1
        if self.seen != self.occurrence:
            return
        if self.hold:
            say("HOLD", cut)
            sys.stdin.buffer.read()  # until the test closes stdin (or kills us)
            sys.exit(4)
        say("KILL", name, cut)
        die()


#: Phases that only a cut of several ranks passes through.
RANKED_PHASES = ("rank-written",)


def save_as_ranks(store: Any, state: Any, step: int, world_size: int = 2) -> Any:
    """Saves ``state`` at ``step`` as a cut of ``world_size`` ranks from this one process: each rank
    writes its own copy of the state as its part (shards, then its durable record, phase
    "rank-written"), then rank 0 collects the records and commits. No torch.distributed: rank parts
    are written through ``Store.rank_part_for``, as ``ckptstore.dcp`` writes them."""
    from ckptstore.arrays import describe
    from ckptstore.tree import flatten

    tree, leaves = flatten(state)
    pending = store.begin_cut(step, world_size=world_size)
    for rank in range(world_size):
        part = store.rank_part_for(pending.id, step, rank, world_size)
        files, tensors = part.write([describe(leaf) for leaf in leaves], codec=store.shard_codec(),
                                    max_shard_bytes=store.options.max_shard_bytes)
        part.publish(files, tensors, tree=tree, pickled=False)
    pending.collect_ranks()
    pending.files_durable()
    return pending.commit()


def watch_bytes(cuts_dir: str, before: set[str], threshold: int) -> None:
    """Kills the process once the new cut's shard files hold ``threshold`` bytes. Polls file sizes: it
    is a sampler, so it may fire a little after the threshold (the bytes it saw are printed)."""
    from ckptstore import layout

    while True:
        new = [n for n in os.listdir(cuts_dir) if n not in before and layout.is_cut_id(n)]
        if new:
            d = os.path.join(cuts_dir, new[0])
            total = 0
            for name in os.listdir(d):
                if layout.is_shard_name(name):
                    try:
                        total += os.stat(os.path.join(d, name)).st_size
                    except FileNotFoundError:
                        pass
            if total >= threshold:
                say("BYTES", total)
                say("KILL", "bytes", new[0])
                die()
        time.sleep(0.0002)  # a poll interval, not a clock: the hook above bounds the wait


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--create", action="store_true")
    p.add_argument("--pre", type=int, default=0, help="cuts saved normally first (steps 1..N)")
    p.add_argument("--shard-bytes", type=int, default=SHARD_BYTES)
    p.add_argument("--prune", action="store_true", help="crash in prune(KeepLast(1)) instead of a save")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--phase")
    mode.add_argument("--hold-at")
    mode.add_argument("--kill-at-bytes", type=int)
    mode.add_argument("--kill-at-fraction", type=float)
    p.add_argument("--occurrence", type=int, default=1)
    args = p.parse_args(argv)

    from ckptstore import KeepLast, Store, StoreOptions

    say("PID", os.getpid())
    plain = StoreOptions(max_shard_bytes=args.shard_bytes)
    last_save = 0.05
    with Store.open(args.url, create=args.create, options=plain) as store:
        for step in range(1, args.pre + 1):
            t0 = time.perf_counter()
            info = store.save(state_for(step), step=step)
            last_save = time.perf_counter() - t0
            say("SAVED", step, info.id)

    killer = PhaseKiller(args.phase or args.hold_at, args.occurrence, hold=args.hold_at is not None)
    store = Store.open(args.url, options=StoreOptions(max_shard_bytes=args.shard_bytes, on_phase=killer))
    state = state_for(args.pre + 1)
    if args.kill_at_bytes is not None:
        cuts_dir = os.path.join(args.url, "cuts")
        killer.await_watcher = True
        threading.Thread(target=watch_bytes, args=(cuts_dir, set(os.listdir(cuts_dir)), args.kill_at_bytes),
                         daemon=True).start()
    timer = None
    if args.kill_at_fraction is not None:
        timer = threading.Timer(args.kill_at_fraction * last_save, die)
        timer.daemon = True
        timer.start()
    if args.prune:
        pruned = store.prune(KeepLast(1))
        say("DONE", *[c.id for c in pruned])
    elif args.phase in RANKED_PHASES:
        info = save_as_ranks(store, state, args.pre + 1)
        say("DONE", info.id)
    else:
        info = store.save(state, step=args.pre + 1)
        say("DONE", info.id)
    if timer is not None:
        timer.cancel()  # the save won the race (the timer may still fire first: the test reads DONE)
    store.close()
    if timer is not None:
        return 0
    say("NEVER-REACHED", args.phase, args.occurrence, "seen", killer.seen)
    return 3


if __name__ == "__main__":
    sys.exit(main())
