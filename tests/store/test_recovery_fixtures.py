"""Crash-state fixtures: build on disk exactly what a crash (or a lost file) leaves, without killing
anything, then check what readers see, what the writer open recovers, and what ``repair`` does."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crashkit import (  # noqa: E402
    SHARD_BYTES,
    assert_clean_layout,
    assert_same_state,
    check_after_crash,
    dead_pid,
    state_for,
)

import ckptstore  # noqa: E402
from ckptstore import LatestError, Store, StoreOptions, hashing, layout  # noqa: E402
from ckptstore.latest import Pointer  # noqa: E402
from ckptstore.marks import Mark  # noqa: E402
from ckptstore.protocol import now_iso  # noqa: E402
from ckptstore.store import open_for_repair  # noqa: E402

OPTS = StoreOptions(max_shard_bytes=SHARD_BYTES)


def make_store(root: Path, steps: list[int]) -> dict[int, str]:
    """A store with a committed cut per step; returns step -> cut id."""
    with Store.open(str(root), create=True, options=OPTS) as store:
        return {s: store.save(state_for(s), step=s).id for s in steps}


def put_mark(root: Path, cut: str, *, pid: int | None = None, host: str | None = None) -> Path:
    mark = Mark(cut=cut, step=layout.step_of_cut_id(cut), host=host or socket.gethostname(),
                pid=pid if pid is not None else dead_pid(), started_at=now_iso(), writer="store.save")
    path = root / layout.mark_path(cut)
    path.write_bytes(mark.to_bytes())
    return path


def point_latest_at(root: Path, cut: str) -> None:
    data = (root / layout.manifest_path(cut)).read_bytes()
    ptr = Pointer(cut=cut, step=layout.step_of_cut_id(cut), manifest_blake3=hashing.digest(data))
    (root / layout.LATEST_FILE).write_bytes(ptr.to_bytes())


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_mark_beside_cut_named_by_latest_is_stale_and_cleared(tmp_path: Path) -> None:
    """Crash between LATEST and the mark's removal (failure-modes row 10): the cut is committed, the
    mark must never make it look incomplete; the writer open clears the mark and keeps every byte."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    mark = put_mark(root, cuts[2])
    before = snapshot(root / "cuts" / cuts[2])
    with Store.open(str(root), readonly=True) as ro:
        assert [c.step for c in ro.cuts()] == [1, 2]
        assert ro.classify().committed_ids() == set(cuts.values())
    store = check_after_crash(root, latest_step=2, committed_steps=[1, 2], leftovers=[("stale-mark", cuts[2])])
    store.close()
    assert not mark.exists()
    assert snapshot(root / "cuts" / cuts[2]) == before


def test_stale_mark_of_a_live_looking_writer_is_still_cleared(tmp_path: Path) -> None:
    """The stale mark names this very process (alive): LATEST names the cut, so it is committed anyway."""
    root = tmp_path / "store"
    cuts = make_store(root, [1])
    put_mark(root, cuts[1], pid=os.getpid())
    check_after_crash(root, latest_step=1, committed_steps=[1], leftovers=[("stale-mark", cuts[1])]).close()


def test_marked_cut_with_manifest_not_named_by_latest_is_removed(tmp_path: Path) -> None:
    """Crash after the manifest, before LATEST: the cut is complete but not committed."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    point_latest_at(root, cuts[1])
    put_mark(root, cuts[2])
    with Store.open(str(root), readonly=True) as ro:
        assert cuts[2] not in ro.classify().committed_ids()
        with pytest.raises(ckptstore.CutNotFound):
            ro.manifest(cuts[2])
    check_after_crash(root, latest_step=1, committed_steps=[1], leftovers=[("in-progress", cuts[2])]).close()
    assert not (root / "cuts" / cuts[2]).exists()


def test_marked_cut_of_a_writer_on_another_host_is_removed_under_the_lock(tmp_path: Path) -> None:
    """Liveness is unknown across hosts, but holding the local flock proves no writer runs."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    point_latest_at(root, cuts[1])
    put_mark(root, cuts[2], pid=1, host="some-other-host")
    with Store.open(str(root), readonly=True) as ro:
        [lo] = ro.classify().leftovers
        assert lo.owner == "some-other-host:1" and lo.owner_alive is None
    check_after_crash(root, latest_step=1, committed_steps=[1], leftovers=[("in-progress", cuts[2])]).close()


def test_unreadable_mark_beside_uncommitted_cut_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    point_latest_at(root, cuts[1])
    (root / layout.mark_path(cuts[2])).write_bytes(b"\x00garbage, not json")
    check_after_crash(root, latest_step=1, committed_steps=[1], leftovers=[("in-progress", cuts[2])]).close()


def test_torn_shards_of_an_uncommitted_cut_are_removed(tmp_path: Path) -> None:
    """Mid-file states that the real-kill sampler rarely hits (a shard up to 4 MiB reaches the disk in
    one O_DIRECT write): a half-written shard and a just-created empty one, no manifest yet."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    point_latest_at(root, cuts[1])
    put_mark(root, cuts[2])
    d = root / "cuts" / cuts[2]
    (d / layout.MANIFEST_FILE).unlink()
    os.truncate(d / layout.shard_name(0, 1, compressed=False), 12345)
    os.truncate(d / layout.shard_name(0, 2, compressed=False), 0)
    check_after_crash(root, latest_step=1, committed_steps=[1], leftovers=[("in-progress", cuts[2])]).close()
    assert not d.exists()


def test_orphan_mark_without_cut_dir_is_removed(tmp_path: Path) -> None:
    """Crash between the mark and the cut directory's creation."""
    root = tmp_path / "store"
    make_store(root, [1])
    orphan = "step-000000000002-0badc0de"
    put_mark(root, orphan)
    check_after_crash(root, latest_step=1, committed_steps=[1], leftovers=[("orphan-mark", orphan)]).close()


