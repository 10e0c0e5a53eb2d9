"""Whether a process has exited, as the tests need it: every thread counts (shared by the writer and
integration tests)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (``Z`` for a zombie), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2]


def has_exited(pid: int) -> bool:
    """True once ``pid`` runs no more: gone, or a zombie waiting for a parent that may never reap it
    (an orphan's new parent here is PID 1, which is not an init that reaps). Every thread counts: a
    multithreaded process's leader shows "Z" as soon as its own thread exited, while the others may
    still be exiting and still hold the process's files (a flocked writer lock among them)."""
    if proc_state(pid) not in (None, "Z", "X"):
        return False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return True
    return all(proc_state_of_task(pid, t) in (None, "Z", "X") for t in tasks)


def proc_state_of_task(pid: int, tid: str) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2]


def wait_gone(pid: int, timeout: float = 60) -> None:
    """Waits (bounded) until process ``pid`` has exited: a SIGKILLed trainer's writer may still hold the
    store's writer lock while it finishes a handed-over cut."""
    deadline = time.monotonic() + timeout  # a bound on waiting for its exit, not a clock being measured
    while not has_exited(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert has_exited(pid), f"process {pid} still alive after {timeout} s"
