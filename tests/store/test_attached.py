"""Files that belong to a cut (issue 13): ``files=`` copies them at the cut, the manifest lists them,
``verify`` checks them, ``show`` lists them and ``restore_files`` puts them back, exactly, and only
under the directory it is given."""

from __future__ import annotations

import errno
import json
import os
import stat

import numpy as np
import pytest

import ckptstore
from ckptstore import Store
from ckptstore.attached import open_sources
from ckptstore.cli import main
from ckptstore.errors import CorruptCut, ManifestError, UnsupportedValue, UsageError
from ckptstore.writer import Checkpointer
from filekit import flip_byte, mounted_tmpfs, rewrite_manifest, snapshot


def tree_of(root: str) -> dict[str, bytes]:
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.fixture
def src(tmp_path) -> str:
    """A config file and a state directory (a data ledger with a nested journal)."""
    root = tmp_path / "src"
    (root / "ledger" / "journal").mkdir(parents=True)
    (root / "config.yaml").write_text("lr: 0.1\n")
    (root / "ledger" / "offsets.bin").write_bytes(np.random.default_rng(0).bytes(300_000))
    (root / "ledger" / "journal" / "000.log").write_text("opened shard 0\n")
    (root / "ledger" / "empty").write_bytes(b"")
    return str(root)


def test_files_are_saved_listed_verified_and_restored_exactly(store, src, tmp_path):
    info = store.save({"w": np.arange(4.0)}, step=1,
                      files=[os.path.join(src, "config.yaml"), os.path.join(src, "ledger")])
    m = store.manifest()
    assert [(a.path, a.nbytes) for a in m.attached] == [
        ("config.yaml", 8), ("ledger/empty", 0), ("ledger/journal/000.log", 15), ("ledger/offsets.bin", 300_000)]
    assert info.id == m.cut
    # The state comes back without them; they come back through restore_files.
    back = store.load()
    assert list(back) == ["w"] and np.array_equal(back["w"], np.arange(4.0))
    written = store.restore_files(to=str(tmp_path / "out"))
    assert sorted(os.path.relpath(p, tmp_path / "out") for p in written) == sorted(a.path for a in m.attached)
    assert tree_of(str(tmp_path / "out")) == tree_of(src)
    assert store.verify().ok


def test_a_mapping_names_the_stored_paths_and_a_cut_without_files_writes_no_attached_field(store, src, tmp_path):
    store.save({"w": np.zeros(2)}, step=1)
    raw = json.loads(open(os.path.join(store.storage.local_path(""), "cuts", store.latest().id, "MANIFEST.json")).read())
    assert "attached" not in raw  # readers that predate attached files read such cuts as before
    store.save({"w": np.zeros(2)}, step=2, files={"run/cfg.yaml": os.path.join(src, "config.yaml")})
    assert [a.path for a in store.manifest().attached] == ["run/cfg.yaml"]
    store.restore_files(to=str(tmp_path / "out"))
    assert open(tmp_path / "out" / "run" / "cfg.yaml").read() == "lr: 0.1\n"
    assert store.restore_files(1, to=str(tmp_path / "none")) == []


def test_the_checkpointer_copies_files_at_the_cut_not_at_the_write(tmp_path, src):
    """maybe_cut returns once the files are in the block: rewriting them right after must not change the
    cut, whether the writer process or the commit thread writes it."""
    url = str(tmp_path / "store")
    cfg = os.path.join(src, "config.yaml")
    os.chmod(cfg, 0o640)  # the mode travels with the bytes through the block (issue 19 item 8)
    for mode in ("process", "thread", "inline"):
        events: list[dict] = []
        with Checkpointer(url, every=1, mode=mode, on_event=events.append) as ck:
            base = (ck.store.latest().step + 1) if ck.store.latest() else 0
            for step in range(base, base + 3):
                with open(cfg, "w") as f:
                    f.write(f"step {step}\n")
                h = ck.maybe_cut(step, {"step": step}, files=[cfg, os.path.join(src, "ledger")])
                with open(cfg, "w") as f:  # the trainer moves on at once
                    f.write("a later step's config\n")
                if h is not None:
                    h.wait(60)
        captured = [e for e in events if e["event"] == "captured"]
        assert [(e["tensors"], e["attached_files"]) for e in captured] == [(0, 4)] * 3
        assert all(e["bytes"] == 7 + 300_000 + 15 for e in captured)
        with Store.open(url, readonly=True) as store:
            for c in store.cuts():
                out = tmp_path / f"out-{c.id}"
                store.restore_files(c.id, to=str(out))
                assert open(out / "config.yaml").read() == f"step {c.step}\n", mode
                assert stat.S_IMODE(os.stat(out / "config.yaml").st_mode) == 0o640, mode
                assert (out / "ledger" / "offsets.bin").read_bytes() == open(
                    os.path.join(src, "ledger", "offsets.bin"), "rb").read()
            assert store.verify().ok


