"""The trainer is SIGKILLed while its writer process is mid-cut (failure-modes S15b) and the writer
cannot finish (it hangs): the writer notices the death, tries to finish the cut alone under the lock it
inherited, gives up at its stall deadline and exits; the previous cut stays LATEST; the next open
recovers the leftovers and the store verifies. (A writer that can finish commits: test_rescue.py.)"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptstore import Store, StoreLocked, StoreOptions
from ckptstore.writer.shm import leftover_segments
from writerkit import BOUND, check_store, has_exited, wait_until

CHILD = Path(__file__).with_name("trainer_child.py")


def _read_json_line(proc: subprocess.Popen, timeout: float) -> dict:
    """One JSON line from the child's stdout, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        if not ready:
            raise AssertionError(f"child said nothing within {timeout} s (exit status {proc.poll()})")
        chunk = os.read(fd, 1)  # byte by byte: never read past the line into the next one
        if not chunk:
            raise AssertionError(f"child closed stdout; exit status {proc.wait(BOUND)}")
        buf += chunk
    return json.loads(buf)


def test_trainer_sigkilled_mid_cut(url):
    proc = subprocess.Popen([sys.executable, str(CHILD), url], stdout=subprocess.PIPE)
    try:
        first = _read_json_line(proc, 60)
        assert first["event"] == "first" and first["pid"] == proc.pid
        writer_pid = first["writer_pid"]
        assert leftover_segments(proc.pid), "the trainer's block should exist while it runs"
        second = _read_json_line(proc, BOUND)
        assert second["event"] == "second"
        cut_dir = Path(url) / "cuts" / second["cut"]
        # Mid-cut: the writer has begun the shard file (and hangs after half its bytes).
        wait_until(lambda: cut_dir.is_dir() and any(cut_dir.iterdir()), what="second cut's shard started")
        assert not has_exited(writer_pid)

        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(BOUND) == -signal.SIGKILL
        # The orphaned writer tries to finish the cut it was handed (it hangs: the injected fault) and
        # holds the inherited writer lock meanwhile, so no new writer collects the cut under it...
        assert not has_exited(writer_pid)
        with pytest.raises(StoreLocked, match="dead; its writer process is finishing a cut"):
            Store.open(url, options=StoreOptions(orphan_wait_s=0))  # (by default the open waits for it)
        # ...until its stall deadline (the trainer's write_timeout, 6 s) ends it.
        wait_until(lambda: has_exited(writer_pid), timeout=BOUND, what=f"orphaned writer {writer_pid} exit")
        assert leftover_segments(proc.pid) == []  # the writer unlinked the dead trainer's block
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    # Nothing of the second cut was committed: it is an in-progress leftover of a dead owner.
    with Store.open(url, readonly=True) as ro:
        cls = ro.classify()
        assert cls.latest is not None and cls.latest.cut == first["cut"]
        assert [m.cut for m in cls.committed] == [first["cut"]]
        kinds = {(lo.cut, lo.kind, lo.owner_alive) for lo in cls.leftovers}
        assert (second["cut"], "in-progress", False) in kinds

    events = []
    with Store.open(url, options=StoreOptions(on_event=events.append)) as store:  # recovery on open
        assert store.classify().leftovers == []
        assert store.latest().id == first["cut"]
        assert any(e["event"] == "recovered" and e["cut"] == second["cut"] for e in events)
    assert not (Path(url) / "cuts" / second["cut"]).exists()
    assert os.listdir(Path(url) / "marks") == []
    store = check_store(url)
    loaded = store.load()
    assert all(float(t[0]) == float(i) for i, t in enumerate(loaded.values()))  # cut 1's values
