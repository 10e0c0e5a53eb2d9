"""The checkpointing methods bench_writer's ``mem`` and ``loop`` children compare, behind one
start()/done()/wait() interface: ckptstore's Checkpointer in its modes, DCP's async_save with either
executor, a CPU-spinning control and no checkpoint at all (split out of bench_writer.py, issue 20).
torch and ckptstore are imported when a Saver is made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

from benchkit import free_port, fsync_path

# The "spin" control: a nice-10 process that only spins a pure-Python loop (no I/O, hardly any memory
# traffic) for SPIN_S seconds, about as long as a ckptstore cut is in flight. What it costs the trainer
# is what any writer that keeps a core busy costs on this machine, whatever it does with the core.
SPIN_S = 2.5
SPIN_CODE = f"import os, time\nos.nice(10)\nend = time.monotonic() + {SPIN_S}\nwhile time.monotonic() < end:\n    pass\n"
# Which variants each section runs (bench_writer's parent starts one child per variant).
LOOP_VARIANTS = {
    1: ["none", "spin", "ckpt-process", "ckpt-process-pin", "ckpt-process-idleio", "ckpt-thread", "dcp-thread",
        "dcp-process"],
    2: ["none", "spin", "ckpt-process", "ckpt-process-nice19", "ckpt-process-idleio", "ckpt-thread", "dcp-thread",
        "dcp-process"],
}
MEM_VARIANTS = ["ckpt-process", "dcp-thread", "dcp-process"]


def init_gloo() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


class Saver:
    """One checkpointing method behind a common start()/done()/wait() interface (section 4 and 3)."""

    def __init__(self, variant: str, scratch: str, nbytes: int) -> None:
        self.variant = variant
        self.scratch = scratch
        self.nbytes = nbytes
        self.ck = None
        self.fut = None
        self.handle = None
        self.done_at: float | None = None
        self.dirs: list[str] = []
        self.step = 0
        self.events: list[dict[str, Any]] = []
        if variant.startswith("ckpt-"):
            from ckptstore.writer import Checkpointer

            kw: dict[str, Any] = {"mode": "thread" if variant == "ckpt-thread" else "process"}
            if "idleio" in variant:
                kw["idle_io"] = True
            if variant.endswith("-nice19"):
                kw["nice"] = 19
            if "pin" in variant:
                cpus = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
                kw["cpu_affinity"] = (cpus[-1],)
            self.kw = kw
            self.ck = Checkpointer(os.path.join(scratch, "store"), every=1, on_event=self._on_event, **kw)
        elif variant == "dcp-process":
            init_gloo()
        self.proc: subprocess.Popen | None = None

    def _on_event(self, e: dict[str, Any]) -> None:
        if e["event"] == "committed":
            self.done_at = time.perf_counter()
        self.events.append(e)

    def start(self, state: Any) -> float:
        """Starts one save; returns the time the call blocked."""
        self.done_at = None
        self.step += 1
        if self.ck is not None:
            t0 = time.perf_counter()
            self.handle = self.ck.maybe_cut(self.step, state)
            blocked = time.perf_counter() - t0
            assert self.handle is not None
            return blocked
        if self.variant == "none":
            return 0.0
        if self.variant == "spin":
            t0 = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, "-c", SPIN_CODE])
            return time.perf_counter() - t0
        import torch.distributed.checkpoint as dcp

        d = os.path.join(self.scratch, f"dcp-{self.step}")
        self.dirs.append(d)
        kw: dict[str, Any] = {}
        if self.variant == "dcp-process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(d), **kw)
        blocked = time.perf_counter() - t0
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse in newer torch
        self.fut = fut

        def _mark(_f: Any) -> None:
            self.done_at = time.perf_counter()

        fut.add_done_callback(_mark)
        return blocked

    def done(self) -> bool:
        if self.ck is not None:
            return self.handle is not None and self.handle.done
        if self.proc is not None:
            if self.proc.poll() is None:
                return False
            if self.done_at is None:
                self.done_at = time.perf_counter()
            return True
        if self.fut is not None:
            return self.fut.done()
        return True

    def wait(self) -> None:
        if self.ck is not None and self.handle is not None:
            self.handle.wait()
        elif self.proc is not None:
            self.proc.wait()
            self.done()
        elif self.fut is not None:
            self.fut.result()
            d = self.dirs[-1]
            fsync_path(d)
            while self.done_at is None:  # the callback runs right after result() is set
                time.sleep(0.001)

    def cleanup(self) -> None:
        """Removes every saved checkpoint but the newest (outside any timed window)."""
        if self.ck is not None:
            from ckptstore import KeepLast

            self.ck.store.prune(KeepLast(1))
        for d in self.dirs[:-1]:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = self.dirs[-1:]

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
        if self.variant == "dcp-process":
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
