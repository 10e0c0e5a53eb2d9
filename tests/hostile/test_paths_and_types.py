"""Hostile stores and surroundings (issue 10, items 1, 4, 13, 14, 17): ``export`` never unpickles what it
reads unless asked by its own flag, never follows a symlink or silently overwrites its target, and writes a
torch file that plain ``torch.load`` reads; a symlinked ``cuts/``, ``marks/`` or cut directory is refused
before anything outside the root is read or deleted; another user's /dev/shm name never stops a
Checkpointer and is never removed; shared storages, Parameters and ``requires_grad`` survive a round trip
through the store and through the writer's capture.

Every case uses real files and processes, asserts the named error (type, and the store, cut or file it
names), and checks that nothing committed or foreign was touched."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptstore
from filekit import rewrite_manifest
from ckptstore import CorruptCut, HostileInput, Store, layout
from ckptstore.cli import main
from ckptstore.writer import Checkpointer, WriterOptions
from ckptstore.writer import shm

NOBODY = 65534
OTHER = 65533  # a third user, owner of nobody's business


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every path under ``root``, not following symlinks: files with their bytes, directories as None,
    symlinks as their target."""
    out: dict[str, bytes | str | None] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = os.readlink(p)
            elif p.is_dir():
                out[rel] = None
            elif name not in (layout.LOCK_FILE, layout.WRITER_FILE):
                out[rel] = p.read_bytes()
    return out


