"""The mirror tier (issue 21, "Measured"): a Checkpointer with ``mirror="s3://..."`` beside the same
Checkpointer without one, its uploads beside a plain s3fs upload, a trainer's steps while cuts upload, and
a restore from the mirror beside a plain download, all in one run against moto's server on 127.0.0.1.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/bench_mirror.py [--quick] [--mib 256] [--reps 3] [--out docs/benchmarks.md]

moto's server (``ThreadedMotoServer`` on 127.0.0.1, bucket "ckpt", credentials test/test, us-east-1, as
bench_s3_faults.py and tests/conftest.py start it) runs in a child process of its own, so its CPU is not
the trainer's GIL; it shares this machine's cores with everything measured. The state is
``ckptstore.training_state(model=...)`` of a ``torch.nn.Sequential`` of bias-free 2048x2048 float32
``Linear`` layers, ``--mib`` MiB in all (16 MiB a layer). Every Checkpointer runs in its default process
mode with ``every=1``, ``keep=KeepLast(1)``; the mirror's with ``mirror=`` a fresh prefix and no
``mirror_keep`` (so no upload is ever skipped). Times come from the Checkpointer's own events (``on_event``,
the perf_counter when each arrives) and from the trainer's clock.

1. **Stall and capture-to-committed (local)**: every repetition, in a rotated order, a fresh Checkpointer
   without a mirror and one with it take a warm-up cut and then ``--cuts`` timed cuts (``os.sync()`` and
   ``--settle`` s before each): ``maybe_cut`` returning (the stall) and ``handle.wait()`` returning (local
   LATEST durable). The mirror's cuts go one after another, so a timed cut may start while the previous
   one uploads (the report counts how many did). Paired per repetition: the mirror's median / the other's.
2. **Mirror throughput**: then one more cut of the mirror's Checkpointer with nothing else under way:
   bytes (the ``mirrored`` event's) / seconds from its ``committed`` event to its ``mirrored`` event,
   beside a plain multipart upload of the same local files by s3fs (``put_file``, ``chunksize`` =
   ckptstore's part size) right after; floors: the local read of those files (8 MiB ``readinto``) and a
   bare 1-thread blake3 pass over their bytes in memory.
3. **Trainer slowdown while cuts upload**: K chained fp32 512x512 ``torch.mm`` per step (K calibrated
   towards 30 ms), with 1 torch thread and with 2. Per repetition and variant (rotated): ``PRE`` idle
   steps, the cut between two steps, steps until it is done, ``POST`` idle steps. Ratio: median of the
   window's steps / median of the idle ones. Windows: "uploading" (mirror: steps from its ``committed``
   to its ``mirrored`` event), "writing locally" (the Checkpointer without a mirror: until committed) and
   "no cut" (30 steps with nothing under way: the noise floor).
4. **Restore from the mirror after the local tier is gone**: on the mirror of sections 1 and 2, in a rotated order,
   ``ckptstore.restore(empty_local, mirror=..., model=...)`` (whatever restore does: today one download,
   verified as it loads, with the write-back into the local tier behind it; restore by URL closes the
   store, which waits for the write-back), ``ckptstore.load(missing_local, mirror=...)``, and a plain s3fs
   download (``cat_file`` of each object of the cut) as the target's reference, plus s3fs ``get_file`` of
   them into local files + fsync. Each with a fresh s3fs client (``skip_instance_cache``).

Figures are median (min-max) over repetitions; ratios are paired per repetition; targets are judged on
their median (benchtargets.Judge). With ``--out FILE`` the region between ``<!-- bench_mirror:begin -->``
and ``<!-- bench_mirror:end -->`` of FILE is replaced (appended when missing). Speed is never asserted in
a test: this only reports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from benchkit import command_line, publish, read_files, rotate, started_at, uptime, write_region  # noqa: E402
from benchstate import fsync_path, med  # noqa: E402
from mirrorkit import BUCKET, MotoProcess, Tracker  # noqa: E402
from mirrorreport import Results, report  # noqa: E402

LAYER = 2048  # a 2048x2048 float32 Linear weight: 16 MiB
MM = 512  # the trainer's matrices: one mm is a few ms, so K mm make a step of about TARGET_STEP_S
PRE, POST, NONE_STEPS = 60, 30, 30
TARGET_STEP_S = 0.030


# ---------------------------------------------------------------------------------------- the bench
class MirrorBench:
    """The server, the model and its state, and the measurements (one per section)."""

    def __init__(self, args: argparse.Namespace, moto: MotoProcess, work: str) -> None:
        import torch
        import ckptstore

        self.args, self.moto, self.work = args, moto, work
        torch.manual_seed(0)
        layers = max(1, args.mib // 16)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])
        self.target = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])
        self.state = ckptstore.training_state(step=0, model=self.model, rng=False)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.timeout = max(120.0, args.mib * 1.0)
        self.res = Results(nbytes=self.nbytes, layers=layers, idle_steps=f"{PRE} + {POST}", mm=MM)

    def checkpointer(self, mirror: str | None, tracker: Tracker) -> tuple[Any, str]:
        import ckptstore
        from ckptstore.writer import Checkpointer

        local = tempfile.mkdtemp(prefix="local-", dir=self.work)
        kw: dict[str, Any] = {}
        if mirror is not None:
            kw = {"mirror": mirror, "mirror_options": self.moto.store_options(), "mirror_timeout": self.timeout}
        return Checkpointer(local, every=1, keep=ckptstore.KeepLast(1), on_event=tracker, **kw), local

    def new_prefix(self, what: str) -> str:
        return f"s3://{BUCKET}/{what}-{uuid.uuid4().hex[:10]}"

    def cut(self, ck: Any, tracker: Tracker, step: int, mirrored: bool) -> Any:
        """One untimed cut, waited for (and for its upload with ``mirrored``)."""
        h = ck.maybe_cut(step, self.state)
        h.wait(self.timeout)
        if mirrored:
            tracker.wait("mirrored", h.id, self.timeout)
        return h

    # -------------------------------------------------------------------- sections 1, 2 and 4
    def repetition(self, rep: int) -> None:
        for variant in rotate(["none", "mirror"], rep):
            prefix = self.new_prefix("mirror") if variant == "mirror" else None
            tracker = Tracker()
            ck, local = self.checkpointer(prefix, tracker)
            try:
                self.cut(ck, tracker, 0, prefix is not None)  # warm-up: the writer process, the block
                self.timed_cuts(ck, tracker, variant, rep)
                if prefix is not None:
                    self.throughput(ck, tracker, local, rep)
            finally:
                ck.close()
                shutil.rmtree(local, ignore_errors=True)
                self.res.retries += len(tracker.retries)
            if prefix is not None:
                self.restores(prefix, rep)
                self.moto.fs().rm(prefix, recursive=True)  # moto keeps objects in memory

    def timed_cuts(self, ck: Any, tracker: Tracker, variant: str, rep: int) -> None:
        stalls, commits = [], []
        for step in range(1, self.args.cuts + 1):
            os.sync()
            time.sleep(self.args.settle)
            if variant == "mirror" and tracker.uploading():
                self.res.overlapped += 1
            t0 = time.perf_counter()
            h = ck.maybe_cut(step, self.state)
            t1 = time.perf_counter()
            h.wait(self.timeout)
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            commits.append(t2 - t0)
        if variant == "mirror":
            tracker.wait("mirrored", h.id, self.timeout)  # uploads go in step order: the last is last
            self.res.timed_mirror_cuts += len(stalls)
        self.res.stall[variant].append(med(stalls))
        self.res.commit[variant].append(med(commits))

    def throughput(self, ck: Any, tracker: Tracker, local: str, rep: int) -> None:
        """Section 2 on the mirror's Checkpointer: one cut with nothing else under way, then the floors."""
        from benchfloors import blake3_pass

        os.sync()
        time.sleep(self.args.settle)
        h = self.cut(ck, tracker, self.args.cuts + 1, True)
        t_committed, _ = tracker.wait("committed", h.id, self.timeout)
        t_mirrored, ev = tracker.wait("mirrored", h.id, self.timeout)
        r = self.res
        r.mirror_s.append(t_mirrored - t_committed)
        r.mirror_event_s.append(float(ev.get("seconds") or 0.0))
        r.mirror_bytes.append(int(ev.get("bytes") or 0))
        cut_dir = os.path.join(local, "cuts", h.id)
        paths = sorted(os.path.join(cut_dir, n) for n in os.listdir(cut_dir))
        r.files_bytes.append(sum(os.path.getsize(p) for p in paths))
        r.plain_up_s.append(self.plain_upload(paths))
        t0 = time.perf_counter()
        read_files(paths)
        r.read_s.append(time.perf_counter() - t0)
        data = bytearray()
        for p in paths:
            with open(p, "rb") as f:
                data += f.read()
        r.blake3_s.append(blake3_pass(memoryview(data), threads=1).wall_s)

    def plain_upload(self, paths: list[str]) -> float:
        """s3fs multipart uploads of the cut's local files, ckptstore's part size, into a fresh prefix."""
        try:
            from ckptstore.storage.multipart import PART_BYTES
        except ImportError:  # moved: the part size it had when this was written
            PART_BYTES = 16 << 20
        fs, prefix = self.moto.fs(), self.new_prefix("plain")
        t0 = time.perf_counter()
        for p in paths:
            fs.put_file(p, f"{prefix}/{os.path.basename(p)}", chunksize=PART_BYTES)
        secs = time.perf_counter() - t0
        fs.rm(prefix, recursive=True)
        return secs

    def restores(self, prefix: str, rep: int) -> None:
        """Section 4 on the mirror's cuts, in a rotated order (see the module docstring)."""
        import ckptstore

        with ckptstore.Store.open(prefix, readonly=True, options=self.moto.store_options()) as mirror:
            cut = mirror.latest()
        assert cut is not None, f"{prefix}: no cut on the mirror"
        objects = sorted(self.moto.fs().find(f"{prefix}/cuts/{cut.id}"))
        self.res.restore_bytes = sum(self.moto.fs().sizes(objects))
        methods: dict[str, Callable[[], float]] = {
            "restore": lambda: self.restore_once(prefix, cut.id),
            "load": lambda: self.load_once(prefix),
            "cat": lambda: self.download(objects, into=None),
            "get": lambda: self.download(objects, into=tempfile.mkdtemp(prefix="get-", dir=self.work)),
        }
        for name in rotate(list(methods), rep):
            os.sync()
            self.res.restore[name].append(methods[name]())

    def restore_once(self, prefix: str, cut: str) -> float:
        import ckptstore
        import torch

        local = os.path.join(self.work, f"gone-{uuid.uuid4().hex[:8]}")  # a replaced node: no local tier
        for p in self.target.parameters():
            p.data.zero_()
        t0 = time.perf_counter()
        resumed = ckptstore.restore(local, mirror=prefix, mirror_options=self.moto.store_options(), model=self.target)
        secs = time.perf_counter() - t0
        assert resumed is not None and resumed.cut.id == cut, f"{local}: restored {resumed}, not cut {cut}"
        self.res.restore_tier = resumed.tier
        assert all(torch.equal(a, b) for a, b in zip(self.target.parameters(), self.model.parameters())), \
            f"{prefix}: cut {cut} restored other bytes than the model's"
        shutil.rmtree(local, ignore_errors=True)
        return secs

    def load_once(self, prefix: str) -> float:
        import ckptstore

        local = os.path.join(self.work, f"missing-{uuid.uuid4().hex[:8]}")
        t0 = time.perf_counter()
        state = ckptstore.load(local, mirror=prefix, mirror_options=self.moto.store_options())
        secs = time.perf_counter() - t0
        assert sorted(state["model"]) == sorted(self.model.state_dict()), f"{prefix}: another state loaded"
        assert not os.path.exists(local)
        return secs

    def download(self, objects: list[str], into: str | None) -> float:
        """A plain s3fs download of the objects: into memory (``cat_file``), or into files + fsync."""
        fs = self.moto.fs()
        t0 = time.perf_counter()
        for o in objects:
            if into is None:
                fs.cat_file(o)
                continue
            dst = os.path.join(into, o.replace("/", "_"))
            fs.get_file(o, dst)
            fsync_path(dst)
        if into is not None:
            fsync_path(into)
        secs = time.perf_counter() - t0
        if into is not None:
            shutil.rmtree(into, ignore_errors=True)
        return secs

    # -------------------------------------------------------------------- section 3
    def trainer(self, threads: int) -> None:
        """Section 3 for one torch thread count: a mirror's and a plain Checkpointer, one cut per window."""
        import torch

        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(1)
        a, b = torch.randn(MM, MM, generator=g), torch.randn(MM, MM, generator=g) / 16
        k = calibrate(a, b)

        def step() -> tuple[float, float]:
            t0 = time.perf_counter()
            x = a
            for _ in range(k):
                x = torch.mm(x, b)
            return t0, time.perf_counter()

        trackers = {"mirror": Tracker(), "local": Tracker()}
        prefix = self.new_prefix("loop")
        cks = {v: self.checkpointer(prefix if v == "mirror" else None, trackers[v]) for v in trackers}
        try:
            for v, (ck, _) in cks.items():
                self.cut(ck, trackers[v], 0, v == "mirror")
            n = 0
            for rep in range(self.args.loop_reps):
                for variant in rotate(["mirror", "local", "none"], rep):
                    n += 1
                    ck = cks[variant][0] if variant != "none" else None
                    ratio = self.window(step, variant, ck, trackers.get(variant), n)
                    self.res.loop[threads][variant].append(ratio)
        finally:
            for ck, local in cks.values():
                ck.close()
                shutil.rmtree(local, ignore_errors=True)
            self.res.retries += sum(len(t.retries) for t in trackers.values())
            self.moto.fs().rm(prefix, recursive=True)
        self.res.loop_k[threads] = k

    def window(self, step: Callable[[], tuple[float, float]], variant: str, ck: Any, tracker: Tracker | None,
               n: int) -> tuple[float, float, int]:
        """One repetition: idle steps, the cut, the window's steps, idle steps; (median ratio, p90 ratio, steps)."""
        os.sync()
        pre = [step() for _ in range(PRE)]
        if ck is None:
            window = [step() for _ in range(NONE_STEPS)]
        else:
            h = ck.maybe_cut(n, self.state)
            kind = "mirrored" if variant == "mirror" else "committed"
            window = []
            deadline = time.monotonic() + self.timeout
            while not tracker.has(kind, h.id):
                if time.monotonic() > deadline or tracker.problems:
                    tracker.wait(kind, h.id, 0.001)  # raises, naming the event or the timeout
                window.append(step())
            if variant == "mirror":  # only the steps from the local commit to the upload's end
                start = tracker.wait("committed", h.id, self.timeout)[0]
                end = tracker.wait("mirrored", h.id, self.timeout)[0]
                window = [s for s in window if s[0] >= start and s[1] <= end]
        post = [step() for _ in range(POST)]
        idle = med([e - s for s, e in pre + post])
        times = sorted(e - s for s, e in window)
        if not times:
            return float("nan"), float("nan"), 0
        return med(times) / idle, times[int(0.9 * (len(times) - 1))] / idle, len(times)


