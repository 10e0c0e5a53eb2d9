"""The ranks of a torch.distributed job that take cuts together: agreement that never hangs.

ckptstore runs no tensor collectives. Its few small messages per cut (the step every rank is at, the
cut id rank 0 marked, whether each rank's files are durable, the outcome of the commit) go through the
job's rendezvous key-value store: the c10d ``Store`` torch.distributed was initialized with (a
``TCPStore`` under torchrun or ``init_method="env://"``), polled against a deadline. So it works
whatever backend the job trains with (nccl or gloo), adds no process group, and can never block in a
collective because another rank died.

Liveness. While a rank is inside a collective ckptstore call it refreshes a heartbeat key every
``rank_timeout / 5`` seconds (at most every second). A waiting rank declares rank r failed when r has
not posted the awaited message and its heartbeat has not moved for ``rank_timeout`` seconds of the
waiter's clock. A rank busy writing a large shard keeps beating, so slow I/O is never taken for
death; a rank that was killed, stopped, or is elsewhere in its program stops beating, and is named.

After a failure the group is broken: the message sequence the ranks share is lost, so every later call
raises at once, naming the first failure. A restart (which re-forms the job) is the way on.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from .errors import CkptStoreError, UsageError

#: Default seconds without a sign of life before a rank is declared failed.
DEFAULT_RANK_TIMEOUT = 300.0


class RankFailure(CkptStoreError):
    """One or more ranks failed (an error in their part, or no sign of life within ``rank_timeout``).
    ``ranks`` are group ranks."""

    def __init__(self, message: str, *, ranks: Sequence[int], **where: Any) -> None:
        super().__init__(message, **where)
        self.ranks = sorted(set(ranks))


class RankGroup:
    """This process's view of the ranks taking cuts together; made by ``Store.open(..., group=)``.

    ``exchange`` is the one primitive: each rank posts a JSON message and gets every rank's back.
    Every rank must make the same sequence of exchanges (ckptstore's collective calls do, whatever
    happens locally: a rank whose part failed still posts, saying so)."""

    def __init__(self, group: Any, *, rank_timeout: float = DEFAULT_RANK_TIMEOUT, namespace: str,
                 kv: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("group= needs torch.distributed to be initialized (dist.init_process_group)")
        if not (isinstance(rank_timeout, (int, float)) and rank_timeout > 0):
            raise UsageError(f"rank_timeout must be a positive number of seconds, got {rank_timeout!r}")
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise UsageError("this process is not a member of the group passed as group=")
        self.size = dist.get_world_size(group)
        self.global_ranks = list(dist.get_process_group_ranks(group))
        self.rank_timeout = float(rank_timeout)
        base = kv if kv is not None else dist.distributed_c10d._get_default_store()
        ns = f"ckptstore/{namespace}/g{self.global_ranks[0]}-{self.size}/"
        # Which opening of this store by this group this is: every rank adds one, and no rank can
        # add for its next opening before all have added for this one (the first exchange waits),
        # so (n - 1) // size is the same on every rank.
        opened = int(base.add(ns + "opened", 1))
        self._kv = dist.PrefixStore(f"{ns}{(opened - 1) // self.size}/", base)
        self._seq = 0
        self._posted: list[str] = []
        self._broken: RankFailure | None = None
        self._busy = 0
        self._beat = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._interval = min(1.0, self.rank_timeout / 5)
        # Polls back off to 10 ms (two exchanges per cut wait in the training loop: the 2-rank
        # benchmark paid ~10 ms of stall with a 50 ms cap) and to 50 ms in big jobs, where every
        # rank's poll is a round trip to the one rendezvous server.
        self._poll_cap = 0.01 if self.size <= 64 else 0.05
        self._kv.set(self._hb_key(self.rank), "0")
        self._thread = threading.Thread(target=self._beat_loop, name="ckptstore-heartbeat", daemon=True)
        self._thread.start()
        self.exchange("hello", {})  # every heartbeat key exists from here on

    # -------------------------------------------------------------------------------------- liveness
    def _hb_key(self, rank: int) -> str:
        return f"hb/{rank}"

    def _beat_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            if self._closed:
                return
            with self._lock:
                busy = self._busy > 0
            if busy:
                self._beat += 1
                try:
                    self._kv.set(self._hb_key(self.rank), str(self._beat))
                except Exception:  # noqa: BLE001 - the waiters notice the store is gone themselves
                    pass

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Beats while the body runs (a collective call, a rank's write of its part)."""
        with self._lock:
            self._busy += 1
        self._wake.set()
        self._wake.clear()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    # -------------------------------------------------------------------------------------- messages
    def exchange(self, what: str, payload: Any, *, senders: Sequence[int] | None = None,
                 **where: Any) -> list[Any]:
        """Posts ``payload`` (JSON-serializable) as this rank's ``what`` message when it is one of
        ``senders`` (default: all), waits for every sender's, and returns them by rank (None for
        ranks that send nothing). Raises ``RankFailure`` naming the ranks that showed no sign of life
        within ``rank_timeout``."""
        if self._broken is not None:
            raise RankFailure(f"the ranks can no longer agree: {self._broken.message}", ranks=self._broken.ranks,
                              **where)
        if self._closed:
            raise UsageError("this rank group is closed", **where)
        self._seq += 1
        wanted = list(range(self.size)) if senders is None else sorted(set(senders))
        prefix = f"{self._seq}/{what}/"
        with self.busy():
            try:
                if self.rank in wanted:
                    self._kv.set(prefix + str(self.rank), json.dumps(payload))
                    self._kv.add(prefix + "n", 1)
                got = self._wait(prefix, wanted, what, where, counted=True)
            except RankFailure as exc:
                self._broken = exc
                raise
            except Exception as exc:  # noqa: BLE001 - the rendezvous store itself is gone
                failure = self._store_gone(what, exc, where)
                self._broken = failure
                raise failure from exc
        if senders is None:
            self._forget()
        if self.rank in wanted:
            self._posted.append(prefix + str(self.rank))
        if self.rank == 0:
            self._posted.append(prefix + "n")
        out: list[Any] = [None] * self.size
        for r, v in got.items():
            out[r] = v
        return out

    def _store_gone(self, what: str, exc: BaseException, where: dict[str, Any]) -> RankFailure:
        return RankFailure(
            f"the job's rendezvous store is unreachable during {what!r} ({type(exc).__name__}: {exc}); "
            "the process that hosts it (rank 0 under init_method='env://') is gone", ranks=[0], **where)

    # One-shot messages of a cut in flight (the commit threads' "my part is durable" and rank 0's
    # outcome). Keys carry the cut id, so they need no sequence and any thread may use them.
    def post(self, key: str, payload: Any) -> None:
        """Publishes this rank's one-shot message ``key`` (e.g. ``written/<cut>``)."""
        self._kv.set(f"msg/{key}/{self.rank}", json.dumps(payload))

    def await_posts(self, key: str, ranks: Sequence[int], what: str, **where: Any) -> dict[int, Any]:
        """Waits (liveness-guarded, like ``exchange``) for message ``key`` of every rank in ``ranks``.
        Does not break the group: a failure here is one cut's, and the next exchange shows the rest."""
        try:
            return self._wait(f"msg/{key}/", sorted(set(ranks)), what, where, counted=False)
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._store_gone(what, exc, where) from exc

    def forget_posts(self, key: str, ranks: Sequence[int]) -> None:
        try:
            for r in ranks:
                self._kv.delete_key(f"msg/{key}/{r}")
        except Exception:  # noqa: BLE001 - a leftover key costs bytes, never correctness
            pass

    def _wait(self, prefix: str, wanted: list[int], what: str, where: dict[str, Any], *,
              counted: bool) -> dict[int, Any]:
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}
        delay, next_liveness = 0.001, start + self._interval
        keys = [prefix + str(r) for r in wanted]
        while True:
            done = (int(self._kv.add(prefix + "n", 0)) >= len(wanted)) if counted else self._kv.check(keys)
            if done:
                values = self._kv.multi_get(keys)
                return {r: json.loads(v) for r, v in zip(wanted, values)}
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + self._interval
                missing = [r for r in wanted if not self._kv.check([prefix + str(r)])]
                beats = self._kv.multi_get([self._hb_key(r) for r in missing]) if missing else []
                dead = []
                for r, beat in zip(missing, beats):
                    b = beat.decode()
                    if r not in seen or seen[r][0] != b:
                        seen[r] = (b, now if r in seen else start)
                    elif now - seen[r][1] > self.rank_timeout:
                        dead.append(r)
                if dead:
                    raise RankFailure(
                        f"rank(s) {dead} showed no sign of life for {self.rank_timeout:g} s while this rank "
                        f"(rank {self.rank}) waited for {what!r}", ranks=dead, **where)
            time.sleep(delay)
            delay = min(delay * 2, self._poll_cap)

    def _forget(self) -> None:
        """After an exchange every rank sent to: deletes what this rank posted before it, which every
        rank has read by now (each posted in this exchange after reading all earlier ones)."""
        keys, self._posted = self._posted, []
        try:
            for key in keys:
                self._kv.delete_key(key)
        except Exception:  # noqa: BLE001 - a leftover key costs bytes, never correctness
            pass

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    @property
    def broken(self) -> RankFailure | None:
        return self._broken


