"""Side-by-side timing of ttile against PyTorch (oneDNN) on the Fig. 8 layers.

Not a test: run it by hand (``python benchmarks/bench_conv.py``) with the ``bench``
extra installed (``pip install ".[bench]"``). For each thread count (``all``: every CPU
this process may use) it pins the process to that many CPUs, then for every layer times,
interleaved round by round, what users call:

* ttile.conv2d per call in NHWC (input NHWC, weights RSCK: ttile's native layout) and in
  NCHW (torch's layout, weights KCRS: the README's first example), packing per call
  (the same arrays come back every round, as in inference, so from the second call on
  conv2d runs on the weights it packed the first time, after checking them unchanged:
  see src/ttile/runtime/weight_cache.py),
* a ttile.Conv2d made once from the same weights (packed once), in both layouts,
* torch.nn.functional.conv2d on NCHW tensors, on channels_last tensors, and an
  nn.Conv2d pre-packed by torch.utils.mkldnn.to_mkldnn on an mkldnn input (output left
  in oneDNN's blocked format, so no conversion is charged to torch),
* onnxruntime and OpenVINO, where installed, on a one-Conv ONNX model with a static input
  shape (``ttile.peers``: default graph optimizations; OpenVINO with f32 precision and the
  latency hint), their thread counts set,
* ttile's generic kernel on the NHWC call (registry verdicts switched off), for reference,

in a seeded shuffled order each round, each timed call right after an untimed one of
the same contender (``bench_semantics.rounds``: a fixed order biases whoever follows
whom), and reports medians, the best of torch's three ways, GFLOP/s, % of the FMA peak
measured here by ttile's microbenchmark, and ratios (> 1: ttile faster), each the median
over rounds of that round's ratio (see ``paired_ratio``): torch's best way over each
ttile call, torch NCHW over ttile NCHW (the like-for-like per-call comparison), and
ttile's NHWC calls over its NCHW calls (what torch's layout costs a ttile user).
Every ttile and peer result is checked against torch's before it is timed.

``--no-shipped-sets`` switches the kernel sets compiled into the wheel off (what a CPU
without a set gets: the generic kernel, or run-time tuning with ``--tuning now``).
``--record`` writes the table's result file for the results page (``results.py``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path
import statistics
import sys
import threading
import time

import numpy as np

import results
import ttile
from bench_semantics import SETTLE_S, rounds
from ttile import _kernels, peers
from ttile.runtime import registry
from ttile.core.cpuinfo import process_cpus
from ttile.generator.networks import NETWORKS, layer as find_layer


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def commit() -> str:
    """The checkout's commit (short id, "+dirty" with uncommitted changes), so a table can
    be tied to the code that made it; $TTILE_BENCH_COMMIT where set (a copy of the
    checkout without its .git, on another machine); "unknown" outside a git checkout."""
    import subprocess
    if os.environ.get("TTILE_BENCH_COMMIT"):
        return os.environ["TTILE_BENCH_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=here,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def fma_peak_gflops(threads: int, iterations: int = 20_000_000, repeats: int = 3,
                    cpus: list[int] | None = None, isa: int | None = None) -> float:
    """Peak fp32 GFLOP/s of ``threads`` cores in the vector family ``isa`` (default
    AVX-512F): best of ``repeats`` concurrent FMA runs, thread i pinned to ``cpus[i]``
    (default: the CPUs this thread may use; pass them explicitly when OpenMP may have
    bound the calling thread to one core)."""
    isa = _kernels.ISA_AVX512F if isa is None else isa
    flops = _kernels.fma_peak_flops(isa)
    cpus = sorted(cpus or os.sched_getaffinity(0))
    best = 0.0
    for _ in range(repeats):
        seconds = [0.0] * threads

        def run(i: int) -> None:
            # one core each, whatever affinity OpenMP gave the main thread (OMP_PROC_BIND)
            os.sched_setaffinity(0, {cpus[i % len(cpus)]})
            seconds[i] = _kernels.fma_peak_seconds(iterations, isa)

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        best = max(best, sum(iterations * flops / s for s in seconds) / 1e9)
    return best


def per_call_overhead_us(calls: int = 20000) -> float:
    """Median per-call time of conv2d on a tiny NHWC shape (1x1x1x16 by 1x1x16x16)."""
    x = np.ones((1, 1, 1, 16), np.float32)
    w = np.ones((1, 1, 16, 16), np.float32)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            ttile.conv2d(x, w, layout="NHWC", threads=1)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def bench_layer(layer, threads: int, reps: int, torch):
    """Times of every contender over ``reps`` interleaved rounds, and the seconds of
    ttile's first NHWC call (the run-time tuning of a shape when ``--tuning now``)."""
    import torch.utils.mkldnn  # noqa: F401  (a submodule torch does not import itself)

    F = torch.nn.functional
    spec = layer.spec()
    pad = layer.rs // 2
    rng = np.random.default_rng(0)
    x_nchw = rng.uniform(-1, 1, (1, spec.c, spec.h, spec.w)).astype(np.float32)
    w_kcrs = rng.uniform(-1, 1, (spec.k, spec.c, spec.r, spec.s)).astype(np.float32)
    x_nhwc = np.ascontiguousarray(x_nchw.transpose(0, 2, 3, 1))
    w_rsck = np.ascontiguousarray(w_kcrs.transpose(2, 3, 1, 0))

    t0 = time.perf_counter()
    ttile.conv2d(x_nhwc, w_rsck, stride=layer.stride, padding=pad, layout="NHWC",
                 threads=threads)
    first_call = time.perf_counter() - t0

    xt, wt = torch.from_numpy(x_nchw), torch.from_numpy(w_kcrs)
    xt_cl = xt.to(memory_format=torch.channels_last)
    wt_cl = wt.to(memory_format=torch.channels_last)
    module = torch.nn.Conv2d(spec.c, spec.k, spec.r, stride=layer.stride, padding=pad, bias=False)
    with torch.no_grad():
        module.weight.copy_(wt)
    packed = torch.utils.mkldnn.to_mkldnn(module.eval())
    xt_mk = xt.to_mkldnn()
    engines = {peer: peers.runner(peer, x_nchw, w_kcrs, (layer.stride, layer.stride),
                                  (pad,) * 4, 1, threads) for peer in ENGINES}

    def generic():   # the direct generic kernel: no set, no Winograd
        previous = ttile.use_tuned_kernels(False)
        winograd = ttile.use_winograd(False)
        try:
            return ttile.conv2d(x_nhwc, w_rsck, stride=layer.stride, padding=pad,
                                layout="NHWC", threads=threads)
        finally:
            ttile.use_tuned_kernels(previous)
            ttile.use_winograd(winograd)

    prepacked = ttile.Conv2d(w_rsck, stride=layer.stride, padding=pad, layout="NHWC",
                             threads=threads)
    prepacked_nchw = ttile.Conv2d(w_kcrs, stride=layer.stride, padding=pad, layout="NCHW",
                                  threads=threads)
    runs = {
        "ttile": lambda: ttile.conv2d(x_nhwc, w_rsck, stride=layer.stride, padding=pad,
                                      layout="NHWC", threads=threads),
        "prepacked": lambda: prepacked(x_nhwc),
        "ttile_nchw": lambda: ttile.conv2d(x_nchw, w_kcrs, stride=layer.stride, padding=pad,
                                           threads=threads),
        "prepacked_nchw": lambda: prepacked_nchw(x_nchw),
        "generic": generic,
        "nchw": lambda: F.conv2d(xt, wt, stride=layer.stride, padding=pad),
        "channels_last": lambda: F.conv2d(xt_cl, wt_cl, stride=layer.stride, padding=pad),
        "mkldnn": lambda: packed(xt_mk),
        **{peer.value: run for peer, run in engines.items()},
    }
    with torch.no_grad():
        expected = runs["nchw"]().numpy()
        scale = np.abs(expected).max() + 1e-30
        for name in ("ttile", "prepacked", "generic", "ttile_nchw", "prepacked_nchw",
                     *(peer.value for peer in ENGINES)):
            got = runs[name]()
            if name in ("ttile", "prepacked", "generic"):
                got = got.transpose(0, 3, 1, 2)
            error = np.abs(got - expected).max() / scale
            if error > 1e-4:
                raise AssertionError(f"{layer.name}: {name} differs from torch "
                                     f"(max rel {error:.2e})")
        times = rounds(runs, reps)   # a shuffled order each round, each call warmed
    return spec, times, first_call