def test_a_damaged_attached_file_fails_verify_and_restore_by_name(store, src, tmp_path):
    payload = b"journal line that is easy to find\n" * 3
    with open(os.path.join(src, "journal.txt"), "wb") as f:
        f.write(payload)
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "journal.txt")])
    cut = store.latest().id
    shard = os.path.join(store.storage.local_path(""), "cuts", cut, store.manifest().files[0].name)
    flip_byte(shard, open(shard, "rb").read().index(payload) + 5)
    report = store.verify()
    assert not report.ok and any(f.cut == cut for f in report.findings)
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.txt").write_text("the run's own journal\n")
    with pytest.raises(CorruptCut) as ei:
        store.restore_files(to=str(out))
    assert cut in str(ei.value) and "~files/journal.txt" in str(ei.value), str(ei.value)
    # The damaged bytes never replace anything, and no temporary file is left behind.
    assert os.listdir(out) == ["journal.txt"] and (out / "journal.txt").read_text() == "the run's own journal\n"


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../b", "a//b", "./a", "a\\b", "a\x00b", ""])
def test_a_hostile_attached_path_is_refused_on_parse(store, src, path):
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "config.yaml")])
    cut = store.latest().id
    url = store.storage.local_path("")

    def mutate(doc):
        doc["attached"][0]["path"] = path
        doc["tensors"] = [dict(t, name="~files/" + path) if t["name"].startswith("~files/") else t
                          for t in doc["tensors"]]

    rewrite_manifest(url, cut, mutate)
    with Store.open(url, readonly=True) as reader:
        with pytest.raises(ManifestError) as ei:
            reader.restore_files(cut, to=os.path.join(url, "..", "out"))
        assert cut in str(ei.value)


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d["attached"].append(dict(d["attached"][0], path="config.yaml/inner")), "both a file and a directory"),
    (lambda d: d["attached"].append(dict(d["attached"][0])), "listed twice"),
    (lambda d: d["attached"][0].update(nbytes=9), "not numpy |u1[9]"),
    (lambda d: d["attached"][0].update(path="other"), "has no array"),
    (lambda d: d["attached"][0].update(mode=0o4755), "mode 0o4755"),  # issue 19 item 8: never setuid
    (lambda d: d["attached"][0].update(mode=-1), "mode -0o1"),
])
def test_an_attached_listing_that_disagrees_with_its_arrays_is_refused(store, src, mutate, why):
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "config.yaml")])
    cut = store.latest().id
    url = store.storage.local_path("")
    rewrite_manifest(url, cut, mutate)
    with Store.open(url, readonly=True) as reader:
        with pytest.raises(ManifestError, match=why.replace("|", r"\|").replace("[", r"\[")):
            reader.manifest(cut)


def test_restore_never_writes_through_a_symlink_in_the_target(store, src, tmp_path):
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "ledger")])
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "out"
    target.mkdir()
    os.symlink(outside, target / "ledger")
    before = snapshot(str(outside))
    with pytest.raises(UsageError, match="not a directory"):
        store.restore_files(to=str(target))
    assert snapshot(str(outside)) == before == {}


