"""Opening a store: one process or the ranks of a group, as a reader, a writer or a participant; creating
one (moved out of store.py, issue 20). Every open returns a :class:`~ckptstore.core.StoreCore` whose
:class:`~ckptstore.core.Role` is fixed here; :class:`~ckptstore.store.Store` wraps it."""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import replace
from typing import Any, Union

from . import layout
from .collect import recover as run_recovery
from .core import Role, StoreCore
from .errors import StorageError, StoreNotFound, UsageError
from .events import log
from .latest import StoreIdentity
from .options import StoreOptions
from .protocol import now_iso
from .collective import Collective
from .ranks import DEFAULT_RANK_TIMEOUT, RankGroup, store_namespace
from .storage import Storage, open_storage, store_url

Url = Union[str, "os.PathLike[str]", Storage]


def open_core(url: Url, *, create: bool, readonly: bool, options: StoreOptions | None, group: Any,
              rank_timeout: float | None, recover: bool) -> StoreCore:
    """See :meth:`ckptstore.Store.open`."""
    url = url if isinstance(url, Storage) else store_url(url)  # a pathlib.Path too (issue 19 item 11)
    if group is not None and not recover:
        raise UsageError("recover=False is for one process; a group's open always recovers", store=str(url))
    if group is not None:
        return _open_group(url, group=group, rank_timeout=rank_timeout, create=create, readonly=readonly,
                           options=options)
    if rank_timeout is not None:
        raise UsageError("rank_timeout goes with group=", store=str(url))
    core = open_one(url, create=create, role=Role.READER if readonly else Role.WRITER, options=options)
    if not readonly and not recover:
        core.recovery_pending = True
    elif not readonly:
        try:
            run_recovery(core)
        except BaseException:
            core.close()
            raise
    return core


def _open_group(url: str | Storage, *, group: Any, rank_timeout: float | None, create: bool, readonly: bool,
                options: StoreOptions | None) -> StoreCore:
    name = url.url if isinstance(url, Storage) else str(url)
    ranks = RankGroup(group, rank_timeout=DEFAULT_RANK_TIMEOUT if rank_timeout is None else rank_timeout,
                      namespace=store_namespace(name), store=name)
    # A rank stuck on storage must fail, named, before the others give up on it (issue 24): no
    # object-store call of a rank outlasts the group's rank_timeout.
    options = options or StoreOptions()
    options = replace(options, io_deadline_s=options.io_policy().capped(ranks.rank_timeout).deadline())
    if ranks.size == 1:
        ranks.close()
        return open_core(url, create=create, readonly=readonly, options=options, group=None, rank_timeout=None,
                         recover=True)
    try:
        # Beating throughout: rank 0's writer open may wait minutes for a dead trainer's writer
        # process to finish its cut while the others wait for it (issue 19 item 7).
        with ranks.busy():
            core = _open_ranks(url, ranks, create=create, readonly=readonly, options=options)
    except BaseException:
        ranks.close()
        raise
    return core.with_ranks(ranks)


def _open_ranks(url: str | Storage, ranks: RankGroup, *, create: bool, readonly: bool,
                options: StoreOptions | None) -> StoreCore:
    """The collective open's body: rank 0 opens as the writer (or every rank readonly), then the
    others join as participants; every rank raises if any failed."""
    c = Collective(ranks, store=url.url if isinstance(url, Storage) else str(url))
    core: StoreCore | None = None

    def open_as(role: Role) -> None:
        nonlocal core
        core = open_one(url, create=False, role=role, options=options)

    def open_writer() -> None:
        nonlocal core
        core = open_core(url, create=create, readonly=False, options=options, group=None, rank_timeout=None,
                         recover=True)

    try:
        if readonly:
            c.all("open", lambda: open_as(Role.READER), doing="opening the store")
        else:
            c.coordinate("open-writer", open_writer, doing="to open the store as its writer")
            c.all("open-participants", lambda: None if c.coordinator else open_as(Role.PARTICIPANT),
                  doing="joining the store")
        assert core is not None
        return core
    except BaseException:
        if core is not None:
            core.close()
        raise


