"""The ckptstore command on cuts of several ranks: ls/show/verify/resume-info name the world size,
verify checks every rank's files, diff and export take --rank (and refuse to guess without it)."""

from __future__ import annotations

import json
import os
import struct

import pytest

torch = pytest.importorskip("torch")

import ckptstore  # noqa: E402
from ckptstore.arrays import describe  # noqa: E402
from ckptstore.cli import main  # noqa: E402
from ckptstore.pending import RankPart  # noqa: E402
from ckptstore.tree import flatten  # noqa: E402
from filekit import flip_byte  # noqa: E402


def rank_state(r: int, step: int) -> dict:
    return {"w": torch.full((r + 1, 2), float(r + step)), "b": torch.ones(3), "r": r}


def save_ranks(store: ckptstore.Store, step: int, world_size: int, *, final: bool = False) -> ckptstore.CutInfo:
    """What every rank of a torch.distributed job does, done in one process."""
    pending = store.begin_cut(step, world_size=world_size)
    for r in range(world_size):
        tree, leaves = flatten(rank_state(r, step))
        items = [describe(leaf) for leaf in leaves]
        part = RankPart(store._protocol, store.storage, pending.id, step, r, world_size)
        kw = dict(codec=store.shard_codec(), max_shard_bytes=store.options.max_shard_bytes)
        files, tensors = part.write(items, **kw)
        part.publish(files, tensors, tree=tree, pickled=False)
    pending.collect_ranks()
    pending.files_durable()
    return pending.commit(tags=[], final=final)


@pytest.fixture()
def store_url(tmp_path):
    """Step 1: one rank; steps 5 and 6: two ranks (6 is LATEST, final)."""
    url = str(tmp_path / "store")
    store = ckptstore.Store.open(url, create=True)
    try:
        store.save({"w": torch.zeros(2, 2)}, step=1)
        save_ranks(store, 5, 2)
        save_ranks(store, 6, 2, final=True)
    finally:
        store.close()
    return url


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_ls_shows_world_size(store_url, capsys):
    code, out, _ = run(capsys, "ls", store_url)
    assert code == 0
    header, _, *rows = out.strip().splitlines()
    assert "ranks" in header.split()
    col = header.split().index("ranks")
    # state is empty for steps 1 and 5: count columns from the right instead
    right = len(header.split()) - col  # "created (UTC)" is two header words, two row words
    assert [row.split()[-right] for row in rows] == ["1", "2", "2"]
    code, out, _ = run(capsys, "ls", store_url, "--json")
    assert [c["world_size"] for c in json.loads(out)["cuts"]] == [1, 2, 2]


def test_show_world_size_and_per_rank_counts(store_url, capsys):
    code, out, _ = run(capsys, "show", store_url)
    assert code == 0
    assert "ranks     2" in out
    assert "rank 0    " in out and "rank 1    " in out and "1 file(s), 2 tensor(s)" in out
    code, out, _ = run(capsys, "show", store_url, "--json")
    doc = json.loads(out)
    assert doc["world_size"] == 2
    assert [(c["rank"], c["files"], c["tensors"]) for c in doc["ranks"]] == [(0, 1, 2), (1, 1, 2)]
    assert sorted(f["rank"] for f in doc["files"]) == [0, 1]
    # a cut of one rank says so, and lists no per-rank lines
    code, out, _ = run(capsys, "show", store_url, "1")
    assert code == 0 and "ranks     1" in out and "rank 0" not in out


