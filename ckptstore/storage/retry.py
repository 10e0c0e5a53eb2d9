"""Deadlines for object-store calls (issue 24): every request under a bounded timeout, every call under
bounded retries with jittered exponential backoff, and every call under one deadline.

Before, s3fs's five retries wrapped botocore's five, each with its own backoff and botocore's 60 s read
timeout, so an upload that never completed was still being retried after 150 s (about 6 minutes in
all), and a rank stuck in one was never a named failure. Now ckptstore turns both libraries' retries
off (:func:`client_options`) and retries here, once per request, so there is one policy to read:

* one attempt is one HTTP request, cancelled after ``timeout_s`` (botocore's connect and read timeouts
  are set to the same, fsspec's ``sync(timeout=)`` cancels a request that trickles past it);
* an attempt that failed transiently (:func:`transient`: 5xx, SlowDown, a reset, a timeout, a body cut
  short or damaged on the wire) is tried again after ``uniform(0.5, 1) * min(backoff_max_s,
  backoff_s * 2**k)`` seconds (the k-th retry), at most ``attempts`` tries in all;
* a call never runs past ``deadline_s`` (default: :meth:`IoPolicy.bound_s`, the most the tries and
  waits above can take); with ``group=`` a store caps it at ``rank_timeout``, so a rank stuck on storage
  fails, named, before the other ranks give up on it.

Definitive answers (404, 403, a failed condition) are never retried: they are the answer.
"""

from __future__ import annotations

import errno
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: S3 error codes that are the server asking to be tried again (AWS's throttling and transient lists,
#: and ``BadDigest``: a body damaged in flight that a real server refused on its Content-MD5).
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException", "TransactionInProgressException", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete", "InternalError", "ServiceUnavailable",
    "BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody",
})


class WireMismatch(OSError):
    """What the server says it stored is not what was sent (its ETag is not the MD5 of our bytes): a
    body damaged in flight, on a server that does not check Content-MD5 (moto). Transient: sent again."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class ShortBody(OSError):
    """A GET answered with fewer bytes than the range asked of an object that holds them: cut short in
    flight (a rewritten Content-Length reads as a whole answer). Transient: read again."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclass(frozen=True, kw_only=True)
