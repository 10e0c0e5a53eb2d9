"""The typed parent/worker protocol: small JSON frames over a Unix socket; tensors never travel here.

Each frame is a u32 little-endian length and a UTF-8 JSON object with a ``kind``, over one Unix
socket pair. The parent sends ``open`` once after the handshake (and ``mirror-open`` with a mirror),
then ``write``, ``marked``, ``ended``, ``mirror-submit`` and ``shutdown``; the worker answers ``hello``
once (the handshake), then ``progress`` while it writes (liveness), ``done`` or ``error`` per request,
and, from its mirror thread at any time, ``mirror-update`` (issue 21). Every
message is a strict pydantic model: unknown kinds or fields are refused. When a ``write`` names a block
the worker has not seen, the frame is followed by one byte carrying the block's file descriptor
(SCM_RIGHTS): the block has no name to attach by (see ``shm.py``).

Issue 23 (a state of 40,000 arrays): a ``write`` whose slots this writer was sent before names them by
their ``layout`` number instead of listing them again; the tree of its ``finish`` plan travels as raw
JSON right after the frame (``tree_bytes`` long), parsed by the worker only should it finish the cut
alone; and ``done`` places each of the request's slots (file, offset, digest) instead of repeating
their names, dtypes and shapes. Each side then handles a few columns where it had 40,000 records.
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import socket
import struct
import time
from typing import Annotated, Any, Literal, Sequence, Union

import pydantic_core
from pydantic import Field, PlainSerializer, PlainValidator, PrivateAttr, TypeAdapter

from ckptstore.errors import CkptStoreError, wire_form
from ckptstore.spi import CutIntent, ShardSpec
from ckptstore.spi import FileRecord, TensorRecord
from ckptstore.spi import StrictModel, pausing, tree_text

from .plan import Slot

MAX_FRAME = 256 << 20

_SLOT_FIELDS = ("name", "kind", "dtype", "shape", "nbytes", "offset")


#: The columns of the last slots sent, by the identity of their tuple: a capture whose layout repeats
#: reuses its plan (``writer.capture``), so the columns of 40,000 slots are made once, not at every
#: cut while the training loop waits (0.05-0.15 s each).
_last_columns: tuple[Any, dict[str, list[Any]]] | None = None


def _slots_to_columns(slots: Any) -> dict[str, list[Any]]:
    """A request's slots as one list per field: 40,000 slots as 40,000 pydantic-validated dataclasses
    cost the writer about 1 s per cut to parse (issue 23); as columns, a few C-level passes."""
    global _last_columns
    last = _last_columns
    if last is not None and last[0] is slots and type(slots) is tuple:
        return last[1]
    cols: list[Any] = list(zip(*[(s.name, s.kind, s.dtype, s.shape, s.nbytes, s.offset) for s in slots])) or [()] * 6
    columns = {k: list(c) for k, c in zip(_SLOT_FIELDS, cols)}
    if type(slots) is tuple:  # immutable: the identity stands for the content
        _last_columns = (slots, columns)
    return columns


def _is_size(v: Any) -> bool:
    return type(v) is int and v >= 0


#: The last tuple of slots found to be all ``Slot``s (a repeated layout's plan: checked once, not at
#: every cut while the loop waits).
_last_checked: tuple[Slot, ...] | None = None


@pausing  # a first request of 40,000 slots makes 40,000 objects (see WriteDone.records)
def _columns_to_slots(value: Any) -> list[Slot]:
    """The slots of the column form, checked as strictly as the dataclass form was (types, sizes)."""
    global _last_checked
    if value is _last_checked:
        return value  # type: ignore[return-value]
    if type(value) in (list, tuple) and all(type(s) is Slot for s in value):
        if type(value) is tuple:
            _last_checked = value
        return value  # made in this process (a plan's own tuple keeps its identity: see above)
    if type(value) is not dict or value.keys() != set(_SLOT_FIELDS) or \
            not all(type(value[k]) is list for k in _SLOT_FIELDS):
        raise ValueError(f"slots must be an object of the lists {list(_SLOT_FIELDS)}")
    names, kinds, dtypes, shapes, nbytes, offsets = (value[k] for k in _SLOT_FIELDS)
    if len({len(c) for c in (names, kinds, dtypes, shapes, nbytes, offsets)}) != 1:
        raise ValueError("slots: every list must have one entry per slot")
    if not (all(type(n) is str for n in names) and all(k in ("torch", "numpy") for k in kinds)
            and all(type(d) is str for d in dtypes) and all(_is_size(n) for n in nbytes)
            and all(_is_size(o) for o in offsets)
            and all(type(sh) is list and all(_is_size(d) for d in sh) for sh in shapes)):
        raise ValueError("slots: a name, kind, dtype, shape, size or offset has the wrong type")
    return [Slot(n, k, d, tuple(sh), b, o) for n, k, d, sh, b, o in zip(names, kinds, dtypes, shapes, nbytes, offsets)]


SlotColumns = Annotated[list[Slot], PlainValidator(_columns_to_slots), PlainSerializer(_slots_to_columns, return_type=dict)]


class Hello(StrictModel):
    kind: Literal["hello"] = "hello"
    pid: int
    nice: int
    modules_with_torch: bool


class OpenStore(StrictModel):
    """The store the worker writes into: what ``Storage.spec()`` says (URL and fsspec options, e.g.
    an endpoint and credentials). Sent once after the handshake, over the socket (never on the command
    line, where other users could read credentials). ``lock`` is the trainer's writer lock as a
    rescuer needs it (``WriterLock.handoff()``): with kind "flock" the frame is followed by the lock
    file's descriptor, so the lock outlives a trainer that dies while its writer finishes a cut."""

    kind: Literal["open"] = "open"
    url: str
    storage_options: dict[str, Any] = Field(default_factory=dict)
    io: dict[str, Any] | None = None  # the store's I/O policy (timeouts, retries, deadline; issue 24)
    lock: dict[str, Any] = Field(default_factory=dict)


