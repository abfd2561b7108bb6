"""Side-by-side timing of the conv2d semantics beyond the bare convolution.

Not a test: run it by hand (``python benchmarks/bench_semantics.py``) with torch,
onnxruntime and onnx installed. Batch 1 unless said otherwise; the process is pinned to
as many CPUs as threads. Four tables, each a median over rounds that interleave every
contender (``paired``: the ratio of each round, then the median, so that a slow spell of
the shared machine hits both sides of a ratio alike), every timed call starting from the
same cache state (``--cache warm``, the default: each call runs once untimed just before;
``--cache cold``: a 64 MB buffer is rewritten before each):

1. **Depthwise** (MobileNetV2's seven 3x3 depthwise layers): ttile.conv2d(groups=C) per
   call in NHWC and in NCHW against torch NCHW, torch channels_last and onnxruntime's CPU
   provider (NCHW, the layout ONNX has); ratio = best peer / ttile NHWC.
2. **Fused bias + ReLU** on the Fig. 8 layers: ttile.conv2d with bias and
   activation="relu" over the bare call, per call in NHWC and pre-packed (Conv2d).
3. **Dilation**: a 3x3 layer at dilation 2 and 4 (padding = dilation, so the output and
   the work are those of the undilated layer) over dilation 1.
4. **Batch 8**: per-image time at N = 8 over N = 1.

Every ttile result is checked against torch before it is timed.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from enum import Enum

import numpy as np

import ttile
from ttile.core.cpuinfo import process_cpus
from ttile.generator.networks import NETWORKS

# (channels, input size, stride) of MobileNetV2's 3x3 depthwise layers
MOBILENET_V2_DEPTHWISE = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (192, 28, 1),
                          (384, 14, 1), (576, 14, 2), (960, 7, 1)]


#: The CPUs this process may use when it starts (pinning narrows the affinity, so it must
#: not be read back: a 2-thread run after a 1-thread one would get one CPU). Not the
#: affinity read here either: with OMP_PROC_BIND set, importing ttile or torch bound this
#: thread to one CPU, and every "2-thread" contender then shared it (onnxruntime's
#: MobileNetV2 ran 13.6 ms at "2 threads" against 3.05 on two CPUs).
PROCESS_CPUS = list(process_cpus())


def pin(threads: int) -> None:
    """Pin the process to its first ``threads`` CPUs."""
    os.sched_setaffinity(0, set(PROCESS_CPUS[:threads]))


class Cache(Enum):
    """The state of the caches each timed call starts from, the same for every contender.

    Interleaving single calls leaves
    each call with whatever the previous contenders left behind: three of the five
    depthwise contenders read the same NCHW input, so the second and third found it in
    cache while ttile NHWC and torch channels_last read their own copies from memory,
    and a 5 MB layer's time then said more about the order of the runs than about the
    kernels (C=96 112x112 s2, ttile NHWC: 0.11 ms warm, 0.92 in the interleaved rounds).
    """
    WARM = "warm"   # the call runs once untimed just before it is timed: its input was
                    # just read, as a layer's input was just written by the layer before
    COLD = "cold"   # a 64 MB buffer is rewritten before each timed call: inputs,
                    # weights and the interpreter's own data come from memory


_SWEEP: list = []


def _evict() -> None:
    if not _SWEEP:
        _SWEEP.append(np.zeros(16 << 20, np.float32))
    np.add(_SWEEP[0], 1.0, out=_SWEEP[0])


#: Seconds each contender waits before its turn. An engine's worker threads spin for a
#: while after its call, waiting for more work, and on a CPU with no core to spare they
#: take it from whoever runs next: at 2 threads on 2 cores, ttile's Winograd call on
#: Yolo9000-8 took 6.2-6.5 ms after an onnxruntime call (its pool's spinning on, the
#: default), 2.1 ms after nothing, 2.4 ms after an onnxruntime session with spinning off;
#: after 10 ms of sleep, 2.3 ms (Zen 5). Each engine runs alone in a user's process; the
#: wait gives back that condition without touching the engines' own settings.
SETTLE_S = 0.015


def rounds(runs: dict, reps: int, cache: Cache = Cache.WARM) -> dict:
    """Times of each run, interleaved round by round in an order drawn afresh for each
    round (seeded: the same on every run of the script), each timed call from ``cache``,
    after one warm-up call each, each turn after a wait of :data:`SETTLE_S`.

    A rotating order (each round starting one contender later) leaves each contender right after the same one in all but one
    round in len(runs), and the call before still shapes the timed one after a warm-up
    call: two copies of ttile's NHWC depthwise kernel differing only in a software
    prefetch measured 0.46-0.50 (the copy listed second over the first) on C=96 112x112
    s2 in rotating rounds and 1.00 in shuffled ones, and two identical copies 0.93-0.97
    warm, 0.72-0.83 cold (Zen 4, 1 thread)."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    order = list(runs.items())
    shuffle = random.Random(len(order) * 1000 + reps).shuffle
    for _ in range(reps):
        shuffle(order)
        for name, fn in order:
            time.sleep(SETTLE_S)   # the previous contender's idle threads stop spinning
            if cache is Cache.WARM:
                fn()
            else:
                _evict()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def median_seconds(fn, reps: int, warmup: int = 1) -> float:
    """The median time of ``reps`` calls of ``fn`` after ``warmup`` untimed ones, for a
    contender timed alone (``rounds`` interleaves several)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(times: dict, numerators: tuple, denominator: str) -> float:
    """Median over rounds of min(numerators in the round) / denominator in the round."""
    return statistics.median(min(t[:-1]) / t[-1]
                             for t in zip(*(times[n] for n in numerators), times[denominator]))


def ms(samples) -> float:
    return statistics.median(samples) * 1e3


def check(name: str, got: np.ndarray, expected: np.ndarray) -> None:
    error = np.abs(got - expected).max() / (np.abs(expected).max() + 1e-30)
    if error > 1e-4:
        raise AssertionError(f"{name}: differs from torch (max rel {error:.2e})")


def ort_session(x_shape, w: np.ndarray, stride: int, pad: int, groups: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride, stride],
                            pads=[pad] * 4, group=groups)
    graph = helper.make_graph([node], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # the IR version of opset 17 (onnx 1.12), not the newest this onnx writes: an older
    # onnxruntime refuses a newer IR (onnx 1.23's 14 against onnxruntime 1.30's 13)
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session


def depthwise_table(torch, threads: int, reps: int, cache: Cache) -> list[str]:
    F = torch.nn.functional
    lines = ["| layer | ttile NHWC ms | ttile NCHW ms | torch NCHW ms | torch channels_last ms "
             "| onnxruntime ms | GFLOP/s (ttile NHWC) | best peer / ttile NHWC | "
             "best peer / ttile NCHW |", "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for c, hw, stride in MOBILENET_V2_DEPTHWISE:
        rng = np.random.default_rng(c)
        x = rng.uniform(-1, 1, (1, c, hw, hw)).astype(np.float32)
        w = rng.uniform(-1, 1, (c, 1, 3, 3)).astype(np.float32)
        x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        w_rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
        xt, wt = torch.from_numpy(x), torch.from_numpy(w)
        xt_cl = xt.to(memory_format=torch.channels_last)
        wt_cl = wt.to(memory_format=torch.channels_last)
        session = ort_session(list(x.shape), w, stride, 1, c, threads)
        runs = {
            "ttile": lambda: ttile.conv2d(x_nhwc, w_rsck, None, stride, 1, 1, c,
                                          layout="NHWC", threads=threads),
            "ttile_nchw": lambda: ttile.conv2d(x, w, None, stride, 1, 1, c, threads=threads),
            "nchw": lambda: F.conv2d(xt, wt, None, stride, 1, 1, c),
            "channels_last": lambda: F.conv2d(xt_cl, wt_cl, None, stride, 1, 1, c),
            "ort": lambda: session.run(None, {"x": x})[0],
        }
        with torch.no_grad():
            expected = runs["nchw"]().numpy()
            check("depthwise NHWC", runs["ttile"]().transpose(0, 3, 1, 2), expected)
            check("depthwise NCHW", runs["ttile_nchw"](), expected)
            check("onnxruntime", runs["ort"](), expected)
            times = rounds(runs, reps, cache)
        peers = ("nchw", "channels_last", "ort")
        ratio = paired(times, peers, "ttile")
        ratios.append(ratio)
        ho = (hw + 2 - 3) // stride + 1
        gflops = 2 * c * 9 * ho * ho / statistics.median(times["ttile"]) / 1e9
        lines.append(f"| C={c} {hw}x{hw} s{stride} | {ms(times['ttile']):.3f} | "
                     f"{ms(times['ttile_nchw']):.3f} | {ms(times['nchw']):.3f} | "
                     f"{ms(times['channels_last']):.3f} | {ms(times['ort']):.3f} | "
                     f"{gflops:.1f} | {ratio:.2f} | {paired(times, peers, 'ttile_nchw'):.2f} |")
    geomean = float(np.exp(np.mean(np.log(ratios))))
    lines.append(f"\ngeomean best peer / ttile NHWC: **{geomean:.2f}**, lowest "
                 f"{min(ratios):.2f}")
    return lines


def fused_table(torch, threads: int, reps: int, layers, cache: Cache) -> list[str]:
    F = torch.nn.functional
    lines = ["| layer | bare ms | bias+relu ms | fused / bare (conv2d NHWC) | "
             "fused / bare (Conv2d NHWC) | fused / bare (conv2d NCHW) | served by |",
             "|---|---|---|---|---|---|---|"]
    ratios = []
    for layer in layers:
        spec = layer.spec()
        pad = layer.rs // 2
        rng = np.random.default_rng(1)
        x = rng.uniform(-1, 1, (1, spec.c, spec.h, spec.w)).astype(np.float32)
        w = rng.uniform(-1, 1, (spec.k, spec.c, spec.r, spec.s)).astype(np.float32)
        bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
        x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        w_rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
        bare_layer = ttile.Conv2d(w_rsck, stride=layer.stride, padding=pad, layout="NHWC",
                                  threads=threads)
        fused_layer = ttile.Conv2d(w_rsck, bias, layer.stride, pad, layout="NHWC",
                                   threads=threads, activation="relu")
        kw = dict(stride=layer.stride, padding=pad, threads=threads)
        runs = {
            "bare": lambda: ttile.conv2d(x_nhwc, w_rsck, layout="NHWC", **kw),
            "fused": lambda: ttile.conv2d(x_nhwc, w_rsck, bias, layout="NHWC",
                                          activation="relu", **kw),
            "bare_packed": lambda: bare_layer(x_nhwc),
            "fused_packed": lambda: fused_layer(x_nhwc),
            "bare_nchw": lambda: ttile.conv2d(x, w, **kw),
            "fused_nchw": lambda: ttile.conv2d(x, w, bias, activation="relu", **kw),
        }
        with torch.no_grad():
            expected = F.relu(F.conv2d(torch.from_numpy(x), torch.from_numpy(w),
                                       torch.from_numpy(bias), layer.stride, pad)).numpy()
        check(f"{layer.name} fused", runs["fused"]().transpose(0, 3, 1, 2), expected)
        check(f"{layer.name} fused Conv2d", runs["fused_packed"]().transpose(0, 3, 1, 2),
              expected)
        check(f"{layer.name} fused NCHW", runs["fused_nchw"](), expected)
        times = rounds(runs, reps, cache)
        ratio = paired(times, ("fused",), "bare")
        ratio_packed = paired(times, ("fused_packed",), "bare_packed")
        ratios += [ratio, ratio_packed]
        served = ttile.plan(x_nhwc.shape, w_rsck.shape, bias, layer.stride, pad,
                            layout="NHWC", threads=threads, activation="relu").kind.value
        lines.append(f"| {layer.name} | {ms(times['bare']):.3f} | {ms(times['fused']):.3f} | "
                     f"{ratio:.3f} | {ratio_packed:.3f} | "
                     f"{paired(times, ('fused_nchw',), 'bare_nchw'):.3f} | {served} |")
    lines.append(f"\nmedian fused / bare over the NHWC rows (per call and Conv2d): "
                 f"**{statistics.median(ratios):.3f}**, highest {max(ratios):.3f}")
    return lines


def dilation_table(threads: int, reps: int, cache: Cache) -> list[str]:
    lines = ["| layer | dilation 1 ms | dilation 2 ms | dilation 4 ms | d2 / d1 | d4 / d1 |",
             "|---|---|---|---|---|---|"]
    for c, k, hw in [(256, 256, 33), (128, 128, 65), (64, 64, 56)]:
        rng = np.random.default_rng(2)
        x = rng.uniform(-1, 1, (1, hw, hw, c)).astype(np.float32)
        w = rng.uniform(-1, 1, (3, 3, c, k)).astype(np.float32)
        runs = {d: (lambda d=d: ttile.conv2d(x, w, None, 1, d, d, layout="NHWC",
                                             threads=threads)) for d in (1, 2, 4)}
        times = rounds(runs, reps, cache)
        lines.append(f"| C=K={c} {hw}x{hw} 3x3 | {ms(times[1]):.3f} | {ms(times[2]):.3f} | "
                     f"{ms(times[4]):.3f} | {paired(times, (2,), 1):.2f} | "
                     f"{paired(times, (4,), 1):.2f} |")
    return lines


def batch_table(threads: int, reps: int, layers, cache: Cache) -> list[str]:
    lines = ["| layer | N=1 ms | N=8 ms per image | per image N=8 / N=1 |", "|---|---|---|---|"]
    for layer in layers:
        spec = layer.spec()
        pad = layer.rs // 2
        rng = np.random.default_rng(3)
        x8 = rng.uniform(-1, 1, (8, spec.h, spec.w, spec.c)).astype(np.float32)
        x1 = np.ascontiguousarray(x8[:1])
        w = rng.uniform(-1, 1, (spec.r, spec.s, spec.c, spec.k)).astype(np.float32)
        kw = dict(stride=layer.stride, padding=pad, layout="NHWC", threads=threads)
        runs = {"one": lambda: ttile.conv2d(x1, w, **kw),
                "eight": lambda: ttile.conv2d(x8, w, **kw)}
        times = rounds(runs, reps, cache)
        per_image = [t / 8 for t in times["eight"]]
        ratio = statistics.median(a / b for a, b in zip(per_image, times["one"]))
        lines.append(f"| {layer.name} | {ms(times['one']):.3f} | {ms(per_image):.3f} | "
                     f"{ratio:.2f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tables", nargs="+", default=["depthwise", "fused", "dilation", "batch"])
    parser.add_argument("--cache", choices=[c.value for c in Cache], default=Cache.WARM.value,
                        help="the caches each timed call starts from (see Cache)")
    parser.add_argument("--record", action="store_true",
                        help="write the depthwise table's result file for the results page")
    args = parser.parse_args(argv)
    recorded: list[str] = []
    cache = Cache(args.cache)
    import torch
    fig8 = [layer for name in ("yolo9000", "resnet18") for layer in NETWORKS[name]]
    batch_layers = [layer for layer in fig8 if layer.name in ("ResNet18-6", "ResNet18-9",
                                                              "Yolo9000-12")]
    print(f"# {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].split(chr(10))[0].strip()}"
          f", ttile {ttile.__version__}, torch {torch.__version__}, caches {cache.value}",
          flush=True)
    for threads in args.threads:
        pin(threads)
        torch.set_num_threads(threads)
        print(f"\n## {threads} thread(s)", flush=True)
        for table in args.tables:
            print(f"\n### {table}\n", flush=True)
            if table == "depthwise":
                lines = depthwise_table(torch, threads, args.reps, cache)
                recorded += [f"{threads} thread(s):", ""] + lines + [""]
            elif table == "fused":
                lines = fused_table(torch, threads, max(10, args.reps // 3), fig8, cache)
            elif table == "dilation":
                lines = dilation_table(threads, max(10, args.reps // 3), cache)
            else:
                lines = batch_table(threads, max(10, args.reps // 3), batch_layers, cache)
            print("\n".join(lines), flush=True)
    if args.record and recorded:
        import results
        import onnxruntime
        results.write("depthwise", "MobileNetV2's depthwise layers, conv2d per call, against "
                      "torch (NCHW, channels_last) and onnxruntime", recorded,
                      threads=args.threads, peers={"torch": torch.__version__,
                                                   "onnxruntime": onnxruntime.__version__},
                      kernels="the depthwise kernels (hand-written; no searched set involved)",
                      tuning="never", notes=f"caches {cache.value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
