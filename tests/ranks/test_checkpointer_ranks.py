"""Checkpointer(group=): background cuts of every rank, agreed in the loop, committed once."""

from __future__ import annotations

import os
import time

import pytest

import ckptstore

from .rankkit import describe, run_job


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_two_ranks_take_periodic_and_final_cuts(tmp_path, mode):
    url = str(tmp_path / "store")
    # thread mode ends with Checkpointer.mark_final (collective) instead of a final cut
    res = run_job(str(tmp_path / "out"), 2, "ck_loop", url=url, mode=mode, mark_final=mode == "thread")
    assert all(r.result and r.result.get("same") for r in res), describe(res)
    a, b = res[0].result, res[1].result
    if mode == "thread":
        assert a["final"]["step"] == a["taken"][-1]
    # Agreement: the same cuts were taken (and skipped) on every rank, and the same cut committed.
    assert a["taken"] == b["taken"] and a["skipped"] == b["skipped"]
    assert a["final"] == b["final"] and a["final"]["world_size"] == 2 and a["final"]["final"]
    assert a["event_ranks"] == [0] and b["event_ranks"] == [1]
    for r in (a, b):  # close is leak-free on every rank: no shared block, no writer process left
        assert r["leaks"] == {"shm": [], "writer_alive": False}
    assert {"captured", "written", "committed"} <= set(a["kinds"])
    with ckptstore.Store.open(url, readonly=True) as store:
        assert store.verify().ok
        assert all(c.world_size == 2 for c in store.cuts())
        assert len(store.cuts()) <= 3  # KeepLast(2) plus the final cut


def test_skip_is_decided_for_all_ranks_together(tmp_path):
    url = str(tmp_path / "store")
    # Rank 1 writes 64 MiB per cut, rank 0 almost nothing: only rank 1 is still busy at the next step.
    res = run_job(str(tmp_path / "out"), 2, "ck_loop", url=url, every=1, steps=12, mib_by_rank={"1": 64},
                  timeout=150)
    assert all(r.result and r.result.get("same") for r in res), describe(res)
    a, b = res[0].result, res[1].result
    assert a["taken"] == b["taken"] and a["skipped"] == b["skipped"]
    assert a["skipped"] > 0, describe(res)


def test_a_preemption_signal_on_one_rank_makes_every_rank_cut_that_step(tmp_path):
    """SIGTERM reaches rank 1 only (at step 5): the notice is agreed at the next maybe_cut, so both
    ranks cut step 5 (every=1000), wait for its commit and end their loops there."""
    url = str(tmp_path / "store")
    res = run_job(str(tmp_path / "out"), 2, "ck_preempt", url=url, at=5, signalled=1)
    assert all(r.result and r.result.get("same") for r in res), describe(res)
    for r in res:
        assert r.result["ended"] == 5 and r.result["latest"] == [5, ["preempted"], 2], describe(res)
        assert r.result["preempted"] == [{"step": 5, "signals": ["SIGTERM"], "ranks": [1]}], describe(res)
    assert ckptstore.Store.open(url, readonly=True).verify().ok


def test_a_rank_at_another_step_is_named(tmp_path):
    res = run_job(str(tmp_path / "out"), 2, "ck_mismatch", url=str(tmp_path / "store"), odd_rank=1)
    for r in res:
        assert r.result["error_type"] == "RankFailure" and r.result["failed_ranks"] == [1], describe(res)
        assert "different step" in r.result["error"]


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_after_capture_fails_the_cut_everywhere_and_nobody_hangs(tmp_path, victim):
    url = str(tmp_path / "store")
    timeout = 3
    res = run_job(str(tmp_path / "out"), 2, "ck_kill", url=url, victim=victim, rank_timeout=timeout)
    assert res[victim].killed, describe(res)
    s = res[1 - victim].result
    assert s is not None, describe(res)
    # The survivor's cut either committed whole (the victim's part was durable before it died) or
    # failed naming the victim; its next collective call raises naming the victim, within the timeout.
    if s["cut2"] != "committed":
        assert s["cut2"]["error_type"] == "RankFailure" and s["cut2"]["failed_ranks"] == [victim], describe(res)
    assert s["seconds"] < timeout + 15
    assert s["next"]["error_type"] == "RankFailure" and s["next"]["failed_ranks"] == [victim], describe(res)
    with ckptstore.Store.open(url, readonly=True) as store:
        latest = store.latest()
        assert latest.step in (1, 2) and latest.world_size == 2
        assert store.verify(latest.id).ok
    # A killed rank 0's writer process inherited the writer lock and finishes (or gives up) the cut it
    # was handed before it exits; a restart takes the store once it is gone (bounded).
    _wait_until_writable(url, within=60)
    # A restart resumes from LATEST on every rank.
    res2 = run_job(str(tmp_path / "out2"), 2, "resume", url=url)
    assert all(r.result and r.result.get("state_ok") for r in res2), describe(res2)


def _wait_until_writable(url: str, *, within: float) -> None:
    """Until the writer lock can be taken (polling, without recovery); fails after ``within`` s."""
    import time

    from ckptstore.store import open_for_repair

    deadline = time.monotonic() + within
    while True:
        try:
            open_for_repair(url).close()
            return
        except ckptstore.StoreLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_background_cuts_of_two_ranks_on_the_s3_server(tmp_path, s3_url):
    url, opts = s3_url
    res = run_job(str(tmp_path / "out"), 2, "ck_loop", url=url, storage_options=opts, timeout=150)
    assert all(r.result and r.result.get("same") for r in res), describe(res)
    assert res[0].result["taken"] == res[1].result["taken"]
    with ckptstore.Store.open(url, readonly=True, options=ckptstore.StoreOptions(storage_options=opts)) as store:
        assert store.latest().final and store.latest().world_size == 2
        assert store.verify().ok


