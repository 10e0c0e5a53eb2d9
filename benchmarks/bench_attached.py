"""Files attached to a cut (``files=``): what they add to the loop's stall, to the persist and to a restore.

Run (from the repository root):

    .venv/bin/python benchmarks/bench_attached.py [--mib 256] [--small 1000] [--reps 3] [--out docs/benchmarks.md]

The files are a directory of one large file (three quarters of ``--mib``) and ``--small`` small ones (the
rest), freshly written and so in the page cache, as a trainer's own journal or config would be. Every
repetition, in a rotated order, measures:

* the loop's stall of ``Checkpointer.maybe_cut(step, {}, files=DIR)`` (process mode: the files are read
  into the shared block before it returns) against the **read floor**: the same files opened and read
  with ``os.preadv`` into one prefaulted, page-aligned buffer, which is all a copy at the cut must do;
  and against the same call without files (the cut's own fixed cost: events, the hand-over);
* the time until that cut is committed against the **disk floor**: the same bytes written with O_DIRECT
  plus fsync of the file and its directory (benchfloors.odirect_write);
* ``Store.restore_files`` of the cut into an empty directory against reading the cut's shard plus
  writing the same files plainly (write + fsync each, fsync the directories): what a durable restore
  of many files cannot beat (shards are written with O_DIRECT, so the restore's read may be cold).

With ``--out FILE`` the region between ``<!-- bench_attached:begin -->`` and ``<!-- bench_attached:end -->``
of FILE is replaced (appended when missing).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shlex
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from benchfloors import odirect_write  # noqa: E402
from benchkit import GB, Series, machine_summary, ratio, read_files, rotate, write_region  # noqa: E402
from benchstate import fmt  # noqa: E402
from benchtargets import table  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.writer import Checkpointer  # noqa: E402

STALL = "maybe_cut(files=DIR) stall (files read into the shared block)"
BARE = "maybe_cut({}) stall without files (the cut's own cost)"
READ = "(floor) read: the same files, open + preadv into one page-aligned buffer"
COMMIT = "maybe_cut(files=DIR) until committed (written, hashed, fsynced, LATEST)"
DISK = "(floor) disk: the same bytes, O_DIRECT + fsync (file, dir)"
RESTORE = "Store.restore_files into an empty directory (hashed, temp + fsync + rename each)"
PLAIN = "(floor) write the same files plainly: write + fsync each, fsync the directories"
SHARD = "(floor) read the cut's shard file(s), 8 MiB readinto (what a restore must read)"


def make_files(root: str, mib: int, small: int) -> list[str]:
    total = mib << 20
    big = total * 3 // 4
    each = max(1, (total - big) // max(small, 1))
    os.makedirs(os.path.join(root, "journal"))
    paths = [os.path.join(root, "big.bin")]
    with open(paths[0], "wb") as f:
        f.write(os.urandom(big))
    for i in range(small):
        p = os.path.join(root, "journal", f"{i:05d}.log")
        with open(p, "wb") as f:
            f.write(os.urandom(each))
        paths.append(p)
    return paths


def read_floor(paths: list[str], buf: mmap.mmap) -> float:
    view = memoryview(buf)
    t0 = time.perf_counter()
    off = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            n = os.fstat(fd).st_size
            done = 0
            while done < n:
                done += os.preadv(fd, [view[off + done:off + n]], done)
        finally:
            os.close(fd)
        off = -(-(off + n) // 4096) * 4096
    secs = time.perf_counter() - t0
    view.release()
    return secs


def plain_write(paths: list[str], src_root: str, dst_root: str) -> float:
    t0 = time.perf_counter()
    dirs = set()
    for p in paths:
        rel = os.path.relpath(p, src_root)
        dst = os.path.join(dst_root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        dirs.add(os.path.dirname(dst))
        with open(p, "rb") as f:
            data = f.read()
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in sorted(dirs) + [dst_root]:
        dfd = os.open(d, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of attached files (default 256)")
    ap.add_argument("--small", type=int, default=1000, help="how many small files beside the large one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="replace the bench_attached region of this markdown file")
    ap.add_argument("--scratch", default=os.path.join(REPO, "bench-out"))
    args = ap.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    work = tempfile.mkdtemp(prefix="attached-", dir=args.scratch)
    t: dict[str, Series] = {name: Series() for name in (STALL, BARE, READ, COMMIT, DISK, RESTORE, SHARD, PLAIN)}
    try:
        src = os.path.join(work, "src")
        paths = make_files(src, args.mib, args.small)
        nbytes = sum(os.path.getsize(p) for p in paths)
        big_mib = os.path.getsize(paths[0]) >> 20
        buf = mmap.mmap(-1, -(-nbytes // 4096) * 4096 + 4096 * len(paths))
        buf.write(b"\0" * len(buf))  # prefaulted, as the writer's block is
        url = os.path.join(work, "store")
        step = 0
        with Checkpointer(url, every=1, busy="wait") as ck:
            with_files = ck.cut(step, {}, files=[src]).wait(120).id  # writer process started, block sized
            for rep in range(args.reps):
                for what in rotate(["cut", "bare", "read", "disk", "restore", "shard", "plain"], rep):
                    os.sync()
                    if what == "cut":
                        step += 1
                        t0 = time.perf_counter()
                        h = ck.maybe_cut(step, {}, files=[src])
                        t[STALL].seconds.append(time.perf_counter() - t0)
                        with_files = h.wait(600).id
                        t[COMMIT].seconds.append(time.perf_counter() - t0)
                    elif what == "bare":
                        step += 1
                        t0 = time.perf_counter()
                        h = ck.maybe_cut(step, {})
                        t[BARE].seconds.append(time.perf_counter() - t0)
                        h.wait(600)
                    elif what == "read":
                        t[READ].seconds.append(read_floor(paths, buf))
                    elif what == "disk":
                        view = memoryview(buf)[:-(-nbytes // 4096) * 4096]
                        t[DISK].seconds.append(odirect_write(work, view).wall_s)
                        view.release()
                    elif what == "restore":
                        dst = os.path.join(work, f"restore-{rep}")
                        t0 = time.perf_counter()
                        ck.store.restore_files(with_files, to=dst)
                        t[RESTORE].seconds.append(time.perf_counter() - t0)
                        shutil.rmtree(dst)
                    elif what == "shard":
                        shards = [os.path.join(url, "cuts", with_files, f.name)
                                  for f in ck.store.manifest(with_files).files]
                        t0 = time.perf_counter()
                        read_files(shards)
                        t[SHARD].seconds.append(time.perf_counter() - t0)
                    else:
                        dst = os.path.join(work, f"plain-{rep}")
                        t[PLAIN].seconds.append(plain_write(paths, os.path.dirname(src), dst))
                        shutil.rmtree(dst)
        buf.close()
        with ckptstore.Store.open(url, readonly=True) as store:
            assert store.verify().ok
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [[name, fmt(s.seconds, 3), "" if name == BARE else fmt([nbytes / GB / x for x in s.seconds], 2)]
            for name, s in t.items()]
    cmd = "python benchmarks/bench_attached.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    body = "\n".join([
        "## Attached files (`files=`)",
        "",
        f"`{cmd.strip()}`: {nbytes / GB:.3f} GB in {len(paths)} files (one of {big_mib} MiB, "
        f"{len(paths) - 1} small), in the page cache; {args.reps} repetitions in rotated order, median (min-max).",
        "",
        *table(["what", "seconds", "GB/s"], rows),
        "",
        f"- stall / read floor: {ratio(t[STALL].seconds, t[READ].seconds)}; commit / disk floor: "
        f"{ratio(t[COMMIT].seconds, t[DISK].seconds)}; restore / (shard read + plain durable write): "
        f"{ratio(t[RESTORE].seconds, [a + b for a, b in zip(t[SHARD].seconds, t[PLAIN].seconds)])}",
        *[f"- {line}" for line in machine_summary(REPO)],
    ])
    print(body)
    if args.out:
        write_region(args.out, body, "bench_attached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
