"""Power-loss simulation: run real save paths over CrashFS, then check the store invariant on the
disk a power loss could leave at every point of the operation log, in both variants ("lose everything
not durable" and "keep a prefix of the non-durable operations")."""

from __future__ import annotations

import random

import numpy as np
import pytest

import ckptstore
from ckptstore import StoreOptions
from ckptstore.protocol import CommitProtocol

from .crashfs import CrashFS
from .invariant import InvariantBroken, check_invariant


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(3000).astype(np.float32), "i": np.arange(step, step + 50, dtype=np.int64),
            "meta": {"step": step, "name": f"s{step}"}}


def _many_state(step: int) -> dict:
    """Issue 23's shape, small: 400 small torch tensors of four dtypes beside the usual arrays (the bulk
    shard writes gather them into 1 MiB writes; the writer's capture batches them; the manifest is a table)."""
    import torch

    dtypes = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)
    many = {f"p{i}": torch.full((1 + i % 7,), step + i % 50, dtype=dtypes[i % 4]) for i in range(400)}
    return {**_state(step), "many": many}


def run_scenario(fs: CrashFS, *, writer: str = "store", make_state=_state) -> tuple[dict[int, dict], list[tuple[int, int]]]:
    """Saves three cuts with a prune between them; returns the states by step and, for each save,
    (op index when it returned, step)."""
    saved: dict[int, dict] = {}
    returned: list[tuple[int, int]] = []
    opts = StoreOptions(max_shard_bytes=1 << 20)
    store = ckptstore.Store.open(fs, create=True, options=opts)
    if writer == "store":
        for step in (10, 20, 30):
            saved[step] = make_state(step)
            store.save(saved[step], step=step)
            returned.append((len(fs.ops) - 1, step))
            store.prune(ckptstore.KeepLast(2))
    else:
        from ckptstore.writer import Checkpointer

        with Checkpointer(store, every=10, keep=ckptstore.KeepLast(2), mode=writer, busy="wait") as ck:
            for step in (10, 20, 30):
                saved[step] = make_state(step)
                ck.maybe_cut(step, saved[step]).wait()
                returned.append((len(fs.ops) - 1, step))
    store.close()
    return saved, returned


def run_ranks_scenario(fs: CrashFS, world: int = 2) -> tuple[dict[int, list], list[tuple[int, int]]]:
    """The multi-rank commit of ``Store.save(group=)`` as its storage sees it, in one process: rank 0
    marks, every rank writes its shards and publishes its record (rank 1 first, as a slower rank 0
    would), rank 0 reads all records and commits; then a prune."""
    from ckptstore.arrays import describe
    from ckptstore.pending import RankPart
    from ckptstore.tree import flatten

    saved: dict[int, list] = {}
    returned: list[tuple[int, int]] = []
    store = ckptstore.Store.open(fs, create=True, options=StoreOptions(max_shard_bytes=1 << 20))
    for step in (10, 20, 30):
        saved[step] = [_state(step * 100 + r) for r in range(world)]
        pending = store.begin_cut(step, world_size=world)
        for rank in reversed(range(world)):
            tree, leaves = flatten(saved[step][rank])
            part = RankPart(store._protocol, store.storage, pending.id, step, rank, world)
            files, arrays = part.write([describe(x) for x in leaves], codec=store.shard_codec(),
                                       max_shard_bytes=store.options.max_shard_bytes)
            part.publish(files, arrays, tree=tree, pickled=False)
        pending.collect_ranks()
        pending.files_durable()
        pending.commit()
        returned.append((len(fs.ops) - 1, step))
        store.prune(ckptstore.KeepLast(2))
    store.close()
    return saved, returned


