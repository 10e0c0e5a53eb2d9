"""The mirror in the CLI and in STORE.json (issue 21, "CLI"; "resume-info --json reports the mirror's lag"):
STORE.json records the mirror's URL (never credentials, written once), ``ls`` says which cuts the mirror
holds, ``resume-info`` makes restore's choice across tiers and reports the lag, ``verify`` audits both,
``mirror`` defaults to the recorded mirror. Real stores on temporary directories, mirrors made with
``spi.mirror_cut``; one mirror on the moto S3 server; an unreadable mirror is a symlink loop (ELOOP, a
real refusal of the file system)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptstore.spi as spi
from ckptstore import Store, StoreOptions
from ckptstore.cli import main
from ckptstore.opening import recordable_url
from filekit import flip_byte


def build(url: str, steps: list[int]) -> dict[int, str]:
    with Store.open(url, create=True) as s:
        return {step: s.save({"w": np.arange(64) * step}, step=step).id for step in steps}


def mirror_some(local: str, mirror: str, cuts: list[str], options: StoreOptions | None = None) -> None:
    """A mirror that fell behind: only ``cuts`` copied, as the writer's uploads copy them."""
    with Store.open(local, readonly=True) as src, Store.open(mirror, create=True, options=options) as dst:
        for cut in cuts:
            spi.mirror_cut(src, dst, cut)


def store_json(url: str) -> dict:
    with open(os.path.join(url, "STORE.json"), encoding="utf-8") as f:
        return json.load(f)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def unreadable(tmp_path: Path) -> str:
    """A mirror path the file system refuses to resolve (ELOOP): a mirror that cannot be reached."""
    os.symlink("loop", tmp_path / "loop")
    return str(tmp_path / "loop" / "mirror")


@pytest.fixture()
def tiers(tmp_path: Path) -> tuple[str, str, dict[int, str]]:
    """Local cuts at 10..40; the mirror, recorded in STORE.json, holds 10 and 20 only."""
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    ids = build(local, [10, 20, 30, 40])
    mirror_some(local, mirror, [ids[10], ids[20]])
    Store.open(local, mirror=mirror).close()
    return local, mirror, ids


# -------------------------------------------------------------------------------------- STORE.json
def test_store_json_records_the_mirror_once_and_a_new_one_replaces_it(tmp_path: Path) -> None:
    local, mirror, other = (str(tmp_path / n) for n in ("local", "mirror", "other"))
    build(local, [1])
    before = open(os.path.join(local, "STORE.json"), "rb").read()
    Store.open(local).close()
    Store.open(local, readonly=True, mirror=mirror).close()  # a reader writes nothing
    assert open(os.path.join(local, "STORE.json"), "rb").read() == before
    assert "mirror" not in store_json(local)

    Store.open(local, mirror=mirror).close()
    assert store_json(local) == {**json.loads(before), "mirror": mirror}
    ino = os.stat(os.path.join(local, "STORE.json")).st_ino
    Store.open(local, mirror=mirror).close()
    assert os.stat(os.path.join(local, "STORE.json")).st_ino == ino  # recorded once, not at every open
    Store.open(local, mirror=other).close()
    assert store_json(local)["mirror"] == other  # the store moved its mirror
    Store.open(local).close()
    assert store_json(local)["mirror"] == other  # an open without a mirror leaves the record alone
    assert not [n for n in os.listdir(local) if n.startswith(".tmp-")]


def test_store_json_never_records_credentials(tmp_path: Path, monkeypatch) -> None:
    local = str(tmp_path / "local")
    build(local, [1])
    Store.open(local, mirror="memory://AKIA:s3cr3t@bucket/run1?sig=t0k3n").close()
    text = open(os.path.join(local, "STORE.json"), encoding="utf-8").read()
    assert json.loads(text)["mirror"] == "memory://bucket/run1"
    assert "s3cr3t" not in text and "AKIA" not in text and "t0k3n" not in text
    assert recordable_url("s3://bucket/run") == "s3://bucket/run"
    assert recordable_url("simplecache::s3://k:s@bucket/run") == "simplecache::s3://bucket/run"
    monkeypatch.chdir(tmp_path)
    assert recordable_url("rel/mirror") == str(tmp_path / "rel" / "mirror")  # a path means one place


def test_the_checkpointer_records_its_mirror(tmp_path: Path) -> None:
    from ckptstore.writer import Checkpointer

    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    with Checkpointer(local, mode="thread", mirror=mirror):
        pass
    assert store_json(local)["mirror"] == mirror


# ---------------------------------------------------------------------------------------------- ls
def test_ls_without_a_mirror_is_unchanged(tmp_path: Path, capsys) -> None:
    local = str(tmp_path / "local")
    build(local, [10, 20])
    code, out, err = run(capsys, "ls", local)
    assert code == 0 and "mirrored" not in out and "mirror" not in err
    doc = json.loads(run(capsys, "ls", local, "--json")[1])
    assert "mirror" not in doc and all("mirrored" not in c for c in doc["cuts"])


