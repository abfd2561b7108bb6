"""bf16 side by side: ttile's ``precision="bf16"`` against OpenVINO at its default
precision and with bf16 forced, and torch's bf16.

Not a test: run it by hand with the ``bench`` extra installed::

    python benchmarks/bench_bf16.py layers --threads 1 2      # the 23 Fig. 8 layers
    python benchmarks/bench_bf16.py networks --threads 1 2    # ResNet-50, MobileNetV2

Each contender runs alone in a child process of its own (back-to-back calls after five
untimed ones, the median of ``--reps``), one after another, in ``--rounds`` rounds with the
contenders in a seeded shuffled order each round; a ratio is the median over rounds of
that round's ratio (> 1: ttile faster). Every contender's output is compared with the
float64 (layers) or fp32 torch (networks) result of the unrounded input, and its error
(largest difference over the largest output) is reported beside its time: what bf16 costs
each engine in accuracy.

Contenders, per layer (NHWC input for ttile, the layer's weights fixed):

* ``ttile``: ``ttile.conv2d(x, w, layout="NHWC", precision="bf16")`` per call (fp32
  arrays in and out; the weights packed on the first call and reused while their bf16
  rounding is unchanged, which each call checks), ``ttile bf16 per call``: the same call
  on ``ml_dtypes.bfloat16`` input and weights, giving a bf16 output (``torch bf16``'s
  arrays),
  ``ttile NCHW``: the same call in torch's layout (NCHW input, KCRS weights),
  ``ttile Conv2d``: a ``ttile.Conv2d(..., precision="bf16")`` made once, and ``ttile bf16
  arrays``: that layer on an ``ml_dtypes.bfloat16`` input, giving a bf16 output (what
  ``torch bf16`` does);
* ``OpenVINO default``: a one-Conv ONNX model compiled with no precision hint (the table
  says what OpenVINO picked), ``OpenVINO bf16`` with ``INFERENCE_PRECISION_HINT`` bf16;
* ``torch autocast``: ``F.conv2d`` on channels_last fp32 tensors under
  ``torch.autocast("cpu", torch.bfloat16)``, and ``torch bf16``: on channels_last bf16
  tensors (no casts in the call).

Each peer is compared with the ttile call that does what it does (``SAME_CALL``): the
OpenVINO contenders, whose compiled model holds the weights packed once, with ``ttile
Conv2d``, which packs them once too (the per-call ``ttile`` checks the caller's weights
on every call, which OpenVINO's calls never do: on Yolo9000-18, 18.9 MB of weights, 6.0 ms
per call against 2.5 for the ``Conv2d``, Xeon model 207); ``torch bf16`` (bf16 arrays, weights passed each call) with ``ttile bf16
per call``; ``torch autocast`` (fp32 arrays, weights passed and cast each call) with
``ttile``. "vs best peer" is the least of those ratios. "fp32 arrays vs fastest" compares
``ttile`` with the fastest peer whatever its arrays and weights (a bf16 output is half the
bytes to write).

Per network (batch 1, 224x224, the networks of ``bench_network.py``): ``ttile``
(``ttile.torch.convert(model, example_input=x, precision="bf16")`` on the channels_last
input), ``OpenVINO default``, ``OpenVINO bf16``, ``torch autocast`` (the channels_last
model under autocast), with ``ttile fp32``, ``OpenVINO f32`` and ``onnxruntime`` (fp32:
its CPU provider has no bf16 convolution) for reference.

With ``--interleaved`` (networks), the contenders run in one process instead, interleaved
in rounds of a shuffled order (``interleaved``): on a host whose speed swings within
minutes the alone runs can each meet a different spell (on the lent 16-core Xeon model
207, OpenVINO's ResNet-50 at 1 thread took 11.7 ms in one run and 30.3 in the next),
where a round's contenders meet the same one.

``--record`` writes the tables' result files for the results page (``results.py``); a
networks table is named for the cores it ran on (machines of one CPU model differ in
cores, and their tables would otherwise replace each other).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_semantics import median_seconds  # noqa: E402 (beside this file)

LAYER_CONTENDERS = ("ttile", "ttile bf16 per call", "ttile NCHW", "ttile Conv2d",
                    "ttile bf16 arrays", "OpenVINO default", "OpenVINO bf16",
                    "torch autocast", "torch bf16")
NETWORK_CONTENDERS = ("ttile", "OpenVINO default", "OpenVINO bf16", "torch autocast",
                      "ttile fp32", "OpenVINO f32", "onnxruntime")
PEERS = ("OpenVINO default", "OpenVINO bf16", "torch autocast", "torch bf16")
#: The ttile contender that does what a peer's call does: its arrays, and its weights
#: packed once (a compiled OpenVINO model) or passed on every call (torch); "ttile" for
#: the others (fp32 arrays in and out, weights passed each call).
SAME_CALL = {"torch bf16": "ttile bf16 per call", "OpenVINO default": "ttile Conv2d",
             "OpenVINO bf16": "ttile Conv2d"}


def _timed(fn, reps: int) -> float:
    return median_seconds(fn, reps, warmup=5) * 1e3


def _layer_runner(label: str, layer, threads: int, reference: bool = True):
    """(call, NCHW output of it) for contender ``label`` on ``layer``, and the float64
    reference's NCHW output."""
    import torch

    import ttile
    from ttile import peers
    from ttile.core.reference import conv2d_nhwc_f64
    spec = layer.spec()
    pad = layer.rs // 2
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, spec.c, spec.h, spec.w)).astype(np.float32)
    w = rng.uniform(-1, 1, (spec.k, spec.c, spec.r, spec.s)).astype(np.float32)
    x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w_rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    stride = layer.stride
    if label == "ttile":
        def call():
            return ttile.conv2d(x_nhwc, w_rsck, stride=stride, padding=pad, layout="NHWC",
                                threads=threads, precision="bf16")
        nchw = (lambda y: y.transpose(0, 3, 1, 2))
    elif label == "ttile bf16 per call":
        import ml_dtypes
        xb, wb = x_nhwc.astype(ml_dtypes.bfloat16), w_rsck.astype(ml_dtypes.bfloat16)

        def call():
            return ttile.conv2d(xb, wb, stride=stride, padding=pad, layout="NHWC",
                                threads=threads, precision="bf16")
        nchw = (lambda y: y.astype(np.float32).transpose(0, 3, 1, 2))
    elif label == "ttile NCHW":
        def call():
            return ttile.conv2d(x, w, stride=stride, padding=pad, threads=threads,
                                precision="bf16")
        nchw = (lambda y: y)
    elif label in ("ttile Conv2d", "ttile bf16 arrays"):
        layer_ = ttile.Conv2d(w_rsck, stride=stride, padding=pad, layout="NHWC",
                              threads=threads, precision="bf16")
        if label == "ttile bf16 arrays":
            import ml_dtypes
            x_in = x_nhwc.astype(ml_dtypes.bfloat16)
        else:
            x_in = x_nhwc

        def call():
            return layer_(x_in)
        nchw = (lambda y: y.astype(np.float32).transpose(0, 3, 1, 2))
    elif label.startswith("OpenVINO"):
        precision = None if label == "OpenVINO default" else "bf16"
        model = peers._conv_model(x.shape, w, (stride, stride), (pad,) * 4, 1)
        call = peers.onnx_runner(peers.Peer.OPENVINO, model, x, threads, precision)
        nchw = (lambda y: y)
    else:
        xt = torch.from_numpy(x).to(memory_format=torch.channels_last)
        wt = torch.from_numpy(w).to(memory_format=torch.channels_last)
        if label == "torch bf16":
            xt, wt = xt.bfloat16(), wt.bfloat16()

        def call():
            with torch.no_grad():
                if label == "torch bf16":
                    return torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad)
        nchw = (lambda y: y.float().numpy())
    want = conv2d_nhwc_f64(x_nhwc, w_rsck, (stride, stride), (pad,) * 4).transpose(
        0, 3, 1, 2) if reference else None
    return call, nchw, want


