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


#: ``Store``'s public face is the user API only (issue 20): methods, and the read-only properties.
STORE_METHODS = ["begin_cut", "choose", "close", "cuts", "gc", "label", "labels", "latest", "load", "manifest",
                 "mark_final", "open", "prune", "remove", "repair", "restore_files", "save", "unlabel", "verify"]
STORE_PROPERTIES = ["events", "mirror", "options", "ranks", "readonly", "recovered", "role", "storage", "url"]

#: What ``ckptstore.writer`` and ``ckptstore.integrations`` may use beyond the user API (issue 20).
EXPECTED_SPI = [
    "classify", "commit_record", "part_of", "whole_of", "lock_handoff", "open_participant", "point_latest",
    "rank_part", "record_bad", "shard_codec", "shard_spec", "CutIntent", "PendingCut", "RankPart", "ShardSpec",
    "CutInfo", "FileRecord", "Manifest",
    "TensorRecord", "TensorColumns", "AttachedFile", "FilesArg", "Source", "open_sources", "close_sources", "Policy",
    "policy_from_json", "policy_to_json", "read_or_none", "remember_tree_text", "tree_text", "Leaf",
    "flatten", "unflatten", "has_pickle", "ArrayItem", "describe", "empty_for", "torch_dtype_name",
    "TORCH_DTYPES", "Flat", "LayoutCache", "write_shards", "read_header", "read_shard_into", "read_tensor_range",
    "check_header_matches", "Storage", "StorageSpec", "open_spec", "CommitProtocol", "ensure_marked",
    "finish_orphaned_cut", "InheritedLock", "Collective", "RankFailure", "RankGroup", "check_all_ok",
    "check_same", "outcome", "Emitter", "pausing", "StrictModel", "StrKind", "NoticeKind",
    "register_metadata_check", "layout", "mirror_cut", "missing", "mirror_missing", "MirrorReport",
    "MirrorConflict", "mirror_rank",
]


def test_store_public_face_is_the_user_api() -> None:
    public = {n: v for n, v in vars(ckptstore.Store).items() if not n.startswith("_")}
    assert sorted(n for n, v in public.items() if isinstance(v, property)) == STORE_PROPERTIES
    assert sorted(n for n, v in public.items() if not isinstance(v, property)) == STORE_METHODS
    for name in STORE_PROPERTIES:
        assert getattr(ckptstore.Store, name).fset is None, f"Store.{name} is settable"


def test_spi_all_is_pinned() -> None:
    import ckptstore.spi as spi

    assert spi.__all__ == EXPECTED_SPI
    assert all(hasattr(spi, name) for name in spi.__all__)


def test_the_moved_store_methods_still_work_for_one_release_and_warn(tmp_path) -> None:
    """The old names of the plumbing are no methods of the class, yet work on a handle, each with a
    DeprecationWarning naming its spi spelling, and give what spi gives."""
    import warnings

    import numpy as np
    import pytest

    import ckptstore.spi as spi

    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        first = store.save({"a": np.arange(3)}, step=1)
        store.save({"a": np.arange(4)}, step=2)
        moved = ["lock_handoff", "rank_part", "rank_part_for", "shard_codec", "point_latest", "record_bad",
                 "classify", "participant"]
        assert not any(hasattr(ckptstore.Store, name) for name in moved)
        for name in moved:
            use = r"(ckptstore\.spi\.|store\.role)"
            with pytest.warns(DeprecationWarning, match=rf"Store\.{name} is deprecated .*: use {use}"):
                getattr(store, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert store.shard_codec() == spi.shard_codec(store)
            assert store.lock_handoff()[0] == spi.lock_handoff(store)[0]
            assert store.classify().latest == spi.classify(store).latest
            assert store.point_latest(first.id).id == first.id and store.latest().id == first.id
            store.record_bad(first.id, "test")
            assert first.id in spi.classify(store).bad
            assert store.participant is False
            pending = store.begin_cut(3, world_size=2)
            with ckptstore.Store.open(url, readonly=True) as reader:  # DCP's ranks, until they switch to spi
                assert reader.rank_part_for(pending.id, 3, 1, 2).rank == 1
            pending.abandon()
            with pytest.raises(ckptstore.UsageError, match="group="):
                store.rank_part("x", 3)
    with pytest.raises(AttributeError):
        store.no_such_thing  # noqa: B018 - other names are still no attributes


#: ``ckptstore.writer``'s public API (issue 20): its exports and the Checkpointer's public face.
EXPECTED_WRITER_ALL = ["Checkpointer", "CutHandle", "WriterOptions", "WriterError", "WriterDied", "WriterTimeout",
                       "ShmTooSmall", "IllegalTransition", "MirrorTimeout"]
CHECKPOINTER_FACE = {"close": "function", "close_locally": "function", "cut": "function", "mark_final": "function",
                     "maybe_cut": "function", "skipped": "property", "waited": "property", "writer_pid": "property"}


def test_writer_all_and_the_checkpointer_face_are_pinned() -> None:
    import ckptstore.writer as writer

    assert writer.__all__ == EXPECTED_WRITER_ALL
    assert all(hasattr(writer, name) for name in writer.__all__)
    face = {n: type(v).__name__ for n, v in vars(writer.Checkpointer).items() if not n.startswith("_")}
    assert face == CHECKPOINTER_FACE
