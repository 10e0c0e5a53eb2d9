"""The commit protocol as one object: how a cut is begun, committed, uncommitted and abandoned.

Save, in this order (each step durable before the next starts)::

    1. mark       marks/<cut>.json written durably          (phase "mark-written")
    2. shards     cuts/<cut>/<shard> written and fsynced     (phase "shard-written", once per shard)
    3. dir sync   fsync cuts/<cut>/ so the shard names last  (phase "shards-synced")
    4. manifest   cuts/<cut>/MANIFEST.json durably           (phase "manifest-written")
    5. LATEST     atomic durable replace: THE COMMIT POINT   (phase "latest-written")
    6. unmark     marks/<cut>.json removed, marks/ fsynced   (phase "mark-removed")

Invariant: a cut is committed iff it has a valid manifest and either no mark or LATEST names it.
A crash before 5 leaves the previous LATEST and a marked cut that ``gc`` removes; a crash between 5 and
6 leaves a committed cut with a stale mark that recovery removes (failure-modes row 10: the mark never
makes a verified cut look incomplete once LATEST names it).

Prune (uncommit first, then delete)::

    a. delete MANIFEST.json durably   (phase "prune-uncommitted"): the cut is no longer committed
    b. delete the shard files          (phase "prune-files-deleted")
    c. remove the directory            (phase "prune-removed")

so a crash mid-prune leaves a directory without manifest or mark: "abandoned", which ``gc`` removes.

The object-store variant is the same sequence: every step is a single PUT or DELETE of one object, and
nothing is ever renamed. ``on_phase`` is the fault-injection seam: tests kill the process in it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

from . import hashing, layout
from .errors import StorageError
from .fs import Storage, host_identity
from .latest import Pointer
from .manifest import Manifest
from .marks import Mark

PhaseHook = Callable[[str, str], None]

SAVE_PHASES = ("mark-written", "shard-written", "shards-synced", "manifest-written", "latest-written", "mark-removed")
PRUNE_PHASES = ("prune-uncommitted", "prune-files-deleted", "prune-removed")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


class CommitProtocol:
    """Performs each protocol step on a storage; knows nothing about tensors."""

    def __init__(self, storage: Storage, on_phase: PhaseHook | None = None) -> None:
        self.storage = storage
        self._on_phase = on_phase

    def phase(self, name: str, cut: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name, cut)

    # save -----------------------------------------------------------------------------------------
    def begin(self, cut: str, step: int, writer: str) -> Mark:
        ident = host_identity()
        mark = Mark(cut=cut, step=step, host=str(ident["host"]), pid=int(ident["pid"]),  # type: ignore[call-overload]
                    started_at=now_iso(), writer=writer)
        self.storage.write_durably(layout.mark_path(cut), mark.to_bytes())
        self.storage.make_dir(layout.cut_dir(cut))
        self.phase("mark-written", cut)
        return mark

    def shards_done(self, cut: str) -> None:
        self.storage.sync_dir(layout.cut_dir(cut))
        self.phase("shards-synced", cut)

    def write_manifest(self, manifest: Manifest) -> str:
        """Publishes the manifest; returns the blake3 of its bytes for LATEST."""
        data = manifest.to_bytes()
        self.storage.write_durably(layout.manifest_path(manifest.cut), data)
        self.phase("manifest-written", manifest.cut)
        return hashing.digest(data)

    def commit(self, manifest: Manifest, manifest_blake3: str) -> Pointer:
        pointer = Pointer(cut=manifest.cut, step=manifest.step, manifest_blake3=manifest_blake3)
        try:
            self.storage.write_durably(layout.LATEST_FILE, pointer.to_bytes())
        except StorageError as exc:
            exc.cut = exc.cut or manifest.cut
            raise
        self.phase("latest-written", manifest.cut)
        return pointer

    def latest_names(self, cut: str) -> bool:
        """Whether LATEST currently names ``cut`` (after a failed commit: did the rename land?)."""
        try:
            return Pointer.from_bytes(self.storage.read_bytes(layout.LATEST_FILE)).cut == cut
        except Exception:  # noqa: BLE001 - unreadable counts as "not ours"
            return False

    def end(self, cut: str) -> None:
        self.storage.delete(layout.mark_path(cut), durable=True)
        self.phase("mark-removed", cut)

    def abandon(self, cut: str) -> None:
        """Removes an uncommitted cut's files and then its mark; never raises (best effort after an
        error: whatever stays is still marked, so ``gc`` finds it)."""
        try:
            self.remove_cut_files(cut)
            self.storage.delete(layout.mark_path(cut), durable=True)
        except StorageError:
            pass

    # prune / gc -----------------------------------------------------------------------------------
    def uncommit(self, cut: str) -> None:
        """Deletes a committed cut: manifest first (durably), then files, then the directory."""
        self.storage.delete(layout.manifest_path(cut), durable=True)
        self.phase("prune-uncommitted", cut)
        self.remove_cut_files(cut, manifest_first=False)

    def remove_cut_files(self, cut: str, *, manifest_first: bool = True) -> list[str]:
        """Deletes what the store wrote in a cut directory; returns foreign names it left there (then the
        directory stays, so nothing that is not ours is ever deleted)."""
        d = layout.cut_dir(cut)
        if manifest_first:
            self.storage.delete(layout.manifest_path(cut), durable=True)
        foreign = []
        for entry in self.storage.list_dir(d):
            if entry.is_dir or not (layout.is_shard_name(entry.name) or layout.is_tmp_name(entry.name)):
                foreign.append(f"{d}/{entry.name}")
                continue
            self.storage.delete(f"{d}/{entry.name}", durable=False)
        self.phase("prune-files-deleted", cut)
        if not foreign:
            self.storage.remove_dir(d)
        self.phase("prune-removed", cut)
        return foreign
