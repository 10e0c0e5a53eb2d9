"""Hostile stores for the maintenance operations (issue 10, items 2, 5, 11, 12): dry runs that change
nothing, a prune that never leaves a store without a verifying cut, our own small files and directories
replaced by something else, and ``verify`` racing a real prune in another process.

Every case builds real files (crash leftovers as a crash leaves them, corruption by flipping a byte),
asserts the named error or finding, and checks that nothing committed or foreign was touched."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from ckptstore import CorruptCut, KeepLast, LatestError, Store, StoreOptions, UsageError, layout
from ckptstore.cli import main
from ckptstore.marks import Mark
from ckptstore.protocol import now_iso
from ckptstore.storage import register_backend
from ckptstore.storage.posix import PosixStorage

OPTS = StoreOptions(max_shard_bytes=64 << 10)  # three shard files per cut
#: Written by whoever holds the writer lock (who and since when): the lock's own record, not store data.
LOCK_RECORDS = {layout.WRITER_FILE, layout.LOCK_FILE}


def state(step: int) -> dict[str, np.ndarray]:
    return {k: np.full(16384, step * 10 + i, dtype=np.float32) for i, k in enumerate("abc")}


def make_store(root: Path, steps: list[int] = [1, 2, 3]) -> dict[int, str]:  # noqa: B006 - never mutated
    with Store.open(str(root), create=True, options=OPTS) as store:
        return {s: store.save(state(s), step=s).id for s in steps}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (directories as None) with its bytes, less the writer lock's records."""
    out: dict[str, bytes | None] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = None
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), root)
            if rel not in LOCK_RECORDS:
                out[rel] = Path(d, name).read_bytes()
    return out


def cut_files(root: Path, cut: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "cuts" / cut).iterdir())}


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue(), err.getvalue()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def plant_crash_leftovers(root: Path, cuts: dict[int, str]) -> dict[str, str]:
    """What crashes leave, one of each kind recovery removes: a dead writer's marked cut with a partial
    shard, an abandoned cut directory (no mark, no manifest), a stale mark beside the LATEST cut and a
    temp file of an interrupted LATEST replace. Returns kind -> the path that shows it."""
    in_progress, abandoned = "step-000000000009-0000dead", "step-000000000008-0000beef"
    for cut in (in_progress, abandoned):
        (root / "cuts" / cut).mkdir()
        (root / "cuts" / cut / layout.shard_name(0, 0, compressed=False)).write_bytes(b"partial")
    latest = cuts[max(cuts)]
    for cut in (in_progress, latest):
        mark = Mark(cut=cut, step=layout.step_of_cut_id(cut), host=os.uname().nodename, pid=dead_pid(),
                    started_at=now_iso(), writer="store.save")
        (root / layout.mark_path(cut)).write_bytes(mark.to_bytes())
    tmp = layout.tmp_name(layout.LATEST_FILE)
    (root / tmp).write_bytes(b"half a pointer")
    return {"in-progress": layout.cut_dir(in_progress), "abandoned": layout.cut_dir(abandoned),
            "stale-mark": layout.mark_path(latest), "temp-file": tmp}


@pytest.fixture
def crashed(tmp_path: Path) -> tuple[Path, dict[int, str], dict[str, str]]:
    root = tmp_path / "store"
    cuts = make_store(root)
    left = plant_crash_leftovers(root, cuts)
    (root / "notes.txt").write_bytes(b"someone's notes")  # foreign: reported, never deleted
    return root, cuts, left