# ------------------------------------------------------------------------------------------ item 1
class _Canary:
    """Unpickling this creates the directory ``path`` (and yields None): proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
def test_export_never_unpickles_the_cut_unless_allow_pickle(tmp_path: Path, declared: bool) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        cut = s.save({"w": torch.arange(4.0), "step": 3}, step=3).id
    canary = tmp_path / "canary"
    payload = base64.b64encode(pickle.dumps(_Canary(str(canary)))).decode()

    def plant(doc: dict[str, Any]) -> None:
        doc["tree"]["items"].append({"k": "evil", "v": {"t": "pickle", "v": payload}})
        doc["pickled"] = declared

    rewrite_manifest(url, cut, plant)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    before = snapshot(tmp_path / "store")
    for argv in (["--format", "torch", "--allow-pickle-format"], [], ["--format", "torch", "--allow-pickle-format",
                                                                      "--force"]):
        code, _, err = cli("export", url, "--to", str(out_dir / "x.pt"), *argv)
        assert code == 1, err
        assert "HostileInput" in err or "unpickle" in err, err
        assert url in err and cut in err, err
        assert not canary.exists(), f"export {argv} ran the planted pickle"
        assert list(out_dir.iterdir()) == [], "nothing written, not even a temp file"
    assert snapshot(tmp_path / "store") == before

    # The input flag is the only way in, and the payload is real (the test above cannot pass by accident).
    code, _, err = cli("export", url, "--to", str(out_dir / "x.pt"), "--format", "torch", "--allow-pickle-format",
                       "--allow-pickle")
    assert code == 0, err
    assert canary.is_dir()
    assert torch.load(out_dir / "x.pt")["evil"] is None


# ----------------------------------------------------------------------------------------- item 17
@pytest.fixture
def rng_store(tmp_path: Path) -> tuple[str, str, dict[str, Any]]:
    np.random.seed(5)
    state = {"model": {"w": torch.randn(3, 2), "p": torch.nn.Parameter(torch.ones(2))},
             "numpy_rng": np.random.get_state(), "np": np.arange(6, dtype=">i4").reshape(2, 3),
             "npscalar": np.float32(1.5), "bits": np.array([True, False]), "step": 7}
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        cut = s.save(state, step=7).id
    return url, cut, state


def test_torch_export_loads_with_weights_only_default(rng_store, tmp_path: Path) -> None:
    url, cut, state = rng_store
    target = tmp_path / "model.pt"
    code, _, err = cli("export", url, "--to", str(target), "--format", "torch", "--allow-pickle-format")
    assert code == 0, err
    got = torch.load(target)  # weights_only=True, torch's default
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and isinstance(got["model"]["p"], torch.nn.Parameter)
    name, keys, pos, has_gauss, cached = got["numpy_rng"]
    assert name == "MT19937" and keys.dtype == torch.uint32 and pos == state["numpy_rng"][2]
    np.random.set_state(got["numpy_rng"])  # accepted as exported
    assert np.array_equal(np.random.get_state()[1], state["numpy_rng"][1])
    assert got["np"].dtype == torch.int32  # big-endian >i4 in the state: native byte order, same values
    assert torch.equal(got["np"], torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32))
    assert got["npscalar"] == 1.5 and type(got["npscalar"]) is float
    assert got["bits"].tolist() == [True, False] and got["step"] == 7
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "store"]


def test_export_target_missing_dir_existing_file_and_symlinks(rng_store, tmp_path: Path, monkeypatch) -> None:
    url, cut, _ = rng_store
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious"
    precious.write_bytes(b"not yours")

    # A missing directory: one line naming the target, no temp-file name, nothing created.
    missing = tmp_path / "nope" / "model.safetensors"
    code, _, err = cli("export", url, "--to", str(missing))
    assert code == 2 and str(missing) in err and ".tmp" not in err, err
    assert not (tmp_path / "nope").exists()

    # An existing target is refused without --force and left as it was.
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    code, _, err = cli("export", url, "--to", str(target))
    assert code == 2 and str(target) in err and "--force" in err, err
    assert target.read_bytes() == b"old"
    code, _, err = cli("export", url, "--to", str(target), "--force")
    assert code == 0, err
    from safetensors.torch import load_file

    assert set(load_file(str(target))) >= {"model/w", "model/p"}

    # A symlink at the target: refused without --force; with it the link is replaced, its target untouched.
    link = tmp_path / "link.safetensors"
    link.symlink_to(precious)
    code, _, err = cli("export", url, "--to", str(link))
    assert code == 2 and str(link) in err, err
    code, _, err = cli("export", url, "--to", str(link), "--force")
    assert code == 0, err
    assert not link.is_symlink() and precious.read_bytes() == b"not yours"

    # A symlink planted under the temp file's name is never followed (O_EXCL|O_NOFOLLOW).
    import ckptstore.export as export_mod

    monkeypatch.setattr(export_mod.secrets, "token_hex", lambda n: "0" * (2 * n))
    fresh = tmp_path / "fresh.pt"
    planted = tmp_path / f".fresh.pt.tmp-{os.getpid()}-{'0' * 12}"
    planted.symlink_to(precious)
    code, _, err = cli("export", url, "--to", str(fresh), "--format", "torch", "--allow-pickle-format")
    assert code == 2 and "File exists" in err, err
    assert precious.read_bytes() == b"not yours" and planted.is_symlink() and not fresh.exists()


# ------------------------------------------------------------------------------------------ item 4
def _leftover_lookalikes(d: Path) -> None:
    """Files and a directory named exactly like what recovery, gc and prune delete in a store."""
    d.mkdir(exist_ok=True)
    (d / ".tmp-0123456789ab-MANIFEST.json").write_bytes(b"theirs 1")
    (d / ".tmp-0123456789ab-step-000000000009-deadbeef.json").write_bytes(b"theirs 2")
    (d / "step-000000000009-deadbeef.json").write_bytes(b"theirs 3")  # an orphan "mark"
    abandoned = d / "step-000000000009-deadbeef"  # an abandoned "cut"
    abandoned.mkdir()
    (abandoned / "rank00000-00000.safetensors").write_bytes(b"theirs 4")


@pytest.mark.parametrize("which", ["cuts", "marks", "cut-dir"])
def test_symlinked_store_dirs_are_refused_and_nothing_outside_is_touched(tmp_path: Path, which: str) -> None:
    url = tmp_path / "store"
    with Store.open(str(url), create=True) as s:
        s.save({"w": torch.ones(3)}, step=1)
        s.save({"w": torch.ones(3) * 2}, step=2)
    outside = tmp_path / "outside"
    if which == "cuts":  # the store's own cuts now live behind a symlink, among someone's lookalikes
        shutil.move(str(url / "cuts"), str(outside))
        _leftover_lookalikes(outside)
        (url / "cuts").symlink_to(outside)
        rel = "cuts"
    elif which == "marks":
        _leftover_lookalikes(outside)
        (url / "marks").rmdir()
        (url / "marks").symlink_to(outside)
        rel = "marks"
    else:
        _leftover_lookalikes(outside)
        (url / "cuts" / "step-000000000009-deadbeef").symlink_to(outside)
        rel = "cuts/step-000000000009-deadbeef"
    outside_before, store_before = snapshot(outside), snapshot(url)

    with pytest.raises(HostileInput) as ei:
        Store.open(str(url))
    assert ei.value.store == str(url) and ei.value.path == rel and "symlink" in str(ei.value)
    for argv in (["gc", str(url)], ["gc", str(url), "--dry-run"], ["prune", str(url), "--keep-last", "1"],
                 ["ls", str(url)]):
        code, _, err = cli(*argv)
        assert code == 1 and "symlink" in err and str(url) in err and f"file={rel}" in err, (argv, err)
    with pytest.raises(HostileInput):
        ckptstore.load(str(url))
    assert snapshot(outside) == outside_before, "a file outside the store was touched"
    assert snapshot(url) == store_before, "a file of the store was touched"


# ----------------------------------------------------------------------------------------- item 13
def _dead_pid() -> int:
    """A pid no process can have: above the kernel's pid_max."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 12345


