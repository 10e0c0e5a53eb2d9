"""The writer lease of an object store (S3 and compatible), where no flock exists: the object
``.writer.lease`` created with a conditional PUT and renewed with ``If-Match`` (``ckptstore.lock``'s
module docstring tells the whole scheme; issue 20 moved it here to keep that module under 400 lines).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from . import layout
from .errors import StorageError, StoreLocked
from .protocol import now_iso
from .storage import ConditionFailed, Storage

DEFAULT_LEASE_TTL_S = 30.0
LAST_MODIFIED_RESOLUTION_S = 1.0


def read_holder(storage: Storage, rel: str) -> dict[str, Any]:
    """Who holds the lock, from ``WRITER.json`` or the lease object ({} when unreadable: advisory only)."""
    try:
        doc = json.loads(storage.read_bytes(rel))
        return doc if isinstance(doc, dict) else {}
    except Exception:  # noqa: BLE001 - the holder's identity is advisory only
        return {}


class Lease:
    """A renewed, conditionally written lease object on an object store (see the module docstring)."""

    def __init__(self, storage: Storage, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.storage = storage
        self.ttl_s = float(ttl_s)
        self.tag = ""
        self.lost = False
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "since": now_iso(),
                     "ttl_s": self.ttl_s, "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed_at = 0.0

    def _doc(self) -> bytes:
        return json.dumps({**self.info, "renewed_at": now_iso()}).encode()

    def acquire(self) -> None:
        # The clock starts before the PUT is sent: the object's LastModified is no earlier than this,
        # so this writer gives the lease up no later than any contender may judge it expired.
        started = time.monotonic()
        try:
            self.tag = self.storage.put_if_absent(layout.LEASE_FILE, self._doc())
        except FileExistsError:
            self._take_over_or_refuse()
        self._renewed_at = started
        self._thread = threading.Thread(target=self._renew_loop, name="ckptstore-lease", daemon=True)
        self._thread.start()

    def _take_over_or_refuse(self) -> None:
        try:
            tag, age = self.storage.version(layout.LEASE_FILE)
        except StorageError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Released between our create and our look: try the create once more.
            try:
                self.tag = self.storage.put_if_absent(layout.LEASE_FILE, self._doc())
                return
            except FileExistsError:
                raise self._locked({}, "another writer took the lease just now") from None
        holder = read_holder(self.storage, layout.LEASE_FILE)
        ttl = holder.get("ttl_s")
        ttl = float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else self.ttl_s
        # S3's LastModified has whole-second resolution (truncated), so the age read here can be up to
        # a second too large: wait that second more, or a live holder could still be inside its ttl.
        ttl += LAST_MODIFIED_RESOLUTION_S
        if age <= ttl:
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}" if holder else "another writer"
            raise self._locked(
                holder, f"another writer holds this store's lease: {who}",
                hint=(f"stop that writer; if it died, its lease expires {max(0.0, ttl - age):.0f} s from now "
                      "(or open the store read-only: Store.open(url, readonly=True))"),
            )
        try:
            self.tag = self.storage.put_if_match(layout.LEASE_FILE, self._doc(), tag)
        except ConditionFailed:
            raise self._locked(holder, "another writer took over the expired lease at the same time") from None

    def _locked(self, holder: dict[str, Any], message: str, hint: str | None = None) -> StoreLocked:
        return StoreLocked(message, holder=holder, store=self.storage.url, path=layout.LEASE_FILE,
                           hint=hint or "stop that writer, or open the store read-only")

    def _renew_loop(self) -> None:
        wait = self.ttl_s / 3
        while not self._stop.wait(wait):
            at_once, wait = wait == 0.0, self.ttl_s / 3
            try:
                if self._renew() and not at_once:  # once: a backend refusing its own tag must not spin
                    wait = 0.0
            except ConditionFailed:
                self.lost = True  # someone took over: this writer must not touch the store again
                return
            except Exception:  # noqa: BLE001 - a transient network error: retry until the ttl runs out
                if time.monotonic() - self._renewed_at > self.ttl_s:
                    self.lost = True
                    return

    def _renew(self) -> bool:
        """One renewal. True when it found instead that an earlier renewal of ours landed though every
        answer to it was lost (issue 24): the lease is still ours, and is renewed again at once on that
        version; the renewal clock stays at the last renewal seen to land, no later than the unseen one.
        Raises ``ConditionFailed`` when another writer holds the lease now."""
        started = time.monotonic()
        try:
            self.tag = self.storage.put_if_match(layout.LEASE_FILE, self._doc(), self.tag)
        except ConditionFailed:
            tag = self._own_tag()
            if tag is None:
                raise
            self.tag = tag
            return True
        self._renewed_at = started
        return False

    def _own_tag(self) -> str | None:
        """The lease object's version tag when it still carries this writer's token, else None. The tag
        is read first: only this writer writes its token, so if the token is there when read, so it
        was when the tag was. An I/O error raises (the caller retries it as a transient error)."""
        try:
            tag, _ = self.storage.version(layout.LEASE_FILE)
            doc = json.loads(self.storage.read_bytes(layout.LEASE_FILE))
        except StorageError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        except ValueError:  # not JSON: someone else's object
            return None
        return tag if isinstance(doc, dict) and doc.get("token") == self.info["token"] else None

    def ensure_held(self) -> None:
        if self.lost or time.monotonic() - self._renewed_at > self.ttl_s:
            self.lost = True
            raise StoreLocked(
                "this writer lost its lease on the store (it was not renewed within the ttl, and another "
                "writer may have taken over); nothing more is committed or deleted by this handle",
                holder=read_holder(self.storage, layout.LEASE_FILE), store=self.storage.url, path=layout.LEASE_FILE,
                hint="reopen the store as its writer once the other writer is gone",
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        if self.lost:
            return
        delete_lease_if(self.storage, self.tag)


def delete_lease_if(storage: Storage, tag: str) -> None:
    """Gives the lease up when it is still the version ``tag`` this process wrote last."""
    try:
        current, _ = storage.version(layout.LEASE_FILE)
        if current == tag:
            storage.delete(layout.LEASE_FILE, durable=False)
    except Exception:  # noqa: BLE001 - an unreleased lease only expires after the ttl
        pass