def test_cut_dirs_without_manifest_or_mark_are_abandoned_and_removed(tmp_path: Path) -> None:
    """Prune leftovers: uncommitted (manifest gone, shards left), and emptied (only the directory)."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2, 3])
    (root / layout.manifest_path(cuts[1])).unlink()
    emptied = "step-000000000002-00000000"
    (root / "cuts" / emptied).mkdir()
    check_after_crash(root, latest_step=3, committed_steps=[2, 3],
                      leftovers=[("abandoned", cuts[1]), ("abandoned", emptied)]).close()


def test_temp_files_of_interrupted_durable_writes_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    temps = [
        ".tmp-0123456789ab-LATEST",  # a LATEST replace that never got renamed
        f"cuts/{cuts[2]}/.tmp-0123456789ab-{layout.MANIFEST_FILE}",
        f"marks/.tmp-0123456789ab-{cuts[2]}.json",
        f"bad/.tmp-0123456789ab-{cuts[1]}.json",  # a bad-cut record being written
    ]
    for rel in temps:
        (root / rel).write_bytes(b'{"kind": "ckptstore.lat')  # torn
    check_after_crash(root, latest_step=2, committed_steps=[1, 2],
                      leftovers=[("temp-file", None)] * len(temps)).close()
    for rel in temps:
        assert not (root / rel).exists(), rel


def test_broken_manifest_is_damage_reported_and_never_deleted(tmp_path: Path) -> None:
    """A committed cut whose manifest no longer parses is not a crash leftover: verify fails on it and
    no writer open deletes it (someone must look)."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    mpath = root / layout.manifest_path(cuts[1])
    mpath.write_bytes(mpath.read_bytes()[:-40])
    with Store.open(str(root)) as store:
        report = store.verify()
        assert not report.ok
        assert [(f.kind, f.cut) for f in report.errors] == [("manifest-broken", cuts[1])]
        assert store.latest().step == 2
        assert_same_state(store.load(), state_for(2))
        store.gc()
    assert mpath.exists() and (root / "cuts" / cuts[1]).is_dir()
    assert len(os.listdir(root / "cuts" / cuts[1])) > 1


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt_newest", [False, True], ids=["intact", "newest-corrupt"])
def test_missing_latest_refuses_open_and_repair_restores_it(tmp_path: Path, corrupt_newest: bool) -> None:
    """LATEST lost while committed cuts exist (failure-modes row 12): never silently start over. The
    writer open refuses and says to run repair; repair points LATEST at the newest cut that verifies."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2, 3])
    (root / layout.LATEST_FILE).unlink()
    if corrupt_newest:
        _flip_byte(root / "cuts" / cuts[3] / layout.shard_name(0, 1, compressed=False))

    with pytest.raises(LatestError) as info:
        Store.open(str(root))
    assert "ckptstore repair" in str(info.value)
    with Store.open(str(root), readonly=True) as ro:  # readers see the problem as an error, and why
        report = ro.verify()
        assert not report.ok and "latest-missing" in {f.kind for f in report.errors}
        with pytest.raises(LatestError):
            ro.latest()
    with pytest.raises(LatestError):
        ckptstore.load(str(root))
    assert set(os.listdir(root / "cuts")) == set(cuts.values()), "the refused open must not gc anything"

    # the refused open released the lock, so repair can take it in the same process
    with open_for_repair(str(root)) as store:
        fixed = store.repair()
    want = 2 if corrupt_newest else 3
    assert fixed is not None and fixed.id == cuts[want]
    assert json.loads((root / layout.LATEST_FILE).read_bytes())["cut"] == cuts[want]

    with Store.open(str(root), options=OPTS) as store:
        assert store.latest().id == cuts[want]
        assert_same_state(store.load(), state_for(want))
        report = store.verify()
        if corrupt_newest:
            # the corrupt cut is still there, reported, never loaded as LATEST
            assert {(f.kind, f.cut) for f in report.errors} == {("hash-mismatch", cuts[3])}
        else:
            assert report.findings == []
        assert store.classify().leftovers == []
        store.save(state_for(4), step=4)
        assert store.latest().step == 4
        if not corrupt_newest:
            assert_clean_layout(root, store)
    assert_same_state(ckptstore.load(str(root)), state_for(4))


def test_repair_of_a_store_whose_only_cuts_are_corrupt_leaves_latest_alone(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root, [1])
    (root / layout.LATEST_FILE).unlink()
    _flip_byte(root / "cuts" / cuts[1] / layout.shard_name(0, 0, compressed=False))
    with open_for_repair(str(root)) as store:
        with pytest.raises(ckptstore.CorruptCut):
            store.repair()
    assert not (root / layout.LATEST_FILE).exists()
    assert (root / "cuts" / cuts[1] / layout.MANIFEST_FILE).exists()
