"""Array records in bulk: a cut's tensors as ``TensorRecord`` tuples, parsed and checked as columns.

A manifest of 40,000 small tensors has 40,000 records. As pydantic models they cost about 15 us each to
validate and 6 us to construct, more than writing the tensor's 4 KB (issue 23). Here a record is a
named tuple (immutable, 1 us to make) and a list of them is validated by a few passes over its columns,
each a C-level loop: the same rules as before (strict types, no extra or missing field, sizes that agree,
hex digests), with one error naming the first bad record.

Two JSON forms carry the same records:

* rows (``TensorRows``), the manifest's form in format versions 1-3: a list of objects with exactly the
  fields of :class:`TensorRecord`;
* columns (``TensorColumns``), the writer protocol's form (docs/writer.md): one list per field, the
  digests as one string of 64 hex digits per record, the file names as an index into ``files``.

Both parse to the same ``list[TensorRecord]``; the cross-record rules (files exist, names are unique,
arrays lie inside their files) stay with the manifest (``manifest._check_arrays``).
"""

from __future__ import annotations

import base64
import functools
import itertools
import math
import operator
import re
from typing import Annotated, Any, NamedTuple

from pydantic import PlainSerializer, PlainValidator

from .format import TORCH_DTYPES, numpy_itemsize

MAX_NAME = 4096
MAX_DIMS = 64
FIELDS = ("name", "kind", "dtype", "shape", "nbytes", "file", "offset", "blake3")
_FIELD_SET = frozenset(FIELDS)
_HEX = re.compile(r"[0-9a-f]*")


class TensorRecord(NamedTuple):
    """One array: where its raw bytes are (shard ``file`` and ``offset`` in its data section), what
    they are, and their blake3 (hex). Immutable; build lists of them with :func:`rows_to_records` or
    :func:`columns_to_records` when they come from bytes, which check them."""

    name: str
    kind: str  # "torch" | "numpy"
    dtype: str
    shape: list[int]
    nbytes: int
    file: str
    offset: int
    blake3: str

    def row(self) -> dict[str, Any]:
        """The record's JSON object (the manifest's row form)."""
        return dict(zip(FIELDS, self))


_row_fields = operator.itemgetter(*FIELDS)
#: A record from a tuple of its eight fields, at C speed (the named tuple's own maker, public spelling).
make_record = functools.partial(tuple.__new__, TensorRecord)


def _itemsize(kind: str, dtype: str) -> int:
    if kind == "torch":
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown torch dtype {dtype!r}")
        return TORCH_DTYPES[dtype][1]
    return numpy_itemsize(dtype)


def _first_bad(records: list[TensorRecord], ok: Any, what: str) -> ValueError:
    """The error for the first record ``ok`` refuses (called once a bulk check failed)."""
    for i, r in enumerate(records):
        if not ok(r):
            name = r.name if type(r.name) is str else f"#{i}"
            return ValueError(f"tensor {name[:200]!r}: {what}")
    return ValueError(what)  # pragma: no cover - the bulk check and this loop test the same thing


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_shape(s: Any) -> bool:
    return type(s) is list and len(s) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in s)


# The bulk checks: each is a C-level pass (``map``, ``set``, ``min``) over one column, no Python call per
# value. ``type(v) is int`` semantics: a bool or a float never passes for an int.
def _all_type(values: Any, kind: type) -> bool:
    return set(map(type, values)) <= {kind}


def _all_counts(values: Any) -> bool:
    return _all_type(values, int) and (not values or min(values) >= 0)


def _all_shapes(shapes: Any) -> bool:
    if not _all_type(shapes, list) or (shapes and max(map(len, shapes)) > MAX_DIMS):
        return False
    dims = list(itertools.chain.from_iterable(shapes))
    return _all_counts(dims)


def _all_indexes(values: Any, n: int) -> bool:
    return _all_counts(values) and (not values or max(values) < n)


def _all_names(names: Any) -> bool:
    return _all_type(names, str) and (not names or (min(map(len, names)) > 0 and max(map(len, names)) <= MAX_NAME))


