"""Zero-copy O_DIRECT shard writes: page-aligned memory goes to the disk without the staging copy, and
the file is byte-identical to one written through the staging buffer, whatever the alignment of the
pieces; a write the kernel refuses falls back to the page cache and still produces the right file."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random

import pytest

from ckptstore import layout
from ckptstore.arrays import ArrayItem
from ckptstore.storage import PosixStorage, buffer_address
from ckptstore.shards import file_order, write_shard

PAGE = 4096


def _direct_io_works(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(os.path.join(path, "probe"))
    return True


@pytest.fixture
def storage(tmp_path) -> PosixStorage:
    if not _direct_io_works(str(tmp_path)):
        pytest.skip("the tmp dir's file system refuses O_DIRECT, so there is no zero-copy path to test")
    os.makedirs(tmp_path / layout.CUTS_DIR / "c1")
    os.makedirs(tmp_path / layout.CUTS_DIR / "c2")
    return PosixStorage(str(tmp_path))


def _aligned_block(sizes: list[int], seed: int) -> tuple[mmap.mmap, list[memoryview]]:
    """One anonymous mapping (page-aligned, like the writer's shared block) with a page-aligned slot per
    size, filled with random bytes."""
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off = -(-(off + n) // PAGE) * PAGE
    block = mmap.mmap(-1, max(off, PAGE))
    rng = random.Random(seed)
    views = []
    for o, n in zip(offsets, sizes):
        block[o : o + n] = rng.randbytes(n)
        views.append(memoryview(block)[o : o + n])
    return block, views


SIZES = [3 * PAGE, 2048, 9 << 20, 8, 1 << 20, 5 * PAGE + 100, 2 * PAGE]


def test_aligned_memory_is_written_without_the_staging_copy(storage: PosixStorage) -> None:
    block, views = _aligned_block([9 << 20], seed=1)
    assert buffer_address(views[0]) % PAGE == 0
    sink = storage.open_sink(layout.cut_file("c1", "f"))
    sink.write(views[0][: 8 << 20])
    sink.write(views[0][8 << 20 :])
    sink.close()
    assert sink.zero_copy_bytes == 9 << 20
    with open(storage.local_path(layout.cut_file("c1", "f")), "rb") as f:
        assert f.read() == bytes(views[0])
    del views
    block.close()


def test_shard_from_aligned_memory_equals_shard_from_copied_bytes(storage: PosixStorage) -> None:
    block, views = _aligned_block(SIZES, seed=2)
    aligned = [ArrayItem(f"t{i}", "numpy", "|u1", (n,), n, v) for i, (n, v) in enumerate(zip(SIZES, views))]
    copied = [ArrayItem(it.name, it.kind, it.dtype, it.shape, it.nbytes, memoryview(bytes(it.data))) for it in aligned]
    rec1, tensors1 = write_shard(storage, "c1", "s.safetensors", 0, aligned)
    rec2, tensors2 = write_shard(storage, "c2", "s.safetensors", 0, copied)
    assert rec1 == rec2 and tensors1 == tensors2
    with open(storage.local_path(layout.cut_file("c1", "s.safetensors")), "rb") as f1, open(
        storage.local_path(layout.cut_file("c2", "s.safetensors")), "rb"
    ) as f2:
        data = f1.read()
        assert data == f2.read()
    # Every array sits at the offset the manifest records, with its own bytes.
    start = 8 + int.from_bytes(data[:8], "little")
    for t in tensors1:
        i = int(t.name[1:])
        assert data[start + t.offset : start + t.offset + t.nbytes] == bytes(views[i])
    del views, aligned
    block.close()


def test_page_multiple_arrays_come_first_in_the_file(storage: PosixStorage) -> None:
    block, views = _aligned_block(SIZES, seed=3)
    items = [ArrayItem(f"t{i}", "numpy", "|u1", (n,), n, v) for i, (n, v) in enumerate(zip(SIZES, views))]
    assert [it.name for it in file_order(items)] == ["t0", "t2", "t4", "t6", "t1", "t3", "t5"]
    _, tensors = write_shard(storage, "c1", "s.safetensors", 0, items)
    by_offset = [t.name for t in sorted(tensors, key=lambda t: t.offset)]
    assert by_offset == ["t0", "t2", "t4", "t6", "t1", "t3", "t5"]
    assert all(t.offset % PAGE == 0 for t in tensors if t.name in ("t0", "t2", "t4", "t6"))
    with open(storage.local_path(layout.cut_file("c1", "s.safetensors")), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert (8 + n) % PAGE == 0
    assert header["t2"]["data_offsets"][0] % PAGE == 0
    del views, items
    block.close()


def test_a_refused_direct_write_falls_back_to_the_page_cache(storage: PosixStorage) -> None:
    """A real EINVAL from the kernel: an O_DIRECT write at an unaligned length. The sink drops O_DIRECT
    for the rest of the file (and later files), and the file still holds exactly the bytes written."""
    block, views = _aligned_block([PAGE * 4], seed=4)
    sink = storage.open_sink(layout.cut_file("c1", "f"))
    sink._submit_view(views[0][:PAGE])  # aligned: goes O_DIRECT
    sink._submit_view(views[0][PAGE : PAGE + 1000])  # unaligned length: the kernel answers EINVAL
    sink.write(views[0][PAGE + 1000 :])
    sink.close()
    assert storage.use_direct is False
    with open(storage.local_path(layout.cut_file("c1", "f")), "rb") as f:
        assert f.read() == bytes(views[0])
    del views
    block.close()
