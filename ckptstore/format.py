"""Shard files: a safetensors-compatible layout, encoded and decoded with every bound checked.

A shard (uncompressed) is byte-for-byte a valid safetensors file::

    u64 little-endian N | N bytes of JSON header (space-padded) | data section

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets
relative to the data section, contiguous and in file order, plus ``__metadata__`` naming the format.
The header is padded so the data section starts on a 4096-byte boundary (page-aligned tensors for
mmap and O_DIRECT readers). dtypes that safetensors has no name for (complex128, float8 variants it
lacks, ...) are stored as ``U8`` of their raw bytes; the manifest always has the true dtype and shape,
and is the authority for ckptstore's own loader.

Why safetensors: standard tools (``safetensors.safe_open``, the HF hub viewer) can read a cut with no
ckptstore installed, the header is JSON (no pickle), and its rules (contiguous offsets, bounded header)
are already battle-tested against hostile files. See docs/format.md.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from .errors import CorruptCut, HostileInput, TruncatedFile

SHARD_FORMAT = "ckptstore-shard"
SHARD_FORMAT_VERSION = "1"
DATA_ALIGN = 4096
#: Headers larger than this are refused before they are read (failure-modes row 43, "HeaderTooLarge").
MAX_HEADER_BYTES = 64 << 20

#: dtype name (torch spelling for tensors, numpy ``dtype.str`` for arrays) -> (safetensors name, itemsize)
TORCH_DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("BOOL", 1),
    "uint8": ("U8", 1),
    "int8": ("I8", 1),
    "int16": ("I16", 2),
    "uint16": ("U16", 2),
    "int32": ("I32", 4),
    "uint32": ("U32", 4),
    "int64": ("I64", 8),
    "uint64": ("U64", 8),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float32": ("F32", 4),
    "float64": ("F64", 8),
    "complex64": ("C64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
    # No safetensors name: stored as U8 bytes, true dtype in the manifest.
    "complex32": ("U8", 4),
    "complex128": ("U8", 16),
    "float8_e8m0fnu": ("U8", 1),
}

#: Every dtype name torch (2.x) gives a ``torch.dtype`` value; a "dtype" tree node must be one. A static
#: set, so ``verify`` checks these nodes exactly as a load decodes them, without importing torch.
TORCH_DTYPE_NAMES = frozenset({
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32",
    "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4",
    "int5", "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1",
    "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
})
#: The device types ``torch.device`` parses (c10 DeviceType), with an optional index of 0..127 (an
#: int8): a "device" tree node must be one. Backends registered at run time (privateuse1 renamed) are
#: not known here and are refused.
_DEVICE = re.compile(r"(cpu|cuda|ipu|xpu|opengl|opencl|ideep|hip|ve|fpga|maia|xla|lazy|vulkan|mps|meta|hpu|mtia"
                     r"|privateuseone)(?::(0|[1-9][0-9]{0,2}))?")


def check_device(spec: str) -> None:
    """ValueError unless ``torch.device(spec)`` accepts ``spec`` (checked without torch)."""
    m = _DEVICE.fullmatch(spec) if type(spec) is str else None
    if m is None or (m.group(2) is not None and int(m.group(2)) > 127):
        raise ValueError(f"unknown device {spec!r}")


_NUMPY_TO_ST = {
    "|b1": "BOOL", "|u1": "U8", "|i1": "I8", "<i2": "I16", "<u2": "U16", "<i4": "I32", "<u4": "U32",
    "<i8": "I64", "<u8": "U64", "<f2": "F16", "<f4": "F32", "<f8": "F64", "<c8": "C64",
}

_NUMPY_DTYPE = re.compile(r"[<>|=]([biufcmM])(\d{1,2})(?:\[([a-zA-Z]+)\])?")
#: The item sizes numpy has for each kind ckptstore stores (f16/c32: long double, where the platform
#: has one); "<i3" or "<f1" match the pattern, yet np.dtype refuses them (issue 10, item 8).
_NUMPY_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8, 16), "c": (8, 16, 32),
                "m": (8,), "M": (8,)}
_TIME_UNITS = frozenset({"Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as", "generic"})


def numpy_itemsize(dtype: str) -> int:
    """The item size of a numpy ``dtype.str`` that ckptstore stores, checked without numpy (verify runs
    without it) against exactly what ``np.dtype`` accepts; ValueError otherwise."""
    m = _NUMPY_DTYPE.fullmatch(dtype) if type(dtype) is str else None
    if m is None or int(m.group(2)) not in _NUMPY_SIZES[m.group(1)]:
        raise ValueError(f"unsupported numpy dtype {dtype!r}")
    unit = m.group(3)
    if unit is not None and (m.group(1) not in "mM" or unit not in _TIME_UNITS):
        raise ValueError(f"unsupported numpy dtype {dtype!r}")
    return int(m.group(2))


ST_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}


def header_dtype(kind: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[str, list[int]]:
    """The (safetensors dtype, shape) a shard header records for a tensor or array."""
    st, as_bytes = header_dtype_rule(kind, dtype)
    return (st, [nbytes]) if as_bytes else (st, list(shape))


def header_dtype_rule(kind: str, dtype: str) -> tuple[str, bool]:
    """The safetensors dtype a shard header records for arrays of ``kind`` and ``dtype``, and whether
    their shape is recorded as ``[nbytes]`` (a dtype safetensors has no name for, stored as U8 bytes)."""
    if kind == "torch":
        st = TORCH_DTYPES[dtype][0]
    else:
        st = _NUMPY_TO_ST.get(dtype, "U8")
    if st == "U8" and not (kind == "torch" and dtype == "uint8") and not (kind == "numpy" and dtype == "|u1"):
        return "U8", True
    return st, False


class HeaderEntry(NamedTuple):
    """One tensor of a decoded header (a NamedTuple: a shard of 40,000 small tensors makes 40,000)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ShardHeader:
    """A decoded shard header: ``data_start`` is the file offset of the data section."""

    entries: tuple[HeaderEntry, ...]
    metadata: dict[str, str]
    data_start: int
    data_nbytes: int

    @property
    def file_nbytes(self) -> int:
        return self.data_start + self.data_nbytes


