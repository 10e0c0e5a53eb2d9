"""A reader that scans while the writer commits sees a consistent store (issue 13, found by the
integration examples polling ``latest()`` during a run).

A scan reads LATEST first, then the cut directories, then the marks. A cut committed in between (its
manifest written, LATEST moved, its mark removed) looks committed while the LATEST read earlier does
not name it: with no LATEST yet that read "LATEST is missing", and with a prune of the old cut right
after, "LATEST names a cut that is not committed". Both are the reader's timing, not damage: the
reader scans again while LATEST moves. Real damage, where LATEST stays put, is still reported."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ckptstore
from ckptstore import Store
from ckptstore.errors import LatestError
from ckptstore.storage import open_storage


def reader_that_commits_mid_scan(url: str, writer: Store, steps: list[int], prune: bool) -> Store:
    """A read-only store whose storage runs ``writer.save`` (and a prune) right before its first
    listing of ``cuts/`` after LATEST was read: a commit in the middle of the reader's scan."""
    storage = open_storage(url)
    original = storage.list_dir

    def list_dir(rel: str):  # noqa: ANN202
        if rel == "cuts" and steps:
            writer.save({"w": np.zeros(3)}, step=steps.pop(0))
            if prune:
                writer.prune(ckptstore.KeepLast(1))
        return original(rel)

    storage.list_dir = list_dir  # type: ignore[method-assign]
    return Store.open(storage, readonly=True)


@pytest.mark.parametrize("first", [True, False], ids=["first-commit", "commit-and-prune"])
def test_a_reader_scanning_during_a_commit_sees_the_store_before_or_after_it(tmp_path, first):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as writer:
        if not first:
            writer.save({"w": np.ones(3)}, step=1)
        pending = [2]
        reader = reader_that_commits_mid_scan(url, writer, pending, prune=not first)
        latest = reader.latest()  # before the fix: LatestError (missing / dangling)
        assert pending == [], "the commit did not happen during the reader's scan"
        assert latest is not None and latest.step == 2
        assert reader.verify().ok
        reader.close()


def test_a_real_latest_problem_is_still_reported(tmp_path):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as writer:
        writer.save({"w": np.ones(3)}, step=1)
    os.remove(os.path.join(url, "LATEST"))
    with Store.open(url, readonly=True) as reader:
        with pytest.raises(LatestError, match="missing"):
            reader.latest()
