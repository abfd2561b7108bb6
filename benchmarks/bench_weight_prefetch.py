"""Run-time-tuned kernels with and without their weight prefetch, weights warm and cold.

Not a test: run it by hand::

    python benchmarks/bench_weight_prefetch.py --threads 1

For each layer (by default the 1x1 layers of MobileNetV2 and ResNet-50 whose weights
outweigh their inputs, where a network pays most for weights coming from memory), the
scheme run-time tuning picks on this CPU is generated twice, with and without
``weight_prefetch`` (``ttile.core.codegen``), and each is timed in alternation: warm (the
call before left the weights in the caches, a layer called in a loop) and cold (its packed
weights evicted from every cache level before the call, the input still warm: a layer
inside a network whose other layers pushed its weights out). Medians of ``--reps`` calls;
both kernels' outputs are compared bit for bit first.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time

import numpy as np

import ttile
from ttile import _kernels
from ttile.core import cbuild, codegen
from ttile.core.scheme import Scheme
from ttile.core.spec import ConvSpec
from ttile.core.cpuinfo import process_cpus

#: (K, C, H): 1x1 stride-1 layers of MobileNetV2 (7x7, 14x14) and ResNet-50 (7x7, 14x14)
LAYERS = [(160, 960, 7), (960, 160, 7), (320, 960, 7), (576, 96, 14), (96, 576, 14),
          (2048, 512, 7), (512, 2048, 7), (256, 1024, 14), (1024, 256, 14)]


def _spec(k: int, c: int, h: int) -> ConvSpec:
    return ConvSpec(n=1, k=k, c=c, h=h, w=h, r=1, s=1, stride_h=1, stride_w=1, pad_top=0,
                    pad_bottom=0, pad_left=0, pad_right=0, dilation_h=1, dilation_w=1)


def _entry(kernel, library):
    fn = getattr(library.handle, kernel.name)
    fn.restype = None
    pointer = ctypes.POINTER(ctypes.c_float)
    fn.argtypes = [pointer, pointer, pointer, ctypes.c_int, ctypes.c_void_p]
    return lambda x, w, y, threads: fn(x.ctypes.data_as(pointer), w.ctypes.data_as(pointer),
                                       y.ctypes.data_as(pointer), threads, None)


def bench(k: int, c: int, h: int, threads: int, reps: int) -> str:
    spec = _spec(k, c, h)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, h, h, c), dtype=np.float32)
    w = rng.standard_normal((1, 1, c, k), dtype=np.float32)
    ttile.conv2d(x, w, layout="NHWC", threads=threads)   # tunes it (tuning "now")
    plan = ttile.plan(x.shape, w.shape, layout="NHWC", threads=threads)
    if not plan.scheme:
        return f"| {c}->{k} {h}x{h} | {plan.kind.value} | - | - | - | - | - |"
    kernels = [codegen.generate(Scheme.parse(plan.scheme), spec, weight_prefetch=ahead)
               for ahead in (False, True)]
    library = cbuild.build(kernels)
    packed = cbuild.packed_weights(kernels[0], w)
    runs = [_entry(kernel, library) for kernel in kernels]
    outputs = [np.empty((1, h, h, k), np.float32) for _ in runs]
    for run, y in zip(runs, outputs):
        run(x, packed, y, threads)
    if not np.array_equal(outputs[0], outputs[1]):
        raise AssertionError(f"{c}->{k} {h}x{h}: the prefetching kernel differs")
    times = {(i, cold): [] for i in range(2) for cold in (False, True)}
    for _ in range(reps):
        for (i, cold), samples in times.items():
            runs[i](x, packed, outputs[i], threads)
            if cold:
                _kernels.evict(packed)
            t0 = time.perf_counter()
            runs[i](x, packed, outputs[i], threads)
            samples.append(time.perf_counter() - t0)
    us = {key: statistics.median(v) * 1e6 for key, v in times.items()}
    return (f"| {c}->{k} {h}x{h} | {plan.scheme} | {us[0, False]:.1f} | {us[1, False]:.1f} | "
            f"{us[0, True]:.1f} | {us[1, True]:.1f} | {us[0, True] / us[1, True]:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)
    import os
    os.sched_setaffinity(0, set(process_cpus()[:args.threads]))
    ttile.use_tuned_kernels(False)
    ttile.set_tuning(mode="now", cache_dir=tempfile.mkdtemp(prefix="ttile-prefetch-"))
    print(f"{args.threads} thread(s); us per call, median of {args.reps}\n")
    print("| layer | scheme (run-time tuned) | warm | warm, prefetch | cold | cold, prefetch "
          "| cold / cold prefetch |\n|---|---|---|---|---|---|---|")
    for k, c, h in LAYERS:
        print(bench(k, c, h, args.threads, args.reps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
