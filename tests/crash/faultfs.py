"""FaultyStorage: a storage wrapper that counts every storage call and fails exactly one of them with EIO.

It wraps a real backend (a :class:`PosixStorage` on a tmp dir in the fault sweep) and records, while its
:class:`FaultPlan` is recording, every call of every storage verb with the verb's name and the
store-relative path: the verbs of the seam (``write_durably``, ``open_sink``, ``read_bytes``,
``read_range``, ``open_reader``, ``map_file``, ``size``, ``exists``, ``list_dir``, ``make_dir``, ``delete``,
``remove_dir``, ``sync_dir``, the conditional verbs, and any public verb the interface gains later),
and the calls on the objects they return (``sink.write``/``sink.close`` on a shard sink,
``reader.readinto``/``reader.read``/... on a reader). Call number ``fail_at`` (0-based, counted from
when recording starts) fails once; every later call works again.

Direct I/O that bypasses the seam: where the backend has local paths the store opens files itself
(the writer lock's flock on ``.writer.lock``; verify's mmap hashing of a shard goes through
``map_file`` since issue 20, and is counted as that verb). :func:`direct_io`
intercepts that too: while it is active and the plan records, every ``os.open`` and built-in ``open``
of a path under the store root that does not come from inside a wrapped storage call is counted as
``direct-open`` and can fail, at the very call the library makes.

How a failure looks, call by call (as the real backend or the OS would raise it):

* a storage verb raises the :class:`StorageError` the backend builds for an OSError
  (``storage._error(OSError(EIO), action, rel)``, i.e. ``StorageError.from_os_error``), with the same
  action words as :class:`PosixStorage`;
* a read on a reader from ``open_reader`` raises a raw ``OSError(EIO)``: the POSIX backend hands out a
  plain file object, whose reads raise raw OSErrors, not StorageErrors;
* a ``direct-open`` raises a raw ``OSError(EIO)`` naming the OS path, as ``os.open``/``open`` do.

``after_effect`` mode (only for calls whose effect is followed by a durability step: ``write_durably``,
``make_dir``, ``remove_dir``, ``delete(durable=True)``): the inner call runs to its end, then EIO is
raised anyway, as when the final directory fsync fails after the rename/unlink/mkdir/rmdir landed.

Not intercepted: ``Sink.abort`` (never raises by contract); ``close``, ``seek`` and ``tell`` on readers;
``local_path`` itself (no I/O; the I/O on the path is caught as ``direct-open``); reads of a memory-mapped
file (an EIO there is a SIGBUS, not an exception); files blake3 opens in Rust (``update_mmap``, the
format-v1 verify path); ``spec()`` (a writer process opening the storage from it gets the inner
backend; the sync store paths swept here never do that).
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import errno
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

try:  # the storage seam is becoming a package; fall back to the old module while it moves
    from ckptstore.storage import Entry, PosixStorage, Sink, Storage
except ImportError:  # pragma: no cover - the tree before the split
    from ckptstore.fs import Entry, PosixStorage, Sink, Storage  # type: ignore[no-redef]

__all__ = ["Call", "FaultPlan", "FaultyStorage", "FaultySink", "FaultyReader", "InjectedFault", "direct_io", "normalize",
           "Entry", "PosixStorage"]

EIO = errno.EIO

#: The action words PosixStorage puts into its StorageErrors, per verb.
ACTIONS = {
    "write_durably": "durable write",
    "open_sink": "creating shard",
    "sink.write": "writing shard",
    "sink.close": "writing shard",
    "read_bytes": "reading",
    "read_range": "reading",
    "open_reader": "opening",
    "map_file": "mapping",
    "size": "stat",
    "exists": "stat",
    "list_dir": "listing",
    "make_dir": "creating directory",
    "delete": "deleting",
    "remove_dir": "removing directory",
    "sync_dir": "directory fsync",
    "put_if_absent": "conditional put",
    "put_if_match": "conditional put",
    "version": "head",
}

#: Storage attributes that do no I/O and are passed straight through, uncounted.
PASS_THROUGH = frozenset({"spec"})

_READ_METHODS = ("readinto", "read", "readall", "readinto1", "read1", "readline", "readlines")

_CUT_RE = re.compile(r"step-(\d{12})-[0-9a-f]{8}")
_TMP_RE = re.compile(r"\.tmp-[0-9a-f]{12}-")


def normalize(path: str) -> str:
    """A path with cut ids written as ``cut<step>`` and temp tokens dropped, so the same call has the
    same name in every run (cut ids and temp names carry random tokens)."""
    return _TMP_RE.sub(".tmp-", _CUT_RE.sub(lambda m: f"cut{int(m.group(1))}", path))


_inside = threading.local()


class InjectedFault(OSError):
    """The raw OSError injected at reader reads and direct opens (what the OS call would raise)."""


@dataclass(frozen=True)
class Call:
    index: int
    verb: str
    path: str
    effect: bool = False  # the call changes the store and ends with a durability step (after_effect applies)

    @property
    def label(self) -> str:
        return f"{self.verb}({normalize(self.path)})"


class FaultPlan:
    """The call log and the one call that fails. Calls are only counted while ``recording`` is true."""

    def __init__(self, fail_at: int | None = None, *, after_effect: bool = False) -> None:
        self.fail_at = fail_at
        self.after_effect = after_effect
        self.recording = False
        self.calls: list[Call] = []
        self.fired: Call | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def next_call(self, verb: str, path: str, *, effect: bool = False) -> Call | None:
        """Logs a call; returns it when it is the one that must fail, else None."""
        with self._lock:
            if not self.recording:
                return None
            call = Call(len(self.calls), verb, path, effect)
            self.calls.append(call)
            if self.fired is None and call.index == self.fail_at:
                self.fired = call
                return call
            return None


class FaultyStorage(Storage):
    """Wraps ``inner``; see the module docstring."""

    def __init__(self, inner: Storage, plan: FaultPlan | None = None) -> None:
        self._inner = inner
        self.plan = plan if plan is not None else FaultPlan()

    # attributes that are not verbs: the inner storage's ------------------------------------------
    @property
    def inner(self) -> Storage:
        return self._inner

    @property
    def url(self) -> str:  # type: ignore[override]
        return self._inner.url

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._inner, name)
        if callable(value) and name not in PASS_THROUGH and not isinstance(value, type):
            # a public method of the backend this wrapper does not know: count it too
            def counted(*args: Any, **kwargs: Any) -> Any:
                rel = args[0] if args and isinstance(args[0], str) else ""
                return self._run(name, rel, lambda: value(*args, **kwargs))

            return counted
        return value

    def spec(self):  # type: ignore[no-untyped-def]
        return self._inner.spec()

    def __repr__(self) -> str:
        return f"FaultyStorage({self._inner!r}, fail_at={self.plan.fail_at})"

    # the fault ------------------------------------------------------------------------------------
    def _eio(self, verb: str, rel: str) -> BaseException:
        exc = self._inner._error(OSError(EIO, os.strerror(EIO)), ACTIONS.get(verb, verb), rel)
        exc.injected = True  # type: ignore[attr-defined]
        return exc

    def _run(self, verb: str, rel: str, fn: Callable[[], Any], *, effect: bool = False) -> Any:
        call = self.plan.next_call(verb, rel, effect=effect)
        if call is not None and not (self.plan.after_effect and effect):
            err = self._eio(verb, rel)
            self.plan.error = err
            raise err
        depth = getattr(_inside, "depth", 0)
        _inside.depth = depth + 1  # the backend's own opens are part of this call, not direct I/O
        try:
            result = fn()
        finally:
            _inside.depth = depth
        if call is not None:  # after_effect: the effect landed, its durability step "failed"
            err = self._eio(verb, rel)
            self.plan.error = err
            raise err
        return result

    def _raw_fault(self, verb: str, rel: str, os_path: str | None = None) -> None:
        """Counts a call whose failure surfaces as a raw OSError (reader reads, direct local I/O)."""
        call = self.plan.next_call(verb, rel)
        if call is not None:
            err = InjectedFault(EIO, os.strerror(EIO), os_path or rel)
            self.plan.error = err
            raise err

    # the verbs ------------------------------------------------------------------------------------
    def write_durably(self, rel: str, data: bytes) -> None:
        self._run("write_durably", rel, lambda: self._inner.write_durably(rel, data), effect=True)

    def open_sink(self, rel: str) -> Sink:
        inner = self._run("open_sink", rel, lambda: self._inner.open_sink(rel))
        return FaultySink(self, inner, rel)

    def read_bytes(self, rel: str) -> bytes:
        return self._run("read_bytes", rel, lambda: self._inner.read_bytes(rel))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        return self._run("read_range", rel, lambda: self._inner.read_range(rel, start, end))

    def open_reader(self, rel: str) -> BinaryIO:
        inner = self._run("open_reader", rel, lambda: self._inner.open_reader(rel))
        return FaultyReader(self, inner, rel)  # type: ignore[return-value]

    def size(self, rel: str) -> int:
        return self._run("size", rel, lambda: self._inner.size(rel))

    def exists(self, rel: str) -> bool:
        return self._run("exists", rel, lambda: self._inner.exists(rel))

    def list_dir(self, rel: str) -> list[Entry]:
        return self._run("list_dir", rel, lambda: self._inner.list_dir(rel))

    def make_dir(self, rel: str) -> None:
        self._run("make_dir", rel, lambda: self._inner.make_dir(rel), effect=True)

    def delete(self, rel: str, *, durable: bool = True) -> None:
        self._run("delete", rel, lambda: self._inner.delete(rel, durable=durable), effect=durable)

    def remove_dir(self, rel: str) -> None:
        self._run("remove_dir", rel, lambda: self._inner.remove_dir(rel), effect=True)

    def sync_dir(self, rel: str) -> None:
        self._run("sync_dir", rel, lambda: self._inner.sync_dir(rel))

    def local_path(self, rel: str) -> str | None:
        return self._inner.local_path(rel)  # no I/O; what is done with the path is caught by direct_io()

    def put_if_absent(self, rel: str, data: bytes) -> str:
        return self._run("put_if_absent", rel, lambda: self._inner.put_if_absent(rel, data))

    def put_if_match(self, rel: str, data: bytes, tag: str) -> str:
        return self._run("put_if_match", rel, lambda: self._inner.put_if_match(rel, data, tag))

    def version(self, rel: str) -> tuple[str, float]:
        return self._run("version", rel, lambda: self._inner.version(rel))


def _counted_method(name: str) -> Callable[..., Any]:
    def method(self: FaultyStorage, *args: Any, **kwargs: Any) -> Any:
        rel = args[0] if args and isinstance(args[0], str) else ""
        return self._run(name, rel, lambda: getattr(self._inner, name)(*args, **kwargs))

    method.__name__ = name
    return method


def _delegated_attribute(name: str) -> property:
    return property(lambda self: getattr(self._inner, name))


def _cover_the_whole_interface(cls: type) -> None:
    """Every public method of the Storage interface that ``cls`` does not wrap explicitly (verbs added
    to the interface later) is delegated to the inner storage *and counted*, so nothing reaches the
    inner backend unseen; every public non-method attribute of the interface (``capabilities``,
    ``conditional_writes``, ...) reads the inner storage's value instead of the base class default."""
    for klass in reversed(Storage.__mro__):
        if klass in (object, abc.ABC):
            continue
        for name, value in list(vars(klass).items()):
            if name.startswith("_") or name in cls.__dict__:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                setattr(cls, name, _counted_method(name))
            else:
                setattr(cls, name, _delegated_attribute(name))
    abc.update_abstractmethods(cls)


