"""Loading a committed cut back into the structure that was saved.

Every byte is hashed once, while it is read (one pass): a large array straight into the memory of the
tensor returned, small ones in runs through one buffer, then copied into tensors of their own
(docs/design.md, "A load's tensors"); a partial load (``keys``) reads only the bytes those keys need and
checks each array's own blake3.
Nothing is unpickled unless the caller passes ``allow_pickle=True``, and nothing is imported by a name
the cut holds: user classes come back as themselves only when named in ``allowed_types``.
"""

from __future__ import annotations

import sys
from itertools import compress
from operator import attrgetter
from typing import Any, Callable, Protocol, Sequence

from .arrays import arrays_from, empty_for, finish_tensor
from .attached import AttachedFile, Restorer
from .errors import CorruptCut, UsageError
from .storage import Storage
from .manifest import FileRecord, Manifest, TensorRecord
from .shards import check_header_matches, read_header, read_shard_into, read_tensor_range
from .tree import leaf_names, unflatten
from .values import allowed_map


class FileTaps(Protocol):
    """Where a whole load hands the stored bytes of each file it reads (issue 21: a restore from the
    mirror writes them back into the local tier as they pass, each byte downloaded once). ``begin``
    returns the file's tap (None: not this one) and ``end`` says whether the read verified; a file's
    bytes are checked only once ``end`` is called with ``ok``."""

    def begin(self, rec: FileRecord) -> Callable[[memoryview | bytes], None] | None: ...
    def end(self, rec: FileRecord, ok: bool) -> None: ...


def _select_tree(m: Manifest, keys: Sequence[str] | None, where: dict[str, Any]) -> dict[str, Any]:
    if keys is None:
        return m.tree
    if m.tree.get("t") != "dict":
        raise UsageError("keys= needs a cut whose state is a dict", **where)
    wanted = list(keys)
    items = [it for it in m.tree.get("items", []) if it.get("k") in wanted or it.get("ik") in wanted]
    found = {it.get("k", it.get("ik")) for it in items}
    missing = [k for k in wanted if k not in found]
    if missing:
        raise UsageError(f"keys {missing!r} are not top-level keys of this cut", **where)
    return {**m.tree, "items": items}


def load_manifest(
    storage: Storage,
    m: Manifest,
    *,
    map_location: Any = "cpu",
    verify: bool = True,
    keys: Sequence[str] | None = None,
    allow_pickle: bool = False,
    allowed_types: Sequence[type] | None = None,
    taps: FileTaps | None = None,
) -> Any:
    """Reads the arrays of a committed cut's manifest and rebuilds its state; enum, dataclass,
    namedtuple, class and OmegaConf values come back as the classes of ``allowed_types`` that they
    name, the others in their plain shapes (docs/format.md, "The tree"). With ``taps`` (a whole load)
    every file of ``m`` is read once, those holding no array of the state through a bounded buffer,
    and its stored bytes handed to the taps as they pass."""
    where = {"store": storage.url, "cut": m.cut}
    allowed = list(allowed_map(allowed_types, where).values())  # a UsageError before any byte is read
    tree = _select_tree(m, keys, where)
    index = m.tensor_index()
    needed = _needed_arrays(m, tree, index, keys, where)
    if taps is not None and keys is not None:
        raise UsageError("a tapped load reads whole files: keys= goes without taps", **where)
    objs = _read_arrays(storage, m, needed, partial=keys is not None, map_location=map_location, verify=verify,
                        where=where, taps=taps)
    leaf = _leaf_maker(objs, map_location, where)
    # On the CPU a plain array node is its array itself (``_leaf_maker``), looked up without a call.
    plain = None if _on_device(map_location) else objs
    return unflatten(tree, leaf, allow_pickle=allow_pickle, where=where, records=index, allowed_types=allowed,
                     plain=plain)


def _needed_arrays(m: Manifest, tree: dict[str, Any], index: dict[str, TensorRecord], keys: Sequence[str] | None,
                   where: dict[str, Any]) -> set[str]:
    """The names of the arrays a load of ``tree`` reads into memory."""
    if keys is None:
        # A whole load reads every array; a tree naming one the manifest lacks fails in _leaf_maker's leaf()
        # (walking a tree of 40,000 leaves twice cost 6% of such a load). Attached files are not state:
        # their bytes are checked through a bounded buffer and dropped (``restore_attached`` writes them out).
        return set(index) - {a.array for a in m.attached}
    needed = set(leaf_names(tree))
    unknown = needed - set(index)
    if unknown:
        raise CorruptCut(f"manifest tree names arrays it does not record: {sorted(unknown)[:3]}", **where)
    return needed


