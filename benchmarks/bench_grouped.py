"""Grouped convolutions (1 < groups < channels) per call: ttile against torch,
onnxruntime and OpenVINO on the grouped layers of AlexNet (groups of 2), ShuffleNet v1
(grouped 1x1 layers, 3 and 8 groups) and ResNeXt-50 32x4d (32 groups of 4 to 32
channels).

Not a test: run it by hand with the ``bench`` extra installed::

    python benchmarks/bench_grouped.py --threads 1 2

Each layer: ``ttile.Conv2d(w, groups=g, layout="NHWC")`` (weights packed once) on an NHWC
input, with ttile's default tuning: the first call searches the layer as one grouped
problem against the grouped or generic kernel, and "served by" says which won (the
verdicts are cached: a second run measures what the first one found). The engines run
on the same NCHW input and KCRS weights (``ttile.peers.runner``),
every output checked against ttile's first, then timed in ``--reps`` rounds that
interleave the contenders in a seeded shuffled order, each timed call right after an
untimed one of its own; medians. "best / ttile" > 1: ttile faster.

With ``--precision bf16``: ``ttile.Conv2d(..., precision="bf16")`` on the fp32 input
against OpenVINO at its default precision (bf16 where the CPU has AVX512_BF16 or AMX) on
the same fp32 arrays, and the same layer on ``ml_dtypes.bfloat16`` arrays ("ttile bf16
arrays") against torch's bf16 convolution on channels_last bf16 tensors; each ttile
output checked against the float64 convolution of the bf16-rounded input and weights,
each engine's against ttile's within bf16's rounding; "best / ttile" is the lesser of
the two ratios.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

import ttile
from ttile import peers

#: (name, input channels, output channels, input size, filter, stride, groups)
LAYERS = [
    ("AlexNet-conv2", 96, 256, 27, 5, 1, 2),
    ("AlexNet-conv4", 384, 384, 13, 3, 1, 2),
    ("AlexNet-conv5", 384, 256, 13, 3, 1, 2),
    ("ShuffleNet-g3-s2-reduce", 240, 60, 28, 1, 1, 3),
    ("ShuffleNet-g3-s2-expand", 60, 240, 28, 1, 1, 3),
    ("ShuffleNet-g3-s3-reduce", 480, 120, 14, 1, 1, 3),
    ("ShuffleNet-g3-s3-expand", 120, 480, 14, 1, 1, 3),
    ("ShuffleNet-g8-s2-reduce", 384, 96, 28, 1, 1, 8),
    ("ShuffleNet-g8-s2-expand", 96, 384, 28, 1, 1, 8),
    ("ResNeXt50-s1", 128, 128, 56, 3, 1, 32),
    ("ResNeXt50-s2-first", 256, 256, 56, 3, 2, 32),
    ("ResNeXt50-s2", 256, 256, 28, 3, 1, 32),
    ("ResNeXt50-s3-first", 512, 512, 28, 3, 2, 32),
    ("ResNeXt50-s3", 512, 512, 14, 3, 1, 32),
    ("ResNeXt50-s4-first", 1024, 1024, 14, 3, 2, 32),
    ("ResNeXt50-s4", 1024, 1024, 7, 3, 1, 32),
]


def _bf16_runs(layer, threads: int, x: np.ndarray, w: np.ndarray) -> dict:
    """The bf16 contenders of one layer (see the module text), each output checked."""
    import ml_dtypes
    import torch

    from ttile.core.reference import conv2d_nhwc_f64
    from ttile.runtime.bf16 import round_to_bf16
    name, c, k, hw, r, stride, groups = layer
    pad = r // 2
    conv = ttile.Conv2d(w, stride=stride, padding=pad, groups=groups, layout="NHWC",
                        threads=threads, precision="bf16")
    xb = x.astype(ml_dtypes.bfloat16)
    xr, wr = round_to_bf16(x).astype(np.float64), round_to_bf16(w).astype(np.float64)
    cg, kg = c // groups, k // groups
    want = np.concatenate([conv2d_nhwc_f64(xr[..., g * cg:(g + 1) * cg],
                                           wr[..., g * kg:(g + 1) * kg], (stride, stride),
                                           (pad,) * 4) for g in range(groups)], axis=-1)
    scale = np.abs(want).max()
    for got, what in ((conv(x), 3e-6), (conv(xb).astype(np.float32), 1e-2)):
        if np.abs(got - want).max() > what * scale:
            raise AssertionError(f"{name}: ttile bf16 off the float64 reference")
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    w_kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    runs = {"ttile": lambda: conv(x), "ttile bf16 arrays": lambda: conv(xb)}
    tx = torch.from_numpy(x_nchw).to(memory_format=torch.channels_last).bfloat16()
    tw = torch.from_numpy(w_kcrs).bfloat16()

    def run_torch():
        with torch.no_grad():
            return torch.nn.functional.conv2d(tx, tw, None, stride, pad, 1, groups)
    runs["torch bf16"] = run_torch
    if peers.Peer.OPENVINO in peers.available():
        runs["OpenVINO default"] = peers.onnx_runner(
            peers.Peer.OPENVINO, peers._conv_model(x_nchw.shape, w_kcrs, (stride, stride),
                                                   (pad,) * 4, groups), x_nchw, threads,
            precision=None)
    for label, check in (("torch bf16", lambda y: y.float().numpy()),
                         ("OpenVINO default", lambda y: y)):
        if label in runs:
            got = check(runs[label]()).transpose(0, 2, 3, 1)
            if np.abs(got - want).max() > 2e-2 * scale:
                raise AssertionError(f"{name}: {label} disagrees with the reference")
    return runs


#: bf16: the ttile call each engine's call is compared with (its arrays' type).
BF16_SAME_CALL = {"torch bf16": "ttile bf16 arrays", "OpenVINO default": "ttile"}


def bench_layer(layer, threads: int, reps: int, rng, precision: str = "fp32") -> dict:
    name, c, k, hw, r, stride, groups = layer
    pad = r // 2
    x = rng.uniform(-1, 1, (1, hw, hw, c)).astype(np.float32)
    w = rng.uniform(-1, 1, (r, r, c // groups, k)).astype(np.float32)
    if precision == "bf16":
        runs = _bf16_runs(layer, threads, x, w)
    else:
        conv = ttile.Conv2d(w, stride=stride, padding=pad, groups=groups, layout="NHWC",
                            threads=threads)
        expected = conv(x).transpose(0, 3, 1, 2)
        x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        w_kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
        runs = {"ttile": lambda: conv(x)}
        for peer in peers.available():
            run = peers.runner(peer, x_nchw, w_kcrs, (stride, stride), (pad,) * 4, groups,
                               threads)
            if run is not None:
                if not np.allclose(run(), expected, rtol=1e-3, atol=1e-3):
                    raise AssertionError(f"{name}: {peer.value} disagrees with ttile")
                runs[peer.value] = run
    times = {label: [] for label in runs}
    order = list(runs)
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for label in order:
            runs[label]()
            t0 = time.perf_counter()
            runs[label]()
            times[label].append(time.perf_counter() - t0)
    ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
    engines = [label for label in ms if not label.startswith("ttile")]
    if precision == "bf16":   # each engine against the ttile call on its arrays
        ratio = min((ms[label] / ms[BF16_SAME_CALL[label]] for label in engines),
                    default=float("nan"))
    else:
        ratio = (min(ms[label] for label in engines) if engines else float("nan")) \
            / ms["ttile"]
    plan = ttile.plan(x.shape, w.shape, stride=stride, padding=pad, groups=groups,
                      layout="NHWC", threads=threads, prepacked=True, precision=precision)
    return dict(name=name, ms=ms, ratio=ratio, kind=plan.kind.value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--record", action="store_true",
                        help="write the table's result file for the results page")
    args = parser.parse_args(argv)
    cpu = open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].split("\n")[0]
    print(f"# {cpu.strip()}; per call, NHWC for ttile, NCHW for the engines; medians of "
          f"{args.reps} interleaved rounds")
    lines = []
    for threads in args.threads:
        try:
            import torch
            torch.set_num_threads(threads)
        except ImportError:
            pass
        rng = np.random.default_rng(0)
        rows = [bench_layer(layer, threads, args.reps, rng, args.precision)
                for layer in LAYERS]
        labels = list(rows[0]["ms"])
        table = [f"{threads} thread(s), medians of {args.reps} interleaved rounds", "",
                 "| layer | served by | " + " | ".join(f"{l} ms" for l in labels)
                 + " | best / ttile |", "|---|---|" + "---|" * len(labels) + "---|"]
        for row in rows:
            table.append(f"| {row['name']} | {row['kind']} | "
                         + " | ".join(f"{row['ms'].get(l, float('nan')):.3f}" for l in labels)
                         + f" | {row['ratio']:.2f} |")
        ratios = [row["ratio"] for row in rows]
        table += ["", f"geomean best / ttile: {float(np.exp(np.mean(np.log(ratios)))):.2f}; "
                      f"lowest {min(ratios):.2f}", ""]
        print("\n" + "\n".join(table), flush=True)
        lines += table
    if args.record:
        import results as records   # beside this script
        bf16 = args.precision == "bf16"
        records.write("grouped-bf16" if bf16 else "grouped",
                      "Grouped convolutions (AlexNet, ShuffleNet, ResNeXt-50), per call "
                      + ("in bf16, against OpenVINO's default precision and torch's bf16"
                         if bf16 else "against torch, onnxruntime and OpenVINO"), lines,
                      threads=args.threads,
                      peers={p.value: peers.version(p) for p in peers.available()},
                      kernels=records.kernel_set(),
                      tuning=f"{ttile.tuning_policy().mode} (the first call searches each "
                             f"grouped layer as one problem)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