def sweep(fs: CrashFS, saved, returned, tmp_path, *, prefixes: bool, rng: random.Random) -> int:
    """Checks every distinct post-crash disk once (consecutive operations often leave the same disk)."""
    checked = 0
    seen: set[tuple] = set()
    for i in range(len(fs.ops)):
        done = [step for idx, step in returned if idx <= i]
        committed_before = max(done) if done else None
        ks = [0]
        if prefixes and i > 0:
            ks += sorted({rng.randrange(1, i + 1), i})
        for k in ks:
            disk = fs.disk_after(i, k)
            key = (committed_before, tuple(sorted((p, d) for p, d in disk.items())))
            if key in seen:
                continue
            seen.add(key)
            root = str(tmp_path / f"crash-{i}-{k}")
            fs.write_disk(disk, root)
            try:
                check_invariant(root, saved, committed_before, next_step=10_000)
            except (InvariantBroken, ckptstore.CkptStoreError) as exc:
                raise InvariantBroken(f"after op {i} ({fs.ops[i].kind} {fs.ops[i].target}), prefix {k}: {exc}") from None
            checked += 1
    return checked


@pytest.mark.parametrize("prefixes", [False, True], ids=["lose-all-volatile", "keep-a-prefix"])
def test_sync_store_survives_power_loss_at_every_point(tmp_path, prefixes):
    fs = CrashFS()
    saved, returned = run_scenario(fs)
    checked = sweep(fs, saved, returned, tmp_path, prefixes=prefixes, rng=random.Random(7))
    assert checked >= 20  # distinct disks: the sweep really explored the log
    assert any(op.kind == "unlink" for op in fs.ops)  # the prune's deletions were part of the log


@pytest.mark.parametrize("prefixes", [False, True], ids=["lose-all-volatile", "keep-a-prefix"])
def test_multi_rank_commit_survives_power_loss_at_every_point(tmp_path, prefixes):
    fs = CrashFS()
    saved, returned = run_ranks_scenario(fs)
    checked = sweep(fs, saved, returned, tmp_path, prefixes=prefixes, rng=random.Random(11))
    assert checked >= 20
    assert any("rank00001.json" in op.target for op in fs.ops)  # the rank records were part of the log


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_writer_path_survives_power_loss_at_every_point(tmp_path, mode):
    fs = CrashFS()
    saved, returned = run_scenario(fs, writer=mode)
    sweep(fs, saved, returned, tmp_path, prefixes=False, rng=random.Random(3))


@pytest.mark.parametrize("writer", ["store", "thread"])
def test_many_small_tensors_survive_power_loss_at_every_point(tmp_path, writer):
    """The many-tensor paths (issue 23) under the same sweep: every post-crash disk loads the 400
    tensors of its step exactly, or an older committed cut."""
    fs = CrashFS()
    saved, returned = run_scenario(fs, writer=writer, make_state=_many_state)
    checked = sweep(fs, saved, returned, tmp_path, prefixes=writer == "store", rng=random.Random(23))
    assert checked >= 20


@pytest.mark.parametrize("broken", ["skip_dir_fsync", "skip_file_fsync"])
def test_a_missing_fsync_is_caught(tmp_path, broken):
    """Remove one kind of fsync on purpose: some crash point must break the invariant."""
    fs = CrashFS(**{broken: True})
    saved, returned = run_scenario(fs)
    with pytest.raises(InvariantBroken):
        sweep(fs, saved, returned, tmp_path, prefixes=False, rng=random.Random(1))


def test_an_early_latest_update_is_caught(tmp_path, monkeypatch):
    """Write LATEST before the manifest (a broken protocol order): a crash between them must be caught."""
    real_write_manifest = CommitProtocol.write_manifest

    def early(self, manifest):
        from ckptstore import hashing

        self.point_latest(manifest.cut, manifest.step, hashing.digest(manifest.to_bytes()))
        return real_write_manifest(self, manifest)

    monkeypatch.setattr(CommitProtocol, "write_manifest", early)
    fs = CrashFS()
    saved, returned = run_scenario(fs)
    monkeypatch.undo()
    with pytest.raises(InvariantBroken):
        sweep(fs, saved, returned, tmp_path, prefixes=False, rng=random.Random(1))