def _read_arrays(storage: Storage, m: Manifest, needed: set[str], *, partial: bool, map_location: Any, verify: bool,
                 where: dict[str, Any], taps: FileTaps | None = None) -> dict[str, Any]:
    """Array name -> the array read (and checked) for every name in ``needed``, shard by shard; a partial
    load (``partial``) reads only the byte ranges it needs of an uncompressed shard."""
    objs: dict[str, Any] = {}
    by_file = _by_file(m)
    for rec in m.files:
        in_file = by_file[rec.name]
        wanted = list(compress(in_file, map(needed.__contains__, map(_name, in_file))))
        if not wanted:
            if taps is not None:  # read and checked for the taps all the same (attached files' shards)
                _read_shard(storage, m, rec, in_file, needed, objs, verify=verify, reuses_buffers=True, taps=taps)
            continue
        if partial and rec.codec == "none" and len(wanted) < len(in_file):
            _read_ranges(storage, m, rec, in_file, wanted, objs, verify=verify, where=where)
            continue
        _read_shard(storage, m, rec, in_file, needed, objs, verify=verify, reuses_buffers=len(wanted) < len(in_file),
                    taps=taps)
        if _on_device(map_location):
            # Move this shard's tensors now, so host memory holds at most one shard (max_shard_bytes)
            # at a time instead of the whole state.
            for t in wanted:
                if t.kind == "torch":
                    objs[t.name] = objs[t.name].to(map_location)
    return objs


def _by_file(m: Manifest) -> dict[str, list[TensorRecord]]:
    """File name -> the records of its arrays, in the manifest's order: one pass, not one per file (a
    cut of many shards of many arrays), and none for a part of one file (every array is in a file of
    the manifest: ``manifest._check_arrays``)."""
    if len(m.files) == 1:
        return {m.files[0].name: list(m.tensors)}
    by_file: dict[str, list[TensorRecord]] = {rec.name: [] for rec in m.files}
    for t in m.tensors:
        by_file[t.file].append(t)
    return by_file


_name = attrgetter("name")


def _read_ranges(storage: Storage, m: Manifest, rec: FileRecord, in_file: list[TensorRecord],
                 wanted: list[TensorRecord], objs: dict[str, Any], *, verify: bool, where: dict[str, Any]) -> None:
    """Reads only the arrays ``wanted`` of the uncompressed shard ``rec``, each by its byte range into a
    new array of ``objs``, each checked against its own blake3."""
    header = read_header(storage, m.cut, rec)
    # The same header checks as a full read, so a partial load never accepts a shard a full
    # load refuses.
    check_header_matches(header, in_file, {**where, "path": f"cuts/{m.cut}/{rec.name}"})
    for t in wanted:
        obj, view = _allocate(t, {**where, "path": f"cuts/{m.cut}/{rec.name}"})
        read_tensor_range(storage, m.cut, rec, header, t, view, verify=verify)
        objs[t.name] = obj


def _leaf_maker(objs: dict[str, Any], map_location: Any, where: dict[str, Any]) -> Callable[[str, dict[str, Any]], Any]:
    """The ``leaf`` callback of ``unflatten``: a tree node's array, finished as the node says."""
    finished: dict[tuple[Any, ...], Any] = {}
    on_cpu = not _on_device(map_location)

    def leaf(name: str, node: dict[str, Any]) -> Any:
        # One object per (array, view, type), so tensors that were shared when saved are shared again,
        # and a Parameter and a plain tensor over one array keep their own types.
        if name not in objs:
            raise CorruptCut(f"manifest tree names arrays it does not record: [{name!r}]", **where)
        if on_cpu and len(node) == 2 and node["t"] != "dtensor":
            # A plain "tensor" or "ndarray" node ({"t", "name"}): the array itself, which finish_tensor
            # returns unchanged (the builder checked that it names an array of the node's kind). Most
            # leaves of a state are these (issue 23: the general path cost 3 us a leaf).
            return objs[name]
        key = (name, node.get("t"), repr(node.get("view")), node.get("param"), node.get("requires_grad"))
        if key not in finished:
            obj = objs[name]
            torch = sys.modules.get("torch")
            if (_on_device(map_location) and torch is not None and isinstance(obj, torch.Tensor)
                    and str(obj.device) != str(map_location)):
                obj = objs[name] = obj.to(map_location)  # once per array: its views share the moved storage
            finished[key] = finish_tensor(obj, node, map_location)
        return finished[key]

    return leaf


