"""Fixtures shared by the integration tests: one fork server per framework and session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .forkkit import Server


@pytest.fixture(scope="session")
def hf_server():
    """``hf_trainer.py --serve``: transformers imported once for every Hugging Face run of the session."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    server = Server(Path(__file__).with_name("hf_trainer.py"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def lightning_server():
    """``lightning_ddp.py --serve``: Lightning imported once for every DDP rank of the session."""
    pytest.importorskip("lightning")
    server = Server(Path(__file__).with_name("lightning_ddp.py"))
    yield server
    server.close()
