"""Labels (names of committed cuts) and final marks: one durable write each through the protocol;
the manifest and LATEST stay untouched (moved out of store.py, issue 20)."""

from __future__ import annotations

from . import layout
from .core import StoreCore
from .errors import UsageError
from .info import CutInfo
from .labels import MAX_LABEL, Label, label_path
from .manifest import Manifest
from .marks import FinalMark
from .protocol import now_iso
from .selection import CutSelector, select_manifest


def label(core: StoreCore, name: str, cut: CutSelector) -> CutInfo:
    """See :meth:`ckptstore.Store.label`."""
    core.require_writer("label")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_LABEL:
        raise UsageError(f"a label is a str of 1 to {MAX_LABEL} characters, got {name!r:.80}", store=core.url)
    cls = core.classify()
    m = select_manifest(cls, cut, core.url)
    if cls.labels.get(name) != m.cut:
        core.own_dirs(layout.LABELS_DIR)
        core.protocol.write_label(Label(label=name, cut=m.cut, step=m.step, labeled_at=now_iso()))
        core.events.emit("labeled", cut=m.cut, step=m.step, label=name)
    return cls.info(m)


def unlabel(core: StoreCore, name: str) -> str | None:
    """See :meth:`ckptstore.Store.unlabel`."""
    core.require_writer("unlabel")
    cut = core.classify().labels.get(name)
    if cut is not None:
        core.protocol.remove_label_file(label_path(name))
        core.events.emit("unlabeled", cut=cut, label=name)
    return cut


def labels(core: StoreCore) -> dict[str, str]:
    """See :meth:`ckptstore.Store.labels`."""
    return dict(core.classify().labels)


def mark_final(core: StoreCore, cut: CutSelector) -> CutInfo:
    """See :meth:`ckptstore.Store.mark_final`."""
    core.require_writer("mark_final")
    cls = core.classify()
    m = select_manifest(cls, cut, core.url)
    return mark_manifest_final(core, m, marked=m.cut in cls.final)


def mark_manifest_final(core: StoreCore, m: Manifest, *, marked: bool) -> CutInfo:
    """:func:`mark_final` of committed cut ``m``, which the caller found (``marked``: it has a final
    mark already). A mirror's upload finds its cut by name, without classifying the mirror (issue 21)."""
    core.require_writer("mark_final")
    if not (m.final or marked):
        core.own_dirs(layout.FINAL_DIR)
        core.protocol.mark_final(FinalMark(cut=m.cut, step=m.step, marked_at=now_iso()))
        core.events.emit("marked-final", cut=m.cut, step=m.step)
    return CutInfo.from_manifest(m, marked_final=True)


__all__ = ["label", "labels", "mark_final", "mark_manifest_final", "unlabel"]
