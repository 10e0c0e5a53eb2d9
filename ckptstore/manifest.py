"""The manifest of a cut: every file and tensor with its blake3, the step, tags and who wrote it.

``MANIFEST.json`` is written last when a cut is saved and deleted first when it is pruned, so a manifest
never names data that is gone. Several ranks' shards fit in one manifest (``FileRecord.rank``); the
writer of rank 0 (the coordinator) publishes it once every rank's files are durable.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from . import layout
from .format import ST_ITEMSIZE, TORCH_DTYPES
from .models import CutId, FileName, StrictModel

_HEX64 = r"^[0-9a-f]{64}$"


class WriterIdentity(StrictModel):
    host: str
    pid: int
    ckptstore_version: str
    mode: str = "sync"


class FileRecord(StrictModel):
    """One shard file. ``nbytes``/``blake3`` describe the bytes stored; ``raw_*`` the safetensors bytes
    before compression (equal to the stored ones when ``codec`` is "none")."""

    name: FileName
    rank: int = Field(ge=0)
    codec: Literal["none", "zstd"]
    nbytes: int = Field(ge=0)
    blake3: str = Field(pattern=_HEX64)
    raw_nbytes: int = Field(ge=0)
    raw_blake3: str = Field(pattern=_HEX64)


class TensorRecord(StrictModel):
    """One array: where its raw bytes are (shard ``file`` and ``offset`` in its data section), what
    they are, and their blake3."""

    name: str = Field(min_length=1, max_length=4096)
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: list[int]
    nbytes: int = Field(ge=0)
    file: FileName
    offset: int = Field(ge=0)
    blake3: str = Field(pattern=_HEX64)

    @model_validator(mode="after")
    def _consistent(self) -> "TensorRecord":
        if any(d < 0 for d in self.shape) or len(self.shape) > 64:
            raise ValueError("shape must be at most 64 non-negative sizes")
        if self.kind == "torch":
            if self.dtype not in TORCH_DTYPES:
                raise ValueError(f"unknown torch dtype {self.dtype!r}")
            itemsize = TORCH_DTYPES[self.dtype][1]
        else:
            itemsize = _numpy_itemsize(self.dtype)
        if math.prod(self.shape) * itemsize != self.nbytes:
            raise ValueError(f"{self.dtype}{self.shape} needs {math.prod(self.shape) * itemsize} bytes, not {self.nbytes}")
        return self


def _numpy_itemsize(dtype: str) -> int:
    import re

    m = re.fullmatch(r"[<>|=]([biufcmM])(\d{1,2})(\[[a-zA-Z]+\])?", dtype)
    if m is None:
        raise ValueError(f"unsupported numpy dtype {dtype!r}")
    return int(m.group(2))


class Manifest(StrictModel):
    KIND = "ckptstore.manifest"

    kind: Literal["ckptstore.manifest"] = "ckptstore.manifest"
    format_version: Literal[1] = 1
    cut: CutId
    step: int = Field(ge=0, le=layout.MAX_STEP)
    tags: list[str] = Field(default_factory=list)
    final: bool = False
    created_at: str
    writer: WriterIdentity
    world_size: int = Field(default=1, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    files: list[FileRecord]
    tensors: list[TensorRecord]
    tree: dict[str, Any]
    pickled: bool = False

    @field_validator("created_at")
    @classmethod
    def _iso(cls, v: str) -> str:
        datetime.fromisoformat(v)
        return v

    @model_validator(mode="after")
    def _references(self) -> "Manifest":
        if layout.step_of_cut_id(self.cut) != self.step:
            raise ValueError(f"cut id {self.cut} does not match step {self.step}")
        files = {f.name: f for f in self.files}
        if len(files) != len(self.files):
            raise ValueError("duplicate file names")
        names = set()
        for t in self.tensors:
            if t.file not in files:
                raise ValueError(f"tensor {t.name!r} names unknown file {t.file!r}")
            if t.name in names:
                raise ValueError(f"duplicate tensor name {t.name!r}")
            names.add(t.name)
            if t.offset + t.nbytes > files[t.file].raw_nbytes:
                raise ValueError(f"tensor {t.name!r} lies past the end of {t.file!r}")
        return self

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def tensor_index(self) -> dict[str, TensorRecord]:
        return {t.name: t for t in self.tensors}


__all__ = ["Manifest", "FileRecord", "TensorRecord", "WriterIdentity", "ST_ITEMSIZE"]
