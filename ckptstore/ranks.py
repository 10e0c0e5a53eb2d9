"""The ranks of a torch.distributed job that take cuts together: agreement that never hangs.

ckptstore runs no tensor collectives. Its few small messages per cut (the step every rank is at, the
cut id rank 0 marked, whether each rank's files are durable, the outcome of the commit) go through the
job's rendezvous key-value store: the c10d ``Store`` torch.distributed was initialized with (a
``TCPStore`` under torchrun or ``init_method="env://"``), polled against a deadline. So it works
whatever backend the job trains with (nccl or gloo), adds no process group, and can never block in a
collective because another rank died. Nothing here ever reads a key that may not exist with a
blocking get (that waits for the rendezvous store's own timeout, 30 min by default): a key is read
once ``check`` saw it (issue 19 item 6).

Liveness. While a rank is inside a collective ckptstore call it refreshes a heartbeat key every
``rank_timeout / 5`` seconds (at most every second). A waiting rank declares rank r failed when r has
not posted the awaited message and its heartbeat has not moved for ``rank_timeout`` seconds of the
waiter's clock; a rank with no heartbeat key at all never joined (it died at start-up, opened the
store without ``group=``, or opened another URL). A rank busy writing a large shard, or waiting inside
its open for a dead trainer's writer process, keeps beating, so slow work is never taken for death; a
rank that was killed, stopped, or is elsewhere in its program stops beating, and is named.

Different calls. Every rank posts in every exchange, its message under the exchange's number and
carrying the exchange's name, and records where it is (opening, number, name). A rank whose message
of this exchange names another, or that waits in an exchange of another opening of the store (its
``Store.open(group=)`` against ``close`` on the open store), is in another collective call: the
ranks that see it fail at once, each naming the others (issue 19 item 5), instead of waiting under
keys the others never write while everyone keeps beating.

Through rank 0 (issue 22). Every rank posts its message of an exchange; rank 0 alone reads them all,
checks them and posts one answer (each distinct message once, with the runs of ranks that sent it, or
the failure it found), which every other rank waits for alone: O(ranks) messages an exchange.

After a failure the group is broken: the message sequence the ranks share is lost, so every later call
raises at once, naming the first failure. A restart (which re-forms the job) is the way on.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from . import hashing
from .errors import RankFailure, UsageError  # RankFailure lives with the other errors (issue 20)

#: Default seconds without a sign of life before a rank is declared failed.
DEFAULT_RANK_TIMEOUT = 300.0

#: The collective call each exchange belongs to, for the error that names ranks in different calls.
CALLS = {
    "hello": "Store.open(group=)", "open": "Store.open(group=)", "open-writer": "Store.open(group=)",
    "open-participants": "Store.open(group=)",
    "save-prepare": "Store.save", "save-begin": "Store.save", "save-written": "Store.save", "save-commit": "Store.save",
    "restore-choose": "restore(group=)", "restore-done": "restore(group=)",
    "checkpointer-ready": "Checkpointer(group=)", "maybe_cut": "Checkpointer.maybe_cut", "cut": "Checkpointer.cut",
    "cut-waited": "Checkpointer.maybe_cut/cut", "captured": "Checkpointer.maybe_cut/cut",
    "cut-final": "Checkpointer.cut(final=True)", "mark-final": "Checkpointer.mark_final",
    "preempt": "the preemption check of Checkpointer.maybe_cut (preemption=True)", "close": "Checkpointer.close",
}


def call_of(what: str) -> str:
    return f"{CALLS.get(what, what)} (exchange {what!r})"


def store_namespace(url: str) -> str:
    """The store's key in the rendezvous store, the same however a rank spells its URL: a trailing
    or doubled ``/`` put a rank in a namespace of its own, where it waited for ranks that never came
    (issue 19 item 6). Local paths as ``PosixStorage`` resolves them."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme in ("file", "local"):
        name = os.path.abspath(rest if sep else url)
    else:
        name = f"{scheme}://{re.sub('/+', '/', rest).rstrip('/')}"
    return hashing.digest(name.encode())[:16]


