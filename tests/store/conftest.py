"""Fixtures shared by the store tests: a fresh store in a tmp dir, opened as its writer."""

from __future__ import annotations

from typing import Iterator

import pytest

from ckptstore import Store


@pytest.fixture
def store_url(tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store.open(store_url, create=True)
    try:
        yield s
    finally:
        s.close()
