"""LATEST's manifest, and a named cut's, read without a listing (issue 24): two single-object reads
where a classification lists the whole store (its root, ``cuts/``, every cut directory, ``marks/``).
A rank other than 0 reads LATEST's cut this way (``reading.py``), and so does a writer's step check at
the start of every save (``core.check_step``): before, each save listed the store and read every
manifest, O(cuts) requests on an object store, each one more chance of a 503."""

from __future__ import annotations

import errno

from . import hashing, layout
from .errors import CutNotFound, DataError, LatestError, StorageError
from .latest import Pointer
from .manifest import Manifest
from .paths import refuse_symlinked_cut
from .recovery import MAX_RESCANS, ManifestCache
from .storage import Storage


#: What a handle remembers of the manifest it wrote last: (blake3 of its bytes, its cut, its step).
Written = tuple[str, str, int]


def pointed_manifest(storage: Storage, url: str, cache: ManifestCache | None = None) -> Manifest | None:
    """LATEST's manifest, read without a listing: LATEST, then the manifest it names (the scan's order),
    whose bytes must hash to what LATEST records: the classification's own test of a healthy LATEST
    (a valid manifest that LATEST names is committed, whatever marks say), with its words when it
    fails. None when there is no LATEST: only a listing tells an empty store from one that lost it.
    ``cache``: manifests parsed before, by (cut, blake3 of their bytes), as the scan keeps them; the
    bytes are read and hashed every time, only their parse is saved."""
    found = _pointed(storage, url, None, cache)
    assert not isinstance(found, tuple)
    return found


def pointed_step(storage: Storage, url: str, known: Written | None = None) -> tuple[str, int] | None:
    """(cut, step) of LATEST's manifest, read and checked as ``pointed_manifest`` reads it; ``known``
    (what this handle wrote last) is taken as it is when LATEST's manifest has its bytes: a save's step
    check parsed 40,000 records, and keeping the whole manifest for it held ~250 bytes a tensor between
    cuts (issue 23)."""
    found = _pointed(storage, url, known)
    return found if found is None or isinstance(found, tuple) else (found.cut, found.step)


def _pointed(storage: Storage, url: str, known: Written | None,
             cache: ManifestCache | None = None) -> Manifest | tuple[str, int] | None:
    where = {"store": url, "path": layout.LATEST_FILE}
    hint = f"run `ckptstore repair {url}`"
    for _ in range(MAX_RESCANS):
        data = read_or_none(storage, layout.LATEST_FILE)
        if data is None:
            return None
        try:
            pointer = Pointer.from_bytes(data, **where)
        except DataError as exc:
            raise LatestError(f"LATEST is unreadable: {exc.message}", hint=hint, **where) from exc
        refuse_symlinked_cut(storage, pointer.cut)
        mpath = layout.manifest_path(pointer.cut)
        body = read_or_none(storage, mpath)
        if body is None:
            if read_or_none(storage, layout.LATEST_FILE) != data:
                continue  # LATEST moved on and a prune took the cut it named meanwhile: read again
            raise LatestError(f"LATEST names {pointer.cut}, which is not a committed cut", hint=hint, **where)
        digest = hashing.digest(body)
        if known is not None and known[0] == digest == pointer.manifest_blake3 and known[1] == pointer.cut:
            return known[1], known[2]
        try:
            m = cache.get((pointer.cut, digest)) if cache is not None else None
            if m is None:
                m = parse_manifest(url, pointer.cut, body)
                if cache is not None and digest == pointer.manifest_blake3:
                    cache[(pointer.cut, digest)] = m
        except DataError as exc:
            raise LatestError(f"LATEST names {pointer.cut}, whose manifest is damaged ({mpath}: {exc.message})",
                              hint=hint, **where) from exc
        if digest != pointer.manifest_blake3:
            raise LatestError(f"LATEST's manifest hash does not match {pointer.cut}'s manifest", hint=hint, **where)
        return m
    raise LatestError(f"LATEST moved {MAX_RESCANS} times while it was read", hint="read again", **where)


def named_manifest(storage: Storage, url: str, cut: str) -> Manifest:
    """The manifest of ``cut``, which rank 0 classified as committed and named in a collective call
    (restore's choice), read as one object: the rank takes rank 0's word for it (issue 24)."""
    layout.check_cut_id(cut, store=url)
    refuse_symlinked_cut(storage, cut)
    body = read_or_none(storage, layout.manifest_path(cut))
    if body is None:
        raise CutNotFound("no such committed cut (removed since rank 0 chose it)", store=url, cut=cut)
    return parse_manifest(url, cut, body)


def parse_manifest(url: str, cut: str, body: bytes) -> Manifest:
    mpath = layout.manifest_path(cut)
    m = Manifest.from_bytes(body, cut=cut, path=mpath, store=url)
    if m.cut != cut:
        raise DataError(f"manifest names cut {m.cut!r} but lives in {cut!r}", store=url, cut=cut, path=mpath)
    return m


def read_or_none(storage: Storage, rel: str) -> bytes | None:
    """The bytes of one of the store's small files; None when it is absent. Any other error is raised:
    "cannot tell" never reads as "absent"."""
    try:
        return storage.read_bytes(rel)
    except FileNotFoundError:  # a Storage that raises the OS's own (custom backends, the power-loss CrashFS)
        return None
    except StorageError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise


__all__ = ["parse_manifest", "read_or_none", "named_manifest", "pointed_manifest", "pointed_step"]
