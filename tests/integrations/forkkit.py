"""A fork server for the integration tests: import a framework once, run each trainer as its own process.

Importing torch with transformers or Lightning costs about 10 s of CPU, most of what a tiny run costs;
the tests run up to six of them on two shared cores. So a run script (``hf_trainer.py``,
``lightning_ddp.py``) started with ``--serve`` calls :func:`serve`: it imports its framework once and
then forks one process per run. The test talks to it through :class:`Server`.

Protocol (stdin and stdout of the server, JSON lines): the test writes one line per phase,
``[{"id", "argv", "log", "env"}, ...]``; the server forks a process for each (``env`` added to
``os.environ``, stdin from /dev/null, stdout and stderr to ``log``, then ``main(argv)``), waits for all
of them and prints ``{"event": "exited", "id", "pid", "returncode"}`` per run (``-9`` after a SIGKILL),
then ``{"event": "phase-done"}``. A run is a process of its own that shares nothing with the others but
the imported code: it builds its model, trainer and store handles itself, and a resumed run gets its
state only from the store. The ranks of a torch.distributed job are runs of one phase, each with its
own ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` in ``env`` (as torchrun would set them).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

RUN_TIMEOUT = 300  # seconds for one phase; a bound on a hang, not a clock


# ------------------------------------------------------------------------------------- server side
def serve(main: Callable[[list[str]], int]) -> int:
    """The server loop (module docstring): one phase per stdin line, until EOF."""
    import torch

    torch.set_num_threads(1)  # no intra-op pool before fork (libgomp's is not fork-safe); runs do the same
    for line in sys.stdin:
        children: dict[int, str] = {}
        for job in json.loads(line):
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(main, job["argv"], job["log"], job.get("env") or {})
            children[pid] = job["id"]
        for pid, job_id in children.items():
            _, status = os.waitpid(pid, 0)
            print(json.dumps({"event": "exited", "id": job_id, "pid": pid,
                              "returncode": os.waitstatus_to_exitcode(status)}), flush=True)
        print(json.dumps({"event": "phase-done"}), flush=True)
    return 0


def _child(main: Callable[[list[str]], int], argv: list[str], log: str, env: dict[str, str]) -> None:
    """In a forked run: the job's environment, stdin from /dev/null, stdout and stderr to ``log``;
    never returns."""
    code = 70
    try:
        os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback goes to the run's log, the status says it failed
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never run the parent's atexit handlers or wait in a process group's teardown


def say(**doc: Any) -> None:
    """One JSON event line on stdout (a run's log), flushed before anything can kill the run."""
    print(json.dumps(doc), flush=True)


# --------------------------------------------------------------------------------------- test side
class Run:
    """One run forked by the :class:`Server`: its log (our JSON events), exit code and output; ``out``
    is where the run writes its end state, if it does."""

    def __init__(self, run_id: str, argv: list[str], log: str, env: dict[str, str] | None = None,
                 out: str | None = None) -> None:
        self.id, self.argv, self.log, self.env, self.out = run_id, argv, log, env or {}, out
        self.pid: int | None = None
        self.returncode: int | None = None
        self.events: list[dict[str, Any]] = []
        self.output = ""

    def end_state(self) -> Any:
        """The end state the run wrote to ``out`` (a file of the test's own run, so torch.load may
        unpickle); fails with the run's log unless it exited 0."""
        import torch

        assert self.returncode == 0, self.output[-4000:]
        assert self.out is not None
        return torch.load(self.out, weights_only=False)

    def exited(self, pid: int, returncode: int) -> None:
        self.pid, self.returncode = pid, returncode
        self.output = Path(self.log).read_text()
        # Frameworks print their own logs too (the Trainer's as Python dicts: {'loss': ...}); ours are JSON.
        self.events = [json.loads(line) for line in self.output.splitlines() if line.startswith('{"')]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of a one-node job (env:// rendezvous on localhost)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "NODE_RANK": "0", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``SCRIPT --serve``, started once; :meth:`phase` forks runs through it."""

    def __init__(self, script: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(script), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(script.parents[2]))
        # A reader thread, not select() on the pipe: readline buffers lines that select cannot see.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # EOF: the server died

    def phase(self, *runs: Run) -> None:
        """Starts ``runs`` at once and returns when all have exited."""
        assert self.proc.stdin is not None
        by_id = {r.id: r for r in runs}
        jobs = [{"id": r.id, "argv": r.argv, "log": r.log, "env": r.env} for r in runs]
        self.proc.stdin.write(json.dumps(jobs) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + RUN_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            assert line, f"fork server {'hung' if line is None else 'died'}; logs: " + "".join(
                Path(r.log).read_text()[-2000:] for r in runs if os.path.exists(r.log))
            doc = json.loads(line)
            if doc["event"] == "phase-done":
                return
            by_id[doc["id"]].exited(doc["pid"], doc["returncode"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


