"""Fixtures of the writer tests: a store URL in tmp_path and an event log; every test ends with no
shared-memory block of this process left in /dev/shm."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from ckptstore.writer.shm import leftover_segments
from writerkit import EventLog


@pytest.fixture
def url(tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def log() -> EventLog:
    return EventLog()


@pytest.fixture(autouse=True)
def no_shm_left() -> Iterator[None]:
    before = set(leftover_segments(os.getpid()))
    yield
    left = set(leftover_segments(os.getpid())) - before
    assert not left, f"shared-memory blocks left in /dev/shm: {sorted(left)}"
