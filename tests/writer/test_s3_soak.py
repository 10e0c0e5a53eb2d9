"""The object-store soak (issue 24): a Checkpointer in process mode cuts, prunes and a reader loads, all
through the fault proxy, while about 5% of requests fail at random with every rule type; then every cut
reported committed and kept by policy loads bitwise, nothing leaked, and no call outlived its deadline.

About 60 s in CI; ``--soak-seconds N`` runs it longer. It prints one JSON line of figures
(docs/crash-safety.md, "Object-store faults", keeps the latest).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from s3proxy import ACTIONS, Rule

import ckptstore
from ckptstore import KeepLast, StoreOptions, spi
from ckptstore.writer import Checkpointer

FAULT_RATE = 0.05
KEEP = 4


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"model": {f"w{k}": rng.standard_normal(20_000).astype(np.float32) for k in range(3)},
            "opt": {"m": np.full(5_000, step, dtype=np.float64)}, "step": step}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(np.array_equal(a["model"][k], b["model"][k]) for k in a["model"]) \
        and np.array_equal(a["opt"]["m"], b["opt"]["m"])


def _rules(seed: int) -> list[Rule]:
    """Every rule type at an equal share of FAULT_RATE, each drawn from its own seeded generator."""
    actions = sorted(ACTIONS)
    share = FAULT_RATE / len(actions)
    # corrupt fires on PUT bodies only, about a quarter of the soak's requests: four times the share
    # there keeps its part of all requests (it fired 0 times in a 60 s run at the plain share).
    return [Rule(a, probability=share * (4 if a == "corrupt" else 1), seed=seed + i, after_bytes=64, stall_s=30.0)
            for i, a in enumerate(actions)]


def test_a_checkpointer_cuts_prunes_and_loads_through_an_object_store_that_fails_5_percent_of_requests(
        s3_url, s3_proxy, request):
    seconds = request.config.getoption("--soak-seconds")
    url, opts = s3_url
    proxied = s3_proxy.options(opts)
    options = StoreOptions(storage_options=proxied, max_shard_bytes=64 << 10, io_timeout_s=2.0, io_attempts=6)
    deadline = options.io_policy().deadline()
    events: list[dict] = []
    ck = Checkpointer(url, every=1, keep=KeepLast(KEEP), store_options=options, on_event=events.append)
    rules = [s3_proxy.add(r) for r in _rules(seed=24)]
    loads, cut_calls, load_s = 0, [], []
    t_end = time.monotonic() + seconds
    step = 0
    try:
        while time.monotonic() < t_end:
            step += 1
            t0 = time.monotonic()
            ck.maybe_cut(step, _state(step))
            cut_calls.append(time.monotonic() - t0)
            committed = [e["step"] for e in events if e["event"] == "committed"]
            if step % 10 == 0 and committed:
                t0 = time.monotonic()  # a reader through the same faulty store, while the writer prunes
                with ckptstore.Store.open(url, readonly=True, options=StoreOptions(
                        storage_options=proxied, io_timeout_s=2.0, io_attempts=6)) as reader:
                    info = reader.latest()
                    out = reader.load(info.id)
                assert _same(out, _state(info.step)), f"cut of step {info.step} did not load bitwise"
                load_s.append(time.monotonic() - t0)
                loads += 1
            time.sleep(0.05)  # a training step
    finally:
        try:
            ck.close(timeout=6 * deadline)  # the last cut commits through the faults too
        finally:
            fired = {r.action: r.fired for r in rules}
            s3_proxy.clear()
    committed = [e["step"] for e in events if e["event"] == "committed"]
    failed = [e for e in events if e["event"] == "failed"]
    assert failed == [], failed  # at 5% a call failing all six tries is a 1e-8 event: a failure is a bug
    assert len(committed) >= 10 and loads >= 2 and sum(fired.values()) >= 10, (committed, loads, fired)
    # No call waited past its deadline: a maybe_cut never waits on storage (busy="skip"), a load is a
    # handful of calls.
    assert max(cut_calls) < deadline and max(load_s) < 4 * deadline, (max(cut_calls), max(load_s))
    with ckptstore.Store.open(url, options=StoreOptions(storage_options=opts)) as store:  # no proxy
        cls = spi.classify(store)
        assert cls.latest_problem is None and cls.leftovers == [] and cls.bad == set()
        kept = [c.step for c in store.cuts()]
        assert kept == sorted(committed)[-KEEP:], (kept, committed)
        for c in store.cuts():
            assert _same(store.load(c.id), _state(c.step))
        assert store.verify().ok
        assert store.storage.list_uploads() == []
        assert store.gc(dry_run=True).removed == []
    print(json.dumps({"soak_s": seconds, "steps": step, "committed": len(committed),
                      "skipped": sum(e["event"] == "skipped" for e in events), "loads": loads,
                      "requests": len(s3_proxy.log), "faults": fired, "max_load_s": round(max(load_s), 2),
                      "deadline_s": deadline}))


@pytest.fixture(autouse=True)
def _quiet_werkzeug(caplog):
    caplog.set_level("WARNING", logger="werkzeug")  # moto logs every request: thousands of lines
