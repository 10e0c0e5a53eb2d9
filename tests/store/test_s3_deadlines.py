"""Deadlines, not hangs (issue 24): every object-store call runs under a timeout per request and bounded,
jittered retries (StoreOptions.io_*), so a save that cannot finish fails with a StorageError naming what
was being written, and the next call works. Before, s3fs's five retries of botocore's five, with a 60 s
read timeout, kept a stalled upload retrying for minutes."""

from __future__ import annotations

import errno
import random
import time

import pytest
from s3proxy import Rule
from test_s3_faults import _check, _state

import ckptstore
from ckptstore import StoreOptions
from ckptstore.storage.retry import GaveUp, IoPolicy, IoStats, run, transient

_SHARD2 = "*/cuts/*/rank00000-00002.safetensors"


def _options(opts: dict, **kw) -> StoreOptions:
    return StoreOptions(storage_options=opts, max_shard_bytes=64 << 10, **kw)


def test_a_stalled_upload_fails_within_its_deadline_naming_the_file_and_the_next_save_commits(s3_url, s3_proxy):
    url, opts = s3_url
    fast = dict(io_timeout_s=1.0, io_attempts=2, io_backoff_s=0.1)
    bound = StoreOptions(**fast).io_policy().bound_s()
    assert bound == pytest.approx(2.1)
    rule = s3_proxy.add(Rule("stall", method="PUT", key=_SHARD2, stall_s=60.0))
    with ckptstore.Store.open(url, create=True, options=_options(s3_proxy.options(opts), **fast)) as store:
        t0 = time.monotonic()
        with pytest.raises(ckptstore.StorageError) as ei:
            store.save(_state(1), step=1)
        took = time.monotonic() - t0
        err = ei.value
        assert err.path is not None and err.path.endswith("rank00000-00002.safetensors")
        assert err.cut is not None and err.errno == errno.ETIMEDOUT
        assert "gave up after 2 tries" in str(err)
        # Both tries were cut off at the request timeout, not at the proxy's 60 s stall.
        assert rule.fired == 2 and took < 10 * bound
        s3_proxy.clear()
        assert store.save(_state(2), step=2).step == 2  # the store works on: nothing held, nothing torn
        assert store.storage.stats.gave_up >= 1
    _check(url, opts, [2])


def test_retries_are_bounded_jittered_and_counted():
    policy = IoPolicy(timeout_s=1.0, attempts=4, backoff_s=0.1, backoff_max_s=0.25)
    assert [policy.backoff(k) for k in range(4)] == [0.1, 0.2, 0.25, 0.25]
    assert policy.bound_s() == pytest.approx(4 * 1.0 + 0.1 + 0.2 + 0.25)
    assert policy.capped(2.0).deadline() == 2.0 and policy.capped(100.0).deadline() == policy.bound_s()
    seen: list[float] = []
    stats = IoStats()

    def flaky(timeout: float) -> str:
        seen.append(time.monotonic())
        if len(seen) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert run(policy, "put", flaky, stats=stats, rng=random.Random(1)) == "ok"
    assert stats.retries == 2 and stats.by_action == {"put": 2} and stats.gave_up == 0
    waits = [b - a for a, b in zip(seen, seen[1:])]
    assert 0.05 <= waits[0] and 0.1 <= waits[1]  # at least half the backoff: never a tight loop

    def always(timeout: float) -> None:
        raise TimeoutError("read timed out")

    with pytest.raises(GaveUp) as ei:
        run(policy, "get", always, stats=stats)
    assert ei.value.tries == 4 and ei.value.errno == errno.ETIMEDOUT and stats.gave_up == 1


def test_a_definitive_answer_is_never_retried():
    calls = []

    def missing(timeout: float) -> None:
        calls.append(timeout)
        raise FileNotFoundError("no such key")

    with pytest.raises(FileNotFoundError):
        run(IoPolicy(attempts=5), "get", missing)
    assert len(calls) == 1


def test_what_is_transient():
    from botocore.exceptions import ClientError, ReadTimeoutError

    def client_error(code: str, status: int) -> OSError:
        err = OSError(errno.EIO, code)
        err.__cause__ = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        return err

    assert transient(client_error("SlowDown", 503)) and transient(client_error("InternalError", 500))
    assert transient(client_error("BadDigest", 400))  # a real server refused a body damaged in flight
    assert not transient(client_error("PreconditionFailed", 412)) and not transient(client_error("AccessDenied", 403))
    assert transient(ReadTimeoutError(endpoint_url="http://x"))
    assert not transient(FileExistsError("LATEST"))


@pytest.mark.parametrize("field,value", [("io_timeout_s", 0), ("io_attempts", 0), ("io_backoff_s", -1),
                                         ("io_deadline_s", 0)])
def test_bad_io_options_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        StoreOptions(**{field: value})


def test_the_writer_process_gets_the_store_s_io_policy(s3_url):
    url, opts = s3_url
    options = _options(opts, io_timeout_s=7.0, io_attempts=3)
    with ckptstore.Store.open(url, create=True, options=options) as store:
        spec = store.storage.spec()
    from ckptstore.spi import open_spec

    other = open_spec(spec)
    assert other.io == IoPolicy(timeout_s=7.0, attempts=3)
    assert other.fs.retries == 1  # s3fs's own loop is off: ours is the only one