class IoPolicy:
    """How long one object-store request may take, how often a call is tried, and its deadline (see the
    module docstring; ``StoreOptions.io_*`` fields set it). ``check_etag``: compare the ETag a PUT's
    answer carries with the MD5 of what was sent (turn off only for buckets whose ETag is not an MD5,
    such as SSE-KMS: the Content-MD5 header still makes a real server refuse a damaged body)."""

    timeout_s: float = 30.0
    attempts: int = 5
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    deadline_s: float | None = None
    check_etag: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError("io_timeout_s must be positive")
        if not (isinstance(self.attempts, int) and self.attempts >= 1):
            raise ValueError("io_attempts must be an int >= 1")
        if not (self.backoff_s >= 0 and self.backoff_max_s >= self.backoff_s):
            raise ValueError("io_backoff_s must be >= 0 and io_backoff_max_s >= io_backoff_s")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError("io_deadline_s must be positive (or None: the bound of the tries)")

    def backoff(self, k: int) -> float:
        """The most the k-th retry (from 0) waits; it waits between half of that and all of it."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** k)

    def bound_s(self) -> float:
        """The most one call can take: every try timing out, and every wait at its longest."""
        return self.attempts * self.timeout_s + sum(self.backoff(k) for k in range(self.attempts - 1))

    def deadline(self) -> float:
        return min(self.bound_s(), self.deadline_s) if self.deadline_s is not None else self.bound_s()

    def capped(self, seconds: float) -> "IoPolicy":
        """This policy with its deadline at most ``seconds`` (a rank group's ``rank_timeout``)."""
        return replace(self, deadline_s=min(self.deadline(), seconds))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "IoPolicy":
        return cls(**(data or {}))


@dataclass
class IoStats:
    """What the calls of one storage cost: tries, retries (by action) and calls that gave up."""

    calls: int = 0
    retries: int = 0
    gave_up: int = 0
    by_action: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def retried(self, action: str) -> None:
        with self._lock:
            self.retries += 1
            self.by_action[action] = self.by_action.get(action, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"calls": self.calls, "retries": self.retries, "gave_up": self.gave_up,
                "retries_by_action": dict(self.by_action)}


class GaveUp(OSError):
    """A call that failed on every try, or ran into its deadline: the last error, and how it went."""

    def __init__(self, last: BaseException, tries: int, elapsed: float, deadline: float) -> None:
        code = last.errno if isinstance(last, OSError) and last.errno else errno.EIO
        if isinstance(last, TimeoutError) or type(last).__name__ in ("FSTimeoutError", "ReadTimeoutError",
                                                                     "ConnectTimeoutError"):
            code = errno.ETIMEDOUT
        what = getattr(last, "strerror", None) or str(last) or type(last).__name__
        super().__init__(code, f"{type(last).__name__}: {what} (gave up after {tries} tr"
                               f"{'y' if tries == 1 else 'ies'} in {elapsed:.1f} s; deadline {deadline:.0f} s)")
        self.last = last
        self.tries = tries


def run(policy: IoPolicy, action: str, attempt: Callable[[float], T], *, stats: IoStats | None = None,
        rng: random.Random | None = None) -> T:
    """``attempt(timeout)`` under ``policy``: tried again while it fails transiently, tries are left and
    the deadline allows the wait; then :class:`GaveUp` (a definitive error is raised as it is)."""
    rng = rng or random
    start = time.monotonic()
    limit = start + policy.deadline()
    tries = 0
    if stats is not None:
        stats.calls += 1
    while True:
        left = limit - time.monotonic()
        tries += 1
        try:
            return attempt(max(0.05, min(policy.timeout_s, left)))
        except BaseException as exc:  # noqa: BLE001 - sorted below; anything not transient is re-raised
            if not transient(exc):
                raise
            wait = policy.backoff(tries - 1) * rng.uniform(0.5, 1.0)
            if tries >= policy.attempts or time.monotonic() + wait >= limit:
                if stats is not None:
                    stats.gave_up += 1
                raise GaveUp(exc, tries, time.monotonic() - start, policy.deadline()) from exc
            if stats is not None:
                stats.retried(action)
            time.sleep(wait)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is an answer worth trying again: see the module docstring."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _transient_one(e):
            return True
        if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError)):
            return False
        e = e.__cause__
    return False


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, (WireMismatch, ShortBody, TimeoutError, ConnectionError)):
        return True
    name = type(e).__name__
    if name in ("IncompleteRead", "FSTimeoutError", "ClientPayloadError", "ServerDisconnectedError",
                "ClientOSError", "ClientConnectionError", "ResponseParserError"):
        return True
    core = sys.modules.get("botocore.exceptions")
    if core is not None:
        if isinstance(e, _botocore_transient(core)):
            return True
        if isinstance(e, core.ClientError):
            err = e.response.get("Error", {})
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            return err.get("Code") in TRANSIENT_CODES or status >= 500 or status == 429
    return False


def _botocore_transient(core: Any) -> tuple[type[BaseException], ...]:
    """botocore's transport errors (a reset, a timeout, a body cut short or failing its checksum),
    those of them this botocore has."""
    names = ("HTTPClientError", "ConnectionError", "ResponseStreamingError", "IncompleteReadError",
             "ChecksumError", "FlexibleChecksumError")
    return tuple(getattr(core, n) for n in names if isinstance(getattr(core, n, None), type))


def client_errors() -> tuple[type[BaseException], ...]:
    """What an object-store call raises when the store could not be reached or answered badly: OSError,
    and botocore's own errors where s3fs runs. Once botocore's retries and s3fs's are spent, a connection
    closed, reset or timed out comes out of s3fs as a raw botocore exception, not an OSError: a LATEST
    PUT that landed unseen then escaped as neither a StorageError nor CommitUnknown, and the save
    abandoned the cut LATEST named (issue 24). Looked up, never imported: no botocore, no such errors."""
    module = sys.modules.get("botocore.exceptions")
    return (OSError,) if module is None else (OSError, module.BotoCoreError)


def client_options(storage_options: dict[str, Any], policy: IoPolicy) -> dict[str, Any]:
    """s3fs options with botocore's retries off and its timeouts at the policy's (what the caller set
    wins); the caller also sets the file system's own ``retries`` to 1, so :func:`run` is the only
    retry."""
    config = {"connect_timeout": policy.timeout_s, "read_timeout": policy.timeout_s,
              "retries": {"total_max_attempts": 1, "mode": "standard"}}
    return {**storage_options, "config_kwargs": {**config, **storage_options.get("config_kwargs", {})}}


__all__ = ["GaveUp", "IoPolicy", "IoStats", "ShortBody", "TRANSIENT_CODES", "WireMismatch", "client_errors", "client_options", "run",
           "transient"]
