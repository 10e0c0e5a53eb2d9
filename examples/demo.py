"""The demo: a trainer takes cuts, is killed with SIGKILL mid-run, resumes, finishes; then the store is
audited with `ckptstore verify` and listed with `ckptstore ls`. A second, uninterrupted run checks that
the resumed run ends with bit-identical parameters.

Run (after scripts/setup.sh): .venv/bin/python examples/demo.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")
CLI = [sys.executable, "-m", "ckptstore.cli"]


def run_until_killed(store: str, kill_after_step: int, steps: int) -> int:
    """Starts the trainer and SIGKILLs it once a cut past ``kill_after_step`` is committed."""
    proc = subprocess.Popen([sys.executable, TRAIN, store, "--steps", str(steps)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    last = -1
    for line in proc.stdout:
        ev = json.loads(line)
        if ev.get("event") == "committed":
            last = ev["step"]
            print(f"  trainer committed step {last}")
            if last >= kill_after_step:
                os.kill(proc.pid, signal.SIGKILL)
                break
    proc.wait(timeout=60)
    print(f"  trainer killed with SIGKILL (exit {proc.returncode}) after committing step {last}")
    return last


def run_to_end(store: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, TRAIN, store, "--steps", str(steps)], capture_output=True, text=True,
                         timeout=300, check=True)
    events = [json.loads(line) for line in out.stdout.splitlines()]
    for ev in events:
        if ev["event"] == "resumed":
            print(f"  resumed from step {ev['step']} ({ev['cut']})")
    return events[-1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-demo-")
    store, reference = os.path.join(base, "store"), os.path.join(base, "reference")
    for d in (store, reference):
        shutil.rmtree(d, ignore_errors=True)

    print(f"1. training into {store}, killing it mid-run")
    run_until_killed(store, kill_after_step=args.steps // 2, steps=args.steps)
    print("2. restarting: the trainer resumes from LATEST and finishes")
    done = run_to_end(store, args.steps)
    print("3. an uninterrupted reference run")
    ref = run_to_end(reference, args.steps)
    same = done["params_blake3"] == ref["params_blake3"]
    print(f"   final parameters bit-identical to the uninterrupted run: {same}")
    print("4. ckptstore verify")
    verify = subprocess.run(CLI + ["verify", store])
    print("5. ckptstore ls")
    ls = subprocess.run(CLI + ["ls", store])
    ok = same and verify.returncode == 0 and ls.returncode == 0
    print("demo", "OK" if ok else "FAILED", f"(stores under {base})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
