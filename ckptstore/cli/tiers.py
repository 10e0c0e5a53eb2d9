"""A command's mirror tier (issue 21, the CLI): ``--mirror MIRROR``, or the mirror the store's STORE.json
records (:func:`ckptstore.opening.recorded_mirror`), read as a second store beside URL. ``ls`` says which
cuts the mirror holds, ``resume-info`` makes restore's choice across both tiers and reports the mirror's
lag, ``verify`` audits both. A mirror that cannot be read is reported, with a warning on stderr, and
never stops ``ls`` or ``resume-info``: what they say of the local tier does not depend on it."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from .. import spi
from ..errors import CutNotFound, StoreNotFound, UsageError
from ..opening import recordable_url, recorded_mirror
from ..options import StoreOptions
from ..recovery import Classification
from ..selection import Choice, Tier, choose_across, choose_cut
from ..store import Store
from .mirror import storage_options
from .render import CUT_HEADERS

#: ``--mirror`` given without a value: the mirror STORE.json records.
RECORDED = "<recorded>"


def add_mirror_flags(sp: argparse.ArgumentParser, *, default_recorded: bool) -> None:
    """``--mirror``, ``--mirror-storage-options`` (read as ``ckptstore mirror`` reads its
    ``--storage-options``) and, where the recorded mirror is the default (``ls``, ``resume-info``),
    ``--no-mirror``; where it is not (``verify``: it would hash every byte of the mirror), ``--mirror``
    without a value names the recorded one."""
    if default_recorded:  # a value is needed: ``ls --mirror URL`` would read URL as the mirror
        sp.add_argument("--mirror", default=None, metavar="MIRROR",
                        help="the mirror store's path or fsspec URL (default: the one URL's STORE.json records)")
    else:
        sp.add_argument("--mirror", nargs="?", const=RECORDED, default=None, metavar="MIRROR",
                        help="also verify this mirror store; without a value, the one URL's STORE.json records")
    sp.add_argument("--mirror-storage-options", default=None, metavar="JSON|@FILE",
                    help="fsspec options of MIRROR (a JSON object, or @FILE holding one: keeps credentials off ps)")
    if default_recorded:
        sp.add_argument("--no-mirror", action="store_true", help="leave the recorded mirror out")


def mirror_url(args: argparse.Namespace, store: Store, *, default_recorded: bool) -> str | None:
    """The mirror a command reads: ``--mirror MIRROR`` wins over the recorded one; None without any."""
    if getattr(args, "no_mirror", False):
        if args.mirror is not None:
            raise UsageError("--mirror and --no-mirror contradict each other", store=store.url)
        return None
    if args.mirror is None and not default_recorded:
        return None
    url = recorded_mirror(store.storage) if args.mirror in (None, RECORDED) else args.mirror
    if url is None and args.mirror == RECORDED:
        raise UsageError(f"--mirror without a value reads the mirror STORE.json records, and {store.url} "
                         "records none: give --mirror MIRROR", store=store.url, path="STORE.json")
    if url is not None and recordable_url(url) == store.url:
        raise UsageError(f"a store cannot be its own mirror: {store.url}", store=store.url)
    return url


def mirror_options(args: argparse.Namespace) -> StoreOptions:
    return StoreOptions(storage_options=storage_options(args.mirror_storage_options, "--mirror-storage-options"))


@dataclass
class MirrorView:
    """The mirror as a command saw it: its reader and listing (None when no store is there yet, or when
    it could not be read: then ``error`` says why)."""

    url: str
    store: Store | None = None
    cls: Classification | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None

    def newest_step(self) -> int | None:
        return self.cls.committed[-1].step if self.cls is not None and self.cls.committed else None


@contextmanager
def read_mirror(args: argparse.Namespace, store: Store) -> Iterator[MirrorView | None]:
    """The mirror of ``ls`` and ``resume-info`` (None without one), opened readonly: never locked, so
    nothing here waits for the mirror's writer. Unreadable: a warning on stderr and ``error`` set."""
    url = mirror_url(args, store, default_recorded=True)
    if url is None:
        yield None
        return
    view = MirrorView(url)
    try:
        view.store = Store.open(url, readonly=True, options=mirror_options(args))
        view.cls = spi.classify(view.store)
    except StoreNotFound:
        pass  # reachable and empty: the run's first cut is not mirrored yet
    except UsageError:
        raise  # a bad --mirror or --mirror-storage-options: exit 2, as for URL
    except Exception as exc:  # noqa: BLE001 - a backend's own error too (botocore; no gcsfs here): never a crash
        view.error = f"{type(exc).__name__}: {exc}"
        print(f"ckptstore: warning: the mirror {url} cannot be read ({view.error}); "
              f"reporting the local tier {store.url} alone", file=sys.stderr)
    try:
        yield view
    finally:
        if view.store is not None:
            view.store.close()


def mirrored(view: MirrorView, cls: Classification) -> dict[str, bool | None]:
    """Cut id -> whether the mirror holds a committed copy of it (the same id and the same manifest);
    None for every cut when the mirror cannot be read."""
    if not view.reachable:
        return {m.cut: None for m in cls.committed}
    theirs = view.cls
    return {m.cut: theirs is not None and theirs.find(m.cut) == m for m in cls.committed}