@contextlib.contextmanager
def shm_names(*specs: tuple[str, int | None]):
    """Creates /dev/shm files ``(name, owner uid)`` (a None uid: a symlink to /etc/hostname), removes
    them after."""
    paths = []
    try:
        for name, uid in specs:
            p = os.path.join(shm.SHM_DIR, name)
            if uid is None:
                os.symlink("/etc/hostname", p)
            else:
                Path(p).write_bytes(b"x")
                os.chown(p, uid, uid)
            paths.append(p)
        yield paths
    finally:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another user (chown)")


@needs_root
def test_reaper_removes_only_our_own_dead_names() -> None:
    dead = _dead_pid()
    ours, theirs, link = (f"{shm.PREFIX}{dead}-aaaa0001", f"{shm.PREFIX}{dead}-aaaa0002",
                          f"{shm.PREFIX}{dead}-aaaa0003")
    with shm_names((ours, os.geteuid()), (theirs, NOBODY), (link, None)) as paths:
        block = shm.Block.create(1 << 16)
        block.close()
        assert not os.path.lexists(paths[0]), "our own leftover of a dead pid is reaped"
        assert os.path.exists(paths[1]) and os.stat(paths[1]).st_uid == NOBODY, "another user's name is kept"
        assert os.path.islink(paths[2]) and Path("/etc/hostname").exists(), "a symlink is never followed"


CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np  # no torch: a numpy state spares the child a torch import
    from ckptstore.writer import Checkpointer, WriterOptions
    from ckptstore.writer import shm

    url, collide = sys.argv[1], sys.argv[2]
    # Still root here: the name this process will draw first, taken by another user (root).
    taken = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{os.getpid()}-{collide}")
    open(taken, "w").close()
    # Now an ordinary user: it may not remove root's names in the sticky /dev/shm (the interpreter
    # lives where that user cannot read, so the switch comes after the imports).
    os.setgroups([]); os.setresgid(NOBODY, NOBODY, NOBODY); os.setresuid(NOBODY, NOBODY, NOBODY)
    draws = iter([collide])
    real = shm.secrets.token_hex
    shm.secrets.token_hex = lambda n: next(draws, None) or real(n)
    with Checkpointer(url, options=WriterOptions(mode="inline")) as ck:
        ck.cut(1, {"w": np.arange(3.0)}, final=True)
    assert "torch" not in sys.modules
    print(json.dumps({"uid": os.getuid(), "taken": taken}))
