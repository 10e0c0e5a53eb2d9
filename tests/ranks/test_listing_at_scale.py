"""Listing at scale (issue 24): with ``group=``, only rank 0 lists the store. The other ranks get its
answer through the rendezvous store (restore's choice, the Checkpointer's check of LATEST) or read the
one object they need (LATEST and the manifest it names, their part's shards). Peers' incident: 512 ranks
listing an object store at once were answered SlowDown and read the store as "0 checkpoints"
(dlio_benchmark issue 347)."""

from __future__ import annotations

import os

import pytest

import ckptstore
from ckptstore import layout
from ckptstore.errors import LatestError
from ckptstore.latest import Pointer
from ckptstore.reading import pointed_manifest
from ckptstore.store import core_of

from .rankkit import describe, run_job

LISTING_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "listing_worker.py")


def test_only_rank_0_lists_the_store_in_the_collective_paths(tmp_path):
    """Open, save, load of latest, latest(), restore (and with fallback), prune and gc, a Checkpointer
    (thread mode) cutting and pruning, restore from a URL, a readonly open and its load: rank 1 lists
    nothing (before issue 24 it listed the whole store in every read: load, latest, each restore three
    times, the Checkpointer's constructor). A LATEST broken later is rank 0's finding, raised on every rank."""
    res = run_job(str(tmp_path / "out"), 2, "paths", worker=LISTING_WORKER, url=str(tmp_path / "store"))
    assert all(r.result and "error" not in r.result for r in res), describe(res)
    r0, r1 = res[0].result, res[1].result
    # The counter works, on both ranks: rank 0 classified the store (its choice of the cut to restore
    # among others), and rank 1's reads were counted.
    assert r0["listed"]["restore"] and r0["listed"]["checkpointer-cut"], r0["listed"]
    assert r1["calls"]["load-latest"]["open_reader"] >= 1, r1["calls"]
    assert r1["listed"] == {}, r1["listed"]
    assert r1["refused"] == ["prune", "gc"] and r0["refused"] == []
    # ... and rank 1 got the same answers as rank 0.
    for key in ("loaded_step", "latest", "resumed_step", "again_step"):
        assert r0[key] == r1[key], (key, r0[key], r1[key])
    # A LATEST broken after the open: rank 0's Checkpointer finds it, rank 1 hears of it from rank 0.
    assert r0["broken"]["error_type"] == "LatestError", r0["broken"]
    assert r1["broken"]["error_type"] == "RankFailure" and r1["broken"]["failed_ranks"] == [0], r1["broken"]
    assert "LATEST is unreadable" in r1["broken"]["error"]


def _store_with_two_cuts(path) -> ckptstore.Store:
    store = ckptstore.Store.open(str(path), create=True)
    for step in (1, 2):
        store.save({"step": step, "w": [float(step)] * 4}, step=step)
    return store


def test_latest_without_a_listing_is_the_classifications_latest(tmp_path):
    with _store_with_two_cuts(tmp_path / "s") as store:
        m = pointed_manifest(core_of(store))
        assert m is not None and m == store.manifest() and m.step == 2


def _garbage_latest(path) -> None:
    (path / layout.LATEST_FILE).write_bytes(b"{not json")


def _wrong_hash(path) -> None:
    p = Pointer.from_bytes((path / layout.LATEST_FILE).read_bytes())
    (path / layout.LATEST_FILE).write_bytes(p.model_copy(update={"manifest_blake3": "0" * 64}).to_bytes())


def _manifest_of_latest(path):
    return path / layout.manifest_path(Pointer.from_bytes((path / layout.LATEST_FILE).read_bytes()).cut)


@pytest.mark.parametrize("damage", [
    _garbage_latest,
    _wrong_hash,
    lambda path: _manifest_of_latest(path).unlink(),  # dangling
    lambda path: _manifest_of_latest(path).write_bytes(b"[]"),  # a damaged manifest
], ids=["unreadable", "hash-mismatch", "dangling", "damaged-manifest"])
def test_a_broken_latest_read_without_a_listing_raises_what_the_classification_says(tmp_path, damage):
    store = _store_with_two_cuts(tmp_path / "s")
    store.close()
    damage(tmp_path / "s")
    with ckptstore.Store.open(str(tmp_path / "s"), readonly=True) as reader:
        with pytest.raises(LatestError) as classified:
            reader.latest()
        with pytest.raises(LatestError) as pointed:
            pointed_manifest(core_of(reader))
    assert pointed.value.message == classified.value.message
    assert pointed.value.hint == classified.value.hint


def test_no_latest_is_left_to_the_classification(tmp_path):
    """Only a listing tells an empty store from one that lost its LATEST (the classification says
    which), so a rank other than 0 lists then."""
    with ckptstore.Store.open(str(tmp_path / "s"), create=True) as store:
        assert pointed_manifest(core_of(store)) is None