#: torch's three ways; the per-round torch time is the fastest of them in that round.
TORCH_WAYS = ("nchw", "channels_last", "mkldnn")
#: The other engines timed (set in main: those installed, unless --peers torch).
ENGINES: tuple = ()


def paired_ratio(times: dict, ttile_name: str, torch_ways=TORCH_WAYS) -> float:
    """Median over rounds of (torch's fastest way in the round) / (ttile in the round).

    The rounds interleave every contender, so a round's ratio compares calls made a few
    milliseconds apart: when the shared machine slows down for a while (it does, by up
    to 2x), both sides of a round slow down together, where a ratio of two medians
    taken over different rounds would carry the swing into the result. Taking torch's
    best way per round favours torch slightly; the ratio is conservative."""
    rounds = zip(*(times[way] for way in torch_ways), times[ttile_name])
    return statistics.median(min(t[:-1]) / t[-1] for t in rounds)


#: The ratios reported per layer: (column, ttile contender, the ways it is held to - the
#: fastest of them in each round). The last two hold ttile's NCHW calls to its own NHWC
#: calls: 0.91 or more is NCHW within 10 % of NHWC.
def ratios_reported() -> tuple:
    """(column, ttile contender, ways) per reported ratio; "peers" is torch's three ways
    and every other engine timed, the fastest of them in each round."""
    every = TORCH_WAYS + tuple(peer.value for peer in ENGINES)
    return (("peers/conv2d", "ttile", every),
            ("peers/conv2d NCHW", "ttile_nchw", every),
            ("peers/Conv2d", "prepacked", every),
            ("torch/conv2d", "ttile", TORCH_WAYS),
            ("torch NCHW/conv2d NCHW", "ttile_nchw", ("nchw",)),
            ("conv2d/conv2d NCHW", "ttile_nchw", ("ttile",)))


