"""Store audits: re-hash every file of every committed cut and report findings, never stopping at the
first one.

A finding has a ``severity``: "error" (committed data or the commit point is damaged: the audit fails)
or "notice" (leftovers of an interrupted save or prune, foreign files: ``gc`` material, not damage),
and a :class:`FindingKind`, compared by member, never by a prefix or a message's words (issue 20).
Notices about manifest metadata an integration owns come from that integration's check
(:mod:`ckptstore.metachecks`), with kinds of its own (a :class:`~ckptstore.metachecks.NoticeKind`).
"""

from __future__ import annotations

import errno

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import hashing, layout
from .assemble import fragment_path, part_manifest, read_fragment
from .errors import (CkptStoreError, StorageError, CorruptCut, DataError, HashMismatch, MissingFile, NotAFile,
                     TruncatedFile)
from .kinds import StrKind
from .latest import Pointer
from .storage import Storage
from .manifest import FileRecord, Manifest
from .metachecks import NoticeKind, notice_kind
from .metachecks import notices as metadata_notices
from .recovery import Classification, LatestProblem, LeftoverKind
from .shards import check_file_digest_v2, check_header_matches, local_digests_v2, read_header, read_shard_into
from .tree import check_tree, has_pickle, leaf_names

Progress = Callable[[int], None]


class FindingKind(StrKind):
    """What an audit found; spelled in JSON and tables as before."""

    # errors about one file of a committed cut
    MISSING_FILE = "missing-file"
    SIZE_MISMATCH = "size-mismatch"
    HASH_MISMATCH = "hash-mismatch"
    TRUNCATED = "truncated"
    NOT_A_FILE = "not-a-file"
    CORRUPT_FILE = "corrupt-file"
    UNREADABLE = "unreadable"
    IO_ERROR = "io-error"  # could not read: proves nothing about the bytes
    # errors about a cut or the commit point
    MANIFEST_BROKEN = "manifest-broken"
    TREE_INVALID = "tree-invalid"
    LATEST_MISSING = "latest-missing"
    LATEST_UNREADABLE = "latest-unreadable"
    LATEST_DANGLING = "latest-dangling"
    LATEST_HASH_MISMATCH = "latest-hash-mismatch"
    # notices (an integration's metadata checks add kinds of their own: ckptstore.metachecks)
    RECORDED_BAD = "recorded-bad"
    REMOVED_DURING_VERIFY = "removed-during-verify"
    FOREIGN = "foreign"
    LEFTOVER_IN_PROGRESS = "leftover-in-progress"
    LEFTOVER_ORPHAN_MARK = "leftover-orphan-mark"
    LEFTOVER_ABANDONED = "leftover-abandoned"
    LEFTOVER_STALE_MARK = "leftover-stale-mark"
    LEFTOVER_TEMP_FILE = "leftover-temp-file"
    LEFTOVER_STALE_LABEL = "leftover-stale-label"
    LEFTOVER_BROKEN_LABEL = "leftover-broken-label"
    LEFTOVER_STALE_FINAL_MARK = "leftover-stale-final-mark"
    LEFTOVER_UPLOAD = "leftover-upload"  # never reported by verify: only gc lists uploads (issue 24)

    @property
    def about_latest(self) -> bool:
        """Whether this finding is about LATEST itself (not about the cut being audited)."""
        return self in _OF_LATEST.values()

    @classmethod
    def of_latest(cls, problem: LatestProblem) -> "FindingKind":
        return _OF_LATEST[problem]

    @classmethod
    def of_leftover(cls, kind: LeftoverKind) -> "FindingKind":
        return _OF_LEFTOVER[kind]


_OF_LATEST = {
    LatestProblem.MISSING: FindingKind.LATEST_MISSING,
    LatestProblem.UNREADABLE: FindingKind.LATEST_UNREADABLE,
    LatestProblem.DANGLING: FindingKind.LATEST_DANGLING,
    LatestProblem.HASH_MISMATCH: FindingKind.LATEST_HASH_MISMATCH,
}
_OF_LEFTOVER = {
    LeftoverKind.IN_PROGRESS: FindingKind.LEFTOVER_IN_PROGRESS,
    LeftoverKind.ORPHAN_MARK: FindingKind.LEFTOVER_ORPHAN_MARK,
    LeftoverKind.ABANDONED: FindingKind.LEFTOVER_ABANDONED,
    LeftoverKind.STALE_MARK: FindingKind.LEFTOVER_STALE_MARK,
    LeftoverKind.TEMP_FILE: FindingKind.LEFTOVER_TEMP_FILE,
    LeftoverKind.STALE_LABEL: FindingKind.LEFTOVER_STALE_LABEL,
    LeftoverKind.BROKEN_LABEL: FindingKind.LEFTOVER_BROKEN_LABEL,
    LeftoverKind.STALE_FINAL_MARK: FindingKind.LEFTOVER_STALE_FINAL_MARK,
    LeftoverKind.UPLOAD: FindingKind.LEFTOVER_UPLOAD,
}


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "notice"
    kind: FindingKind | NoticeKind
    message: str
    cut: str | None = None
    path: str | None = None
    expected: str | None = None
    found: str | None = None

    def __post_init__(self) -> None:
        # A kind given by its spelling becomes the member; an unknown one is refused here, not
        # reported under a kind no reader knows.
        object.__setattr__(self, "kind", _finding_kind(self.kind))


