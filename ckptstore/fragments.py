"""The commit record of a cut of several ranks (manifest format version 5, issue 22): one entry per rank.

Each rank's part (its files, arrays, tree and attached files) is a manifest fragment of its own, the
rank's record ``cuts/<cut>/rank<r>.json``, written durably by the rank once its shards are durable.
The rank tells the coordinator the fragment's size and blake3 (the ``written`` post of the commit
exchange), so the coordinator commits without reading any fragment: the cut's ``MANIFEST.json`` lists
the world size, step, tags and each fragment's :class:`PartRef`, O(ranks) bytes whatever the tensors.
A reader reads the commit record and the fragment(s) it needs, each checked against its digest before
it is parsed (:mod:`ckptstore.assemble`).

In the manifest the references are one table (``parts``), a list per field, one entry per rank in
rank order, the digests as one base64 string of 32 bytes per rank: about 100 bytes a rank.
"""

from __future__ import annotations

import base64
import functools
import operator
import re
from typing import Annotated, Any, NamedTuple

from pydantic import PlainSerializer, PlainValidator

from . import layout

#: Per rank: the fragment's name, its bytes and blake3 (hex), the stored bytes of the rank's files, how
#: many files and arrays (attached files' included) and attached files it lists, and whether its tree
#: holds a pickled value. Counts let a listing describe the cut without reading a fragment.
PART_FIELDS = ("name", "nbytes", "blake3", "data_nbytes", "files", "arrays", "attached", "pickled")
PART_KEYS = frozenset(PART_FIELDS)
#: A fragment larger than this is refused before it is read (a hostile commit record).
MAX_FRAGMENT_BYTES = 1 << 30


class PartRef(NamedTuple):
    """What the commit record knows of one rank's fragment."""

    name: str
    nbytes: int
    blake3: str
    data_nbytes: int
    files: int
    arrays: int
    attached: int
    pickled: bool

    def to_json(self) -> dict[str, Any]:
        """The reference as a rank posts it to the coordinator."""
        return dict(zip(PART_FIELDS, self))

    @classmethod
    def from_json(cls, value: Any, rank: int) -> "PartRef":
        """A reference a rank posted (checked as strictly as a commit record's entry)."""
        if type(value) is not dict or value.keys() != PART_KEYS:
            raise ValueError(f"rank {rank}'s part reference must have exactly the keys {sorted(PART_KEYS)}")
        return check_part(cls(*(value[k] for k in PART_FIELDS)), rank)


class BadPart(ValueError):
    """A reference that is not a sane one of rank ``rank``'s fragment."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**62


def check_part(ref: PartRef, rank: int) -> PartRef:
    """ValueError unless ``ref`` is a sane reference to rank ``rank``'s fragment: its name is the
    rank's record name (a commit record names nothing else: no path leaves the cut's directory), sizes
    and counts are non-negative ints, the digest 64 lowercase hex digits."""
    if ref.name != layout.rank_record_name(rank):
        raise BadPart(rank, f"rank {rank}'s fragment must be named {layout.rank_record_name(rank)!r}, "
                         f"not {str(ref.name)[:200]!r}")
    if not all(map(_count, (ref.nbytes, ref.data_nbytes, ref.files, ref.arrays, ref.attached))):
        raise BadPart(rank, f"rank {rank}'s part: sizes and counts must be non-negative integers")
    if ref.nbytes > MAX_FRAGMENT_BYTES:
        raise BadPart(rank, f"rank {rank}'s fragment of {ref.nbytes} bytes is over the {MAX_FRAGMENT_BYTES} allowed")
    if ref.attached > ref.arrays:
        raise BadPart(rank, f"rank {rank}'s part lists more attached files than arrays")
    if type(ref.blake3) is not str or len(ref.blake3) != 64 or ref.blake3.strip("0123456789abcdef"):
        raise BadPart(rank, f"rank {rank}'s fragment digest must be 64 lowercase hex digits")
    if type(ref.pickled) is not bool:
        raise BadPart(rank, f"rank {rank}'s part: pickled must be true or false")
    return ref


_HEX = re.compile(r"[0-9a-f]*")


@functools.lru_cache(maxsize=8)
def _names(n: int) -> tuple[str, ...]:
    """The fragments' names of a cut of ``n`` ranks, in rank order."""
    return tuple(layout.rank_record_name(r) for r in range(n))


