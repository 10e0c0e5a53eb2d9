"""The cut outlives its trainer: once a cut is handed to the writer process (maybe_cut returned), a
trainer SIGKILLed right after does not lose it. The orphaned writer finishes the write, commits under
the lock it inherited, and exits; nothing stays behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ckptstore
from writerkit import BOUND, has_exited, wait_until

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import ckptstore
    from ckptstore.writer import Checkpointer

    url, opts, mib, journal = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    state = {f"w{i}": np.full(mib * 65536, float(i), dtype=np.float32) for i in range(4)}
    ck = Checkpointer(url, every=1, store_options=ckptstore.StoreOptions(**opts))
    first = ck.cut(1, state).wait(60)
    for a in state.values():
        a += 1.0
    with open(journal, "w") as f:
        f.write("journal at step 2\\n")
    h = ck.maybe_cut(2, state, tags=["rescued?"], files=[journal])
    with open(journal, "w") as f:  # what the cut holds was read in maybe_cut
        f.write("journal at step 3\\n")
    print(json.dumps({"first": first.id, "second": h.id, "writer_pid": ck.writer_pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def run_child(url: str, opts: dict, mib: int, journal: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, url, json.dumps(opts), str(mib), journal],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def check_rescued(url: str, opts: dict, out: dict, restore_to: str) -> None:
    wait_until(lambda: has_exited(out["writer_pid"]), timeout=BOUND, what="the orphaned writer's exit")
    with ckptstore.Store.open(url, readonly=True, options=ckptstore.StoreOptions(**opts)) as store:
        latest = store.latest()
        assert latest is not None and latest.id == out["second"], "the handed-over cut was lost"
        assert latest.tags == ("rescued?",)
        assert store.manifest().writer.mode == "rescue:process"
        assert store.verify().ok
        # The mark is gone; at most a temp file of a write the trainer's own thread was doing as it died.
        assert {lo.kind for lo in store.classify().leftovers} <= {"temp-file"}
        state = store.load()
        store.restore_files(to=restore_to)  # the file attached to the cut is finished with it
    assert open(os.path.join(restore_to, "journal.txt")).read() == "journal at step 2\n"
    assert all(np.all(state[f"w{i}"] == i + 1.0) for i in range(4))
    with ckptstore.Store.open(url, options=ckptstore.StoreOptions(**opts)) as store:  # recovery on open
        assert store.classify().leftovers == [] and store.latest().id == out["second"]


def test_a_trainer_killed_right_after_handing_over_a_cut_loses_nothing(tmp_path):
    url = str(tmp_path / "store")
    out = run_child(url, {}, mib=16, journal=str(tmp_path / "journal.txt"))  # 64 MiB: still writing at the kill
    check_rescued(url, {}, out, str(tmp_path / "restored"))


def test_rescue_on_the_s3_server(tmp_path, s3_url):
    url, opts = s3_url
    out = run_child(url, {"storage_options": opts}, mib=4, journal=str(tmp_path / "journal.txt"))
    check_rescued(url, {"storage_options": opts}, out, str(tmp_path / "restored"))


SLOW_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from fault_worker import inject
    from ckptstore.writer import Checkpointer

    ck = Checkpointer(sys.argv[1], every=1)
    first = ck.cut(1, {"w": np.zeros(1 << 20, dtype=np.float32)}).wait(60)
    inject(ck, "pause-mid-shard")  # the next cut's write pauses 3 s halfway: the rescue outlives the kill
    h = ck.maybe_cut(2, {"w": np.ones(1 << 20, dtype=np.float32)})
    print(json.dumps({"second": h.id, "writer_pid": ck.writer_pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def run_slow_child(url: str, log: str) -> dict:
    """SLOW_CHILD to its SIGKILL; its output goes to a file (a pipe would make us wait for the writer
    process too, which inherits it)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, url, os.path.dirname(os.path.abspath(__file__))],
                                stdout=f, stderr=subprocess.STDOUT)
        assert proc.wait(120) == -9, open(log).read()[-3000:]
    return json.loads([line for line in open(log).read().splitlines() if line.startswith("{")][-1])