def _finding_kind(kind: str) -> FindingKind | NoticeKind:
    """The member a kind spells: the store's own, else a notice kind an integration registered."""
    if isinstance(kind, (FindingKind, NoticeKind)):
        return kind
    try:
        return FindingKind(kind)
    except ValueError:
        found = notice_kind(kind)
        if found is None:
            raise
        return found


@dataclass
class VerifyReport:
    store: str
    cuts_checked: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_hashed: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def bad_cuts(self) -> set[str]:
        return {f.cut for f in self.errors if f.cut is not None}

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store, "ok": self.ok, "cuts_checked": self.cuts_checked,
            "files_checked": self.files_checked, "bytes_hashed": self.bytes_hashed,
            "findings": [asdict(f) for f in self.findings],
        }


def verify_file(storage: Storage, m: Manifest, rec: FileRecord, progress: Progress | None = None) -> list[Finding]:
    """Checks one file of a cut: presence, size, its digests as the manifest's ``format_version``
    defines them (v2: every array's blake3, then the file digest; v1: the plain blake3 of the stored
    and raw bytes), and its header against the manifest. Returns findings instead of raising."""
    rel = layout.cut_file(m.cut, rec.name)
    try:
        return _check_file(storage, m, rec, rel, progress)
    except (CkptStoreError, FileNotFoundError) as exc:
        return [_error_finding(storage, exc, m.cut, rel)]


def _check_file(storage: Storage, m: Manifest, rec: FileRecord, rel: str, progress: Progress | None) -> list[Finding]:
    """``verify_file``'s checks; damage it finds by comparing is a finding, damage a read finds raises."""
    tensors = [t for t in m.tensors if t.file == rec.name]
    if not storage.exists(rel):
        return [Finding("error", FindingKind.MISSING_FILE, f"{rel} is missing", m.cut, rel)]
    size = storage.size(rel)
    if size != rec.nbytes:
        return [Finding("error", FindingKind.SIZE_MISMATCH, f"{rel}: expected {rec.nbytes} bytes, found {size}",
                        m.cut, rel, str(rec.nbytes), str(size))]
    local = storage.local_path(rel)
    where = {"store": storage.url, "cut": m.cut, "path": rel}
    if rec.codec == "none" and local is not None and m.format_version >= 2:
        # Each byte hashed once: every array's range of the mapped file, then the file digest of
        # the bytes before the data section and the array digests. Hashes before structure, so
        # damage anywhere (header included) is a hash-mismatch with both digests named.
        digests, got = local_digests_v2(storage, rel, rec, tensors, where)
        if progress is not None:
            progress(size)
        for t, d in digests:
            if d.hex() != t.blake3:
                return [Finding("error", FindingKind.HASH_MISMATCH, f"{rel}: tensor {t.name!r}: blake3 mismatch",
                                m.cut, rel, t.blake3, d.hex())]
        try:
            check_file_digest_v2(rec, got, where)
        except HashMismatch:
            expected = rec.raw_blake3 if got != rec.raw_blake3 else rec.blake3
            return [Finding("error", FindingKind.HASH_MISMATCH, f"{rel}: blake3 mismatch (file digest: header "
                            "bytes)", m.cut, rel, expected, got)]
        check_header_matches(read_header(storage, m.cut, rec), tensors, where)
    elif rec.codec == "none" and local is not None:
        got = hashing.digest_file(local)
        if progress is not None:
            progress(size)
        if got != rec.blake3:
            return [Finding("error", FindingKind.HASH_MISMATCH, f"{rel}: blake3 mismatch", m.cut, rel, rec.blake3,
                            got)]
        check_header_matches(read_header(storage, m.cut, rec), tensors, where)
    else:
        # Each array streams through one buffer of at most 8 MiB (never its own size: a 131 KB zstd
        # bomb claiming a 4 GiB array cost 4.2 GB here, issue 10 item 9).
        read_shard_into(storage, m.cut, rec, tensors, lambda t: None,
                        format_version=m.format_version, verify=True, on_bytes=progress, reuses_buffers=True)
    return []


