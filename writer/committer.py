"""Deprecated: this module is :mod:`ckptstore.writer.handle` now (issue 20: its docstring claimed the
commit thread, which lives in :mod:`ckptstore.writer.pipeline`). Kept for one release; import
``CutHandle`` from ``ckptstore.writer``."""

from __future__ import annotations

import warnings

from .handle import TERMINAL, CutHandle, elapsed

warnings.warn("ckptstore.writer.committer is deprecated: import CutHandle from ckptstore.writer "
              "(the module is ckptstore.writer.handle)", DeprecationWarning, stacklevel=2)

__all__ = ["CutHandle", "TERMINAL", "elapsed"]
