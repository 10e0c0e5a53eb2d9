"""GPU capture benchmark: the stall per GiB of a cut's capture on CUDA, for both capture paths, against
the bare copies they are built from.

    .venv/bin/python benchmarks/bench_cuda.py [--gib 1] [--reps 5] [--out FILE]

Rows (median (min-max) over --reps, after a warm-up):
- ``cuda-device-copy``: ``Checkpointer.maybe_cut`` stall when the device has room for a clone (the loop
  continues after the device-to-device copy; the device-to-host copy runs on a side stream);
- ``cuda-direct``: the stall with ``device_copy=False`` (device-to-host into the pinned block before
  returning);
- bare device-to-device copy of the same tensors into preallocated device buffers;
- bare pinned device-to-host copy of the same tensors into a preallocated pinned buffer.
Exits 0 with a message when CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def build_state(gib: float, device: str):
    import torch

    total = int(gib * (1 << 30))
    state, made = {}, 0
    i = 0
    while made < total:
        n = min(4 << 20, (total - made) // 2) or 1
        state[f"w{i}"] = torch.randn(n, device=device).to(torch.bfloat16)
        made += n * 2
        i += 1
    return state, made


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("CUDA is not available here: nothing to measure (run this on a GPU machine)")
        return 0
    from ckptstore.writer import Checkpointer

    sync = torch.cuda.synchronize
    state, nbytes = build_state(args.gib, "cuda")
    gib = nbytes / (1 << 30)
    rows: dict[str, list[float]] = {k: [] for k in ("cuda-device-copy", "cuda-direct", "bare D2D", "bare pinned D2H")}
    d2d = {k: torch.empty_like(v) for k, v in state.items()}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    views, off = {}, 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        views[k] = pinned[off:off + n].view(v.dtype).view(v.shape)
        off += n

    def bare_d2d() -> None:
        for k, v in state.items():
            d2d[k].copy_(v)
        sync()

    def bare_d2h() -> None:
        for k, v in state.items():
            views[k].copy_(v, non_blocking=True)
        sync()

    modes = {}
    with tempfile.TemporaryDirectory() as d:
        for label, device_copy in (("cuda-device-copy", True), ("cuda-direct", False)):
            events: list[dict] = []
            with Checkpointer(f"{d}/{label}", every=1, mode="process", busy="wait", device_copy=device_copy,
                              on_event=events.append) as ck:
                ck.cut(0, state).wait()  # warm-up: block allocated, pinned, writer up
                for rep in range(args.reps):
                    sync()
                    t0 = time.perf_counter()
                    handle = ck.maybe_cut(rep + 1, state)
                    rows[label].append(time.perf_counter() - t0)
                    handle.wait()
                modes[label] = [e.get("capture_mode") for e in events if e["event"] == "captured"][-1]
        for _ in range(args.reps):
            rows["bare D2D"].append(timed(bare_d2d, sync))
            rows["bare pinned D2H"].append(timed(bare_d2h, sync))

    lines = [f"GPU: {torch.cuda.get_device_name()}; state {nbytes} bytes ({gib:.2f} GiB) in {len(state)} bf16 tensors; "
             f"{args.reps} reps; median (min-max)", "",
             "| path | seconds | seconds per GiB | ratio to its bare copy |", "|---|---|---|---|"]
    bare_of = {"cuda-device-copy": "bare D2D", "cuda-direct": "bare pinned D2H"}
    for k, xs in rows.items():
        if not xs:
            continue
        ratio = ""
        if k in bare_of:
            ratio = f"{statistics.median(xs) / statistics.median(rows[bare_of[k]]):.2f}x"
        lines.append(f"| {k} | {med(xs)} | {statistics.median(xs) / gib:.4f} | {ratio} |")
    lines.append("")
    lines.append(f"capture modes reported by the events: {json.dumps(modes)}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"Command: `{' '.join(sys.argv)}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
