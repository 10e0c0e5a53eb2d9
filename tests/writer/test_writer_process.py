"""The writer process itself: a fresh interpreter that never imports torch, runs niced, and is reaped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ckptstore.writer import Checkpointer
from writerkit import BOUND, has_exited, proc_nice, small_state, wait_until


def test_writer_never_imports_torch_and_runs_at_nice_10(url):
    assert "torch" in sys.modules  # the trainer side has torch loaded (small_state builds tensors)
    with Checkpointer(url, every=1) as ck:
        ck.cut(1, small_state()).wait(BOUND)  # after real work, not only after the handshake
        pid = ck.writer_pid
        hello = ck._writer.hello
        assert hello.pid == pid
        assert hello.modules_with_torch is False
        assert hello.nice == 10 and proc_nice(pid) == 10
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps and "libc10" not in maps  # no torch library mapped at all
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"ckptstore.writer.worker" in cmdline  # a fresh interpreter (spawn), not a fork of us
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        assert ppid == os.getpid()
    wait_until(lambda: has_exited(pid), what="writer exit after close")


def test_writer_nice_level_is_an_option(url):
    with Checkpointer(url, every=1, nice=15) as ck:
        assert ck._writer.hello.nice == 15 == proc_nice(ck.writer_pid)