def test_a_trainer_started_again_at_once_waits_for_the_rescue_and_resumes_from_its_cut(tmp_path):
    """kill -9, then the same command at once: the new writer open finds the lock held by the dead
    trainer's writer process, still finishing the handed-over cut, waits for it instead of raising
    StoreLocked, and sees that cut committed."""
    url = str(tmp_path / "store")
    out = run_slow_child(url, str(tmp_path / "child.log"))
    assert not has_exited(out["writer_pid"]), "the rescue ended before the restart: the test proves nothing"
    with ckptstore.Store.open(url) as store:  # waits (bounded by StoreOptions.orphan_wait_s), no StoreLocked
        assert store.latest().id == out["second"]  # the rescuer committed before it let the lock go
        assert store.manifest().writer.mode == "rescue:process"
    # The same wait switched off: StoreLocked names the holder as a dead trainer whose writer is busy.
    out = run_slow_child(url + "-2", str(tmp_path / "child2.log"))
    with pytest.raises(ckptstore.StoreLocked, match="dead; its writer process is finishing a cut"):
        ckptstore.Store.open(url + "-2", options=ckptstore.StoreOptions(orphan_wait_s=0))
    wait_until(lambda: has_exited(out["writer_pid"]), timeout=BOUND, what="the second rescue's exit")


# A ttl the niced rescuer renews in time even when the two cores are loaded (at 2 s, a loaded machine
# starved its renewals past the ttl and a restart took the store: a load-dependent failure).
LEASE_TTL = 4.0
LEASE_CHILD = f"LEASE_TTL = {LEASE_TTL}\n" + textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    import ckptstore
    from fault_worker import inject
    from ckptstore.writer import Checkpointer

    options = ckptstore.StoreOptions(storage_options=json.loads(sys.argv[2]), lease_ttl_s=LEASE_TTL)
    # nice 0: on two loaded cores (the suite's two workers) a niced rescuer got too little CPU to renew
    # a 4 s lease in time; what is tested is that it renews, not how it shares the CPU.
    ck = Checkpointer(sys.argv[1], every=1, store_options=options, nice=0)
    ck.cut(1, {"w": np.zeros(1 << 18, dtype=np.float32)}).wait(60)
    inject(ck, "pause-mid-shard:13")  # the rescue writes for over three lease ttls after the kill
    h = ck.maybe_cut(2, {"w": np.ones(1 << 18, dtype=np.float32)})
    print(json.dumps({"second": h.id, "writer_pid": ck.writer_pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_rescue_on_s3_keeps_the_lease_for_as_long_as_it_writes(tmp_path, s3_url):
    """Issue 19 item 3: the dead trainer's lease is renewed by its writer from the death on, so a
    restart that comes more than a ttl later still gets StoreLocked until the rescue committed."""
    url, opts = s3_url
    log = str(tmp_path / "child.log")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", LEASE_CHILD, url, json.dumps(opts),
                                 os.path.dirname(os.path.abspath(__file__))], stdout=f, stderr=subprocess.STDOUT)
        assert proc.wait(120) == -9, open(log).read()[-3000:]
    dead = time.monotonic()
    out = json.loads([line for line in open(log).read().splitlines() if line.startswith("{")][-1])
    options = ckptstore.StoreOptions(storage_options=opts, lease_ttl_s=LEASE_TTL)
    late_refusals = 0
    while True:  # restarts, every 0.2 s, until one gets the store
        assert time.monotonic() - dead < BOUND, "the rescue did not end"
        try:
            store = ckptstore.Store.open(url, options=options)
            break
        except ckptstore.StoreLocked:
            # Past the trainer's ttl (+1 s of LastModified resolution) only the rescuer's renewals hold it.
            late_refusals += time.monotonic() - dead > LEASE_TTL + 1.5
        time.sleep(0.2)
    with store:
        assert store.latest().id == out["second"], "a restart took the store from the rescue: its cut was lost"
        assert late_refusals > 0, "the rescue ended within the lease ttl: the test proves nothing"
        assert store.manifest().writer.mode == "rescue:process"
        assert store.verify().ok