class Finish(CutIntent):
    """How the cut of a request is finished should the trainer die before it ends it (the rescue):
    the intent its commit thread would have committed (the same record, issue 20), and how long rank
    0's rescuer waits for a rank record that does not come (``rank_timeout``)."""

    rank_timeout: float = 300.0
    stall_timeout: float = 600.0


class WriteRequest(StrictModel):
    """Write the arrays in ``slots`` (offsets into the shared block) as the shards of ``rank`` of
    ``cut``, with the store's shard settings (codec, level, shard size)."""

    kind: Literal["write"] = "write"
    cut: str
    step: int
    block: str
    block_size: int
    #: None on the wire when this writer was sent the same slots before, under number ``layout``.
    slots: SlotColumns | None
    layout: int = Field(default=0, ge=0)
    shards: ShardSpec
    rank: int = 0
    finish: Finish | None = None
    #: Handed over at capture: write nothing before the ``marked`` frame of this cut (or, once the
    #: trainer is gone, before marking it here), so no shard ever precedes its cut's mark.
    after_mark: bool = False
    #: Whether every byte was in the block when this was sent (False while a CUDA device copy is still
    #: in flight: then only ``marked`` says the bytes are there, and a rescue without it writes nothing).
    block_complete: bool = True
    #: Bytes of raw JSON after the frame: ``finish``'s tree (then None in the frame). The worker needs
    #: the tree only to finish the cut alone, so it parses it then, not while the write waits.
    tree_bytes: int = Field(default=0, ge=0, le=MAX_FRAME)
    _tree_text: bytes | None = PrivateAttr(default=None)

    def plan(self) -> Finish | None:
        """``finish`` with its tree, parsed and checked here from the raw JSON that followed the frame
        when it travelled there (a ValueError when that is no JSON object)."""
        f, text = self.finish, self._tree_text
        if f is None or f.tree is not None or text is None:
            return f
        try:
            tree = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"the tree of cut {self.cut}'s request is not JSON: {exc}") from None
        return Finish.model_validate({**dict(f), "tree": tree})


def _wire_json(value: Any) -> bytes:
    """Any JSON of ``value`` (the worker parses it back with ``json.loads``; NaN and infinities as
    json writes them): pydantic-core's encoder, 4-6x json.dumps on a tree of 40,000 arrays."""
    return pydantic_core.to_json(value)


