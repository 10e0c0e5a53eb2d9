"""bench_mirror.py's parts that know nothing of the measurements: moto's server in a child process of its
own (so its CPU is not the trainer's GIL) and the Checkpointer's events as they arrive. No torch here."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

BUCKET = "ckpt"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------- the server
def serve_moto() -> int:
    """The child: moto's server on 127.0.0.1 with the bucket; prints its endpoint, serves until stdin closes."""
    from moto.server import ThreadedMotoServer
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # it logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    print(endpoint, flush=True)
    sys.stdin.read()  # EOF: the parent is done (or gone)
    server.stop()
    return 0


class MotoProcess:
    """moto's server in a child process (see the module docstring); ``options`` reach it."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)
        deadline, line = time.monotonic() + timeout, ""
        while not line.startswith("http://") and time.monotonic() < deadline:  # moto says hello first
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline().strip() if ready else ""
            if ready and not line and self.proc.poll() is not None:
                break  # it exited
        if not line.startswith("http://"):
            self.stop()
            raise RuntimeError(f"moto's server did not start within {timeout:g} s (got {line!r})")
        self.endpoint = line
        self.options = {"key": "test", "secret": "test",
                        "client_kwargs": {"endpoint_url": line, "region_name": "us-east-1"}}

    def fs(self) -> Any:
        """A fresh s3fs client (no instance cache), as each ckptstore open makes its own."""
        import fsspec

        return fsspec.filesystem("s3", **self.options, skip_instance_cache=True)

    def store_options(self) -> Any:
        import ckptstore

        return ckptstore.StoreOptions(storage_options={**self.options, "skip_instance_cache": True})

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)


# ---------------------------------------------------------------------------------------- the events
class Tracker:
    """The Checkpointer's events (its ``on_event``), each ``committed``/``mirrored`` with the perf_counter it
    arrived at; waits are bounded, and a failed cut or an upload given up ends the benchmark with that
    event (an upload the tier tries again is only counted: ``retries``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.at: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self.problems: list[dict[str, Any]] = []
        self.retries: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        with self._cond:
            kind = event["event"]
            if kind in ("committed", "mirrored"):
                self.at[(kind, str(event.get("cut")))] = (time.perf_counter(), event)
            elif kind == "mirror-failed" and event.get("retry_in") is not None:
                self.retries.append(event)  # tried again by the tier: counted, reported
            elif kind in ("failed", "mirror-failed", "mirror-skipped"):
                self.problems.append(event)
            self._cond.notify_all()

    def wait(self, kind: str, cut: str, timeout: float) -> tuple[float, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (kind, cut) not in self.at:
                if self.problems:
                    raise RuntimeError(f"cut {cut}: {self.problems[0]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {kind!r} event for cut {cut} within {timeout:g} s")
                self._cond.wait(left)
            return self.at[(kind, cut)]

    def has(self, kind: str, cut: str) -> bool:
        with self._cond:
            return (kind, cut) in self.at

    def uploading(self) -> int:
        """Cuts committed locally and not yet mirrored (with a mirror: an upload is under way or waits)."""
        with self._cond:
            return sum(1 for k, c in self.at if k == "committed" and ("mirrored", c) not in self.at)


if __name__ == "__main__":
    sys.exit(serve_moto())