def check_records(records: list[TensorRecord], *, derived: bool = False) -> list[TensorRecord]:
    """Checks every field of every record, in bulk; returns ``records``. Raises ValueError naming the
    first bad record: strict types (an int is never a bool or a float), a name of 1-4096 characters, a
    kind and a dtype of that kind, a shape of at most 64 non-negative sizes, ``nbytes`` equal to the
    shape's elements times the itemsize, a non-negative offset, a 64-digit lowercase hex digest.
    ``derived``: the caller made shapes, sizes, dtypes and digests itself from checked columns (a
    version 4 table), so only names, files and offsets are left to check."""
    if not records:
        return records
    names, kinds, dtypes, shapes, nbytes, files, offsets, digests = zip(*records)
    if not _all_names(names):
        raise _first_bad(records, lambda r: type(r.name) is str and 0 < len(r.name) <= MAX_NAME,
                         f"name must be a string of 1 to {MAX_NAME} characters")
    if not _all_type(files, str):
        raise _first_bad(records, lambda r: type(r.file) is str, "file must be a string")
    if not _all_counts(offsets):
        raise _first_bad(records, lambda r: _is_count(r.offset), "offset must be a non-negative integer")
    if derived:
        return records
    if not _all_counts(nbytes):
        raise _first_bad(records, lambda r: _is_count(r.nbytes), "nbytes must be a non-negative integer")
    if not (_all_type(digests, str) and set(map(len, digests)) == {64}) or not _HEX.fullmatch("".join(digests)):
        raise _first_bad(records, lambda r: type(r.blake3) is str and len(r.blake3) == 64
                         and _HEX.fullmatch(r.blake3) is not None, "blake3 must be 64 lowercase hex digits")
    if not _all_shapes(shapes):
        raise _first_bad(records, lambda r: _is_shape(r.shape),
                         f"shape must be a list of at most {MAX_DIMS} non-negative sizes")
    itemsizes: dict[tuple[Any, Any], int] = {}
    for pair in set(zip(kinds, dtypes)):
        kind, dtype = pair
        if kind not in ("torch", "numpy") or type(dtype) is not str:
            raise _first_bad(records, lambda r: (r.kind, r.dtype) != pair,
                             f"kind must be 'torch' or 'numpy' and dtype a string, not {kind!r}, {dtype!r}")
        try:
            itemsizes[pair] = _itemsize(kind, dtype)
        except ValueError as exc:
            raise _first_bad(records, lambda r: (r.kind, r.dtype) != pair, str(exc)) from None
    prod = math.prod
    sizes = map(itemsizes.__getitem__, zip(kinds, dtypes))
    if list(map(operator.mul, map(prod, shapes), sizes)) != list(nbytes):
        def agrees(r: TensorRecord) -> bool:
            return prod(r.shape) * itemsizes[(r.kind, r.dtype)] == r.nbytes

        bad = next(r for r in records if not agrees(r))
        need = prod(bad.shape) * itemsizes[(bad.kind, bad.dtype)]
        raise ValueError(f"tensor {bad.name!r}: {bad.dtype}{bad.shape} needs {need} bytes, not {bad.nbytes}")
    return records


def rows_to_records(rows: Any) -> list[TensorRecord]:
    """The records of the row form (a list of objects with exactly the record's fields), checked."""
    if type(rows) is not list:
        raise ValueError("tensors must be a list of records")
    if not all(type(r) is dict and r.keys() == _FIELD_SET for r in rows):
        for i, r in enumerate(rows):
            if type(r) is not dict:
                raise ValueError(f"tensor record #{i} is not an object")
            if r.keys() != _FIELD_SET:
                missing, extra = _FIELD_SET - r.keys(), r.keys() - _FIELD_SET
                raise ValueError(f"tensor record #{i} ({str(r.get('name'))[:200]!r}): "
                                 + (f"missing {sorted(missing)}" if missing else f"unknown fields {sorted(extra)}"))
    return check_records(list(map(make_record, map(_row_fields, rows))))


def records_to_rows(records: list[TensorRecord]) -> list[dict[str, Any]]:
    return [dict(zip(FIELDS, r)) for r in records]


