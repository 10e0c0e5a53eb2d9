"""The ckptstore command: every subcommand in-process, exit codes, --json, and one real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import main
from filekit import flip_byte


@pytest.fixture()
def store_url(tmp_path):
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        for i in range(1, 5):
            store.save({"w": np.arange(100) * i, "opt": {0: np.ones(3) * i}}, step=i * 10,
                       tags=("best",) if i == 2 else ())
    return url


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ls_table_and_json(store_url, capsys):
    code, out, _ = run(capsys, "ls", store_url)
    assert code == 0
    assert "LATEST" in out and "step-000000000040-" in out
    code, out, _ = run(capsys, "ls", store_url, "--json")
    doc = json.loads(out)
    assert [c["step"] for c in doc["cuts"]] == [10, 20, 30, 40]
    assert doc["latest"].startswith("step-000000000040-")


def test_show_with_tensors(store_url, capsys):
    code, out, _ = run(capsys, "show", store_url, "20", "--tensors", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["step"] == 20 and doc["tags"] == ["best"] and doc["latest"] is False
    assert {t["name"] for t in doc["tensors"]} == {"w", "opt/0"}
    code, out, _ = run(capsys, "show", store_url)
    assert "step      40" in out and "latest    yes" in out


def test_verify_ok_then_corrupt(store_url, capsys):
    code, out, _ = run(capsys, "verify", store_url)
    assert code == 0 and out.strip().endswith("0 notice(s)")
    cut = ckptstore.Store.open(store_url, readonly=True).manifest(30)
    shard = os.path.join(store_url, "cuts", cut.cut, cut.files[0].name)
    flip_byte(shard, -1)
    code, out, _ = run(capsys, "verify", store_url, "--json")
    assert code == 1
    doc = json.loads(out)
    bad = [f for f in doc["findings"] if f["severity"] == "error"]
    assert len(bad) == 1 and bad[0]["kind"] == "hash-mismatch" and bad[0]["cut"] == cut.cut
    assert bad[0]["path"].endswith(cut.files[0].name) and bad[0]["expected"] != bad[0]["found"]
    # --cut limits the audit to one (healthy) cut
    code, _, _ = run(capsys, "verify", store_url, "--cut", "40")
    assert code == 0


def test_prune_dry_run_then_real(store_url, capsys):
    code, out, _ = run(capsys, "prune", store_url, "--keep-last", "2", "--keep-tag", "best", "--dry-run", "--json")
    assert code == 0
    assert [c["step"] for c in json.loads(out)["removed"]] == [10]
    assert [c.step for c in ckptstore.Store.open(store_url, readonly=True).cuts()] == [10, 20, 30, 40]
    code, out, _ = run(capsys, "prune", store_url, "--keep-last", "1")
    assert code == 0 and "removed 3 cut(s)" in out
    assert [c.step for c in ckptstore.Store.open(store_url, readonly=True).cuts()] == [40]


def test_prune_needs_a_policy(store_url, capsys):
    code, _, err = run(capsys, "prune", store_url)
    assert code == 2 and "--keep-last" in err


def test_gc_reports_leftovers_and_keeps_foreign(store_url, capsys):
    os.makedirs(os.path.join(store_url, "cuts", "step-000000000050-deadbeef"))
    open(os.path.join(store_url, "notes.txt"), "w").write("mine")
    code, out, _ = run(capsys, "gc", store_url, "--json")
    assert code == 0
    doc = json.loads(out)
    # opening as writer already recovered the abandoned directory; gc itself reports the foreign file
    assert "notes.txt" in doc["foreign"]
    assert os.path.exists(os.path.join(store_url, "notes.txt"))
    assert not os.path.exists(os.path.join(store_url, "cuts", "step-000000000050-deadbeef"))


def test_broken_latest_then_repair(store_url, capsys):
    with open(os.path.join(store_url, "LATEST"), "wb") as f:
        f.write(b"\x00garbage")
    code, _, err = run(capsys, "ls", store_url)
    assert code == 1
    code, _, err = run(capsys, "gc", store_url)
    assert code == 1 and "ckptstore repair" in err and "Traceback" not in err
    code, out, _ = run(capsys, "repair", store_url)
    assert code == 0 and "step 40" in out
    code, _, _ = run(capsys, "verify", store_url)
    assert code == 0


def test_missing_store_and_bad_args(tmp_path, capsys):
    code, _, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert code == 2 and "no ckptstore store" in err
    code, out, _ = run(capsys, "ls", str(tmp_path / "nope"), "--json")
    assert code == 2 and json.loads(out.splitlines()[0])["error"] == "StoreNotFound"
    assert run(capsys, "frobnicate", str(tmp_path))[0] == 2
    assert run(capsys, "show", str(tmp_path / "nope"), "../../etc")[0] == 2


def test_show_hostile_cut_name(store_url, capsys):
    code, _, err = run(capsys, "show", store_url, "../../etc/passwd")
    assert code == 2 and "refusing cut name" in err  # a bad argument, not damage found (exit 1)
    for cmd in (["verify", store_url, "--cut", "notacut"], ["diff", store_url, "latest", "nope"],
                ["export", store_url, "x/../y", "--to", "/tmp/never-written"]):
        code, _, err = run(capsys, *cmd)
        assert code == 2 and "refusing cut name" in err, cmd


def test_real_subprocess(store_url):
    out = subprocess.run([sys.executable, "-m", "ckptstore.cli", "verify", store_url, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True
    out = subprocess.run([sys.executable, "-m", "ckptstore.cli", "ls", store_url + "-missing"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_prune_keep_last_zero_says_what_is_wrong(store_url, capsys):
    code, _, err = run(capsys, "prune", store_url, "--keep-last", "0")
    assert code == 2 and "--keep-last must be at least 1" in err
    code, _, err = run(capsys, "prune", store_url)
    assert code == 2 and "needs at least one of" in err


def test_a_backend_error_is_one_line_and_exit_2(monkeypatch, capsys):
    """An object store without credentials: botocore's own error, not a traceback (issue 10, item 15)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    code, out, err = run(capsys, "ls", "s3://missing-bucket/run")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckptstore: error: ") and "Traceback" not in err
    assert "s3://missing-bucket/run" in lines[0] and "credentials" in lines[0].lower()
    code, out, _ = run(capsys, "ls", "s3://missing-bucket/run", "--json")
    assert code == 2 and json.loads(out.splitlines()[0])["exit_code"] == 2


def test_show_tensors_is_sorted_with_one_dtype_naming(tmp_path, capsys):
    import numpy as np
    import torch

    url = str(tmp_path / "s")
    with ckptstore.Store.open(url, create=True) as store:
        store.save({"zeta": torch.zeros(2, dtype=torch.bfloat16), "alpha": np.arange(3, dtype=">i8"),
                    "mid": np.zeros(2, dtype=np.float32)}, step=1)
    code, out, _ = run(capsys, "show", url, "--tensors", "--json")
    assert code == 0
    tensors = json.loads(out)["tensors"]
    assert [t["name"] for t in tensors] == ["alpha", "mid", "zeta"]
    assert [t["dtype_name"] for t in tensors] == ["numpy.int64 (big-endian)", "numpy.float32", "torch.bfloat16"]
    code, out, _ = run(capsys, "show", url, "--tensors")
    rows = [line for line in out.splitlines() if line.startswith(("alpha", "mid", "zeta"))]
    assert [r.split()[0] for r in rows] == ["alpha", "mid", "zeta"] and "torch.bfloat16" in rows[2]