def check_parts(refs: list[PartRef]) -> list[PartRef]:
    """:func:`check_part` of every reference (rank = its index), in bulk: one C-level pass a column
    (issue 22: a Python check an entry cost 9 us, 37 ms of a commit of 4,096 ranks); the first bad
    entry is named by ``check_part`` when a column fails."""
    if not refs:
        return refs
    names, nbytes, digests, data, files, arrays, attached, pickled = zip(*refs)
    counts = (*nbytes, *data, *files, *arrays, *attached)
    ok = (names == _names(len(refs))
          and set(map(type, counts)) == {int} and min(counts) >= 0 and max(counts) < 2**62
          and max(nbytes) <= MAX_FRAGMENT_BYTES and all(map(operator.le, attached, arrays))
          and set(map(type, digests)) == {str} and set(map(len, digests)) == {64}
          and _HEX.fullmatch("".join(digests)) is not None and set(map(type, pickled)) == {bool})
    if not ok:
        for r, ref in enumerate(refs):
            check_part(ref, r)
    return refs


def parts_from_json(values: list[Any]) -> list[PartRef]:
    """The references ranks posted (``PartRef.to_json``), by rank, checked; ValueError naming the rank
    of the first that is not one."""
    keys = [type(v) is dict and v.keys() == PART_KEYS for v in values]
    if not all(keys):
        r = keys.index(False)
        raise BadPart(r, f"rank {r}'s part reference must have exactly the keys {sorted(PART_KEYS)}")
    get = operator.itemgetter(*PART_FIELDS)
    return check_parts([PartRef(*get(v)) for v in values])


def parts_to_table(parts: list[PartRef]) -> dict[str, Any]:
    """The commit record's ``parts`` table (module docstring)."""
    cols: dict[str, Any] = dict(zip(PART_FIELDS, map(list, zip(*parts)))) if parts else {k: [] for k in PART_FIELDS}
    cols["blake3"] = base64.b64encode(bytes.fromhex("".join(cols["blake3"]))).decode("ascii")
    return cols


def table_to_parts(table: Any) -> list[PartRef]:
    """The references of a ``parts`` table, checked: exactly its keys, columns of one length, canonical
    base64 of 32 bytes a rank, every entry as :func:`check_part` wants it."""
    if type(table) is not dict or table.keys() != PART_KEYS:
        got = sorted(table) if type(table) is dict else type(table).__name__
        raise ValueError(f"parts must be a table with exactly the keys {sorted(PART_KEYS)}, not {got}")
    digests = table["blake3"]
    cols = [table[k] for k in PART_FIELDS if k != "blake3"]
    if not all(type(c) is list for c in cols) or type(digests) is not str:
        raise ValueError("parts: every column must be a list, blake3 a string")
    n = len(cols[0])
    if any(len(c) != n for c in cols):
        raise ValueError(f"parts: every column must have one entry per rank ({n})")
    try:
        raw = base64.b64decode(digests, validate=True)
    except (ValueError, TypeError):
        raise ValueError("parts.blake3 is not base64") from None
    if len(raw) != 32 * n or base64.b64encode(raw).decode("ascii") != digests:
        raise ValueError(f"parts.blake3 must be the canonical base64 of {n} digests of 32 bytes")
    hexed = raw.hex()
    by_field = dict(zip([k for k in PART_FIELDS if k != "blake3"], cols))
    split = [hexed[64 * r:64 * r + 64] for r in range(n)]
    return _Checked(check_parts(list(map(PartRef, by_field["name"], by_field["nbytes"], split, by_field["data_nbytes"],
                                         by_field["files"], by_field["arrays"], by_field["attached"],
                                         by_field["pickled"]))))


class _Checked(list):  # type: ignore[type-arg]
    """References ``table_to_parts`` or ``check_parts`` checked whole: the field validator takes them as
    they are (only this module makes one; parsed JSON never is one)."""


def _parts_validator(value: Any) -> list[PartRef]:
    if type(value) is _Checked:
        return list(value)
    if type(value) is list and all(type(p) is PartRef for p in value):
        return check_parts(value)  # built in this process
    return table_to_parts(value)


def checked(refs: list[PartRef]) -> list[PartRef]:
    """``refs`` checked (``check_parts``), marked so that a manifest built of them takes them as they are."""
    return _Checked(check_parts(list(refs)))


#: A pydantic field of part references, stored as the table.
PartTable = Annotated[list[PartRef], PlainValidator(_parts_validator),
                      PlainSerializer(parts_to_table, return_type=dict)]

__all__ = ["PartRef", "PartTable", "PART_FIELDS", "BadPart", "check_part", "check_parts", "checked", "parts_from_json", "parts_to_table", "table_to_parts"]
