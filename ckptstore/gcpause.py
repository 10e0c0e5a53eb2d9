"""Pausing Python's cyclic garbage collector over bulk work that allocates many small objects.

Parsing or building the manifest and shard headers of a state with tens of thousands of tensors makes
hundreds of thousands of dicts and lists; each 700 allocations the collector runs, and its older
generations grow with the very objects being built, so the work turns roughly quadratic. Measured here
for 40,000 tensors: json.loads of a shard header 0.56 s with the collector, 0.11 s without; a manifest's
validation 1.03 s vs 0.48 s. Safetensors and DCP's C++/Rust parsers never pay this. Nothing made under
the pause is cyclic garbage, and the collector runs as usual afterwards.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disables the cyclic collector for the block; re-enables it only if this call disabled it, so
    nested pauses (and a caller that disabled it on purpose) keep working."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def pausing(fn: F) -> F:
    """Decorator form of :func:`gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
