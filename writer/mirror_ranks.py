"""The mirror tier of a Checkpointer with ``group=`` (issue 21, "Several ranks"): every rank uploads its
own files of each cut committed locally, rank 0 commits the mirror's cut (``spi.mirror_rank``).

- **Rank 0 decides.** Rank 0's tier (:class:`~ckptstore.writer.mirror.MirrorTier`, with
  :func:`rank0_upload`) alone keeps the backlog, skips what ``mirror_keep`` would not keep, retries,
  catches up and prunes: it alone lists the local tier (issue 24) and knows the mirror. A decision
  taken on one rank only can never leave rank 0 waiting for a rank that decided otherwise.
- **The others follow its marks.** A rank r > 0 (:class:`FollowerTier`) uploads exactly the cuts rank 0
  marks on the mirror: it looks at the mirror's ``marks/`` (one listing a poll, every ``POLL_S`` or a
  tenth of the ``rank_timeout`` rank 0 waits for its record), and for each mark it has not served, oldest
  first, it copies its files of that cut and posts its record. A skipped cut is never marked, so never
  waited for; a retried one is marked anew (a mark of other bytes), so served again; a writer process
  that died and was replaced serves the mark in flight; and a cut of rank 0's catch-up is marked like
  any other. A cut of another world size than the job's (another job's cut) rank 0 copies alone.
- **Where it runs.** In the rank's writer process (process mode), else a thread of its trainer; never
  inside a collective call, so the ranks' group calls and the uploads never wait for each other.
- **The waits.** ``cut(final=True)`` and ``close()`` wait on every rank for what rank 0 waits for,
  agreed through the ranks' group (:func:`agreed_wait`): rank 0 waits for its tier and posts the
  outcome, the others wait for that post (bounded: rank 0 beats meanwhile, and its own wait is bounded
  by ``mirror_timeout``), while their tiers go on uploading.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ckptstore import CutInfo, Store, StoreNotFound, StoreOptions
from ckptstore import spi
from ckptstore.errors import CutNotFound, DataError, RankFailure, UsageError
from ckptstore.spi import Emitter, MirrorConflict, Policy, RankGroup, Storage, layout, outcome

from .errors import WriterError
from .gate import Gate
from .mirror import JOIN_S, RETRY_MAX_S, MirrorTier, MirrorTimeout, close_both

#: Between two looks at the mirror's marks while none is there, at most (and at most a tenth of
#: ``rank_timeout``, which rank 0 waits for a rank's record): one listing a second per rank on S3.
POLL_S = 1.0

Upload = Callable[[Store, Store, CutInfo, Callable[[int], None]], CutInfo]


def rank0_upload(world_size: int, rank_timeout: float) -> Upload:
    """Rank 0's upload of one cut: a cut of the job's world size with ``mirror_rank`` (every rank its
    own files), any other with ``mirror_cut`` (no ranks to share it with)."""
    def upload(reader: Store, mirror: Store, info: CutInfo, progress: Callable[[int], None]) -> CutInfo:
        if 1 < world_size == info.world_size:
            got = spi.mirror_rank(reader, mirror, info.id, 0, rank_timeout=rank_timeout, progress=progress)
            assert got is not None  # rank 0 commits, or raises
            return got
        return spi.mirror_cut(reader, mirror, info.id, progress=progress)
    return upload


def make_tier(source: Storage, url: str, options: StoreOptions | None, keep: Policy | None, events: Emitter, *,
              rank: int, world_size: int, rank_timeout: float, **kw: Any) -> MirrorTier | FollowerTier:
    """This rank's tier: rank 0's (the backlog) or a follower of its marks (module docstring)."""
    if rank == 0:
        return MirrorTier(source, url, options, keep, events, upload=rank0_upload(world_size, rank_timeout), **kw)
    kw.pop("on_state", None)  # a follower's state never changes: nothing waits, nothing is held
    return FollowerTier(source, url, options, events, rank=rank, world_size=world_size, rank_timeout=rank_timeout,
                        **kw)


class FollowerTier:
    """A rank's tier other than rank 0's: its files of each cut rank 0 marks on the mirror, in one thread
    (module docstring). The face of :class:`MirrorTier` for the writer process and the Checkpointer:
    it holds nothing (only rank 0 prunes), waits for nothing (rank 0 knows), takes no submissions."""

    def __init__(self, source: Storage, url: str, options: StoreOptions | None, events: Emitter, *, rank: int,
                 world_size: int, rank_timeout: float, retry_s: float, source_options: StoreOptions | None = None,
                 progress: Callable[[int], None] | None = None, gate: Gate | None = None) -> None:
        self.url, self.rank, self.gate = url, rank, gate if gate is not None else Gate()
        self._source, self._options, self._source_options, self._events = source, options, source_options, events
        self._world_size, self._rank_timeout, self._retry_s, self._progress = world_size, rank_timeout, retry_s, progress
        self._poll_s = min(POLL_S, rank_timeout / 10)
        self._cond = threading.Condition()
        self._stopping = False
        self._served: set[tuple[str, bytes]] = set()  # (cut, its mark's bytes): posted, or not this rank's
        self._failures = 0
        self._last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-mirror-rank{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, info: CutInfo) -> None:
        """Nothing: rank 0 decides what goes to the mirror, and this tier follows its marks."""

    def rescan(self) -> None:
        """Nothing: rank 0's look at both stores marks what the mirror lacks."""

    def state(self) -> dict[str, Any]:
        last = self._last_error
        return {"scanned": True, "waiting": [], "held": [],
                "last_error": None if last is None else f"{type(last).__name__}: {last}"}

    def wait(self, cut: str, timeout: float) -> None:
        """Nothing: rank 0 knows when a cut is on the mirror (:func:`agreed_wait`)."""

    def drain(self, timeout: float) -> None:
        """Nothing: rank 0 knows when its backlog is done (:func:`agreed_wait`)."""

    def close(self, join_s: float = JOIN_S) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(join_s)

    # ------------------------------------------------------------------------------- the tier's thread
    def _run(self) -> None:
        stores: tuple[Store, Store] | None = None
        try:
            while not self._stopping:
                if stores is None:
                    stores = self._connect()
                    if stores is None:
                        return
                try:
                    marked = self._serve_marks(*stores)
                except Exception as exc:  # noqa: BLE001 - the mirror failed: reported, looked at again
                    self._failed(None, exc)
                    close_both(stores)
                    stores = None
                    self._pause(self._delay())
                    continue
                self._pause(0.02 if marked else self._poll_s)
        finally:
            if stores is not None:
                close_both(stores)

    def _connect(self) -> tuple[Store, Store] | None:
        """A reader of the local tier and a participant of the mirror (no lock, no recovery: rank 0's
        handle does those); a mirror rank 0 has not created yet is waited for without a word."""
        while not self._stopping:
            reader: Store | None = None
            try:
                reader = Store.open(self._source, readonly=True, options=self._source_options)
                return reader, spi.open_participant(self.url, self._options)
            except StoreNotFound:
                pass
            except Exception as exc:  # noqa: BLE001 - reported, retried
                self._failed(None, exc)
            if reader is not None:
                reader.close()
            self._pause(self._delay() if self._failures else self._poll_s)
        return None

    def _serve_marks(self, reader: Store, mirror: Store) -> bool:
        """This rank's part of every cut marked on the mirror that it has not served, oldest first (a
        cut id sorts by step); whether any was marked. An I/O error is raised: the caller retries."""
        # Only marks: a mark being written is a temporary sibling first (the durable write), not a mark yet.
        cuts = sorted(e.name[:-len(".json")] for e in mirror.storage.list_dir(layout.MARKS_DIR)
                      if not e.is_dir and e.name.endswith(".json") and layout.is_cut_id(e.name[:-len(".json")]))
        for cut in cuts:
            mark = spi.read_or_none(mirror.storage, layout.mark_path(cut))
            if mark is None or (cut, mark) in self._served:
                continue  # committed or abandoned meanwhile, or served already
            self._serve(reader, mirror, cut)
            self._served.add((cut, mark))
        return bool(cuts)

    def _serve(self, reader: Store, mirror: Store, cut: str) -> None:
        """This rank's files and record of ``cut``, when it is a local cut of the job's world size; a
        failure that another try cannot mend is reported and the cut left to rank 0 (it abandons it)."""
        try:
            data = spi.read_or_none(reader.storage, layout.manifest_path(cut))
            if data is None:
                return  # not committed locally (pruned: rank 0 gave it up): not this rank's to serve
            m = spi.Manifest.from_bytes(data, store=reader.url, cut=cut, path=layout.manifest_path(cut))
            if m.world_size != self._world_size:
                return  # another job's cut: rank 0 copies it alone (rank0_upload)
            spi.mirror_rank(reader, mirror, cut, self.rank, rank_timeout=self._rank_timeout, progress=self._piece)
        except (CutNotFound, RankFailure):
            return  # gone locally, or rank 0 abandoned it before this rank began: nothing to serve
        except (DataError, MirrorConflict, UsageError) as exc:  # damage recorded locally, or not this mirror's
            self._failed(cut, exc, retry=False)
            return
        self._failures, self._last_error = 0, None

    def _piece(self, n: int) -> None:
        """After each piece uploaded: a local cut being written goes first (``Gate``)."""
        if self._progress is not None:
            self._progress(n)
        self.gate.wait_idle()

    def _failed(self, cut: str | None, exc: BaseException, *, retry: bool = True) -> None:
        self._last_error = exc
        if retry:
            self._failures += 1
        step = layout.step_of_cut_id(cut) if cut is not None else None
        self._events.emit("mirror-failed", step=step, cut=cut, error=str(exc), error_type=type(exc).__name__,
                          attempt=self._failures, retry_in=round(self._delay(), 3) if retry else None)

    def _delay(self) -> float:
        return min(self._retry_s * 2 ** max(0, self._failures - 1), RETRY_MAX_S)

    def _pause(self, seconds: float) -> None:
        """Waits ``seconds`` before the next look; a stop ends the wait at once."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._stopping and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())


def agreed_wait(ranks: RankGroup, key: str, wait: Callable[[], None], what: str, url: str,
                before: Callable[[], None] = lambda: None) -> None:
    """One wait for the mirror on every rank (module docstring): rank 0 runs ``wait`` and posts its
    outcome under ``key``; every other rank runs ``before`` (a writer process for its tier), then waits
    for the post and raises what rank 0 raised (a ``MirrorTimeout`` as its own type)."""
    with ranks.busy():
        if ranks.rank == 0:
            err: BaseException | None = None
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001 - posted for the others, then raised here
                err = exc
            try:
                ranks.post(key, outcome(err))
            except Exception:  # noqa: BLE001 - the others then find rank 0 silent, and say so
                pass
            if err is not None:
                raise err
            return
        before()
        got = ranks.await_posts(key, [0], what, store=url)[0]
    if not got["ok"]:
        cls = MirrorTimeout if got.get("type") == "MirrorTimeout" else WriterError
        raise cls(f"rank 0: {got['error']}", store=url, hint="every cut stays committed locally; the next "
                  "Checkpointer open uploads what the mirror lacks")


__all__ = ["FollowerTier", "POLL_S", "agreed_wait", "make_tier", "rank0_upload"]
