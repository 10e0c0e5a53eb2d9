"""In-progress marks: a small durable file per cut being written, saying who writes it.

A mark is written (and fsynced, with its directory) before the first shard of a cut, and removed
(durably) only after LATEST names the cut. A cut directory with a mark is never read as committed
unless LATEST names it (then the mark is stale: the crash came between the commit and the removal).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .models import CutId, StrictModel


class Mark(StrictModel):
    KIND = "ckptstore.mark"

    kind: Literal["ckptstore.mark"] = "ckptstore.mark"
    format_version: Literal[1] = 1
    cut: CutId
    step: int = Field(ge=0)
    host: str
    pid: int
    started_at: str
    writer: str


class FinalMark(StrictModel):
    """A record that a committed cut was marked final after its commit (``Store.mark_final``): the run
    ended at its step, though the cut was written as an ordinary periodic one. The manifest stays as it
    was committed; readers take ``final`` as the manifest's flag or this mark."""

    KIND = "ckptstore.final"

    kind: Literal["ckptstore.final"] = "ckptstore.final"
    format_version: Literal[1] = 1
    cut: CutId
    step: int = Field(ge=0)
    marked_at: str


class BadCut(StrictModel):
    """A record that a committed cut failed verification on load, so restarts skip it."""

    KIND = "ckptstore.bad"

    kind: Literal["ckptstore.bad"] = "ckptstore.bad"
    format_version: Literal[1] = 1
    cut: CutId
    step: int
    reason: str
    recorded_at: str
