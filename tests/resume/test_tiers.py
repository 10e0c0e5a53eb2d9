"""Restore across tiers (issue 21, third part): ``restore``, ``load`` and ``Store.open(mirror=)`` take the
newest step that verifies in either tier. Real stores on temporary directories, the mirror built by
``spi.mirror_missing`` as the writer's uploads build it, one mirror on the moto S3 server."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

import ckptstore
import ckptstore.spi as spi
from ckptstore import Store, StoreOptions
from filekit import flip_byte, snapshot
from statekit import assert_bitwise


def state_for(step: int) -> dict:
    """Different bytes at every step, so restoring the wrong cut (or the wrong tier's bytes) fails."""
    rng = np.random.default_rng(step)
    return {"model": {"w": torch.from_numpy(rng.standard_normal((64, 32), dtype=np.float32)),
                      "b": torch.full((32,), float(step))},
            "step": step}


def build(url: str, steps: list[int]) -> dict[int, str]:
    with Store.open(url, create=True) as s:
        return {step: s.save(state_for(step), step=step).id for step in steps}


def mirror_all(local: str, mirror: str, mirror_options: StoreOptions | None = None) -> None:
    with Store.open(local, readonly=True) as src, Store.open(mirror, create=True, options=mirror_options) as dst:
        assert spi.mirror_missing(src, dst).ok


def corrupt(url: str, cut: str) -> None:
    """Flips a byte inside the array data of every shard of ``cut`` (a local path)."""
    for name in os.listdir(os.path.join(url, "cuts", cut)):
        if name != "MANIFEST.json":
            flip_byte(os.path.join(url, "cuts", cut, name), -1)


def bad(url: str) -> set[str]:
    d = os.path.join(url, "bad")
    return {n.removesuffix(".json") for n in os.listdir(d)} if os.path.isdir(d) else set()


def test_a_corrupted_local_cut_is_restored_bitwise_from_the_mirrors_copy_of_the_same_step(tmp_path: Path) -> None:
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    ids = build(local, [100, 200])
    mirror_all(local, mirror)
    corrupt(local, ids[200])

    resumed = ckptstore.restore(local, mirror=mirror, fallback=True)
    assert resumed is not None and (resumed.cut.id, resumed.step, resumed.tier) == (ids[200], 200, "mirror")
    assert_bitwise(resumed.state, state_for(200))
    assert resumed.skipped[ids[200]].startswith("local copy: ")
    assert bad(local) == {ids[200]} and bad(mirror) == set()  # recorded in the tier whose copy failed
    with Store.open(local, readonly=True) as s:
        assert s.latest().id == ids[200]  # the local LATEST stays: the next cut (201) is above it
    # Without fallback too: the newest LATEST's other copy, nothing recorded.
    assert_bitwise(ckptstore.load(local, mirror=mirror), state_for(200))


def test_a_deleted_local_tier_restores_from_an_s3_mirror_bitwise_and_is_written_back(tmp_path: Path, s3_url) -> None:
    local = str(tmp_path / "local")
    mirror, storage_options = s3_url
    mopts = StoreOptions(storage_options=storage_options)
    ids = build(local, [100, 200])
    mirror_all(local, mirror, mopts)
    shutil.rmtree(local)  # a replaced node

    # A load reads the mirror alone and creates nothing where the local tier was.
    assert_bitwise(ckptstore.load(local, mirror=mirror, mirror_options=mopts), state_for(200))
    assert not os.path.exists(local)

    resumed = ckptstore.restore(local, mirror=mirror, mirror_options=mopts)
    assert resumed is not None and (resumed.cut.id, resumed.tier) == (ids[200], "mirror")
    assert_bitwise(resumed.state, state_for(200))
    # Written back into the local tier (verified as it streamed): the next restart is local.
    assert_bitwise(ckptstore.load(local), state_for(200))
    assert ckptstore.restore(local, mirror=mirror, mirror_options=mopts).tier == "local"


def test_a_mirror_newer_than_the_local_tier_is_chosen(tmp_path: Path) -> None:
    node_a, node_b, mirror = (str(tmp_path / n) for n in ("a", "b", "mirror"))
    build(node_a, [100, 200])
    mirror_all(node_a, mirror)
    # The run went on elsewhere: node B resumed from the mirror, cut 300 and mirrored it.
    assert ckptstore.restore(node_b, mirror=mirror).step == 200
    with Store.open(node_b) as s:
        cut300 = s.save(state_for(300), step=300).id
    mirror_all(node_b, mirror)

    with Store.open(node_a, mirror=mirror) as store:
        assert store.choose(fallback=False)[0].id == cut300
        resumed = ckptstore.restore(store, fallback=True)
    assert resumed is not None and (resumed.cut.id, resumed.tier) == (cut300, "mirror")
    assert_bitwise(resumed.state, state_for(300))
    with Store.open(node_a, readonly=True) as s:
        assert s.latest().id == cut300  # written back above the old LATEST


def test_both_copies_of_the_newest_step_bad_fall_back_to_the_next_older_step(tmp_path: Path) -> None:
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    ids = build(local, [100, 200])
    mirror_all(local, mirror)
    corrupt(local, ids[200])
    corrupt(mirror, ids[200])

    resumed = ckptstore.restore(local, mirror=mirror, fallback=True)
    assert resumed is not None and (resumed.step, resumed.tier) == (100, "local")
    assert_bitwise(resumed.state, state_for(100))
    why = resumed.skipped[ids[200]]
    assert why.startswith("local copy: ") and "; mirror copy: " in why
    assert bad(local) == {ids[200]} and bad(mirror) == {ids[200]}
    with Store.open(local) as s:  # LATEST moved back, so the run continues from step 100
        assert s.latest().id == ids[100]
        s.save(state_for(101), step=101)


def test_a_load_across_tiers_never_opens_the_local_tier_as_writer(tmp_path: Path) -> None:
    local, mirror = str(tmp_path / "local"), str(tmp_path / "missing-mirror")
    ids = build(local, [100, 200])
    with Store.open(local, mirror=mirror) as s:
        assert s.mirror is None  # no store there yet (a first run): the local tier alone
    mirror = str(tmp_path / "mirror")
    mirror_all(local, mirror)
    corrupt(local, ids[200])
    before = snapshot(local)
    with Store.open(local) as writer:  # a trainer holds the local writer lock throughout
        assert_bitwise(ckptstore.load(local, mirror=mirror), state_for(200))
        assert_bitwise(ckptstore.load(local, 100, mirror=mirror), state_for(100))
        assert writer.mirror is None
    assert snapshot(local) == before
