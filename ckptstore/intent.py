"""What a cut commits besides its files, and how its shards are encoded: one record each (issue 20).

:class:`CutIntent` is the one shape of a commit's intent, from every driver to the manifest: ``save``
builds one, the writer's pipeline builds one at capture and sends it to its writer process inside the
wire ``Finish`` (a subclass, so a rescuer commits exactly what the commit thread would have), the rescue
and the DCP writer commit one. Its part fields (``tree``, ``pickled``, ``attached``) describe one rank's
part (``publish``); its cut fields (``tags``, ``final``, ``metadata``, ``mode``, ``world_size``) the
commit. Before it the same eight values travelled as an ``extra`` dict, ``Finish``'s fields, ``commit``
and ``publish`` keywords and 16 rescue parameters.

:class:`ShardSpec` is a store's shard settings (codec, level, shard size) as the pending cut and its
rank parts carry them, and as a write request carries them to the writer process: derived once from
:class:`~ckptstore.options.StoreOptions` instead of being passed by hand at every write.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .attached import AttachedFile
from .errors import UsageError
from .options import StoreOptions
from .shards import Codec


class ShardSpec(BaseModel):
    """How a cut's shards are written: ``codec`` ("none" or "zstd") at ``zstd_level``, files of at
    most ``max_shard_bytes`` (an array larger than that gets a file of its own)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    codec: Literal["none", "zstd"] = "none"
    zstd_level: int = 1
    max_shard_bytes: int = Field(default=1 << 30, ge=1)

    @classmethod
    def of(cls, options: StoreOptions) -> "ShardSpec":
        """The settings of a store opened with ``options`` (the one place they are read)."""
        return cls(codec="zstd" if options.compression == "zstd" else "none", zstd_level=options.zstd_level,
                   max_shard_bytes=options.max_shard_bytes)

    def make_codec(self) -> Codec:
        return Codec("zstd", self.zstd_level) if self.codec == "zstd" else Codec()


class CutIntent(BaseModel):
    """A cut's commit intent. ``tree`` is None where the cut takes its trees from its collected rank
    records (a cut of several ranks); ``mode`` is the writer mode the manifest records ("sync",
    "thread", "process", "dcp", "rescue:..."). Lax types, so a tuple of tags is a list of them; frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tree: dict[str, Any] | None = None
    pickled: bool = False
    attached: list[AttachedFile] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    final: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)
    mode: str = "sync"
    world_size: int = Field(default=1, ge=1)

    @field_validator("metadata", mode="before")
    @classmethod
    def _no_metadata(cls, v: Any) -> Any:
        return {} if v is None else v  # ``save(metadata=None)`` means none

    @classmethod
    def given(cls, intent: "CutIntent | None", fields: dict[str, Any], *, what: str) -> "CutIntent":
        """``intent``, or one built from keyword ``fields`` (``commit(tags=...)`` spells the same record
        by its fields); both at once is a usage error."""
        if intent is not None and fields:
            raise UsageError(f"{what} takes an intent or its fields, not both (got {sorted(fields)})")
        if intent is not None:
            return intent
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise UsageError(f"{what}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None

    def as_recorded(self, mode: str) -> "CutIntent":
        """The same intent recorded under another writer mode (a rescuer's "rescue:<mode>")."""
        return self.model_copy(update={"mode": mode})


__all__ = ["CutIntent", "ShardSpec"]
