"""Whole networks through ``ttile.torch.convert`` against torch, onnxruntime and OpenVINO.

Not a test: run it by hand with torch, onnxruntime and onnx installed::

    python benchmarks/bench_network.py --networks resnet18 resnet50 mobilenet_v2 yolo \\
        --batch 1 8 --threads 1 2

The networks are defined here with torch.nn from their published architectures
(torchvision's compiled ops do not load with the CPU torch used here): ResNet-18 and -50
(He et al. 2016, torchvision's v1.5 layout: stride in the 3x3), ResNeXt-50 32x4d (its
3x3 layers in 32 groups), MobileNetV2 (Sandler et
al. 2018, width 1.0) and a YOLO-style backbone (Darknet-19 of YOLOv2/YOLO9000: conv + batch
norm + leaky ReLU 0.1, max pools). Random weights and batch norm statistics, eval mode,
224x224 inputs.

Contenders, each timed in rounds that interleave all of them in a seeded shuffled order (the
median of each round's ratio is reported, so a slow spell of the shared machine hits both
sides alike), each timed call right after an untimed one of its own (``bench_semantics``'s
warm rounds: the thread pools of torch, onnxruntime and ttile's OpenMP spin for a while
after each call, and took the two cores from whichever contender came next - ttile's
MobileNetV2 at 2 threads ran 6.2 ms alone and 10.7 in single interleaved calls):

* torch eager, NCHW and channels_last (the best of the two is the anchor);
* ``torch.compile`` (inductor) of the channels_last model, where it compiles; with
  ``--compile`` also ``torch.compile`` of the converted model (inductor around ttile's
  custom op) and its ``torch.export`` program run as a module, both on the channels_last
  input;
* onnxruntime (CPU provider, default graph optimizations) on the model exported with
  ``torch.onnx.export``;
* OpenVINO on the same export (CPU, ``INFERENCE_PRECISION_HINT`` f32, ``PERFORMANCE_HINT``
  LATENCY, ``INFERENCE_NUM_THREADS`` set), where installed;
* ttile: ``ttile.torch.convert(model, example_input=x)`` called on the channels_last
  input (ttile's native layout) and on the NCHW input; ``ttile onnx``: the ONNX export
  through ``ttile.onnx.load``, called on the NCHW numpy input as an ONNX user calls it
  (the notes give its speed relative to the channels_last conversion, a median of each
  round's ratio).

With ``--alone``, each contender is also timed by itself in a child process of its own
(back-to-back calls, the kernels tuned by the interleaved run served from the disk cache),
in three rounds with the contenders in a shuffled order each round; the alone ratios are
medians of each round's ratio:
at 2 threads and more, the interleaved contenders' thread pools spin after their calls and
take cores from whoever runs next (every engine's MobileNetV2 about 1.3x at 2 threads on a
Xeon model 167), so the alone ratios say what a user running one engine meets, and the two
tables side by side say what interleaving costs.

With ``--breakdown``, each network also gets a per-layer table (``network_layers.py``):
every converted convolution's time inside the network and alone, beside the same node's
time in onnxruntime's profile and OpenVINO's performance counters, so that a lost
millisecond has a layer.

Every output is compared with torch eager's (relative error <= 1e-4) before timing. The
first ttile call (which tunes every layer's shape, by ``ttile.set_tuning``'s policy) is
timed apart and reported; the tuned kernels are cached on disk.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import numpy as np

import ttile
from bench_semantics import PROCESS_CPUS, Cache, median_seconds, pin, rounds
from ttile.peers import Peer, onnx_runner


def build(name: str):
    import torch
    from torch import nn

    def conv_bn(cin, cout, k, stride=1, groups=1, act=None):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act)
        return nn.Sequential(*layers)

    class BasicBlock(nn.Module):
        expansion = 1

        def __init__(self, cin, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = (conv_bn(cin, planes, 1, stride)
                               if stride != 1 or cin != planes else None)

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += identity
            return self.relu(out)

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, cin, planes, stride, groups=1, width_per_group=64):
            super().__init__()
            out = planes * 4
            width = planes * width_per_group // 64 * groups   # ResNeXt: wider, grouped 3x3
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = (conv_bn(cin, out, 1, stride)
                               if stride != 1 or cin != out else None)

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            out += identity
            return self.relu(out)

    class ResNeXtBottleneck(Bottleneck):
        def __init__(self, cin, planes, stride):   # ResNeXt-50 32x4d (Xie et al. 2017)
            super().__init__(cin, planes, stride, groups=32, width_per_group=4)

    def resnet(block, counts):
        layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for i, (planes, count) in enumerate(zip((64, 128, 256, 512), counts)):
            for j in range(count):
                layers.append(block(cin, planes, 2 if j == 0 and i > 0 else 1))
                cin = planes * block.expansion
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
        return nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            hidden = cin * expand
            layers = [] if expand == 1 else [conv_bn(cin, hidden, 1, act=nn.ReLU6(inplace=True))]
            layers += [conv_bn(hidden, hidden, 3, stride, hidden, nn.ReLU6(inplace=True)),
                       conv_bn(hidden, cout, 1)]
            self.conv = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.conv(x) if self.residual else self.conv(x)

    def mobilenet_v2():
        layers = [conv_bn(3, 32, 3, 2, act=nn.ReLU6(inplace=True))]
        cin = 32
        for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                           (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers += [conv_bn(cin, 1280, 1, act=nn.ReLU6(inplace=True)),
                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, 1000)]
        return nn.Sequential(*layers)

    def darknet19():
        def cbl(cin, cout, k):
            return conv_bn(cin, cout, k, act=nn.LeakyReLU(0.1, inplace=True))
        cfg = [32, "M", 64, "M", 128, (64, 1), 128, "M", 256, (128, 1), 256, "M", 512,
               (256, 1), 512, (256, 1), 512, "M", 1024, (512, 1), 1024, (512, 1), 1024]
        layers, cin = [], 3
        for item in cfg:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            cout, k = item if isinstance(item, tuple) else (item, 3)
            layers.append(cbl(cin, cout, k))
            cin = cout
        layers += [nn.Conv2d(cin, 1000, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        return nn.Sequential(*layers)

    model = {"resnet18": lambda: resnet(BasicBlock, (2, 2, 2, 2)),
             "resnet50": lambda: resnet(Bottleneck, (3, 4, 6, 3)),
             "resnext50": lambda: resnet(ResNeXtBottleneck, (3, 4, 6, 3)),
             "mobilenet_v2": mobilenet_v2, "yolo": darknet19}[name]()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                n = module.num_features
                module.running_mean.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
                module.running_var.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                module.weight.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                module.bias.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
    return model.eval()


def onnx_export(model, x) -> bytes:
    import io

    import torch
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, opset_version=17, dynamo=False)
    return buffer.getvalue()


def models(name: str, batch: int):
    """The network in both layouts (the same weights) and its NCHW and channels_last input."""
    import torch
    model = build(name)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    x_cl = x.contiguous(memory_format=torch.channels_last)
    model_cl = build(name).to(memory_format=torch.channels_last)
    model_cl.load_state_dict(model.state_dict())
    return model, model_cl, x, x_cl


def contender(label: str, model, model_cl, x, x_cl, threads: int, converted=None,
              exported: Optional[bytes] = None):
    """The call that times contender ``label`` (the converted model and the ONNX export
    are made here when not given)."""
    import torch

    import ttile.torch as tt
    if label == "ttile onnx":   # the ONNX export through ttile.onnx.load, as an ONNX user
        import ttile.onnx
        served = ttile.onnx.load(exported if exported is not None else onnx_export(model, x),
                                 x.numpy(), threads=threads)
        x_np = x.numpy()
        return lambda: served(x_np)
    if label.startswith("ttile"):
        if converted is None:
            converted = tt.convert(model, example_input=x_cl, threads=threads, progress=False)
        if label == "ttile torch.compile":   # inductor around ttile's custom op
            compiled = torch.compile(converted)
            compiled(x_cl)
            return lambda: compiled(x_cl)
        if label == "ttile export":          # torch.export's program, run as a module
            program = torch.export.export(converted, (x_cl,)).module()
            return lambda: program(x_cl)
        return (lambda: converted(x_cl)) if label == "ttile channels_last" else \
            (lambda: converted(x))
    if label == "torch NCHW":
        return lambda: model(x)
    if label == "torch channels_last":
        return lambda: model_cl(x_cl)
    if label == "torch.compile":
        compiled = torch.compile(model_cl)
        compiled(x_cl)
        return lambda: compiled(x_cl)
    peer = {"onnxruntime": Peer.ONNXRUNTIME, "OpenVINO": Peer.OPENVINO}[label]
    return onnx_runner(peer, exported if exported is not None else onnx_export(model, x),
                       x.numpy(), threads)


def check_output(name: str, label: str, fn, expected) -> None:
    """``fn``'s output within 1e-4 (relative to its largest value) of torch eager's."""
    import torch
    got = torch.as_tensor(fn())
    error = float((got - expected).abs().max() / expected.abs().max())
    if error > 1e-4:
        raise AssertionError(f"{name}: {label} differs from torch eager: {error:.2e}")


#: Rounds of --alone: every contender's child process once a round.
ALONE_ROUNDS = 3


def alone(name: str, batch: int, threads: int, reps: int, label: str) -> dict:
    """One contender timed by itself in this process: ``reps`` back-to-back calls after five
    untimed ones, as a service answering one request after another meets it, with no other
    runtime's threads spinning on the cores (what `--alone` runs in a child process)."""
    import torch
    torch.set_num_threads(threads)
    model, model_cl, x, x_cl = models(name, batch)
    with torch.no_grad():
        fn = contender(label, model, model_cl, x, x_cl, threads)
        check_output(name, label, fn, model(x))
        seconds = median_seconds(fn, reps, warmup=5)
    return dict(label=label, ms=seconds * 1e3)