class RankGroup:
    """This process's view of the ranks taking cuts together; made by ``Store.open(..., group=)``.

    ``exchange`` is the one primitive: each rank posts a JSON message and gets every rank's back
    (through rank 0's answer; the payloads of ranks that sent the same one are one object: read them,
    never change them).
    Every rank must make the same sequence of exchanges (ckptstore's collective calls do, whatever
    happens locally: a rank whose part failed still posts, saying so); an exchange is where the ranks
    find out that they do not (module docstring, "Different calls")."""

    def __init__(self, group: Any, *, rank_timeout: float = DEFAULT_RANK_TIMEOUT, namespace: str,
                 kv: Any = None, store: str | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("group= needs torch.distributed to be initialized (dist.init_process_group)")
        if not (isinstance(rank_timeout, (int, float)) and rank_timeout > 0):
            raise UsageError(f"rank_timeout must be a positive number of seconds, got {rank_timeout!r}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise UsageError("this process is not a member of the group passed as group=")
        self._start(rank, dist.get_world_size(group), list(dist.get_process_group_ranks(group)),
                    kv if kv is not None else dist.distributed_c10d._get_default_store(),
                    rank_timeout=rank_timeout, namespace=namespace, store=store)

    @classmethod
    def of_ranks(cls, rank: int, size: int, kv: Any, *, namespace: str, rank_timeout: float = DEFAULT_RANK_TIMEOUT,
                 store: str | None = None) -> "RankGroup":
        """Rank ``rank`` of ``size`` ranks agreeing through the c10d store ``kv`` (a ``TCPStore`` client
        of its own), with no process group: the simulated ranks of the scale harness (issue 22), each a
        thread with its own client, run the same agreement code a job's ranks do."""
        if not (isinstance(size, int) and size > 0 and isinstance(rank, int) and 0 <= rank < size):
            raise UsageError(f"rank {rank!r} of {size!r} ranks is not a rank of the group")
        if not (isinstance(rank_timeout, (int, float)) and rank_timeout > 0):
            raise UsageError(f"rank_timeout must be a positive number of seconds, got {rank_timeout!r}")
        group = cls.__new__(cls)
        group._start(rank, size, list(range(size)), kv, rank_timeout=rank_timeout, namespace=namespace, store=store)
        return group

    def _start(self, rank: int, size: int, global_ranks: list[int], kv: Any, *, rank_timeout: float,
               namespace: str, store: str | None) -> None:
        self.rank = rank
        self.size = size
        self.global_ranks = global_ranks
        self.rank_timeout = float(rank_timeout)
        self._kv = kv
        self._ns = f"ckptstore/{namespace}/g{self.global_ranks[0]}-{self.size}/"
        # Which opening of this store by this group this is: every rank adds one, and no rank can
        # add for its next opening before all have added for this one (the first exchange waits),
        # so (n - 1) // size is the same on every rank.
        self.opening = (int(self._kv.add(self._ns + "opened", 1)) - 1) // self.size
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
        # rank's poll is a round trip to the one rendezvous server. Where the other ranks are is
        # looked at after 50 ms of waiting (a call mismatch shows at once), in big jobs only every
        # interval: a look is a round trip per missing rank.
        self._poll_cap = 0.01 if self.size <= 64 else 0.05
        self._first_look = min(self._interval, 0.05) if self.size <= 64 else self._interval
        self._kv.set(self._hb_key(self.rank), "0")
        self._thread = threading.Thread(target=self._beat_loop, name="ckptstore-heartbeat", daemon=True)
        self._thread.start()
        try:
            self.exchange("hello", {}, store=store)  # every heartbeat key exists from here on
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ keys
    def _key(self, opening: int, *parts: object) -> str:
        return self._ns + "/".join(str(p) for p in (opening, *parts))

    def _hb_key(self, rank: int) -> str:
        return self._key(self.opening, "hb", rank)

    def _msg_key(self, opening: int, seq: int, rank: int) -> str:
        return self._key(opening, "x", seq, rank)

    def _at_key(self, rank: int) -> str:
        """Where rank ``rank`` is: [opening, seq, exchange] of the last exchange it entered, over every
        opening of this store by this group (issue 19 item 5)."""
        return f"{self._ns}at/{rank}"

    # -------------------------------------------------------------------------------------- liveness
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
        """Beats while the body runs: a whole collective call (the others may wait for this rank
        while it works on its own: opens a store, waits for a dead trainer's writer, writes), a
        rank's write of its part."""
        with self._lock:
            self._busy += 1
        self._wake.set()
        self._wake.clear()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _liveness(self, missing: list[int], seen: dict[int, tuple[str | None, float]], start: float,
                  now: float, what: str, where: dict[str, Any]) -> None:
        """Raises ``RankFailure`` naming the ranks in ``missing`` whose heartbeat has not moved for
        ``rank_timeout``, or that never joined (no heartbeat key: never read with a blocking get,
        which would wait for the rendezvous store's own timeout, 30 min by default; issue 19 item 6)."""
        dead: list[int] = []
        absent: list[int] = []
        for r, raw in zip(missing, self._read_present([self._hb_key(r) for r in missing])):
            beat = raw.decode() if raw is not None else None
            if r not in seen or seen[r][0] != beat:
                seen[r] = (beat, now if r in seen else start)
            elif now - seen[r][1] > self.rank_timeout:
                (absent if beat is None else dead).append(r)
        if absent:
            raise RankFailure(
                f"rank(s) {absent} never joined this store's group within {self.rank_timeout:g} s while this rank "
                f"(rank {self.rank}) waited in {call_of(what)}: a rank that died at start-up, opened the store "
                "without group=, or opened another URL never joins (every rank opens the same store with group=)",
                ranks=absent + dead, **where)
        if dead:
            raise RankFailure(
                f"rank(s) {dead} showed no sign of life for {self.rank_timeout:g} s while this rank "
                f"(rank {self.rank}) waited for {what!r}", ranks=dead, **where)

    # -------------------------------------------------------------------------------------- messages
    def exchange(self, what: str, payload: Any, *, senders: Sequence[int] | None = None,
                 **where: Any) -> list[Any]:
        """Posts ``payload`` (JSON-serializable) as this rank's ``what`` message when it is one of
        ``senders`` (default: all), waits for every rank's, and returns the payloads by rank (None for
        ranks that send nothing). Every rank posts, senders or not, so every exchange compares the
        calls the ranks are in. Raises ``RankFailure`` naming the ranks that are in another collective
        call, or showed no sign of life within ``rank_timeout``."""
        msgs = self._exchange(what, payload, senders, None, where)
        return [m["p"] if senders is None or r in senders else None for r, m in enumerate(msgs)]

    def exchange_to_coordinator(self, what: str, payload: Any, private: Any, **where: Any
                                ) -> tuple[list[Any], list[Any] | None]:
        """``exchange`` of ``payload``, every rank also sending ``private`` to rank 0 alone: (the
        payloads by rank, on rank 0 the private values by rank, elsewhere None). Rank 0's answer
        leaves the private values out, so what the others read stays small (issue 22: a fragment
        reference from each of 4,096 ranks read by each of them would be O(ranks^2) bytes)."""
        msgs = self._exchange(what, payload, None, private, where)
        return [m["p"] for m in msgs], [m.get("c") for m in msgs] if self.rank == 0 else None

    def _exchange(self, what: str, payload: Any, senders: Sequence[int] | None, private: Any,
                  where: dict[str, Any]) -> list[dict[str, Any]]:
        if self._broken is not None:
            raise RankFailure(f"the ranks can no longer agree: {self._broken.message}", ranks=self._broken.ranks,
                              exchange=what, **where)
        if self._closed:
            raise UsageError("this rank group is closed", **where)
        self._seq += 1
        sends = senders is None or self.rank in senders
        mine = self._msg_key(self.opening, self._seq, self.rank)
        message: dict[str, Any] = {"x": what, "p": payload if sends else None}
        if private is not None:
            message["c"] = private
        with self.busy():
            try:
                # Where this rank is, then (or at once) its message: a rank that reads this place and
                # then finds no message here knows the message is still to come (_waits_elsewhere).
                self._kv.multi_set([self._at_key(self.rank), mine],
                                   [json.dumps([self.opening, self._seq, what]), json.dumps(message)])
                msgs = self._await_exchange(what, where)
            except RankFailure as exc:
                exc.exchange = what  # raised while waiting in this exchange: say so as a field
                self._broken = exc
                raise
            except Exception as exc:  # noqa: BLE001 - the rendezvous store itself is gone
                failure = self._store_gone(what, exc, where)
                failure.exchange = what
                self._broken = failure
                raise failure from exc
        self._forget()
        self._posted.append(mine)
        if self.rank == 0:  # every rank has read the answer once it posts in the next exchange
            self._posted.append(self._answer_key())
        return msgs

    def _await_exchange(self, what: str, where: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's message of this exchange, through rank 0 (issue 22: O(ranks) messages, not
        every rank reading every rank's): rank 0 waits for all of them, checks them, and posts one
        answer, which every other rank waits for alone (one key a poll, whatever the world size)."""
        if self.rank == 0:
            return self._gather_and_answer(what, where)
        return self._await_answer(what, where)

    def _answer_key(self) -> str:
        return self._key(self.opening, "a", self._seq)

    def _gather_and_answer(self, what: str, where: dict[str, Any]) -> list[dict[str, Any]]:
        ranks = list(range(self.size))
        keys = [self._msg_key(self.opening, self._seq, r) for r in ranks]
        read: dict[int, dict[str, Any]] = {}

        def look(missing: list[int]) -> None:
            for r in ranks:
                if r not in missing and r not in read:
                    read[r] = json.loads(self._kv.get(keys[r]))
            self._check_calls(read, what, where)
            self._check_elsewhere(missing, what, where)

        calls: dict[int, str] = {}
        try:
            raw = self._wait(ranks, keys, what, where, look)
            msgs = [json.loads(v) for v in raw]
            calls = {r: m["x"] for r, m in enumerate(msgs)}
            self._check_calls(dict(enumerate(msgs)), what, where)
        except RankFailure as exc:
            # The others wait for the answer alone: they hear of the failure from it, at once. A
            # mismatch goes with every rank's call, so each names the ranks odd from where it stands.
            odd = {r: x for r, x in calls.items() if x != what}
            fail = {"message": exc.message, "ranks": list(exc.ranks or [])}
            if odd:
                fail["calls"] = {str(r): x for r, x in calls.items()}
            self._post_answer({"x": what, "fail": fail})
            raise
        # The answer lists each distinct message once and which ranks sent it, as runs of ranks: the
        # ranks of one call mostly send the same few messages, so it stays small at any world size.
        distinct: dict[bytes, int] = {}
        runs: list[list[int]] = []
        if any("c" in m for m in msgs):  # what was for rank 0 alone stays out of the answer
            raw = [json.dumps({"x": m["x"], "p": m["p"]}).encode() for m in msgs]
        for v in raw:
            i = distinct.setdefault(bytes(v), len(distinct))
            if runs and runs[-1][0] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        text = b"".join([b'{"x":', json.dumps(what).encode(), b',"d":[', b",".join(distinct), b'],"r":',
                         json.dumps(runs, separators=(",", ":")).encode(), b"}"])
        self._kv.set(self._answer_key(), text)
        return msgs

    def _post_answer(self, answer: dict[str, Any]) -> None:
        try:
            self._kv.set(self._answer_key(), json.dumps(answer))
        except Exception:  # noqa: BLE001 - the others then find rank 0's store gone themselves
            pass

    def _await_answer(self, what: str, where: dict[str, Any]) -> list[dict[str, Any]]:
        def look(missing: list[int]) -> None:  # rank 0 has not answered yet: is it in another opening?
            self._check_elsewhere(missing, what, where)

        (raw,) = self._wait([0], [self._answer_key()], what, where, look)
        answer = json.loads(raw)
        fail = answer.get("fail")
        if fail is not None:
            calls = fail.get("calls")
            if calls is not None:  # ranks in different calls: named from this rank's own call
                odd = {int(r): x for r, x in calls.items() if x != what}
                if odd:
                    self._mismatch(odd, what, where)
            raise RankFailure(f"rank 0 found: {fail['message']}", ranks=fail["ranks"], **where)
        if answer["x"] != what:  # rank 0 answered another exchange of this number: it is in another call
            self._mismatch({0: answer["x"]}, what, where)
        distinct = answer["d"]
        msgs: list[dict[str, Any]] = []
        for i, n in answer["r"]:
            msgs.extend([distinct[i]] * n)
        if len(msgs) != self.size:
            raise RankFailure(f"rank 0's answer to {what!r} lists {len(msgs)} messages for {self.size} ranks",
                              ranks=[0], **where)
        return msgs

    def _check_calls(self, msgs: dict[int, dict[str, Any]], what: str, where: dict[str, Any]) -> None:
        """Ranks whose message of this exchange belongs to another exchange are in another collective
        call: every rank that sees it fails at once, naming them (issue 19 item 5)."""
        odd = {r: m["x"] for r, m in msgs.items() if m["x"] != what}
        if odd:
            self._mismatch(odd, what, where)

    def _check_elsewhere(self, missing: list[int], what: str, where: dict[str, Any]) -> None:
        raw = self._read_present([self._at_key(r) for r in missing])
        places = {r: json.loads(v) for r, v in zip(missing, raw) if v is not None}
        odd = {r: place[2] for r, place in places.items() if self._waits_elsewhere(r, place)}
        if odd:
            self._mismatch(odd, what, where, note=" of another opening of this store")

    def _waits_elsewhere(self, r: int, place: list[Any]) -> bool:
        """Whether rank ``r``, last seen entering exchange ``place`` of another opening of this store
        (its ``Store.open(group=)`` against a call on the open store, or a call on another handle),
        waits there still, where this exchange can never meet it. In this opening the messages of one
        exchange are compared by name instead."""
        opening, seq, _ = place
        if opening == self.opening:
            return False
        if self._kv.check([self._msg_key(opening, seq, q) for q in range(self.size)]):
            return False  # that exchange is complete: r is past it, or about to be
        # r posted here, or moved on, meanwhile (a message is posted with, or after, its place).
        return (not self._kv.check([self._msg_key(self.opening, self._seq, r)])
                and json.loads(self._kv.get(self._at_key(r))) == place)

    def _read_present(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys`` that exist (None for the others), never waiting for one: one round
        trip when all exist, the usual case. Only for keys never deleted (heartbeats, places)."""
        if not keys:
            return []
        if self._kv.check(keys):
            return list(self._kv.multi_get(keys))
        return [self._kv.get(k) if self._kv.check([k]) else None for k in keys]

    def _mismatch(self, odd: dict[int, str], what: str, where: dict[str, Any], note: str = "") -> None:
        there = "; ".join(f"rank {r} is in {call_of(x)}{note}" for r, x in sorted(odd.items()))
        raise RankFailure(f"{there} while this rank (rank {self.rank}) is in {call_of(what)}: every rank must make "
                          "the same collective calls in the same order", ranks=list(odd), **where)

    def _store_gone(self, what: str, exc: BaseException, where: dict[str, Any]) -> RankFailure:
        return RankFailure(
            f"the job's rendezvous store is unreachable during {what!r} ({type(exc).__name__}: {exc}); "
            "the process that hosts it (rank 0 under init_method='env://') is gone", ranks=[0], **where)

    # One-shot messages of a cut in flight (the commit threads' "my part is durable" and rank 0's
    # outcome). Keys carry the cut id, so they need no sequence and any thread may use them.
    def post(self, key: str, payload: Any) -> None:
        """Publishes this rank's one-shot message ``key`` (e.g. ``written/<cut>``)."""
        self._kv.set(self._key(self.opening, "msg", key, self.rank), json.dumps(payload))

    def await_posts(self, key: str, ranks: Sequence[int], what: str, **where: Any) -> dict[int, Any]:
        """Waits (liveness-guarded, like ``exchange``) for message ``key`` of every rank in ``ranks``.
        Does not break the group: a failure here is one cut's, and the next exchange shows the rest."""
        wanted = sorted(set(ranks))
        keys = [self._key(self.opening, "msg", key, r) for r in wanted]
        try:
            return {r: json.loads(v) for r, v in zip(wanted, self._wait(wanted, keys, what, where))}
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._store_gone(what, exc, where) from exc

    def forget_posts(self, key: str, ranks: Sequence[int]) -> None:
        try:
            for r in ranks:
                self._kv.delete_key(self._key(self.opening, "msg", key, r))
        except Exception:  # noqa: BLE001 - a leftover key costs bytes, never correctness
            pass

    def _wait(self, ranks: list[int], keys: list[str], what: str, where: dict[str, Any],
              look: Callable[[list[int]], None] | None = None) -> list[bytes]:
        """Polls until every key is there (then reads them: a key is only read once it exists), looking
        at the missing ranks now and then: ``look`` (where they are), then their heartbeats."""
        start = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {}
        delay, next_look = 0.001, start + self._first_look
        while True:
            if self._kv.check(keys):
                return list(self._kv.multi_get(keys))
            now = time.monotonic()
            if now >= next_look:
                next_look = now + self._interval
                missing = [r for r, k in zip(ranks, keys) if not self._kv.check([k])]
                if look is not None:
                    look(missing)
                self._liveness(missing, seen, start, now, what, where)
            time.sleep(delay)
            delay = min(delay * 2, self._poll_cap)

    def _forget(self) -> None:
        """After an exchange: deletes what this rank posted before it, which every rank has read by
        now (each posted in this exchange after reading all earlier ones)."""
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
    """A rank's message about its own part: ok, or the error's type and message and the tail of its
    traceback, so every rank's ``RankFailure`` can say what failed where (issue 20)."""
    if exc is None:
        return {"ok": True}
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:])
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "type": type(exc).__name__,
            "traceback": tail[-2000:]}


__all__ = ["RankGroup", "RankFailure", "DEFAULT_RANK_TIMEOUT", "check_all_ok", "check_same", "outcome",
           "store_namespace"]
