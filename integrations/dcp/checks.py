"""What ``verify`` says about a DCP cut, without torch (issue 20: this check lived in the store layer).

A DCP cut's byte-IO items are bytes DCP made with ``torch.save``; ckptstore stores and hashes them as
uint8 arrays and never unpickles them, but DCP's loader does, so verify names them in a notice. This
module imports no framework: ``ckptstore.verify`` imports it (by ``ckptstore.integrations``'
``METADATA_CHECKS`` table) the first time it meets a cut with DCP metadata, so ``ckptstore verify``
reports the notice, exit code unchanged, on a machine without torch.
"""

from __future__ import annotations

from typing import Any

from ckptstore.spi import NoticeKind, register_metadata_check as register

#: The manifest ``metadata`` key that holds a DCP cut's ``Metadata`` as JSON (docs/dcp.md).
METADATA_KEY = "ckptstore.dcp"


class DcpNotice(NoticeKind):
    """The notice kinds of a DCP cut, spelled in JSON as before issue 20."""

    BYTE_IO = "dcp-byte-io"


def byte_io_fqns(doc: Any) -> list[str]:
    """The fqns of the byte-IO items a DCP metadata document lists (nothing for a malformed one: the
    reader refuses that, this only counts)."""
    entries = doc.get("state_dict_metadata") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return []
    return [str(e.get("fqn")) for e in entries if isinstance(e, dict) and e.get("kind") == "bytes"]


def check(doc: Any) -> list[tuple[DcpNotice, str]]:
    """The notice of a DCP cut that holds byte-IO items (loading them through DCP unpickles them)."""
    fqns = byte_io_fqns(doc)
    if not fqns:
        return []
    return [(DcpNotice.BYTE_IO, f"{len(fqns)} value(s) saved through DCP as torch.save bytes (e.g. {fqns[0]!r}): "
             "stored and hashed as uint8 arrays, never unpickled by ckptstore; DCP's loader unpickles them "
             "(weights_only=False), so load this cut through DCP only from a store you trust")]


register(METADATA_KEY, check, DcpNotice)

__all__ = ["DcpNotice", "METADATA_KEY", "byte_io_fqns", "check"]