def encode_header(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str] | None = None) -> bytes:
    """The header bytes (length prefix included) for tensors ``(name, st_dtype, shape, nbytes)`` laid
    out contiguously in the given order: ``json.dumps`` of the header object, compact and ASCII-only,
    space-padded so the data section starts on a ``DATA_ALIGN`` boundary."""
    names, st_dtypes, shapes, sizes = zip(*entries) if entries else ((), (), (), ())
    return encode_header_columns(names, st_dtypes, shapes, sizes, metadata)


def encode_header_columns(names: Sequence[str], st_dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                          sizes: Sequence[int], metadata: dict[str, str] | None = None) -> bytes:
    """:func:`encode_header` of the tensors given as four columns (a shard writer has them so)."""
    meta = {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, **(metadata or {})}
    if len(set(names)) != len(names) or "__metadata__" in names:
        seen: set[str] = {"__metadata__"}
        for name in names:
            if name in seen:
                raise ValueError(f"duplicate or reserved tensor name {name!r}")
            seen.add(name)
    chunks = _header_chunks(names, st_dtypes, shapes, sizes, meta)
    if chunks is None:
        chunks = [_header_json(zip(names, st_dtypes, shapes, sizes), meta).encode("ascii")]
    total = 8 + sum(map(len, chunks))
    padded = -(-total // DATA_ALIGN) * DATA_ALIGN
    # One copy of the text, into the header (a header of 100,000 entries is 7.8 MB: each copy more
    # was 7.8 MB more of a cut's peak memory, issue 23).
    return b"".join((struct.pack("<Q", padded - 8), *chunks, b" " * (padded - total)))


def _header_json(entries: Iterable[tuple[str, str, Sequence[int], int]], meta: dict[str, str]) -> str:
    """The header's JSON text as ``json.dumps`` writes the header object: the definition of the bytes
    that :func:`_header_chunks` writes faster."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, st_dtype, shape, nbytes in entries:
        header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return json.dumps(header, separators=(",", ":"), ensure_ascii=True)


_escape = json.encoder.encode_basestring_ascii  # what json.dumps(ensure_ascii=True) writes a string as


#: Entries per chunk of a header's text (``_header_chunks``): their f-strings live only while it is made.
_CHUNK = 4096


def _header_chunks(names: Sequence[str], st_dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                   sizes: Sequence[int], meta: dict[str, str]) -> list[bytes] | None:
    """The text of :func:`_header_json`, ASCII, as chunks to join, written entry by entry as one
    f-string each (issue 23: building a dict of three values and two lists per tensor for ``json.dumps``
    cost 3 us a tensor, this a sixth of it), ``_CHUNK`` entries at a time (the f-strings of 100,000
    entries at once were 15 MB). Only for the canonical case, checked in bulk first: names and dtypes
    of type str, sizes and dimensions of type int (``repr`` of an int is what json writes; a bool or a
    numpy integer is not), shapes lists or tuples; None otherwise, for ``_header_json`` to write."""
    head = '{"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=True)
    if not names:
        return [(head + "}").encode("ascii")]
    if (set(map(type, names)) != {str} or set(map(type, st_dtypes)) != {str} or set(map(type, sizes)) != {int}
            or not set(map(type, shapes)) <= {list, tuple}
            or not set(map(type, itertools.chain.from_iterable(shapes))) <= {int}):
        return None
    esc = _escape
    dtype_text = {d: esc(d) for d in set(st_dtypes)}
    # A state repeats few shapes: each one's text is made once.
    as_tuples = list(map(tuple, shapes))
    dims_text = {t: ",".join(map(repr, t)) for t in set(as_tuples)}
    chunks = [head.encode("ascii")]
    begin = 0
    for i in range(0, len(names), _CHUNK):
        ends = list(itertools.accumulate(sizes[i:i + _CHUNK], initial=begin))
        parts = [f',{esc(n)}:{{"dtype":{d},"shape":[{s}],"data_offsets":[{b},{e}]}}'
                 for n, d, s, b, e in zip(names[i:i + _CHUNK], map(dtype_text.__getitem__, st_dtypes[i:i + _CHUNK]),
                                          map(dims_text.__getitem__, as_tuples[i:i + _CHUNK]), ends, ends[1:])]
        chunks.append("".join(parts).encode("ascii"))
        begin = ends[-1]
    chunks.append(b"}")
    return chunks


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # one C call; the loop below only runs to name a duplicate
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise HostileInput(f"duplicate key {k!r} in shard header")
            seen.add(k)
    return out


def decode_header(
    read_range: Callable[[int, int], bytes],
    file_nbytes: int,
    *,
    where: dict[str, str | None],
) -> ShardHeader:
    """Decodes and bounds-checks a shard header. ``read_range(start, end)`` returns file bytes;
    ``where`` carries store/cut/path for errors. Never trusts a length before checking it against the
    file size."""
    if file_nbytes < 8:
        raise TruncatedFile(f"shard is {file_nbytes} bytes, shorter than its 8-byte length prefix", **where)
    (n,) = struct.unpack("<Q", read_range(0, 8))
    if n > MAX_HEADER_BYTES or n > file_nbytes - 8:
        raise HostileInput(
            f"shard header length {n} is impossible (file is {file_nbytes} bytes, limit {MAX_HEADER_BYTES})",
            **where,
        )
    raw = read_range(8, 8 + n)
    if len(raw) != n:
        raise TruncatedFile(f"shard header: expected {n} bytes, found {len(raw)}", **where)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except HostileInput as exc:
        raise HostileInput(exc.message, **where) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCut(f"shard header is not valid JSON: {exc}", **where) from None
    if not isinstance(doc, dict):
        raise CorruptCut("shard header is not a JSON object", **where)
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCut("shard header __metadata__ must map strings to strings", **where)
    entries = []
    for name, spec in doc.items():
        entries.append(_check_entry(name, spec, where))
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for e in entries:
        if e.begin != expected:
            raise CorruptCut(f"tensor {e.name!r}: data_offsets start at {e.begin}, expected {expected}", **where)
        expected = e.end
    data_start = 8 + n
    if data_start + expected > file_nbytes:
        raise TruncatedFile(
            f"shard data section needs {data_start + expected} bytes, file has {file_nbytes}", **where
        )
    if data_start + expected != file_nbytes:
        raise CorruptCut(
            f"shard has {file_nbytes - data_start - expected} trailing bytes after its data section", **where
        )
    return ShardHeader(tuple(entries), meta, data_start, expected)


_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
#: Sizes and offsets a header may hold are below this (larger ones are refused as hostile).
SANE_INT = _SANE = 2**62


def _sane_ints(values: Any, max_len: int) -> bool:
    """A list of at most ``max_len`` ints (not bools) in [0, 2**62). Written as a plain loop: this runs
    once per tensor of every shard read."""
    if type(values) is not list or len(values) > max_len:
        return False
    for v in values:
        if type(v) is not int or not 0 <= v < _SANE:
            return False
    return True


def _check_entry(name: str, spec: Any, where: dict[str, str | None]) -> HeaderEntry:
    if type(spec) is not dict or spec.keys() != _ENTRY_KEYS:
        raise CorruptCut(f"tensor {name!r}: header entry must have exactly dtype, shape, data_offsets", **where)
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    itemsize = ST_ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise CorruptCut(f"tensor {name!r}: unknown dtype {dtype!r}", **where)
    if not _sane_ints(shape, 64):
        raise HostileInput(f"tensor {name!r}: shape {shape!r} is not a list of sane sizes", **where)
    if not _sane_ints(offsets, 2) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise HostileInput(f"tensor {name!r}: data_offsets {offsets!r} are not an ordered pair", **where)
    nbytes = math.prod(shape) * itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptCut(
            f"tensor {name!r}: {dtype}{shape} needs {nbytes} bytes, offsets span {offsets[1] - offsets[0]}",
            **where,
        )
    return HeaderEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
