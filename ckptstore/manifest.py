"""The manifest of a cut: every file and tensor with its blake3, the step, tags and who wrote it.

``MANIFEST.json`` is written last when a cut is saved and deleted first when it is pruned, so a manifest
never names data that is gone.

A cut of several ranks (``world_size`` > 1) is ``format_version`` 3: every rank's files and arrays are
listed (``FileRecord.rank``; array names are unique per rank) and ``tree`` is
``{"t": "ranks", "ranks": [tree of rank 0, tree of rank 1, ...]}``. Each rank first publishes a
:class:`RankRecord` (its files, arrays and tree) beside its shards; rank 0 (the coordinator) reads them
all and publishes the manifest once every rank's record is durable. :meth:`Manifest.for_rank` is one
rank's part as an ordinary manifest, which is what loaders read.
"""

from __future__ import annotations

import json
import operator
from datetime import datetime
from operator import attrgetter
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from . import hashing, layout
from .attached import AttachedFile, check_listing
from .fragments import PartRef, PartTable, parts_to_table
from .format import ST_ITEMSIZE
from .jsontext import compact_bytes, table_pieces, tree_pieces
from .models import CutId, FileName, StrictModel, json_key_count
from .records import FIELDS, TABLE_KEYS, TensorRecord, TensorRows, records_to_rows, records_to_table, table_to_records

_HEX64 = r"^[0-9a-f]{64}$"


class WriterIdentity(StrictModel):
    host: str
    pid: int
    ckptstore_version: str
    mode: str = "sync"


class FileRecord(StrictModel):
    """One shard file. ``nbytes``/``blake3`` describe the bytes stored; ``raw_*`` the safetensors bytes
    before compression (equal to the stored ones when ``codec`` is "none").

    What the digests are depends on the manifest's ``format_version`` (docs/format.md): in 1 both are
    the plain blake3 of the bytes; in 2 ``raw_blake3`` is the v2 file digest (header bytes plus each
    tensor's size and blake3) and ``blake3`` the same for codec "none", the plain blake3 of the
    compressed bytes for "zstd"."""

    name: FileName
    rank: int = Field(ge=0)
    codec: Literal["none", "zstd"]
    nbytes: int = Field(ge=0)
    blake3: str = Field(pattern=_HEX64)
    raw_nbytes: int = Field(ge=0)
    raw_blake3: str = Field(pattern=_HEX64)


#: The most raw bytes one stored zstd byte can stand for: a block decodes to at most 128 KiB and
#: costs at least 4 stored bytes (an RLE block: 3 header bytes and the byte). A manifest claiming more
#: is refused before anything is allocated for it (issue 10, item 9).
ZSTD_MAX_RATIO = 1 << 15


def _check_arrays(files: list[FileRecord], tensors: list[TensorRecord]) -> None:
    """Every array lies inside a file of its rank, names are unique per rank, sizes agree."""
    by_name = {f.name: f for f in files}
    if len(by_name) != len(files):
        raise ValueError("duplicate file names")
    for f in files:
        # Sizes are claims a reader allocates for: they must agree with each other before any is used.
        if f.codec == "none" and f.raw_nbytes != f.nbytes:
            raise ValueError(f"file {f.name!r} is not compressed, yet records {f.raw_nbytes} raw bytes "
                             f"and {f.nbytes} stored")
        if f.codec == "zstd" and f.raw_nbytes > f.nbytes * ZSTD_MAX_RATIO:
            raise ValueError(f"file {f.name!r}: {f.nbytes} zstd bytes cannot hold the {f.raw_nbytes} raw bytes "
                             "recorded")
    # In bulk, one C-level pass per rule over a column (issue 23: 40,000 records; a generator a rule cost
    # 0.7 us an array); the records' own fields were checked as they were parsed (records.check_records).
    names, in_files, offsets, nbytes = (list(map(attrgetter(f), tensors)) for f in ("name", "file", "offset", "nbytes"))
    if not set(in_files) <= by_name.keys():
        bad = next(t for t in tensors if t.file not in by_name)
        raise ValueError(f"tensor {bad.name!r} names unknown file {bad.file!r}")
    rank_of = {f.name: f.rank for f in files}
    # Names are unique per rank: of a one-rank part, the names alone.
    keys: list[Any] = names if len(set(rank_of.values())) <= 1 else list(zip(map(rank_of.__getitem__, in_files), names))
    if len(set(keys)) != len(keys):
        seen: set[tuple[int, str]] = set()
        for rank, name in zip(map(rank_of.__getitem__, in_files), names):
            if (rank, name) in seen:
                raise ValueError(f"duplicate tensor name {name!r}" + (f" in rank {rank}" if rank else ""))
            seen.add((rank, name))
    size_of = {f.name: f.raw_nbytes for f in files}
    if not all(map(operator.le, map(operator.add, offsets, nbytes), map(size_of.__getitem__, in_files))):
        bad = next(t for t in tensors if t.offset + t.nbytes > size_of[t.file])
        raise ValueError(f"tensor {bad.name!r} lies past the end of {bad.file!r}")