def _error_finding(storage: Storage, exc: CkptStoreError | FileNotFoundError, cut: str, rel: str) -> Finding:
    """The finding of an error raised while one file was checked; the first class that matches wins."""
    message = exc.message if isinstance(exc, CkptStoreError) else str(exc)
    missing = Finding("error", FindingKind.MISSING_FILE, f"{rel} is missing", cut, rel)
    if isinstance(exc, TruncatedFile):
        return Finding("error", FindingKind.TRUNCATED, message, cut, rel)
    if isinstance(exc, NotAFile):  # a symlink, FIFO or directory in the shard's place: damage (issue 19 item 12)
        return Finding("error", FindingKind.NOT_A_FILE, message, cut, rel)
    if isinstance(exc, MissingFile):  # deleted between the exists() check and reading it
        return missing
    if isinstance(exc, HashMismatch):  # by type: a tensor may be named "blake3" (issue 20)
        return Finding("error", FindingKind.HASH_MISMATCH, message, cut, rel)
    if isinstance(exc, CorruptCut):
        return Finding("error", FindingKind.CORRUPT_FILE, message, cut, rel)
    if not isinstance(exc, CkptStoreError):  # a raw FileNotFoundError (a backend, a plain hashing read)
        return missing
    if isinstance(exc, StorageError):
        if exc.errno == errno.ENOENT:
            return missing
        # Could not read: proves nothing about the bytes. Fallback and repair raise on it instead of
        # skipping or quarantining the cut (ckptstore.selection).
        return Finding("error", FindingKind.IO_ERROR, message, cut, rel)
    if isinstance(exc, FileNotFoundError) or not _exists(storage, rel):
        # gone since the exists() check (a StoreNotFound, say), or while it was read: absent, not
        # unreadable (issue 10, item 12)
        return missing
    return Finding("error", FindingKind.UNREADABLE, message, cut, rel)


def _exists(storage: Storage, rel: str) -> bool:
    try:
        return storage.exists(rel)
    except CkptStoreError:
        return True  # cannot tell: keep what the read found


def tree_problem(m: Manifest) -> str | None:
    """Why a manifest's tree could not be loaded (names no recorded array, holds a pickle the manifest
    does not declare, or a node a load could not decode), or None. Checked without loading anything,
    by the decoder loads use (``tree.check_tree``)."""
    for rank, _ in m.rank_trees():
        problem = part_tree_problem(m.for_rank(rank), rank)
        if problem is not None:
            return problem
    return None


def part_tree_problem(part: Manifest, rank: int) -> str | None:
    """``tree_problem`` of rank ``rank``'s part (``Manifest.for_rank``, or a fragment's)."""
    of_rank = f" of rank {rank}" if part.world_size > 1 else ""
    names = set(leaf_names(part.tree))
    unknown = names - {t.name for t in part.tensors}
    if unknown:
        return f"tree{of_rank} names arrays the manifest does not record: {sorted(unknown)[:3]}"
    if has_pickle(part.tree) and not part.pickled:
        return f"tree{of_rank} holds a pickled value the manifest does not declare (hostile or damaged)"
    try:  # every node, decoded as a load decodes it (issue 10, item 8)
        check_tree(part.tree, part.tensor_index())
    except CkptStoreError as exc:
        return f"rank {rank}: {exc.message}" if of_rank else exc.message
    return None