def kinds(leftovers: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {lo["kind"]: lo["paths"] for lo in leftovers}


# ------------------------------------------------------------------------- item 2: dry runs, reporting
def test_gc_dry_run_changes_nothing_and_lists_what_recovery_would_remove(crashed) -> None:
    root, cuts, left = crashed
    before = tree(root)
    code, out, _ = cli("gc", str(root), "--dry-run", "--json")
    assert code == 0
    assert tree(root) == before  # byte for byte: not even the leftovers recovery would remove
    doc = json.loads(out)
    assert doc["dry_run"] is True
    assert {k: v[0] for k, v in kinds(doc["removed"]).items()} == left
    assert doc["foreign"] == ["notes.txt"]

    code, out, _ = cli("gc", str(root), "--dry-run")
    assert code == 0 and "would remove 4 leftover(s)" in out and tree(root) == before


def test_real_gc_reports_every_removal(crashed) -> None:
    root, cuts, left = crashed
    committed = {c: cut_files(root, c) for c in cuts.values()}
    code, out, _ = cli("gc", str(root), "--json")
    assert code == 0
    assert {k: v[0] for k, v in kinds(json.loads(out)["removed"]).items()} == left  # was "removed": []
    for path in left.values():
        assert not (root / path).exists(), path
    assert {c: cut_files(root, c) for c in cuts.values()} == committed
    assert (root / "notes.txt").read_bytes() == b"someone's notes"
    code, out, _ = cli("gc", str(root))
    assert code == 0 and "removed 0 leftover(s)" in out


def test_prune_dry_run_changes_nothing(crashed) -> None:
    root, cuts, _ = crashed
    before = tree(root)
    code, out, _ = cli("prune", str(root), "--keep-last", "1", "--dry-run", "--json")
    assert code == 0
    assert tree(root) == before
    doc = json.loads(out)
    assert [c["id"] for c in doc["removed"]] == [cuts[1], cuts[2]]
    assert doc["removed_at_open"] == []


def test_store_dry_runs_on_a_handle_opened_without_recovery(crashed) -> None:
    root, cuts, left = crashed
    before = tree(root)
    with Store.open(str(root), recover=False, options=OPTS) as store:
        report = store.gc(dry_run=True)
        assert {lo.kind: lo.paths[0] for lo in report.removed} == left and report.at_open == []
        assert [c.id for c in store.prune(KeepLast(1), dry_run=True)] == [cuts[1], cuts[2]]
        assert tree(root) == before
        # The first change runs the recovery it put off: the stale mark beside the LATEST cut goes
        # before LATEST moves on, so that cut stays committed.
        store.save(state(4), step=4)
        assert store.recovered and {lo.kind for lo in store.recovered} == set(left)
        assert [c.step for c in store.cuts()] == [1, 2, 3, 4]
    assert not (root / left["stale-mark"]).exists()


def test_recovery_at_open_is_reported_by_gc_and_prune(crashed, tmp_path: Path) -> None:
    root, cuts, left = crashed
    spare = tmp_path / "copy"
    shutil.copytree(root, spare)
    with Store.open(str(root), options=OPTS) as store:  # recovers: the removals happen here
        for dry_run in (True, False):
            report = store.gc(dry_run=dry_run)
            assert report.removed == [] and {lo.kind: lo.paths[0] for lo in report.at_open} == left
            assert {k: v[0] for k, v in kinds(report.to_json()["removed_at_open"]).items()} == left
    code, out, _ = cli("prune", str(spare), "--keep-last", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert {k: v[0] for k, v in kinds(doc["removed_at_open"]).items()} == left
    code, out, _ = cli("prune", str(spare), "--keep-last", "1")
    assert code == 0 and "recovery at open" not in out


# ------------------------------------------------------------------ item 5: prune keeps a verifying cut
def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_prune_keeps_the_newest_verifying_cut_when_latest_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root)
    flip_last_byte(root / "cuts" / cuts[3] / layout.shard_name(0, 2, compressed=False))
    kept = {c: cut_files(root, c) for c in (cuts[2], cuts[3])}
    code, out, _ = cli("prune", str(root), "--keep-last", "1", "--json")
    assert code == 0
    assert [c["id"] for c in json.loads(out)["removed"]] == [cuts[1]]
    assert {c: cut_files(root, c) for c in (cuts[2], cuts[3])} == kept  # the damaged LATEST is left as it is
    assert cli("verify", str(root), "--cut", "2")[0] == 0  # a verifying cut survived
    with Store.open(str(root), readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == [cuts[2], cuts[3]]


def test_prune_no_verify_is_the_documented_opt_out(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root)
    flip_last_byte(root / "cuts" / cuts[3] / layout.shard_name(0, 0, compressed=False))
    code, out, _ = cli("prune", str(root), "--keep-last", "1", "--no-verify", "--json")
    assert code == 0 and [c["id"] for c in json.loads(out)["removed"]] == [cuts[1], cuts[2]]


def test_prune_removes_nothing_when_no_cut_verifies(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root)
    for cut in cuts.values():
        flip_last_byte(root / "cuts" / cut / layout.shard_name(0, 1, compressed=False))
    before = tree(root)
    with Store.open(str(root), options=OPTS) as store:
        with pytest.raises(CorruptCut) as err:
            store.prune(KeepLast(1))
    assert err.value.store == str(root) and err.value.cut == cuts[3] and "prune removed nothing" in err.value.message
    assert tree(root) == before
    assert cli("prune", str(root), "--keep-last", "1")[0] == 1


def test_prune_after_a_save_trusts_the_cut_it_just_wrote(tmp_path: Path) -> None:
    """The Checkpointer's prune after each commit: the newest kept cut is the one this handle just
    wrote and hashed, so the prune reads no shard (its cost is unchanged). Shown by damaging that cut
    after its commit: a prune that re-read it would spare cut 2."""
    root = tmp_path / "store"
    with Store.open(str(root), create=True, options=OPTS) as store:
        cuts = {s: store.save(state(s), step=s).id for s in (1, 2, 3)}
        flip_last_byte(root / "cuts" / cuts[3] / layout.shard_name(0, 0, compressed=False))
        assert [c.id for c in store.prune(KeepLast(1))] == [cuts[1], cuts[2]]


# ------------------------------------------------------- item 11: our names replaced by something else
def test_manifest_that_is_a_directory_breaks_only_its_cut(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root)
    man = root / layout.manifest_path(cuts[1])
    man.unlink()
    man.mkdir()
    (man / "x").write_bytes(b"foreign")
    code, out, _ = cli("verify", str(root), "--json")
    assert code == 1
    errors = [f for f in json.loads(out)["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["cut"]) for f in errors] == [("manifest-broken", cuts[1])]
    assert "not a regular file" in errors[0]["message"]
    assert cli("ls", str(root))[0] == 0
    code, _, err = cli("show", str(root), "1")
    assert code == 1 and cuts[1] in err and "MANIFEST.json" in err
    with Store.open(str(root), readonly=True) as ro:
        with pytest.raises(CorruptCut):
            ro.manifest(cuts[1])
        assert ro.load()["a"][0] == 30
    assert cli("gc", str(root))[0] == 0
    with Store.open(str(root), options=OPTS) as store:
        store.save(state(4), step=4)
    assert (man / "x").read_bytes() == b"foreign"  # damage is reported, never collected


def test_latest_that_is_a_directory_is_a_finding_and_a_named_error(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root)
    (root / layout.LATEST_FILE).unlink()
    (root / layout.LATEST_FILE).mkdir()
    (root / layout.LATEST_FILE / "x").write_bytes(b"foreign")
    code, out, _ = cli("verify", str(root), "--json")
    assert code == 1
    doc = json.loads(out)
    assert [f["kind"] for f in doc["findings"] if f["severity"] == "error"] == ["latest-unreadable"]
    assert sorted(doc["cuts_checked"]) == sorted(cuts.values())
    assert cli("ls", str(root))[0] == 1
    with pytest.raises(LatestError) as err:
        Store.open(str(root))
    assert err.value.path == layout.LATEST_FILE
    code, _, err_text = cli("repair", str(root))
    assert code == 1 and "LATEST is not a regular file" in err_text
    assert (root / layout.LATEST_FILE / "x").read_bytes() == b"foreign"


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_writer_lock_that_is_not_a_file_is_a_usage_error(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "store"
    make_store(root)
    lock = root / layout.LOCK_FILE
    lock.unlink()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not yours to truncate")
    if kind == "directory":
        lock.mkdir()
        (lock / "x").write_bytes(b"foreign")
    else:
        lock.symlink_to(outside)
    with pytest.raises(UsageError) as err:
        Store.open(str(root))
    assert err.value.path == layout.LOCK_FILE and err.value.store == str(root) and kind in err.value.message
    code, _, err_text = cli("gc", str(root))
    assert code == 2 and layout.LOCK_FILE in err_text
    assert outside.read_bytes() == b"not yours to truncate"
    if kind == "directory":
        assert (lock / "x").read_bytes() == b"foreign"
    with Store.open(str(root), readonly=True) as ro:
        assert ro.latest().step == 3


def test_deleted_marks_directory_is_recreated(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    shutil.rmtree(root / layout.MARKS_DIR)
    with Store.open(str(root), options=OPTS) as store:
        assert (root / layout.MARKS_DIR).is_dir()
        store.save(state(4), step=4)
        shutil.rmtree(root / layout.MARKS_DIR)  # under a live writer, between two saves
        store.save(state(5), step=5)
        assert [c.step for c in store.cuts()] == [1, 2, 3, 4, 5]
    assert cli("verify", str(root))[0] == 0


# --------------------------------------------------------------- item 12: verify racing a real prune
def prune_in_another_process(root: Path) -> None:
    """``ckptstore prune --keep-last 1`` run to its end in a separate process (its own writer lock)."""
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "prune", str(root), "--keep-last", "1", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["removed"]) == 3


def once(fn: Callable[[], None]) -> Callable[[int], None]:
    done: list[bool] = []

    def hook(_: int) -> None:
        if not done:
            done.append(True)
            fn()
    return hook


def test_verify_while_a_prune_removes_the_cut_being_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2, 3, 4])
    with Store.open(str(root), readonly=True) as ro:
        # The hook runs after the first file of cut 1 is hashed: the prune removes cuts 1-3 mid-audit.
        report = ro.verify(progress=once(lambda: prune_in_another_process(root)))
    assert report.ok, report.findings
    assert report.cuts_checked == [cuts[s] for s in (1, 2, 3, 4)]
    assert sorted(f.cut for f in report.findings if f.kind == "removed-during-verify") == [cuts[1], cuts[2], cuts[3]]
    assert all(f.severity == "notice" for f in report.findings)
    assert sorted(os.listdir(root / "cuts")) == [cuts[4]]


class PruneAfterListing(PosixStorage):
    """Real POSIX storage whose listing of one cut's directory lets a real prune run before the scan
    reads that cut's manifest: the moment a concurrent prune can hit (manifest listed, then gone)."""

    def __init__(self, root: Path, cut: str) -> None:
        super().__init__(str(root))
        self.when = f"{layout.CUTS_DIR}/{cut}"
        self.fired = False

    def list_dir(self, rel: str):  # type: ignore[no-untyped-def]
        entries = super().list_dir(rel)
        if rel == self.when and not self.fired:
            self.fired = True
            prune_in_another_process(Path(self.root))
        return entries


def test_scan_tolerates_a_prune_between_listing_and_reading(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2, 3, 4])
    storage = PruneAfterListing(root, cuts[2])
    with Store.open(storage, readonly=True) as ro:
        report = ro.verify()
    assert storage.fired
    assert report.ok, report.findings
    assert cuts[4] in report.cuts_checked and cuts[2] not in report.cuts_checked


def test_a_file_missing_from_a_cut_that_still_exists_is_missing_file(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root)
    gone = root / "cuts" / cuts[1] / layout.shard_name(0, 1, compressed=False)
    first = root / "cuts" / cuts[1] / layout.shard_name(0, 0, compressed=False)
    gone.unlink()
    with Store.open(str(root), readonly=True) as ro:
        # The hook runs after cut 1's first file is hashed and before its header is read: the file
        # goes while it is being checked.
        report = ro.verify(progress=once(first.unlink))
    errors = sorted((f.kind, f.path) for f in report.errors)
    assert errors == [("missing-file", layout.cut_file(cuts[1], first.name)),
                      ("missing-file", layout.cut_file(cuts[1], gone.name))]
    with Store.open(str(root), readonly=True) as ro:
        assert [c.id for c in ro.cuts()] == list(cuts.values())
    code, out, _ = cli("verify", str(root), "--json")
    assert code == 1 and {f["kind"] for f in json.loads(out)["findings"]} == {"missing-file"}


# ---------------------- issue 19 item 13: verify beside a writer that saves and prunes continuously
#: A real writer in another process: commits a cut at argv[2], then prunes to the newest one, so the
#: cut LATEST named a moment before (the one a reader's scan saw as LATEST's target) goes too.
SUPERSEDE = """
import sys
import numpy as np
from ckptstore import KeepLast, Store, StoreOptions
with Store.open(sys.argv[1], options=StoreOptions(max_shard_bytes=64 << 10)) as store:
    step = int(sys.argv[2])
    store.save({k: np.full(16384, step * 10 + i, dtype=np.float32) for i, k in enumerate("abc")}, step=step)
    print(len(store.prune(KeepLast(1))))
"""


def supersede_in_another_process(root: Path, step: int) -> None:
    p = subprocess.run([sys.executable, "-c", SUPERSEDE, str(root), str(step)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1"]


def test_verify_while_latest_moves_on_and_its_old_cut_is_pruned(tmp_path: Path) -> None:
    """The scan saw cut 1 as LATEST's target; mid-audit a writer commits cut 2 and prunes cut 1. The
    scan's LATEST cannot tell "pruned" from "damaged" then; LATEST as it is after the files went can."""
    root = tmp_path / "store"
    cuts = make_store(root, [1])
    with Store.open(str(root), readonly=True) as ro:
        report = ro.verify(progress=once(lambda: supersede_in_another_process(root, 2)))
    assert report.ok, report.findings
    assert [(f.kind, f.severity, f.cut) for f in report.findings] == [("removed-during-verify", "notice", cuts[1])]
    assert not (root / "cuts" / cuts[1]).exists()


class SupersedeBeforeReading(PosixStorage):
    """Real POSIX storage that lets a real writer commit a newer cut and prune the scanned LATEST's
    cut just before the audit looks for that cut's first shard: the cut's whole directory is gone."""

    def __init__(self, root: str, shard: str) -> None:
        super().__init__(root)
        self.shard, self.fired = shard, False

    def exists(self, rel: str) -> bool:
        if rel == self.shard and not self.fired:
            self.fired = True
            supersede_in_another_process(Path(self.root), 2)
        return super().exists(rel)


def test_cli_verify_while_latest_moves_on_and_its_old_cut_is_pruned(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cuts = make_store(root, [1])
    shard = layout.cut_file(cuts[1], layout.shard_name(0, 0, compressed=False))
    hooked: list[SupersedeBeforeReading] = []

    def backend(url: str, _: dict[str, Any]) -> PosixStorage:
        hooked.append(SupersedeBeforeReading(url.split("://", 1)[1], shard))
        return hooked[-1]

    register_backend("supersede-test", backend)
    code, out, _ = cli("verify", f"supersede-test://{root}", "--json")
    assert [s.fired for s in hooked] == [True]
    doc = json.loads(out)
    assert code == 0 and doc["ok"], doc["findings"]
    assert [(f["kind"], f["cut"]) for f in doc["findings"]] == [("removed-during-verify", cuts[1])]


def test_latest_cut_losing_its_manifest_and_files_mid_verify_is_damage(tmp_path: Path) -> None:
    """The other side: LATEST still names the cut whose manifest and files went (no writer moved it),
    so it is a dangling LATEST and missing files, never "removed during verify"."""
    root = tmp_path / "store"
    cuts = make_store(root, [1, 2])
    latest_dir = root / "cuts" / cuts[2]

    def vandalize(_: int) -> None:
        if (latest_dir / layout.MANIFEST_FILE).exists():
            (latest_dir / layout.MANIFEST_FILE).unlink()
            for p in latest_dir.iterdir():
                p.unlink()

    with Store.open(str(root), readonly=True) as ro:
        report = ro.verify(progress=vandalize)
    assert {(f.kind, f.cut) for f in report.errors} == {("missing-file", cuts[2])}
    assert not any(f.kind == "removed-during-verify" for f in report.findings)