def check_all_ok(results: Sequence[Any], what: str, **where: Any) -> None:
    """Raises ``RankFailure`` naming every rank whose message says its part failed
    (``{"ok": False, "error": ...}``)."""
    failed = {r: m for r, m in enumerate(results) if isinstance(m, dict) and m.get("ok") is False}
    if failed:
        detail = "; ".join(f"rank {r}: {m.get('error', '?')}" for r, m in sorted(failed.items()))
        raise RankFailure(f"{what} failed on rank(s) {sorted(failed)}: {detail}", ranks=list(failed), **where)


def check_same(msgs: Sequence[Any], fields: Sequence[str], what: str, **where: Any) -> None:
    """Every rank passed the same values to a collective call (else all raise, naming the odd ranks)."""
    for name in fields:
        values = [m.get(name) if isinstance(m, dict) else None for m in msgs]
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            got = ", ".join(f"rank {r}: {values[r]!r}" for r in [0, *odd])
            raise RankFailure(f"ranks called {what} with different {name} ({got}); every rank must make the "
                              "same collective calls", ranks=odd, **where)


def outcome(exc: BaseException | None) -> dict[str, Any]:
    """A rank's message about its own part."""
    if exc is None:
        return {"ok": True}
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}


__all__ = ["RankGroup", "RankFailure", "DEFAULT_RANK_TIMEOUT", "check_all_ok", "check_same", "outcome"]
