"""File surgery shared by the corruption tests: damage a stored file the way a disk or a person would."""

from __future__ import annotations

import contextlib
from typing import Iterator


def flip_byte(path: str, offset: int) -> None:
    """Inverts every bit of the byte at ``offset`` (negative: from the end) in place."""
    with open(path, "r+b") as f:
        f.seek(offset, 0 if offset >= 0 else 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def snapshot(url: str) -> dict[str, str]:
    """Every file under a store root (the writer lock's own records aside) and the blake3 of its bytes:
    compared before and after, it proves nothing committed or foreign changed."""
    import os

    from ckptstore.hashing import digest

    out = {}
    for root, _dirs, files in os.walk(url):
        for name in files:
            if name in (".writer.lock", "WRITER.json"):
                continue
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, url)] = digest(f.read())
    return out


def write_manifest(url: str, cut: str, data: bytes) -> None:
    """Replaces a committed cut's manifest bytes; LATEST's manifest hash follows when LATEST names the
    cut, so only the manifest's content is wrong (an old cut's manifest has no hash outside itself)."""
    import json
    import os

    from ckptstore.hashing import digest

    with open(os.path.join(url, "cuts", cut, "MANIFEST.json"), "wb") as f:
        f.write(data)
    latest = os.path.join(url, "LATEST")
    doc = json.loads(open(latest, "rb").read())
    if doc["cut"] == cut:
        doc["manifest_blake3"] = digest(data)
        with open(latest, "w") as f:
            json.dump(doc, f)


def as_rows(doc: dict) -> dict:
    """A format 4 manifest document made format 2 in place (its tensor table as rows, the same records):
    the form the damage tests edit field by field. Version 4's own table is refused by the tests of
    tests/hostile/test_manifest_table.py. Other versions are returned as they are."""
    if doc.get("format_version") == 4:
        from ckptstore.records import records_to_rows, table_to_records

        doc["tensors"] = records_to_rows(table_to_records(doc["tensors"], [f["name"] for f in doc["files"]]))
        doc["format_version"] = 2
    return doc


def rewrite_manifest(url: str, cut: str, mutate, *, indent: int | None = None) -> None:  # noqa: ANN001
    """Applies ``mutate`` to a committed manifest's JSON (it may return raw bytes instead), written
    compact (or with ``indent``), through :func:`write_manifest`. A format 4 manifest is handed to
    ``mutate`` as format 2 (:func:`as_rows`)."""
    import json
    import os

    doc = as_rows(json.loads(open(os.path.join(url, "cuts", cut, "MANIFEST.json"), "rb").read()))
    res = mutate(doc)
    if isinstance(res, bytes):
        data = res
    elif indent is None:
        data = json.dumps(doc, separators=(",", ":")).encode()
    else:
        data = json.dumps(doc, indent=indent).encode()
    write_manifest(url, cut, data)



@contextlib.contextmanager
def mounted_tmpfs(path: str, size: str) -> Iterator[str]:
    """A real size-limited tmpfs mounted at ``path`` (made if missing) while the context lasts: a file
    system that really fills up (ENOSPC from the kernel, not from a wrapper). Skips the test where
    mounting is not allowed (not root, no tmpfs)."""
    import os
    import subprocess

    import pytest

    os.makedirs(path, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False, timeout=30)
