"""A Checkpointer with group= and mirror= (issue 21, "Several ranks", the writer side): every rank's
tier uploads its own files of each cut committed locally, rank 0 commits the mirror's cut. Real gloo
ranks (2), local directories for both tiers, a real SIGKILL."""

from __future__ import annotations

import os

import ckptstore
from ckptstore import layout

from .rank_worker import same, state_of
from .rankkit import describe, run_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mirror_ck_worker.py")
RANK_TIMEOUT = 3.0


def _job(tmp_path, scenario: str, **cfg):
    url, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    res = run_job(str(tmp_path / "out"), 2, scenario, worker=WORKER, url=url, mirror=mirror,
                  rank_timeout=RANK_TIMEOUT, timeout=90, **cfg)
    return url, mirror, res


def test_a_two_rank_checkpointer_mirrors_every_cut_and_the_mirror_alone_restores_each_rank(tmp_path):
    url, mirror, res = _job(tmp_path, "cuts")
    assert all(r.returncode == 0 and r.result and r.result.get("ok") for r in res), describe(res)
    a, b = res[0].result, res[1].result
    cuts = a["cuts"]
    assert b["cuts"] == cuts and len(cuts) == 3
    assert a["mirrored"] == cuts and b["mirrored"] == [], describe(res)  # rank 0 commits on the mirror
    assert a["failed"] == [] and b["failed"] == [], describe(res)
    assert a["on_mirror_at_final"] and b["on_mirror_at_final"]  # cut(final=True) waited on every rank
    with ckptstore.Store.open(mirror, readonly=True) as store:
        assert [c.id for c in store.cuts()] == cuts and store.latest().id == cuts[-1]
        assert all(c.world_size == 2 for c in store.cuts())
        assert store.verify().ok
    for rank in (0, 1):  # the mirror alone: each rank's part of each cut, bitwise
        for step, cut in enumerate(cuts, start=1):
            assert same(ckptstore.load(mirror, cut, rank=rank), state_of(rank, step))
    for r in (a, b):  # the local tier was removed: every rank restored the final cut from the mirror
        assert r["restored"] == {"cut": cuts[-1], "tier": "mirror", "same": True}, describe(res)


def test_a_rank_killed_mid_upload_leaves_only_committed_cuts_on_the_mirror(tmp_path):
    url, mirror, res = _job(tmp_path, "kill", mode="thread", victim=1, mirror_timeout=1.0)
    assert res[1].killed and res[0].result is not None and res[0].result.get("ok"), describe(res)
    out = res[0].result
    assert out["mirrored"] == [out["first"]], describe(res)
    failed = out["failed"][0]  # rank 0 gave the cut up after rank_timeout, naming rank 1
    assert failed["cut"] == out["second"] and failed["error_type"] == "RankFailure", describe(res)
    assert "rank(s) [1]" in failed["error"] and failed["retry_in"] is not None
    assert out["close"]["error_type"] == "MirrorTimeout", describe(res)  # close: bounded by mirror_timeout
    with ckptstore.Store.open(mirror, readonly=True) as store:
        assert [c.id for c in store.cuts()] == [out["first"]] and store.latest().id == out["first"]
    with ckptstore.Store.open(mirror) as store:  # the mirror's own recovery takes what the upload left
        report = store.verify()
        assert report.ok and not [f for f in report.findings if f.kind.value.startswith("leftover")], report.to_json()
    assert not os.path.exists(os.path.join(mirror, layout.cut_dir(out["second"])))
    for rank in (0, 1):
        assert same(ckptstore.load(mirror, rank=rank), state_of(rank, 1))
    with ckptstore.Store.open(url, readonly=True) as store:  # every cut stays committed locally
        assert [c.id for c in store.cuts()] == [out["first"], out["second"]]
