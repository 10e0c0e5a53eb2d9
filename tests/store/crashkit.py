"""Shared helpers of the crash suites: run ``crashsave.py``, read what it printed, and check the store
invariant on what a crash left (``check_after_crash``)."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import ckptstore
from ckptstore import Store, StoreOptions, layout

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "crashsave.py"
sys.path.insert(0, str(HERE))

from crashsave import SHARD_BYTES, shard_count, state_for  # noqa: E402

__all__ = ["SHARD_BYTES", "shard_count", "state_for", "Run", "run_script", "spawn_script", "read_until",
           "assert_same_state", "check_after_crash", "assert_clean_layout", "dead_pid", "owner_of"]

RUN_TIMEOUT = 60


@dataclass
class Run:
    """What one run of crashsave.py did, parsed from its output."""

    rc: int
    out: str
    err: str
    pid: int = -1
    saved: dict[int, str] = field(default_factory=dict)  # step -> cut id of the normal saves
    killed: tuple[str, str] | None = None  # (phase, cut) of the self-kill
    done: list[str] | None = None
    bytes_seen: int | None = None

    @classmethod
    def parse(cls, rc: int, out: str, err: str) -> "Run":
        run = cls(rc, out, err)
        for line in out.splitlines():
            word, *rest = line.split()
            if word == "PID":
                run.pid = int(rest[0])
            elif word == "SAVED":
                run.saved[int(rest[0])] = rest[1]
            elif word == "KILL":
                run.killed = (rest[0], rest[1])
            elif word == "DONE":
                run.done = rest
            elif word == "BYTES":
                run.bytes_seen = int(rest[0])
        return run

    def describe(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.out}\n--- stderr\n{self.err}"


def _argv(url: str | os.PathLike[str], args: list[str]) -> list[str]:
    return [sys.executable, str(SCRIPT), str(url), *args]


def run_script(url: str | os.PathLike[str], *args: str) -> Run:
    """Runs crashsave.py to its end (death included) and parses what it printed."""
    p = subprocess.run(_argv(url, list(args)), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    return Run.parse(p.returncode, p.stdout, p.stderr)


def spawn_script(url: str | os.PathLike[str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(_argv(url, list(args)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def read_until(proc: subprocess.Popen[bytes], word: str, timeout: float = RUN_TIMEOUT) -> list[str]:
    """Reads ``proc``'s stdout lines until one starts with ``word``; returns all lines read. Fails on
    timeout or EOF (the process died first) with what it printed."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {word!r} line within {timeout}s; got {lines}")
            if not sel.select(left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"process exited (rc={proc.wait()}) before {word!r}; got {lines}")
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                lines.append(line.decode())
                if lines[-1].split()[:1] == [word]:
                    return lines
    finally:
        sel.close()


def assert_same_state(got: Any, want: Any, where: str = "state") -> None:
    """Exact equality of nested dicts of numpy arrays: keys, dtypes, shapes and every element."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}")
        return
    assert isinstance(got, np.ndarray), f"{where}: expected ndarray, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert np.array_equal(got, want), f"{where}: values differ"


def owner_of(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}"


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (for marks whose writer is dead)."""
    p = subprocess.Popen(["true"])
    assert p.wait(RUN_TIMEOUT) == 0
    return p.pid


