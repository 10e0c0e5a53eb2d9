"""CutInfo: what callers see of a committed cut."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .manifest import Manifest


@dataclass(frozen=True)
class CutInfo:
    """A committed cut. ``nbytes`` counts the stored bytes of its shard files (of every rank);
    ``world_size`` is the number of ranks whose state it holds (``load(..., rank=r)``)."""

    id: str
    step: int
    tags: tuple[str, ...]
    created_at: datetime
    nbytes: int
    final: bool
    files: int
    tensors: int
    metadata: dict[str, Any]
    world_size: int = 1

    @classmethod
    def from_manifest(cls, m: Manifest, *, marked_final: bool = False) -> "CutInfo":
        """``marked_final``: the cut has a final mark (``Store.mark_final``), so it is final even if its
        manifest says otherwise."""
        return cls(
            id=m.cut, step=m.step, tags=tuple(m.tags), created_at=datetime.fromisoformat(m.created_at),
            nbytes=m.nbytes, final=m.final or marked_final, files=m.file_count, tensors=m.array_count,
            metadata=dict(m.metadata), world_size=m.world_size,
        )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CutInfo":
        """The inverse of :meth:`to_json` (how rank 0 tells the other ranks what it committed)."""
        return cls(id=d["id"], step=d["step"], tags=tuple(d["tags"]), created_at=datetime.fromisoformat(d["created_at"]),
                   nbytes=d["nbytes"], final=d["final"], files=d["files"], tensors=d["tensors"],
                   metadata=dict(d.get("metadata", {})), world_size=d.get("world_size", 1))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "step": self.step, "tags": list(self.tags), "created_at": self.created_at.isoformat(),
            "nbytes": self.nbytes, "final": self.final, "files": self.files, "tensors": self.tensors,
            "world_size": self.world_size,
        }
