"""Restore across tiers (issue 21, third part): ``restore``, ``load`` and ``Store.open(mirror=)`` take the
newest step that verifies in either tier. Real stores on temporary directories, the mirror built by
``spi.mirror_missing`` as the writer's uploads build it, one mirror on the moto S3 server."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptstore
import ckptstore.spi as spi
from ckptstore import Store, StoreOptions
from ckptstore.storage import PosixStorage
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


# -- the write-back (issue 21): the restore reads the mirror once and writes the local tier behind it ---------

def two_shard_state(step: int) -> dict:
    """Two arrays of 80 KB each: with max_shard_bytes=64 KiB each is a shard of its own."""
    rng = np.random.default_rng(step)
    return {"model": {"a": torch.from_numpy(rng.standard_normal(20_000, dtype=np.float32)),
                      "b": torch.from_numpy(rng.standard_normal(20_000, dtype=np.float32))},
            "step": step}


def test_a_deleted_local_tier_reads_each_s3_shard_once_and_is_committed_locally_behind_the_restore(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    local = str(tmp_path / "local")
    mirror, storage_options = s3_url
    small = StoreOptions(max_shard_bytes=64 << 10)
    with Store.open(local, create=True, options=small) as s:
        cut = s.save(two_shard_state(200), step=200).id
    mirror_all(local, mirror, StoreOptions(storage_options=storage_options))
    shutil.rmtree(local)  # a replaced node
    proxied = StoreOptions(storage_options=s3_proxy.options(storage_options))

    with Store.open(local, create=True, mirror=mirror, mirror_options=proxied) as store:
        shards = {f.name: f.nbytes for f in store.mirror.manifest(cut).files}
        before = len(s3_proxy.log)
        resumed = ckptstore.restore(store)
        assert resumed is not None and (resumed.cut.id, resumed.tier) == (cut, "mirror")
        assert_bitwise(resumed.state, two_shard_state(200))
        local_info = resumed.write_back.wait(30)
        assert local_info.id == cut and store.latest().id == cut
        mirror_manifest = core_bytes(store.mirror, f"cuts/{cut}/MANIFEST.json")
    assert len(shards) >= 2
    # Each byte of each shard downloaded once (ranged GETs that tile the file): the restore's load is
    # the verification and the write-back's source.
    got: dict[str, list[tuple[int, int]]] = {}
    for seen in s3_proxy.log[before:]:
        name = seen.key.rsplit("/", 1)[-1]
        if seen.op == "get" and name in shards:
            start, _, end = (seen.range or f"bytes=0-{shards[name] - 1}").removeprefix("bytes=").partition("-")
            got.setdefault(name, []).append((int(start), int(end) + 1))
    for name, nbytes in shards.items():
        spans = sorted(got[name])
        assert spans[0][0] == 0 and spans[-1][1] == nbytes, (name, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)  # no byte twice
    with Store.open(local, readonly=True) as s:  # byte for byte the mirror's cut, verified
        assert s.verify().ok and [c.id for c in s.cuts()] == [cut]
    assert Path(local, "cuts", cut, "MANIFEST.json").read_bytes() == mirror_manifest
    again = ckptstore.restore(local, mirror=mirror, mirror_options=proxied)
    assert again.tier == "local" and again.write_back is None  # the next restart is local
    assert_bitwise(again.state, two_shard_state(200))


def core_bytes(store: Store, rel: str) -> bytes:
    return spi.core_of(store).storage.read_bytes(rel)


def test_a_local_tier_that_is_full_still_restores_from_the_mirror_and_commits_nothing_half(
        tmp_path: Path, caplog) -> None:
    from filekit import mounted_tmpfs

    src, mirror = str(tmp_path / "src"), str(tmp_path / "mirror")
    big = {"w": torch.arange(400_000, dtype=torch.float32), "step": 7}  # 1.6 MB: more than the disk holds
    with Store.open(src, create=True) as s:
        cut = s.save(big, step=7).id
    mirror_all(src, mirror)
    with mounted_tmpfs(str(tmp_path / "small"), "1m") as mnt:
        local = os.path.join(mnt, "local")
        with caplog.at_level("WARNING", logger="ckptstore"):
            resumed = ckptstore.restore(local, mirror=mirror)
        assert resumed is not None and (resumed.cut.id, resumed.tier) == (cut, "mirror")
        assert_bitwise(resumed.state, big)
        with pytest.raises(ckptstore.StorageError) as exc:
            resumed.write_back.wait(0)
        assert exc.value.errno == errno.ENOSPC and exc.value.cut == cut
        assert any("write-back" in r.getMessage() and cut in r.getMessage() for r in caplog.records)
        with Store.open(local, readonly=True) as s:  # nothing committed, nothing half left
            assert s.cuts() == [] and spi.classify(s).leftovers == []
        # The next restart reads the mirror again (and tries the write-back again).
        assert ckptstore.restore(local, mirror=mirror).tier == "mirror"


class HeldSinks(PosixStorage):
    """A real POSIX store whose shard files wait to be opened until ``release`` (bounded): a local tier
    slower than the restore."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def open_sink(self, rel: str):  # type: ignore[no-untyped-def]
        self.release.wait(10)
        return super().open_sink(rel)


def test_the_restore_returns_while_the_local_tier_is_still_writing_the_cut_back(tmp_path: Path) -> None:
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    ids = build(local, [100])
    mirror_all(local, mirror)
    shutil.rmtree(local)
    held = HeldSinks(local)
    with Store.open(held, create=True, mirror=mirror) as store:
        resumed = ckptstore.restore(store)
        assert resumed is not None and resumed.tier == "mirror"
        assert not resumed.write_back.done()  # the restore did not wait for the local tier's writes
        assert_bitwise(resumed.state, state_for(100))
        with pytest.raises(TimeoutError):
            resumed.write_back.wait(0)
        held.release.set()
        assert resumed.write_back.wait(30).id == ids[100]
    with Store.open(local, readonly=True) as s:
        assert s.latest().id == ids[100] and s.verify().ok