def _check_attached(attached: list[AttachedFile], files: list[FileRecord], tensors: list[TensorRecord]) -> None:
    """Every attached file is a 1-D ``uint8`` array of its rank with its size; paths are restorable."""
    if not attached:
        return
    check_listing((a.rank, a.path) for a in attached)
    rank_of = {f.name: f.rank for f in files}
    arrays = {(rank_of.get(t.file), t.name): t for t in tensors}
    for a in attached:
        t = arrays.get((a.rank, a.array))
        if t is None:
            raise ValueError(f"attached file {a.path!r} has no array {a.array!r}" + (f" in rank {a.rank}" if a.rank else ""))
        if (t.kind, t.dtype, t.shape) != ("numpy", "|u1", [a.nbytes]):
            raise ValueError(f"attached file {a.path!r}: array {a.array!r} is {t.kind} {t.dtype}{t.shape}, "
                             f"not numpy |u1[{a.nbytes}]")


#: The manifest format of a cut of several ranks.
RANKS_FORMAT_VERSION = 3
#: The manifest format of a cut of one rank since issue 23: version 2 with its arrays as one table
#: (``records.records_to_table``): about 90 bytes an array where a row took 200, parsed column by column.
TABLE_FORMAT_VERSION = 4
#: The manifest format of a cut of several ranks since issue 22: a commit record of one entry per rank
#: (``ckptstore.fragments``); each rank's files, arrays and tree are in its own fragment (its record).
FRAGMENTS_FORMAT_VERSION = 5
#: The keys a version 5 manifest holds instead of the parts themselves (they are in the fragments).
_PART_ONLY = ("files", "tensors", "tree", "attached")
#: What a version 5 manifest's ``tree`` is in memory: each rank's tree is in its fragment.
_PARTS_TREE = {"t": "parts"}