def on_the_wire(req: WriteRequest, *, layout: int, slots_known: bool) -> tuple[WriteRequest, bytes]:
    """``req`` as it travels to a writer, and the bytes after its frame: its slots as ``layout``
    (left out when ``slots_known``: this writer was sent them under that number), its finish plan's
    tree as raw JSON after the frame, made of the text the manifest of the last cut remembered for
    the subtrees this tree shares with it (``tree_text``: a repeated layout re-encodes only what
    changed) and the rest encoded anew."""
    update: dict[str, Any] = {"layout": layout}
    if slots_known:
        update["slots"] = None
    tail = b""
    f = req.finish
    if f is not None and f.tree is not None:
        tail = tree_text(f.tree, dumps=_wire_json)
        update.update(finish=f.model_copy(update={"tree": None}), tree_bytes=len(tail))
    return req.model_copy(update=update), tail


class Marked(StrictModel):
    """The trainer marked ``cut`` (durably) and every byte of it is in the block: write it now."""

    kind: Literal["marked"] = "marked"
    cut: str


class CutEnded(StrictModel):
    """The trainer committed or abandoned ``cut``: nothing is left for a rescue."""

    kind: Literal["ended"] = "ended"
    cut: str


class Progress(StrictModel):
    kind: Literal["progress"] = "progress"
    cut: str
    bytes_done: int


_PLACED_KEYS = frozenset(("slot", "file", "offset", "blake3"))
_HEX = re.compile(r"[0-9a-f]*")


def _all_counts(values: list[Any]) -> bool:
    """Every value a non-negative int (never a bool), in C-level passes."""
    return set(map(type, values)) <= {int} and (not values or min(values) >= 0)


def _check_placed(value: Any) -> dict[str, Any]:
    """The ``placed`` columns of a ``done``, checked in bulk: exactly its keys, int columns of one
    length, digests as 64 lowercase hex digits each; ``slot`` None (the request's order) or a list.
    Whether they fit the request (a permutation of its slots, files listed) ``WriteDone.records`` checks."""
    if type(value) is not dict or value.keys() != _PLACED_KEYS:
        raise ValueError(f"placed must be an object with exactly the keys {sorted(_PLACED_KEYS)}")
    order, files, offsets, digests = value["slot"], value["file"], value["offset"], value["blake3"]
    if not (type(files) is list and type(offsets) is list and type(digests) is str
            and (order is None or type(order) is list)):
        raise ValueError("placed: file and offset must be lists, slot a list or null, blake3 a string")
    n = len(files)
    if len(offsets) != n or (order is not None and len(order) != n) or len(digests) != 64 * n:
        raise ValueError(f"placed: every column must have {n} entries (and blake3 {64 * n} hex digits)")
    if not (_all_counts(files) and _all_counts(offsets) and (order is None or _all_counts(order))):
        raise ValueError("placed: slot, file and offset must be non-negative integers")
    if not _HEX.fullmatch(digests):
        raise ValueError("placed: blake3 must be lowercase hex digits")
    return value


#: A ``done``'s arrays: per record (in the order the shard writer wrote them) the index of its slot in
#: the request (``slot``; null when that order is the request's), the index of its file in ``files``,
#: its offset in the file's data and its blake3 (hex, concatenated).
Placed = Annotated[dict[str, Any], PlainValidator(_check_placed)]
_make_record = functools.partial(tuple.__new__, TensorRecord)  # a record from its 8 fields, at C speed


def place(slots: Sequence[Slot], files: list[FileRecord], tensors: list[TensorRecord]) -> dict[str, Any]:
    """The ``placed`` columns of ``tensors``, the records the shard writer returned for ``slots``."""
    names = [t.name for t in tensors]
    if names == [s.name for s in slots]:
        order = None
    else:
        index = {s.name: i for i, s in enumerate(slots)}
        order = [index[n] for n in names]
    file_index = {f.name: i for i, f in enumerate(files)}
    return {"slot": order, "file": [file_index[t.file] for t in tensors], "offset": [t.offset for t in tensors],
            "blake3": "".join(t.blake3 for t in tensors)}


