"""ckptstore: a crash-safe checkpoint store for PyTorch trainers.

The public API is re-exported here; everything else is private. ``import ckptstore`` never imports
torch nor the writer (``ckptstore.writer``), so audits run on machines without torch.
"""

from __future__ import annotations

from .version import __version__  # noqa: E402
from .errors import (  # noqa: E402
    CkptStoreError,
    CorruptCut,
    CutNotFound,
    DataError,
    HostileInput,
    LatestError,
    ManifestError,
    MissingFile,
    StepConflict,
    StorageError,
    StoreLocked,
    StoreNotFound,
    TruncatedFile,
    UnsupportedValue,
    UsageError,
)
from .events import JsonLinesFile  # noqa: E402
from .info import CutInfo  # noqa: E402
from .options import StoreOptions  # noqa: E402
from .resume import Resumed, capture_rng, restore, restore_rng, training_state  # noqa: E402
from .retention import KeepEvery, KeepFinal, KeepLast, KeepTagged, Policy  # noqa: E402
from .store import GcReport, Store, load  # noqa: E402
from .verify import Finding, VerifyReport  # noqa: E402

__all__ = [
    "__version__",
    "Store",
    "StoreOptions",
    "CutInfo",
    "load",
    "restore",
    "training_state",
    "Resumed",
    "capture_rng",
    "restore_rng",
    "GcReport",
    "VerifyReport",
    "Finding",
    "JsonLinesFile",
    "Policy",
    "KeepLast",
    "KeepEvery",
    "KeepTagged",
    "KeepFinal",
    "CkptStoreError",
    "DataError",
    "CorruptCut",
    "TruncatedFile",
    "MissingFile",
    "ManifestError",
    "LatestError",
    "HostileInput",
    "UsageError",
    "UnsupportedValue",
    "StepConflict",
    "CutNotFound",
    "StoreNotFound",
    "StoreLocked",
    "StorageError",
]
