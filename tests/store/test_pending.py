"""The cut lifecycle object: only writers begin cuts; each cut moves open -> written -> committed (or
abandoned) and nothing else; a cut in flight is invisible to prune and gc; and a committed cut survives
a failed mark removal (protocol Rule M, issue 9's data-loss bug)."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from ckptstore import KeepLast, StepConflict, Store, StorageError, UsageError, layout
from ckptstore.arrays import describe
from ckptstore.storage import PosixStorage
from ckptstore.tree import flatten


def _items(i: int):
    tree, leaves = flatten({"w": np.arange(1000, dtype=np.float32) + i, "n": i})
    return tree, [describe(x) for x in leaves]


def _write(store: Store, pending, i: int) -> dict:
    tree, items = _items(i)
    pending.write(items, codec=store.shard_codec(), max_shard_bytes=store.options.max_shard_bytes)
    pending.files_durable()
    return tree


def test_a_readonly_handle_can_neither_begin_nor_commit_nor_abandon(tmp_path):
    url = str(tmp_path / "s")
    with Store.open(url, create=True) as w:
        w.save({"a": np.ones(3)}, step=1)
    with Store.open(url, readonly=True) as ro:
        with pytest.raises(UsageError, match="needs a writer"):
            ro.begin_cut(2)
        # The old public back doors of the commit protocol are gone.
        assert not hasattr(ro, "commit_manifest") and not hasattr(ro, "abandon_cut")
        assert ro.latest().step == 1


def test_lifecycle_commits_once_and_refuses_every_other_move(tmp_path):
    with Store.open(str(tmp_path / "s"), create=True) as store:
        pending = store.begin_cut(5, writer="test")
        assert pending.state == "open" and store.storage.exists(layout.mark_path(pending.id))
        with pytest.raises(UsageError, match="cannot commit"):
            pending.commit(tree={})
        tree = _write(store, pending, 5)
        assert pending.state == "written"
        with pytest.raises(UsageError, match="cannot add files"):
            pending.add_files([], [])
        info = pending.commit(tree=tree, tags=("best",))
        assert pending.state == "committed" and info.id == pending.id and info.tags == ("best",)
        assert not store.storage.exists(layout.mark_path(pending.id))
        with pytest.raises(UsageError):
            pending.commit(tree=tree)
        pending.abandon()  # a no-op once the cut has ended: never removes a committed cut
        assert store.load()["n"] == 5 and store.verify().ok


def test_abandon_removes_files_and_mark_and_an_open_cut_is_safe_from_gc_and_prune(tmp_path):
    with Store.open(str(tmp_path / "s"), create=True) as store:
        for i in (1, 2):
            store.save({"a": np.full(4, i)}, step=i)
        pending = store.begin_cut(3)
        tree, items = _items(3)
        pending.write(items, codec=store.shard_codec(), max_shard_bytes=store.options.max_shard_bytes)
        report = store.gc()
        assert [lo.cut for lo in report.kept] == [pending.id] and not report.removed
        store.prune(KeepLast(1))
        assert store.storage.list_dir(layout.cut_dir(pending.id)), "gc or prune touched a cut in flight"
        pending.abandon()
        assert pending.state == "abandoned"
        assert not store.storage.exists(layout.cut_dir(pending.id))
        assert not store.storage.exists(layout.mark_path(pending.id))
        assert store.classify().leftovers == [] and store.latest().step == 2


def test_begin_cut_refuses_steps_at_or_below_latest_and_foreign_ranks(tmp_path):
    with Store.open(str(tmp_path / "s"), create=True) as store:
        store.save({"a": np.ones(2)}, step=10)
        with pytest.raises(StepConflict):
            store.begin_cut(10)
        with pytest.raises(UsageError, match="does not match step"):
            store.begin_cut(11, cut=layout.new_cut_id(12))
        pending = store.begin_cut(11)
        files, tensors = pending.write(_items(11)[1], codec=store.shard_codec(), max_shard_bytes=1 << 20, rank=0)
        with pytest.raises(UsageError, match="another rank"):
            pending.add_files(files, tensors, rank=1)
        pending.abandon()


class _MarkDeleteFailsOnce(PosixStorage):
    """Real POSIX storage whose first removal of a mark fails with EIO (a transient DELETE error)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.failed = False

    def delete(self, rel: str, *, durable: bool = True) -> None:
        if rel.startswith(layout.MARKS_DIR + "/") and not self.failed:
            self.failed = True
            raise self._error(OSError(errno.EIO, "injected EIO"), "deleting", rel)
        super().delete(rel, durable=durable)


def test_a_committed_cut_survives_a_failed_mark_removal_and_the_next_commits(tmp_path):
    """Issue 9: save returned a committed cut whose mark removal failed; the next save moved LATEST,
    the cut then looked in progress, and the next writer open deleted it."""
    root = str(tmp_path / "s")
    storage = _MarkDeleteFailsOnce(root)
    with Store.open(storage, create=True) as store:
        first = store.save({"a": np.arange(5)}, step=1, tags=["keep"], final=True)
        assert storage.failed and storage.exists(layout.mark_path(first.id))  # the stale mark is there
        store.save({"a": np.arange(6)}, step=2)
        # Rule M: LATEST left the first cut only after its mark was gone.
        assert not storage.exists(layout.mark_path(first.id))
    with Store.open(root) as store:  # recovery on open
        assert [c.id for c in store.cuts()][0] == first.id
        assert list(store.load(first.id)["a"]) == list(range(5)) and store.verify(first.id).ok


def test_when_the_previous_mark_cannot_be_removed_the_new_cut_is_not_committed(tmp_path):
    """The other side of Rule M: if the stale mark of LATEST's cut cannot go, LATEST does not move;
    the new save fails cleanly and the old cut stays committed and named."""
    root = str(tmp_path / "s")
    storage = _MarkDeleteFailsOnce(root)
    with Store.open(storage, create=True) as store:
        first = store.save({"a": np.arange(5)}, step=1)  # its mark removal fails: stale mark
        storage.failed = False  # ... and fails once more, when the next commit clears it
        with pytest.raises(StorageError, match="injected EIO"):
            store.save({"a": np.arange(6)}, step=2)
        assert store.latest().id == first.id and [c.step for c in store.cuts()] == [1]
    with Store.open(root) as store:
        assert store.latest().id == first.id and store.verify().ok and store.classify().leftovers == []
