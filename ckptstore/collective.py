"""One driver for a step of a cut on one rank or many: a local step on every rank, a coordinator step
on rank 0, and every failure carried to every rank (the shape of DCP's ``_DistWrapper``).

World size 1 is the trivial case, not a second code path: ``Collective(None)`` runs the local step,
then the coordinator step, and raises what they raise. With a :class:`~ckptstore.ranks.RankGroup`
each step is followed by one exchange, so every rank learns every outcome at the same call:

* :meth:`Collective.all` runs ``local`` on every rank; if it failed anywhere, the rank where it failed
  raises its own error and every other rank a ``RankFailure`` naming the ranks that failed, with each
  one's error type and message. Fields in ``same`` must be equal on every rank (else all raise, naming
  the odd ranks).
* :meth:`Collective.coordinate` runs ``step`` on rank 0 only and gives every rank its result (as JSON,
  through ``share`` and ``receive``), or raises on every rank: rank 0 its own error, the others a
  ``RankFailure`` naming rank 0 with that error. ``note`` (run on rank 0 after the failure) adds what
  the others must know about it: that the cut may be committed when the commit itself failed, say.

* :meth:`Collective.gather` is both behind the training loop (a commit thread): ``local`` on every
  rank, then ``coordinator`` on rank 0 once every rank's ``local`` succeeded, its result shared. It
  goes by one-shot posts keyed by the cut, not by the call sequence, so it never interleaves with the
  exchanges the loop makes meanwhile.

Every wait is the rank group's: bounded by ``rank_timeout`` against ranks with no sign of life, and
failing at once against ranks in another collective call (:mod:`ckptstore.ranks`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, TypeVar

from .ranks import RankFailure, RankGroup, check_all_ok, check_same, outcome

T = TypeVar("T")


class Collective:
    """The steps of one collective call (see the module docstring). ``where``: the store (and the cut,
    once known: :meth:`at`) that every error names."""

    def __init__(self, ranks: RankGroup | None, **where: Any) -> None:
        self.ranks = ranks
        self.where = dict(where)
        self._outcomes: list[str] = []  # rank 0: gather outcomes every rank may still have to read

    @property
    def rank(self) -> int:
        return 0 if self.ranks is None else self.ranks.rank

    @property
    def size(self) -> int:
        return 1 if self.ranks is None else self.ranks.size

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def at(self, **where: Any) -> None:
        """Adds to what every later error names (the cut, once rank 0 chose it)."""
        self.where.update(where)

    def busy(self) -> ContextManager[None]:
        """Beats for the whole call: the others may wait while this rank works on its own step."""
        return self.ranks.busy() if self.ranks is not None else nullcontext()

    def all(self, what: str, local: Callable[[], T], *, same: dict[str, Any] | None = None,
            doing: str | None = None) -> T:
        """Runs ``local`` on every rank and returns its result here (see the module docstring)."""
        return self._all(what, local, same, doing, to_coordinator=False)[0]

    def all_to_coordinator(self, what: str, local: Callable[[], Any], *, doing: str | None = None) -> list[Any] | None:
        """``all``, with every rank's result (JSON) sent to rank 0 alone: on rank 0 the results by rank,
        elsewhere None. What the ranks read back stays as small as ``all``'s (issue 22)."""
        return self._all(what, local, None, doing, to_coordinator=True)[1]

    def _all(self, what: str, local: Callable[[], T], same: dict[str, Any] | None, doing: str | None, *,
             to_coordinator: bool) -> tuple[T, list[Any] | None]:
        err: BaseException | None = None
        result: T | None = None
        try:
            result = local()
        except BaseException as exc:  # noqa: BLE001 - every rank hears of it in the exchange
            err = exc
        if self.ranks is None:
            if err is not None:
                raise err
            return result, [result]  # type: ignore[return-value]
        gathered: list[Any] | None = None
        if to_coordinator:
            msgs, gathered = self.ranks.exchange_to_coordinator(what, outcome(err), result if err is None else None,
                                                                **self.where)
        else:
            msgs = self.ranks.exchange(what, {**outcome(err), **(same or {})}, **self.where)
        if err is not None:
            raise err
        if same:
            check_same(msgs, tuple(same), what, **self.where)
        check_all_ok(msgs, doing or what, **self.where)
        return result, gathered  # type: ignore[return-value]

    def coordinate(self, what: str, step: Callable[[], T], *, share: Callable[[T], Any] = lambda r: r,
                   receive: Callable[[Any], T] = lambda v: v, doing: str | None = None,
                   note: Callable[[], str | None] = lambda: None, lost: str | None = None) -> T:
        """Runs ``step`` on rank 0 and returns its result on every rank (see the module docstring).
        ``lost``: added to the ``RankFailure`` of a rank that waited for rank 0's answer in vain (rank
        0 went silent, or is in another call), since nobody can say how far its step got."""
        if self.ranks is None:
            return step()
        err: BaseException | None = None
        msg: dict[str, Any] = {"ok": True, "value": None}
        result: T | None = None
        if self.coordinator:
            try:
                result = step()
                msg["value"] = share(result)
            except BaseException as exc:  # noqa: BLE001 - every rank hears of it in the exchange
                err = exc
                msg = {**outcome(exc), "note": note()}
        try:
            got = self.ranks.exchange(what, msg, senders=[0], **self.where)[0]
        except RankFailure as exc:
            if lost and not self.coordinator:
                exc.message += f"; {lost}"
            raise
        if err is not None:
            raise err
        if not got["ok"]:
            note_ = f"; {got['note']}" if got.get("note") else ""
            raise RankFailure(f"rank 0 failed {doing or what}: {got['error']}{note_}", ranks=[0], **self.where)
        return result if self.coordinator else receive(got["value"])  # type: ignore[return-value]


    def gather(self, key: str, local: Callable[[], Any], coordinator: Callable[[list[Any]], T], *,
               first: Callable[[], Any] | None = None, share: Callable[[T], Any] = lambda r: r,
               receive: Callable[[Any], T] = lambda v: v, doing: str,
               note: Callable[[], str | None] = lambda: None) -> T:
        """``first`` on rank 0 (if given) before ``local`` on any rank, then ``local`` on every rank,
        then ``coordinator`` on rank 0 if every ``local`` succeeded, given every rank's ``local`` result
        (JSON: each rank posts its own to rank 0) by rank; returns its result on every rank or raises
        on every rank (see the module docstring). ``key`` names the posts (a cut id);
        ``note`` as in :meth:`coordinate`. ``first`` is the cut's mark: no rank writes a shard of a
        cut before rank 0 marked it (issue 20)."""
        err: BaseException | None = None
        part: Any = None
        try:
            if first is not None:
                self._first(key, first, doing)
            part = local()
        except BaseException as exc:  # noqa: BLE001 - rank 0 hears of it in the posts
            err = exc
        if self.ranks is None:
            if err is not None:
                raise err
            return coordinator([part])
        try:
            self.ranks.post(f"written/{key}", {**outcome(err), "part": part})
        except Exception:  # noqa: BLE001 - rank 0 then finds this rank silent
            pass
        if self.coordinator:
            return self._coordinate_posts(key, err, coordinator, share, doing, note)
        return self._await_outcome(key, err, receive, doing)

    def _first(self, key: str, first: Callable[[], Any], doing: str) -> None:
        """Rank 0 runs ``first`` and posts its outcome; every other rank waits for that post."""
        if self.ranks is None:
            first()
            return
        where = {**self.where, "cut": key}
        if self.coordinator:
            err: BaseException | None = None
            try:
                first()
            except BaseException as exc:  # noqa: BLE001 - posted for the others, then raised here
                err = exc
            try:
                self.ranks.post(f"begun/{key}", outcome(err))
            except Exception:  # noqa: BLE001 - the others then find rank 0 silent
                pass
            if err is not None:
                raise err
            return
        got = self.ranks.await_posts(f"begun/{key}", [0], f"rank 0's start of {doing}", **where)[0]
        if not got["ok"]:
            raise RankFailure(f"{doing} failed on rank 0 before any rank wrote: {got['error']}", ranks=[0], **where)

    def _coordinate_posts(self, key: str, err: BaseException | None, coordinator: Callable[[list[Any]], T],
                          share: Callable[[T], Any], doing: str, note: Callable[[], str | None]) -> T:
        assert self.ranks is not None
        where = {**self.where, "cut": key}
        result: T | None = None
        failure: BaseException | None = None
        try:
            posts = self.ranks.await_posts(f"written/{key}", range(self.size), f"every rank's part of {doing}", **where)
            if err is not None:
                raise err
            check_all_ok([posts[r] for r in range(self.size)], doing, **where)
            result = coordinator([posts[r].get("part") for r in range(self.size)])
        except BaseException as exc:  # noqa: BLE001 - posted for the others, then raised here
            failure = exc
        # Every rank posted "written" after reading "begun" (or after giving up on it): both go.
        self.ranks.forget_posts(f"written/{key}", range(self.size))
        self.ranks.forget_posts(f"begun/{key}", [0])
        answer = {**outcome(failure), "note": note() if failure is not None else None,
                  "value": share(result) if failure is None else None}  # type: ignore[arg-type]
        try:
            self.ranks.post(f"outcome/{key}", answer)
            self._outcomes.append(f"outcome/{key}")
        except Exception:  # noqa: BLE001 - the others then find rank 0 silent
            pass
        if failure is not None:
            raise failure
        return result  # type: ignore[return-value]

    def _await_outcome(self, key: str, err: BaseException | None, receive: Callable[[Any], T], doing: str) -> T:
        assert self.ranks is not None
        where = {**self.where, "cut": key}
        try:
            got = self.ranks.await_posts(f"outcome/{key}", [0], f"rank 0's side of {doing}", **where)[0]
        except BaseException:
            if err is not None:
                raise err from None
            raise
        if err is not None:
            raise err
        if not got["ok"]:
            note_ = f" ({got['note']})" if got.get("note") else ""
            raise RankFailure(f"{doing} failed on rank 0{note_}: {got['error']}", ranks=[0], **where)
        return receive(got["value"])

    def forget_outcomes(self) -> None:
        """Rank 0, once every rank is past every gather so far (all idle): their outcome posts go."""
        if self.ranks is not None and self.coordinator:
            for key in self._outcomes:
                self.ranks.forget_posts(key, [0])
        self._outcomes.clear()


__all__ = ["Collective"]
