"""Runs a job of several ranks as real processes (torch.distributed, gloo, TCP rendezvous on 127.0.0.1).

``run_job`` starts one worker script per rank (``rank_worker.py`` unless told otherwise) with a scenario
name and a config, waits for all (bounded), and returns each rank's exit code and the JSON result it
wrote. A worker script's ``main`` is :func:`worker_main`. Ranks may kill themselves with SIGKILL in a
scenario; their exit code is then -9 and they write no result.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    result: dict[str, Any] | None
    stderr: str

    @property
    def killed(self) -> bool:
        return self.returncode == -9


def run_job(out_dir: str, world: int, scenario: str, *, timeout: float = 90, worker: str = WORKER,
            **config: Any) -> list[RankResult]:
    """Runs ``scenario`` of the ``worker`` script on ``world`` ranks; every rank gets ``config`` (JSON)
    and writes ``out_dir/rank<r>.json``."""
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        for name in (f"rank{rank}.json", f"rank{rank}.err"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        cfg = {"scenario": scenario, "rank": rank, "world": world, "port": port, "out_dir": out_dir, **config}
        err = open(os.path.join(out_dir, f"rank{rank}.err"), "w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(WORKER)), os.getcwd()])}
        procs.append((subprocess.Popen([sys.executable, worker, json.dumps(cfg)], stdout=err, stderr=subprocess.STDOUT,
                                       env=env), err))
    deadline = time.monotonic() + timeout
    results = []
    for rank, (p, err) in enumerate(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise AssertionError(f"rank {rank} of scenario {scenario!r} still running after {timeout} s:\n"
                                 + _read(os.path.join(out_dir, f"rank{rank}.err")))
        err.close()
    for rank, (p, _) in enumerate(procs):
        path = os.path.join(out_dir, f"rank{rank}.json")
        res = json.load(open(path)) if os.path.exists(path) else None
        results.append(RankResult(rank, p.returncode, res, _read(os.path.join(out_dir, f"rank{rank}.err"))))
    return results


def _read(path: str) -> str:
    try:
        return open(path).read()[-4000:]
    except OSError:
        return ""


def describe(results: list[RankResult]) -> str:
    return "\n".join(f"rank {r.rank}: rc={r.returncode} result={r.result}\n{r.stderr[-1500:]}" for r in results)


def worker_main(scope: dict[str, Any], make_arg: Callable[[dict[str, Any]], Any] = lambda cfg: cfg) -> None:
    """The ``main`` of a worker script: joins the gloo job, runs ``scope["scenario_<name>"]`` on
    ``make_arg(config)``, writes its result (or the error it raised) to ``out_dir/rank<r>.json``. Rank
    0's process hosts the rendezvous store (tcp://), so it stays until the other ranks wrote their
    results, as a job's final barrier would (never waiting for a ``victim`` that was killed)."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        res = scope[f"scenario_{cfg['scenario']}"](make_arg(cfg))
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        res = {**failure(exc), "traceback": traceback.format_exc()}
    with open(os.path.join(cfg["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if rank == 0:
        others = [r for r in range(1, world) if r != cfg.get("victim")]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(cfg["out_dir"], f"rank{r}.json")) for r in others):
            time.sleep(0.05)
    os._exit(0)  # never wait in destroy_process_group for a rank that is gone


def failure(exc: BaseException) -> dict[str, Any]:
    """A scenario's failure as its JSON result."""
    return {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
            "failed_ranks": getattr(exc, "ranks", None)}