""").replace("NOBODY", str(NOBODY))


@pytest.fixture
def nobodys_dir() -> Any:
    """A directory the unprivileged user owns (pytest's tmp_path lies under a root-only directory)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="ckptstore-nobody-"))
    try:
        os.chown(d, NOBODY, NOBODY)
        yield d
    finally:
        shutil.rmtree(d)


@needs_root
def test_another_users_shm_names_never_stop_a_non_root_checkpointer(nobodys_dir: Path) -> None:
    store_dir = nobodys_dir / "run"
    dead = _dead_pid()
    # A third user's name of a dead pid: the unprivileged reaper may not remove it (and a root process
    # running beside this test never takes it for its own either).
    foreign = f"{shm.PREFIX}{dead}-bbbb0001"
    mine = f"{shm.PREFIX}{dead}-bbbb0002"  # the user's own, of a dead pid: reaped
    with shm_names((foreign, OTHER), (mine, NOBODY)) as paths:
        res = subprocess.run([sys.executable, "-c", CHILD, str(store_dir), "c0111de0"], capture_output=True,
                             text=True, timeout=120)
        try:
            assert res.returncode == 0, res.stderr[-3000:]
            out = json.loads(res.stdout.strip().splitlines()[-1])
            assert out["uid"] == NOBODY
            assert os.path.exists(out["taken"]) and os.stat(out["taken"]).st_uid == 0, "the colliding name is kept"
            assert os.path.exists(paths[0]) and os.stat(paths[0]).st_uid == OTHER, "another user's name is kept"
            assert not os.path.exists(paths[1]), "the user's own dead leftover is reaped"
        finally:
            with contextlib.suppress(FileNotFoundError, UnboundLocalError):
                os.unlink(out["taken"])
            for n in os.listdir(shm.SHM_DIR):  # the child's name if it died before printing
                if n.endswith("-c0111de0"):
                    os.unlink(os.path.join(shm.SHM_DIR, n))
    assert np.array_equal(ckptstore.load(str(store_dir))["w"], np.arange(3.0))


# ----------------------------------------------------------------------------------------- item 14
def shared_state() -> dict[str, Any]:
    w = torch.arange(12.0).reshape(3, 4)
    p = torch.nn.Parameter(torch.ones(5))
    return {"param": p, "plain": p.data, "w": w, "row": w[1], "wt": w.t(),
            "grad": torch.zeros(3, requires_grad=True), "alone": torch.full((2,), 7.0),
            "tied": [p, p], "np": np.arange(3)}


def check_shared(out: dict[str, Any]) -> None:
    want = shared_state()
    assert type(out["param"]) is torch.nn.Parameter and out["param"].requires_grad
    assert type(out["plain"]) is torch.Tensor and not out["plain"].requires_grad
    assert out["plain"].untyped_storage().data_ptr() == out["param"].untyped_storage().data_ptr()
    assert out["tied"][0] is out["tied"][1] is out["param"]
    assert type(out["grad"]) is torch.Tensor and out["grad"].requires_grad and out["grad"].is_leaf
    assert not out["alone"].requires_grad and not out["w"].requires_grad
    for k in ("w", "row", "wt", "alone", "plain"):
        assert torch.equal(out[k], want[k]) and out[k].shape == want[k].shape, k
    assert out["wt"].stride() == (1, 4)
    # The views share one storage again: a write through one shows through the others.
    out["w"][1, 2] = -1.0
    assert out["row"][2] == -1.0 and out["wt"][2, 1] == -1.0


def test_types_and_shared_storage_round_trip_through_the_store(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        s.save(shared_state(), step=1)
        m = s.manifest()
    # w, row and wt are one array; param and plain another (nothing is stored twice).
    assert sorted(t.name for t in m.tensors) == ["alone", "grad", "np", "param", "w"]
    check_shared(ckptstore.load(url))


def test_types_and_shared_storage_round_trip_through_the_writer(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with Checkpointer(url, options=WriterOptions(mode="thread")) as ck:
        ck.cut(1, shared_state(), final=True)
    check_shared(ckptstore.load(url))


@pytest.mark.parametrize("view", [
    {"offset": 10, "shape": [4], "stride": [1]},  # reaches past the 12 elements
    {"offset": 0, "shape": [3, 5], "stride": [4, 1]},
    {"offset": -1, "shape": [2], "stride": [1]},
    {"offset": 0, "shape": [2], "stride": [1], "extra": 1},
    {"offset": 0, "shape": [True], "stride": [1]},
], ids=["past-end", "2d-past-end", "negative", "extra-field", "bool"])
def test_a_hostile_view_is_refused_naming_the_cut(tmp_path: Path, view: dict[str, Any]) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as s:
        cut = s.save(shared_state(), step=1).id

    def plant(doc: dict[str, Any]) -> None:
        for item in doc["tree"]["items"]:
            if item["k"] == "row":
                item["v"]["view"] = view

    rewrite_manifest(url, cut, plant)
    before = snapshot(tmp_path / "store")
    with pytest.raises(CorruptCut) as ei:
        ckptstore.load(url)
    assert ei.value.store == url and ei.value.cut == cut and "view" in str(ei.value)
    # what load refuses, verify refuses (issue 10, item 8): the same check, without torch
    with Store.open(url, readonly=True) as s:
        report = s.verify()
    assert [(f.kind, f.cut) for f in report.errors] == [("tree-invalid", cut)] and "view" in report.errors[0].message
    assert snapshot(tmp_path / "store") == before