def calibrate(a: Any, b: Any) -> int:
    """K chained mm that make a step last about TARGET_STEP_S (10 untimed mm, then 30 timed)."""
    import torch

    for _ in range(10):
        torch.mm(a, b)
    one = []
    for _ in range(30):
        t0 = time.perf_counter()
        torch.mm(a, b)
        one.append(time.perf_counter() - t0)
    return max(1, round(TARGET_STEP_S / med(one)))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2 repetitions, 2 cuts, 0.2 s settle (~1 min)")
    ap.add_argument("--mib", type=int, help="MiB of model weights in the state (default 256; --quick 32)")
    ap.add_argument("--reps", type=int, help="repetitions of sections 1, 2 and 4 (default 3; --quick 2)")
    ap.add_argument("--cuts", type=int, help="timed cuts per Checkpointer and repetition (default 3; --quick 2)")
    ap.add_argument("--loop-reps", type=int, help="repetitions per variant of section 3 (default 3; --quick 2)")
    ap.add_argument("--settle", type=float, help="s of idle after os.sync() before each timed cut (default 1)")
    ap.add_argument("--threads-list", default="1,2", help="trainer thread counts for section 4 (default 1,2)")
    ap.add_argument("--out", help="replace the bench_mirror region of this markdown file")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"), help="scratch parent directory")
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    quick = {"mib": 32, "reps": 2, "cuts": 2, "loop_reps": 2, "settle": 0.2}
    full = {"mib": 256, "reps": 3, "cuts": 3, "loop_reps": 3, "settle": 1.0}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    meta = {"cmd": command_line("bench_mirror.py", argv), "started": started_at(), "load_before": uptime()}
    t0 = time.perf_counter()
    os.makedirs(args.scratch, exist_ok=True)
    moto = MotoProcess()
    work = tempfile.mkdtemp(prefix="mirror-", dir=args.scratch)
    try:
        bench = MirrorBench(args, moto, work)
        for rep in range(args.reps):
            bench.repetition(rep)
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)
        for threads in (int(x) for x in args.threads_list.split(",")):
            bench.trainer(threads)
            print(f"trainer with {threads} thread(s) done", flush=True)
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    meta.update(took=f"{time.perf_counter() - t0:.0f}", load_after=uptime())
    body = report(bench.res, args, meta)
    publish(body, args.out, lambda path, text: write_region(path, text, "bench_mirror"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
