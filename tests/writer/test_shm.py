"""The shared block: a /dev/shm too small for the state fails at creation with ShmTooSmall naming the
container setting, fast, never with SIGBUS mid-copy (failure-modes S17); blocks are reused, have no
name in /dev/shm, and are gone once every descriptor and mapping is closed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ckptstore.writer import Checkpointer
from ckptstore.writer.shm import Block, leftover_segments
from writerkit import BOUND, small_state

PROBE = textwrap.dedent("""
    import json, os, time
    from ckptstore.writer import ShmTooSmall
    from ckptstore.writer.shm import Block, leftover_segments, SHM_DIR

    st = os.statvfs(SHM_DIR)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    # More than is free, and more than the whole mount: tmpfs refuses such a posix_fallocate up front
    # instead of first filling the machine's memory page by page.
    size = max(free, total) + (1 << 30)
    t0 = time.monotonic()
    try:
        Block.create(size)
    except ShmTooSmall as exc:
        out = {"raised": "ShmTooSmall", "memory_error": isinstance(exc, MemoryError), "str": str(exc),
               "hint": exc.hint, "path": exc.path, "size": size, "free": free}
    except BaseException as exc:
        out = {"raised": type(exc).__name__, "str": str(exc)}
    else:
        out = {"raised": None}
    out["seconds"] = time.monotonic() - t0
    out["left"] = leftover_segments(os.getpid())
    print(json.dumps(out))
""")


def test_block_larger_than_free_shm_raises_shm_too_small_not_sigbus():
    # In a subprocess: a SIGBUS would show as its exit status instead of taking pytest down.
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"probe died with status {res.returncode}: {res.stderr[-2000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["raised"] == "ShmTooSmall", out
    assert out["memory_error"] is True
    assert "--shm-size" in out["hint"] and "--shm-size" in out["str"]
    assert str(out["size"]) in out["str"] and "/dev/shm" in out["str"]
    assert out["path"].startswith("/dev/shm/ckptstore-")
    assert out["seconds"] < 10, f"posix_fallocate took {out['seconds']:.1f} s to fail"
    assert out["left"] == []  # the refused block's name was unlinked again


def test_block_is_shared_by_descriptor_and_never_named():
    block = Block.create(1 << 20)
    try:
        assert not os.path.exists(os.path.join("/dev/shm", block.name))  # unlinked at birth
        assert block.name in leftover_segments(os.getpid())  # ... but alive while held
        other = Block.attach(os.dup(block.fd), block.size, block.name)
        block.view[:5] = b"hello"
        assert bytes(other.view[:5]) == b"hello"  # the same memory, as the writer process sees it
        other.close()
        assert block.name in leftover_segments(os.getpid())
    finally:
        block.close()
    assert block.name not in leftover_segments(os.getpid())
    block.close()  # idempotent


def test_a_killed_creator_leaves_nothing(tmp_path):
    """SIGKILL right after creating a block: no name, no memory survives the process."""
    code = "import os, signal; from ckptstore.writer.shm import Block; b = Block.create(1 << 20); " \
           "print(b.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == -9
    name = res.stdout.strip()
    assert name.startswith("ckptstore-")
    assert not os.path.exists(os.path.join("/dev/shm", name))
    assert name not in leftover_segments()


def test_checkpointer_reuses_one_block_and_grows_it_only_when_needed(url):
    with Checkpointer(url, every=1, mode="thread") as ck:
        ck.cut(1, small_state(numel=1024)).wait(BOUND)
        first = leftover_segments(os.getpid())
        assert len(first) == 1
        ck.cut(2, small_state(numel=1000)).wait(BOUND)  # smaller: same block
        assert leftover_segments(os.getpid()) == first
        ck.cut(3, small_state(numel=256 * 1024)).wait(BOUND)  # bigger: a new block replaces it
        grown = leftover_segments(os.getpid())
        assert len(grown) == 1 and grown != first
    assert leftover_segments(os.getpid()) == []