def open_one(url: str | Storage, *, create: bool, role: Role, options: StoreOptions | None) -> StoreCore:
    """One process's open in ``role``, without recovery: a writer takes the lock; a reader and a
    participant only check that a store is there."""
    options = options or StoreOptions()
    # A Storage instance is accepted as is: custom backends, and the power-loss simulator in tests.
    storage = url if isinstance(url, Storage) else open_storage(url, storage_options=options.storage_options,
                                                                io=options.io_policy())
    if not storage.exists(layout.STORE_FILE):
        if not create or role is not Role.WRITER:
            raise StoreNotFound("no ckptstore store here", store=storage.url, path=layout.STORE_FILE,
                                hint="pass create=True to make one" if role is Role.WRITER else None)
        # A directory holding only our own names is a creation that crashed before STORE.json
        # was durable: finish it. Anything else is someone's data: never take it over.
        foreign = [e.name for e in storage.list_dir("")
                   if e.name not in layout.ROOT_ENTRIES and not layout.is_tmp_name(e.name)]
        if foreign:
            raise UsageError(f"refusing to create a store in a non-empty directory ({foreign[:3]})", store=storage.url)
        _create(storage)
    else:
        _identity(storage)
    core = StoreCore(storage, options, role)
    if role is Role.WRITER:
        try:
            core.lock.acquire()
            core.own_dirs(layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR)
        except BaseException:
            core.close()
            raise
    return core


def _create(storage: Storage) -> None:
    root = storage.local_path("") if storage.capabilities.local_paths else None
    if root is not None:
        make_root(root, storage.url)
    for d in (layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR):
        storage.make_dir(d)
    storage.write_durably(layout.STORE_FILE, StoreIdentity(created_at=now_iso()).to_bytes())


def make_root(root: str, url: str) -> None:
    """Creates a local store's root and its parents. A path that is, or runs through, something other
    than a directory is a ``UsageError`` naming what is in the way (issue 10 item 20; issue 19 item 14:
    a path below a regular file raised a raw NotADirectoryError); any other refusal (permissions, a
    full disk, a file created meanwhile) is a ``StorageError`` naming the store."""
    there = root
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if os.path.lexists(there) and not os.path.isdir(there):
        what = "a file, not a directory" if os.path.isfile(there) else "not a directory"
        raise UsageError(f"cannot create a store here: {there} is {what}", store=url, path=there,
                         hint="pick a new or empty directory for the store")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise StorageError.from_os_error(exc, "creating the store directory", store=url, path=root) from exc


def open_tiers(url: Url, mirror: Url | None, mirror_options: StoreOptions | None, *, alone_ok: bool = False,
               create: bool = False, readonly: bool = False, options: StoreOptions | None = None, group: Any = None,
               rank_timeout: float | None = None, recover: bool = True) -> tuple[StoreCore, StoreCore | None]:
    """The local tier's core (:func:`open_core`) and its mirror's (:func:`open_mirror`; None without
    one). ``alone_ok``: a missing local store (a replaced node) gives the mirror alone in the local's
    place, for a readonly load (issue 21)."""
    try:
        core = open_core(url, create=create, readonly=readonly, options=options, group=group,
                         rank_timeout=rank_timeout, recover=recover)
    except StoreNotFound:
        if mirror is None or not alone_ok:
            raise
        return open_one(mirror if isinstance(mirror, Storage) else store_url(mirror), create=False,
                        role=Role.READER, options=mirror_options), None
    mirror_core: StoreCore | None = None
    try:
        mirror_core = None if mirror is None else open_mirror(mirror, core.url, mirror_options)
        if mirror is not None and core.role is Role.WRITER:
            # STORE.json names the mirror for `ckptstore ls` (issue 21): after its open, so a URL that
            # is refused outright (no backend for it) is never recorded; one that is down still is.
            record_mirror(core, mirror)
        return core, mirror_core
    except BaseException:
        if mirror_core is not None:
            mirror_core.close()
        core.close()
        raise