def verify_store(
    storage: Storage,
    cls: Classification,
    *,
    cut: str | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Audits the committed cuts (or one, by id) and reports the store-level state around them."""
    report = VerifyReport(store=storage.url)
    add = report.findings.append
    if cls.latest_problem is not None:
        kind = FindingKind.of_latest(cls.latest_problem_kind)  # type: ignore[arg-type]
        add(Finding("error", kind, cls.latest_problem + "; run `ckptstore repair`", path=layout.LATEST_FILE))
    for c, exc in cls.broken.items():
        # Only in a whole-store audit: another cut's damage must not fail a one-cut audit (repair
        # checks one cut at a time and would otherwise find no cut that verifies).
        if cut is None:
            add(Finding("error", FindingKind.MANIFEST_BROKEN, exc.message, c, layout.manifest_path(c)))
    targets = cls.committed if cut is None else [m for m in cls.committed if m.cut == cut]
    for m in targets:
        report.cuts_checked.append(m.cut)
        start = len(report.findings)
        parts = _parts(storage, m, report)
        problem = tree_problem(m) if not m.fragmented else next(
            (p for r, part in parts if (p := part_tree_problem(part, r)) is not None), None)
        if problem is not None:
            add(Finding("error", FindingKind.TREE_INVALID, problem, m.cut, layout.manifest_path(m.cut)))
        # What the integrations that own keys of the cut's metadata say about it (issue 20: the store
        # layer knows none of them).
        for kind, message in metadata_notices(m.metadata):
            add(Finding("notice", kind, message, m.cut, layout.manifest_path(m.cut)))
        for _, part in parts:
            for rec in part.files:
                report.findings.extend(verify_file(storage, part, rec, progress))
                report.files_checked += 1
                report.bytes_hashed += rec.nbytes
        if m.cut in cls.bad:
            add(Finding("notice", FindingKind.RECORDED_BAD, "cut was recorded bad by an earlier load", m.cut,
                        layout.bad_path(m.cut)))
        # Whole-store audits only: a one-cut audit (repair, fallback, prune) must not pass a cut that is gone.
        if cut is None and removed_meanwhile(storage, cls, m.cut, report.findings[start:]):
            del report.findings[start:]
            add(Finding("notice", FindingKind.REMOVED_DURING_VERIFY, "the cut was removed (pruned) while it was "
                        "verified: its files going is not damage", m.cut, layout.manifest_path(m.cut)))
    if cut is None:
        for lo in cls.leftovers:
            alive = {True: "alive", False: "dead", None: "unknown"}[lo.owner_alive]
            owner = f" (writer {lo.owner}, {alive})" if lo.owner else ""
            add(Finding("notice", FindingKind.of_leftover(lo.kind), f"{lo.kind} leftover{owner}: {', '.join(lo.paths)}",
                        lo.cut, lo.paths[0] if lo.paths else None))
        for rel in cls.foreign:
            add(Finding("notice", FindingKind.FOREIGN, f"{rel} is not ckptstore's; left alone", path=rel))
    return report


def _parts(storage: Storage, m: Manifest, report: VerifyReport) -> list[tuple[int, Manifest]]:
    """(rank, part) whose files to check: the manifest itself for versions 1-4; for a commit record
    (version 5) each rank's fragment, checked against its digest first (a fragment that is not the
    commit record's is a finding, and its files are not checked against it)."""
    if not m.fragmented:
        return [(0, m)]
    out = []
    for rank in range(m.world_size):
        try:
            rec, _ = read_fragment(storage, storage.url, m, rank)
        except (CkptStoreError, FileNotFoundError) as exc:
            report.findings.append(_error_finding(storage, exc, m.cut, fragment_path(m.cut, rank)))
            continue
        out.append((rank, part_manifest(m, rec)))
    return out


def removed_meanwhile(storage: Storage, cls: Classification, cut: str, findings: list[Finding]) -> bool:
    """Whether a cut whose audit found errors was uncommitted while it was read (a concurrent prune
    deletes the manifest first, then the files, issue 10 item 12): its manifest is gone now, and LATEST
    did not name it, neither when the store was scanned nor now. Prune never removes LATEST's target,
    but a writer that saves and prunes continuously commits a newer cut and then prunes the one the
    scan saw as LATEST's while it is audited (issue 19 item 13): so LATEST is read again, *after* the
    manifest was seen gone. A cut LATEST still names lost its manifest (a dangling LATEST: damage), and
    a manifest or LATEST that cannot be checked keeps the findings."""
    if not any(f.severity == "error" for f in findings):
        return False
    try:
        if storage.exists(layout.manifest_path(cut)):
            return False
        if cls.latest is None or cls.latest.cut != cut:
            return True
        return _latest_cut_now(storage) not in (None, cut)
    except CkptStoreError:
        return False


def _latest_cut_now(storage: Storage) -> str | None:
    """The cut LATEST names now; None when it is absent (no writer moved it on: cannot tell)."""
    try:
        data = storage.read_bytes(layout.LATEST_FILE)
    except StorageError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    return Pointer.from_bytes(data, store=storage.url, path=layout.LATEST_FILE).cut


def first_error(report: VerifyReport) -> DataError | None:
    """The first error finding as an exception (for loaders that refuse damaged cuts)."""
    for f in report.errors:
        cls = TruncatedFile if f.kind in (FindingKind.TRUNCATED, FindingKind.SIZE_MISMATCH) else CorruptCut
        detail = f" (expected {f.expected}, found {f.found})" if f.expected else ""
        return cls(f.message + detail, store=report.store, cut=f.cut, path=f.path)
    return None
