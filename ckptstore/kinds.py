"""The base of ckptstore's kind enums: finding, leftover, LATEST-problem, phase and writer-mode kinds.

Kinds used to be bare strings, some read back out of error messages and some matched by prefix (issue
20). A kind is now an enum member that is also a ``str``: ``==`` against its old spelling holds, it hashes
as that spelling (so it finds and is found in sets and dicts of plain strings), and ``json.dumps``,
``str()`` and f-strings write the spelling, so every JSON output stays byte-identical. ``enum.StrEnum``
arrived in Python 3.11 and ckptstore supports 3.10: :class:`StrKind` is the same idea, one class on
every version, so what the tests run is what every user gets.
"""

from __future__ import annotations

from enum import Enum


class StrKind(str, Enum):
    """A ``str`` enum whose ``str()`` and ``format()`` are its value (``enum.StrEnum``'s behaviour)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def spellings(cls) -> tuple[str, ...]:
        """Every member's spelling, in definition order (for messages and completeness tests)."""
        return tuple(str(m.value) for m in cls)


__all__ = ["StrKind"]