def open_mirror(url: Url, local: str, options: StoreOptions | None) -> StoreCore | None:
    """The mirror tier of the store at ``local``, opened readonly for reads (issue 21): a mirror is read,
    never locked, so no read waits for its writer; None while no store is there yet (a run's first
    start, before its first cut was mirrored). Its writer (the Checkpointer's uploads) opens its own."""
    url = url if isinstance(url, Storage) else store_url(url)
    if (url.url if isinstance(url, Storage) else str(url)) == local:
        raise UsageError(f"a store cannot be its own mirror: {local}", store=local)
    try:
        return open_one(url, create=False, role=Role.READER, options=options)
    except StoreNotFound:
        return None
    except StorageError as exc:
        # A mirror that is down must not stop a restart that its local tier can serve ("mirror
        # unreachable: local cuts go on", issue 21): read the local tier alone, and say so.
        log.warning("the mirror %s is unreachable (%s); reading the local tier %s alone", url, exc, local)
        return None


def recordable_url(url: Url) -> str:
    """What STORE.json may record of a mirror's URL (issue 21: "never credentials"): a local path made
    absolute (a relative one would name another place from another directory), an fsspec URL without
    the ``user:password@`` of its authority and without its query (``?sig=...`` tokens), each part of a
    ``::`` chain alike. Credentials go in ``mirror_options`` / ``--mirror-storage-options`` instead."""
    text = url.url if isinstance(url, Storage) else store_url(url)
    if "://" not in text:
        return os.path.abspath(text)
    parts = []
    for part in text.split("::"):
        s = urllib.parse.urlsplit(part) if "://" in part else None
        if s is None or ("@" not in s.netloc and not s.query and not s.fragment):
            parts.append(part)  # as given: urlunsplit may respell what needs no stripping
            continue
        parts.append(urllib.parse.urlunsplit((s.scheme, s.netloc.rpartition("@")[2], s.path, "", "")))
    return "::".join(parts)


def recorded_mirror(storage: Storage) -> str | None:
    """The mirror URL the store's STORE.json records (issue 21), None when it records none."""
    return _identity(storage).mirror


def record_mirror(core: StoreCore, mirror: Url) -> None:
    """Records ``mirror`` (:func:`recordable_url`) in the STORE.json of the writer ``core``, with the one
    durable replace of every small file (temp file, fsync, rename, fsync of the directory; one PUT on an
    object store), so a crash leaves the old record or the new one. Written once: nothing happens when
    STORE.json records this URL already; another URL replaces the old (the store moved its mirror)."""
    core.require_writer("recording the store's mirror")
    url = recordable_url(mirror)
    shown = mirror.url if isinstance(mirror, Storage) else store_url(mirror)
    if url != shown and "://" in shown:
        log.warning("ckptstore: %s records its mirror as %s: credentials and query strings are never "
                    "written to %s (pass them in mirror_options)", core.url, url, layout.STORE_FILE)
    identity = _identity(core.storage)
    if identity.mirror == url:
        return
    if identity.mirror is not None:
        log.info("ckptstore: %s: the mirror recorded in %s moves from %s to %s", core.url, layout.STORE_FILE,
                 identity.mirror, url)
    record = StoreIdentity(created_at=identity.created_at, mirror=url)
    core.storage.write_durably(layout.STORE_FILE, record.to_bytes())


def _identity(storage: Storage) -> StoreIdentity:
    return StoreIdentity.from_bytes(storage.read_bytes(layout.STORE_FILE), store=storage.url, path=layout.STORE_FILE)


def open_for_repair(url: str | Storage, options: StoreOptions | None = None) -> StoreCore:
    """A writer handle without recovery, for ``ckptstore repair`` on a store whose LATEST is broken."""
    return open_one(url, create=False, role=Role.WRITER, options=options)


def open_participant(url: Url, options: StoreOptions | None = None) -> StoreCore:
    """A participant without a group: no lock, no recovery; it writes rank parts of cuts a coordinator
    elsewhere marks (DCP's ranks; issue 20: they wrote them through readonly handles)."""
    return open_one(url if isinstance(url, Storage) else store_url(url), create=False, role=Role.PARTICIPANT,
                    options=options)


__all__ = ["make_root", "open_core", "open_for_repair", "open_mirror", "open_tiers", "open_one", "open_participant",
           "record_mirror", "recordable_url", "recorded_mirror"]