def test_a_ddp_job_that_checkpoints_from_rank_0_alone_does_not_hang(tmp_path):
    res = run_job(str(tmp_path / "out"), 2, "rank0_alone", url=str(tmp_path / "store"))
    assert res[0].result == {"world_size": 1, "step": 1}, describe(res)
    assert res[1].result == {"idle": True}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_all_trainers_killed_right_after_capture_and_the_cut_still_commits(tmp_path, where, request):
    url, opts = str(tmp_path / "store"), None
    if where == "s3":
        url, opts = request.getfixturevalue("s3_url")
    res = run_job(str(tmp_path / "out"), 2, "ck_all_die", url=url, timeout=120, storage_options=opts,
                  mib=32 if where == "local" else 4)
    assert all(r.killed and r.result for r in res), describe(res)
    cut = res[0].result["cut"]
    assert res[1].result["cut"] == cut
    for r in res:  # every orphaned writer finishes its part and exits by itself
        assert gone_within(r.result["writer_pid"], 60), f"rank {r.rank}'s writer still runs"
    with ckptstore.Store.open(url, readonly=True, options=ckptstore.StoreOptions(storage_options=opts)) as store:
        latest = store.latest()
        assert latest.id == cut and latest.world_size == 2, "the handed-over cut was lost"
        assert store.manifest().writer.mode == "rescue:process"
        assert store.verify().ok
        for r in (0, 1):  # each rank's attached file, finished by its own orphaned writer
            store.restore_files(to=str(tmp_path / f"restored{r}"), rank=r)
            assert open(tmp_path / f"restored{r}" / "journal.txt").read() == f"rank {r} at step 2\n"
    res2 = run_job(str(tmp_path / "out2"), 2, "resume", url=url, resume_mib=32 if where == "local" else 4,
                   storage_options=opts, timeout=150, files_to=True)
    assert all(r.result and r.result["latest_step"] == 2 and r.result["state_ok"] for r in res2), describe(res2)
    assert [r.result["journal"] for r in res2] == [f"rank {r} at step 2\n" for r in (0, 1)]


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_ranks_writer_process_dies_and_that_rank_writes_its_part_itself(tmp_path):
    url = str(tmp_path / "store")
    res = run_job(str(tmp_path / "out"), 2, "ck_writer_dies", url=url)
    assert all(r.result and r.result.get("same") for r in res), describe(res)
    assert res[1].result["fallbacks"] == [2] and res[0].result["fallbacks"] == []
    assert all(r.result["step"] == 2 and r.result["world_size"] == 2 for r in res)
    with ckptstore.Store.open(url, readonly=True) as store:
        assert store.verify().ok


def test_restoring_a_cut_of_another_world_size_is_refused_by_name(tmp_path):
    url = str(tmp_path / "store")
    res = run_job(str(tmp_path / "out"), 2, "save_load", url=url)
    assert all(r.result and r.result.get("loaded_same") for r in res), describe(res)
    res3 = run_job(str(tmp_path / "out3"), 3, "restore_other_world", url=url)
    for r in res3:
        assert r.result["error_type"] == "UsageError", describe(res3)
        assert "holds 2 rank(s) but this job has 3" in r.result["error"]
    with pytest.raises(ckptstore.UsageError, match="world size 2"):
        ckptstore.restore(url)  # one process: names the cut's world size


def test_a_capture_that_fails_on_one_rank_fails_the_cut_on_every_rank(tmp_path):
    url = str(tmp_path / "store")
    res = run_job(str(tmp_path / "out"), 2, "ck_capture_fails", url=url)
    by = {r.rank: r.result for r in res}
    assert by[1]["error_type"] == "UnsupportedValue", describe(res)
    assert by[0]["error_type"] == "RankFailure" and by[0]["failed_ranks"] == [1], describe(res)
    assert by[0]["next"] == by[1]["next"] == 3
    with ckptstore.Store.open(url, readonly=True) as store:
        assert [c.step for c in store.cuts()] == [1, 3]


def test_restore_with_fallback_is_agreed_by_every_rank(tmp_path):
    url = str(tmp_path / "store")
    res = run_job(str(tmp_path / "out"), 2, "save_load", url=url)  # cuts at steps 1 and 2
    assert all(r.result and r.result.get("loaded_same") for r in res), describe(res)
    with ckptstore.Store.open(url, readonly=True) as store:
        m = store.manifest()
        shard = next(f for f in m.files if f.rank == 1)
    path = os.path.join(url, "cuts", m.cut, shard.name)
    with open(path, "r+b") as f:  # flip one byte of rank 1's data: only rank 1 could notice by itself
        f.seek(shard.nbytes - 1)
        b = f.read(1)
        f.seek(shard.nbytes - 1)
        f.write(bytes([b[0] ^ 0xFF]))
    res2 = run_job(str(tmp_path / "out2"), 2, "restore_fallback", url=url)
    for r in res2:
        assert r.result == {"step": 1, "skipped": [m.cut], "latest_after": 1, "same": True}, describe(res2)


def test_no_rank_writes_a_shard_before_rank_0_marked_the_cut(tmp_path):
    """Issue 20: ranks other than 0 wrote their part as soon as their commit thread reached it, before
    rank 0's mark; the cut's directory then read as an abandoned leftover on rank 0."""
    url = str(tmp_path / "store")
    res = run_job(str(tmp_path / "out"), 2, "ck_mark_window", url=url, mode="process")
    assert all(r.result for r in res), describe(res)
    assert res[1].result["early"] == [], "rank 1 wrote before rank 0 marked the cut"
    assert res[0].result["verify_ok"] and res[0].result["cut"] == res[1].result["cut"]
