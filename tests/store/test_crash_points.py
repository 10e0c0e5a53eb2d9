"""The crash-point table: a real writer process SIGKILLs itself at every named phase of save and prune
(and at sampled byte offsets and times mid-save), then the store invariant is checked on what it left.

Invariant (ckptstore.protocol): a reader always finds LATEST naming a committed cut that loads exactly
and verifies; the crash's leftovers are notices, never errors; a writer open removes them all and the
next save commits. For a save crash, LATEST is the previous cut before "latest-written" and the new cut
from "latest-written" on.
"""

from __future__ import annotations

import json
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crashkit import (  # noqa: E402
    check_after_crash,
    run_script,
    shard_count,
    state_for,
)

from ckptstore import Store, layout  # noqa: E402
from ckptstore.protocol import PRUNE_PHASES, SAVE_PHASES  # noqa: E402

KILLED = -signal.SIGKILL
SHARDS = shard_count(state_for(3))  # shards of the crashing save (every state has the same layout)


@dataclass(frozen=True)
class SaveCase:
    phase: str
    occurrence: int
    committed: bool  # LATEST names the new cut after the crash
    leftover: str | None  # leftover kind of the new cut, None when the crash left nothing
    shards_left: int  # shard files in the new cut's directory when the process died
    manifest_left: bool
    mark_left: bool

    def __str__(self) -> str:
        return f"{self.phase}-{self.occurrence}"


SAVE_CASES = [
    SaveCase("mark-written", 1, False, "in-progress", 0, False, True),
    SaveCase("shard-written", 1, False, "in-progress", 1, False, True),
    SaveCase("shard-written", 2, False, "in-progress", 2, False, True),
    SaveCase("shard-written", SHARDS, False, "in-progress", SHARDS, False, True),
    SaveCase("shards-synced", 1, False, "in-progress", SHARDS, False, True),
    # A cut of two ranks (crashsave.py writes both from one process): rank 0's record is durable,
    # rank 1's is not, so nothing commits it (issue 20: the phase was missing from SAVE_PHASES).
    SaveCase("rank-written", 1, False, "in-progress", SHARDS, False, True),
    SaveCase("manifest-written", 1, False, "in-progress", SHARDS, True, True),
    SaveCase("latest-written", 1, True, "stale-mark", SHARDS, True, True),
    SaveCase("mark-removed", 1, True, None, SHARDS, True, False),
]


@dataclass(frozen=True)
class PruneCase:
    """prune(KeepLast(1)) over cuts at steps 1, 2, 3 dooms steps 1 then 2; the kill hits ``victim``."""

    phase: str
    occurrence: int
    victim: int  # step of the cut being pruned when the process died
    leftover: str | None
    shards_left: int | None  # None: the victim's directory is gone
    committed_after: list[int]

    def __str__(self) -> str:
        return f"{self.phase}-{self.occurrence}"


PRUNE_CASES = [
    PruneCase("prune-uncommitted", 1, 1, "abandoned", SHARDS, [2, 3]),
    PruneCase("prune-files-deleted", 1, 1, "abandoned", 0, [2, 3]),
    PruneCase("prune-removed", 1, 1, None, None, [2, 3]),
    PruneCase("prune-uncommitted", 2, 2, "abandoned", SHARDS, [3]),
    PruneCase("prune-removed", 2, 2, None, None, [3]),
]


def test_table_covers_every_phase() -> None:
    assert SHARDS >= 3, "the state must span several shards for the shard-written cases to differ"
    assert {c.phase for c in SAVE_CASES} == set(SAVE_PHASES)
    assert {c.phase for c in PRUNE_CASES} == set(PRUNE_PHASES)


def test_hook_fires_once_per_shard(tmp_path: Path) -> None:
    """The harness can tell a phase that never fired (exit 3, save completed): shard-written fires
    exactly SHARDS times, so the cases above kill where they say."""
    url = tmp_path / "store"
    run = run_script(url, "--create", "--phase", "shard-written", "--occurrence", str(SHARDS + 1))
    assert run.rc == 3, run.describe()
    assert f"NEVER-REACHED shard-written {SHARDS + 1} seen {SHARDS}" in run.out
    with Store.open(str(url), readonly=True) as ro:
        assert ro.latest().step == 1 and ro.latest().files == SHARDS
        assert ro.verify().findings == []


def _pointer_cut(root: Path) -> str | None:
    p = root / layout.LATEST_FILE
    return json.loads(p.read_bytes())["cut"] if p.exists() else None


