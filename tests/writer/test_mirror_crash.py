"""Crash safety of the mirror tier (issue 21, "Crash safety" and "Mirror unreachable"), with real
processes, real SIGKILLs, and an S3 mirror (the moto server) reached through the fault proxy
(tests/s3proxy.py): a trainer killed after its local commit, or mid multipart upload, leaves only
committed cuts on the mirror, the mirror's own recovery collects what the dead copy left, and the next
Checkpointer open catches up; a mirror down for a while costs no local cut and catches up by itself.

Only the public Checkpointer API and its events are used, and the killed job is the trainer *and* its
writer process (a job killed whole, as a scheduler does it), so these hold wherever the uploads run (a
trainer thread, or the writer process). Every test ends by looking at the mirror alone through a client
that bypasses the proxy: committed cuts that verify and load bitwise, no leftover, no multipart upload.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore import KeepLast, Store, StoreOptions, spi
from ckptstore.writer import Checkpointer
from ckptstore.writer.shm import leftover_segments
from mirror_child import state
from s3proxy import Rule
from writerkit import BOUND, EventLog, has_exited, wait_until

CHILD = Path(__file__).with_name("mirror_child.py")
#: The killed child's mirror lease: the restart's open of the mirror waits for it to run out (bounded).
LEASE_TTL_S = 2.0
_SHARDS = "*/cuts/*/rank*.safetensors"  # the mirror's shard objects (the key without the bucket)


# ---------------------------------------------------------------------------------------- helpers
def _events(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of an events file (a line being written is not read yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _read_line(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """One JSON line from the child's stdout, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        assert ready, f"the child said nothing within {timeout} s (exit status {proc.poll()})"
        chunk = os.read(proc.stdout.fileno(), 1)  # byte by byte: never past the line
        assert chunk, f"the child closed stdout; exit status {proc.wait(BOUND)}"
        buf += chunk
    return json.loads(buf)


def _start_child(tmp_path: Path, murl: str, storage_options: dict, kind: str,
                 **extra: Any) -> tuple[subprocess.Popen, Path]:
    events = tmp_path / "child-events.jsonl"
    cfg = {"local": str(tmp_path / "local"), "mirror": murl, "storage_options": storage_options,
           "lease_ttl_s": LEASE_TTL_S, "events": str(events), "state": kind, **extra}
    proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)], stdout=subprocess.PIPE)
    return proc, events