def test_show_tensors_names_their_rank(store_url, capsys):
    code, out, _ = run(capsys, "show", store_url, "--tensors", "--json")
    assert code == 0
    doc = json.loads(out)
    assert sorted((t["rank"], t["name"], tuple(t["shape"])) for t in doc["tensors"]) == [
        (0, "b", (3,)), (0, "w", (1, 2)), (1, "b", (3,)), (1, "w", (2, 2))]
    code, out, _ = run(capsys, "show", store_url, "--tensors")
    table = out.split("\n\n", 1)[1].splitlines()
    assert table[0].split()[:2] == ["rank", "name"]
    assert sorted(tuple(row.split()[:2]) for row in table[2:]) == [("0", "b"), ("0", "w"), ("1", "b"), ("1", "w")]
    # --rank R: only rank R's files and tensors
    code, out, _ = run(capsys, "show", store_url, "5", "--tensors", "--rank", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["rank"] == 1 and doc["world_size"] == 2
    assert {t["rank"] for t in doc["tensors"]} == {1} and len(doc["tensors"]) == 2
    assert [f["rank"] for f in doc["files"]] == [1]
    code, _, err = run(capsys, "show", store_url, "--rank", "2")
    assert code == 2 and "world size 2" in one_line_error(err)


def test_show_tensors_single_rank_unchanged(store_url, capsys):
    code, out, _ = run(capsys, "show", store_url, "1", "--tensors")
    assert code == 0
    assert out.split("\n\n", 1)[1].splitlines()[0].split() == ["name", "dtype", "shape", "bytes", "file"]


def test_verify_checks_every_rank_and_names_the_damaged_file(store_url, capsys):
    code, out, _ = run(capsys, "verify", store_url, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] and doc["files_checked"] == 5  # 1 + 2 + 2: both ranks' shards
    assert sorted(doc["world_sizes"].values()) == [1, 2, 2]
    code, out, _ = run(capsys, "verify", store_url)
    assert code == 0 and "3 cut(s) (2 with 2 ranks)" in out

    m = ckptstore.Store.open(store_url, readonly=True).manifest(5)
    rank1 = [f for f in m.files if f.rank == 1]
    assert len(rank1) == 1
    flip_byte(os.path.join(store_url, "cuts", m.cut, rank1[0].name), -1)

    code, out, _ = run(capsys, "verify", store_url, "--json")
    assert code == 1
    doc = json.loads(out)
    bad = [f for f in doc["findings"] if f["severity"] == "error"]
    assert len(bad) == 1 and bad[0]["cut"] == m.cut and bad[0]["rank"] == 1
    assert bad[0]["path"].endswith(rank1[0].name) and bad[0]["kind"] == "hash-mismatch"
    code, out, _ = run(capsys, "verify", store_url)
    assert code == 1 and rank1[0].name in out and "PROBLEMS FOUND" in out
    header = out.splitlines()[0].split()
    assert header == ["severity", "kind", "cut", "rank", "file", "message"]
    # the other cuts (both ranks of step 6) are still fine
    assert run(capsys, "verify", store_url, "--cut", "6")[0] == 0


def test_resume_info_world_size(store_url, capsys):
    code, out, _ = run(capsys, "resume-info", store_url, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["world_size"] == 2 and doc["resume_step"] == 6 and doc["finished"] is True
    code, out, _ = run(capsys, "resume-info", store_url)
    assert code == 0 and "world size 2" in out


def test_resume_info_single_rank_and_empty(tmp_path, capsys):
    url = str(tmp_path / "one")
    with ckptstore.Store.open(url, create=True) as store:
        code, out, _ = run(capsys, "resume-info", url, "--json")
        assert code == 0 and json.loads(out)["world_size"] is None
        store.save({"w": torch.zeros(2)}, step=3)
    code, out, _ = run(capsys, "resume-info", url, "--json")
    assert code == 0 and json.loads(out)["world_size"] == 1
    code, out, _ = run(capsys, "resume-info", url)
    assert code == 0 and "world size" not in out


def test_diff_needs_rank_on_cuts_of_several_ranks(store_url, capsys):
    code, out, err = run(capsys, "diff", store_url, "5", "6")
    assert code == 2 and out == ""
    line = one_line_error(err)
    assert "world size 2" in line and "--rank" in line
    code, out, _ = run(capsys, "diff", store_url, "5", "6", "--json")
    assert code == 2 and json.loads(out)["error"] == "UsageError"
    # also when only one side holds several ranks
    code, _, err = run(capsys, "diff", store_url, "1", "6")
    assert code == 2 and "world size 2" in one_line_error(err)


def test_diff_one_rank(store_url, capsys):
    code, out, _ = run(capsys, "diff", store_url, "5", "6", "--rank", "1", "--json")
    assert code == 1  # w differs (r + step), b does not
    doc = json.loads(out)
    assert doc["rank"] == 1 and doc["changed"] == ["w"] and doc["unchanged"] == ["b"]
    assert doc["added"] == [] and doc["removed"] == []
    code, out, _ = run(capsys, "diff", store_url, "6", "6", "--rank", "0")
    assert code == 0 and "rank 0: 0 changed, 2 unchanged" in out
    # a one-rank cut is its own rank 0; it has no rank 1
    code, out, _ = run(capsys, "diff", store_url, "1", "6", "--rank", "0", "--json")
    assert code == 1 and json.loads(out)["added"] == ["b"]
    code, _, err = run(capsys, "diff", store_url, "1", "6", "--rank", "1")
    assert code == 2 and "world size 1" in one_line_error(err)


def read_safetensors(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def test_export_needs_rank_on_cuts_of_several_ranks(store_url, tmp_path, capsys):
    out_path = str(tmp_path / "out.safetensors")
    code, out, err = run(capsys, "export", store_url, "--to", out_path)
    assert code == 2 and out == ""
    line = one_line_error(err)
    assert "world size 2" in line and "--rank" in line
    assert not os.path.exists(out_path)
    code, _, err = run(capsys, "export", store_url, "--to", out_path, "--rank", "2")
    assert code == 2 and "world size 2" in one_line_error(err)
    assert not os.path.exists(out_path)


def test_export_one_rank(store_url, tmp_path, capsys):
    out_path = str(tmp_path / "r1.safetensors")
    code, out, _ = run(capsys, "export", store_url, "5", "--to", out_path, "--rank", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["rank"] == 1 and doc["world_size"] == 2 and doc["tensors"] == 2
    header, _ = read_safetensors(out_path)
    meta = header.pop("__metadata__")
    assert meta["ckptstore_rank"] == "1" and meta["ckptstore_world_size"] == "2"
    assert meta["ckptstore_step"] == "5"
    assert {k: v["shape"] for k, v in header.items()} == {"w": [2, 2], "b": [3]}
    from safetensors.torch import load_file

    loaded = load_file(out_path)
    assert torch.equal(loaded["w"], rank_state(1, 5)["w"]) and torch.equal(loaded["b"], torch.ones(3))

    pt = str(tmp_path / "r0.pt")
    code, out, _ = run(capsys, "export", store_url, "--to", pt, "--rank", "0", "--format", "torch",
                       "--allow-pickle-format")
    assert code == 0 and "rank 0 of 2" in out
    state = torch.load(pt, weights_only=True)
    assert state["r"] == 0 and torch.equal(state["w"], rank_state(0, 6)["w"])


def test_export_single_rank_unchanged(store_url, tmp_path, capsys):
    out_path = str(tmp_path / "one.safetensors")
    code, out, _ = run(capsys, "export", store_url, "1", "--to", out_path)
    assert code == 0 and out.strip().startswith("exported step-000000000001-")
    assert out.split(" to ")[0].endswith(" (1 tensors)")  # no "rank R of N" for a cut of one rank
    header, _ = read_safetensors(out_path)
    assert "ckptstore_rank" not in header["__metadata__"]
    assert run(capsys, "export", store_url, "1", "--to", out_path, "--rank", "0", "--force")[0] == 0