def ls_mirrored(view: MirrorView, cls: Classification, doc: dict[str, Any],
                rows: list[list[Any]]) -> tuple[list[str], list[list[Any]]]:
    """``ls`` with a mirror: ``mirrored`` on every cut of ``doc`` and ``doc["mirror"]``; the headers and
    rows with a ``mirrored`` column (yes, no, ``?`` when the mirror cannot be read)."""
    flags = mirrored(view, cls)
    for cut in doc["cuts"]:
        cut["mirrored"] = flags[cut["id"]]
    doc["mirror"] = {"url": view.url, "reachable": view.reachable}
    if not view.reachable:
        doc["mirror"]["error"] = view.error
    shown = {True: "yes", False: "no", None: "?"}
    return [*CUT_HEADERS, "mirrored"], [[*row, shown[flags[m.cut]]] for row, m in zip(rows, cls.committed)]


def ls_summary(doc: dict[str, Any]) -> str:
    """``ls``'s line about the mirror."""
    mirror = doc["mirror"]
    if not mirror["reachable"]:
        return f"mirror {mirror['url']}: cannot be read ({mirror['error']})"
    n = sum(1 for c in doc["cuts"] if c["mirrored"])
    return f"mirror {mirror['url']}: {n} of {len(doc['cuts'])} cut(s) mirrored"


def lag_json(view: MirrorView, cls: Classification) -> dict[str, Any]:
    """``resume-info``'s ``mirror``: how far the mirror is behind the local tier, in steps (the local
    newest committed step minus the mirror's, at least 0; 0 when the local tier holds no cut, null when
    only the mirror holds none) and in cuts (local committed cuts newer than the mirror's newest)."""
    doc: dict[str, Any] = {"url": view.url, "latest_step": None, "lag_steps": None, "lag_cuts": None,
                           "reachable": view.reachable}
    if not view.reachable:
        doc["error"] = view.error
        return doc
    theirs = view.newest_step()
    ours = cls.committed[-1].step if cls.committed else None
    doc["latest_step"] = theirs
    doc["lag_cuts"] = sum(1 for m in cls.committed if theirs is None or m.step > theirs)
    if ours is None:
        doc["lag_steps"] = 0
    elif theirs is not None:
        doc["lag_steps"] = max(0, ours - theirs)
    return doc


def lag_text(lag: dict[str, Any]) -> str:
    if not lag["reachable"]:
        return f"mirror {lag['url']}: cannot be read ({lag['error']}); its lag is unknown"
    newest = "holds no cut" if lag["latest_step"] is None else f"newest step {lag['latest_step']}"
    steps = "" if lag["lag_steps"] is None else f"{lag['lag_steps']} step(s) and "
    return f"mirror {lag['url']}: {newest}, {steps}{lag['lag_cuts']} cut(s) behind the local tier"


def choose_tiers(store: Store, cls: Classification, view: MirrorView | None) -> Choice:
    """The cut restore would take (``Store.choose(fallback=True)``: the newest step that verifies in
    either tier, :func:`~ckptstore.selection.choose_across`), without recording the damaged copies it
    skips: ``resume-info`` only looks. The local tier alone when the mirror holds nothing readable."""
    tiers = [Tier("local", store.storage, cls)]
    if view is not None and view.store is not None and view.cls is not None:
        tiers.append(Tier("mirror", view.store.storage, view.cls))
    return choose_across(tiers, fallback=True)


def local_healthy(store: Store, cls: Classification, choice: Choice | None) -> bool:
    """Whether the local tier's LATEST is healthy as ``resume-info`` without a mirror says it (LATEST
    names the newest local cut that verifies), so the mirror never changes the exit status. Read off
    the choice across tiers where it settles it; where the mirror's copy won, the local tier is asked
    alone (it may not have verified the local LATEST at all: the mirror held a newer step)."""
    if cls.latest_problem is not None:
        return False
    if not cls.committed:
        return True
    latest = cls.latest.cut if cls.latest is not None else None
    if choice is None or choice.info is None:
        return False  # no copy of any committed cut verifies
    if any(tier == "local" and cut == latest for tier, cut, _ in choice.skips):
        return False
    if choice.tier == 0:
        return choice.info.id == latest
    try:
        info, _ = choose_cut(store.storage, cls, fallback=True)
    except CutNotFound:
        return False
    return info is not None and info.id == latest


__all__ = ["MirrorView", "RECORDED", "add_mirror_flags", "choose_tiers", "lag_json", "lag_text", "local_healthy",
           "ls_mirrored", "ls_summary", "mirror_options", "mirror_url", "mirrored", "read_mirror"]


def resume_info_mirror_alone(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``resume-info LOCAL --mirror MIRROR`` where LOCAL is gone (a replaced node, issue 21): restore's
    choice is then the mirror's newest cut that verifies (what ``restore(..., mirror=)`` reads), said
    with ``local_missing``; the caller's exit status stays the local tier's (not healthy)."""
    with Store.open(args.mirror, readonly=True, options=mirror_options(args)) as m:
        cls = spi.classify(m)
        try:
            info, skipped = choose_cut(m.storage, cls, fallback=True)
        except CutNotFound as exc:
            info, skipped = None, {"*": exc.message}
        newest = cls.committed[-1].step if cls.committed else None
        doc = {"store": args.url, "local_missing": True, "resume_step": info.step if info else None,
               "cut": info.id if info else None, "finished": bool(info.final) if info else False,
               "healthy": False, "latest": None, "world_size": info.world_size if info else None,
               "latest_problem": None, "skipped": [{"cut": c, "reason": r} for c, r in skipped.items()],
               "tier": "mirror" if info else None,
               "mirror": {"url": m.url, "latest_step": newest, "lag_steps": None, "lag_cuts": None, "reachable": True}}
        text = (f"the local tier {args.url} is missing: "
                + (f"resume from step {info.step} ({info.id}) from the mirror {m.url}; run "
                   f"{'finished' if info.final else 'interrupted'}" if info else
                   f"the mirror {m.url} holds no cut that verifies: start from scratch"))
    return doc, text