_cover_the_whole_interface(FaultyStorage)
# Attributes of the backends that the base class only annotates (``is_local`` before the split).
for _name in ("is_local", "root"):
    if _name not in FaultyStorage.__dict__:
        setattr(FaultyStorage, _name, _delegated_attribute(_name))


# --------------------------------------------------------------------------------------------------
# Direct I/O on local paths, past the seam


@contextlib.contextmanager
def direct_io(storage: FaultyStorage) -> Iterator[None]:
    """Counts (and can fail) every ``os.open`` / built-in ``open`` of a path under the store root made
    outside a wrapped storage call, as verb ``direct-open``; only while the plan records. Patches the
    two functions process-wide for the duration (tests run one case at a time)."""
    root = storage.inner.local_path("")  # None where the backend has no local paths
    if root is None:
        yield
        return
    root = os.path.abspath(root)
    real_os_open, real_open = os.open, builtins.open

    def check(path: Any) -> None:
        if getattr(_inside, "depth", 0) or isinstance(path, int):
            return
        try:
            full = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return
        if full != root and not full.startswith(root + os.sep):
            return
        rel = os.path.relpath(full, root).replace(os.sep, "/")
        storage._raw_fault("direct-open", "" if rel == "." else rel, full)

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        check(path)
        return real_os_open(path, *args, **kwargs)

    def open_(file: Any, *args: Any, **kwargs: Any) -> Any:
        check(file)
        return real_open(file, *args, **kwargs)

    os.open, builtins.open = os_open, open_  # type: ignore[assignment]
    try:
        yield
    finally:
        os.open, builtins.open = real_os_open, real_open  # type: ignore[assignment]


class FaultySink(Sink):
    """A shard sink whose ``write`` and ``close`` calls are counted and can fail."""

    def __init__(self, storage: FaultyStorage, inner: Sink, rel: str) -> None:
        self._storage = storage
        self._inner = inner
        self._rel = rel

    def write(self, data: memoryview | bytes) -> None:
        self._storage._run("sink.write", self._rel, lambda: self._inner.write(data))

    def close(self) -> None:
        self._storage._run("sink.close", self._rel, self._inner.close)

    def abort(self) -> None:
        self._inner.abort()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)


class FaultyReader:
    """A reader from ``open_reader`` whose reads are counted and can fail with a raw OSError."""

    def __init__(self, storage: FaultyStorage, inner: BinaryIO, rel: str) -> None:
        self._storage = storage
        self._inner = inner
        self._rel = rel

    def _read_method(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._inner, name)

        def read(*args: Any, **kwargs: Any) -> Any:
            self._storage._raw_fault(f"reader.{name}", self._rel)
            return fn(*args, **kwargs)

        return read

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _READ_METHODS:
            return self._read_method(name)
        return getattr(self._inner, name)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def __enter__(self) -> "FaultyReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
