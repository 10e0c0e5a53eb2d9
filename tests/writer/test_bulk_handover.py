"""The hand-over and the answer of a cut of many arrays (issue 23): a request of a repeated layout names
its slots by number and carries its tree as raw JSON after the frame; the answer places each slot
(file, offset, digest) instead of repeating 40,000 records; the manifest's tree and table reuse the
text of what they share with the last cut. Every shortcut gives the bytes of the long way, and every
malformed answer is a named error."""

from __future__ import annotations

import json
import math
import socket
import threading

import ckptstore
import numpy as np
import pytest

from ckptstore.jsontext import TreeText, compact_json, remember_tree_text
from ckptstore.manifest import FileRecord, Manifest, WriterIdentity
from ckptstore.records import make_record
from ckptstore.spi import CutIntent, ShardSpec
from ckptstore.writer import Checkpointer
from ckptstore.writer import protocol as P
from ckptstore.writer.plan import plan_block
from ckptstore.writer.worker import Worker
from writerkit import BOUND, EventLog, assert_state_equal, check_store, clone_state, mutate_in_place

CUT = "step-000000000001-abcdef01"
SHARD = "rank00000-00000.safetensors"


def _slots(n: int) -> tuple:
    return plan_block((f"w{i}", "numpy", "<f4", (1024,), 4096) for i in range(n)).slots


def _tree(n: int) -> dict:
    return {"t": "dict", "ordered": False, "items": [{"k": f"w{i}", "v": {"t": "array", "name": f"w{i}"}}
                                                     for i in range(n)]}


def _request(slots, tree) -> P.WriteRequest:
    finish = P.Finish(**dict(CutIntent(tree=tree, tags=["a"], metadata={"lr": 3e-4})))
    return P.WriteRequest(cut=CUT, step=1, block="b", block_size=1 << 30, slots=slots, shards=ShardSpec(),
                          finish=finish, after_mark=True)


def _through_socket(msg: P.StrictModel, tail: bytes = b"") -> P.Message:
    a, b = socket.socketpair()
    with a, b:
        # a reader on its own thread: a frame of megabytes does not fit the socket buffer
        got: list = []
        t = threading.Thread(target=lambda: got.append(P.recv(b.fileno(), timeout=BOUND)))
        t.start()
        P.send(a.fileno(), msg, tail)
        t.join(BOUND)
        return got[0]


def test_a_request_travels_with_its_tree_after_the_frame_and_its_slots_by_number():
    slots, tree = _slots(3000), _tree(3000)
    tree["items"].append({"k": "loss", "v": {"t": "float", "v": math.inf}})  # json's spelling survives
    req = _request(slots, tree)
    wire, tail = P.on_the_wire(req, layout=1, slots_known=False)
    got = _through_socket(wire, tail)
    assert isinstance(got, P.WriteRequest) and got.finish is not None and got.finish.tree is None
    assert got.layout == 1 and list(got.slots) == list(slots) and got.tree_bytes == len(tail)
    plan = got.plan()
    assert plan == req.finish and plan.tree == tree

    again, tail2 = P.on_the_wire(req, layout=1, slots_known=True)
    frame = again.model_dump_json()
    assert '"slots":null' in frame and len(frame) < 2000  # the slots stay behind: 3,000 of them
    worker = Worker(-1, 0)
    worker.with_slots(got)  # the first request listed them under number 1
    resolved = worker.with_slots(_through_socket(again, tail2))
    assert list(resolved.slots) == list(slots) and resolved.plan() == req.finish


def test_a_request_naming_slots_this_writer_never_got_writes_nothing():
    req = _request(_slots(4), _tree(4))
    wire, tail = P.on_the_wire(req, layout=7, slots_known=True)
    got = Worker(-1, 0).with_slots(_through_socket(wire, tail))
    assert got.slots is None
    with pytest.raises(RuntimeError, match="layout 7"):
        Worker(-1, 0).write.__wrapped__(Worker(-1, 0), got)


def test_tree_bytes_without_a_finish_plan_to_hold_them_is_refused_and_the_channel_stays_in_step():
    req = _request(_slots(2), None).model_copy(update={"finish": None, "tree_bytes": 4})
    a, b = socket.socketpair()
    with a, b:
        P.send(a.fileno(), req, b"{}  ")
        P.send(a.fileno(), P.Shutdown())
        with pytest.raises(ValueError, match="tree bytes"):
            P.recv(b.fileno(), timeout=BOUND)
        assert isinstance(P.recv(b.fileno(), timeout=BOUND), P.Shutdown)


