"""What a cut records of an attached file, and the rules its stored path obeys (issue 13; split out of
attached.py for issue 20): :class:`AttachedFile`, :func:`check_path`, :func:`check_listing`. Pure: both
the capture side (:mod:`.capture`) and the restore side (:mod:`.restore`) build on it, and a manifest
parses its ``attached`` list with it."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Iterable, Mapping, Sequence, Union

from pydantic import AfterValidator, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from ..models import StrictModel

#: The prefix of the array names that hold attached files.
FILES_PREFIX = "~files/"
#: Longest stored path, in bytes (UTF-8); each component at most NAME_MAX.
MAX_PATH_BYTES = 4000  # its array name (``~files/`` + path) stays within a manifest's 4096
NAME_MAX = 255
#: Most files one cut may carry (each is a manifest record and an array).
MAX_FILES = 100_000
#: The mode bits a cut keeps of a file: read, write and execute for owner, group and others. Setuid,
#: setgid and sticky are dropped at capture and refused on parse (issue 19 item 8): a restore must never
#: make a set-id program out of a checkpoint, which may come from another user or machine.
MODE_BITS = 0o777

#: What ``files=`` takes: a path, several, or {stored path: source path}.
FilesArg = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], Mapping[str, Union[str, "os.PathLike[str]"]]]


_CONTROL_OR_BACKSLASH = re.compile(r"[\x00-\x1f\x7f\\]")


def check_path(p: str) -> str:
    """``p`` when it is a relative POSIX path of plain components; ValueError otherwise."""
    if not isinstance(p, str) or not p:
        raise ValueError("an attached file's path must be a non-empty string")
    if len(p.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"attached path {p[:60]!r}... is longer than {MAX_PATH_BYTES} bytes")
    if _CONTROL_OR_BACKSLASH.search(p):
        raise ValueError(f"attached path {p!r} holds a control character or a backslash")
    for part in p.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"attached path {p!r} is not a relative path of plain names")
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise ValueError(f"attached path {p!r} has a component longer than {NAME_MAX} bytes")
    return p


AttachedPath = Annotated[str, AfterValidator(check_path)]


class AttachedFile(StrictModel):
    """A file of a cut: its bytes are the ``uint8`` array :func:`array_name` of rank ``rank``."""

    path: AttachedPath
    rank: int = Field(default=0, ge=0)
    nbytes: int = Field(ge=0)
    #: The file's permission bits at the cut (``MODE_BITS`` of them), restored exactly; None in cuts
    #: saved before modes were kept (issue 19 item 8), whose restore keeps a replaced file's own mode.
    mode: int | None = None

    @field_validator("mode")
    @classmethod
    def _permission_bits(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MODE_BITS:
            raise ValueError(f"attached file mode {v:#o} is not permission bits (0o0 to {MODE_BITS:#o}; "
                             "setuid, setgid and sticky are never kept)")
        return v

    @model_serializer(mode="wrap")
    def _without_unknown_mode(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        doc = handler(self)
        if doc.get("mode", 0) is None:  # a record of an older cut: written back as it was read
            del doc["mode"]
        return doc

    @property
    def array(self) -> str:
        return array_name(self.path)


def array_name(path: str) -> str:
    return FILES_PREFIX + path


def check_listing(files: Iterable[tuple[int, str]]) -> None:
    """ValueError unless the (rank, path) pairs are unique and no path is also another's directory of
    the same rank (``a`` and ``a/b``: a restore could not write both)."""
    seen: set[tuple[int, str]] = set()
    dirs: set[tuple[int, str]] = set()
    for rank, path in files:
        key = (rank, path)
        if key in seen:
            raise ValueError(f"attached path {path!r} is listed twice" + (f" for rank {rank}" if rank else ""))
        seen.add(key)
        parts = path.split("/")
        for i in range(1, len(parts)):
            dirs.add((rank, "/".join(parts[:i])))
    clash = sorted(p for r, p in seen & dirs)
    if clash:
        raise ValueError(f"attached path {clash[0]!r} is both a file and a directory")


__all__ = ["AttachedFile", "AttachedPath", "FILES_PREFIX", "FilesArg", "MAX_FILES", "MAX_PATH_BYTES", "MODE_BITS",
           "NAME_MAX", "array_name", "check_listing", "check_path"]
