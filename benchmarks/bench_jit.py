"""Run-time tuning on shapes outside the built-in networks, against PyTorch (oneDNN).

Not a test: ``python benchmarks/bench_jit.py`` (needs the bench and jit extras). Every
shape is tuned from an empty cache (a fresh temporary directory) by its first
``ttile.conv2d`` call, whose wall time (model, compiles, checks, timings, cache write)
is reported against the budget; then ttile's JIT kernel is timed side by side with
torch's three ways exactly as in ``bench_conv.py`` (single thread by default).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conv import compare_table, cpu_model, fma_peak_gflops  # noqa: E402

import ttile  # noqa: E402
from ttile.core.cpuinfo import process_cpus  # noqa: E402
from ttile.generator.networks import Layer  # noqa: E402

#: Shapes no built-in network has: odd maps, K not a multiple of 16, stride 2, 1x1, 5x5,
#: 7x7 on 3 channels.
SHAPES = (
    Layer("odd-3x3-k40", 40, 24, 23, 3),
    Layer("1x1-k100", 100, 64, 17, 1),
    Layer("5x5-s2", 64, 32, 30, 5, 2),
    Layer("7x7-s2-c3", 24, 3, 57, 7, 2),
    Layer("3x3-s2-k96", 96, 48, 35, 3, 2),
    Layer("3x3-k200-13", 200, 120, 13, 3),
    Layer("5x5-k48", 48, 48, 28, 5),
    Layer("1x1-k160-9", 160, 80, 9, 1),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--budget", type=float, default=20.0, help="tuning budget (s)")
    parser.add_argument("--output", help="also write the markdown to this file")
    args = parser.parse_args(argv)
    import torch

    cpus = process_cpus()   # not the affinity: OMP_PROC_BIND narrows it on import
    os.sched_setaffinity(0, cpus[:args.threads])
    torch.set_num_threads(args.threads)
    cache = tempfile.mkdtemp(prefix="ttile-bench-jit-")
    ttile.set_tuning(mode="now", budget_seconds=args.budget, cache_dir=cache)
    lines = [f"Measured {datetime.date.today()} on {cpu_model()}; torch {torch.__version__}; "
             f"{args.threads} thread(s), batch 1, fp32, ttile NHWC; tuning budget "
             f"{args.budget:.0f} s from an empty cache.", "",
             "| shape | K | C | H=W | R=S | stride | first call s | kernel | scheme |",
             "|---|---|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for layer in SHAPES:
        spec = layer.spec()
        x = rng.uniform(-1, 1, (1, spec.h, spec.w, spec.c)).astype(np.float32)
        w = rng.uniform(-1, 1, (spec.r, spec.s, spec.c, spec.k)).astype(np.float32)
        t0 = time.perf_counter()
        ttile.conv2d(x, w,
                     stride=layer.stride,
                         padding=layer.rs // 2, layout="NHWC", threads=args.threads)
        first = time.perf_counter() - t0
        plan = ttile.plan(x.shape, w.shape,
                          stride=layer.stride, padding=layer.rs // 2, layout="NHWC",
                          threads=args.threads)
        row = (f"| {layer.name} | {spec.k} | {spec.c} | {spec.h} | {spec.r} | {layer.stride} | "
               f"{first:.1f} | {plan.kind} | `{plan.scheme or '-'}` |")
        lines.append(row)
        print(row, flush=True)
    peak = fma_peak_gflops(args.threads, cpus=cpus[:args.threads])
    lines += ["", f"FMA peak measured: {peak:.0f} GFLOP/s", ""]

    def kind_of(layer):
        return ttile.plan((1, layer.hw, layer.hw, layer.c), (layer.rs, layer.rs, layer.c, layer.k),
                          stride=layer.stride, padding=layer.rs // 2, layout="NHWC",
                          threads=args.threads).kind

    lines += compare_table(SHAPES, args.threads, args.reps, torch, peak, kind_of)
    text = "\n".join(lines)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