def test_a_tree_that_is_no_json_object_fails_the_plan_by_name():
    req = _request(_slots(2), _tree(2))
    wire, _ = P.on_the_wire(req, layout=1, slots_known=False)
    got = _through_socket(wire.model_copy(update={"tree_bytes": 5}), b"[1, 2")
    with pytest.raises(ValueError, match="not JSON"):
        got.plan()
    got = _through_socket(wire.model_copy(update={"tree_bytes": 3}), b"[1]")
    with pytest.raises(ValueError):
        got.plan()


def _records(slots, order=None):
    order = list(range(len(slots))) if order is None else order
    return [make_record((slots[i].name, slots[i].kind, slots[i].dtype, list(slots[i].shape), slots[i].nbytes,
                         SHARD, k * 4096, f"{k:064x}")) for k, i in enumerate(order)]


def _file() -> FileRecord:
    return FileRecord(name=SHARD, rank=0, codec="none", nbytes=1 << 20, blake3="0" * 64, raw_nbytes=1 << 20,
                      raw_blake3="0" * 64)


@pytest.mark.parametrize("order", [None, [2, 0, 3, 1]])
def test_done_places_the_slots_and_the_trainer_rebuilds_the_very_records(order):
    slots = _slots(4)
    records = _records(slots, order)
    done = P.WriteDone(cut=CUT, files=[_file()], placed=P.place(slots, [_file()], records), timings={})
    assert (done.placed["slot"] is None) == (order is None)
    got = _through_socket(done)
    assert got.records(slots) == records
    assert all(type(r.shape) is list for r in got.records(slots))


def _placed(**change):
    base = {"slot": None, "file": [0, 0], "offset": [0, 4096], "blake3": "ab" * 64}
    return {**base, **change}


@pytest.mark.parametrize("placed, words", [
    ({"slot": None, "file": [0], "offset": [0]}, "exactly the keys"),
    (_placed(extra=1), "exactly the keys"),
    (_placed(file=[0]), "entries"),
    (_placed(offset=[0, -1]), "non-negative"),
    (_placed(offset=[0, True]), "non-negative"),
    (_placed(file=[0, 1.0]), "non-negative"),
    (_placed(slot=[0, "1"]), "non-negative"),
    (_placed(blake3="AB" * 64), "lowercase hex"),
    (_placed(blake3="ab" * 63), "entries"),
    (_placed(offset="0"), "must be lists"),
])
def test_a_malformed_done_is_refused_on_parse(placed, words):
    frame = json.dumps({"kind": "done", "cut": CUT, "files": [_file().model_dump()], "placed": placed,
                        "timings": {}}).encode()
    a, b = socket.socketpair()
    with a, b:
        a.sendall(len(frame).to_bytes(4, "little") + frame)
        with pytest.raises(ValueError, match=words):
            P.recv(b.fileno(), timeout=BOUND)


@pytest.mark.parametrize("placed, words", [
    (_placed(slot=[0, 0]), "each of the request's slots once"),
    (_placed(slot=[0, 2]), "each of the request's slots once"),
    (_placed(file=[0, 1]), "outside the 1"),
    ({"slot": None, "file": [0], "offset": [0], "blake3": "ab" * 32}, "the request has 2"),
])
def test_a_done_that_does_not_fit_its_request_is_refused(placed, words):
    done = P.WriteDone(cut=CUT, files=[_file()], placed=placed, timings={})
    with pytest.raises(ValueError, match=words):
        done.records(_slots(2))


