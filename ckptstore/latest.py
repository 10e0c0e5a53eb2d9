"""The LATEST pointer: the commit point of the store.

LATEST is a small JSON file naming the committed cut (by its relative id, so a moved store still
resolves, failure-modes row 17) and the blake3 of that cut's manifest bytes, so a pointer can never be
paired with a different manifest. It is only ever replaced atomically and durably.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field

from .models import CutId, StrictModel


class Pointer(StrictModel):
    KIND = "ckptstore.latest"

    kind: Literal["ckptstore.latest"] = "ckptstore.latest"
    format_version: Literal[1] = 1
    cut: CutId
    step: int = Field(ge=0)
    manifest_blake3: str = Field(pattern=r"^[0-9a-f]{64}$")


class StoreIdentity(StrictModel):
    """STORE.json: marks a directory as a ckptstore store, so ``gc`` never works on a foreign tree.
    ``mirror``: the URL of the store's mirror tier, recorded by a writer opened with one (issue 21),
    without credentials; absent (not null) without one, so a store without a mirror keeps its bytes."""

    KIND = "ckptstore.store"

    kind: Literal["ckptstore.store"] = "ckptstore.store"
    format_version: Literal[1] = 1
    created_at: str
    mirror: str | None = Field(default=None, min_length=1)

    def to_bytes(self) -> bytes:
        # No "mirror": null in a store without a mirror: its STORE.json stays byte for byte what every
        # version wrote (tests/store/test_golden.py), and older versions, which forbid unknown fields,
        # still open it (issue 21).
        doc = self.model_dump(mode="json")
        if doc["mirror"] is None:
            del doc["mirror"]
        return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()