def _shards_in(d: Path) -> int:
    return sum(1 for n in d.iterdir() if layout.is_shard_name(n.name))


@pytest.mark.parametrize("case", SAVE_CASES, ids=str)
def test_save_crash(tmp_path: Path, case: SaveCase) -> None:
    url = tmp_path / "store"
    run = run_script(url, "--create", "--pre", "2", "--phase", case.phase, "--occurrence", str(case.occurrence))
    assert run.rc == KILLED, run.describe()
    assert run.killed is not None and run.killed[0] == case.phase
    cut = run.killed[1]
    assert layout.step_of_cut_id(cut) == 3 and cut not in run.saved.values()

    # What the crash left, before anyone looks: the phase hook sits where the protocol says.
    cdir = url / "cuts" / cut
    assert _shards_in(cdir) == case.shards_left
    assert (cdir / layout.MANIFEST_FILE).exists() == case.manifest_left
    assert (url / layout.mark_path(cut)).exists() == case.mark_left
    assert _pointer_cut(url) == (cut if case.committed else run.saved[2])

    store = check_after_crash(
        url,
        latest_step=3 if case.committed else 2,
        committed_steps=[1, 2, 3] if case.committed else [1, 2],
        leftovers=[(case.leftover, cut)] if case.leftover else [],
        dead_owner=run.pid,
    )
    store.close()
    assert cdir.exists() == case.committed


@pytest.mark.parametrize("phase", ["mark-written", "shard-written", "manifest-written", "latest-written"])
def test_first_cut_crash(tmp_path: Path, phase: str) -> None:
    """The store's only cut crashed: before the commit the store opens empty and the next save works;
    from "latest-written" on, the first cut is committed."""
    url = tmp_path / "store"
    occurrence = 2 if phase == "shard-written" else 1
    run = run_script(url, "--create", "--phase", phase, "--occurrence", str(occurrence))
    assert run.rc == KILLED, run.describe()
    cut = run.killed[1]  # type: ignore[index]
    committed = phase == "latest-written"
    assert _pointer_cut(url) == (cut if committed else None)
    store = check_after_crash(
        url,
        latest_step=1 if committed else None,
        committed_steps=[1] if committed else [],
        leftovers=[("stale-mark" if committed else "in-progress", cut)],
        dead_owner=run.pid,
    )
    with store:
        assert [c.step for c in store.cuts()] == ([1, 2] if committed else [1])


@pytest.mark.parametrize("case", PRUNE_CASES, ids=str)
def test_prune_crash(tmp_path: Path, case: PruneCase) -> None:
    url = tmp_path / "store"
    run = run_script(url, "--create", "--pre", "3", "--prune", "--phase", case.phase,
                     "--occurrence", str(case.occurrence))
    assert run.rc == KILLED, run.describe()
    victim = run.saved[case.victim]
    assert run.killed == (case.phase, victim)

    vdir = url / "cuts" / victim
    if case.shards_left is None:
        assert not vdir.exists()
    else:
        assert _shards_in(vdir) == case.shards_left
        assert not (vdir / layout.MANIFEST_FILE).exists(), "prune must uncommit before deleting data"
    assert not (url / "marks").joinpath(f"{victim}.json").exists()
    assert _pointer_cut(url) == run.saved[3]

    store = check_after_crash(
        url,
        latest_step=3,
        committed_steps=case.committed_after,
        leftovers=[(case.leftover, victim)] if case.leftover else [],
    )
    store.close()
    assert not vdir.exists()


def _total_shard_bytes() -> int:
    from ckptstore.arrays import describe
    from ckptstore.tree import flatten

    return sum(describe(leaf).nbytes for leaf in flatten(state_for(3))[1])


_TOTAL = _total_shard_bytes()
BYTE_OFFSETS = [0, *sorted(random.Random(20241129).sample(range(1, _TOTAL), 3))]


