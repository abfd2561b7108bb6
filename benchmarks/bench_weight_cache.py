"""Per-call conv2d with and without the reuse of packed weights (src/ttile/runtime/weight_cache.py).

Not a test: ``python benchmarks/bench_weight_cache.py --threads 1 2 8 16``. For each
thread count and layer it times, in seeded shuffled rounds (each timed call right after
an untimed one of the same contender), a per-call ``conv2d`` in NHWC and in NCHW with
the reuse on (whatever the thread count: the threshold ``MIN_THREADS`` is lifted) and
off, and ``Conv2d``, and prints medians and the paired ratio on/off (< 1: the reuse
helps). What decided that the reuse is used from 8 threads on.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

import ttile
from ttile.core.cpuinfo import process_cpus
from bench_semantics import rounds
from ttile.generator.networks import layer as find_layer
from ttile.runtime import weight_cache

DEFAULT_LAYERS = ("ResNet18-9", "ResNet18-10", "ResNet18-11", "ResNet18-12", "Yolo9000-18",
                  "Yolo9000-19")


def _paired(on: list, off: list) -> float:
    return statistics.median(a / b for a, b in zip(on, off))


def bench(name: str, threads: int, reps: int) -> str:
    layer = find_layer(name)
    spec, stride, pad = layer.spec(), layer.stride, layer.rs // 2
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, spec.h, spec.w, spec.c)).astype(np.float32)
    w = rng.uniform(-1, 1, (spec.r, spec.s, spec.c, spec.k)).astype(np.float32)
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    w_kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    module = ttile.Conv2d(w, stride=stride, padding=pad, layout="NHWC", threads=threads)
    cache = weight_cache.CACHE

    def call(xx, ww, layout, reuse):
        bound = cache.max_bytes
        cache.max_bytes = bound if reuse else 0
        try:
            return ttile.conv2d(xx, ww, stride=stride, padding=pad, layout=layout,
                                threads=threads)
        finally:
            cache.max_bytes = bound

    runs = {"on": lambda: call(x, w, "NHWC", True), "off": lambda: call(x, w, "NHWC", False),
            "on NCHW": lambda: call(x_nchw, w_kcrs, "NCHW", True),
            "off NCHW": lambda: call(x_nchw, w_kcrs, "NCHW", False),
            "Conv2d": lambda: module(x)}
    times = rounds(runs, reps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return (f"| {name} | {threads} | " + " | ".join(f"{med[k]:.3f}" for k in runs)
            + f" | {_paired(times['on'], times['off']):.2f} | "
            f"{_paired(times['on NCHW'], times['off NCHW']):.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--layers", nargs="+", default=list(DEFAULT_LAYERS))
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args(argv)
    ttile.set_tuning(mode="never")
    weight_cache.MIN_THREADS = 1
    cpus = process_cpus()   # not the affinity: OMP_PROC_BIND narrows it on import
    print("| layer | threads | on ms | off ms | on NCHW ms | off NCHW ms | Conv2d ms | "
          "on/off | on/off NCHW |\n|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        os.sched_setaffinity(0, cpus[:threads])
        for name in args.layers:
            print(bench(name, threads, args.reps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
