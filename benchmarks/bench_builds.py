"""Two builds of the extension, every compiled kernel family timed side by side.

A compile option (an optimization level, a variant kept or dropped) earns its build time
only with a measured gain, and a build made faster must not make a kernel slower. This
compares two installed builds on this CPU:

    pip install --no-deps --target /tmp/build_a dist_a/ttile-*.whl   # and /tmp/build_b
    python benchmarks/bench_builds.py /tmp/build_a /tmp/build_b [--rounds 7]

Each round runs one worker process per build (the order alternating round by round), with
that build first on ``sys.path``. A worker times, at the thread count each was made for,

* every searched kernel the builds carry whose vector family runs here
  (``_kernels.run_tuned``; build both with ``-C cmake.define.TTILE_KERNEL_SETS=all`` to
  time every set's), NHWC with a fused bias + ReLU (the specialised epilogue
  store) and without one, and through its NCHW entry point where it has one: these serve
  only on the CPU they were searched on, but their code is the same everywhere;
* ``ttile.conv2d`` with bias and ReLU, NHWC and NCHW, on the paper's layers (ResNet-18,
  MobileNetV2 and V3, YOLO9000 without its 28269-channel classifier) with the shipped sets
  off and run-time tuning off: the generic, Winograd, depthwise, pointwise-NCHW and
  grouped kernels that serve a CPU without a set,

each the median of ``--reps`` calls after a warm-up call. The report gives, per case, the
median over rounds of that round's time ratio (b over a: above 1, build b is slower), the
geometric mean per family and the cases that moved most. Both builds' outputs are
compared with each other before anything is timed. Read a family's geomean against the
families whose code the two builds share: on a shared, noisy host, identical code has
come out 0.88-0.94 between two builds in one run, so only a move well past that spread
is evidence (an even ``--rounds`` gives each build the first turn equally often).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER_FLAG = "--worker"


def _registry_cases(np, ttile, _kernels):
    from ttile.runtime import registry
    from ttile.core.kinds import Isa
    runs = {Isa.AVX512F: ttile.has_avx512f(), Isa.AVX2: ttile.has_avx2()}
    for entry in registry.KERNELS:
        if not runs.get(entry.isa):
            continue
        spec = entry.spec
        rng = np.random.default_rng(entry.index)
        x = rng.uniform(-1, 1, spec.input_shape()).astype(np.float32)
        w = rng.uniform(-1, 1, spec.weight_shape()).astype(np.float32)
        bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
        y = np.empty(spec.output_shape(), np.float32)
        packed = _kernels.pack_weights(w, entry.panel)
        name = f"tuned/{entry.isa.value}/{entry.layer}/{entry.cpu[:24]}/t{entry.threads}#{entry.index}"
        yield (f"{name}/nhwc", lambda e=entry, x=x, p=packed, y=y:
               _kernels.run_tuned(e.index, x, p, y, e.threads), y)
        yield (f"{name}/nhwc+bias-relu", lambda e=entry, x=x, p=packed, y=y, b=bias:
               _kernels.run_tuned(e.index, x, p, y, e.threads, bias=b, activation=1), y)
        if entry.nchw:
            xc = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
            n, ho, wo, k = spec.output_shape()
            yc = _kernels.empty_aligned((n, k, ho, wo))
            yield (f"{name}/nchw+bias-relu", lambda e=entry, x=xc, p=packed, y=yc, b=bias:
                   _kernels.run_tuned(e.index, x, p, y, e.threads, bias=b, activation=1,
                                      nchw_out=True), yc)


def _api_cases(np, ttile):
    from ttile.generator.networks import ALL_LAYERS
    for layer in ALL_LAYERS:
        if layer.flops > 4e9:
            continue
        spec = layer.spec()
        groups = layer.groups
        rng = np.random.default_rng(len(layer.name))
        x = rng.uniform(-1, 1, (1, layer.c, spec.h, spec.w)).astype(np.float32)
        w = rng.uniform(-1, 1, (layer.k, spec.c, spec.r, spec.s)).astype(np.float32)
        b = rng.uniform(-1, 1, layer.k).astype(np.float32)
        pad = (spec.pad_top, spec.pad_left)
        stride = (spec.stride_h, spec.stride_w)
        kind = ttile.plan(x.shape, w.shape, stride=stride, padding=pad, groups=groups,
                          threads=1).kind.value
        x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        w_rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
        y_nchw = np.empty(ttile.conv2d(x, w, b, stride, pad, 1, groups, threads=1).shape,
                          np.float32)
        y_nhwc = np.empty(np.moveaxis(y_nchw, 1, 3).shape, np.float32)
        yield (f"{kind}/{layer.name}/nhwc+bias-relu",
               lambda: ttile.conv2d(x_nhwc, w_rsck, b, stride, pad, 1, groups, threads=1,
                                    layout="NHWC", activation="relu", out=y_nhwc), y_nhwc)
        yield (f"{kind}/{layer.name}/nchw+bias-relu",
               lambda: ttile.conv2d(x, w, b, stride, pad, 1, groups, threads=1,
                                    activation="relu", out=y_nchw), y_nchw)


def worker(reps: int, outputs: Path, only: str = "") -> dict[str, float]:
    """Time every case under the build this process imports; save each case's output."""
    import numpy as np
    import ttile
    from bench_semantics import median_seconds
    from ttile import _kernels
    ttile.use_tuned_kernels(False)
    ttile.set_tuning("never")
    times, results = {}, {}
    for cases in (_registry_cases(np, ttile, _kernels), _api_cases(np, ttile)):
        # the shipped sets are off for the API cases only: run_tuned calls entries by index
        for name, fn, y in cases:
            if not name.startswith(only):
                continue
            times[name] = median_seconds(fn, reps)
            results[name] = np.array(y, copy=True)
    np.savez(outputs, **{str(i): results[k] for i, k in enumerate(sorted(results))})
    return times


