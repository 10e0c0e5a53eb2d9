"""Directories the store reads and deletes in are never reached through a symlink (issue 10, item 4).

A store that finds ``cuts/``, ``marks/`` or ``bad/`` replaced by a symlink, or a cut-named entry of
``cuts/`` that is a symlink, would list, read and (in recovery, gc and prune) *delete* whatever lies
behind it, outside the store root: files named like its leftovers in someone else's directory. So
every scan refuses such a store with ``HostileInput`` naming the path, before anything is read or
deleted. The store root itself may be a symlink (a user's own choice of where the store lives); what
is inside it may not. Object stores have no symlinks: the check applies to local paths only.
"""

from __future__ import annotations

import os
import stat

from . import layout
from .errors import HostileInput, StorageError
from .storage import Storage

#: The directories of a store root that hold what the store reads and deletes.
STORE_DIRS = (layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR, layout.FINAL_DIR, layout.LABELS_DIR)


def refuse_symlinked_dirs(storage: Storage) -> None:
    """Raises ``HostileInput`` (naming the store and the path) when ``cuts/``, ``marks/``, ``bad/`` or
    a cut directory is a symlink. Costs three lstats and one listing of ``cuts/`` on a local store."""
    root = storage.local_path("")
    if root is None:
        return
    for rel in STORE_DIRS:
        if _is_symlink(storage, os.path.join(root, rel), rel):
            raise _refused(storage, rel)
    try:
        with os.scandir(os.path.join(root, layout.CUTS_DIR)) as it:
            linked = sorted(e.name for e in it if layout.is_cut_id(e.name) and e.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise StorageError.from_os_error(exc, "listing", store=storage.url, path=layout.CUTS_DIR) from exc
    if linked:
        raise _refused(storage, f"{layout.CUTS_DIR}/{linked[0]}", cut=linked[0])


def refuse_symlinked_cut(storage: Storage, cut: str) -> None:
    """:func:`refuse_symlinked_dirs` for the one cut a read names, without listing ``cuts/``: for a rank
    other than 0 of a group, which reads a cut by name (issue 24). Two lstats on a local store."""
    root = storage.local_path("")
    if root is None:
        return
    for rel in (layout.CUTS_DIR, layout.cut_dir(cut)):
        if _is_symlink(storage, os.path.join(root, *rel.split("/")), rel):
            raise _refused(storage, rel, cut=None if rel == layout.CUTS_DIR else cut)


def _is_symlink(storage: Storage, path: str, rel: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise StorageError.from_os_error(exc, "stat", store=storage.url, path=rel) from exc


def _refused(storage: Storage, rel: str, cut: str | None = None) -> HostileInput:
    return HostileInput(
        f"{rel} is a symlink; the store never reads or deletes through one (it could reach files outside "
        "the store root)", store=storage.url, cut=cut, path=rel,
        hint=f"replace the symlink {rel} with the directory it points to, or move the store",
    )