TREES = [
    {}, [], {"a": []}, {"t": "dict", "items": [1, 2.5, None, True, "é\u2028\"x\"", float("nan"), -math.inf]},
    {"k": {str(i): [i] * i for i in range(40)}}, {1: "int key", "a": {2: [3]}},
    {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[{"x": 1}]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
    _tree(100),
]


@pytest.mark.parametrize("tree", TREES)
def test_tree_text_is_compact_json_byte_for_byte(tree):
    text, want = TreeText(), compact_json(tree).encode()
    assert text.text(tree) == want
    assert text.text(tree, remember=True) == want
    assert text.text(tree) == want  # from what it remembered
    assert text.text(dict(tree) if isinstance(tree, dict) else list(tree)) == want


def test_tree_text_reuses_only_the_very_objects_it_remembered():
    text = TreeText()
    shared = _tree(50)
    first = {"model": shared, "step": 1}
    text.text(first, remember=True)
    second = {"model": shared, "step": 2}  # the next cut: same subtree object, a new value beside it
    assert text.text(second, remember=True) == compact_json(second).encode()
    equal_copy = json.loads(json.dumps(second))
    equal_copy["model"]["items"][0]["k"] = "changed"  # an equal-looking tree that is not the same object
    assert text.text(equal_copy) == compact_json(equal_copy).encode()
    with pytest.raises(ValueError):
        text.text(second, remember=True, dumps=lambda v: b"")


def _manifest(tree, offsets, digest="1") -> Manifest:
    slots = _slots(len(offsets))
    tensors = [make_record((s.name, s.kind, s.dtype, list(s.shape), s.nbytes, SHARD, o, digest * 64))
               for s, o in zip(slots, offsets)]
    return Manifest(cut=CUT, step=1, created_at="2026-01-01T00:00:00+00:00", files=[_file()], tensors=tensors,
                    tree=tree, writer=WriterIdentity(host="h", pid=1, ckptstore_version="0", mode="process"))


def _reference_bytes(m: Manifest) -> bytes:
    """The manifest's bytes the long way: one json.dumps of the whole document."""
    from ckptstore.manifest import _document
    from ckptstore.records import records_to_table

    doc = _document(m, {"tensors": records_to_table(m.tensors, [f.name for f in m.files]), "tree": m.tree})
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def test_manifest_bytes_with_remembered_trees_and_repeated_columns_are_the_long_way_s():
    tree = _tree(20)
    remember_tree_text(tree)
    for offsets, digest in (([0, 4096, 8192], "1"), ([0, 4096, 8192], "2"), ([0, 8192, 4096], "2"),
                            ([0, 4096], "3")):
        m = _manifest({**tree}, offsets, digest)  # a copy of the root, as pydantic makes it
        assert m.to_bytes() == _reference_bytes(m)
        assert Manifest.from_bytes(m.to_bytes()).tensors == m.tensors
    tree["items"].append({"k": "new", "v": 1})  # modified in place: a user's tree, never remembered ...
    m = _manifest({**tree}, [0])
    assert m.to_bytes() != _reference_bytes(m)  # ... would go wrong: hence only the pipeline remembers


def test_repeated_cuts_of_one_layout_commit_the_same_state_as_a_fresh_writer(url):
    """End to end over the process writer: cuts 2 and 3 hand over by number and reuse the texts; each
    loads back bit for bit, and its manifest is what a parse and re-encode give."""
    state = {f"w{i}": np.full(1024, float(i), np.float32) for i in range(300)}
    state["meta"] = {"step": 0, "lr": 0.1}
    with Checkpointer(url, every=1) as ck:
        for step in (1, 2, 3):
            state["meta"]["step"] = step
            snap = clone_state(state)
            info = ck.cut(step, state).wait(BOUND)
            loaded = ckptstore.load(url, cut=info.id)
            assert_state_equal(loaded, snap)
            data = ck.store.storage.read_bytes(f"cuts/{info.id}/MANIFEST.json")
            m = Manifest.from_bytes(data)
            assert _reference_bytes(m) == data
            mutate_in_place(state)
    check_store(url)


def test_a_launch_that_fails_after_the_cut_is_in_flight_fails_it_and_close_returns(url):
    """A request that cannot be encoded (metadata of no JSON type) fails in the hand-over, after the cut
    was recorded as in flight: the cut fails there and then, the error reaches the caller with a
    "failed" event, and close() returns (before, it waited for that cut forever)."""
    log = EventLog()
    state = {"w": np.ones(1024, np.float32)}
    ck = Checkpointer(url, every=1, on_event=log)
    try:
        with pytest.raises(Exception, match="serialize"):
            ck.cut(1, state, metadata={"x": object()})
        failed = log.wait_for("failed", step=1)
        assert failed["stage"] == "launch"
        assert ck.cut(2, state).wait(BOUND).step == 2  # the writer and the loop go on
    finally:
        closer = threading.Thread(target=ck.close, daemon=True)
        closer.start()
        closer.join(BOUND)
        assert not closer.is_alive(), "close() hung on a cut whose launch failed"
    check_store(url)