def layer_child(label: str, names: list[str], threads: int, reps: int,
                errors: bool = True) -> dict:
    import torch
    torch.set_num_threads(threads)
    from ttile.generator.networks import layer as find_layer
    out = {}
    for name in names:
        call, nchw, want = _layer_runner(label, find_layer(name), threads, errors)
        error = float("nan")
        if errors:
            got = np.asarray(nchw(call()), dtype=np.float64)
            error = float(np.abs(got - want).max() / np.abs(want).max())
        out[name] = {"ms": _timed(call, reps), "error": error}
    return out


def _network_call(label: str, name: str, threads: int):
    """(call, fp32 torch output of the unrounded input) for contender ``label`` on
    network ``name``; call it under ``torch.no_grad()``."""
    import torch

    import ttile.torch as tt
    from bench_network import models, onnx_export
    from ttile import peers
    model, model_cl, x, x_cl = models(name, 1)
    with torch.no_grad():
        want = model(x).numpy()
        if label.startswith("ttile"):
            precision = "fp32" if label == "ttile fp32" else "bf16"
            converted = tt.convert(model, example_input=x_cl, threads=threads,
                                   progress=False, precision=precision)

            def call():
                return converted(x_cl).numpy()
        elif label == "torch autocast":
            def call():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model_cl(x_cl).float().numpy()
        elif label == "onnxruntime":
            call = peers.onnx_runner(peers.Peer.ONNXRUNTIME, onnx_export(model, x),
                                     x.numpy(), threads)
        else:
            precision = {"OpenVINO default": None, "OpenVINO bf16": "bf16",
                         "OpenVINO f32": "f32"}[label]
            call = peers.onnx_runner(peers.Peer.OPENVINO, onnx_export(model, x),
                                     x.numpy(), threads, precision)
    return call, want


