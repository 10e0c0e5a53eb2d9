"""The README's Python snippets run as written, the way a newcomer runs them: pasted in order into one
script, in a fresh directory (they name relative store paths), run, then run again (each run in a
fresh namespace). A snippet that
drifts from the API, leaves its store open, cannot be rerun (StepConflict) or ends a finished loop
without a final cut (``resume-info`` saying "interrupted") fails here, not for a user (issue 10,
item 19)."""

from __future__ import annotations

import json
import os
import re

import ckptstore
from ckptstore import cli

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def readme_script() -> str:
    blocks = python_blocks(open(README, encoding="utf-8").read())
    assert len(blocks) >= 2, "the README lost its snippets (or this parser broke)"
    return "\n".join(blocks)


def test_readme_snippets_pasted_into_one_script_run_twice(tmp_path, monkeypatch, capsys):
    script = tmp_path / "readme_script.py"
    script.write_text(readme_script(), encoding="utf-8")
    monkeypatch.chdir(tmp_path)

    # First run in this process (torch is imported already), in a fresh namespace, as one script.
    ns: dict = {"__name__": "__main__"}
    exec(compile(script.read_text(encoding="utf-8"), str(script), "exec"), ns)  # noqa: S102 - our own README
    # What the first snippet claims: the cut is saved, verified and loads back.
    assert ns["info"].step == 120 and ns["report"].ok
    assert set(ns["model_only"]) == {"model"} and ckptstore.load("ckpt/run1")["step"] == 120
    with ckptstore.Store.open("ckpt/run2", readonly=True) as store:
        steps = [c.step for c in store.cuts()]
        # Periodic cuts may be skipped while one is in flight (busy="skip"); the final one never is.
        assert steps[-1] == 200 and len(steps) <= 3 and set(steps) <= {50, 100, 150, 200}
        assert store.latest().final and store.verify().ok
        assert store.load()["step"] == 200
        first_run = [c.id for c in store.cuts()]

    # The rerun: the same script in a fresh namespace. In this process, so a store the first run left
    # open fails it with StoreLocked (flock locks are per open file, and the test spends no second torch
    # import); a reused step fails it with StepConflict.
    exec(compile(script.read_text(encoding="utf-8"), str(script), "exec"), {"__name__": "__main__"})  # noqa: S102

    with ckptstore.Store.open("ckpt/run1", readonly=True) as store:
        assert [c.step for c in store.cuts()] == [120, 240] and store.verify().ok
    with ckptstore.Store.open("ckpt/run2", readonly=True) as store:
        # Finished already: the rerun restores step 200 and takes no further cut.
        assert [c.id for c in store.cuts()] == first_run and store.latest().final

    capsys.readouterr()
    assert cli.main(["resume-info", "ckpt/run2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["finished"] is True and doc["healthy"] is True and doc["resume_step"] == 200
    assert cli.main(["resume-info", "ckpt/run2"]) == 0
    text = capsys.readouterr().out
    assert "run finished" in text and "interrupted" not in text, text
