"""File surgery shared by the corruption tests: damage a stored file the way a disk or a person would."""

from __future__ import annotations


def flip_byte(path: str, offset: int) -> None:
    """Inverts every bit of the byte at ``offset`` (negative: from the end) in place."""
    with open(path, "r+b") as f:
        f.seek(offset, 0 if offset >= 0 else 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