def assert_clean_layout(root: str | os.PathLike[str], store: Store, foreign: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Nothing under the root, cuts/, marks/ or bad/ but committed cuts (each exactly its manifest and
    the files it lists) and the ``foreign`` paths (relative to the root)."""
    root = Path(root)
    committed = {m.cut: m for m in store.classify().committed}
    stray_root = {p.name for p in root.iterdir()} - layout.ROOT_ENTRIES - foreign
    assert stray_root == set(), f"stray entries at the root: {stray_root}"
    marks = {f"marks/{n}" for n in os.listdir(root / "marks")} - foreign
    assert marks == set(), f"stray marks: {marks}"
    assert os.listdir(root / "bad") == []
    cut_names = {n for n in os.listdir(root / "cuts") if f"cuts/{n}" not in foreign}
    assert cut_names == set(committed), f"cuts/ holds {sorted(cut_names)}, committed are {sorted(committed)}"
    for cut, m in committed.items():
        names = set(os.listdir(root / "cuts" / cut))
        assert names == {layout.MANIFEST_FILE} | {f.name for f in m.files}, f"{cut}: {sorted(names)}"


def check_after_crash(
    url: str | os.PathLike[str],
    *,
    latest_step: int | None,
    committed_steps: list[int],
    leftovers: list[tuple[str, str | None]] | None,
    allowed_kinds: set[str] | None = None,
    dead_owner: int | None = None,
    foreign: set[str] = frozenset(),  # type: ignore[assignment]
) -> Store:
    """The store invariant after a crash, checked in the order a restart meets the store.

    Readers first (no lock, nothing changed): LATEST is committed, ``verify`` is ok and lists the
    leftovers as notices, ``load`` returns the committed state. Then the writer open (recovery + gc):
    exactly the leftovers are recovered, no leftover or stray file stays, every committed cut loads
    exactly and verifies, and the next save commits. ``leftovers`` is the exact list of (kind, cut)
    expected; with None, any leftovers whose kinds are in ``allowed_kinds``. Returns the writer store
    (open: the caller closes it).
    """
    url = str(url)
    # (f) a reader before any writer: sees the leftovers as notices and still the committed cut.
    with Store.open(url, readonly=True) as ro:
        cls = ro.classify()
        found = sorted(((lo.kind, lo.cut) for lo in cls.leftovers), key=str)
        if leftovers is not None:
            assert found == sorted(leftovers, key=str), f"leftovers {found}, expected {leftovers}"
        else:
            assert {k for k, _ in found} <= (allowed_kinds or set()), found
        if dead_owner is not None:
            for lo in cls.leftovers:
                if lo.kind in ("in-progress", "orphan-mark"):
                    assert lo.owner == owner_of(dead_owner) and lo.owner_alive is False, lo
        report = ro.verify()
        assert report.ok, report.findings
        notices = sorted(((f.kind, f.cut) for f in report.findings if f.kind.startswith("leftover-")), key=str)
        assert notices == sorted(((f"leftover-{k}", c) for k, c in found), key=str), notices
        assert all(f.severity == "notice" for f in report.findings), report.findings
        latest = ro.latest()
        assert (latest.step if latest else None) == latest_step
        assert [c.step for c in ro.cuts()] == committed_steps
    if latest_step is None:
        try:
            ckptstore.load(url)
        except ckptstore.CutNotFound:
            pass
        else:
            raise AssertionError("load of an empty store returned something")
    else:
        assert_same_state(ckptstore.load(url), state_for(latest_step))

    # (a) the writer open recovers: exactly the leftovers seen above are removed.
    events: list[dict[str, Any]] = []
    store = Store.open(url, options=StoreOptions(max_shard_bytes=SHARD_BYTES, on_event=events.append))
    try:
        recovered = sorted(((e["kind"], e["cut"]) for e in events if e["event"] == "recovered"), key=str)
        assert recovered == found, f"recovered {recovered}, leftovers were {found}"
        # (b) LATEST names a committed cut: the expected one.
        latest = store.latest()
        assert (latest.step if latest else None) == latest_step
        assert [c.step for c in store.cuts()] == committed_steps
        # (c) every committed cut loads exactly what was saved at its step.
        for c in store.cuts():
            assert_same_state(store.load(c.id), state_for(c.step), f"cut {c.id}")
        # (d) the audit is clean: no error, and no notice but foreign files.
        report = store.verify()
        assert report.ok, report.findings
        assert [f.kind for f in report.findings if f.kind != "foreign"] == [], report.findings
        # (e) no leftovers and no stray files.
        assert store.classify().leftovers == []
        assert_clean_layout(url, store, foreign)
        # (g) the next save commits and reads back.
        nxt = max(committed_steps, default=0) + 1
        info = store.save(state_for(nxt), step=nxt)
        assert store.latest() == info
        assert_same_state(ckptstore.load(url), state_for(nxt))
        assert store.verify().ok
        assert_clean_layout(url, store, foreign)
    except BaseException:
        store.close()
        raise
    return store