def _run_worker(build: Path, reps: int, outputs: Path, only: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(build), TTILE_CACHE_DIR=tempfile.mkdtemp())
    done = subprocess.run([sys.executable, __file__, WORKER_FLAG, str(reps), str(outputs),
                           only],
                          env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build_a", type=Path, help="folder holding build a's ttile package")
    parser.add_argument("build_b", type=Path, help="folder holding build b's ttile package")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--show", type=int, default=12, help="how many outlying cases")
    parser.add_argument("--only", default="",
                        help="time only the cases whose name starts with this (e.g. tuned/)")
    args = parser.parse_args(argv)
    import numpy as np
    builds = (args.build_a.resolve(), args.build_b.resolve())
    rounds: list[dict[Path, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = builds if r % 2 == 0 else builds[::-1]
            times = {b: _run_worker(b, args.reps, Path(tmp) / f"{i}.npz", args.only)
                     for i, b in enumerate(order)}
            if r == 0:
                a_out, b_out = (np.load(Path(tmp) / f"{i}.npz") for i in range(2))
                differ = [k for k in a_out.files
                          if not np.allclose(a_out[k], b_out[k], rtol=1e-5, atol=1e-5)]
                if differ:
                    print(f"bench_builds: {len(differ)} outputs differ between the builds")
                    return 1
            rounds.append(times)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    cases = sorted(rounds[0][builds[0]])
    ratio = {c: statistics.median(t[builds[1]][c] / t[builds[0]][c] for t in rounds)
             for c in cases}
    ms_a = {c: statistics.median(t[builds[0]][c] for t in rounds) * 1e3 for c in cases}
    families: dict[str, list[str]] = {}
    for c in cases:
        families.setdefault(c.split("/")[0] + ("/nchw" if "nchw" in c else "/nhwc"), []).append(c)
    print(f"a = {builds[0]}\nb = {builds[1]}\n{args.rounds} rounds, {len(cases)} cases; "
          "time ratio b/a, median over rounds (above 1: b slower)\n")
    print(f"{'family':28s} {'cases':>5s} {'geomean':>8s} {'min':>6s} {'max':>6s}")
    for fam, members in sorted(families.items()):
        rs = [ratio[c] for c in members]
        print(f"{fam:28s} {len(rs):5d} {_geomean(rs):8.3f} {min(rs):6.3f} {max(rs):6.3f}")
    print(f"{'all':28s} {len(cases):5d} {_geomean(ratio.values()):8.3f}")
    print("\ncases that moved most:")
    for c in sorted(cases, key=lambda c: -abs(math.log(ratio[c])))[:args.show]:
        print(f"  {ratio[c]:6.3f}  {ms_a[c]:9.3f} ms  {c}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == WORKER_FLAG:
        print(json.dumps(worker(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])))
    else:
        sys.exit(main())
