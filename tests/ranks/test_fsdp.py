"""An FSDP2 job (fully_shard on CPU, gloo) checkpointed by Checkpointer(group=), killed and resumed in place."""

from __future__ import annotations

import ckptstore

from .rankkit import describe, run_job


def test_fsdp2_model_and_optimizer_resume_bitwise_after_sigkill(tmp_path):
    ref = run_job(str(tmp_path / "ref"), 2, "fsdp", url=str(tmp_path / "ref-store"), steps=9, timeout=150)
    assert all(r.result and "digest" in r.result for r in ref), describe(ref)

    url = str(tmp_path / "store")
    killed = run_job(str(tmp_path / "a"), 2, "fsdp", url=url, steps=9, die_at=4, timeout=150)
    assert all(r.killed for r in killed), describe(killed)
    with ckptstore.Store.open(url, readonly=True) as store:
        latest = store.latest()
        assert latest.step == 4 and latest.world_size == 2
        part = store.manifest().for_rank(1)
        model_tree = next(it["v"] for it in part.tree["items"] if it["k"] == "model")
        kinds = {it["v"]["t"] for it in model_tree["items"]}
        assert kinds == {"dtensor"}  # every parameter is stored as its shard plus its layout
    resumed = run_job(str(tmp_path / "b"), 2, "fsdp", url=url, steps=9, timeout=150)
    assert all(r.result and r.result.get("resumed_from") == 4 for r in resumed), describe(resumed)
    for r_ref, r_res in zip(ref, resumed):
        assert r_res.result["digest"] == r_ref.result["digest"], f"rank {r_ref.rank} diverged after the restart"
    with ckptstore.Store.open(url, readonly=True) as store:
        assert store.latest().step == 9 and store.latest().final
        assert store.verify().ok
