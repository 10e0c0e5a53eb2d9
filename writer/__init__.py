"""ckptstore.writer: background cuts through one shared-memory block and a persistent writer process.

Depends on the store (``ckptstore``); the store never imports this package.
"""

from __future__ import annotations

from .checkpointer import Checkpointer
from .handle import CutHandle
from .mirror import MirrorTimeout
from .errors import IllegalTransition, ShmTooSmall, WriterDied, WriterError, WriterTimeout
from .options import WriterOptions

__all__ = [
    "Checkpointer",
    "CutHandle",
    "WriterOptions",
    "WriterError",
    "WriterDied",
    "WriterTimeout",
    "ShmTooSmall",
    "IllegalTransition",
    "MirrorTimeout",
]