def geomean(values) -> float:
    return float(np.exp(np.mean(np.log(values))))


def compare_table(layers, threads: int, reps: int, torch, peak: float, kind_of) -> list[str]:
    """Markdown rows, one per layer, and the geometric means; rows print as they come."""
    ratios_ = ratios_reported()
    every = ratios_[0][2]
    lines = ["| layer | ttile kernel | best peer | peer ms | conv2d ms | Conv2d ms | "
             "conv2d NCHW ms | Conv2d NCHW ms | GFLOP/s | % peak | generic ms | first call s | "
             + " | ".join(name for name, _, _ in ratios_) + " |",
             "|" + "---|" * (12 + len(ratios_))]
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in ratios_}
    for layer in layers:
        spec, times, first_call = bench_layer(layer, threads, reps, torch)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        best = min(every, key=med.get)
        gflops = spec.flops / med["prepacked"] / 1e9
        row_ratios = []
        for name, contender, ways in ratios_:
            ratios[name].append(paired_ratio(times, contender, ways))
            row_ratios.append(f"{ratios[name][-1]:.2f}")
        row = (f"| {layer.name} | {kind_of(layer)} | {best} | {med[best] * 1e3:.3f} | "
               f"{med['ttile'] * 1e3:.3f} | {med['prepacked'] * 1e3:.3f} | "
               f"{med['ttile_nchw'] * 1e3:.3f} | {med['prepacked_nchw'] * 1e3:.3f} | "
               f"{gflops:.1f} | {100 * gflops / peak:.0f} | {med['generic'] * 1e3:.3f} | "
               f"{first_call:.2f} | " + " | ".join(row_ratios) + " |")
        lines.append(row)
        print(row, flush=True)
    summary = "; ".join(f"{name} {geomean(values):.2f} (lowest {min(values):.2f})"
                        for name, values in ratios.items())
    lines += ["", f"Geometric means: {summary}.", ""]
    print(lines[-2], flush=True)
    return lines