def test_without_overwrite_every_existing_file_is_named_and_nothing_is_written(store, src, tmp_path):
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "config.yaml"), os.path.join(src, "ledger")])
    out = tmp_path / "out"
    (out / "ledger").mkdir(parents=True)
    (out / "config.yaml").write_text("mine\n")
    (out / "ledger" / "empty").write_text("mine too\n")
    with pytest.raises(UsageError) as ei:
        store.restore_files(to=str(out), overwrite=False)
    assert "config.yaml" in str(ei.value) and "ledger/empty" in str(ei.value)
    assert sorted(tree_of(str(out))) == ["config.yaml", "ledger/empty"]
    # The default replaces them (a resume wants the cut's journal, not the one that ran on) and leaves
    # files the cut does not hold alone.
    (out / "notes.txt").write_text("keep\n")
    store.restore_files(to=str(out))
    assert open(out / "config.yaml").read() == "lr: 0.1\n"
    assert open(out / "notes.txt").read() == "keep\n"


def test_what_cannot_be_attached_is_refused_all_at_once(tmp_path, src, store):
    os.mkfifo(os.path.join(src, "ledger", "pipe"))
    os.symlink(os.path.join(src, "ledger", "journal"), os.path.join(src, "ledger", "linked-dir"))
    os.symlink(os.path.join(src, "config.yaml"), os.path.join(src, "ledger", "linked-file"))  # followed: fine
    with pytest.raises(UnsupportedValue) as ei:
        store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "ledger")])
    msg = str(ei.value)
    assert "pipe: a FIFO" in msg and "linked-dir: a symlink to a directory" in msg and "linked-file" not in msg
    with pytest.raises(UsageError, match="does not exist"):
        store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "missing.txt")])
    with pytest.raises(UsageError, match="listed twice"):
        store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "config.yaml")] * 2)
    with pytest.raises(UsageError, match="not a relative path"):
        store.save({"w": np.zeros(2)}, step=1, files={"../up": os.path.join(src, "config.yaml")})
    assert store.latest() is None  # nothing was committed by any refused save


def test_a_file_that_changes_size_while_it_is_read_is_refused(tmp_path):
    p = tmp_path / "growing.log"
    p.write_bytes(b"x" * 1000)
    for change, word in ((b"more", "grew"), (None, "shrank")):
        [s] = open_sources([str(p)], where={"store": "s"})
        try:
            if change is None:
                os.truncate(p, 10)
            else:
                with open(p, "ab") as f:
                    f.write(change)
            with pytest.raises(UsageError, match=word):
                s.item(where={"store": "s"})
        finally:
            os.close(s.fd)
        p.write_bytes(b"x" * 1000)


