"""Only the exact temp names the store writes are its own (issue 10, item 3): a user's ``.tmp-*`` file
is never deleted, and a ``.tmp-*`` directory never breaks a writer open."""

from __future__ import annotations

import os

import ckptstore
from ckptstore import layout


def test_only_our_exact_temp_names_are_ours():
    assert layout.is_tmp_name(layout.tmp_name("LATEST"))
    assert layout.is_tmp_name(layout.tmp_name("MANIFEST.json"))
    assert layout.is_tmp_name(layout.tmp_name("step-000000000001-0a0b0c0d.json"))
    assert layout.is_tmp_name(layout.tmp_name("rank00003.json"))
    for foreign in (".tmp-notes.txt", ".tmp-", ".tmp-0123456789ab-notes.txt", ".tmp-XYZ-LATEST",
                    ".tmp-0123456789ab-", ".tmp-0123456789ab-../LATEST"):
        assert not layout.is_tmp_name(foreign), foreign


def test_user_tmp_files_and_tmp_directories_survive_writer_open(tmp_path):
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        store.save({"a": 1}, step=1)
    ours = os.path.join(url, layout.tmp_name("LATEST"))
    open(ours, "wb").close()  # a crash leftover of ours: removed on open
    notes = os.path.join(url, ".tmp-notes.txt")
    with open(notes, "w") as f:
        f.write("mine")
    tmp_dir = os.path.join(url, layout.CUTS_DIR, ".tmp-0123456789ab-MANIFEST.json")
    os.makedirs(tmp_dir)  # a directory with our temp pattern: not a file we wrote
    with ckptstore.Store.open(url) as store:  # writer open: recovery
        assert store.latest().step == 1
        report = store.verify()
        assert report.ok
        foreign = {f.path for f in report.findings if f.kind == "foreign"}
    assert not os.path.exists(ours)
    assert open(notes).read() == "mine" and os.path.isdir(tmp_dir)
    assert {".tmp-notes.txt", "cuts/.tmp-0123456789ab-MANIFEST.json"} <= foreign


LABEL_CRASH = """
import os, signal, sys
import ckptstore
real = os.replace
def replace(src, dst, *a, **kw):
    if "/labels/" in str(dst):  # the label's temp file is written and fsynced: die before the rename
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *a, **kw)
os.replace = replace
with ckptstore.Store.open(sys.argv[1]) as store:
    store.label("last.ckpt")
"""


def test_a_crash_inside_label_leaves_a_temp_file_that_recovery_removes(tmp_path):
    """Issue 20: label file names were built outside layout.py, so the temp file of a label write that
    crashed read as foreign and gc never removed it."""
    import signal
    import subprocess
    import sys

    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as store:
        store.save({"a": 1}, step=1)
    proc = subprocess.run([sys.executable, "-c", LABEL_CRASH, url], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    [left] = os.listdir(os.path.join(url, layout.LABELS_DIR))
    assert layout.is_tmp_name(left)
    with ckptstore.Store.open(url, readonly=True) as ro:
        cls = ro.classify()
        assert [lo.kind for lo in cls.leftovers] == ["temp-file"]
        assert not [f for f in ro.verify().findings if f.kind == "foreign"]
    with ckptstore.Store.open(url) as store:  # a writer open's recovery removes it
        assert os.listdir(os.path.join(url, layout.LABELS_DIR)) == []
        assert store.labels() == {}
        store.label("last.ckpt")
        assert store.labels() == {"last.ckpt": store.latest().id}