def _error(call, want) -> float:
    return float(np.abs(np.asarray(call(), np.float64) - want).max() / np.abs(want).max())


def network_child(label: str, names: list[str], threads: int, reps: int,
                  errors: bool = True) -> dict:
    import torch
    torch.set_num_threads(threads)
    out = {}
    for name in names:
        call, want = _network_call(label, name, threads)
        with torch.no_grad():
            out[name] = {"error": _error(call, want), "ms": _timed(call, reps)}
    return out


def interleaved(contenders, names, threads: int, reps: int, rounds: int,
                seed: int = 0) -> list[dict]:
    """Every contender in this one process, per network in ``rounds`` rounds with the
    contenders in a seeded shuffled order each round, each turn ``reps`` back-to-back
    calls after one untimed call and 15 ms of quiet (the engines' worker threads spin
    after their calls): one dict per round, as :func:`in_children` gives. A slow spell
    of a shared host then hits every contender of a round alike, where the contenders
    alone, minutes apart, can each meet a different one."""
    import time

    import torch
    torch.set_num_threads(threads)
    shuffle = random.Random(seed).shuffle
    results: list[dict] = [{label: {} for label in contenders} for _ in range(rounds)]
    for name in names:
        calls, errors = {}, {}
        for label in contenders:
            call, want = _network_call(label, name, threads)
            with torch.no_grad():
                errors[label] = _error(call, want)
            calls[label] = call
        order = list(contenders)
        with torch.no_grad():
            for round_ in results:
                shuffle(order)
                for label in order:
                    time.sleep(0.015)
                    round_[label][name] = {"ms": median_seconds(calls[label], reps,
                                                                warmup=1) * 1e3,
                                           "error": errors[label]}
    return results