def records_to_columns(records: list[TensorRecord]) -> dict[str, Any]:
    """The column form: ``files`` lists each distinct file name once, ``file`` indexes it."""
    if not records:
        return {"files": [], "name": [], "kind": [], "dtype": [], "shape": [], "nbytes": [], "file": [],
                "offset": [], "blake3": ""}
    names, kinds, dtypes, shapes, nbytes, files, offsets, digests = zip(*records)
    index: dict[str, int] = {}
    for f in files:
        index.setdefault(f, len(index))
    return {"files": list(index), "name": list(names), "kind": list(kinds), "dtype": list(dtypes),
            "shape": list(shapes), "nbytes": list(nbytes), "file": [index[f] for f in files],
            "offset": list(offsets), "blake3": "".join(digests)}


_COLUMNS = frozenset(("files", "name", "kind", "dtype", "shape", "nbytes", "file", "offset", "blake3"))


def columns_to_records(doc: Any) -> list[TensorRecord]:
    """The records of the column form, checked (the same rules as the row form)."""
    if type(doc) is not dict or doc.keys() != _COLUMNS:
        got = sorted(doc) if type(doc) is dict else type(doc).__name__
        raise ValueError(f"tensor columns must have exactly the keys {sorted(_COLUMNS)}, not {got}")
    files, digests = doc["files"], doc["blake3"]
    if type(files) is not list or not all(type(f) is str for f in files) or type(digests) is not str:
        raise ValueError("tensor columns: files must be a list of strings and blake3 a string")
    cols = [doc[k] for k in ("name", "kind", "dtype", "shape", "nbytes", "file", "offset")]
    if not all(type(c) is list for c in cols):
        raise ValueError("tensor columns: every column must be a list")
    n = len(cols[0])
    if any(len(c) != n for c in cols) or len(digests) != 64 * n:
        raise ValueError(f"tensor columns: every column must have {n} entries (and blake3 {64 * n} digits)")
    if not _all_indexes(cols[5], len(files)):
        raise ValueError(f"tensor columns: a file index is outside the {len(files)} files listed")
    names, kinds, dtypes, shapes, nbytes, file_idx, offsets = cols
    file_names = [files[i] for i in file_idx]
    split = [digests[i:i + 64] for i in range(0, 64 * n, 64)]
    return check_records(list(map(make_record, zip(names, kinds, dtypes, shapes, nbytes, file_names,
                                                           offsets, split))))


# ------------------------------------------------------------------------------- the manifest's table
TABLE_KEYS = frozenset(("dtypes", "name", "dtype", "shape", "file", "offset", "blake3"))


def records_to_table(records: list[TensorRecord], file_names: list[str]) -> dict[str, Any]:
    """The table form of manifest format version 4 (docs/format.md): one list per field, each
    record's (kind, dtype) as an index into ``dtypes``, its file as an index into the manifest's
    ``files`` (``file_names``, in order), no ``nbytes`` (the shape and dtype give it) and the digests
    as one base64 string of 32 bytes per record. About 90 bytes per array where a row took 200."""
    if not records:
        return {"dtypes": [], "name": [], "dtype": [], "shape": [], "file": [], "offset": [], "blake3": ""}
    names, kinds, dtypes, shapes, _nbytes, files, offsets, digests = zip(*records)
    # Each column in one C-level pass (issue 23: a Python step per array cost 0.3 us a column).
    pairs = {p: i for i, p in enumerate(dict.fromkeys(zip(kinds, dtypes)))}  # first-seen order
    file_index = {n: i for i, n in enumerate(file_names)}
    return {"dtypes": [list(p) for p in pairs], "name": list(names),
            "dtype": list(map(pairs.__getitem__, zip(kinds, dtypes))), "shape": list(shapes),
            "file": list(map(file_index.__getitem__, files)), "offset": list(offsets),
            "blake3": base64.b64encode(bytes.fromhex("".join(digests))).decode("ascii")}


