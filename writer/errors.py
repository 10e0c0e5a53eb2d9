"""Errors of the writer, in the one ckptstore exception tree (see ckptstore.errors).

    CkptStoreError
    +-- WriterError                 a background cut failed
        +-- WriterDied              the writer process exited (signal or code)
        +-- WriterTimeout           the writer made no progress within write_timeout
        +-- ShmTooSmall (also MemoryError)   /dev/shm cannot hold the state
        +-- IllegalTransition       a cut's state machine was driven wrongly (a bug, never data loss)

Each class is registered under its wire key (``ckptstore.errors.WIRE``, issue 20).
"""

from __future__ import annotations

from typing import Any

from ckptstore.errors import CkptStoreError


class WriterError(CkptStoreError, wire="writer-error"):
    """A background cut failed; ``step`` says which."""

    wire_fields = ("step",)

    def __init__(self, message: str, *, step: int | None = None, **fields: Any) -> None:
        self.step = step
        super().__init__(message, **fields)


class WriterDied(WriterError, wire="writer-died"):
    """The writer process exited while it held a cut."""


class WriterTimeout(WriterError, wire="writer-timeout"):
    """The writer process made no progress within ``write_timeout``."""


class ShmTooSmall(WriterError, MemoryError, wire="shm-too-small"):
    """Shared memory cannot hold the state."""


class IllegalTransition(WriterError, wire="illegal-transition"):
    """A cut's state machine was asked to make a transition it does not allow."""
