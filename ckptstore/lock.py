"""The single-writer lock of a store.

Local stores: a ``flock`` on ``.writer.lock`` (through filelock) excludes a second writer on the same
host or on a file system with working POSIX locks; the kernel drops it when its holder dies, SIGKILL
included, so a killed writer never locks the store forever. ``WRITER.json`` says who holds it, so the
second writer's ``StoreLocked`` names the holder. Readers take no lock.

Object stores (S3 and compatible): no flock exists, so the writer holds a **lease**, the object
``.writer.lease`` created with a conditional PUT (``If-None-Match: *``) and renewed every ttl/3 with
``If-Match`` on its last ETag. A second writer finds it and gets ``StoreLocked`` naming the holder; a
lease nobody renewed for ``lease_ttl_s`` + 1 s (LastModified resolution; the holder gives it up after
``lease_ttl_s`` counted from before its PUT) is taken over with ``If-Match`` on the
stale ETag, so exactly one of several contenders wins. A writer whose renewal lost (another writer took
the lease after it stalled longer than the ttl) stops: every later commit, prune or gc raises
``StoreLocked`` instead of touching the store. Staleness is judged by the object's LastModified (the
server's clock) against this host's clock, so hosts need NTP-grade clocks (skew well under the ttl).

Limits: flock gives no exclusion across hosts on NFS mounted ``nolock`` or on some parallel file systems
(failure-modes row 65); object stores without conditional PUTs (fsspec's memory file system, GCS through
its own protocol) get no lock: run one writer per store there (torch.distributed rank 0 commits).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
import time
from typing import Any

import filelock

from . import layout
from .errors import StorageError, StoreLocked, UsageError
from .events import log
from .lease import DEFAULT_LEASE_TTL_S, Lease, delete_lease_if, read_holder
from .protocol import now_iso
from .storage import ConditionFailed, Storage

__all__ = ["DEFAULT_LEASE_TTL_S", "DEFAULT_ORPHAN_WAIT_S", "InheritedLock", "Lease", "WriterLock", "orphaned_holder",
           "read_holder"]



#: How long a writer open waits, by default, for the writer process of a dead trainer that still holds
#: the lock while it finishes the cut it was handed (ckptstore.rescue).
DEFAULT_ORPHAN_WAIT_S = 300.0
_POLL_S = 0.05


def orphaned_holder(holder: dict[str, Any]) -> bool:
    """Whether the lock's recorded holder is a process of this host that is gone: the lock is then held
    by a process that inherited it, the writer process finishing a dead trainer's handed-over cut."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