def table_to_records(table: Any, file_names: list[Any]) -> list[TensorRecord]:
    """The records of a version 4 table, checked as strictly as rows are (``check_records``), plus
    the table's own rules: exactly its keys, columns of one length, indexes inside ``dtypes`` and
    ``files``, digests that are canonical base64 of 32 bytes each."""
    if type(table) is not dict or table.keys() != TABLE_KEYS:
        got = sorted(table) if type(table) is dict else type(table).__name__
        raise ValueError(f"format 4 lists tensors as a table with exactly the keys {sorted(TABLE_KEYS)}, not {got}")
    pairs, digests = table["dtypes"], table["blake3"]
    if type(pairs) is not list or not all(type(p) is list and len(p) == 2 and all(type(x) is str for x in p)
                                          for p in pairs):
        raise ValueError("tensors.dtypes must be a list of [kind, dtype] pairs of strings")
    cols = [table[k] for k in ("name", "dtype", "shape", "file", "offset")]
    if not all(type(c) is list for c in cols) or type(digests) is not str:
        raise ValueError("tensors: name, dtype, shape, file and offset must be lists, blake3 a string")
    names, dtype_idx, shapes, file_idx, offsets = cols
    n = len(names)
    if any(len(c) != n for c in cols):
        raise ValueError(f"tensors: every column must have one entry per array ({n})")
    if not _all_indexes(dtype_idx, len(pairs)):
        raise ValueError(f"tensors.dtype: an index is outside the {len(pairs)} dtypes listed")
    if not _all_indexes(file_idx, len(file_names)):
        raise ValueError(f"tensors.file: an index is outside the {len(file_names)} files listed")
    try:
        raw = base64.b64decode(digests, validate=True)
    except (ValueError, TypeError):
        raise ValueError("tensors.blake3 is not base64") from None
    if len(raw) != 32 * n or base64.b64encode(raw).decode("ascii") != digests:
        raise ValueError(f"tensors.blake3 must be the canonical base64 of {n} digests of 32 bytes")
    if not _all_shapes(shapes):
        bad = next(i for i, sh in enumerate(shapes) if not _is_shape(sh))
        raise ValueError(f"tensor {str(names[bad])[:200]!r}: shape must be a list of at most {MAX_DIMS} "
                         "non-negative sizes")
    sizes = []
    for kind, dtype in pairs:
        if kind not in ("torch", "numpy"):
            raise ValueError(f"tensors.dtypes: kind must be 'torch' or 'numpy', not {kind!r}")
        sizes.append(_itemsize(kind, dtype))
    # Each column in one C-level pass (``map`` over an index or a slice), no Python step per array.
    hexed = raw.hex()
    kinds = list(map([p[0] for p in pairs].__getitem__, dtype_idx))
    dtypes = list(map([p[1] for p in pairs].__getitem__, dtype_idx))
    nbytes = list(map(operator.mul, map(math.prod, shapes), map(sizes.__getitem__, dtype_idx)))
    files = list(map(file_names.__getitem__, file_idx))
    split = list(map(hexed.__getitem__, map(slice, range(0, 64 * n, 64), range(64, 64 * n + 1, 64))))
    records = check_records(list(map(make_record, zip(names, kinds, dtypes, shapes, nbytes, files, offsets, split))),
                            derived=True)
    return _Checked(records)


class _Checked(list):  # type: ignore[type-arg]
    """Records that ``table_to_records`` checked whole: the field validator of ``TensorRows`` takes them
    as they are instead of checking all of them a second time (issue 23: 1 us an array). Only this
    module makes one; parsed JSON never is one."""


def _rows_validator(value: Any) -> list[TensorRecord]:
    if type(value) is _Checked:
        return list(value)  # a version 4 table's, checked as it was read (``table_to_records``)
    if type(value) is list and all(type(r) is TensorRecord for r in value):
        return check_records(value)  # built in this process (a model constructed from records)
    return rows_to_records(value)


def _columns_validator(value: Any) -> list[TensorRecord]:
    if type(value) is list and all(type(r) is TensorRecord for r in value):
        return check_records(value)
    return columns_to_records(value)


#: A pydantic field of records in the row form (manifests, rank records).
TensorRows = Annotated[list[TensorRecord], PlainValidator(_rows_validator),
                       PlainSerializer(records_to_rows, return_type=list)]
#: A pydantic field of records in the column form (the writer protocol).
TensorColumns = Annotated[list[TensorRecord], PlainValidator(_columns_validator),
                          PlainSerializer(records_to_columns, return_type=dict)]

__all__ = ["TensorRecord", "TensorRows", "TensorColumns", "check_records", "rows_to_records", "records_to_rows",
           "records_to_columns", "columns_to_records", "records_to_table", "table_to_records"]
