"""Verify's notice hook for the manifest ``metadata`` that an integration owns (issue 20).

The store layer knows no integration: the checks that used to sit in verify.py for one of them (the
count of its byte-IO items) now live in the integration, registered here under the metadata key it
writes. ``verify`` runs the check of every key a committed cut's ``metadata`` holds and reports what it
returns as notices of that cut (never errors: metadata the store does not understand proves no damage).

A check takes the JSON document under its key and returns ``(kind, message)`` pairs, ``kind`` a member
of the integration's own :class:`NoticeKind` subclass (spelled in JSON like every finding kind). An
integration registers its checks when imported (:func:`register`). So that ``ckptstore verify`` in a
process that never imported the integration (the CLI, maybe without torch) reports the same notices,
verify, meeting a key no check is registered for, imports the module that the table
``ckptstore.integrations.METADATA_CHECKS`` names for that key: a fixed table, so a
manifest's keys never choose what is imported, and those modules import no framework. A key the table
does not name is plain metadata: no notice.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

from .kinds import StrKind

#: The package whose ``METADATA_CHECKS`` maps a metadata key to the module that registers its check.
TABLE_MODULE = "ckptstore.integrations"


class NoticeKind(StrKind):
    """The base of the notice kinds an integration's metadata check reports: subclass it with members."""

    @property
    def about_latest(self) -> bool:
        """Never: a notice about one cut's metadata (``FindingKind.about_latest``'s counterpart)."""
        return False


#: A check of the document under its key: the notices it finds, as ``(kind, message)``.
MetadataCheck = Callable[[Any], Iterable[tuple[NoticeKind, str]]]

_CHECKS: dict[str, MetadataCheck] = {}
_KINDS: list[type[NoticeKind]] = []


def register(key: str, check: MetadataCheck, kinds: type[NoticeKind]) -> None:
    """Runs ``check`` on the document under ``metadata[key]`` of every cut verify audits; ``kinds``
    is the enum of the notice kinds it reports (a ``Finding`` then accepts their spellings)."""
    if not (isinstance(kinds, type) and issubclass(kinds, NoticeKind)):
        raise TypeError(f"kinds must be a NoticeKind subclass, got {kinds!r}")
    _CHECKS[key] = check
    if kinds not in _KINDS:
        _KINDS.append(kinds)


def notice_kind(spelling: str) -> NoticeKind | None:
    """The registered notice kind spelled ``spelling``, or None."""
    for kinds in _KINDS:
        try:
            return kinds(spelling)
        except ValueError:
            continue
    return None


def notices(metadata: Any) -> list[tuple[NoticeKind, str]]:
    """What the checks of the keys of a manifest's ``metadata`` report, in key order."""
    if not isinstance(metadata, dict):
        return []
    found: list[tuple[NoticeKind, str]] = []
    for key, doc in metadata.items():
        check = _check_for(key)
        if check is not None:
            found.extend(check(doc))
    return found


def _check_for(key: str) -> MetadataCheck | None:
    """The check registered for ``key``, importing the module the table names for it when none is yet.
    Nothing is cached here: the import system keeps the module, and a thread that asks while another
    imports it waits for that import (a "looked up" flag set first would let it see no check)."""
    check = _CHECKS.get(key)
    if check is None:
        module = getattr(importlib.import_module(TABLE_MODULE), "METADATA_CHECKS", {}).get(key)
        if module is not None:
            importlib.import_module(module)  # registers the key's check
            check = _CHECKS.get(key)
    return check


__all__ = ["MetadataCheck", "NoticeKind", "TABLE_MODULE", "notice_kind", "notices", "register"]
