"""Typed results of bench_writer's child processes. They travel to the parent as JSON (``dataclasses.asdict``
out, ``from_dict`` in); the parent reads them without torch."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from benchstate import med

GIB = float(1 << 30)


class _FromDict:
    """``from_dict``: the dataclass from its asdict() form; keys it does not declare are ignored."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]):  # noqa: ANN206
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class CutSample(_FromDict):
    """One steady-state cut of the core child."""

    rep: int
    floor_s: float  # the memcpy floor, right before this cut
    stall_s: float  # maybe_cut's wall time
    stall_event_s: float | None  # its ``captured`` event's stall_s
    e2e_s: float  # maybe_cut start until handle.wait() returns
    persist_s: float  # maybe_cut return (end of the capture) until handle.wait() returns
    written_bytes: int  # the ``written`` event's bytes (shard files)
    writer_user_s: float | None  # the writer process's CPU over the cut (None: no writer pid, or it changed)
    writer_sys_s: float | None
    written: dict[str, float] = field(default_factory=dict)  # the ``written`` event's timings
    commit_s: float | None = None

    @property
    def writer_cpu_s_per_gib(self) -> float | None:
        if self.writer_user_s is None or self.writer_sys_s is None:
            return None
        return (self.writer_user_s + self.writer_sys_s) / (self.written_bytes / GIB)


@dataclass
class CoreRep(_FromDict):
    """The per-repetition floors and the torch.save baseline of the core child."""

    rep: int
    image_bytes: int  # bytes the blake3 and disk floors process (the state in 4 KiB-aligned slots)
    blake3_wall_s: float  # bare blake3, 1 thread, over the image
    blake3_cpu_s: float
    disk_s: float | None  # the disk floor: O_DIRECT write + fsync of the image (None: O_DIRECT refused)
    torch_save_s: float
    torch_parts: dict[str, float]


@dataclass
class CoreResult(_FromDict):
    nbytes: int
    ntensors: int
    threads: int
    warmup_cut_s: float
    block_bytes: int | None
    writer_nice: int | None
    writer_has_torch: Any
    cuts: list[CutSample]
    reps: list[CoreRep]
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CoreResult":
        r = super().from_dict(d)
        r.cuts = [CutSample.from_dict(c) for c in d["cuts"]]
        r.reps = [CoreRep.from_dict(c) for c in d["reps"]]
        return r

    def per_rep(self, get: Any) -> list[float]:
        """The median over each repetition's cuts of ``get(cut)`` (Nones dropped), one value per repetition."""
        out = []
        for k in sorted({c.rep for c in self.cuts}):
            xs = [get(c) for c in self.cuts if c.rep == k]
            xs = [x for x in xs if x is not None]
            if xs:
                out.append(med(xs))
        return out


@dataclass
class LoopRep(_FromDict):
    """One repetition of a section-4 variant."""

    idle_med: float
    pre_med: float
    post_med: float
    idle_p90_over_med: float
    blocked: float
    done_s: float | None
    n_inflight: int
    ratio_med: float | None
    ratio_p90: float | None
    lost: float
    foreign_cores: float
    written: dict[str, float] | None = None
    writer_cpu_s: float | None = None  # the writer process's user + system CPU over this save
    written_bytes: int | None = None
