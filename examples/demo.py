"""The demo: a trainer takes cuts, is killed with SIGKILL mid-run, resumes, finishes; then the store is
audited with `ckptstore verify` and listed with `ckptstore ls`. A second, uninterrupted run checks that
the resumed run ends with bit-identical parameters.

``--ranks N`` runs the same story with an FSDP2 job of N ranks (torch.distributed.run, gloo on CPU):
the whole job is SIGKILLed, restarts, and every rank's shards must end bit-identical.

Run (after scripts/setup.sh): .venv/bin/python examples/demo.py [--dir DIR] [--ranks N]
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
TRAIN_RANKS = os.path.join(HERE, "train_ranks.py")
CLI = [sys.executable, "-m", "ckptstore.cli"]


def command(store: str, steps: int, ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, TRAIN, store, "--steps", str(steps)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            TRAIN_RANKS, store, "--steps", str(steps)]


def events_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def kill_tree(pid: int) -> None:
    """SIGKILLs a process and every descendant at once, as a node dying would (torch.distributed.run
    puts its workers in sessions of their own, so a process group is not enough)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    doomed, todo = [], [pid]
    while todo:
        p = todo.pop()
        doomed.append(p)
        todo.extend(children.get(p, []))
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_until_killed(store: str, kill_after_step: int, steps: int, ranks: int) -> int:
    """Starts the job and SIGKILLs all of it (every process of its session) once a cut past
    ``kill_after_step`` is committed."""
    proc = subprocess.Popen(command(store, steps, ranks), stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    last = -1
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        if ev.get("event") == "committed":
            last = ev["step"]
            print(f"  job committed step {last}" + (f" (all {ev['world_size']} ranks)" if "world_size" in ev else ""))
            if last >= kill_after_step:
                kill_tree(proc.pid)
                break
    proc.wait(timeout=60)
    print(f"  job killed with SIGKILL (exit {proc.returncode}) after committing step {last}")
    return last


def run_to_end(store: str, steps: int, ranks: int) -> dict[int, str]:
    """Runs the job to its end; returns each rank's final parameter digest."""
    out = subprocess.run(command(store, steps, ranks), capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(f"the job failed with exit {out.returncode}")
    digests = {}
    for ev in events_of(out.stdout):
        if ev["event"] == "resumed":
            print(f"  resumed from step {ev['step']} ({ev['cut']})")
        if ev["event"] == "finished":
            digests[ev.get("rank", 0)] = ev["params_blake3"]
    return digests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 60, or 40 with --ranks)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks of the job (>1: FSDP2 over torch.distributed.run)")
    args = ap.parse_args()
    steps = args.steps or (60 if args.ranks == 1 else 40)
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-demo-")
    store, reference = os.path.join(base, "store"), os.path.join(base, "reference")
    for d in (store, reference):
        shutil.rmtree(d, ignore_errors=True)

    who = "the trainer" if args.ranks == 1 else f"a job of {args.ranks} ranks"
    print(f"1. training {who} into {store}, killing it mid-run")
    run_until_killed(store, kill_after_step=steps // 2, steps=steps, ranks=args.ranks)
    print("2. restarting: it resumes from LATEST and finishes")
    done = run_to_end(store, steps, args.ranks)
    print("3. an uninterrupted reference run")
    ref = run_to_end(reference, steps, args.ranks)
    same = len(done) == args.ranks and done == ref
    print(f"   final parameters (every rank's) bit-identical to the uninterrupted run: {same}")
    print("4. ckptstore verify")
    verify = subprocess.run(CLI + ["verify", store])
    print("5. ckptstore ls")
    ls = subprocess.run(CLI + ["ls", store])
    ok = same and verify.returncode == 0 and ls.returncode == 0
    print("demo", "OK" if ok else "FAILED", f"(stores under {base})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