def _kill_job(proc: subprocess.Popen, writer_pid: int | None) -> None:
    """SIGKILLs the trainer and its writer process (the whole job, wherever its uploads run) and waits
    (bounded) until both are gone; the kernel frees their shared-memory block with them."""
    os.kill(proc.pid, signal.SIGKILL)
    if writer_pid is not None:
        try:
            os.kill(writer_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_until(lambda: has_exited(writer_pid), what=f"writer {writer_pid} gone")
    assert proc.wait(BOUND) == -signal.SIGKILL
    assert leftover_segments(proc.pid) == []


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(BOUND)
    proc.stdout.close()


def _mirror(murl: str, opts: dict) -> Store:
    """The mirror alone, read through a client that does not go through the proxy."""
    return Store.open(murl, readonly=True, options=StoreOptions(storage_options=opts))


def _check_mirror(murl: str, opts: dict, steps: list[int], kind: str, *, clean: bool = True) -> spi.Classification:
    """The mirror alone: its committed cuts are ``steps``, LATEST names the last (no cut: no LATEST),
    nothing is recorded bad, and every committed cut verifies and loads bitwise. ``clean``: nothing is
    left over either (no leftover cut, no multipart upload); else the leftovers are returned, not judged."""
    with _mirror(murl, opts) as m:
        cls = spi.classify(m)
        assert cls.latest_problem is None, cls.latest_problem
        assert [c.step for c in cls.committed] == steps
        assert (cls.latest.step if cls.latest is not None else None) == (steps[-1] if steps else None)
        assert cls.bad == set()
        assert m.verify().ok
        for cut in cls.committed:
            out = m.load(cut.cut)
            want = state(kind, cut.step)
            assert set(out) == set(want) and out["step"] == cut.step
            for name, array in want.items():
                if isinstance(array, np.ndarray):
                    assert out[name].dtype == array.dtype and out[name].tobytes() == array.tobytes(), name
        if clean:
            assert cls.leftovers == []
            assert m.storage.list_uploads() == []
        return cls


def _restart(tmp_path: Path, murl: str, storage_options: dict, log: EventLog) -> Checkpointer:
    """A new Checkpointer on the killed job's local directory and mirror (its catch-up runs at open;
    the dead child's mirror lease makes the first opens fail until it runs out: mirror-failed, retried)."""
    mopts = StoreOptions(storage_options=storage_options, lease_ttl_s=LEASE_TTL_S)
    return Checkpointer(str(tmp_path / "local"), every=1, mode="thread", mirror=murl, mirror_options=mopts,
                        mirror_retry_s=0.2, mirror_timeout=BOUND, on_event=log)


# ------------------------------------------------------------------------------------------ tests
def _kill_after_local_commit(tmp_path: Path, murl: str, opts: dict, s3_proxy, rule: Rule, kind: str) -> str:
    """Starts the child with ``rule`` holding its upload, kills the job once the rule fired (the cut
    committed locally, no ``mirrored`` event), and returns the cut's id."""
    proc, events = _start_child(tmp_path, murl, s3_proxy.options(opts), kind)
    try:
        said = _read_line(proc, 60)
        assert said["event"] == "committed"
        assert s3_proxy.wait_for(lambda: rule.fired >= 1, timeout=BOUND), [e["event"] for e in _events(events)]
        seen = _events(events)
        assert ("committed", 1) in [(e["event"], e.get("step")) for e in seen]
        assert not [e for e in seen if e["event"] == "mirrored"]
        _kill_job(proc, said["writer_pid"])
    finally:
        _stop(proc)
    return said["cut"]


def _catch_up(tmp_path: Path, murl: str, opts: dict, s3_proxy, cut: str) -> EventLog:
    """The restart: the proxy faultless again, a new Checkpointer uploads the killed job's cut by its
    catch-up alone (no cut taken), and closes."""
    s3_proxy.clear()
    log = EventLog()
    with _restart(tmp_path, murl, s3_proxy.options(opts), log):
        got = log.wait_for("mirrored", step=1)
        assert got["cut"] == cut
    return log


def test_a_job_killed_after_its_local_commit_leaves_only_committed_cuts_and_the_restart_mirrors_the_cut(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    murl, opts = s3_url
    # Every shard PUT to the mirror stalls: the upload of cut 1 is under way, and cannot end, when the
    # job dies (the proxy's stop wakes the stall; the child is dead long before 60 s).
    stall = s3_proxy.add(Rule("stall", method="PUT", key=_SHARDS, stall_s=60.0))
    cut = _kill_after_local_commit(tmp_path, murl, opts, s3_proxy, stall, "small")
    with Store.open(str(tmp_path / "local"), readonly=True) as local:
        assert [c.id for c in local.cuts()] == [cut]
    # The mirror: no committed cut and no LATEST; the dead copy is a leftover (its mark), nothing more.
    cls = _check_mirror(murl, opts, [], "small", clean=False)
    assert {lo.cut for lo in cls.leftovers} == {cut}
    log = _catch_up(tmp_path, murl, opts, s3_proxy, cut)
    assert [e["step"] for e in log.of("mirrored")] == [1]
    # The mirror alone loads it bitwise; its recovery removed the dead copy's leftovers.
    _check_mirror(murl, opts, [1], "small")


def test_a_job_killed_mid_multipart_upload_leaves_no_half_cut_and_the_mirrors_recovery_aborts_the_upload(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    murl, opts = s3_url
    # One shard just over 16 MiB: a multipart upload of two parts. Part 2 stalls, part 1 is stored.
    stall = s3_proxy.add(Rule("stall", op="upload_part", part=2, stall_s=60.0))
    cut = _kill_after_local_commit(tmp_path, murl, opts, s3_proxy, stall, "big")
    cls = _check_mirror(murl, opts, [], "big", clean=False)
    assert {lo.cut for lo in cls.leftovers} == {cut}
    with _mirror(murl, opts) as m:
        [upload] = m.storage.list_uploads()  # the dead copy's upload: created, part 1 in, never completed
        assert upload.rel.startswith(f"cuts/{cut}/") and upload.rel.endswith(".safetensors")
    aborts_before = len(s3_proxy.requests(op="abort_multipart"))
    _catch_up(tmp_path, murl, opts, s3_proxy, cut)
    # The restart's open of the mirror recovered it: the dead upload aborted (the new one completed).
    assert len(s3_proxy.requests(op="abort_multipart")) > aborts_before
    _check_mirror(murl, opts, [1], "big")


def test_an_s3_mirror_down_mid_run_costs_no_local_cut_and_its_backlog_goes_up_when_it_is_back(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    """Extends test_mirror_tier's mirror that is down from the start (a local directory): here an S3
    mirror is reachable (cut 1 mirrored), then refuses every request (503 SlowDown) while cuts 2-4
    commit, with failed uploads and a mirror lease left unrenewed, then comes back: the same trainer
    uploads the backlog in step order, and the failed copies' leftovers are collected."""
    murl, opts = s3_url
    url, log = str(tmp_path / "local"), EventLog()
    mopts = StoreOptions(storage_options=s3_proxy.options(opts), io_attempts=1, io_backoff_s=0.01,
                         lease_ttl_s=LEASE_TTL_S)
    with Checkpointer(url, every=1, busy="wait", keep=KeepLast(1), mirror=murl, mirror_options=mopts,
                      mirror_retry_s=0.05, mirror_timeout=BOUND, on_event=log) as ck:
        ck.maybe_cut(1, state("small", 1))
        log.wait_for("mirrored", step=1)
        down = s3_proxy.add(Rule("slowdown"))
        for step in (2, 3, 4):
            ck.maybe_cut(step, state("small", step))
            log.wait_for("committed", step=step)
        log.wait_for("mirror-failed", attempt=3)  # three failed attempts in a row, the trainer going on
        assert not [e for e in log.of("mirrored") if e["step"] > 1]
        # keep=KeepLast(1) keeps one cut: the local prune spares the three the mirror still needs.
        with Store.open(url, readonly=True) as local:
            assert [c.step for c in local.cuts()] == [2, 3, 4]
        s3_proxy.clear()
        assert down.fired >= 3
        for step in (2, 3, 4):
            log.wait_for("mirrored", step=step)
        ck.cut(5, state("small", 5), final=True)
    assert [e["step"] for e in log.of("mirrored")] == [1, 2, 3, 4, 5]
    failed = log.of("mirror-failed")
    assert [e["attempt"] for e in failed] == list(range(1, len(failed) + 1))  # one event per attempt
    assert all(e["error"] and e["error_type"] and e["retry_in"] > 0 for e in failed)
    delays = [e["retry_in"] for e in failed]
    assert delays == sorted(delays) and delays[0] < delays[-1]  # the backoff grows
    assert {e["step"] for e in failed} <= {None, 2, 3, 4}
    _check_mirror(murl, opts, [1, 2, 3, 4, 5], "small")


# ------------------------------------------------- the uploads run in the writer process: it outlives the trainer
def test_a_trainer_killed_alone_mid_upload_leaves_its_writer_to_finish_the_upload_with_no_restart(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    """The uploads run in the writer process (issue 21): the trainer SIGKILLed alone while its cut's
    upload is held up, its orphaned writer goes on, commits the cut on the mirror, and exits, with no
    restart at all."""
    murl, opts = s3_url
    stall = s3_proxy.add(Rule("stall", method="PUT", key=_SHARDS, attempts={1}, stall_s=2.0))
    proc, events = _start_child(tmp_path, murl, s3_proxy.options(opts), "small", mirror_timeout=BOUND)
    try:
        said = _read_line(proc, 60)
        assert s3_proxy.wait_for(lambda: stall.fired >= 1, timeout=BOUND)
        assert not [e for e in _events(events) if e["event"] == "mirrored"]
        os.kill(proc.pid, signal.SIGKILL)  # the trainer only
        assert proc.wait(BOUND) == -signal.SIGKILL
        wait_until(lambda: has_exited(said["writer_pid"]), what="the orphaned writer's exit")
    finally:
        _stop(proc)
    _check_mirror(murl, opts, [1], "small")


def test_a_cut_rescued_by_the_orphaned_writer_is_committed_locally_and_mirrored_by_it(
        tmp_path: Path, s3_url, s3_proxy) -> None:
    """Issue 21, "a cut handed to an orphaned writer (the rescue) is mirrored by it too": the trainer hands
    cut 2 over and dies at once; its writer commits the cut locally (as "rescue:process") and uploads it
    to the mirror before it exits, with no restart."""
    murl, opts = s3_url
    proc, _events_path = _start_child(tmp_path, murl, s3_proxy.options(opts), "small", mirror_timeout=BOUND,
                                      then="rescue")
    try:
        said = _read_line(proc, 60)
        handed = _read_line(proc, BOUND)
        assert proc.wait(BOUND) == -signal.SIGKILL
        wait_until(lambda: has_exited(said["writer_pid"]), what="the orphaned writer's exit")
    finally:
        _stop(proc)
    with Store.open(str(tmp_path / "local"), readonly=True) as local:
        assert local.latest().id == handed["cut"] and local.manifest().writer.mode == "rescue:process"
    _check_mirror(murl, opts, [1, 2], "small")
    with _mirror(murl, opts) as m:
        assert m.latest().id == handed["cut"]
