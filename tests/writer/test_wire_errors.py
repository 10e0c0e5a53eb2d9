"""Errors cross the process boundary as themselves (issue 20).

Every ``CkptStoreError`` class is registered under a stable wire key (``ckptstore.errors.WIRE``); the
writer process answers a failed write with the key and the error's fields, and the trainer rebuilds
the exact type. Before, the trainer looked the class name up in ``ckptstore.errors`` alone, so
``RankFailure`` (ckptstore.ranks) and ``CommitUnknown`` (ckptstore.protocol) came back as a plain
``WriterError``, and a ``StoreLocked`` lost its holder.
"""

from __future__ import annotations

import errno
import pickle
import socket

import pytest

import ckptstore.errors as E
from ckptstore.errors import WIRE, CkptStoreError
from ckptstore.protocol import CommitUnknown
from ckptstore.ranks import RankFailure
from ckptstore.writer import Checkpointer
from ckptstore.writer import errors as writer_errors
from ckptstore.writer import protocol as P
from ckptstore.writer.process import rebuild_error
from writerkit import BOUND, EventLog, check_store, has_exited, inject_fault, small_state

#: A value for every field past store, cut, path and hint that a registered class carries.
SAMPLE = {"errno": errno.EIO, "holder": {"host": "node-7", "pid": 4242, "kind": "flock"}, "ranks": [1, 3],
          "exchange": "save-commit", "step": 12}
WHERE = {"store": "/data/run", "cut": "step-000000000012-0a1b2c3d", "path": "cuts/step-000000000012-0a1b2c3d/x",
         "hint": "do this next"}


def _sample(cls: type[CkptStoreError]) -> CkptStoreError:
    return cls("it failed", **WHERE, **{name: SAMPLE[name] for name in cls.wire_fields})


def _fields(exc: CkptStoreError) -> dict:
    return {name: getattr(exc, name) for name in (*WHERE, *type(exc).wire_fields)}


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def test_every_error_class_of_the_package_is_registered_and_sampled() -> None:
    ours = [c for c in _subclasses(CkptStoreError) if c.__module__.startswith("ckptstore")]
    unregistered = [c.__qualname__ for c in ours if not vars(c).get("wire_key")]
    assert unregistered == []
    assert {RankFailure, CommitUnknown, writer_errors.WriterDied, E.HashMismatch} <= set(WIRE.values())
    assert {name for cls in WIRE.values() for name in cls.wire_fields} <= set(SAMPLE)


@pytest.mark.parametrize("key", sorted(WIRE))
def test_an_error_sent_through_the_socket_protocol_comes_back_as_itself(key: str) -> None:
    cls = WIRE[key]
    sent = _sample(cls)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        P.send(a.fileno(), P.WriteFailed.of(WHERE["cut"], sent))
        msg = P.recv(b.fileno(), timeout=BOUND)
    assert isinstance(msg, P.WriteFailed) and msg.key == key
    got = rebuild_error(msg, step=99)
    assert type(got) is cls
    assert got.message == sent.message and _fields(got) == _fields(sent) and str(got) == str(sent)


@pytest.mark.parametrize("key", sorted(WIRE))
def test_every_registered_error_pickles_with_its_fields(key: str) -> None:
    sent = _sample(WIRE[key])
    got = pickle.loads(pickle.dumps(sent))
    assert type(got) is type(sent) and _fields(got) == _fields(sent)


def test_an_error_that_is_no_ckptstore_error_comes_back_as_a_writer_error_naming_it() -> None:
    msg = P.WriteFailed.of("step-000000000003-00000000", KeyError("slot 7"))
    assert msg.key is None
    got = rebuild_error(msg, step=3)
    assert type(got) is writer_errors.WriterError
    assert got.step == 3 and got.cut == "step-000000000003-00000000" and "KeyError" in got.message


def test_a_subclass_registered_under_no_key_crosses_as_its_nearest_registered_base() -> None:
    class LocalCorruption(E.CorruptCut):  # e.g. a plug-in's own error
        pass

    got = rebuild_error(P.WriteFailed.of(None, LocalCorruption("bad bytes", **WHERE)), step=1)
    assert type(got) is E.CorruptCut and _fields(got) == WHERE


def test_a_wire_key_taken_by_another_class_is_refused_at_definition() -> None:
    before = dict(WIRE)
    with pytest.raises(TypeError, match="rank-failure"):
        class Impostor(CkptStoreError, wire="rank-failure"):
            pass
    assert WIRE == before


def test_a_real_writer_process_reports_a_non_storage_ckptstore_error_as_itself(url: str) -> None:
    """The writer process's write raises ``RankFailure`` (defined in ckptstore.ranks, with ``ranks``):
    the cut fails, and the trainer raises that very type with its fields, not a ``WriterError``."""
    log = EventLog()
    with Checkpointer(url, every=1, on_event=log) as ck:
        ck.cut(1, small_state(1.0)).wait(BOUND)
        inject_fault(ck, "raise-rank-failure-mid-shard")
        pid = ck.writer_pid
        h = ck.cut(2, small_state(2.0))
        with pytest.raises(CkptStoreError) as err:
            h.wait(BOUND)
        exc = err.value
        assert type(exc) is RankFailure, repr(exc)
        assert exc.ranks == [1, 2] and exc.exchange == "save-written"
        assert exc.hint == "injected by tests/writer/fault_worker.py" and "ranks 1 and 2 failed" in exc.message
        assert log.wait_for("failed", step=2)["error_type"] == "RankFailure"
        assert ck.writer_pid == pid and not has_exited(pid)  # an error, not a death: same writer
        assert ck.cut(3, small_state(3.0)).wait(BOUND).step == 3
    store = check_store(url)
    assert [c.step for c in store.cuts()] == [1, 3]