def test_show_lists_them_and_restore_files_puts_them_back_from_the_command_line(store, src, tmp_path, capsys):
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "config.yaml")])
    url = store.storage.local_path("")
    assert main(["show", url, "--files"]) == 0
    out = capsys.readouterr().out
    assert "attached  1 file(s)" in out and "config.yaml" in out
    assert main(["show", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    src_mode = stat.S_IMODE(os.stat(os.path.join(src, "config.yaml")).st_mode)
    assert doc["attached"] == [{"path": "config.yaml", "rank": 0, "nbytes": 8, "mode": src_mode}]
    assert main(["restore-files", url, "--to", str(tmp_path / "cli"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["written"] == [str(tmp_path / "cli" / "config.yaml")]
    assert main(["restore-files", url, "--to", str(tmp_path / "cli"), "--no-overwrite"]) == 2
    assert "exist" in capsys.readouterr().err
    assert stat.S_IMODE(os.stat(tmp_path / "cli" / "config.yaml").st_mode) == src_mode


def test_restore_puts_the_files_back_with_the_state(tmp_path, src):
    """The one-call resume: ckptstore.restore(..., files_to=) restores the state and the cut's files."""
    import torch

    url = str(tmp_path / "store")
    model = torch.nn.Linear(3, 2)
    journal = os.path.join(src, "ledger", "journal", "000.log")
    with Checkpointer(url, every=1) as ck:
        for step in (1, 2):
            with open(journal, "a") as f:
                f.write(f"step {step} done\n")
            ck.cut(step, ckptstore.training_state(step=step, model=model), files=[os.path.join(src, "ledger")]).wait(60)
        with open(journal, "a") as f:
            f.write("step 3 started, then the job died\n")
    fresh = torch.nn.Linear(3, 2)
    resumed = ckptstore.restore(url, model=fresh, files_to=str(tmp_path / "work"))
    assert resumed is not None and resumed.step == 2
    assert torch.equal(fresh.weight, model.weight)
    assert open(tmp_path / "work" / "ledger" / "journal" / "000.log").read() == (
        "opened shard 0\nstep 1 done\nstep 2 done\n")


RSS_CHILD = """
import resource, sys
import ckptstore
store = ckptstore.Store.open(sys.argv[1], readonly=True)
store.manifest()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
store.restore_files(to=sys.argv[2])
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_restoring_a_large_file_streams_it_through_bounded_memory(store, tmp_path):
    """A 160 MiB attached file is restored through the reader's 8 MiB buffer: the restoring process's
    peak RSS grows by far less than the file (measured in a child process, in KiB)."""
    import subprocess
    import sys

    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for i in range(20):
            f.write(bytes([i]) * (8 << 20))
    store.save({"w": np.zeros(2)}, step=1, files=[str(big)])
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, store.storage.local_path(""), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert after - before < 48 * 1024, f"peak RSS grew by {(after - before) // 1024} MiB restoring 160 MiB"
    assert (tmp_path / "out" / "big.bin").stat().st_size == 160 << 20
    with open(tmp_path / "out" / "big.bin", "rb") as f:
        assert all(f.read(8 << 20) == bytes([i]) * (8 << 20) for i in range(20))


def test_attached_files_go_with_their_cut_when_it_is_pruned(store, src):
    for step in range(1, 4):
        store.save({"w": np.zeros(2)}, step=step, files=[os.path.join(src, "ledger")])
    store.prune(ckptstore.KeepLast(1))
    [only] = store.cuts()
    assert only.step == 3 and store.verify().ok
    assert len(os.listdir(os.path.join(store.storage.local_path(""), "cuts"))) == 1


# ------------------------------------------------------------------- issue 19 items 4, 8, 9: the restore side
#: Stored names of NAME_MAX (255) bytes that are far fewer characters: the restore's temporary name
#: must be cut in bytes (issue 19 item 4).
LONG_NAMES = {"数" * 85: b"a tokenizer", "run/" + "é" * 127 + "x": b"a journal"}


def _restore_via(via: str, store: Store, to: str) -> None:
    if via == "restore_files":
        store.restore_files(to=to)
    elif via == "restore":
        ckptstore.restore(store, files_to=to)
    else:
        assert main(["restore-files", store.storage.local_path(""), "--to", to]) == 0


@pytest.mark.parametrize("via", ["restore_files", "restore", "cli"])
def test_a_multibyte_name_of_name_max_bytes_is_restored_by_every_restore_path(store, tmp_path, via):
    """Issue 19 item 4: a legal name of 228-255 bytes saved fine, then every restore failed with a raw
    ENAMETOOLONG because the temporary name beside it was cut at 200 characters, not bytes."""
    src = tmp_path / "src"
    src.mkdir()
    files = {}
    for i, (name, data) in enumerate(LONG_NAMES.items()):
        (src / f"f{i}").write_bytes(data)
        files[name] = str(src / f"f{i}")
    assert all(len(n.split("/")[-1].encode()) == 255 for n in files)
    store.save({"w": np.zeros(2)}, step=1, files=files)
    out = tmp_path / "out"
    _restore_via(via, store, str(out))
    assert tree_of(str(out)) == LONG_NAMES  # and no temporary file is left beside them


def _make_modes(root) -> dict[str, int]:  # noqa: ANN001
    modes = {"token": 0o600, "run.sh": 0o755, "frozen.cfg": 0o444, "group.txt": 0o664, "suid.sh": 0o4755}
    root.mkdir()
    for name, mode in modes.items():
        (root / name).write_text(name)
        os.chmod(root / name, mode)
    return modes


def test_restored_files_keep_their_permission_bits_and_lose_setuid(store, tmp_path):
    """Issue 19 item 8: every restored file used to be 0644 minus the umask (a 0600 token became
    world-readable, a script lost its execute bit). The manifest keeps each file's permission bits and
    the restore sets exactly them, whatever the umask and the mode of the file it replaces; setuid,
    setgid and sticky are not kept."""
    modes = _make_modes(tmp_path / "cfg")
    store.save({"w": np.zeros(2)}, step=1, files=[str(tmp_path / "cfg")])
    assert {a.path: a.mode for a in store.manifest().attached} == {f"cfg/{n}": m & 0o777 for n, m in modes.items()}
    out = tmp_path / "out"
    (out / "cfg").mkdir(parents=True)
    (out / "cfg" / "token").write_text("the old token")
    os.chmod(out / "cfg" / "token", 0o666)
    old = os.umask(0o077)
    try:
        store.restore_files(to=str(out))
    finally:
        os.umask(old)
    got = {n: stat.S_IMODE(os.stat(out / "cfg" / n).st_mode) for n in modes}
    assert got == {n: m & 0o777 for n, m in modes.items()}
    assert (out / "cfg" / "token").read_text() == "token"


def test_a_cut_saved_without_modes_keeps_an_existing_files_mode(store, src, tmp_path):
    """Issue 19 item 8, cuts saved before the manifest kept modes: a file that is replaced keeps its own
    mode; a new one is created 0644 minus the umask, as before."""
    store.save({"w": np.zeros(2)}, step=1, files=[os.path.join(src, "config.yaml"), os.path.join(src, "ledger")])
    url, cut = store.storage.local_path(""), store.latest().id
    rewrite_manifest(url, cut, lambda d: [a.pop("mode", None) for a in d["attached"]])
    assert all(getattr(a, "mode", None) is None for a in store.manifest(cut).attached)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("mine\n")
    os.chmod(out / "config.yaml", 0o600)
    old = os.umask(0o022)
    try:
        store.restore_files(to=str(out))
    finally:
        os.umask(old)
    assert (out / "config.yaml").read_text() == "lr: 0.1\n"
    assert stat.S_IMODE(os.stat(out / "config.yaml").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out / "ledger" / "offsets.bin").st_mode) == 0o644


def test_a_full_disk_under_the_target_raises_a_storage_error_and_changes_nothing(store, tmp_path, capsys):
    """Issue 19 item 9: on a real full file system (a 1 MiB tmpfs) restoring a 2 MiB file raised a bare
    OSError; now every restore path raises StorageError(ENOSPC) naming the store, the cut and the file,
    and what was under the target is left as it was (no temporary file stays)."""
    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    (tmp_path / "big.bin").write_bytes(np.random.default_rng(0).bytes(2 << 20))
    store.save({"w": np.zeros(2)}, step=1, files=[str(tmp_path / "config.yaml"), str(tmp_path / "big.bin")])
    cut = store.latest().id
    with mounted_tmpfs(str(tmp_path / "small"), "1m") as target:
        with open(os.path.join(target, "config.yaml"), "w") as f:
            f.write("the run's own config\n")
        before = snapshot(target)
        for call in (lambda: store.restore_files(to=target), lambda: ckptstore.restore(store, files_to=target)):
            with pytest.raises(ckptstore.StorageError) as ei:
                call()
            e = ei.value
            assert (e.errno, e.store, e.cut, e.path) == (errno.ENOSPC, store.url, cut, os.path.join(target, "big.bin"))
            assert "full" in str(e) and cut in str(e) and "big.bin" in str(e)
            assert snapshot(target) == before
        capsys.readouterr()
        assert main(["restore-files", store.storage.local_path(""), "--to", target]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ckptstore: error:") and "full" in err and "big.bin" in err and "Traceback" not in err
        assert snapshot(target) == before
