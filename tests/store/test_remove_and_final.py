"""Removing one cut (``Store.remove``, ``ckptstore rm``) under prune's rules, and marking a committed cut
final without writing it again (``Store.mark_final``), issue 13."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import ckptstore
from ckptstore import layout
from ckptstore.cli import main as cli
from filekit import flip_byte


def _store(tmp_path, steps=(1, 2, 3), save_kw=None):
    url = str(tmp_path / "store")
    with ckptstore.Store.open(url, create=True) as s:
        for st in steps:
            s.save({"a": np.arange(4) + st}, step=st, **(save_kw or {}).get(st, {}))
    return url


def _steps(url: str) -> list[int]:
    with ckptstore.Store.open(url, readonly=True) as s:
        return [c.step for c in s.cuts()]


def test_remove_one_cut_by_step_or_id_and_dry_run_changes_nothing(tmp_path, capsys):
    url = _store(tmp_path)
    with ckptstore.Store.open(url) as s:
        one = s.cuts()[0]
        before = sorted(os.listdir(os.path.join(url, "cuts")))
        assert s.remove(1, dry_run=True).id == one.id
        assert sorted(os.listdir(os.path.join(url, "cuts"))) == before
        assert s.remove(one.id).step == 1
    assert _steps(url) == [2, 3] and not os.path.exists(os.path.join(url, "cuts", one.id))
    capsys.readouterr()
    assert cli(["rm", url, "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"]["step"] == 2
    assert _steps(url) == [3] and cli(["verify", url]) == 0


@pytest.mark.parametrize("what,match", [("latest", "never removed"), (3, "LATEST's target"), (2, "tagged 'keep'")])
def test_remove_refuses_latest_and_pinned_cuts_by_name(tmp_path, what, match):
    url = _store(tmp_path, save_kw={2: {"tags": ["keep"]}})
    with ckptstore.Store.open(url) as s:
        with pytest.raises(ckptstore.UsageError, match=match) as exc:
            s.remove(what)
        assert url in str(exc.value)
    assert _steps(url) == [1, 2, 3]
    assert cli(["rm", url, "3"]) == 2  # one line, exit 2: nothing removed


def test_remove_never_takes_the_last_cut_that_verifies(tmp_path):
    """LATEST's cut is silently corrupt: removing the newest cut that still verifies is refused, as a
    prune would refuse it (issue 10, item 5); --no-verify is the explicit opt-out."""
    url = _store(tmp_path)
    with ckptstore.Store.open(url, readonly=True) as s:
        latest = s.manifest()
    flip_byte(os.path.join(url, "cuts", latest.cut, latest.files[0].name), -1)
    with ckptstore.Store.open(url) as s:
        with pytest.raises(ckptstore.CorruptCut, match="newest cut that verifies"):
            s.remove(2)
        assert s.remove(1).step == 1  # an older one goes: step 2 still verifies
    assert _steps(url) == [2, 3]
    assert cli(["rm", url, "2", "--no-verify"]) == 0 and _steps(url) == [3]


def test_mark_final_marks_the_latest_cut_without_writing_it_again(tmp_path, capsys):
    url = _store(tmp_path)
    with ckptstore.Store.open(url) as s:
        m = s.manifest()
        manifest_bytes = open(os.path.join(url, layout.manifest_path(m.cut)), "rb").read()
        latest_bytes = open(os.path.join(url, layout.LATEST_FILE), "rb").read()
        assert not s.latest().final
        info = s.mark_final()
        assert info.final and info.id == m.cut
        assert s.mark_final().final  # idempotent
        assert [c.final for c in s.cuts()] == [False, False, True]
    # the commit is untouched: same manifest, same LATEST; one durable mark beside them
    assert open(os.path.join(url, layout.manifest_path(m.cut)), "rb").read() == manifest_bytes
    assert open(os.path.join(url, layout.LATEST_FILE), "rb").read() == latest_bytes
    assert os.listdir(os.path.join(url, layout.FINAL_DIR)) == [f"{m.cut}.json"]
    capsys.readouterr()
    assert cli(["resume-info", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finished"] is True
    assert cli(["verify", url]) == 0
    # KeepFinal keeps it, as it keeps a cut written final
    with ckptstore.Store.open(url) as s:
        s.save({"a": np.arange(4)}, step=4)
        removed = s.prune(ckptstore.KeepLast(1) | ckptstore.KeepFinal())
        assert [c.step for c in removed] == [1, 2] and [c.step for c in s.cuts()] == [3, 4]


def test_a_final_mark_goes_with_its_cut_and_a_stale_one_is_collected(tmp_path, capsys):
    url = _store(tmp_path)
    with ckptstore.Store.open(url) as s:
        s.mark_final(2)
        s.remove(2)
        assert os.listdir(os.path.join(url, layout.FINAL_DIR)) == []
    # a crash between a prune's uncommit and the mark's removal leaves a stale mark: gc reports and removes it
    stale = os.path.join(url, layout.final_path("step-000000000002-0badc0de"))
    with open(stale, "w") as f:
        json.dump({"kind": "ckptstore.final", "format_version": 1, "cut": "step-000000000002-0badc0de", "step": 2,
                   "marked_at": "2026-11-30T00:00:00+00:00"}, f)
    capsys.readouterr()
    assert cli(["gc", url, "--json"]) == 0
    removed = json.loads(capsys.readouterr().out)["removed"]
    assert [r["kind"] for r in removed] == ["stale-final-mark"] and not os.path.exists(stale)
    assert _steps(url) == [1, 3]


def test_a_symlinked_final_directory_is_refused(tmp_path):
    url = _store(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "step-000000000002-0badc0de.json").write_text("{}")
    assert not os.path.exists(os.path.join(url, layout.FINAL_DIR))  # created by the first mark only
    os.symlink(outside, os.path.join(url, layout.FINAL_DIR))
    with pytest.raises(ckptstore.HostileInput, match="final"):
        ckptstore.Store.open(url).close()
    assert (outside / "step-000000000002-0badc0de.json").read_text() == "{}"


def test_labels_move_atomically_go_with_their_cut_and_stale_or_broken_ones_are_collected(tmp_path, capsys):
    from ckptstore.labels import Label, label_path

    url = _store(tmp_path)
    with ckptstore.Store.open(url) as s:
        one, two, three = (c.id for c in s.cuts())
        s.label("best.ckpt", 1)
        s.label("last.ckpt")
        s.label("best.ckpt", 2)  # moved: one file replaced, never two labels of one name
        assert s.labels() == {"best.ckpt": two, "last.ckpt": three}
        assert len(os.listdir(os.path.join(url, layout.LABELS_DIR))) == 2
        s.remove(2)  # its label goes with it
        assert s.labels() == {"last.ckpt": three}
        assert s.unlabel("last.ckpt") == three and s.unlabel("last.ckpt") is None
        assert [c.id for c in s.cuts()] == [one, three]  # unlabel never removes a cut
    # a label of a cut that is gone (a crash between a remove and its labels) and a file whose label does
    # not hash to its name: both reported and collected, never followed
    stale = Label(label="ghost", cut="step-000000000009-00000000", step=9, labeled_at="x")
    with open(os.path.join(url, label_path("ghost")), "wb") as f:
        f.write(stale.to_bytes())
    forged = Label(label="forged", cut=one, step=1, labeled_at="x")
    with open(os.path.join(url, label_path("not-forged")), "wb") as f:
        f.write(forged.to_bytes())
    with ckptstore.Store.open(url, readonly=True) as s:
        assert s.labels() == {}
    capsys.readouterr()
    assert cli(["gc", url, "--json"]) == 0
    kinds = sorted(r["kind"] for r in json.loads(capsys.readouterr().out)["removed"])
    assert kinds == ["broken-label", "stale-label"] and os.listdir(os.path.join(url, layout.LABELS_DIR)) == []
    assert _steps(url) == [1, 3]