def _served_by(layer, threads: int) -> str:
    """What serves this layer at this thread count, per the plans: Conv2d's kernel, and
    per-call conv2d's where it differs ("tuned/generic per call")."""
    spec = layer.spec()
    kinds = [ttile.plan(spec.input_shape(), spec.weight_shape(),
                        stride=layer.stride,
                            padding=layer.rs // 2, layout="NHWC", threads=threads, prepacked=prepacked).kind.value
             for prepacked in (True, False)]
    return kinds[0] if kinds[0] == kinds[1] else f"{kinds[0]}/{kinds[1]} per call"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", nargs="+", default=["1", "2"],
                        help="thread counts, or 'all' (every CPU this process may use)")
    parser.add_argument("--reps", type=int, default=11, help="timed rounds per layer")
    parser.add_argument("--layers", nargs="+", default=None,
                        help="layer names (e.g. Yolo9000-12) or network names (dense layers "
                        "only: depthwise ones are bench_semantics.py's); default the 23 Fig. 8 "
                        "layers")
    parser.add_argument("--output", help="also write the markdown tables to this file")
    parser.add_argument("--tuning", choices=("never", "now"), default="never",
                        help="never (default): what the wheel ships serves, a searched kernel "
                        "or the generic one; now: a shape without a kernel for this CPU and "
                        "thread count is tuned at its first call (ttile's default for users; "
                        "the 'first call s' column says how long that took)")
    parser.add_argument("--no-shipped-sets", dest="shipped", action="store_false",
                        help="switch the kernel sets compiled into the wheel off (what a CPU "
                        "without a set gets)")
    parser.add_argument("--peers", choices=("all", "torch"), default="all",
                        help="all: torch and onnxruntime and OpenVINO where installed")
    parser.add_argument("--record", action="store_true",
                        help="write the result file for the results page (benchmarks/records)")
    parser.add_argument("--isa", choices=("auto", "avx512f", "avx2", "portable"),
                        default="auto", help="ttile's kernel family (ttile.set_isa); with "
                        "avx2, torch's oneDNN and ATen are capped at AVX2 too")
    args = parser.parse_args(argv)
    if args.isa == "avx2":
        # read by oneDNN and ATen when torch loads: set before the import below
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
        if "torch" in sys.modules:
            print("--isa avx2 must set torch's ISA cap before torch is imported",
                  file=sys.stderr)
            return 2
    ttile.set_isa(args.isa)

    try:
        import torch
    except ImportError:
        print("benchmarks need torch: pip install '.[bench]'", file=sys.stderr)
        return 2
    print(f"ttile's kernel family here: {ttile.get_isa().value}", file=sys.stderr)
    ttile.set_tuning(mode=args.tuning)
    ttile.use_tuned_kernels(args.shipped)
    global ENGINES
    ENGINES = tuple(p for p in peers.available() if p is not peers.Peer.TORCH) \
        if args.peers == "all" else ()
    versions = {"torch": torch.__version__, **{p.value: peers.version(p) for p in ENGINES}}

    layers = []
    for name in args.layers or ["yolo9000", "resnet18"]:   # the paper's Fig. 8 layers
        layers.extend(NETWORKS.get(name.lower(), ()) or [find_layer(name)])
    grouped = [layer.name for layer in layers if layer.groups > 1]
    if grouped:
        # this table times dense convolutions; a grouped layer's one-group problem is not it
        print(f"left out {len(grouped)} grouped layers (bench_semantics.py times them): "
              + ", ".join(grouped), file=sys.stderr)
        layers = [layer for layer in layers if layer.groups == 1]

    cpus = list(process_cpus())   # not the affinity: OMP_PROC_BIND narrows it on import
    counts = [len(cpus) if t == "all" else int(t) for t in args.threads]
    lines = [f"Measured {datetime.date.today()} on {cpu_model()}, {os.cpu_count()} CPUs; "
             + ", ".join(f"{name} {v}" for name, v in versions.items())
             + f", ttile {ttile.__version__} at {commit()} "
             f"({len(registry.ENTRIES)} registry verdicts for {len(registry.cpus())} CPU(s), this "
             f"one {registry.serving_cpu()}; {ttile.get_isa()} kernel family; run-time "
             f"tuning {args.tuning}; kernel set: {results.kernel_set(args.shipped)}"
             + (", torch capped at AVX2: ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2"
                if args.isa == "avx2" else "") + "); "
             f"batch 1, fp32; {args.reps} interleaved rounds, each turn after "
             f"{SETTLE_S * 1e3:.0f} ms of quiet, warm cache (the "
             f"same tensors every call); times are medians, torch/ttile the median of the "
             f"rounds' ratios (torch's fastest way in each round over ttile).", ""]
    for threads in counts:
        os.sched_setaffinity(0, cpus[:threads])
        torch.set_num_threads(threads)
        family = ttile.get_isa()
        peak = (fma_peak_gflops(threads, cpus=cpus[:threads],
                                isa=_kernels.ISA_AVX2 if family == "avx2"
                                else _kernels.ISA_AVX512F)
                if family.vector else float("nan"))
        lines += [f"### {threads} thread{'s' if threads > 1 else ''} "
                  f"({family.value} FMA peak measured: {peak:.0f} GFLOP/s)", ""]
        lines += compare_table(layers, threads, args.reps, torch, peak,
                               lambda layer: _served_by(layer, threads))
    os.sched_setaffinity(0, cpus[:1])
    lines.append(f"Per-call time of conv2d on a 1x1x1x16 NHWC input with 16 filters, 1 thread: "
                 f"{per_call_overhead_us():.1f} us (median).")
    os.sched_setaffinity(0, cpus)
    text = "\n".join(lines)
    print(text)
    if args.record:
        table = "conv-" + ("avx2" if args.isa == "avx2" else "sets-on" if args.shipped
                           else "sets-off") + (f"-tuning-{args.tuning}"
                                               if args.tuning != "never" else "")
        path = results.write(
            table, "Fig. 8 layers, one convolution per call: conv2d per call (NHWC and NCHW),"
                   " Conv2d pre-packed, against torch, onnxruntime and OpenVINO", lines,
            threads=counts, peers=versions, kernels=results.kernel_set(args.shipped),
            tuning=args.tuning)
        print(f"wrote {path}", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