class WriteDone(StrictModel):
    kind: Literal["done"] = "done"
    cut: str
    files: list[FileRecord]
    placed: Placed  # where each slot of the request went (``place``): a few columns, not 40,000 records
    timings: dict[str, float]

    @pausing  # 40,000 new records: the collector's passes over the trainer's heap cost 0.2-0.4 s
    def records(self, slots: Sequence[Slot]) -> list[TensorRecord]:
        """The manifest records of the arrays written: the request's ``slots`` (what each array is),
        where ``placed`` says each went. A ValueError unless ``placed`` lists every slot once and
        names files of ``files``."""
        p, n = self.placed, len(slots)
        order = p["slot"]
        if len(p["file"]) != n:
            raise ValueError(f"done places {len(p['file'])} arrays, the request has {n}")
        if order is not None and (len(set(order)) != n or (n and max(order) >= n)):
            raise ValueError("done's slot indexes are not each of the request's slots once")
        if p["file"] and max(p["file"]) >= len(self.files):
            raise ValueError(f"done names a file outside the {len(self.files)} it lists")
        placed = slots if order is None else [slots[i] for i in order]
        digests, names = p["blake3"], [f.name for f in self.files]
        shapes = [s.shape for s in placed]
        # One list per distinct shape, shared by its records (records are never changed in place, as
        # shardwrite's): 100,000 records of one shape made 100,000 lists, 7 MB of the commit's peak.
        lists = {shape: list(shape) for shape in set(shapes)}
        return list(map(_make_record, zip(
            [s.name for s in placed], [s.kind for s in placed], [s.dtype for s in placed],
            map(lists.__getitem__, shapes), [s.nbytes for s in placed], [names[i] for i in p["file"]],
            p["offset"], [digests[i:i + 64] for i in range(0, 64 * n, 64)])))


class WriteFailed(StrictModel):
    """The request failed in the writer. A ckptstore error travels by its wire ``key``
    (``ckptstore.errors.WIRE``) with its ``fields``, so the trainer rebuilds its own type (issue 20:
    rebuilt by class name, ``RankFailure`` and ``CommitUnknown`` came back as a plain ``WriterError``);
    any other error as ``error_type`` (its class name) and its message."""

    kind: Literal["error"] = "error"
    cut: str | None
    error_type: str
    message: str
    key: str | None = None
    fields: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, cut: str | None, exc: BaseException) -> "WriteFailed":
        if not isinstance(exc, CkptStoreError):
            return cls(cut=cut, error_type=type(exc).__name__, message=str(getattr(exc, "message", exc)))
        key, fields = wire_form(exc)
        # JSON as the frame carries it: a field that is not (a tuple, a path object) goes as its text
        # instead of failing the frame, which would leave the trainer waiting for an answer.
        fields = json.loads(json.dumps(fields, default=str))
        return cls(cut=cut, error_type=type(exc).__name__, message=exc.message, key=key, fields=fields)


class MirrorOpen(StrictModel):
    """Sent once after ``open`` with a mirror (issue 21): the worker uploads each committed cut of its
    store into the store at ``url`` (opened with ``options``, ``StoreOptions``' plain fields: storage
    options, lease and I/O settings; never a callable), prunes it with ``keep`` (a policy's JSON form,
    ``spi.policy_to_json``) and first catches it up. Over the socket, like ``open``'s credentials."""

    kind: Literal["mirror-open"] = "mirror-open"
    url: str
    options: dict[str, Any] = Field(default_factory=dict)
    keep: dict[str, Any] | None = None
    retry_s: float = 1.0
    #: How long an orphaned writer (its trainer gone) goes on uploading before it exits.
    timeout_s: float = 600.0
    #: The trainer's rank of a job's ``world_size`` ranks, and the bound of each wait for the others on
    #: the mirror (issue 21, several ranks: rank 0's tier decides, the others follow its marks).
    rank: int = 0
    world_size: int = 1
    rank_timeout: float = 300.0


class MirrorSubmit(StrictModel):
    """A cut the trainer just committed locally (``CutInfo.to_json`` and its metadata): upload it."""

    kind: Literal["mirror-submit"] = "mirror-submit"
    cut: dict[str, Any]


class MirrorUpdate(StrictModel):
    """From the worker's mirror thread, at any time: one of its events (``mirrored``, ``mirror-failed``,
    ``mirror-skipped``; None when only its state changed) and the tier's state (``MirrorTier.state``).
    The trainer's reader thread takes these apart from the answers to its requests."""

    kind: Literal["mirror-update"] = "mirror-update"
    event: dict[str, Any] | None = None
    state: dict[str, Any]


