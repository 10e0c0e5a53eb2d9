"""The one exception tree of ckptstore.

Every error the library raises derives from :class:`CkptStoreError` and carries ``store``, ``cut`` and
``path`` where they are known. Errors about *bad data* (what is on disk is corrupt, truncated, missing
or hostile) are kept apart from errors about *misuse* (what the caller asked for makes no sense), so a
launcher can tell "fall back to an older cut" from "fix the code"::

    CkptStoreError
    +-- DataError                      what is stored is not what it should be
    |   +-- CorruptCut                 hash or size mismatch, bad header, bad tree
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
    +-- StorageError (also OSError)    the file system refused (full disk, permissions, I/O error)

Every class pickles with its fields intact (``__reduce__``), so an error raised in the writer process
reaches the trainer with type and context (the filelock habit, ``_error.py:Timeout.__reduce__``).
"""

from __future__ import annotations

import errno as _errno
from typing import Any

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
    "UsageError",
    "UnsupportedValue",
    "StepConflict",
    "CutNotFound",
    "StoreNotFound",
    "StoreLocked",
    "StorageError",
]


class CkptStoreError(Exception):
    """Base of every ckptstore error; ``str()`` names the store, cut and file where known."""

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
        return {}

    def __str__(self) -> str:
        return self._render()


def _rebuild(cls: type, message: str, fields: dict[str, Any], extra: dict[str, Any]) -> CkptStoreError:
    return cls(message, **fields, **extra)


class DataError(CkptStoreError):
    """What is stored is not what the manifest or the format says it should be."""


class CorruptCut(DataError):
    """A hash, size, header or tree check failed."""


class TruncatedFile(CorruptCut):
    """A file is shorter than its manifest records."""


class NotAFile(CorruptCut):
    """A name the store reads (a shard, a manifest, LATEST) is a directory, FIFO, device or symlink, not a
    regular file: damage of that file, never a transient I/O error, so fallback skips its cut (issue 19
    item 12: a symlinked shard used to read as "a transient I/O error: retry")."""


class MissingFile(DataError, FileNotFoundError):
    """A file that the manifest or LATEST names does not exist."""

    def __init__(self, message: str, **fields: Any) -> None:
        DataError.__init__(self, message, **fields)
        self.errno = _errno.ENOENT


class ManifestError(DataError):
    """A manifest, pointer or mark that does not parse or violates the format."""


class LatestError(DataError):
    """LATEST is missing, unreadable or dangling while committed cuts exist."""


class HostileInput(DataError):
    """Input built to escape the store or run code: traversal names, absurd lengths, pickle."""


class UsageError(CkptStoreError, ValueError):
    """The caller asked for something that makes no sense."""


class UnsupportedValue(UsageError, TypeError):
    """A state value that cannot be stored without pickle; names the key path."""


class StepConflict(UsageError):
    """The step is at or below the committed LATEST step."""


class CutNotFound(UsageError, LookupError):
    """No committed cut matches the request."""


class StoreNotFound(UsageError, FileNotFoundError):
    """The URL holds no ckptstore store (and ``create`` was not asked for)."""


class StoreLocked(CkptStoreError):
    """Another live writer holds the store; ``holder`` says who."""

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None, **fields: Any) -> None:
        self.holder = holder or {}
        super().__init__(message, **fields)

    def _extra(self) -> dict[str, Any]:
        return {"holder": self.holder}


class StorageError(CkptStoreError, OSError):
    """The file system refused an operation; ``errno`` is kept so ``except OSError`` works."""

    def __init__(self, message: str, *, errno: int | None = None, **fields: Any) -> None:
        CkptStoreError.__init__(self, message, **fields)
        self.errno = errno
        self.strerror = message

    def _extra(self) -> dict[str, Any]:
        return {"errno": self.errno}

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
