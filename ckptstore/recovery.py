"""What is on disk, classified: committed cuts, in-flight or abandoned leftovers, foreign files.

:func:`scan` is the thin I/O part (list the store, parse LATEST, marks and manifests without trusting
any name); :func:`classify` is pure and applies the protocol's invariant (see
:mod:`ckptstore.protocol`): a cut is committed iff it has a valid manifest and either no mark or LATEST
names it. ``verify``, ``gc``, recovery on open and ``ls`` all read the same :class:`Classification`, so
they can never disagree about what a cut is.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from . import hashing, layout
from .errors import CkptStoreError, CorruptCut, DataError, ManifestError, StorageError
from .storage import Entry, Storage
from .latest import Pointer
from .manifest import Manifest
from .info import CutInfo
from .kinds import StrKind
from .labels import Label, is_label_file_name, label_path
from .marks import BadCut, FinalMark, Mark
from .paths import refuse_symlinked_dirs


class LeftoverKind(StrKind):
    """What an interrupted save, prune or label left behind (``Leftover.kind``); spelled as before in
    JSON, events and tables (issue 20: these kinds were listed only in a comment)."""

    IN_PROGRESS = "in-progress"  # a marked cut with a directory: its writer is running or died
    ORPHAN_MARK = "orphan-mark"  # a mark whose cut directory was never made
    ABANDONED = "abandoned"  # a cut directory with neither manifest nor mark (a crash mid-prune or -abandon)
    STALE_MARK = "stale-mark"  # the mark of a committed cut (step 6 never ran)
    TEMP_FILE = "temp-file"  # a durable write's sibling temp file
    STALE_LABEL = "stale-label"  # a label naming a cut that is not committed
    BROKEN_LABEL = "broken-label"  # a label file that does not parse or hash to its name
    STALE_FINAL_MARK = "stale-final-mark"  # a final mark whose cut is gone
    UPLOAD = "upload"  # an S3 multipart upload no live writer runs (listed by gc and recovery only)


class LatestProblem(StrKind):
    """Why LATEST is not healthy (``Classification.latest_problem_kind``)."""

    MISSING = "missing"
    UNREADABLE = "unreadable"
    DANGLING = "dangling"
    HASH_MISMATCH = "hash-mismatch"


@dataclass
class DiskState:
    """Everything read from a store root, parsed but not judged."""

    latest: Pointer | None = None
    latest_error: DataError | None = None
    latest_present: bool = False
    manifests: dict[str, Manifest] = field(default_factory=dict)
    manifest_hashes: dict[str, str] = field(default_factory=dict)
    broken_manifests: dict[str, DataError] = field(default_factory=dict)
    cut_dirs: set[str] = field(default_factory=set)
    marks: dict[str, Mark | None] = field(default_factory=dict)
    bad: dict[str, BadCut | None] = field(default_factory=dict)
    final: dict[str, FinalMark | None] = field(default_factory=dict)
    labels: dict[str, Label] = field(default_factory=dict)  # label -> its record
    broken_labels: list[str] = field(default_factory=list)  # label files that do not parse (rel paths)
    tmp_files: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


@dataclass
class Leftover:
    """Something an interrupted save or prune left behind. ``owner_alive`` is None when unknown;
    ``upload_id`` is the server's id of an ``upload`` (its object's path is ``paths[0]``)."""

    cut: str | None
    kind: LeftoverKind
    paths: list[str]
    owner: str | None = None
    owner_alive: bool | None = None
    upload_id: str | None = None


@dataclass
class Classification:
    committed: list[Manifest]  # ascending by step
    latest: Pointer | None
    latest_problem: str | None  # None when LATEST is fine (or absent in an empty store)
    latest_problem_kind: LatestProblem | None
    leftovers: list[Leftover]
    broken: dict[str, DataError]  # cut dirs whose manifest is damaged (not crash leftovers)
    foreign: list[str]
    bad: set[str]
    final: set[str] = field(default_factory=set)  # committed cuts marked final after their commit
    labels: dict[str, str] = field(default_factory=dict)  # label -> committed cut it names

    def committed_ids(self) -> set[str]:
        return {m.cut for m in self.committed}

    def info(self, m: Manifest) -> CutInfo:
        """The CutInfo of a committed cut, final when its manifest or a final mark says so."""
        return CutInfo.from_manifest(m, marked_final=m.cut in self.final)

    def find(self, cut: str) -> Manifest | None:
        for m in self.committed:
            if m.cut == cut:
                return m
        return None


#: Parsed manifests by (cut, blake3 of their bytes): a handle re-scans its store at every save and prune,
#: and parsing a manifest of tens of thousands of tensors costs far more than reading and hashing it.
ManifestCache = dict[tuple[str, str], Manifest]


def scan(storage: Storage, cache: ManifestCache | None = None) -> DiskState:
    """Reads a store root into a :class:`DiskState`. Names are checked before they are used as paths.
    ``cache`` (optional) reuses manifests parsed by an earlier scan whose bytes are unchanged; it is
    updated to hold exactly this scan's manifests. The order of the reads is part of the contract
    (docs/design.md: LATEST first, then ``cuts/``, then ``marks/``; see :func:`classify_now`)."""
    refuse_symlinked_dirs(storage)  # before anything is listed, read or (by gc, prune, open) deleted
    st = DiskState()
    seen: ManifestCache = {}
    where = {"store": storage.url}
    present = _scan_root(storage, st)
    _scan_latest(storage, st, where)
    for entry in storage.list_dir(layout.CUTS_DIR):
        _scan_cut_dir(storage, st, entry, cache, seen, where)
    for sub, target in ((layout.MARKS_DIR, st.marks), (layout.BAD_DIR, st.bad), (layout.FINAL_DIR, st.final)):
        # marks/ is always listed: a mark created after the root listing must still be seen, or a cut in
        # progress would pass for committed. Bad records, final marks and labels only annotate
        # committed cuts: a directory absent from the root listing is not listed (on an object store,
        # each listing of a missing prefix costs two requests).
        if sub != layout.MARKS_DIR and sub not in present:
            continue
        _scan_records(storage, st, sub, target, where)
    if layout.LABELS_DIR in present:
        _scan_labels(storage, st, where)
    if cache is not None:
        cache.clear()
        cache.update(seen)
    return st


def _scan_root(storage: Storage, st: DiskState) -> set[str]:
    """Lists the store root into ``st`` (temp files, foreign entries); returns the names present."""
    root = storage.list_dir("")
    for entry in root:
        if layout.is_tmp_name(entry.name) and not entry.is_dir:
            st.tmp_files.append(entry.name)
        elif entry.name not in layout.ROOT_ENTRIES:
            st.foreign.append(entry.name)
    return {entry.name for entry in root}


def _scan_latest(storage: Storage, st: DiskState, where: dict[str, str]) -> None:
    """Reads LATEST into ``st``: its pointer, or the DataError that it does not parse."""
    if storage.exists(layout.LATEST_FILE):
        st.latest_present = True
        try:
            data = _read_own(storage, layout.LATEST_FILE, where)
            if data is None:  # removed since the exists() above (a concurrent repair): absent
                st.latest_present = False
            else:
                st.latest = Pointer.from_bytes(data, path=layout.LATEST_FILE, **where)
        except DataError as exc:
            st.latest_error = exc


def _scan_cut_dir(storage: Storage, st: DiskState, entry: Entry, cache: ManifestCache | None, seen: ManifestCache,
                  where: dict[str, str]) -> None:
    """Reads one entry of ``cuts/`` into ``st``: a cut directory (its temp files and its manifest), a
    temp file, or a foreign entry."""
    rel = f"{layout.CUTS_DIR}/{entry.name}"
    if layout.is_tmp_name(entry.name) and not entry.is_dir:
        st.tmp_files.append(rel)
        return
    if not entry.is_dir or not layout.is_cut_id(entry.name):
        st.foreign.append(rel)
        return
    st.cut_dirs.add(entry.name)
    listing = storage.list_dir(rel)
    names = {e.name for e in listing}
    for n in (e.name for e in listing if not e.is_dir):
        if layout.is_tmp_name(n):
            st.tmp_files.append(f"{rel}/{n}")
    if layout.MANIFEST_FILE in names:
        _scan_manifest(storage, st, entry.name, cache, seen, where)


def _scan_manifest(storage: Storage, st: DiskState, cut: str, cache: ManifestCache | None, seen: ManifestCache,
                   where: dict[str, str]) -> None:
    """Reads the manifest of ``cut`` into ``st`` (parsed, or reused from ``cache`` when its bytes are
    unchanged), or records it broken; adds it to ``seen``."""
    mpath = layout.manifest_path(cut)
    try:
        data = _read_own(storage, mpath, {**where, "cut": cut})
        if data is None:
            return  # uncommitted by a concurrent prune since the listing: the cut is going
        digest = hashing.digest(data)
        key = (cut, digest)
        m = cache.get(key) if cache is not None else None
        if m is None:
            m = Manifest.from_bytes(data, cut=cut, path=mpath, **where)
        if m.cut != cut:
            raise DataError(f"manifest names cut {m.cut!r} but lives in {cut!r}", cut=cut, path=mpath, **where)
        seen[key] = m
        st.manifests[cut] = m
        st.manifest_hashes[cut] = digest
    except DataError as exc:
        st.broken_manifests[cut] = exc


def _scan_records(storage: Storage, st: DiskState, sub: str, target: dict[str, Any], where: dict[str, str]) -> None:
    """Reads the per-cut records of ``sub`` (``marks/``, ``bad/`` or ``final/``) into ``target``: cut ->
    its record, None when it is ours by name but does not read."""
    model = {layout.MARKS_DIR: Mark, layout.BAD_DIR: BadCut, layout.FINAL_DIR: FinalMark}[sub]
    for entry in storage.list_dir(sub):
        rel = f"{sub}/{entry.name}"
        if layout.is_tmp_name(entry.name) and not entry.is_dir:
            st.tmp_files.append(rel)
            continue
        cut = layout.cut_id_of_mark(entry.name)
        if cut is None or entry.is_dir:
            st.foreign.append(rel)
            continue
        try:
            data = _read_own(storage, rel, where)
            if data is None:
                continue  # removed since the listing (its cut committed or was collected): no mark
            target[cut] = model.from_bytes(data, cut=cut, path=rel, **where)  # type: ignore[attr-defined]
        except CkptStoreError:
            target[cut] = None  # unreadable: still ours by name, so it is handled, not ignored


def _scan_labels(storage: Storage, st: DiskState, where: dict[str, Any]) -> None:
    """Reads ``labels/`` into ``st``: each label file must parse and hash to its own name; one that does
    not is a broken label (reported, removed by gc, never followed)."""
    for entry in storage.list_dir(layout.LABELS_DIR):
        rel = f"{layout.LABELS_DIR}/{entry.name}"
        if layout.is_tmp_name(entry.name) and not entry.is_dir:
            st.tmp_files.append(rel)
            continue
        if entry.is_dir or not is_label_file_name(entry.name):
            st.foreign.append(rel)
            continue
        try:
            data = _read_own(storage, rel, where)
            if data is None:
                continue  # removed since the listing
            lab = Label.from_bytes(data, path=rel, **where)
            if label_path(lab.label) != rel:
                raise ManifestError(f"label file {rel} holds label {lab.label[:80]!r}, whose file is "
                                    f"{label_path(lab.label)}", path=rel, **where)
            st.labels[lab.label] = lab
        except CkptStoreError:
            st.broken_labels.append(rel)  # ours by name: reported (and removed by gc), never followed


#: errnos that say "this name is not a regular file" (a directory, a FIFO, a symlink planted where the store
#: keeps one of its small files): damage of that one file, never a reason for every command to fail.
_NOT_A_FILE = frozenset({errno.EISDIR, errno.EINVAL, errno.ELOOP, errno.ENOTSUP, errno.EOPNOTSUPP})


def _read_own(storage: Storage, rel: str, where: dict[str, str]) -> bytes | None:
    """The bytes of one of the store's small files (LATEST, a manifest, a mark), None when it vanished
    since it was listed (a concurrent prune, commit or repair removed it: not damage). A name that is not
    a regular file raises ``CorruptCut`` for that file only; any other I/O error (EIO, a timeout) is
    raised as is, so "cannot tell" never reads as "absent" or "damaged"."""
    try:
        return storage.read_bytes(rel)
    except StorageError as exc:
        if exc.errno == errno.ENOENT:
            return None
        if exc.errno in _NOT_A_FILE:
            raise CorruptCut(f"{rel} is not a regular file (a directory, FIFO or symlink stands in its place)",
                             path=rel, **where) from exc
        raise


def owner_alive(mark: Mark | None) -> bool | None:
    """Whether the process that wrote a mark still runs; None when it is on another host or unknown."""
    if mark is None or mark.host != socket.gethostname():
        return None
    if mark.pid == os.getpid():
        return True
    try:
        os.kill(mark.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: How many times a read is repeated while LATEST keeps moving under it (see :func:`classify_now`).
MAX_RESCANS = 5


def classify_now(storage: Storage, cache: ManifestCache | None = None) -> Classification:
    """``classify(scan(storage))``, scanned again while the result shows a LATEST problem *and* LATEST
    changed since the previous scan. A reader scans while a writer may commit: it reads LATEST first,
    so a cut committed (manifest written, LATEST moved, mark removed) during the rest of its scan looks
    committed with LATEST missing, and a prune of LATEST's old cut right after looks like a dangling
    LATEST, although the store is fine. A problem that stays while LATEST stays the same is real."""
    st = scan(storage, cache)
    cls = classify(st)
    for _ in range(MAX_RESCANS):
        if cls.latest_problem is None:
            break
        again = scan(storage, cache)
        moved = _pointer_state(again) != _pointer_state(st)
        st, cls = again, classify(again)
        if not moved:
            break
    return cls


def _pointer_state(st: DiskState) -> tuple[Any, ...]:
    return (st.latest_present, st.latest, st.latest_error.message if st.latest_error is not None else None)


def classify(st: DiskState) -> Classification:
    """Applies the protocol invariant to a scanned store. Pure apart from :func:`owner_alive`."""
    latest_cut = st.latest.cut if st.latest is not None else None
    committed = [
        m for cut, m in st.manifests.items() if cut not in st.marks or cut == latest_cut
    ]
    committed.sort(key=lambda m: (m.step, m.created_at))
    committed_ids = {m.cut for m in committed}
    leftovers: list[Leftover] = []
    for cut in sorted(set(st.marks) | st.cut_dirs):
        mark = st.marks.get(cut)
        paths = []
        if cut in st.cut_dirs:
            paths.append(layout.cut_dir(cut))
        if cut in st.marks:
            paths.append(layout.mark_path(cut))
        if cut in committed_ids:
            if cut in st.marks:
                leftovers.append(Leftover(cut, LeftoverKind.STALE_MARK, [layout.mark_path(cut)]))
            continue
        if cut in st.broken_manifests and cut not in st.marks:
            continue  # damage, reported as broken; never deleted as a leftover
        if cut in st.marks:
            owner = f"{mark.host}:{mark.pid}" if mark is not None else None
            kind = LeftoverKind.IN_PROGRESS if cut in st.cut_dirs else LeftoverKind.ORPHAN_MARK
            leftovers.append(Leftover(cut, kind, paths, owner, owner_alive(mark)))
        else:
            leftovers.append(Leftover(cut, LeftoverKind.ABANDONED, paths))
    for rel in st.tmp_files:
        leftovers.append(Leftover(None, LeftoverKind.TEMP_FILE, [rel]))
    for lab in sorted(st.labels.values(), key=lambda x: x.label):
        if lab.cut not in committed_ids:
            leftovers.append(Leftover(lab.cut, LeftoverKind.STALE_LABEL, [label_path(lab.label)]))
    for rel in st.broken_labels:
        leftovers.append(Leftover(None, LeftoverKind.BROKEN_LABEL, [rel]))
    for cut in sorted(set(st.final) - committed_ids):
        # A cut id is never reused, so a final mark whose cut is gone can never apply again.
        leftovers.append(Leftover(cut, LeftoverKind.STALE_FINAL_MARK, [layout.final_path(cut)]))
    problem, latest_kind = _latest_health(st, committed_ids)
    return Classification(
        committed=committed,
        latest=st.latest if problem is None else None,
        latest_problem=problem,
        latest_problem_kind=latest_kind,
        leftovers=leftovers,
        broken=dict(st.broken_manifests),
        foreign=sorted(st.foreign),
        bad=set(st.bad),
        final={c for c in st.final if c in committed_ids},
        labels={name: lab.cut for name, lab in st.labels.items() if lab.cut in committed_ids},
    )


def _latest_health(st: DiskState, committed_ids: set[str]) -> tuple[str | None, LatestProblem | None]:
    """What is wrong with LATEST, and its kind; (None, None) when it is fine or rightly absent."""
    latest_cut = st.latest.cut if st.latest is not None else None
    if st.latest_error is not None:
        return f"LATEST is unreadable: {st.latest_error.message}", LatestProblem.UNREADABLE
    if st.latest is None:
        if committed_ids:
            return "LATEST is missing although committed cuts exist", LatestProblem.MISSING
        return None, None
    if latest_cut in st.broken_manifests:
        # Say why: "not a committed cut" alone hides that its manifest exists but is damaged.
        exc = st.broken_manifests[latest_cut]
        return (f"LATEST names {latest_cut}, whose manifest is damaged ({exc.path}: {exc.message})",
                LatestProblem.DANGLING)
    if latest_cut not in committed_ids:
        return f"LATEST names {latest_cut}, which is not a committed cut", LatestProblem.DANGLING
    if st.manifest_hashes.get(latest_cut) != st.latest.manifest_blake3:
        return f"LATEST's manifest hash does not match {latest_cut}'s manifest", LatestProblem.HASH_MISMATCH
    return None, None