class Shutdown(StrictModel):
    kind: Literal["shutdown"] = "shutdown"


Message = Union[Hello, OpenStore, WriteRequest, Marked, CutEnded, Progress, WriteDone, WriteFailed, MirrorOpen,
                MirrorSubmit, MirrorUpdate, Shutdown]
#: Discriminated by ``kind``: pydantic goes straight to the one model (an undiscriminated union tried
#: the models in turn, 0.7 s for a request of 40,000 arrays where the JSON parses in 0.1 s: issue 23).
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Annotated[Message, Field(discriminator="kind")])


class ChannelClosed(EOFError):
    """The other end of the socket is gone."""


def send(fd: int, msg: StrictModel, tail: bytes = b"") -> None:
    """One frame, and ``tail`` right after it (a request's ``tree_bytes`` of raw tree JSON)."""
    # pydantic-core's serializer: a request of 40,000 arrays (plus its tree) encodes in 0.1 s, where
    # model_dump + json.dumps took 0.8 s, and the request is encoded while the training loop waits.
    data = msg.model_dump_json().encode()
    parts: list[Any] = [p for p in (struct.pack("<I", len(data)), data, tail) if p]
    while parts:
        try:
            n = os.writev(fd, parts)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelClosed("peer closed the socket") from exc
        while parts and n >= len(parts[0]):  # drop what went; keep the rest of a part half sent
            n -= len(parts.pop(0))
        if parts and n:
            parts[0] = memoryview(parts[0])[n:]
        parts = [p for p in parts if len(p)]


class FrameTimeout(TimeoutError):
    """A frame started but its rest did not come within ``FRAME_S``: the channel is out of step."""


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        # A zero wait past the deadline still sees bytes that are there (a job resumed after SIGSTOP).
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise FrameTimeout(f"{len(out)} of {n} bytes of a frame arrived within {FRAME_S:g} s")
        try:
            chunk = os.read(fd, n - len(out))
        except ConnectionResetError as exc:  # the peer died with bytes we had sent still unread
            raise ChannelClosed("peer closed the socket") from exc
        if not chunk:
            raise ChannelClosed("peer closed the socket")
        out += chunk
    return bytes(out)


#: How long the rest of a frame may take once its first byte arrived (the sender writes a frame whole).
FRAME_S = 30.0


def recv(fd: int, timeout: float | None = None) -> Message:
    """The next message, or TimeoutError when none starts within ``timeout`` seconds. Nothing is
    consumed unless a frame starts in time: a frame's bytes are read only once the first one is there,
    so a reader polling with short timeouts never loses half a header."""
    if timeout is not None:
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if not ready:
            raise TimeoutError
        head = _read_exact(fd, 4, time.monotonic() + FRAME_S)
    else:
        head = _read_exact(fd, 4, None)
    (n,) = struct.unpack("<I", head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds the protocol limit")
    deadline = time.monotonic() + FRAME_S
    body = _read_exact(fd, n, deadline)
    try:
        msg = _ADAPTER.validate_json(body, strict=False)
    except ValueError:
        json.loads(body.decode())  # not JSON at all: say so as json does
        raise
    if isinstance(msg, WriteRequest) and msg.tree_bytes:
        text = _read_exact(fd, msg.tree_bytes, deadline)  # read first: the channel stays in step
        if msg.finish is None or msg.finish.tree is not None:
            raise ValueError("a write carries tree bytes only for a finish plan without its tree")
        msg._tree_text = text
    return msg


def send_fd(sock_fd: int, fd: int) -> None:
    """Sends one file descriptor (with a one-byte carrier) right after a frame."""
    sock = socket.socket(fileno=sock_fd)
    try:
        socket.send_fds(sock, [b"F"], [fd])
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise ChannelClosed("peer closed the socket") from exc
    finally:
        sock.detach()


def recv_fd(sock_fd: int) -> int:
    """Receives the file descriptor that follows a frame."""
    sock = socket.socket(fileno=sock_fd)
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    except ConnectionResetError as exc:
        raise ChannelClosed("peer closed the socket") from exc
    finally:
        sock.detach()
    if data != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ChannelClosed("expected a file descriptor from the parent")
    return fds[0]
