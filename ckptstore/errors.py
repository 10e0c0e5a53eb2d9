"""The one exception tree of ckptstore.

Every error the library raises derives from :class:`CkptStoreError` and carries ``store``, ``cut`` and
``path`` where they are known. Errors about *bad data* (what is on disk is corrupt, truncated, missing
or hostile) are kept apart from errors about *misuse* (what the caller asked for makes no sense), so a
launcher can tell "fall back to an older cut" from "fix the code"::

    CkptStoreError
    +-- DataError                      what is stored is not what it should be
    |   +-- CorruptCut                 hash or size mismatch, bad header, bad tree
    |   |   +-- HashMismatch           a blake3 digest differs from the one recorded
    |   |   +-- TruncatedFile          a file is shorter than its manifest says
    |   |   +-- NotAFile               a directory, FIFO or symlink stands where the store keeps a file
    |   +-- MissingFile (also FileNotFoundError)
    |   +-- ManifestError              a manifest that does not parse or breaks the format's rules
    |   +-- LatestError                LATEST unreadable or dangling while committed cuts exist
    |   +-- HostileInput               path traversal, absurd header lengths, pickle where none is allowed
    +-- UsageError (also ValueError)   the caller's request is wrong
    |   +-- UnsupportedValue (also TypeError) a state value that cannot be stored without pickle
    |   +-- StepConflict               a step at or below the committed LATEST
    |   +-- CutNotFound (also LookupError)
    |   +-- StoreNotFound (also FileNotFoundError)
    +-- StoreLocked                    another writer holds the store
    +-- RankFailure                    ranks of a job failed or disagree (``ranks``; ckptstore.ranks)
    +-- StorageError (also OSError)    the file system refused (full disk, permissions, I/O error)

Every class pickles with its fields intact (``__reduce__``), so an error raised in the writer process
reaches the trainer with type and context (the filelock habit, ``_error.py:Timeout.__reduce__``).

The wire. Every class is registered in :data:`WIRE` under a stable key given in its class statement
(``class RankFailure(CkptStoreError, wire="rank-failure")``), wherever it is defined: the writer
process sends :func:`wire_form` (the key and the fields) and the trainer rebuilds the exact type with
:func:`from_wire`. Fields beyond store, cut, path and hint are named in the class's ``wire_fields`` (and
taken as keywords by its ``__init__``), so pickling and the wire carry the same ones (issue 20: errors
used to be rebuilt by class name from this module only, so ``RankFailure`` and ``CommitUnknown`` came
back as a plain ``WriterError``, and ``RankFailure`` did not pickle at all).
"""

from __future__ import annotations

import errno as _errno
from typing import Any, ClassVar, Mapping, Sequence

__all__ = [
    "CkptStoreError",
    "DataError",
    "CorruptCut",
    "TruncatedFile",
    "NotAFile",
    "MissingFile",
    "ManifestError",
    "LatestError",
    "HostileInput",
    "HashMismatch",
    "UsageError",
    "UnsupportedValue",
    "StepConflict",
    "CutNotFound",
    "StoreNotFound",
    "StoreLocked",
    "StorageError",
    "RankFailure",
    "WIRE",
    "wire_form",
    "from_wire",
]

#: Every error class by its wire key (see the module docstring). Keys are part of the writer's wire
#: protocol: never reuse or rename one.
WIRE: dict[str, type["CkptStoreError"]] = {}

#: The fields every error carries (its ``__init__`` keywords besides the message).
_BASE_FIELDS = ("store", "cut", "path", "hint")


class CkptStoreError(Exception):
    """Base of every ckptstore error; ``str()`` names the store, cut and file where known."""

    #: The fields past store, cut, path and hint that ``__init__`` takes as keywords and keeps as
    #: attributes of the same name: they pickle and cross the process boundary.
    wire_fields: ClassVar[tuple[str, ...]] = ()
    #: This class's own key in WIRE; None for a subclass registered under none (it crosses the wire
    #: as its nearest registered base).
    wire_key: ClassVar[str | None] = None

    def __init_subclass__(cls, *, wire: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.wire_key = None
        if wire is not None:
            _register(cls, wire)

    def __init__(
        self,
        message: str,
        *,
        store: str | None = None,
        cut: str | None = None,
        path: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.store = store
        self.cut = cut
        self.path = path
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.message]
        where = []
        if self.store is not None:
            where.append(f"store={self.store}")
        if self.cut is not None:
            where.append(f"cut={self.cut}")
        if self.path is not None:
            where.append(f"file={self.path}")
        if where:
            parts.append("[" + ", ".join(where) + "]")
        if self.hint:
            parts.append(f"-- {self.hint}")
        return " ".join(parts)

    def _fields(self) -> dict[str, Any]:
        return {"store": self.store, "cut": self.cut, "path": self.path, "hint": self.hint}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self._fields(), self._extra()))

    def _extra(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.wire_fields}

    def __str__(self) -> str:
        return self._render()


def _rebuild(cls: type, message: str, fields: dict[str, Any], extra: dict[str, Any]) -> CkptStoreError:
    return cls(message, **fields, **extra)


def _register(cls: type[CkptStoreError], key: str) -> None:
    """Registers ``cls`` under ``key``; a key taken by another class is a bug, caught at import."""
    if not key or WIRE.get(key, cls) is not cls:
        raise TypeError(f"error wire key {key!r} of {cls.__qualname__} is empty or taken by {WIRE[key].__qualname__}")
    WIRE[key] = cls
    cls.wire_key = key


_register(CkptStoreError, "ckptstore-error")


