"""Frozen options of a Checkpointer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from ckptstore.errors import UsageError
from ckptstore.spi import StrKind
from ckptstore.spi import Policy

#: An argument not passed (``None`` is a value ``keep`` takes).
UNSET: Any = object()

Busy = Literal["skip", "wait"]


class WriterMode(StrKind):
    """Who writes a background cut's shards (``WriterOptions.mode``). A cut's manifest records it as
    its writer's mode, spelled as before; ``Store.save`` records "sync" there and DCP "dcp", which are
    not writer modes (issue 20: ``mode`` meant three things, as strings)."""

    PROCESS = "process"  # a persistent niced writer subprocess
    THREAD = "thread"  # a thread of the trainer
    INLINE = "inline"  # the call itself writes and commits


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How a :class:`~ckptstore.writer.Checkpointer` takes cuts. How shards are encoded (compression,
    shard size) is the store's business: ``StoreOptions``, never here.

    ``mode``: "process" (default: a persistent niced writer subprocess), "thread" (a thread of the
    trainer writes; for comparison) or "inline" (the call writes and commits; for debugging). All three
    write byte-identical shards. ``busy``: what a due periodic cut does while the previous one is still
    being written or committed: "skip" (default) or "wait". ``nice``: the writer process's nice level;
    ``idle_io`` puts it in the idle I/O class; ``cpu_affinity`` pins it to those CPUs. ``write_threads``:
    threads the writer process hashes with (blake3 ``max_threads``; default 1, so a background cut
    occupies at most one core besides its I/O thread, which mostly waits on the disk).
    ``write_timeout``: seconds without progress after which a writer counts as hung (then it is killed
    and the trainer writes the cut itself). ``events_path`` appends one JSON line per event.
    ``preemption``: SIGTERM and SIGUSR1 only raise a flag, and the next ``maybe_cut`` takes a cut of its
    step, waits for its commit and sets ``Checkpointer.preempted`` (docs/writer.md, "Preemption").
    With a mirror (``Checkpointer(..., mirror=URL)``, issue 21): ``mirror_keep`` prunes the mirror (None:
    keeps every cut there); ``mirror_timeout`` bounds the waits of ``cut(final=True)`` and ``close()`` for
    the mirror; ``mirror_retry_s`` is the first wait after a failed upload (doubling, up to 30 s).
    """

    every: int = 1
    keep: Policy | None = None
    mode: WriterMode = WriterMode.PROCESS
    busy: Busy = "skip"
    nice: int = 10
    idle_io: bool = False
    cpu_affinity: tuple[int, ...] | None = None
    write_threads: int = 1
    write_timeout: float = 600.0
    handshake_timeout: float = 60.0
    on_event: Callable[[dict[str, Any]], None] | None = None
    events_path: str | None = None
    device_copy: bool = True
    preemption: bool = False
    mirror_keep: Policy | None = None
    mirror_timeout: float = 600.0
    mirror_retry_s: float = 1.0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("every must be >= 1")
        try:  # a spelling ("thread") becomes the member, so every reader compares members
            object.__setattr__(self, "mode", WriterMode(self.mode))
        except (ValueError, TypeError):
            raise ValueError(f"mode must be 'process', 'thread' or 'inline', got {self.mode!r}") from None
        if self.busy not in ("skip", "wait"):
            raise ValueError(f"busy must be 'skip' or 'wait', got {self.busy!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError("nice must be in [0, 19]")
        if self.write_timeout <= 0 or self.handshake_timeout <= 0 or self.mirror_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.mirror_retry_s <= 0:
            raise ValueError("mirror_retry_s must be positive")


def resolve_options(options: WriterOptions | None, **given: Any) -> WriterOptions:
    """The Checkpointer's ``options``, or the WriterOptions its keywords make (those not ``UNSET``).
    Both at once is a UsageError naming the keywords: ``options`` silently won before, so ``every``,
    ``keep``, ``mode`` and ``busy`` were ignored (issue 20)."""
    given = {k: v for k, v in given.items() if v is not UNSET}
    if options is None:
        try:
            return WriterOptions(**given)
        except (TypeError, ValueError) as exc:  # an unknown keyword, a value out of range
            raise UsageError(f"Checkpointer: {exc}") from None
    if given:
        raise UsageError(f"Checkpointer takes options= or its keywords, not both: {sorted(given)} would be "
                         "ignored", hint="put them in the WriterOptions: dataclasses.replace(options, ...)")
    return options
