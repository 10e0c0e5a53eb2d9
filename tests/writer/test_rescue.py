"""The cut outlives its trainer: once a cut is handed to the writer process (maybe_cut returned), a
trainer SIGKILLed right after does not lose it. The orphaned writer finishes the write, commits under
the lock it inherited, and exits; nothing stays behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np

import ckptstore
from writerkit import BOUND, has_exited, wait_until

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import ckptstore
    from ckptstore.writer import Checkpointer

    url, opts, mib = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    state = {f"w{i}": np.full(mib * 65536, float(i), dtype=np.float32) for i in range(4)}
    ck = Checkpointer(url, every=1, store_options=ckptstore.StoreOptions(**opts))
    first = ck.cut(1, state).wait(60)
    for a in state.values():
        a += 1.0
    h = ck.maybe_cut(2, state, tags=["rescued?"])
    print(json.dumps({"first": first.id, "second": h.id, "writer_pid": ck.writer_pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def run_child(url: str, opts: dict, mib: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, url, json.dumps(opts), str(mib)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def check_rescued(url: str, opts: dict, out: dict) -> None:
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
    assert all(np.all(state[f"w{i}"] == i + 1.0) for i in range(4))
    with ckptstore.Store.open(url, options=ckptstore.StoreOptions(**opts)) as store:  # recovery on open
        assert store.classify().leftovers == [] and store.latest().id == out["second"]


def test_a_trainer_killed_right_after_handing_over_a_cut_loses_nothing(tmp_path):
    url = str(tmp_path / "store")
    out = run_child(url, {}, mib=16)  # 64 MiB: the writer is still writing when the trainer dies
    check_rescued(url, {}, out)


def test_rescue_on_the_s3_server(tmp_path, s3_url):
    url, opts = s3_url
    out = run_child(url, {"storage_options": opts}, mib=4)
    check_rescued(url, {"storage_options": opts}, out)
