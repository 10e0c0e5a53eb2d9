"""The one-process demo (examples/demo.py, the README's first quick-start command) tells the mirror's
story as the README says (issue 21, "README shows the mirror in the quick start"): its cuts reach the
mirror, the local tier is deleted and the same command restores from the mirror bit-identically, writing
the cut back locally, and the audit covers both tiers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ckptstore

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "demo.py")


def resume_info(stdout: str) -> dict:
    """The JSON ``ckptstore resume-info --json`` printed inside the demo's output."""
    text = stdout.split("$ ckptstore resume-info", 1)[1].split("\n", 1)[1]
    return json.JSONDecoder().raw_decode(text)[0]


def test_demo_restores_a_deleted_local_tier_from_the_mirror(tmp_path):
    out = subprocess.run([sys.executable, DEMO, "--steps", "10", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK" in out.stdout
    # The restart after the SIGKILL resumes locally; the replaced node's restart from the mirror.
    assert "resumed from step 5 (" in out.stdout and "), local tier" in out.stdout, out.stdout
    assert "resumed from step 10 (" in out.stdout and "), mirror tier" in out.stdout, out.stdout
    assert "bit-identical to the uninterrupted run: True" in out.stdout
    assert "restored from the mirror bit-identical to the uninterrupted run: True" in out.stdout
    assert "mirrored" in out.stdout  # the ls column
    mirror, local = str(tmp_path / "mirror"), str(tmp_path / "store")
    with ckptstore.Store.open(mirror, readonly=True) as m, ckptstore.Store.open(local, readonly=True) as s:
        # The mirror is an ordinary store holding the final cut; the local tier got it written back.
        assert m.latest().step == 10 and m.latest().final and m.verify().ok
        assert [c.id for c in s.cuts()] == [m.latest().id] and s.verify().ok
    doc = resume_info(out.stdout)
    assert doc["tier"] == "local" and doc["resume_step"] == 10 and doc["finished"] is True
    assert doc["mirror"]["url"] == mirror and doc["mirror"]["lag_steps"] == 0 and doc["mirror"]["lag_cuts"] == 0
