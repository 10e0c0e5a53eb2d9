"""Frozen, keyword-only, validated options of a store. No environment variables are read anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from .protocol import PhaseHook
from .storage.retry import IoPolicy

EventSink = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How a store writes.

    ``compression``: None (default: zstd does not pay for float state on this class of machine, see
    docs/benchmarks.md) or "zstd"; ``zstd_level`` its level. ``max_shard_bytes`` bounds a shard file.
    ``on_event`` receives one JSON-able dict per event (``events.py``). ``on_phase`` is the
    fault-injection seam of the commit protocol (tests only). ``lease_ttl_s``: on object stores, how
    long a writer's lease stays valid without renewal (it is renewed every third of that); a killed
    writer's store can be taken over by a new writer after it (``ckptstore.lock``).
    ``orphan_wait_s``: on local stores, how long a writer open waits while the lock is held by the
    writer process of a dead trainer finishing the cut it was handed (0: raise ``StoreLocked`` at once).

    Object stores only (issue 24; ``ckptstore.storage.retry``): ``io_timeout_s`` bounds one request
    (botocore's connect and read timeouts, and a hard cut-off); a call that fails transiently (5xx,
    SlowDown, a reset, a timeout, a body damaged in flight) is tried again after a jittered,
    doubling wait from ``io_backoff_s`` up to ``io_backoff_max_s``, at most ``io_attempts`` tries;
    ``io_deadline_s`` caps one call with all its tries (None: the most the tries can take,
    5 x 30 s + 3 s by default; with ``group=``, at most ``rank_timeout``). ``io_check_etag``: compare
    each PUT's answered ETag with the MD5 of what was sent (off only for buckets whose ETag is no MD5,
    such as SSE-KMS; Content-MD5 is sent either way).
    """

    compression: Literal["zstd"] | None = None
    zstd_level: int = 1
    max_shard_bytes: int = 1 << 30
    on_event: EventSink | None = None
    on_phase: PhaseHook | None = None
    storage_options: dict[str, Any] | None = None
    lease_ttl_s: float = 30.0
    orphan_wait_s: float = 300.0
    io_timeout_s: float = 30.0
    io_attempts: int = 5
    io_backoff_s: float = 0.2
    io_backoff_max_s: float = 5.0
    io_deadline_s: float | None = None
    io_check_etag: bool = True

    def io_policy(self) -> IoPolicy:
        """The I/O policy of an object store opened with these options (raises ValueError when bad)."""
        return IoPolicy(timeout_s=self.io_timeout_s, attempts=self.io_attempts, backoff_s=self.io_backoff_s,
                        backoff_max_s=self.io_backoff_max_s, deadline_s=self.io_deadline_s,
                        check_etag=self.io_check_etag)

    def __post_init__(self) -> None:
        self.io_policy()
        if not self.lease_ttl_s > 0:
            raise ValueError("lease_ttl_s must be positive")
        if not self.orphan_wait_s >= 0:
            raise ValueError("orphan_wait_s must be >= 0")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}")
        if not -7 <= self.zstd_level <= 22:
            raise ValueError("zstd_level must be in [-7, 22]")
        if self.max_shard_bytes < 64 << 10:
            raise ValueError("max_shard_bytes must be at least 64 KiB")
