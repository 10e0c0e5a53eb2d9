"""Labels: names that point at committed cuts, written after the commit (``labels/<digest>.json``).

A framework that names checkpoints by path (Lightning's ``epoch=3-step=120.ckpt`` and ``last.ckpt``)
needs a map from its names to cuts that survives restarts and moves atomically. A label is one small
JSON file named by the blake3 of the label (so any text can be a label, and the file name never is
the caller's): writing it is one durable replace, removing it one durable delete. Several labels may
name one cut; one label names one cut. The manifest and LATEST are never touched: a label is not a
commit, only a name for one.

Removing a cut (``Store.remove``, a prune) deletes the labels that name it after its files; a label
whose cut is gone (a crash in between) is a ``stale-label`` leftover that ``gc`` removes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .layout import is_label_file_name, label_path
from .models import CutId, StrictModel

#: The longest label accepted (a path a framework hands over fits easily).
MAX_LABEL = 1024


class Label(StrictModel):
    KIND = "ckptstore.label"

    kind: Literal["ckptstore.label"] = "ckptstore.label"
    format_version: Literal[1] = 1
    label: str = Field(min_length=1, max_length=MAX_LABEL)
    cut: CutId
    step: int = Field(ge=0)
    labeled_at: str


__all__ = ["Label", "MAX_LABEL", "label_path", "is_label_file_name"]