@pytest.mark.parametrize("offset", BYTE_OFFSETS)
def test_kill_mid_write_at_byte_offset(tmp_path: Path, offset: int) -> None:
    """A helper thread kills the writer once the new cut's shards hold ``offset`` bytes: a partly
    written cut that must stay invisible (failure-modes rows 1, 2). With O_DIRECT a shard of up to
    4 MiB lands in one write, so kills fall on shard boundaries or a just-created file; a torn shard is
    built directly in test_recovery_fixtures."""
    url = tmp_path / "store"
    run = run_script(url, "--create", "--pre", "2", "--kill-at-bytes", str(offset))
    assert run.rc == KILLED, run.describe()
    assert run.killed is not None and run.killed[0] == "bytes"
    assert run.bytes_seen is not None and run.bytes_seen >= offset
    cut = run.killed[1]
    cdir = url / "cuts" / cut
    assert not (cdir / layout.MANIFEST_FILE).exists()
    assert sum(p.stat().st_size for p in cdir.iterdir()) >= offset
    assert _pointer_cut(url) == run.saved[2]
    store = check_after_crash(url, latest_step=2, committed_steps=[1, 2], leftovers=[("in-progress", cut)],
                              dead_owner=run.pid)
    store.close()


@pytest.mark.parametrize("fraction", [0.2, 0.4, 0.55, 0.7])
def test_kill_at_random_time(tmp_path: Path, fraction: float) -> None:
    """A timer kills the writer ``fraction`` of the previous save's duration into the crashing save
    (which runs warmer: 0.2-0.7 spans from the mark to past the commit, and the save may win). Any
    state, temp files of durable writes included; what LATEST names decides what is expected, and the
    invariant must hold either way."""
    url = tmp_path / "store"
    run = run_script(url, "--create", "--pre", "2", "--kill-at-fraction", str(fraction))
    assert run.rc in (KILLED, 0), run.describe()
    assert run.done is not None or run.rc == KILLED
    new = [n for n in (url / "cuts").iterdir() if n.name not in run.saved.values()]
    assert len(new) <= 1
    named = _pointer_cut(url)
    committed = run.done is not None or (bool(new) and named == new[0].name)
    if not committed:
        assert named == run.saved[2]
    store = check_after_crash(
        url,
        latest_step=3 if committed else 2,
        committed_steps=[1, 2, 3] if committed else [1, 2],
        leftovers=None,
        allowed_kinds={"stale-mark"} if committed else {"in-progress", "orphan-mark", "temp-file"},
        dead_owner=run.pid,
    )
    store.close()


FOREIGN = {"notes.txt": b"my notes", "tensorboard/events.out": b"tb", "cuts/README.md": b"readme",
           "cuts/my-export/weights.bin": b"\x00\x01", "marks/README": b"do not touch"}
FOREIGN_TOP = {"notes.txt", "tensorboard", "cuts/README.md", "cuts/my-export", "marks/README"}


def _plant_foreign(root: Path) -> None:
    for rel, data in FOREIGN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _foreign_intact(root: Path) -> None:
    for rel, data in FOREIGN.items():
        assert (root / rel).read_bytes() == data, rel


def test_foreign_entries_survive_crash_recovery_and_gc(tmp_path: Path) -> None:
    url = tmp_path / "store"
    Store.open(str(url), create=True).close()
    _plant_foreign(url)
    run = run_script(url, "--pre", "2", "--phase", "shard-written", "--occurrence", "2")
    assert run.rc == KILLED, run.describe()
    cut = run.killed[1]  # type: ignore[index]
    store = check_after_crash(url, latest_step=2, committed_steps=[1, 2], leftovers=[("in-progress", cut)],
                              dead_owner=run.pid, foreign=FOREIGN_TOP)
    with store:
        _foreign_intact(url)
        report = store.gc()
        assert report.removed == [] and set(report.foreign) == FOREIGN_TOP
        assert {f.path for f in store.verify().findings if f.kind == "foreign"} == FOREIGN_TOP
    _foreign_intact(url)


def test_foreign_file_inside_crashed_cut_is_never_deleted(tmp_path: Path) -> None:
    """Someone put a file into the directory of a crashed cut: gc removes the store's own files and
    the mark but never that file (so the directory stays, and stays reported)."""
    url = tmp_path / "store"
    run = run_script(url, "--create", "--pre", "1", "--phase", "shards-synced")
    assert run.rc == KILLED, run.describe()
    cut = run.killed[1]  # type: ignore[index]
    theirs = url / "cuts" / cut / "user-notes.txt"
    theirs.write_bytes(b"precious")
    with Store.open(str(url)) as store:
        assert theirs.read_bytes() == b"precious"
        assert _shards_in(theirs.parent) == 0
        assert not (url / layout.mark_path(cut)).exists()
        assert store.latest().step == 1 and store.verify().ok
        assert any(f.path is not None and cut in f.path for f in store.verify().findings)
        store.save(state_for(2), step=2)
        assert store.latest().step == 2
    assert theirs.read_bytes() == b"precious"