class Manifest(StrictModel):
    """A cut's manifest. New manifests of one rank are ``format_version`` 4 (2 with its arrays as a
    table), of several ranks 5 (a commit record: ``parts`` references each rank's fragment, and
    ``files``, ``tensors``, ``tree`` and ``attached`` are empty here: :mod:`ckptstore.assemble` reads
    them); versions 3 (every rank merged), 2 (arrays as rows) and 1 (plain file hashes, pretty-printed
    JSON) still read, verify and load as they always did. Versions 2-5 hash files the same way."""

    KIND = "ckptstore.manifest"
    FORMAT_VERSION: ClassVar[int] = TABLE_FORMAT_VERSION
    READ_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3, 4, 5)

    kind: Literal["ckptstore.manifest"] = "ckptstore.manifest"
    format_version: Literal[1, 2, 3, 4, 5] = TABLE_FORMAT_VERSION
    cut: CutId
    step: int = Field(ge=0, le=layout.MAX_STEP)
    tags: list[str] = Field(default_factory=list)
    final: bool = False
    created_at: str
    writer: WriterIdentity
    world_size: int = Field(default=1, ge=1, le=layout.MAX_WORLD_SIZE)
    metadata: dict[str, Any] = Field(default_factory=dict)
    files: list[FileRecord]
    tensors: TensorRows
    tree: dict[str, Any]
    pickled: bool = False
    #: Files that belong to the cut (``files=``; ckptstore.attached). Written only when there are some,
    #: so a cut without files reads in versions that predate the field.
    attached: list[AttachedFile] = Field(default_factory=list)
    #: Version 5: each rank's fragment, in rank order (``ckptstore.fragments``).
    parts: PartTable = Field(default_factory=list)

    @field_validator("created_at")
    @classmethod
    def _iso(cls, v: str) -> str:
        datetime.fromisoformat(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _table(cls, data: Any) -> Any:
        """Version 4 lists its arrays as a table, the others as rows: each form only in its versions."""
        if type(data) is not dict:
            return data
        if data.get("format_version") == FRAGMENTS_FORMAT_VERSION:
            present = [k for k in _PART_ONLY if k in data and data[k] not in ([], _PARTS_TREE)]
            if present:
                raise ValueError(f"format_version 5 keeps {present} in the ranks' fragments, not the manifest")
            if "parts" not in data:
                raise ValueError("format_version 5 lists its ranks' fragments in parts")
            return {**data, "files": [], "tensors": [], "tree": _PARTS_TREE}
        if "parts" in data:
            raise ValueError(f"format_version {data.get('format_version')!r} has no parts (they are version 5's)")
        if "tensors" not in data:
            return data
        tensors = data["tensors"]
        if data.get("format_version") == TABLE_FORMAT_VERSION:
            if type(tensors) is list and all(type(t) is TensorRecord for t in tensors):
                return data  # built in this process
            return {**data, "tensors": table_to_records(tensors, _file_names(data.get("files")))}
        if type(tensors) is dict:
            raise ValueError(f"format_version {data.get('format_version')!r} lists tensors as rows, not a table")
        return data

    @property
    def ranked(self) -> bool:
        """Whether this is the manifest of a cut of several ranks (version 3: a tree per rank)."""
        return self.format_version == RANKS_FORMAT_VERSION

    @property
    def fragmented(self) -> bool:
        """Whether this is a commit record (version 5): each rank's part is in its fragment, read by
        :func:`ckptstore.assemble.read_part` (one rank) or :func:`ckptstore.assemble.whole` (all)."""
        return self.format_version == FRAGMENTS_FORMAT_VERSION

    @model_validator(mode="after")
    def _references(self) -> "Manifest":
        if layout.step_of_cut_id(self.cut) != self.step:
            raise ValueError(f"cut id {self.cut} does not match step {self.step}")
        if self.fragmented:
            if self.world_size < 2 or len(self.parts) != self.world_size:
                raise ValueError(f"a commit record of {self.world_size} rank(s) lists {len(self.parts)} fragments: "
                                 "it needs one per rank, and at least two ranks")
            if self.pickled != any(p.pickled for p in self.parts):
                raise ValueError("pickled must say whether any rank's part holds a pickled value")
            return self
        if not self.ranked:
            if self.world_size != 1:
                raise ValueError(f"world_size {self.world_size} needs format_version {RANKS_FORMAT_VERSION}")
        else:
            ranks = self.tree.get("ranks")
            if self.tree.get("t") != "ranks" or not isinstance(ranks, list) or len(ranks) != self.world_size:
                raise ValueError(f"a cut of {self.world_size} ranks needs a tree of kind 'ranks' with one tree per rank")
            if not all(isinstance(r, dict) for r in ranks):
                raise ValueError("every rank's tree must be an object")
        for f in self.files:
            if f.rank >= self.world_size:
                raise ValueError(f"file {f.name!r} belongs to rank {f.rank}, outside world size {self.world_size}")
        _check_arrays(self.files, self.tensors)
        for a in self.attached:
            if a.rank >= self.world_size:
                raise ValueError(f"attached file {a.path!r} belongs to rank {a.rank}, outside world size {self.world_size}")
        _check_attached(self.attached, self.files, self.tensors)
        return self

    def for_rank(self, rank: int) -> "Manifest":
        """Rank ``rank``'s part as a manifest of its own (its files, arrays and tree): what loaders and
        exporters read. A cut of one rank is its own part 0. Raises ValueError for a rank outside the
        cut's world size."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside the cut's world size {self.world_size}")
        self._whole("for_rank")
        if not self.ranked:
            return self
        files = [f for f in self.files if f.rank == rank]
        names = {f.name for f in files}
        tensors = [t for t in self.tensors if t.file in names]
        attached = [a for a in self.attached if a.rank == rank]
        return self.model_copy(update={"files": files, "tensors": tensors, "tree": self.tree["ranks"][rank],
                                       "attached": attached})

    def rank_trees(self) -> list[tuple[int, dict[str, Any]]]:
        """(rank, tree) of every rank."""
        self._whole("rank_trees")
        if not self.ranked:
            return [(0, self.tree)]
        return list(enumerate(self.tree["ranks"]))

    def _whole(self, what: str) -> None:
        if self.fragmented:
            raise ValueError(f"cut {self.cut}'s manifest is a commit record (format 5): {what} needs its ranks' "
                             "fragments (ckptstore.assemble.read_part / whole)")

    def to_bytes(self) -> bytes:
        """Versions 2-5: compact JSON (the C encoder; ``indent`` would force the pure-Python one, half a
        save of 40,000 small tensors); 4 with its arrays as a table. Version 1 keeps its pretty-printed
        bytes. The tree's text reuses the remembered text of the subtrees it shares with the tree the
        writer last captured (``TreeText``; the bytes are those of ``compact_json`` all the same)."""
        # A TensorRecord holds JSON values only (str, int, list of int), so its rows are what
        # model_dump would make of them, without the cost (0.3 s for 40,000 records). The tree is JSON
        # values already, and model_dump refuses one nested past ~250 levels (a state of 84 dicts).
        if self.fragmented:  # version 5: the cut's fields and the parts table, O(ranks)
            doc = self.model_dump(mode="json", exclude={*_PART_ONLY, "parts"})
            doc["parts"] = parts_to_table(self.parts)
            return (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        if self.format_version == TABLE_FORMAT_VERSION:
            tensors: Any = records_to_table(self.tensors, [f.name for f in self.files])
        else:
            tensors = records_to_rows(self.tensors)
        doc = _document(self, {"tensors": tensors, "tree": self.tree})
        if self.format_version == 1:
            return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()
        # json.dumps(doc, separators) joins the items exactly so: '{' key ':' value (',' ...) '}'.
        parts = [b"{"]
        for i, (k, v) in enumerate(doc.items()):
            parts.append((b"," if i else b"") + compact_bytes(k) + b":")
            if k == "tree":
                parts.extend(tree_pieces(self.tree))
            elif k == "tensors" and self.format_version == TABLE_FORMAT_VERSION:
                parts.extend(table_pieces(tensors))
            else:
                parts.append(compact_bytes(v))
        parts.append(b"}\n")
        del doc, tensors  # the table's digest text (4.3 MB at 100,000 arrays) goes before the join
        return b"".join(parts)

    def json_key_count(self) -> int:
        return _key_count(self)

    @classmethod
    def doc_key_floor(cls, doc: dict[str, Any]) -> int:
        return _doc_key_floor(doc)

    @property
    def nbytes(self) -> int:
        """The stored bytes of the cut's files (of every rank)."""
        if self.fragmented:
            return sum(p.data_nbytes for p in self.parts)
        return sum(f.nbytes for f in self.files)

    @property
    def file_count(self) -> int:
        return sum(p.files for p in self.parts) if self.fragmented else len(self.files)

    @property
    def array_count(self) -> int:
        """Arrays of every rank, attached files' arrays included."""
        return sum(p.arrays for p in self.parts) if self.fragmented else len(self.tensors)

    @property
    def attached_count(self) -> int:
        return sum(p.attached for p in self.parts) if self.fragmented else len(self.attached)

    def tensor_index(self) -> dict[str, TensorRecord]:
        self._whole("tensor_index")
        return dict(zip(map(attrgetter("name"), self.tensors), self.tensors))


class RankRecord(StrictModel):
    """Rank ``rank``'s part of a cut of several ranks, written durably beside its shards once they are
    durable (``cuts/<cut>/rank<r>.json``): the "my files are written" record of the storage-side
    two-phase commit. The coordinator commits the cut once all ``world_size`` records are there;
    until then the cut is in progress (marked) and its records commit nothing.

    Format 2 (issue 22) is the fragment a version 5 commit record references by size and blake3:
    compact JSON with its arrays as a table (as a version 4 manifest's). Format 1 (pretty-printed,
    arrays as rows) is what cuts of version 3 were committed from; it still reads."""

    KIND = "ckptstore.rank"
    FORMAT_VERSION: ClassVar[int] = 2
    READ_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)

    kind: Literal["ckptstore.rank"] = "ckptstore.rank"
    format_version: Literal[1, 2] = 2
    cut: CutId
    step: int = Field(ge=0, le=layout.MAX_STEP)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1, le=layout.MAX_WORLD_SIZE)
    created_at: str
    writer: WriterIdentity
    files: list[FileRecord]
    tensors: TensorRows
    tree: dict[str, Any]
    pickled: bool = False
    attached: list[AttachedFile] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _table(cls, data: Any) -> Any:
        """Format 2 lists its arrays as a table, format 1 as rows."""
        if type(data) is not dict or "tensors" not in data:
            return data
        tensors = data["tensors"]
        if data.get("format_version", 2) == 2:
            if type(tensors) is list and all(type(t) is TensorRecord for t in tensors):
                return data  # built in this process
            return {**data, "tensors": table_to_records(tensors, _file_names(data.get("files")))}
        if type(tensors) is dict:
            raise ValueError("a rank record of format 1 lists tensors as rows, not a table")
        return data

    def to_bytes(self) -> bytes:
        if self.format_version == 1:
            doc = _document(self, {"tree": self.tree})  # a deep tree, as in Manifest.to_bytes
            return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()
        table = records_to_table(self.tensors, [f.name for f in self.files])
        doc = _document(self, {"tensors": table, "tree": self.tree})
        parts = [b"{"]
        for i, (k, v) in enumerate(doc.items()):
            parts.append((b"," if i else b"") + compact_bytes(k) + b":")
            if k == "tree":
                parts.extend(tree_pieces(self.tree))
            elif k == "tensors":
                parts.extend(table_pieces(table))
            else:
                parts.append(compact_bytes(v))
        parts.append(b"}\n")
        del doc, table
        return b"".join(parts)

    def part_ref(self, data: bytes) -> PartRef:
        """What the commit record says of this record, whose bytes are ``data``."""
        return PartRef(layout.rank_record_name(self.rank), len(data), hashing.digest(data),
                       sum(f.nbytes for f in self.files), len(self.files), len(self.tensors), len(self.attached),
                       bool(self.pickled))

    def json_key_count(self) -> int:
        return _key_count(self)

    @classmethod
    def doc_key_floor(cls, doc: dict[str, Any]) -> int:
        return _doc_key_floor(doc)

    @model_validator(mode="after")
    def _consistent(self) -> "RankRecord":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        for f in self.files:
            if f.rank != self.rank:
                raise ValueError(f"file {f.name!r} belongs to rank {f.rank}, not {self.rank}")
        _check_arrays(self.files, self.tensors)
        if any(a.rank != self.rank for a in self.attached):
            raise ValueError(f"an attached file of rank {self.rank}'s record names another rank")
        _check_attached(self.attached, self.files, self.tensors)
        return self


