"""Shared base for every model parsed from bytes: strict, frozen, versioned, no extra fields."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from . import layout
from .errors import ManifestError
from .gcpause import pausing


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

    def json_key_count(self) -> int:
        """How many object keys the JSON document this model was parsed from held, duplicates counted
        once (the fields it set, and theirs). Models with many records override it with a faster walk."""
        return json_key_count(self)

    @classmethod
    def doc_key_floor(cls, doc: dict[str, Any]) -> int:
        """A count of the object keys in ``doc`` (a parsed document) that may leave some out, but none of
        a document this model accepts. ``from_bytes`` trusts a document only when this equals
        ``raw_key_bound`` of its bytes, which is no smaller than the keys the bytes hold, duplicates
        included: equality then proves that no key repeats, whatever this leaves out (leaving out keys
        only sends a document to the slow path, which names the duplicate or validates it all the same).
        Here every key is counted; models with many records skip what cannot hold keys."""
        return json_key_count(doc)

    @classmethod
    @pausing  # hundreds of thousands of objects: the collector would make the parse quadratic
    def from_bytes(cls: type[M], data: bytes, **where: Any) -> M:
        """Parses and validates; every failure is a ManifestError naming the store, cut and file.

        Well-formed input takes the fast way: the C parser of ``json`` without a hook, then pydantic's
        validation of the parsed document (a manifest of 40,000 tensors in 0.3 s, where pydantic's own
        JSON validation took 0.55 and the hooked parse below 0.8: issue 23); anything it refuses is
        parsed again below, only to say precisely what is wrong."""
        what = cls.KIND
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            pass
        else:
            # A parser keeps the last of duplicate keys (issue 10, item 11): the document is trusted
            # only when it provably has none (its raw key count is what the parsed objects hold), and
            # it is validated only when it says it is this kind, in a version read here.
            if (type(doc) is dict and doc.get("kind") == cls.KIND and type(doc.get("format_version")) is int
                    and doc["format_version"] in cls.READ_VERSIONS and raw_key_bound(data) == cls.doc_key_floor(doc)):
                try:
                    return cls.model_validate(doc)
                except (ValidationError, ValueError, RecursionError):
                    pass
        try:
            doc = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
        except _DuplicateKey as exc:
            raise ManifestError(f"{what} repeats the key {exc.args[0]!r} in one object (which one counts "
                                "would depend on the parser)", **where) from None
        except RecursionError:
            # A document nested thousands deep (a hostile manifest) exhausts json's recursion guard; a
            # state's tree is at most tree.MAX_DEPTH levels, far below it (issue 10, item 7).
            raise ManifestError(f"{what} is nested too deeply to parse", **where) from None
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
        except RecursionError:
            raise ManifestError(f"{what} is nested too deeply to validate", **where) from None
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise ManifestError(f"{what} field {loc!r}: {first['msg']}", **where) from None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # one C call; the loop only runs to name the duplicate
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


_WS_BEFORE_COLON = re.compile(rb'"[ \t\r\n]+:')


def raw_key_bound(data: bytes) -> int | None:
    """A number no smaller than the count of object keys in a valid JSON document, duplicates
    included, found in its bytes without parsing (0.02 s for a 13 MB manifest): every ``"`` that closes
    a string (after an even run of backslashes) followed directly by ``:``. A string value that starts
    with ``:`` counts too, which only sends the caller to its slow path. None when it cannot tell: some
    ``"`` is followed by whitespace and then ``:`` (a key could be missed), or backslash runs are long."""
    # Whitespace is rare in a compact document: its bytes are looked for one by one first (memchr), the
    # regex only when some are there but for the one closing newline (issue 23: four scans for
    # two-byte patterns, stopping at every quote, cost 0.03 s of a 7.7 MB manifest).
    if (b" " in data or b"\t" in data or b"\r" in data or data.count(b"\n") > data.endswith(b"\n")) \
            and _WS_BEFORE_COLON.search(data):
        return None
    if b"\\" not in data:  # no backslash at all (memchr): every ``":`` counts, one scan
        return data.count(b'":')
    # count(b'":') - count(b'\\":') + count(b'\\\\":') - ...: the ``":`` after an even backslash run.
    n, sign, pattern = 0, 1, b'":'
    while (found := data.count(pattern)):
        if len(pattern) > 10:  # a hostile run of backslashes must not make this quadratic
            return None
        n += sign * found
        sign, pattern = -sign, b"\\" + pattern
    return n


def json_key_count(value: Any) -> int:
    """The object keys in ``value``: parsed models (the fields their document set), dicts and lists of
    them. One stack of what is still to count: only what may hold keys is pushed (strings and
    numbers, most of a document, are looked at once and left), so a nested manifest of 40,000 tensors
    (253,390 keys) takes 32 ms, where a level-by-level walk in C-level passes took 62 and one pushing
    every value 0.2 s (issue 23). Iterative: a state's tree nests hundreds of levels deep."""
    n = 0
    stack = [value]
    pop, push = stack.pop, stack.append
    while stack:
        v = pop()
        t = type(v)
        if t is dict:
            n += len(v)
            v = v.values()
        elif t is not list:
            if isinstance(v, BaseModel):  # only when counting a model's fields (never a parsed document)
                fields = v.model_fields_set
                n += len(fields)
                stack.extend(getattr(v, f) for f in fields)
            continue
        for x in v:
            if type(x) not in _SCALAR_TYPES:  # a dict, a list, a model perhaps
                push(x)
    return n


#: JSON's scalar types: what holds no keys. Anything else is pushed (a model, perhaps) and looked at.
_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))
