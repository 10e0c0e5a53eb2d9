"""What is on disk, classified: committed cuts, in-flight or abandoned leftovers, foreign files.

:func:`scan` is the thin I/O part (list the store, parse LATEST, marks and manifests without trusting
any name); :func:`classify` is pure and applies the protocol's invariant (see
:mod:`ckptstore.protocol`): a cut is committed iff it has a valid manifest and either no mark or LATEST
names it. ``verify``, ``gc``, recovery on open and ``ls`` all read the same :class:`Classification`, so
they can never disagree about what a cut is.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from . import hashing, layout
from .errors import CkptStoreError, DataError
from .storage import Storage
from .latest import Pointer
from .manifest import Manifest
from .marks import BadCut, Mark


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
    tmp_files: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


@dataclass
class Leftover:
    """Something an interrupted save or prune left behind. ``owner_alive`` is None when unknown."""

    cut: str | None
    kind: str  # "in-progress" | "abandoned" | "stale-mark" | "temp-file" | "orphan-mark"
    paths: list[str]
    owner: str | None = None
    owner_alive: bool | None = None


@dataclass
class Classification:
    committed: list[Manifest]  # ascending by step
    latest: Pointer | None
    latest_problem: str | None  # None when LATEST is fine (or absent in an empty store)
    latest_problem_kind: str | None  # "missing" | "unreadable" | "dangling" | "hash-mismatch"
    leftovers: list[Leftover]
    broken: dict[str, DataError]  # cut dirs whose manifest is damaged (not crash leftovers)
    foreign: list[str]
    bad: set[str]

    def committed_ids(self) -> set[str]:
        return {m.cut for m in self.committed}

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
    updated to hold exactly this scan's manifests."""
    st = DiskState()
    seen: ManifestCache = {}
    where = {"store": storage.url}
    for entry in storage.list_dir(""):
        if layout.is_tmp_name(entry.name) and not entry.is_dir:
            st.tmp_files.append(entry.name)
        elif entry.name not in layout.ROOT_ENTRIES:
            st.foreign.append(entry.name)
    if storage.exists(layout.LATEST_FILE):
        st.latest_present = True
        try:
            st.latest = Pointer.from_bytes(storage.read_bytes(layout.LATEST_FILE), path=layout.LATEST_FILE, **where)
        except DataError as exc:
            st.latest_error = exc
    for entry in storage.list_dir(layout.CUTS_DIR):
        rel = f"{layout.CUTS_DIR}/{entry.name}"
        if layout.is_tmp_name(entry.name) and not entry.is_dir:
            st.tmp_files.append(rel)
            continue
        if not entry.is_dir or not layout.is_cut_id(entry.name):
            st.foreign.append(rel)
            continue
        st.cut_dirs.add(entry.name)
        listing = storage.list_dir(rel)
        names = {e.name for e in listing}
        for n in (e.name for e in listing if not e.is_dir):
            if layout.is_tmp_name(n):
                st.tmp_files.append(f"{rel}/{n}")
        if layout.MANIFEST_FILE in names:
            mpath = layout.manifest_path(entry.name)
            try:
                data = storage.read_bytes(mpath)
                digest = hashing.digest(data)
                key = (entry.name, digest)
                m = cache.get(key) if cache is not None else None
                if m is None:
                    m = Manifest.from_bytes(data, cut=entry.name, path=mpath, **where)
                if m.cut != entry.name:
                    raise DataError(f"manifest names cut {m.cut!r} but lives in {entry.name!r}",
                                    cut=entry.name, path=mpath, **where)
                seen[key] = m
                st.manifests[entry.name] = m
                st.manifest_hashes[entry.name] = digest
            except DataError as exc:
                st.broken_manifests[entry.name] = exc
    for sub, target in ((layout.MARKS_DIR, st.marks), (layout.BAD_DIR, st.bad)):
        for entry in storage.list_dir(sub):
            rel = f"{sub}/{entry.name}"
            if layout.is_tmp_name(entry.name) and not entry.is_dir:
                st.tmp_files.append(rel)
                continue
            cut = layout.cut_id_of_mark(entry.name)
            if cut is None or entry.is_dir:
                st.foreign.append(rel)
                continue
            model = Mark if sub == layout.MARKS_DIR else BadCut
            try:
                target[cut] = model.from_bytes(storage.read_bytes(rel), cut=cut, path=rel, **where)  # type: ignore[attr-defined]
            except CkptStoreError:
                target[cut] = None  # unreadable: still ours by name, so it is handled, not ignored
    if cache is not None:
        cache.clear()
        cache.update(seen)
    return st


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
                leftovers.append(Leftover(cut, "stale-mark", [layout.mark_path(cut)]))
            continue
        if cut in st.broken_manifests and cut not in st.marks:
            continue  # damage, reported as broken; never deleted as a leftover
        if cut in st.marks:
            owner = f"{mark.host}:{mark.pid}" if mark is not None else None
            kind = "in-progress" if cut in st.cut_dirs else "orphan-mark"
            leftovers.append(Leftover(cut, kind, paths, owner, owner_alive(mark)))
        else:
            leftovers.append(Leftover(cut, "abandoned", paths))
    for rel in st.tmp_files:
        leftovers.append(Leftover(None, "temp-file", [rel]))

    problem = kind = None
    if st.latest_error is not None:
        problem, kind = f"LATEST is unreadable: {st.latest_error.message}", "unreadable"
    elif st.latest is not None:
        if latest_cut in st.broken_manifests:
            # Say why: "not a committed cut" alone hides that its manifest exists but is damaged.
            exc = st.broken_manifests[latest_cut]
            problem, kind = f"LATEST names {latest_cut}, whose manifest is damaged ({exc.path}: {exc.message})", "dangling"
        elif latest_cut not in committed_ids:
            problem, kind = f"LATEST names {latest_cut}, which is not a committed cut", "dangling"
        elif st.manifest_hashes.get(latest_cut) != st.latest.manifest_blake3:
            problem, kind = f"LATEST's manifest hash does not match {latest_cut}'s manifest", "hash-mismatch"
    elif committed:
        problem, kind = "LATEST is missing although committed cuts exist", "missing"
    return Classification(
        committed=committed,
        latest=st.latest if problem is None else None,
        latest_problem=problem,
        latest_problem_kind=kind,
        leftovers=leftovers,
        broken=dict(st.broken_manifests),
        foreign=sorted(st.foreign),
        bad=set(st.bad),
    )
