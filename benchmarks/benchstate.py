"""What both benchmarks share, with no import-time side effects (bench_store pins glibc's mmap
threshold when imported, so neither benchmark imports the other): the reference training state,
fsync of a path, the "median (min-max)" formatting and the machine lines of a report. torch is
imported lazily."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any


def build_state(gib: float, seed: int = 0):  # noqa: ANN201 - torch types imported lazily
    """A transformer-like training state: for every parameter a bf16 weight ~N(0, 0.02) (norm weights
    ~1), an fp32 exp_avg ~N(0, 1e-4) and an fp32 exp_avg_sq = 1e-8*N(0,1)^2 + 1e-12; plus six int64
    counters. At --gib 1 it is exactly limits.md's "1 GiB state" (vocab 32000, d 1024, 6 layers:
    1,083,473,968 bytes in 231 tensors). Returns (state, flat safetensors view of it, state bytes)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d = 1024
    layers = max(1, round(6 * gib))
    vocab = max(1024, int(round(32000 * gib / 64.0)) * 64)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
            p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,),
            p + "mlp.fc2.weight": (d, 4 * d), p + "mlp.fc2.bias": (d,),
        })
    shapes.update({"norm.weight": (d,), "norm.bias": (d,)})
    model: dict[str, Any] = {}
    ostate: dict[str, dict[str, Any]] = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g).mul_(0.02)
        if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "norm.weight":
            w.add_(1.0)
        model[name] = w.to(torch.bfloat16)
        del w
        ea = torch.randn(shape, generator=g).mul_(1e-4)
        eas = torch.randn(shape, generator=g).square_().mul_(1e-8).add_(1e-12)
        ostate[name] = {"exp_avg": ea, "exp_avg_sq": eas}
    counters = {k: torch.tensor(v, dtype=torch.int64) for k, v in
                [("step", 12000), ("tokens_seen", 12000 * 4096 * 256), ("epoch", 3), ("micro_step", 96000),
                 ("skipped_steps", 7), ("loss_scale_updates", 0)]}
    state = {
        "model": model,
        "optim": {
            "state": ostate,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                              "params": list(range(len(shapes)))}],
            "counters": counters,
        },
        "step": 12000,
    }
    flat: dict[str, Any] = {}
    for k, v in model.items():
        flat[f"model/{k}"] = v
    for k, st in ostate.items():
        for sk, v in st.items():
            flat[f"optim/state/{k}/{sk}"] = v
    for k, v in counters.items():
        flat[f"optim/counters/{k}"] = v
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    return state, flat, nbytes


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt(xs: list[float] | None, digits: int = 2) -> str:
    """"median (min-max)" of the values that are not None; "n/a" when there are none."""
    xs = [x for x in (xs or []) if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{med(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def machine_lines(scratch: str) -> list[str]:
    """The CPU, memory and kernel line and the file system holding ``scratch``, for a report."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    fs = "?"
    try:
        target = os.path.realpath(scratch)
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ, opts = line.split()[:4]
                if target.startswith(mnt) and len(mnt) > len(best):
                    best, fs = mnt, f"{typ} on {dev} ({mnt}, {opts})"
    except OSError:
        pass
    return [
        f"CPU: {cpu}, {os.cpu_count()} logical cores; RAM {mem_kb / 2**20:.1f} GiB; kernel {platform.release()}",
        f"Scratch file system: {fs}",
    ]
