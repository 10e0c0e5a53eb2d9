"""Giving the C heap's free memory back to the system between the phases of a cut (issue 23).

A cut of many small arrays makes and frees buffers of several MB (request and answer frames, header and
manifest text). glibc serves the first such buffer by mmap, but freeing it raises its mmap threshold
(up to 32 MB), so later ones come from the heap, and freed there they stay resident: small objects that
live on sit above them, so the heap cannot shrink from its top. In process mode that left 66 MB free
inside glibc's heaps after the first cut of 100,000 arrays, on top of the trainer's peak.
``malloc_trim(0)`` returns the free pages of every heap (madvise), whatever lies above them; it costs
a few milliseconds and runs without the GIL (a ctypes call). Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Callable

_trim: Callable[[int], Any] | None = None
try:  # glibc only
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = getattr(_libc, "malloc_trim", None)
    if _trim is not None:
        _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except OSError:
    _trim = None


def give_back() -> bool:
    """Returns the C heap's free memory to the system; whether this C library can (glibc)."""
    if _trim is None:
        return False
    _trim(0)
    return True