class WriterLock:
    def __init__(self, storage: Storage, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 orphan_wait_s: float = DEFAULT_ORPHAN_WAIT_S) -> None:
        self.storage = storage
        self.orphan_wait_s = orphan_wait_s
        self._lock: filelock.BaseFileLock | None = None
        self._fd: int | None = None  # the flocked descriptor, as filelock's on_acquired hands it over
        self._lease: Lease | None = None
        self.lease_ttl_s = lease_ttl_s

    @property
    def excludes(self) -> bool:
        """Whether holding this lock proves no other writer is active (so marked cuts not in flight
        here belong to dead writers)."""
        caps = self.storage.capabilities
        return caps.local_paths or caps.conditional_writes

    def _flock(self, lock: filelock.BaseFileLock) -> None:
        """Takes the flock, or raises ``StoreLocked`` naming the holder. A holder that is a dead process
        of this host (its writer process inherited the lock and is finishing its last cut) is waited
        for, up to ``orphan_wait_s``: a trainer killed and started again at once then resumes from that
        cut instead of failing."""
        deadline: float | None = None
        while True:
            try:
                lock.acquire(timeout=0)
                return
            except filelock.Timeout:
                pass
            holder = read_holder(self.storage, layout.WRITER_FILE)
            orphaned = orphaned_holder(holder)
            if orphaned and deadline is None and self.orphan_wait_s > 0:
                deadline = time.monotonic() + self.orphan_wait_s
                log.warning("ckptstore: %s: the writer lock is held by the writer process of dead trainer pid %s, "
                            "finishing its last cut; waiting up to %g s", self.storage.url, holder.get("pid"),
                            self.orphan_wait_s)
            if orphaned and deadline is not None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                continue
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}" if holder else "another process"
            if orphaned:
                who += (f" (dead; its writer process is still finishing a cut after {self.orphan_wait_s:g} s)"
                        if deadline is not None else " (dead; its writer process is finishing a cut)")
            raise StoreLocked(f"another writer holds this store: {who}", holder=holder, store=self.storage.url,
                              path=layout.LOCK_FILE,
                              hint="stop that writer, or open the store read-only (Store.open(url, readonly=True))")

    def acquire(self) -> None:
        caps = self.storage.capabilities
        if not caps.local_paths:
            if caps.conditional_writes:
                lease = Lease(self.storage, self.lease_ttl_s)
                lease.acquire()
                self._lease = lease
            # Without conditional writes there is nothing to lock with; see the module docstring.
            return
        path = self.storage.local_path(layout.LOCK_FILE)
        assert path is not None
        absent = _check_lock_file(path, self.storage.url)
        try:
            self._lock = self._native_or_soft(path, absent)
        except OSError as exc:
            raise StorageError.from_os_error(exc, "taking the writer lock", store=self.storage.url,
                                             path=layout.LOCK_FILE) from exc
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": now_iso()}
        try:
            self.storage.write_durably(layout.WRITER_FILE, json.dumps(info).encode())
        except BaseException:
            # A failed open must not keep the store locked (the caller may hold on to the error).
            self.release()
            raise

    def ensure_held(self) -> None:
        """Raises ``StoreLocked`` when this writer's lease was lost to another writer."""
        if self._lease is not None:
            self._lease.ensure_held()

    def handoff(self) -> dict[str, Any]:
        """What a helper process needs to go on holding this lock should this process die while the
        helper finishes a cut (see :class:`InheritedLock`): for a flock, pass :meth:`lock_fd` along
        (a descriptor of the same open file keeps the lock); for a lease, its token and ttl."""
        if self._lock is not None:
            return {"kind": "flock"}
        if self._lease is not None:
            return {"kind": "lease", "token": self._lease.info["token"], "ttl_s": self._lease.ttl_s}
        return {"kind": "none"}

    def _native_or_soft(self, path: str, absent: bool) -> filelock.BaseFileLock:
        """The flock, its descriptor from filelock's public ``on_acquired`` hook (issue 20: it was read
        from the private, thread-local ``_context``: None in any thread but the opener's). The hook is
        for native locks only, so where flock is missing (ENOSYS) the lock is filelock's soft lock, as
        before: while no lock file exists filelock probes first (a soft lock's marker goes on release)."""
        plain = filelock.FileLock(path, timeout=0, is_singleton=False)
        if absent:
            self._flock(plain)
            plain.release()
        if not absent or os.path.lexists(path):
            hooked = filelock.FileLock(path, timeout=0, is_singleton=False, on_acquired=self._held)
            try:
                self._flock(hooked)
                return hooked
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
        self._flock(plain)  # no flock here: a soft lock (its marker, if another writer's, refuses us)
        return plain

    def _held(self, fd: int) -> None:
        self._fd = fd

    def lock_fd(self) -> int | None:
        """The descriptor of the flocked lock file, from any thread (None without a flock)."""
        return self._fd if self._lock is not None else None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            self._fd = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def _check_lock_file(path: str, store: str) -> bool:
    """Refuses a ``.writer.lock`` that is not a regular file: a directory made every writer open fail
    with a raw ``IsADirectoryError`` (issue 10, item 11), and filelock opens the lock file with
    ``O_TRUNC``, so a symlink planted there would have it truncate whatever the link points at."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return True  # filelock creates it
    except OSError as exc:
        raise StorageError.from_os_error(exc, "checking the writer lock", store=store, path=layout.LOCK_FILE) from exc
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
        raise UsageError(f"the writer lock file {layout.LOCK_FILE} is {what}, so no writer can lock this store",
                         store=store, path=layout.LOCK_FILE,
                         hint=f"move {path} aside (it is not ckptstore's), then open the store again")
    return False


class InheritedLock:
    """The writer lock as a rescuer holds it: a writer process finishing the cut of a trainer that
    died (``WriterLock.handoff()`` says what it inherits).

    flock: the inherited descriptor of the trainer's lock file keeps the lock held while the rescuer
    lives (flock belongs to the open file, not the process), so no new writer can open the store and
    collect the cut as a dead writer's leftover meanwhile. lease: the trainer's renewals die with it, so
    the rescuer renews the lease from the trainer's death on (``start_renewing``, every ttl/3, with
    ``If-Match`` on its current version and only while it still carries the trainer's token): a restart
    gets ``StoreLocked`` for as long as the rescue runs, however long its write (issue 19 item 3), and can
    take the lease only after the rescuer stopped. ``ensure_held`` (the commit protocol's guard, run
    before every step that moves LATEST or deletes) renews once more, so a rescuer that lost it commits
    nothing."""

    def __init__(self, storage: Storage, handoff: dict[str, Any], fd: int | None = None) -> None:
        self.storage = storage
        self.kind = handoff.get("kind", "none")
        self.token = handoff.get("token")
        ttl = handoff.get("ttl_s")
        self.ttl_s = float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else DEFAULT_LEASE_TTL_S
        self.fd = fd
        self.tag: str | None = None
        self.lost: StoreLocked | None = None
        self._renewed_at = time.monotonic()
        self._mutex = threading.Lock()  # one conditional PUT at a time: two on one version fail each other
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_renewing(self) -> None:
        """Renews the lease in a daemon thread until ``release`` (nothing to do for a flock)."""
        if self.kind != "lease" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._renew_loop, name="ckptstore-rescue-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        wait = 0.0  # at once: the trainer's last renewal may be most of a ttl ago
        while not self._stop.wait(wait):
            wait = self.ttl_s / 3
            try:
                self.ensure_held()
            except StoreLocked:
                return  # recorded in self.lost: the guard refuses every later step
            except Exception as exc:  # noqa: BLE001 - a transient network error: retry until the ttl runs out
                if time.monotonic() - self._renewed_at > self.ttl_s:
                    self.lost = StoreLocked(f"the lease could not be renewed within its ttl: {exc}",
                                            store=self.storage.url, path=layout.LEASE_FILE)
                    return

    def ensure_held(self) -> None:
        if self.kind != "lease":
            return
        with self._mutex:
            if self.lost is not None:
                raise self.lost
            started = time.monotonic()
            try:
                tag, _ = self.storage.version(layout.LEASE_FILE)
                holder = read_holder(self.storage, layout.LEASE_FILE)
                if holder.get("token") != self.token:
                    self.lost = StoreLocked(
                        "the lease of the trainer whose cut this process finishes was taken by another "
                        "writer; this cut is not committed", holder=holder, store=self.storage.url,
                        path=layout.LEASE_FILE)
                    raise self.lost
                doc = json.dumps({**holder, "renewed_at": now_iso(), "rescuer_pid": os.getpid()}).encode()
                self.tag = self.storage.put_if_match(layout.LEASE_FILE, doc, tag)
                self._renewed_at = started
            except ConditionFailed:
                self.lost = StoreLocked("another writer took the lease while this process finished a dead "
                                        "trainer's cut", store=self.storage.url, path=layout.LEASE_FILE)
                raise self.lost from None

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        if self.fd is not None:
            try:
                os.close(self.fd)  # never LOCK_UN: that would unlock the trainer's open file too
            except OSError:
                pass
            self.fd = None
        if self.kind == "lease" and self.tag is not None and self.lost is None:
            delete_lease_if(self.storage, self.tag)