def _registered_base(cls: type[CkptStoreError]) -> type[CkptStoreError]:
    return next(c for c in cls.__mro__ if vars(c).get("wire_key"))


def wire_form(exc: CkptStoreError) -> tuple[str, dict[str, Any]]:
    """The wire key of ``exc``'s class (or of its nearest registered base) and the fields that class
    takes, for :func:`from_wire` on the other side. Field values are JSON (paths, errno, ranks, a
    holder as the lock recorded it)."""
    cls = _registered_base(type(exc))
    fields = exc._fields()
    fields.update({name: getattr(exc, name) for name in cls.wire_fields})
    return cls.wire_key, fields  # type: ignore[return-value]


def from_wire(key: str, message: str, fields: Mapping[str, Any]) -> CkptStoreError | None:
    """The error of class ``WIRE[key]`` with ``message`` and the fields it takes (others are ignored);
    None when the key is unknown here or the fields do not fit the class (the caller then says what
    came, as text)."""
    cls = WIRE.get(key)
    if cls is None:
        return None
    known = (*_BASE_FIELDS, *cls.wire_fields)
    try:
        return cls(message, **{k: v for k, v in fields.items() if k in known})
    except (TypeError, ValueError):
        return None


class DataError(CkptStoreError, wire="data-error"):
    """What is stored is not what the manifest or the format says it should be."""


class CorruptCut(DataError, wire="corrupt-cut"):
    """A hash, size, header or tree check failed."""


class HashMismatch(CorruptCut, wire="hash-mismatch"):
    """A blake3 digest of stored bytes differs from the one the manifest records: the bytes changed.
    Its own type, so audits tell it from other damage by type (issue 20: verify looked for "blake3" in
    the message, and a tensor named so turned any damage of its file into a hash mismatch)."""


class TruncatedFile(CorruptCut, wire="truncated-file"):
    """A file is shorter than its manifest records."""


class NotAFile(CorruptCut, wire="not-a-file"):
    """A name the store reads (a shard, a manifest, LATEST) is a directory, FIFO, device or symlink, not a
    regular file: damage of that file, never a transient I/O error, so fallback skips its cut (issue 19
    item 12: a symlinked shard used to read as "a transient I/O error: retry")."""


class MissingFile(DataError, FileNotFoundError, wire="missing-file"):
    """A file that the manifest or LATEST names does not exist."""

    def __init__(self, message: str, **fields: Any) -> None:
        DataError.__init__(self, message, **fields)
        self.errno = _errno.ENOENT


class ManifestError(DataError, wire="manifest-error"):
    """A manifest, pointer or mark that does not parse or violates the format."""


class LatestError(DataError, wire="latest-error"):
    """LATEST is missing, unreadable or dangling while committed cuts exist."""


class HostileInput(DataError, wire="hostile-input"):
    """Input built to escape the store or run code: traversal names, absurd lengths, pickle."""


class UsageError(CkptStoreError, ValueError, wire="usage-error"):
    """The caller asked for something that makes no sense."""


class UnsupportedValue(UsageError, TypeError, wire="unsupported-value"):
    """A state value that cannot be stored without pickle; names the key path."""


class StepConflict(UsageError, wire="step-conflict"):
    """The step is at or below the committed LATEST step."""


class CutNotFound(UsageError, LookupError, wire="cut-not-found"):
    """No committed cut matches the request."""


class StoreNotFound(UsageError, FileNotFoundError, wire="store-not-found"):
    """The URL holds no ckptstore store (and ``create`` was not asked for)."""


class StoreLocked(CkptStoreError, wire="store-locked"):
    """Another live writer holds the store; ``holder`` says who."""

    wire_fields = ("holder",)

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None, **fields: Any) -> None:
        self.holder = holder or {}
        super().__init__(message, **fields)


class StorageError(CkptStoreError, OSError, wire="storage-error"):
    """The file system refused an operation; ``errno`` is kept so ``except OSError`` works."""

    wire_fields = ("errno",)

    def __init__(self, message: str, *, errno: int | None = None, **fields: Any) -> None:
        CkptStoreError.__init__(self, message, **fields)
        self.errno = errno
        self.strerror = message

    @classmethod
    def from_os_error(cls, exc: OSError, action: str, *, hint: str | None = None, **fields: Any) -> "StorageError":
        """Wraps an OSError raised while doing ``action``, keeping its errno and naming the place. A
        FileNotFoundError without an errno (s3fs raises them so) gets ENOENT, so "absent" is always
        told apart from "could not read". ``hint`` replaces the default one, which speaks of the store
        (a file system that is not the store's, as a restore's target: issue 19 item 9)."""
        code = exc.errno
        if code is None and isinstance(exc, FileNotFoundError):
            code = _errno.ENOENT
        if hint is None and exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
            hint = "the file system is full: free space, then take the next cut; committed cuts are untouched"
        elif hint is None and exc.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS):
            hint = "the store is not writable by this process"
        return cls(f"{action} failed: {exc.strerror or exc}", errno=code, hint=hint, **fields)


class RankFailure(CkptStoreError, wire="rank-failure"):
    """One or more ranks failed (an error in their part, or no sign of life within ``rank_timeout``).
    ``ranks`` are group ranks. ``exchange``: the exchange this rank's call failed in, when it failed in
    one (e.g. "save-commit"), so callers tell where by a field, never by the message (issue 20).
    Raised by :mod:`ckptstore.ranks` (and importable from there)."""

    wire_fields = ("ranks", "exchange")

    def __init__(self, message: str, *, ranks: Sequence[int], exchange: str | None = None, **where: Any) -> None:
        super().__init__(message, **where)
        self.ranks = sorted(set(ranks))
        self.exchange = exchange
