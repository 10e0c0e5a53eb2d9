"""CutInfo: what callers see of a committed cut."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .manifest import Manifest


@dataclass(frozen=True)
class CutInfo:
    """A committed cut. ``nbytes`` counts the stored bytes of its shard files."""

    id: str
    step: int
    tags: tuple[str, ...]
    created_at: datetime
    nbytes: int
    final: bool
    files: int
    tensors: int
    metadata: dict[str, Any]

    @classmethod
    def from_manifest(cls, m: Manifest) -> "CutInfo":
        return cls(
            id=m.cut, step=m.step, tags=tuple(m.tags), created_at=datetime.fromisoformat(m.created_at),
            nbytes=m.nbytes, final=m.final, files=len(m.files), tensors=len(m.tensors),
            metadata=dict(m.metadata),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "step": self.step, "tags": list(self.tags), "created_at": self.created_at.isoformat(),
            "nbytes": self.nbytes, "final": self.final, "files": self.files, "tensors": self.tensors,
        }
