"""``ckptstore mirror URL --to MIRROR``: uploads what the mirror is missing, oldest first, with
progress on stderr (issue 21, first part: :mod:`ckptstore.mirroring`). A module of its own beside
commands.py: parse, call one library function, render."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..collect import leftover_json
from ..errors import UsageError
from ..info import CutInfo
from ..mirroring import MirrorReport, mirror_missing
from ..opening import recorded_mirror
from ..options import StoreOptions
from ..store import Store
from .exits import EXIT_OK, EXIT_PROBLEM
from .render import CUT_HEADERS, Progress, cut_rows, emit, human_bytes, table


def storage_options(value: str | None, flag: str) -> dict[str, Any] | None:
    """A ``--...storage-options`` value: a JSON object, or ``@FILE`` holding one (so credentials need
    not stand on the command line, where ``ps`` shows them to every user)."""
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UsageError(f"{flag}: cannot read {value[1:]}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{flag} takes a JSON object or @FILE holding one: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{flag} takes a JSON object (fsspec storage options), got {type(doc).__name__}")
    return doc


class _CutProgress:
    """One line per cut on stderr (always: it goes where the JSON does not), and the byte bar of the
    cut being copied where stderr is a terminal."""

    def __init__(self) -> None:
        self._bar: Progress | None = None

    def start(self, info: CutInfo, i: int, n: int) -> None:
        self.finish()
        sys.stderr.write(f"mirroring {info.id} (step {info.step}, {human_bytes(info.nbytes)}) ({i}/{n})\n")
        sys.stderr.flush()
        self._bar = Progress(info.nbytes, f"  {info.id}")

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar(n)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.finish()
            self._bar = None


def cmd_mirror(args: argparse.Namespace) -> int:
    src_options = StoreOptions(storage_options=storage_options(args.storage_options, "--storage-options"))
    dst_options = StoreOptions(storage_options=storage_options(args.to_storage_options, "--to-storage-options"))
    # The source is only read (a trainer may hold its writer lock); the mirror is written as its writer,
    # whose open recovers what an interrupted mirror left.
    with Store.open(args.url, readonly=True, options=src_options) as src, \
            Store.open(_mirror_of(args, src), create=True, options=dst_options) as dst:
        progress = _CutProgress()
        try:
            report = mirror_missing(src, dst, progress=progress, on_cut=progress.start)
        finally:
            progress.finish()
        latest = dst.latest()
        doc = {**report.to_json(), "latest": latest.id if latest else None,
               "removed_at_open": [leftover_json(lo) for lo in dst.recovered]}
        emit(args, doc, _text(report, src.url, latest.id if latest else None))
        return EXIT_OK if report.ok else EXIT_PROBLEM


def _mirror_of(args: argparse.Namespace, src: Store) -> str:
    """``--to MIRROR``, else the mirror URL's STORE.json records (issue 21); neither is a usage error."""
    if args.to is not None:
        return str(args.to)
    url = recorded_mirror(src.storage)
    if url is None:
        raise UsageError(f"ckptstore mirror needs --to MIRROR: {src.url} records no mirror in its STORE.json "
                         "(a Checkpointer or Store.open with mirror= records one)", store=src.url, path="STORE.json")
    return url


def _text(report: MirrorReport, source: str, latest: str | None) -> str:
    lines = [table(CUT_HEADERS, cut_rows(report.mirrored, latest))] if report.mirrored else []
    lines.append(f"mirrored {len(report.mirrored)} cut(s) to {report.mirror}; its LATEST: {latest or '-'}")
    for e in report.failed:
        lines.append(f"! {e.cut}: not mirrored, a file does not match its manifest ({type(e).__name__}: {e}); "
                     f"recorded bad in {source}")
    for cut in report.removed:
        lines.append(f"  {cut}: removed from {source} while it was mirrored")
    return "\n".join(lines)


__all__ = ["cmd_mirror", "storage_options"]
