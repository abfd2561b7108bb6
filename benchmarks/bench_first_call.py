"""First calls of unseen shapes: the learned ranking's quick pick against the 20 s search.

Not a test: ``python benchmarks/bench_first_call.py`` (needs the jit extra). For each
shape no tuning record has seen, from an empty cache:

* the first ``ttile.conv2d`` call with the default settings (the learned ranking picks
  ``JitSettings.ranked_measure`` candidates, two; compile, check, time, compare with the
  generic kernel, cache write, load): its wall time, and the kernel it chose (read back
  from the cache entry that call wrote);
* the model-ranked search of ``--budget`` seconds (the run-time search without the
  ranker, ``JitSettings(ranked=False)``, which the "background" mode runs), on the same
  shape;
* then the two kernels (or the generic kernel, where either search chose it) timed side
  by side, warm, in interleaved rounds, with the generic kernel timed twice: ranked /
  searched time is the quality of the quick pick (1.0: as fast), and generic / generic
  (the same code) is the noise floor of that comparison in the same rounds. The summary
  counts only the shapes where a searched kernel served in at least one of the two
  (where both chose the generic kernel the ratio compares a kernel with itself).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conv import commit, cpu_model  # noqa: E402

import ttile  # noqa: E402
from ttile.core.cpuinfo import process_cpus  # noqa: E402
from ttile import _kernels  # noqa: E402
from ttile.core import cbuild  # noqa: E402
from ttile.core.kinds import KernelKind  # noqa: E402
from ttile.core.vectors import extension_code  # noqa: E402
from ttile.runtime import dispatch, jit  # noqa: E402
from ttile.tuning.bench import LayerBench, generic_packed_copies  # noqa: E402

from bench_jit import SHAPES  # noqa: E402

#: More shapes no record holds (the records cover the Fig. 8 layers, MobileNetV2's dense
#: layers and ResNet-50's): K and C off the multiples of 16, odd maps, 5x5 and 1x1.
MORE = (
    ("3x3-k72-c36-19", ttile.ConvSpec(1, 72, 36, 19, 19, 3, 3, 1, 1, 1, 1, 1, 1)),
    ("1x1-k176-c88-21", ttile.ConvSpec(1, 176, 88, 21, 21, 1, 1)),
    ("3x3-s2-k112-c56-45", ttile.ConvSpec(1, 112, 56, 45, 45, 3, 3, 2, 2, 1, 1, 1, 1)),
    ("5x5-k24-c24-40", ttile.ConvSpec(1, 24, 24, 40, 40, 5, 5, 1, 1, 2, 2, 2, 2)),
)


def _runner(result, spec: ttile.ConvSpec, bench: LayerBench, threads: int):
    """A timed call of what ``result`` chose: a JitResult (library on disk) or the
    KernelChoice a first call left in the cache (library loaded, ``address`` set)."""
    x, w, y = bench.copies[0]
    if result.kind is KernelKind.JIT:
        if getattr(result, "address", 0):
            library, address = result.handle, result.address
        else:
            library = ctypes.CDLL(str(result.library))
            address = cbuild.symbol_address(library, result.function)
        packed = _kernels.pack_weights(w, result.panel)
        shape = spec.packed_weight_shape(result.panel)
        # tuned in the family calls use now (ttile.get_isa())
        return library, lambda: _kernels.run_compiled(address, x, packed, y, threads,
                                                      spec.input_shape(), shape,
                                                      spec.output_shape(),
                                                      isa=extension_code(ttile.get_isa()))
    ((_, gw, _),) = generic_packed_copies(spec, [(x, w, y)])
    return None, lambda: _kernels.conv2d_generic_packed(
        x, gw, y, spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left, threads)


def side_by_side(runs, rounds: int) -> list[float]:
    times = [[] for _ in runs]
    for round_ in range(rounds + 1):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            if round_:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=20.0,
                        help="budget of the model-ranked search compared with (s)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--output", help="also write the markdown to this file")
    parser.add_argument("--record", action="store_true",
                        help="write the result file for the results page (benchmarks/records)")
    args = parser.parse_args(argv)
    cpus = process_cpus()   # not the affinity: OMP_PROC_BIND narrows it on import
    os.sched_setaffinity(0, cpus[:args.threads])
    shapes = [(layer.name, layer.spec()) for layer in SHAPES] + list(MORE)
    lines = [f"Measured {datetime.date.today()} on {cpu_model()}, {args.threads} thread(s), "
             f"batch 1, fp32, NHWC, empty caches; ttile {ttile.__version__} at {commit()}.", "",
             "| shape | first call s (ranked) | measured | kernel | search s (model, "
             f"{args.budget:.0f} s budget) | measured | kernel | ranked ms | searched ms | "
             "generic ms | ranked / searched | generic / generic |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, firsts, noise = [], [], []
    for name, spec in shapes:
        x = np.random.default_rng(0).uniform(-1, 1, spec.input_shape()).astype(np.float32)
        w = np.random.default_rng(1).uniform(-1, 1, spec.weight_shape()).astype(np.float32)
        cache = tempfile.mkdtemp(prefix="ttile-first-call-")
        # a process reuses the libraries it compiled (by the hash of their source):
        # forget them, so that every first call and search compiles what it measures
        cbuild._built.clear()
        previous = ttile.set_tuning(mode="now", cache_dir=cache, min_mflops=0)
        pad = (spec.pad_top, spec.pad_left)
        t0 = time.perf_counter()
        ttile.conv2d(x, w, stride=(spec.stride_h, spec.stride_w), padding=pad, layout="NHWC",
                     threads=args.threads)
        first = time.perf_counter() - t0
        fitted = ttile.plan(spec.input_shape(), spec.weight_shape(),
                            stride=(spec.stride_h, spec.stride_w), padding=pad,
                            layout="NHWC", threads=args.threads).threads
        ranked = dispatch.cached_choice(spec, "NHWC", fitted, ttile.get_isa())
        ttile.restore_tuning(previous)
        if ranked is None:
            raise SystemExit(f"{name}: the first call left no cache entry (tuning off?)")
        import json
        [record] = Path(cache).glob("kernels-v*/*.json")
        ranked_measured = json.loads(record.read_text())["measured"]
        cbuild._built.clear()
        searched = jit.tune(spec, fitted,
                            jit.JitSettings(ranked=False, budget_seconds=args.budget),
                            cache_root=Path(cache))
        bench = LayerBench.make(spec, copy_bytes=0, max_copies=1, seed=3)
        keep_a, run_a = _runner(ranked, spec, bench, args.threads)
        keep_b, run_b = _runner(searched, spec, bench, args.threads)
        generic = jit.JitResult(kind=KernelKind.GENERIC, problem=spec, gflops=0,
                                generic_gflops=0, search_seconds=0, measured=0, wrong=0,
                                failed=0)
        _, run_g = _runner(generic, spec, bench, args.threads)
        _, run_g2 = _runner(generic, spec, bench, args.threads)
        a, b, g, g2 = side_by_side([run_a, run_b, run_g, run_g2], args.rounds)
        del keep_a, keep_b
        ratio = a / b
        firsts.append(first)
        noise.append(g / g2)
        searched_served = KernelKind.JIT in (ranked.kind, searched.kind)
        if searched_served:
            ratios.append(ratio)
        lines.append(f"| {name} | {first:.2f} | {ranked_measured} | {ranked.kind.value} | "
                     f"{searched.search_seconds:.1f} | {searched.measured} | "
                     f"{searched.kind.value} | {a * 1e3:.3f} | {b * 1e3:.3f} | {g * 1e3:.3f} | "
                     f"{ratio:.3f}{'' if searched_served else ' (both generic)'} | "
                     f"{g / g2:.3f} |")
        print(lines[-1], flush=True)
    spread = max(abs(float(np.log(n))) for n in noise)
    lines += ["", f"First call: median {statistics.median(firsts):.2f} s, longest "
                  f"{max(firsts):.2f} s. Noise floor (generic / generic, same code, same "
                  f"rounds): within {np.expm1(spread) * 100:.1f} % on every shape."]
    if ratios:
        geo = float(np.exp(np.mean(np.log(ratios))))
        lines.append(f"Where a searched kernel served ({len(ratios)} of {len(shapes)} "
                     f"shapes): ranked pick / {args.budget:.0f} s search, warm time, geomean "
                     f"{geo:.3f}, worst {max(ratios):.3f}; "
                     f"{sum(r <= 1.05 for r in ratios)} of {len(ratios)} within 5 %.")
    else:
        lines.append("On no shape did a searched kernel serve: no quality to compare.")
    text = "\n".join(lines)
    print(text)
    if args.record:
        import results
        results.write("first-call", "Tuning cost on a CPU without a set: the first call of "
                      "an unseen shape (learned ranking) against the 20 s search",
                      lines[2:], threads=[args.threads], peers={},
                      kernels="run-time tuning into an empty cache (shipped sets do not hold "
                              "these shapes)", tuning="now")
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
