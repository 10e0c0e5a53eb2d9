"""The demo: a trainer takes cuts into a local directory, each one copied into a mirror (a second
directory standing for the durable tier: on a cluster an s3:// URL with mirror_options), is killed with
SIGKILL mid-run, resumes, finishes; a second, uninterrupted run checks that the resumed run ends with
bit-identical parameters. Then the local tier is deleted (a replaced node) and the same command restores
from the mirror; `ckptstore verify --mirror` audits both tiers and `ckptstore resume-info --json` shows
the mirror's lag (issue 21).

``--ranks N`` runs the first story with an FSDP2 job of N ranks (torch.distributed.run, gloo on CPU), no
mirror: the whole job is SIGKILLed, restarts, and every rank's shards must end bit-identical.

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


def command(store: str, steps: int, ranks: int, mirror: str | None = None) -> list[str]:
    if ranks == 1:
        return [sys.executable, TRAIN, store, "--steps", str(steps)] + (["--mirror", mirror] if mirror else [])
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


def run_until_killed(store: str, kill_after_step: int, steps: int, ranks: int, mirror: str | None) -> int:
    """Starts the job and SIGKILLs all of it (every process of its session, its writer too) once a cut
    past ``kill_after_step`` is committed."""
    proc = subprocess.Popen(command(store, steps, ranks, mirror), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    last = -1
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        if ev.get("event") in ("mirrored", "mirror-skipped"):
            print(f"  the mirror {'committed' if ev['event'] == 'mirrored' else 'skipped'} step {ev['step']}")
        if ev.get("event") == "committed":
            last = ev["step"]
            print(f"  job committed step {last}" + (f" (all {ev['world_size']} ranks)" if "world_size" in ev else ""))
            if last >= kill_after_step:
                kill_tree(proc.pid)
                break
    proc.wait(timeout=60)
    print(f"  job killed with SIGKILL (exit {proc.returncode}) after committing step {last}")
    return last


def start_job(store: str, steps: int, ranks: int, mirror: str | None = None) -> subprocess.Popen:
    # Its output (about 12 KB for 60 steps) fits in the pipe until finish_job reads it.
    return subprocess.Popen(command(store, steps, ranks, mirror), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish_job(proc: subprocess.Popen) -> dict[int, str]:
    """Waits for the job's end; returns each rank's final parameter digest. Prints where it resumed
    from and what reached the mirror."""
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        sys.stderr.write(out[-3000:] + err[-3000:])
        raise SystemExit(f"the job failed with exit {proc.returncode}")
    digests: dict[int, str] = {}
    mirror: dict[str, list[str]] = {"mirrored": [], "mirror-skipped": []}
    for ev in events_of(out):
        if ev["event"] == "resumed":
            tier = f", {ev['tier']} tier" if "tier" in ev else ""
            print(f"  resumed from step {ev['step']} ({ev['cut']}){tier}")
        if ev["event"] in mirror:
            mirror[ev["event"]].append(str(ev["step"]))
        if ev["event"] == "finished":
            digests[ev.get("rank", 0)] = ev["params_blake3"]
    if mirror["mirrored"]:
        skipped = mirror["mirror-skipped"]
        print(f"  the mirror committed step(s) {', '.join(mirror['mirrored'])}"
              + (f"; skipped {', '.join(skipped)} (a backlog keeps what mirror_keep keeps)" if skipped else ""))
    return digests


def cli(*argv: str) -> bool:
    print(f"$ ckptstore {' '.join(argv)}", flush=True)
    return subprocess.run(CLI + list(argv)).returncode == 0


def replaced_node(store: str, mirror: str, steps: int, ref: dict[int, str]) -> bool:
    """The node is replaced: its local tier is gone. The same command restores from the mirror (and
    writes the cut back locally); then both tiers are audited and the mirror's lag is shown."""
    print(f"5. a replaced node: {store} deleted, the same command restores out of the mirror")
    shutil.rmtree(store)
    back = finish_job(start_job(store, steps, 1, mirror))
    same = back == ref
    print(f"   parameters restored from the mirror bit-identical to the uninterrupted run: {same}")
    print("6. the audit of both tiers, and the mirror's lag")
    verify = cli("verify", store, "--mirror")
    info = cli("resume-info", store, "--json")
    return same and verify and info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 60, or 40 with --ranks)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks of the job (>1: FSDP2 over torch.distributed.run)")
    args = ap.parse_args()
    steps = args.steps or (60 if args.ranks == 1 else 40)
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-demo-")
    store, reference = os.path.join(base, "store"), os.path.join(base, "reference")
    # The durable tier, a directory here (no network in the demo); on a cluster: mirror="s3://bucket/run1"
    # with mirror_options. The job of several ranks tells the one-tier story, kept short for its test.
    mirror = os.path.join(base, "mirror") if args.ranks == 1 else None
    for d in (store, reference, mirror):
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    who = "the trainer" if args.ranks == 1 else f"a job of {args.ranks} ranks"
    tiers = f" (mirror {mirror})" if mirror else ""
    print(f"1. training {who} into {store}{tiers}, killing it mid-run")
    # One process: the reference run goes on beside steps 1 and 2 (it shares nothing with them), so the
    # mirror's added steps cost little wall time where a core is spare. Several ranks: after them, as before.
    beside = start_job(reference, steps, 1) if args.ranks == 1 else None
    try:
        run_until_killed(store, kill_after_step=steps // 2, steps=steps, ranks=args.ranks, mirror=mirror)
        print("2. restarting: it resumes from LATEST and finishes" + (", and the mirror catches up" if mirror else ""))
        done = finish_job(start_job(store, steps, args.ranks, mirror))
        print("3. an uninterrupted reference run" + (f" (it ran beside 1 and 2, into {reference})" if beside else ""))
        ref = finish_job(beside or start_job(reference, steps, args.ranks))
    finally:
        if beside is not None and beside.poll() is None:  # a failed step: leave no job behind
            kill_tree(beside.pid)
            beside.communicate()
    same = len(done) == args.ranks and done == ref
    print(f"   final parameters (every rank's) bit-identical to the uninterrupted run: {same}")
    if mirror is None:
        print("4. the audit and the store's cuts")
        audited = [cli("verify", store), cli("ls", store)]
    else:  # the audit comes after the restore from the mirror, of both tiers (replaced_node)
        print("4. the store's cuts, and which of them are on the mirror")
        audited = [cli("ls", store), replaced_node(store, mirror, steps, ref)]
    ok = same and all(audited)
    print("demo", "OK" if ok else "FAILED", f"(stores under {base})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
