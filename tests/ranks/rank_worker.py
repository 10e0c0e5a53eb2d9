"""One rank of a test job (started by rankkit.run_job): runs a scenario, writes rank<r>.json.

Scenarios save and load through ``Store.open(url, group=WORLD)``; a victim rank may SIGKILL itself at
a protocol phase (``StoreOptions.on_phase``) or before a call, as a node dying would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import ckptstore
from ranks.rankkit import failure, worker_main


def state_of(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(rank + 2, 3, generator=g), "rank": rank, "step": step,
            "nested": {"b": torch.arange(5) * (rank + step), "name": f"rank-{rank}"}}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


class Job:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rank = cfg["rank"]
        self.url = cfg["url"]
        self.victim = cfg.get("victim")
        self.phase = cfg.get("phase")
        self.kill_step = cfg.get("kill_step", 2)
        self.step = 0

    def on_phase(self, name: str, cut: str) -> None:
        if self.rank == self.victim and name == self.phase and self.step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def open(self, **kw: Any) -> ckptstore.Store:
        opts = ckptstore.StoreOptions(storage_options=self.cfg.get("storage_options"), on_phase=self.on_phase,
                                      lease_ttl_s=self.cfg.get("lease_ttl_s", 30.0))
        return ckptstore.Store.open(self.url, group=dist.group.WORLD, options=opts,
                                    rank_timeout=self.cfg.get("rank_timeout", 30), **kw)

    def save(self, store: ckptstore.Store, step: int, **kw: Any) -> ckptstore.CutInfo:
        self.step = step
        if self.rank == self.victim and self.phase == "before-save" and step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return store.save(state_of(self.rank, step), step=step, **kw)


def scenario_save_load(job: Job) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with job.open(create=True) as store:
        out["repr"] = repr(store)
        journal = os.path.join(job.cfg["out_dir"], f"journal{job.rank}.txt")
        with open(journal, "w") as f:
            f.write(f"rank {job.rank}\n")
        infos = [job.save(store, s, files={"journal.txt": journal} if s == 2 else None) for s in (1, 2)]
        out["infos"] = [i.to_json() for i in infos]
        # Each rank's own files come back to it (a store opened with group= restores its own rank's).
        restored = os.path.join(job.cfg["out_dir"], f"restored{job.rank}")
        store.restore_files(to=restored)
        out["restored"] = open(os.path.join(restored, "journal.txt")).read()
    back = ckptstore.load(job.url, rank=job.rank, storage_options=job.cfg.get("storage_options"))
    out["loaded_same"] = same(back, state_of(job.rank, 2))
    out["keys_same"] = same(ckptstore.load(job.url, keys=["nested"], rank=job.rank,
                                           storage_options=job.cfg.get("storage_options")),
                            {"nested": state_of(job.rank, 2)["nested"]})
    try:
        ckptstore.load(job.url, storage_options=job.cfg.get("storage_options"))
    except ckptstore.UsageError as exc:
        out["no_rank_error"] = str(exc)
    return out


def scenario_fail_prepare(job: Job) -> dict[str, Any]:
    with job.open(create=True) as store:
        job.save(store, 1)
        bad = job.cfg["bad_rank"]
        state = state_of(job.rank, 2)
        if job.rank == bad:
            state["oops"] = object()
        try:
            store.save(state, step=2)
        except ckptstore.CkptStoreError as exc:
            res = failure(exc)
        else:
            res = {"ok": True}
        # The group is not broken by a reported failure: the next save works on every rank.
        res["next"] = job.save(store, 3).step
        return res


def scenario_mismatch(job: Job) -> dict[str, Any]:
    with job.open(create=True) as store:
        try:
            store.save(state_of(job.rank, 1), step=1 + (job.rank == job.cfg["odd_rank"]))
        except ckptstore.CkptStoreError as exc:
            return failure(exc)
        return {"ok": True}


def scenario_kill(job: Job) -> dict[str, Any]:
    store = job.open(create=True)
    job.save(store, 1)
    t0 = time.monotonic()
    try:
        job.save(store, 2)
    except ckptstore.CkptStoreError as exc:
        res = failure(exc)
    else:
        res = {"ok": True}
    res["seconds"] = time.monotonic() - t0
    try:
        job.save(store, 3)
    except ckptstore.CkptStoreError as exc:
        res["next_error"] = failure(exc)
    try:
        store.close()
    except ckptstore.CkptStoreError:
        pass
    return res


def scenario_resume(job: Job) -> dict[str, Any]:
    with job.open(create=False) as store:
        latest = store.latest()
        back = store.load(rank=job.rank)
        mib = job.cfg.get("resume_mib")
        want = big_state(job.rank, latest.step, mib) if mib else state_of(job.rank, latest.step)
        res = {"latest_step": latest.step, "world_size": latest.world_size, "state_ok": same(back, want)}
        if job.cfg.get("files_to"):  # the collective restore puts this rank's attached files back too
            to = os.path.join(job.cfg["out_dir"], f"files{job.rank}")
            ckptstore.restore(store, rng=False, files_to=to)
            res["journal"] = open(os.path.join(to, "journal.txt")).read()
        info = job.save(store, latest.step + 10)
        res["saved"] = info.step
        if job.rank == 0:
            res["verify_ok"] = store.verify().ok
        return res


def checkpointer(job: Job, **kw: Any) -> Any:
    from ckptstore.writer import Checkpointer

    events: list[dict[str, Any]] = []
    opts = ckptstore.StoreOptions(storage_options=job.cfg.get("storage_options"))
    ck = Checkpointer(job.url, group=dist.group.WORLD, rank_timeout=job.cfg.get("rank_timeout", 30),
                      store_options=opts, mode=job.cfg.get("mode", "process"), on_event=events.append, **kw)
    return ck, events


def big_state(rank: int, step: int, mib: int) -> dict[str, Any]:
    st = state_of(rank, step)
    st["big"] = torch.full((mib * 262144,), float(step))
    return st


def scenario_ck_loop(job: Job) -> dict[str, Any]:
    ck, events = checkpointer(job, every=job.cfg.get("every", 2), keep=ckptstore.KeepLast(2))
    mib = job.cfg.get("mib_by_rank", {}).get(str(job.rank), 0)
    taken = []
    for step in range(job.cfg.get("steps", 10)):
        h = ck.maybe_cut(step, big_state(job.rank, step, mib) if mib else state_of(job.rank, step))
        if h is not None:
            taken.append(step)
    if job.cfg.get("mark_final"):  # the last periodic cut is the run's end: marked final, not written again
        info = ck.mark_final()
        final = info.step
    else:
        final = job.cfg.get("steps", 10)
        info = ck.cut(final, state_of(job.rank, final), final=True).wait()
    writer_pid = ck.writer_pid
    ck.close()
    from ckptstore.writer.shm import leftover_segments

    leaks = {"shm": leftover_segments(os.getpid()), "writer_alive": writer_pid is not None and _alive(writer_pid)}
    back = ckptstore.load(job.url, rank=job.rank, storage_options=job.cfg.get("storage_options"))
    return {"taken": taken, "skipped": ck.skipped, "final": info.to_json(), "same": same(back, state_of(job.rank, final)),
            "leaks": leaks,
            "event_ranks": sorted({e.get("rank") for e in events}),
            "kinds": sorted({e["event"] for e in events})}


def scenario_ck_mark_window(job: Job) -> dict[str, Any]:
    """Rank 0's commit thread is slow to mark cut 2 (held until rank 1 has looked): rank 1 must write
    nothing of the cut before its mark (issue 20), or a gc on rank 0 in that window could take rank
    1's shards for an abandoned leftover."""
    ck, _ = checkpointer(job, every=1)
    first = ck.cut(1, state_of(job.rank, 1)).wait(60)
    go = os.path.join(job.cfg["out_dir"], "go")
    if job.rank == 0:
        begin = ck.store.begin_cut

        def held_begin(*a: Any, **kw: Any) -> Any:
            _wait_for_file(go)
            return begin(*a, **kw)

        ck.store.begin_cut = held_begin
    h = ck.maybe_cut(2, state_of(job.rank, 2))
    early: list[str] = []
    if job.rank == 1:
        cuts = os.path.join(job.url, "cuts")
        deadline = time.monotonic() + 1.0  # without the wait, rank 1's shards were there within ms
        while time.monotonic() < deadline and not early:
            early = [f"{d}/{f}" for d in os.listdir(cuts) if d != first.id for f in os.listdir(os.path.join(cuts, d))]
            time.sleep(0.01)
        open(go, "w").close()
    info = h.wait(60)
    ck.close()
    res: dict[str, Any] = {"early": early, "cut": info.id}
    if job.rank == 0:
        with ckptstore.Store.open(job.url, readonly=True) as store:
            res["verify_ok"] = store.verify().ok and store.latest().id == info.id
    return res


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def scenario_rank0_alone(job: Job) -> dict[str, Any]:
    """A DDP-style job where only rank 0 checkpoints, without group=: nothing is collective, so the
    other ranks never take part and nobody waits for them."""
    from ckptstore.writer import Checkpointer

    if job.rank == 0:
        with Checkpointer(job.url, every=1) as ck:
            ck.cut(1, state_of(0, 1), final=True)
        info = ckptstore.Store.open(job.url, readonly=True).latest()
        return {"world_size": info.world_size, "step": info.step}
    return {"idle": True}


