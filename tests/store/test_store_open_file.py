"""Opening a store on a path that is a regular file names the problem (issue 10, item 20)."""

from __future__ import annotations

import pytest

import ckptstore


def test_create_on_a_regular_file_is_a_usage_error_naming_the_path(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(ckptstore.UsageError, match="is a file, not a directory") as ei:
        ckptstore.Store.open(str(path), create=True)
    assert str(path) in str(ei.value)
    assert path.read_text() == "mine"  # nothing touched
    with pytest.raises(ckptstore.StoreNotFound):
        ckptstore.Store.open(str(path), readonly=True)


@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
def test_create_below_a_regular_file_is_a_usage_error_naming_the_file(tmp_path, below):
    """Issue 19 item 14: a path through a regular file raised a raw NotADirectoryError."""
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    url = str(path / below)
    with pytest.raises(ckptstore.UsageError) as ei:
        ckptstore.Store.open(url, create=True)
    assert ei.value.store == url and ei.value.path == str(path)
    assert f"{path} is a file, not a directory" in ei.value.message
    assert path.read_text() == "mine"  # nothing touched
    for kw in ({"readonly": True}, {}):
        with pytest.raises(ckptstore.StoreNotFound):
            ckptstore.Store.open(url, **kw)
