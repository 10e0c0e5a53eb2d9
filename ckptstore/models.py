"""Shared base for every model parsed from bytes: strict, frozen, versioned, no extra fields."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from . import layout
from .errors import ManifestError


def _cut_id(v: str) -> str:
    if not layout.is_cut_id(v):
        raise ValueError(f"refusing cut name {v!r}: not of the form step-<12 digits>-<8 hex>")
    return v


def _file_name(v: str) -> str:
    if not layout.is_plain_file_name(v):
        raise ValueError(f"refusing file name {v!r}: not a plain shard name")
    return v


#: A cut id read from bytes: hostile names (``..``, ``/``, odd characters) are refused on parse.
CutId = Annotated[str, AfterValidator(_cut_id)]
#: A file name inside a cut directory, likewise.
FileName = Annotated[str, AfterValidator(_file_name)]

M = TypeVar("M", bound="StrictModel")


class StrictModel(BaseModel):
    """Frozen, ``extra="forbid"``, strict types. Subclasses set ``KIND`` and carry ``format_version``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    KIND: ClassVar[str] = ""
    #: The format_version this ckptstore writes, and every version ``from_bytes`` accepts.
    FORMAT_VERSION: ClassVar[int] = 1
    READ_VERSIONS: ClassVar[tuple[int, ...]] = (1,)

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=False) + "\n").encode()

    @classmethod
    def from_bytes(cls: type[M], data: bytes, **where: Any) -> M:
        """Parses and validates; every failure is a ManifestError naming the store, cut and file.

        Well-formed input takes pydantic's own JSON parser (in Rust: a manifest of 40,000 tensors
        parses and validates in about half the time of json.loads + model_validate); anything it
        refuses is parsed again below, only to say precisely what is wrong."""
        what = cls.KIND
        try:
            fast = cls.model_validate_json(data)
        except (ValidationError, ValueError, RecursionError):
            pass
        else:
            if fast.KIND == cls.KIND and getattr(fast, "format_version", None) in cls.READ_VERSIONS:
                return fast
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestError(f"{what} is not valid JSON: {exc}", **where) from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{what} is not a JSON object", **where)
        if doc.get("kind") != cls.KIND:
            raise ManifestError(f"expected kind {cls.KIND!r}, found {doc.get('kind')!r}", **where)
        version = doc.get("format_version")
        if type(version) is not int or version not in cls.READ_VERSIONS:
            readable = ", ".join(str(v) for v in cls.READ_VERSIONS)
            raise ManifestError(
                f"{what} format_version {version!r} is not supported "
                f"(this ckptstore reads version {readable}); upgrade ckptstore",
                **where,
            )
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise ManifestError(f"{what} field {loc!r}: {first['msg']}", **where) from None