def in_children(mode: str, contenders, names, threads: int, reps: int, rounds: int,
                seed: int = 0) -> list[dict]:
    """Each contender alone in a child process, ``rounds`` rounds in shuffled orders:
    one dict per round, {contender: {name: {ms, error}}}."""
    order = list(contenders)
    shuffle = random.Random(seed).shuffle
    results = []
    for number in range(rounds):
        shuffle(order)
        round_ = {}
        for label in order:   # errors measured in the first round (the same every round)
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), mode, "--child", label,
                 "--threads", str(threads), "--reps", str(reps), "--names", *names]
                + (["--no-errors"] if number else []),
                capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
            round_[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(round_)
    return results


def _ratio(round_: dict, peer: str, name: str) -> float:
    """The peer's time over that of the ttile call doing what it does (> 1: ttile
    faster)."""
    mine = SAME_CALL.get(peer, "ttile")
    if mine not in round_:
        mine = "ttile"
    return round_[peer][name]["ms"] / round_[mine][name]["ms"]


def geomean(values) -> float:
    values = list(values)
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def table(mode: str, results: list[dict], names, threads: int, ov_default: str) -> list[str]:
    """The markdown table of one thread count: each contender's median time and error,
    and ttile's ratio to each peer and to the best of them (medians over rounds)."""
    ttile_label = "ttile"
    order = LAYER_CONTENDERS if mode == "layers" else NETWORK_CONTENDERS
    labels = [label for label in order if label in results[0]]
    peers_here = [p for p in PEERS if p in results[0]]
    medians = {label: {name: statistics.median(r[label][name]["ms"] for r in results)
                       for name in names} for label in labels}
    errors = {label: {name: results[0][label][name]["error"] for name in names}
              for label in labels}
    head = ["| " + ("layer" if mode == "layers" else "network") + " | threads | "
            + " | ".join(f"{label} ms (error)" for label in labels) + " | "
            + " | ".join(f"vs {p}" for p in peers_here)
            + " | vs best peer | fp32 arrays vs fastest |",
            "|---|---|" + "---|" * (len(labels) + len(peers_here) + 2)]
    lines = list(head)
    ratios = {p: [] for p in peers_here + ["best", "fastest"]}
    for name in names:
        row = [name, str(threads)]
        row += [f"{medians[label][name]:.3f} ({errors[label][name]:.1e})"
                for label in labels]
        for peer in peers_here:
            ratio = statistics.median(_ratio(r, peer, name) for r in results)
            ratios[peer].append(ratio)
            row.append(f"{ratio:.2f}")
        best = statistics.median(min(_ratio(r, p, name) for p in peers_here)
                                 for r in results)
        fastest = statistics.median(min(r[p][name]["ms"] for p in peers_here)
                                    / r[ttile_label][name]["ms"] for r in results)
        ratios["best"].append(best)
        ratios["fastest"].append(fastest)
        row += [f"**{best:.2f}**", f"{fastest:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| geomean | " + str(threads) + " | " + " | ".join("" for _ in labels)
                 + " | " + " | ".join(f"{geomean(ratios[p]):.2f}" for p in peers_here)
                 + f" | **{geomean(ratios['best']):.2f}** | {geomean(ratios['fastest']):.2f} |")
    lines.append("")
    lines.append(f"OpenVINO's default precision here: {ov_default}. Ratios > 1: ttile "
                 f"faster; errors against the {'float64' if mode == 'layers' else 'fp32 torch'}"
                 f" output of the unrounded input, relative to its largest value.")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("layers", "networks"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=None,
                        help="timed calls per contender (default 30 layers, 20 networks)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--names", nargs="+", default=None,
                        help="layers (default: the Fig. 8 layers) or networks "
                             "(default: resnet50 mobilenet_v2)")
    parser.add_argument("--contenders", nargs="+", default=None)
    parser.add_argument("--interleaved", action="store_true",
                        help="networks: every contender in one process, interleaved in "
                             "rounds (instead of each alone in a process of its own)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--no-errors", dest="errors", action="store_false",
                        help=argparse.SUPPRESS)
    parser.add_argument("--record", action="store_true",
                        help="write the result files for the results page")
    args = parser.parse_args(argv)
    if args.mode == "layers":
        from ttile.generator.networks import RESNET18, YOLO9000
        names = args.names or [layer.name for layer in YOLO9000 + RESNET18]
        contenders, reps = LAYER_CONTENDERS, args.reps or 30
    else:
        names = args.names or ["resnet50", "mobilenet_v2"]
        contenders, reps = NETWORK_CONTENDERS, args.reps or 20
    if args.child:
        child = layer_child if args.mode == "layers" else network_child
        print(json.dumps(child(args.child, names, args.threads[0], reps, args.errors)))
        return 0
    contenders = args.contenders or contenders
    from ttile import peers
    ov_default = peers.openvino_precision()
    from bench_conv import commit, cpu_model
    if args.interleaved and args.mode != "networks":
        parser.error("--interleaved times networks only")
    how = ("interleaved in one process, in a shuffled order each round" if args.interleaved
           else "each contender alone in its own process")
    lines = [f"CPU: {cpu_model()}; commit {commit()}; {how}, {args.rounds} rounds, {reps} "
             f"calls each", ""]
    for threads in args.threads:
        results = interleaved(contenders, names, threads, reps, args.rounds) \
            if args.interleaved else \
            in_children(args.mode, contenders, names, threads, reps, args.rounds)
        lines += table(args.mode, results, names, threads, ov_default) + [""]
        print("\n".join(lines), flush=True)
    if args.record:
        import results as records
        import torch

        import ttile
        import openvino
        table_name, title = f"bf16-{args.mode}", f"bf16 {args.mode}: ttile against OpenVINO " \
            f"(default: {ov_default}) and torch"
        if args.mode == "networks":   # the machines of one CPU model differ in cores
            cores = len(os.sched_getaffinity(0))
            table_name += ("-interleaved" if args.interleaved else "") + f"-{cores}-cores"
            title += f", {how}, on {cores} cores"
        records.write(table_name, title, lines, threads=args.threads,
                      peers={"torch": torch.__version__, "openvino": openvino.__version__},
                      kernels=records.kernel_set(), tuning="bf16 kernels (AMX or "
                      "AVX512_BF16), no search", notes=f"bf16 kind here: "
                      f"{ttile.plan((1, 8, 8, 32), (3, 3, 32, 32), layout='NHWC', precision='bf16').kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
