"""The README's Python snippets run as written, in order, in one namespace (in a fresh directory, since
they name relative store paths): a snippet that drifts from the API fails here, not for a user."""

from __future__ import annotations

import os
import re

import ckptstore

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_python_snippets_run_as_written(tmp_path, monkeypatch):
    blocks = python_blocks(open(README, encoding="utf-8").read())
    assert len(blocks) >= 2, "the README lost its snippets (or this parser broke)"
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), ns)  # noqa: S102 - our own README
        if i == 0:  # what the first snippet claims: the cut is saved, verified and loads back
            assert ns["info"].step == 120 and ns["report"].ok
            assert ns["state"]["step"] == 120 and set(ns["model_only"]) == {"model"}
    with ckptstore.Store.open("ckpt/run2", readonly=True) as store:
        steps = [c.step for c in store.cuts()]
        # Periodic cuts may be skipped while one is in flight (busy="skip"); the final one never is.
        assert steps[-1] == 200 and len(steps) <= 3 and set(steps) <= {50, 100, 150, 200}
        assert store.latest().final and store.verify().ok
        assert store.load()["step"] == 200