def _file_names(files: Any) -> list[Any]:
    """The names of a document's (or a model's) ``files``, which a table's ``file`` column indexes."""
    if type(files) is not list:
        return []
    return [f.get("name") if type(f) is dict else getattr(f, "name", None) for f in files]


def _doc_key_floor(doc: dict[str, Any]) -> int:
    """``StrictModel.doc_key_floor`` of a manifest or rank record's document: every key but those inside
    the array records' values, which hold none in a document that validates (a version 4 table's
    columns are strings, ints and lists of ints; so are a row's fields). Counting the table's 200,000
    values one by one cost 0.03 s for 40,000 arrays (issue 23); an object hidden in a column is left
    out, and sends the document to the slow path (see ``doc_key_floor``)."""
    tensors = doc.get("tensors")
    n = len(doc) + json_key_count([v for k, v in doc.items() if k != "tensors"])
    if type(tensors) is dict:
        n += len(tensors)
    elif type(tensors) is list:
        n += sum([len(r) for r in tensors if type(r) is dict])
    return n


def _key_count(model: "Manifest | RankRecord") -> int:
    """``json_key_count`` of a manifest or rank record, without the generic walk over every field of
    40,000 flat array records (0.1 s): every field of a TensorRecord is required and no other is
    allowed, so each parsed record set exactly that many distinct keys."""
    fields = model.model_fields_set
    rest = [getattr(model, f) for f in fields if f != "tensors"]
    if isinstance(model, Manifest) and model.fragmented:  # O(ranks), not of arrays: its document's own count
        return json_key_count(json.loads(model.to_bytes()))
    if getattr(model, "format_version", None) == TABLE_FORMAT_VERSION or (
            isinstance(model, RankRecord) and model.format_version == 2):
        return len(fields) + json_key_count(rest) + (len(TABLE_KEYS) if "tensors" in fields else 0)
    return len(fields) + json_key_count(rest) + len(FIELDS) * len(model.tensors)


def _document(model: StrictModel, raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of ``model`` in field order, with the fields in ``raw`` taken as they are."""
    dumped = model.model_dump(mode="json", exclude={*raw, "parts"})
    doc = {k: raw[k] if k in raw else dumped[k] for k in type(model).model_fields if k != "parts"}
    if not doc.get("attached", True):
        del doc["attached"]  # readers that predate attached files still read a cut without any
    return doc


__all__ = ["Manifest", "RankRecord", "RANKS_FORMAT_VERSION", "TABLE_FORMAT_VERSION", "FRAGMENTS_FORMAT_VERSION", "PartRef", "FileRecord", "TensorRecord",
           "WriterIdentity", "ST_ITEMSIZE"]
