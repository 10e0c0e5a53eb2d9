"""The single-writer lock of a store.

A ``flock`` on ``.writer.lock`` (through filelock) excludes a second writer on the same host or on a
file system with working POSIX locks; the kernel drops it when its holder dies, SIGKILL included, so a
killed writer never locks the store forever. ``WRITER.json`` says who holds it, so the second writer's
``StoreLocked`` names the holder. Readers take no lock.

Limit (failure-modes row 65): flock gives no exclusion across hosts on NFS mounted ``nolock`` or on
some parallel file systems; run one writer per store there (torch.distributed rank 0 commits).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import filelock

from . import layout
from .errors import StoreLocked
from .fs import Storage
from .protocol import now_iso


class WriterLock:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock: filelock.BaseFileLock | None = None

    def acquire(self) -> None:
        if not self.storage.is_local:
            # Object stores have no flock; the single-writer rule is the caller's (one rank commits).
            return
        path = self.storage.local_path(layout.LOCK_FILE)
        assert path is not None
        lock = filelock.FileLock(path, timeout=0, is_singleton=False)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            holder = self.holder()
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}" if holder else "another process"
            raise StoreLocked(
                f"another writer holds this store: {who}",
                holder=holder,
                store=self.storage.url,
                path=layout.LOCK_FILE,
                hint="stop that writer, or open the store read-only (Store.open(url, readonly=True))",
            ) from None
        self._lock = lock
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": now_iso()}
        self.storage.write_durably(layout.WRITER_FILE, json.dumps(info).encode())

    def holder(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.storage.read_bytes(layout.WRITER_FILE))
            return doc if isinstance(doc, dict) else {}
        except Exception:  # noqa: BLE001 - the holder file is advisory only
            return {}

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def held(self) -> bool:
        return self._lock is not None or not self.storage.is_local