def test_ls_says_which_cuts_the_recorded_mirror_holds(tiers, tmp_path: Path, capsys) -> None:
    local, mirror, ids = tiers
    code, out, _ = run(capsys, "ls", local)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[-1] == "mirrored"
    assert [ln.split()[-1] for ln in lines[2:6]] == ["yes", "yes", "no", "no"]
    assert f"mirror {mirror}: 2 of 4 cut(s) mirrored" in out
    doc = json.loads(run(capsys, "ls", local, "--json")[1])
    assert [c["mirrored"] for c in doc["cuts"]] == [True, True, False, False]
    assert doc["mirror"] == {"url": mirror, "reachable": True}

    # --mirror wins over the record; --no-mirror leaves it out
    empty = str(tmp_path / "empty")
    doc = json.loads(run(capsys, "ls", local, "--json", "--mirror", empty)[1])
    assert [c["mirrored"] for c in doc["cuts"]] == [False] * 4 and doc["mirror"]["url"] == empty
    doc = json.loads(run(capsys, "ls", local, "--json", "--no-mirror")[1])
    assert "mirror" not in doc and "mirrored" not in doc["cuts"][0]


def test_ls_with_an_unreachable_mirror_says_so_and_still_lists(tiers, tmp_path: Path, capsys) -> None:
    local, _, _ = tiers
    gone = unreadable(tmp_path)
    code, out, err = run(capsys, "ls", local, "--mirror", gone)
    assert code == 0
    assert [ln.split()[-1] for ln in out.splitlines()[2:6]] == ["?"] * 4
    assert f"the mirror {gone} cannot be read" in err
    code, out, _ = run(capsys, "ls", local, "--json", "--mirror", gone)
    doc = json.loads(out)
    assert code == 0 and [c["mirrored"] for c in doc["cuts"]] == [None] * 4
    assert doc["mirror"]["reachable"] is False and "StorageError" in doc["mirror"]["error"]
    # a mirror whose backend this machine lacks is read as unreachable too, never a crash
    code, out, err = run(capsys, "ls", local, "--mirror", "nosuchfs://bucket/run")
    assert code == 0 and out.splitlines()[2].split()[-1] == "?" and "nosuchfs" in err


