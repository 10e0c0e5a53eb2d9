"""A mirror tier for several ranks (issue 21, "Several ranks"): every rank uploads its own files and
posts its rank record on the mirror, rank 0 commits the mirror's cut with the storage-side two-phase
commit, and restore(group=) reads each rank's part from whichever tier holds a verified copy of it.
Real gloo ranks (2), real files, a real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil

import torch

import ckptstore
from ckptstore import layout

from .rank_worker import same, state_of
from .rankkit import describe, run_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mirror_worker.py")
RANK_TIMEOUT = 3.0


def _job(tmp_path, scenario: str, **cfg):
    mirror = str(tmp_path / "mirror")
    ckptstore.Store.open(mirror, create=True).close()  # the mirror exists before any rank opens it
    url = str(tmp_path / "local")
    res = run_job(str(tmp_path / "out"), 2, scenario, worker=WORKER, url=url, mirror=mirror,
                  rank_timeout=RANK_TIMEOUT, timeout=60, **cfg)
    return url, mirror, res


def test_a_two_rank_cut_mirrored_by_both_ranks_commits_on_the_mirror_and_loads_bitwise_from_it_alone(tmp_path):
    url, mirror, res = _job(tmp_path, "mirror")
    assert all(r.returncode == 0 and r.result and r.result.get("ok") for r in res), describe(res)
    cuts = res[0].result["cuts"]
    assert [i["id"] for i in res[0].result["infos"]] == cuts  # rank 0 committed each cut on the mirror
    assert res[1].result["infos"] == [None, None]  # the others posted their part
    for cut in cuts:  # the mirror's cut is the local one byte for byte
        rel = layout.manifest_path(cut)
        assert open(os.path.join(mirror, rel), "rb").read() == open(os.path.join(url, rel), "rb").read()
    shutil.rmtree(url)  # the local tier is gone: the mirror alone serves every rank
    with ckptstore.Store.open(mirror, readonly=True) as store:
        assert [c.id for c in store.cuts()] == cuts and store.latest().id == cuts[-1]
        assert store.verify().ok
    for rank in (0, 1):
        assert same(ckptstore.load(mirror, rank=rank), state_of(rank, 2))
        back = ckptstore.load(mirror, cuts[0], rank=rank)
        assert torch.equal(back["w"], state_of(rank, 1)["w"])


def test_a_rank_that_fails_before_its_record_leaves_the_mirrors_older_cut_and_a_named_failure(tmp_path):
    # One job, two failures of rank 1 (a damaged local file at step 2, a SIGKILL at step 3): a job
    # costs seconds to start (torch, gloo), and the suite is near its budget.
    url, mirror, res = _job(tmp_path, "fail", victim=1)
    assert res[1].killed and res[0].result is not None, describe(res)
    out = res[0].result
    for how in ("corrupt", "kill"):
        r0 = out[how]
        assert r0["error_type"] == "RankFailure" and r0["failed_ranks"] == [1], describe(res)
        assert r0["store"] == mirror and r0["cut"] == r0["expected_cut"] and "rank(s) [1]" in r0["error"]
        assert r0["path"] == layout.rank_record_path(r0["cut"], 1)
        assert r0["seconds"] < RANK_TIMEOUT + 10  # bounded by rank_timeout, never hanging
    # rank 1's damaged local file is named in its own error (what it saw before it was killed),
    # recorded bad locally, and never landed on the mirror
    damaged = out["corrupt"]["cut"]
    r1 = json.load(open(tmp_path / "out" / "partial1.json"))["corrupt"]
    assert r1["error_type"] == "HashMismatch" and (r1["store"], r1["cut"]) == (url, damaged), r1
    assert r1["path"].startswith(f"cuts/{damaged}/rank00001-")
    assert os.path.exists(os.path.join(url, layout.bad_path(damaged)))
    with ckptstore.Store.open(mirror, readonly=True) as store:
        assert store.latest().id == out["first"]  # the mirror keeps its older cut
        assert [c.id for c in store.cuts()] == [out["first"]]
    with ckptstore.Store.open(mirror) as store:  # the mirror's own recovery takes what the failures left
        report = store.verify()
        assert report.ok and not [f for f in report.findings if f.kind.value.startswith("leftover")], report.to_json()
    for how in ("corrupt", "kill"):
        assert not os.path.exists(os.path.join(mirror, layout.cut_dir(out[how]["cut"])))
    assert same(ckptstore.load(mirror, rank=1), state_of(1, 1))


def test_a_two_rank_job_whose_rank_1_lost_its_local_tier_restores_each_part_from_the_tier_that_has_it(tmp_path):
    url, mirror, res = _job(tmp_path, "restore")
    assert all(r.returncode == 0 and r.result and r.result.get("ok") for r in res), describe(res)
    newest = res[0].result["cuts"][1]
    for r in res:
        for fallback in ("False", "True"):
            got = r.result[fallback]
            assert got["cut"] == newest and got["same"], describe(res)  # the newest step, bitwise
            assert got["tier"] == ("local" if r.rank == 0 else "mirror"), describe(res)
            assert "local copy: rank 1: missing-file" in got["skipped"][newest]
    # fallback proved the local copy damaged (rank 1's part): recorded bad there, so no restart
    # verifies it again; the mirror's copy is untouched
    assert os.path.exists(os.path.join(url, layout.bad_path(newest)))
    assert ckptstore.Store.open(mirror, readonly=True).verify().ok
