"""The public API is what ``ckptstore.__all__`` says: pinned here, so a change to it is a decision."""

from __future__ import annotations

import types

import ckptstore

EXPECTED_ALL = [
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


def test_all_is_pinned() -> None:
    assert ckptstore.__all__ == EXPECTED_ALL


def test_every_exported_name_exists_once() -> None:
    assert len(set(ckptstore.__all__)) == len(ckptstore.__all__)
    for name in ckptstore.__all__:
        assert hasattr(ckptstore, name), name


def test_nothing_public_hides_outside_all() -> None:
    """Every public, non-module attribute of the package is exported (no accidental public API)."""
    public = {n for n, v in vars(ckptstore).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"}
    assert public <= set(ckptstore.__all__), sorted(public - set(ckptstore.__all__))


def test_exceptions_form_one_tree() -> None:
    exported = [getattr(ckptstore, n) for n in ckptstore.__all__]
    errors = [v for v in exported if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(errors) == 15
    assert all(issubclass(e, ckptstore.CkptStoreError) for e in errors)
    assert issubclass(ckptstore.MissingFile, FileNotFoundError) and issubclass(ckptstore.MissingFile, ckptstore.DataError)
    assert issubclass(ckptstore.UnsupportedValue, TypeError) and issubclass(ckptstore.UsageError, ValueError)
    assert issubclass(ckptstore.StorageError, OSError)
    assert issubclass(ckptstore.TruncatedFile, ckptstore.CorruptCut)
    for data_error in (ckptstore.CorruptCut, ckptstore.ManifestError, ckptstore.LatestError, ckptstore.HostileInput):
        assert issubclass(data_error, ckptstore.DataError)
    for usage in (ckptstore.StepConflict, ckptstore.CutNotFound, ckptstore.StoreNotFound):
        assert issubclass(usage, ckptstore.UsageError) and not issubclass(usage, ckptstore.DataError)