# ------------------------------------------------------------------------------------- resume-info
def test_resume_info_reports_the_lag_of_a_mirror_that_fell_behind(tiers, capsys) -> None:
    local, mirror, ids = tiers
    code, out, _ = run(capsys, "resume-info", local, "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["cut"], doc["tier"], doc["healthy"]) == (ids[40], "local", True)
    assert doc["mirror"] == {"url": mirror, "latest_step": 20, "lag_steps": 20, "lag_cuts": 2, "reachable": True}
    code, out, _ = run(capsys, "resume-info", local)
    assert code == 0 and f"mirror {mirror}: newest step 20, 20 step(s) and 2 cut(s) behind the local tier" in out


def test_resume_info_of_a_replaced_node_with_mirror_says_resume_from_the_mirror(tiers, capsys) -> None:
    """The local tier is gone (a new node): with --mirror, resume-info says what restore will read (the
    mirror's newest cut that verifies), and exits as a missing local tier is not healthy (1); without
    --mirror it is the usage error (2) it always was."""
    local, mirror, ids = tiers
    shutil.rmtree(local)
    code, out, _ = run(capsys, "resume-info", local, "--mirror", mirror, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["local_missing"] is True
    assert (doc["resume_step"], doc["cut"], doc["tier"], doc["healthy"]) == (20, ids[20], "mirror", False)
    assert doc["mirror"]["latest_step"] == 20 and doc["mirror"]["reachable"] is True
    code, out, _ = run(capsys, "resume-info", local, "--mirror", mirror)
    assert code == 1 and f"resume from step 20 ({ids[20]}) from the mirror {mirror}" in out
    code, _out, err = run(capsys, "resume-info", local)
    assert code == 2 and local in err


def test_resume_info_takes_the_mirror_s_copy_of_a_damaged_local_cut_and_keeps_the_local_exit(
        tmp_path: Path, capsys) -> None:
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    ids = build(local, [10, 20])
    mirror_some(local, mirror, [ids[10], ids[20]])
    m = Store.open(local, readonly=True).manifest(20)
    flip_byte(os.path.join(local, "cuts", ids[20], m.files[0].name), -1)
    code, out, _ = run(capsys, "resume-info", local, "--json", "--mirror", mirror)
    doc = json.loads(out)
    assert (doc["cut"], doc["tier"], doc["mirror"]["lag_steps"]) == (ids[20], "mirror", 0)
    # The local LATEST is damaged: exit 1, as without the mirror; resume-info only looks (nothing recorded).
    assert code == 1 and doc["healthy"] is False
    assert doc["skipped"][0]["cut"] == ids[20] and doc["skipped"][0]["reason"].startswith("local copy: ")
    assert not os.listdir(os.path.join(local, "bad")) and not os.listdir(os.path.join(mirror, "bad"))
    assert run(capsys, "resume-info", local, "--no-mirror")[0] == 1


def test_resume_info_takes_a_mirror_newer_than_the_local_tier(tmp_path: Path, capsys) -> None:
    node_a, node_b, mirror = (str(tmp_path / n) for n in ("a", "b", "mirror"))
    ids = build(node_a, [10, 20])
    shutil.copytree(node_a, node_b)  # node b stopped at 20; the run went on on node a
    with Store.open(node_a) as s:
        ids[30] = s.save({"w": np.arange(64) * 30}, step=30).id
    mirror_some(node_a, mirror, list(ids.values()))
    code, out, _ = run(capsys, "resume-info", node_b, "--json", "--mirror", mirror)
    doc = json.loads(out)
    assert code == 0 and (doc["resume_step"], doc["tier"], doc["healthy"]) == (30, "mirror", True)
    assert (doc["mirror"]["lag_steps"], doc["mirror"]["lag_cuts"]) == (0, 0)
    assert f"from the mirror {mirror}" in run(capsys, "resume-info", node_b, "--mirror", mirror)[1]


def test_resume_info_with_an_unreachable_mirror_reports_it_and_exits_as_the_local_tier(
        tiers, tmp_path: Path, capsys) -> None:
    local, _, ids = tiers
    gone = unreadable(tmp_path)
    code, out, err = run(capsys, "resume-info", local, "--json", "--mirror", gone)
    doc = json.loads(out)
    assert code == 0 and (doc["cut"], doc["tier"], doc["healthy"]) == (ids[40], "local", True)
    lag = doc["mirror"]
    assert (lag["reachable"], lag["latest_step"], lag["lag_steps"], lag["lag_cuts"]) == (False, None, None, None)
    assert f"the mirror {gone} cannot be read" in err
    assert "its lag is unknown" in run(capsys, "resume-info", local, "--mirror", gone)[1]


# ------------------------------------------------------------------------------------------ verify
def test_verify_with_a_mirror_audits_both_tiers(tiers, capsys) -> None:
    local, mirror, ids = tiers
    code, out, _ = run(capsys, "verify", local)  # no --mirror: the local tier only, as ever
    assert code == 0 and "mirror" not in out
    code, out, _ = run(capsys, "verify", local, "--mirror", "--json")  # the recorded mirror
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and len(doc["cuts_checked"]) == 4
    assert doc["mirror"]["store"] == mirror and doc["mirror"]["ok"] and len(doc["mirror"]["cuts_checked"]) == 2

    m = Store.open(mirror, readonly=True).manifest(20)
    flip_byte(os.path.join(mirror, "cuts", ids[20], m.files[0].name), -1)
    code, out, _ = run(capsys, "verify", local, "--mirror", mirror)
    assert code == 1
    local_part, mirror_part = out.split(f"\n\nmirror {mirror}:\n")
    assert local_part.startswith(f"local {local}:\n") and local_part.rstrip().split("\n")[-1].startswith("OK")
    assert ids[20] in mirror_part and "PROBLEMS FOUND" in mirror_part


def test_verify_mirror_without_a_recorded_one_is_a_usage_error(tmp_path: Path, capsys) -> None:
    local = str(tmp_path / "local")
    build(local, [1])
    code, _, err = run(capsys, "verify", local, "--mirror")
    assert code == 2 and "records none" in err


# ------------------------------------------------------------------------------------------ mirror
def test_mirror_without_to_uses_the_recorded_mirror(tiers, tmp_path: Path, capsys) -> None:
    local, mirror, ids = tiers
    code, out, _ = run(capsys, "mirror", local, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["mirror"] == mirror and [c["id"] for c in doc["mirrored"]] == [ids[30], ids[40]]

    bare = str(tmp_path / "bare")
    build(bare, [1])
    code, _, err = run(capsys, "mirror", bare)
    assert code == 2 and "needs --to MIRROR" in err and "records no mirror" in err


# ---------------------------------------------------------------------------------------------- S3
def test_ls_and_resume_info_with_an_s3_mirror(tmp_path: Path, s3_url, capsys) -> None:
    local = str(tmp_path / "local")
    mirror, opts = s3_url
    ids = build(local, [10, 20, 30])
    mirror_some(local, mirror, [ids[10]], StoreOptions(storage_options=opts))
    Store.open(local, mirror=mirror, mirror_options=StoreOptions(storage_options=opts)).close()
    assert store_json(local)["mirror"] == mirror and "secret" not in json.dumps(store_json(local))
    creds = tmp_path / "mirror-options.json"
    creds.write_text(json.dumps(opts))

    code, out, _ = run(capsys, "ls", local, "--json", "--mirror-storage-options", f"@{creds}")
    assert code == 0 and [c["mirrored"] for c in json.loads(out)["cuts"]] == [True, False, False]
    code, out, _ = run(capsys, "resume-info", local, "--json", "--mirror-storage-options", f"@{creds}")
    doc = json.loads(out)
    assert code == 0 and doc["tier"] == "local"
    assert doc["mirror"] == {"url": mirror, "latest_step": 10, "lag_steps": 20, "lag_cuts": 2, "reachable": True}