def alone_in_children(name: str, batch: int, threads: int, reps: int, labels,
                      rounds: int = ALONE_ROUNDS, seed: int = 0) -> list[dict]:
    """Each contender's median from ``alone`` in a child process of its own, pinned to the
    same CPUs, one after another, in ``rounds`` rounds with the contenders in a seeded
    shuffled order each round (a shared host drifts over the minutes this takes, and one
    pass would give whoever ran in a quiet spell the lead): ms by label, one dict a
    round."""
    import json
    import random
    import subprocess
    order = list(labels)
    shuffle = random.Random(seed).shuffle
    results = []
    for _ in range(rounds):
        shuffle(order)
        ms = {}
        for label in order:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--alone-child", label,
                 "--networks", name, "--batch", str(batch), "--threads", str(threads),
                 "--reps", str(reps)], check=True, capture_output=True, text=True).stdout
            ms[label] = json.loads(out.strip().splitlines()[-1])["ms"]
        results.append(ms)
    return results


def bench(name: str, batch: int, threads: int, reps: int, compile_: bool,
          breakdown: bool = False, separately: bool = False) -> dict:
    import torch

    import ttile.torch as tt
    torch.set_num_threads(threads)
    model, model_cl, x, x_cl = models(name, batch)
    t0 = time.perf_counter()
    converted = tt.convert(model, example_input=x_cl, threads=threads, progress=False)
    first = time.perf_counter() - t0
    runs = {label: contender(label, model, model_cl, x, x_cl, threads, converted)
            for label in ("torch NCHW", "torch channels_last", "ttile channels_last",
                          "ttile NCHW")}
    notes = []
    with torch.no_grad():
        expected = model(x)
        if compile_:
            for label in ("torch.compile", "ttile torch.compile", "ttile export"):
                try:
                    runs[label] = contender(label, model, model_cl, x, x_cl, threads,
                                            converted)
                except Exception as error:   # inductor needs a C++ toolchain and more
                    notes.append(f"{label} failed: {type(error).__name__}")
        try:
            exported = onnx_export(model, x)
            runs["onnxruntime"] = contender("onnxruntime", model, model_cl, x, x_cl, threads,
                                            exported=exported)
            runs["ttile onnx"] = contender("ttile onnx", model, model_cl, x, x_cl, threads,
                                           exported=exported)
        except Exception as error:
            exported = None
            notes.append(f"onnx export failed: {type(error).__name__}: {error}")
        if exported is not None:
            try:
                runs["OpenVINO"] = contender("OpenVINO", model, model_cl, x, x_cl, threads,
                                             exported=exported)
            except ImportError:
                notes.append("OpenVINO not installed")
        for label, fn in runs.items():
            check_output(name, label, fn, expected)
        for fn in runs.values():
            fn()
        times = rounds(runs, reps, Cache.WARM)
        if "ttile onnx" in times:
            onnx_ratio = statistics.median(c / o for c, o in zip(times["ttile channels_last"],
                                                                 times["ttile onnx"]))
            notes.append(f"ttile.onnx.load / convert speed {onnx_ratio:.2f}")
        layers = None
        if breakdown:
            from network_layers import breakdown as per_layer
            layers = per_layer(name, model, converted, x_cl, x, exported, threads, reps)
    eager = [min(a, b) for a, b in zip(times["torch NCHW"], times["torch channels_last"])]
    best_ttile = [min(a, b) for a, b in zip(times["ttile channels_last"], times["ttile NCHW"])]
    engines = [label for label in ("onnxruntime", "OpenVINO") if label in times]
    best_engine = [min(ts) for ts in zip(*(times[label] for label in engines))] \
        if engines else None
    result = dict(name=name, batch=batch, threads=threads, first=first, notes=notes,
                  layers=layers,
                  ratio_engines=(statistics.median(e / t for e, t in zip(best_engine, best_ttile))
                                 if best_engine else float("nan")),
                  ms={label: statistics.median(t) * 1e3 for label, t in times.items()},
                  ratio=statistics.median(e / t for e, t in zip(eager, best_ttile)),
                  ratio_nchw=statistics.median(e / t for e, t in zip(eager, times["ttile NCHW"])))
    if separately:
        # The converted model's kernels are tuned and cached on disk by now: the child's
        # convert finds them there and its first call tunes nothing.
        solo = alone_in_children(name, batch, threads, max(reps * 3, 20), list(runs))

        def ttile_ms(ms):
            return min(ms["ttile channels_last"], ms["ttile NCHW"])
        result["alone"] = dict(
            ms={label: statistics.median(r[label] for r in solo) for label in runs},
            rounds=len(solo),
            # medians over the rounds of each round's ratio
            ratio_engines=(statistics.median(min(r[label] for label in engines) / ttile_ms(r)
                                             for r in solo)
                           if engines else float("nan")),
            ratio=statistics.median(min(r["torch NCHW"], r["torch channels_last"])
                                    / ttile_ms(r) for r in solo))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", nargs="+",
                        default=["resnet18", "resnet50", "mobilenet_v2", "yolo"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--threads", type=int, nargs="+", default=[len(PROCESS_CPUS)])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--chart", help="write a bar chart (PNG) of the ratios here")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each convolution inside the network beside the same "
                             "node in onnxruntime's and OpenVINO's profilers "
                             "(network_layers.py)")
    parser.add_argument("--alone", action="store_true",
                        help="also time each contender by itself, in a process of its own "
                             "(at 2 threads and more, interleaved contenders slow each other "
                             "down)")
    parser.add_argument("--alone-child", metavar="CONTENDER", help=argparse.SUPPRESS)
    parser.add_argument("--record", action="store_true",
                        help="write the result file for the results page (benchmarks/records)")
    args = parser.parse_args(argv)
    if args.alone_child:
        import json
        pin(args.threads[0])
        print(json.dumps(alone(args.networks[0], args.batch[0], args.threads[0], args.reps,
                               args.alone_child)))
        return 0
    import torch
    cpu = open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].split("\n")[0]
    print(f"# {cpu.strip()}, torch {torch.__version__}", flush=True)
    rows, lines = [], ["| network | batch | threads | ms per contender (median) | first call | "
                       "best engine / ttile | eager / ttile | eager / ttile NCHW | notes |",
                       "|---|---|---|---|---|---|---|---|---|"]
    alone_lines = ["| network | batch | threads | ms per contender alone (median) | "
                   "best engine / ttile | eager / ttile |", "|---|---|---|---|---|---|"]
    for threads in args.threads:
        pin(threads)
        for batch in args.batch:
            for name in args.networks:
                result = bench(name, batch, threads, args.reps, args.compile,
                               args.breakdown, args.alone)
                rows.append(result)
                cells = "; ".join(f"{label} {value:.1f}" for label, value in
                                  result["ms"].items())   # one cell: the header's column
                lines.append(f"| {name} | {batch} | {threads} | {cells} | "
                             f"{result['first']:.1f} s | {result['ratio_engines']:.2f} | "
                             f"{result['ratio']:.2f} | {result['ratio_nchw']:.2f} | "
                             f"{'; '.join(result['notes'])} |")
                print(lines[-1], flush=True)
                if "alone" in result:
                    solo = result["alone"]
                    cells = "; ".join(f"{label} {value:.1f}" for label, value in
                                      solo["ms"].items())
                    alone_lines.append(f"| {name} | {batch} | {threads} | {cells} | "
                                       f"{solo['ratio_engines']:.2f} | {solo['ratio']:.2f} |")
                    print("alone: " + alone_lines[-1], flush=True)
                if result["layers"] is not None:
                    from network_layers import format_breakdown
                    print("\n".join(format_breakdown(result["layers"])), flush=True)
    if len(alone_lines) > 2:
        lines += ["", "Each contender alone, in a process of its own:", ""] + alone_lines
    if args.record:
        import results
        from ttile.peers import Peer, available, version
        versions = {"torch": torch.__version__,
                    **{p.value: version(p) for p in available() if p is not Peer.TORCH}}
        results.write("networks", "Whole networks, ttile.torch.convert (default settings, "
                      "empty cache) against torch eager, onnxruntime and OpenVINO", lines,
                      threads=args.threads, peers=versions, kernels=results.kernel_set(),
                      tuning=ttile.tuning_policy().mode,
                      notes="ms columns: each contender's median; ratios: medians of each "
                            "round's ratio (> 1: ttile faster); ttile is the faster of its "
                            "channels_last and NCHW calls. At 2 threads and more the "
                            "contenders, interleaved in one process, slow each other down "
                            "(each runtime's threads spin for a while after its call: every "
                            "engine's MobileNetV2 ran about 1.3x slower interleaved at 2 "
                            "threads on a Xeon model 167); the 'alone' table (--alone) times "
                            "each contender by itself in a process of its own, back-to-back "
                            "calls: the ratio a user serving one engine meets")
    if args.chart:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        labels = [f"{r['name']}\nN={r['batch']} T={r['threads']}" for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
        ax.bar(range(len(rows)), [r["ratio"] for r in rows])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("torch eager (best layout) / ttile")
        ax.set_title(f"Whole networks, {cpu.strip()}")
        fig.tight_layout()
        fig.savefig(args.chart, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
