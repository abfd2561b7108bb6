"""Two searches of the same layers, their final kernels side by side.

Not a test: ``python benchmarks/compare_searches.py --baseline generator --candidate /tmp/rs
--network yolo9000``. For every layer and thread count both record sets hold on this CPU,
the verdict each search would ship (``registry_entries``: its best scheme where it beats
the generic kernel, else the generic kernel) is built and timed warm, side by side in
interleaved rounds, with the generic kernel; the table gives candidate / baseline time
(1.0: the same speed; the aim is the same final kernels within the noise).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import ttile
from ttile import _kernels
from ttile.core.cbuild import build, symbol_address
from ttile.core.codegen import generate
from ttile.core.vectors import extension_code
from ttile.generator.emit import registry_entries
from ttile.generator.networks import NETWORKS
from ttile.tuning.bench import LayerBench, generic_packed_copies
from ttile.tuning.records import TuningDatabase


def _runner(entry, spec, bench, threads):
    x, w, y = bench.copies[0]
    if entry is None or entry.scheme is None:
        ((_, gw, _),) = generic_packed_copies(spec, [(x, w, y)])
        return None, lambda: _kernels.conv2d_generic_packed(
            x, gw, y, spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left, threads)
    kernel = generate(entry.scheme, spec, "compare_searches")
    library = build([kernel])
    address = symbol_address(library.handle, kernel.name)
    packed = _kernels.pack_weights(w, kernel.panel)
    shape = spec.packed_weight_shape(kernel.panel)
    return library, lambda: _kernels.run_compiled(address, x, packed, y, threads,
                                                  spec.input_shape(), shape,
                                                  spec.output_shape(),
                                                  isa=extension_code(kernel.isa))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="data dir (records/)")
    parser.add_argument("--candidate", type=Path, required=True, help="data dir (records/)")
    parser.add_argument("--network", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    problems = {layer.spec().key(): layer.name for net in args.network
                for layer in NETWORKS[net]}
    verdicts = []
    for root in (args.baseline, args.candidate):
        database = TuningDatabase(root / "records")
        verdicts.append({(e.spec.key(), e.threads): e for e in registry_entries([database])
                         if e.spec.key() in problems})
    keys = sorted(set(verdicts[0]) & set(verdicts[1]), key=lambda k: (problems[k[0]], k[1]))
    print("| layer | threads | baseline verdict | candidate verdict | baseline ms | "
          "candidate ms | generic ms | candidate / baseline |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for key in keys:
        base, cand = verdicts[0][key], verdicts[1][key]
        spec, threads = base.spec, key[1]
        bench = LayerBench.make(spec, copy_bytes=0, max_copies=1, seed=5)
        keep_b, run_b = _runner(base, spec, bench, threads)
        keep_c, run_c = _runner(cand, spec, bench, threads)
        _, run_g = _runner(None, spec, bench, threads)
        times = [[], [], []]
        for round_ in range(args.rounds + 1):
            for i, run in enumerate((run_b, run_c, run_g)):
                t0 = time.perf_counter()
                run()
                if round_:
                    times[i].append(time.perf_counter() - t0)
        b, c, g = (statistics.median(t) for t in times)
        del keep_b, keep_c
        ratio = c / b
        ratios.append(ratio)
        kind = lambda e: "searched" if e.scheme is not None else "generic"  # noqa: E731
        print(f"| {problems[key[0]]} | {threads} | {kind(base)} | {kind(cand)} | "
              f"{b * 1e3:.3f} | {c * 1e3:.3f} | {g * 1e3:.3f} | {ratio:.3f} |", flush=True)
    geo = float(np.exp(np.mean(np.log(ratios))))
    print(f"\ncandidate / baseline: geomean {geo:.3f}, worst {max(ratios):.3f}, best "
          f"{min(ratios):.3f} over {len(ratios)} verdicts; measured on "
          f"{ttile.__version__} with {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