def scenario_ck_preempt(job: Job) -> dict[str, Any]:
    """preemption=True on every rank; only rank ``signalled`` receives SIGTERM, at step ``at`` (a real
    signal, sent to itself mid-step). Every rank must cut that same step and end its loop there."""
    import signal
    import time

    ck, events = checkpointer(job, every=1000, preemption=True)
    ended, seconds = None, []
    for step in range(1, 50):
        if step == job.cfg["at"] and job.rank == job.cfg["signalled"]:
            os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.perf_counter()
        h = ck.maybe_cut(step, state_of(job.rank, step))
        if h is None:
            seconds.append(time.perf_counter() - t0)
        if ck.preempted:
            ended = step
            break
    ck.close()
    latest = ckptstore.Store.open(job.url, readonly=True).latest()
    return {"ended": ended, "latest": [latest.step, list(latest.tags), latest.world_size],
            "preempted": [{k: e[k] for k in ("step", "signals", "ranks")} for e in events if e["event"] == "preempted"],
            "same": same(ckptstore.load(job.url, rank=job.rank), state_of(job.rank, ended or 0)),
            "median_check_ms": round(1000 * sorted(seconds)[len(seconds) // 2], 3) if seconds else None}


def scenario_ck_mismatch(job: Job) -> dict[str, Any]:
    ck, _ = checkpointer(job, every=1)
    try:
        ck.maybe_cut(4 + (job.rank == job.cfg["odd_rank"]), state_of(job.rank, 4))
    except ckptstore.CkptStoreError as exc:
        res = failure(exc)
    else:
        res = {"ok": True}
    ck.close_locally()
    return res


def scenario_ck_kill(job: Job) -> dict[str, Any]:
    ck, _ = checkpointer(job, every=1)
    ck.cut(1, state_of(job.rank, 1), final=True)
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    try:
        h = ck.maybe_cut(2, state_of(job.rank, 2))
        if job.rank == job.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        h.wait(60)
        res["cut2"] = "committed"
    except ckptstore.CkptStoreError as exc:
        # The victim may die while this rank still reads the last exchange of maybe_cut (rank 0's
        # process hosts the rendezvous store here): then maybe_cut itself raises, naming it.
        res["cut2"] = failure(exc)
    res["seconds"] = time.monotonic() - t0
    try:
        ck.maybe_cut(3, state_of(job.rank, 3))
    except ckptstore.CkptStoreError as exc:
        res["next"] = failure(exc)
    try:
        ck.close()
    except ckptstore.CkptStoreError as exc:
        res["close"] = failure(exc)
    return res


def scenario_ck_all_die(job: Job) -> dict[str, Any]:
    """Every trainer is SIGKILLed right after the cut of step 2 was handed to its writer process."""
    ck, _ = checkpointer(job, every=1)
    ck.cut(1, state_of(job.rank, 1), final=True)
    journal = os.path.join(job.cfg["out_dir"], f"journal{job.rank}.txt")
    with open(journal, "w") as f:
        f.write(f"rank {job.rank} at step 2\n")
    h = ck.maybe_cut(2, big_state(job.rank, 2, job.cfg.get("mib", 32)), files={"journal.txt": journal})
    with open(os.path.join(job.cfg["out_dir"], f"rank{job.rank}.json"), "w") as f:
        json.dump({"cut": h.id, "writer_pid": ck.writer_pid}, f)
    # Every rank is past maybe_cut before any dies: rank 0's process hosts the rendezvous store here
    # (tcp://), and a rank still reading the last exchange would see it vanish (under torchrun the
    # agent hosts it). A file barrier, not a collective: nothing of the library is involved.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(job.cfg["out_dir"], f"rank{r}.json")) for r in range(job.cfg["world"])):
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def scenario_restore_fallback(job: Job) -> dict[str, Any]:
    """Every rank restores with fallback=True from a store whose LATEST cut is damaged (one byte of
    rank 1's shard): all agree on the older cut."""
    with job.open(create=False) as store:
        resumed = ckptstore.restore(store, fallback=True, group=dist.group.WORLD)
        return {"step": resumed.step, "skipped": sorted(resumed.skipped), "latest_after": store.latest().step,
                "same": same(resumed.state, state_of(job.rank, resumed.step))}


def scenario_restore_other_world(job: Job) -> dict[str, Any]:
    with job.open(create=False) as store:
        try:
            ckptstore.restore(store, group=dist.group.WORLD)
        except ckptstore.CkptStoreError as exc:
            return failure(exc)
        return {"ok": True}


def scenario_ck_capture_fails(job: Job) -> dict[str, Any]:
    """Rank 1's state holds a value that cannot be stored: every rank raises at that maybe_cut, and the
    next cut works."""
    ck, _ = checkpointer(job, every=1)
    ck.cut(1, state_of(job.rank, 1), final=True)
    state = state_of(job.rank, 2)
    if job.rank == 1:
        state["oops"] = object()
    try:
        ck.maybe_cut(2, state)
    except ckptstore.CkptStoreError as exc:
        res = failure(exc)
    else:
        res = {"ok": True}
    res["next"] = ck.cut(3, state_of(job.rank, 3), final=True).wait().step
    ck.close()
    return res


def scenario_ck_writer_dies(job: Job) -> dict[str, Any]:
    """Rank 1's writer process is SIGKILLed halfway through its part of cut 2: that rank writes its
    part itself from the same block (fallback) and the cut commits whole."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "writer"))
    from fault_worker import inject

    ck, events = checkpointer(job, every=1)
    ck.cut(1, state_of(job.rank, 1), final=True)
    if job.rank == 1:
        inject(ck, "sigkill-mid-shard")
    info = ck.cut(2, big_state(job.rank, 2, 4), final=True).wait()
    ck.close()
    back = ckptstore.load(job.url, rank=job.rank)
    return {"step": info.step, "world_size": info.world_size, "same": same(back, big_state(job.rank, 2, 4)),
            "fallbacks": [e["step"] for e in events if e["event"] == "fallback"]}


def fsdp_model() -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_step(model: Any, opt: Any, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(4, 5, generator=g)
    loss = model(x).pow(2).mean() + 0.01 * torch.randn(1).sum()  # the global RNG matters too
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest(model: Any, opt: Any) -> str:
    import hashlib

    h = hashlib.sha256()
    for v in list(model.state_dict().values()) + [t for st in opt.state_dict()["state"].values() for t in st.values()]:
        local = v.to_local() if hasattr(v, "to_local") else v
        h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if local.numel() else b"")
    return h.hexdigest()


def scenario_fsdp(job: Job) -> dict[str, Any]:
    """Trains an FSDP2 model with background cuts; ``die_at`` SIGKILLs every rank after that step's
    cut committed; a rerun restores in place and trains on to ``steps``."""
    from ckptstore.writer import Checkpointer

    model, opt = fsdp_model()
    opts = ckptstore.StoreOptions(storage_options=job.cfg.get("storage_options"))
    with Checkpointer(job.url, every=2, group=dist.group.WORLD, rank_timeout=30, store_options=opts,
                      mode=job.cfg.get("mode", "process")) as ck:
        resumed = ckptstore.restore(ck.store, model=model, optimizer=opt, group=dist.group.WORLD)
        start = resumed.step + 1 if resumed is not None else 0
        for step in range(start, job.cfg["steps"]):
            train_step(model, opt, job.rank, step)
            state = ckptstore.training_state(step=step, model=model, optimizer=opt)
            if job.cfg.get("die_at") == step:
                ck.cut(step, state).wait()
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            ck.maybe_cut(step, state)
        ck.cut(job.cfg["steps"], ckptstore.training_state(step=job.cfg["steps"], model=model, optimizer=opt), final=True)
    return {"resumed_from": resumed.step if resumed else None, "digest": digest(model, opt)}


# ------------------------------------------------------------------------------------ agreement cases
# One job runs many cases (tests/ranks/test_agreement.py: each job costs seconds of start-up on 2
# cores); each case uses a store of its own, so a group a case broke never touches the next one.

def scenario_agreement(job: Job) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for case in job.cfg["cases"]:
        kind, _, arg = case.partition(":")
        t0 = time.monotonic()
        try:
            cases[case] = CASES[kind](job, arg)
        except BaseException as exc:  # noqa: BLE001 - one case's surprise must not hide the others
            import traceback

            cases[case] = {**failure(exc), "traceback": traceback.format_exc()}
        cases[case]["wall_s"] = round(time.monotonic() - t0, 3)  # where a slow job spends its time
    return {"cases": cases}


def _case_url(job: Job, name: str) -> str:
    return os.path.join(job.cfg["out_dir"], "stores", name)


def _timed(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        res = fn() or {"ok": True}
    except ckptstore.CkptStoreError as exc:
        res = failure(exc)
    res["seconds"] = time.monotonic() - t0
    return res


def case_restart(job: Job, _: str) -> dict[str, Any]:
    """The restart of a job whose trainer died while its writer process still finishes (rescues) its
    last cut: rank 0's writer open waits for that writer (stopped by the test, resumed here only once
    rank 1 has waited longer than rank_timeout), and the restart must not be taken for rank 0's death."""
    import threading

    timeout = job.cfg["rank_timeout"]
    dist.barrier()  # both ranks start their open together (gloo; nothing of the library)
    if job.rank == 0:
        threading.Timer(timeout + 1, os.kill, (job.cfg["orphan_pid"], signal.SIGCONT)).start()

    def body() -> dict[str, Any]:
        with ckptstore.Store.open(job.cfg["restart_url"], group=dist.group.WORLD, rank_timeout=timeout) as store:
            latest = store.latest()
            saved = store.save(state_of(job.rank, 10), step=10)  # the restarted group agrees on a cut
            return {"ok": True, "latest": latest.id if latest else None, "saved_world_size": saved.world_size}

    return _timed(body)


def case_never_joins(job: Job, _: str) -> dict[str, Any]:
    """Rank 1 opens the store without group=: rank 0's collective open must name it within rank_timeout
    (1 s here: only rank 0 waits, for a rank that is not there)."""
    url, done = _case_url(job, "never-joins"), os.path.join(job.cfg["out_dir"], "never-joins.done")
    if job.rank == 0:
        res = _timed(lambda: ckptstore.Store.open(url, create=True, group=dist.group.WORLD, rank_timeout=1).close())
        open(done, "w").close()
        return res
    with ckptstore.Store.open(url, create=True):  # group=None: this rank is not one of the group's
        _wait_for_file(done)
    return {"ok": True}


def _wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60  # a bound, not a clock: rank 0 writes the file when its case ended
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def case_slash(job: Job, _: str) -> dict[str, Any]:
    """Rank 1 spells the store's URL with a trailing slash: the same store, so the same group."""
    url = _case_url(job, "slash") + ("/" if job.rank == 1 else "")

    def body() -> dict[str, Any]:
        with ckptstore.Store.open(url, create=True, group=dist.group.WORLD, rank_timeout=job.cfg["rank_timeout"]) as s:
            return {"ok": True, "info": s.save(state_of(job.rank, 1), step=1).to_json()}

    return _timed(body)


def case_foreign_record(job: Job, _: str) -> dict[str, Any]:
    """Rank 1's record of the cut of step 2 is rewritten to name rank 0's shard as soon as it is durable,
    after rank 1 described it to rank 0 (issue 22: the commit reads no record; the bytes are pinned)."""
    url = _case_url(job, "foreign-record")
    step = {"now": 1}

    def on_phase(name: str, cut: str) -> None:
        if job.rank == 1 and name == "rank-written" and step["now"] == 2:
            path = os.path.join(url, "cuts", cut, "rank00001.json")
            doc = json.load(open(path))
            for f in doc["files"]:
                f["name"] = f["name"].replace("rank00001-", "rank00000-")
            with open(path, "w") as f:
                json.dump(doc, f)

    opts = ckptstore.StoreOptions(on_phase=on_phase)
    with ckptstore.Store.open(url, create=True, group=dist.group.WORLD, options=opts,
                              rank_timeout=job.cfg["rank_timeout"]) as store:
        store.save(state_of(job.rank, 1), step=1)
        step["now"] = 2
        res = _timed(lambda: store.save(state_of(job.rank, 2), step=2) and None)
        step["now"] = 3
        res["next"] = _timed(lambda: {"step": store.save(state_of(job.rank, 3), step=3).step})
    return res


def case_pair(job: Job, pair: str) -> dict[str, Any]:
    """Rank 0 makes collective call a, rank 1 call b (``pair`` is "a-b"), on a fresh store and Checkpointer."""
    from ckptstore.writer import Checkpointer

    a, b = pair.split("-")
    mine = a if job.rank == 0 else b
    url = _case_url(job, f"pair-{pair}")
    timeout = job.cfg["rank_timeout"]
    extra: list[Any] = []
    store = ckptstore.Store.open(url, create=True, group=dist.group.WORLD, rank_timeout=timeout)
    ck = Checkpointer(store, group=dist.group.WORLD, mode="thread", every=1, preemption=mine == "preempt")
    calls = {
        "open": lambda: extra.append(ckptstore.Store.open(url, readonly=True, group=dist.group.WORLD,
                                                          rank_timeout=timeout)),
        "save": lambda: store.save(state_of(job.rank, 1), step=1),
        "restore": lambda: ckptstore.restore(store, group=dist.group.WORLD),
        "checkpointer": lambda: extra.append(Checkpointer(store, group=dist.group.WORLD, mode="thread")),
        "maybe_cut": lambda: ck.maybe_cut(1, state_of(job.rank, 1)),
        "cut_final": lambda: ck.cut(1, state_of(job.rank, 1), final=True),
        "preempt": lambda: ck.maybe_cut(1, state_of(job.rank, 1)),
        "mark_final": lambda: ck.mark_final(),
        "close": lambda: ck.close(),
    }
    try:
        return _timed(lambda: calls[mine]() and None)
    finally:
        for x in [*extra, ck]:
            x.close_locally() if hasattr(x, "close_locally") else x.close()
        store.close()


CASES = {"restart": case_restart, "never_joins": case_never_joins, "slash": case_slash,
         "foreign_record": case_foreign_record, "pair": case_pair}


if __name__ == "__main__":
    worker_main(globals(), Job)