def restore_attached(storage: Storage, m: Manifest, restorer: Restorer, *, verify: bool = True) -> None:
    """Streams the attached files of one rank's part ``m`` into ``restorer`` (each hashed while read, through
    one bounded buffer); the caller commits it once this returned. Shards holding none are not opened."""
    by_array = {a.array: a for a in m.attached}
    sink = _AttachedSink(by_array, restorer)
    for rec in m.files:
        in_file = [t for t in m.tensors if t.file == rec.name]
        if any(t.name in by_array for t in in_file):
            read_shard_into(storage, m.cut, rec, in_file, lambda t: None, format_version=m.format_version,
                            verify=verify, reuses_buffers=True, sink=sink)


class _AttachedSink:
    """Passes the bytes of attached-file arrays to the restorer and ignores the state's arrays."""

    def __init__(self, by_array: dict[str, AttachedFile], restorer: Restorer) -> None:
        self.by_array, self.restorer, self.active = by_array, restorer, False

    def begin(self, t: TensorRecord) -> None:
        rec = self.by_array.get(t.name)
        self.active = rec is not None
        if rec is not None:
            self.restorer.begin(rec)

    def write(self, piece: memoryview) -> None:
        if self.active:
            self.restorer.write(piece)

    def end(self, t: TensorRecord) -> None:
        if self.active:
            self.restorer.end()
        self.active = False


def _read_shard(storage: Storage, m: Manifest, rec: FileRecord, in_file: list[TensorRecord], wanted: set[str],
                objs: dict[str, Any], *, verify: bool, reuses_buffers: bool, taps: FileTaps | None = None) -> None:
    """Streams shard ``rec`` once: each array named in ``wanted`` lands in a new array of ``objs``; the
    others are read and checked through a bounded buffer, then dropped. ``taps`` see its stored bytes."""
    path = f"cuts/{m.cut}/{rec.name}"
    where = {"store": storage.url, "cut": m.cut, "path": path}

    def dest(t: TensorRecord) -> memoryview | None:
        if t.name in wanted:
            obj, view = _allocate(t, where)
            objs[t.name] = obj
            return view
        return None

    def take(run: Sequence[TensorRecord], data: memoryview, starts: list[int]) -> None:
        # A run of small arrays read in one piece: built together (issue 23), each its own storage.
        picked = list(map(wanted.__contains__, map(_name, run)))
        if not all(picked):
            run, starts = list(compress(run, picked)), list(compress(starts, picked))
        if run:
            objs.update(zip(map(_name, run), _allocate_run(list(run), data, starts, where)))

    tap = None if taps is None else taps.begin(rec)
    try:
        read_shard_into(storage, m.cut, rec, in_file, dest, format_version=m.format_version, verify=verify,
                        reuses_buffers=reuses_buffers, tap=tap, take=take)
    except BaseException:
        if taps is not None:
            taps.end(rec, False)
        raise
    if taps is not None:
        taps.end(rec, verify)  # an unverified read hands on bytes no one checked: never "ok"


def _allocate(t: TensorRecord, where: dict[str, Any]) -> tuple[Any, memoryview]:
    """The array a record describes, allocated empty. Called only once the shard's size and header
    have been checked against the manifest, so its size is a checked claim; a dtype this torch or
    numpy lacks (a cut from a newer one) is a DataError naming the array, never a raw error."""
    try:
        return empty_for(t.kind, t.dtype, t.shape, t.nbytes)
    except (TypeError, AttributeError) as exc:
        raise CorruptCut(f"array {t.name!r}: cannot allocate {t.kind} dtype {t.dtype!r} here: {exc}", **where) from None


def _allocate_run(ts: list[TensorRecord], data: memoryview, starts: list[int], where: dict[str, Any]) -> list[Any]:
    """The arrays of ``ts`` filled from their bytes in ``data`` (``arrays_from``); a dtype this torch or
    numpy lacks is the DataError of ``_allocate``, naming the first such array."""
    try:
        return arrays_from(ts, data, starts)
    except (TypeError, AttributeError):
        for t in ts:
            _allocate(t, where)
        raise


def _on_device(map_location: Any) -> bool:
    return map_location is not None and str(map_location) != "cpu"
