"""``ttile-generate``: the offline generator's command line.

Subcommands:
  microkernels   step 1: measure microkernels on this CPU, save the table under
                 generator/microkernels/ (resumes if interrupted), optionally plot it.
  model          step 2: rank loop permutations above a microkernel for one layer with
                 the IOOpt model, beside IOOpt's lower bound.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_GENERATOR_DIR = Path("generator")


class _Progress:
    """tqdm when it is installed, else a single updating line on stderr."""

    def __init__(self, description: str):
        self.description = description
        self.bar = None
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, what: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            if self.bar is None:
                self.bar = tqdm(total=total, desc=self.description, unit="kernel")
            self.bar.n = done
            self.bar.set_postfix_str(what, refresh=True)
            return
        elapsed = time.monotonic() - self.start
        print(f"\r{self.description}: {done}/{total} ({elapsed:.0f} s) {what:<24}",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


def _cmd_microkernels(args: argparse.Namespace) -> int:
    from .microkernels import explore
    out_dir = args.generator_dir / "microkernels"
    progress = _Progress("microkernels")
    started = time.monotonic()
    try:
        table = explore(out_dir, kernel_sizes=args.kernel_sizes, threshold=args.threshold,
                        jobs=args.jobs, progress=progress)
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    ok = [m for m in table.measurements if m.status == "ok"]
    failed = len(table.measurements) - len(ok)
    print(f"{len(table.measurements)} microkernels measured in {elapsed:.0f} s "
          f"({failed} failed), peak {table.peak_gflops:.1f} GFLOP/s per core")
    print("best per unrolling scheme:")
    for family, m in sorted(table.best_per_family().items()):
        print(f"  [T{table.reduction} c; {m.shape.block_specifiers()}]  "
              f"{m.gflops:.1f} GFLOP/s  {m.percent_of_peak:.0f} %")
    selected = sum(c.beta_max - c.beta_min + 1 for c in table.classes)
    print(f"{selected} selected (>= {100 * table.threshold:.0f} % of their scheme's best) "
          f"in {len(table.classes)} classes; table: {out_dir / (table.cpu.id + '.json')}")
    if args.plot:
        from .plot import plot_microkernels
        print(f"plot: {plot_microkernels(table, args.plot)}")
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from .machine import load_or_measure
    from .microkernels import MicrokernelShape, load_table
    from .model import compare_with_lower_bound, default_microkernel, rank_permutations
    from .networks import layer

    spec = layer(args.layer).spec()
    machine = load_or_measure(args.generator_dir / "machine")
    caches = machine.caches()
    if args.microkernel:
        r, s, axis, alpha, beta = args.microkernel
        shape = MicrokernelShape(int(r), int(s), axis, int(alpha), int(beta))
    else:
        try:
            table = load_table(args.generator_dir / "microkernels")
        except FileNotFoundError as exc:
            print(f"note: {exc}; using a default microkernel", file=sys.stderr)
            table = None
        shape = default_microkernel(spec, table)
    started = time.monotonic()
    ranked = rank_permutations(spec, shape, caches, top=args.top)
    elapsed = time.monotonic() - started
    b = machine.bandwidths
    print(f"{args.layer}: K={spec.k} C={spec.c} H=W={spec.h} R=S={spec.r} stride "
          f"{spec.stride_h}; microkernel [{shape.block_specifiers()}]")
    print(f"caches: " + ", ".join(f"{c.name} {c.capacity_bytes // 1024} KiB" for c in caches)
          + f"; read bandwidth L2 {b.l2 / 1e9:.0f}, L3 {b.l3 / 1e9:.0f}, DRAM "
          f"{b.dram / 1e9:.0f} GB/s")
    for rank, rp in enumerate(ranked, 1):
        volumes = ", ".join(f"{name} {v:.3g}" for name, v in rp.estimate.volumes)
        print(f"{rank}. {rp.notation()}  counts {rp.notation(with_counts=True)}")
        print(f"   data moved (floats): {volumes}; estimated {rp.estimate.cost * 1e3:.3f} ms")
    print("best permutation against IOOpt's lower bound (floats loaded into each cache):")
    for report in compare_with_lower_bound(spec, ranked[0], caches):
        print(f"   {report.cache}: upper {report.volume:.3g} (this scheme), lower "
              f"{report.lower_bound:.3g}, dominant term: {report.dominant_term}")
    print(f"({elapsed:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttile-generate",
                                     description="TTile offline generator")
    parser.add_argument("--generator-dir", type=Path, default=DEFAULT_GENERATOR_DIR,
                        help="where tables and records live (default: ./generator)")
    sub = parser.add_subparsers(dest="command", required=True)
    micro = sub.add_parser("microkernels", help="step 1: measure microkernels on this CPU")
    micro.add_argument("--threshold", type=float, default=0.85,
                       help="keep microkernels within this fraction of their scheme's best")
    micro.add_argument("--kernel-sizes", type=int, nargs="+", default=[1, 3, 5, 7],
                       help="kernel sizes R=S whose r/s unrolls are explored")
    micro.add_argument("--jobs", type=int, default=2, help="parallel compiler processes")
    micro.add_argument("--plot", type=Path, help="draw the Fig. 7 heatmaps to this PNG")
    micro.set_defaults(run=_cmd_microkernels)
    model = sub.add_parser("model", help="step 2: rank loop permutations for a layer")
    model.add_argument("--layer", required=True, help="a Fig. 8 layer, e.g. Yolo9000-12")
    model.add_argument("--microkernel", nargs=5, metavar=("R", "S", "AXIS", "ALPHA", "BETA"),
                       help="unroll r, unroll s, h|w, k vectors, outputs (default: best "
                            "measured that fits)")
    model.add_argument("--top", type=int, default=3, help="permutations to show")
    model.set_defaults(run=_cmd_model)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "microkernels" and not 0 < args.threshold <= 1:
        print("--threshold must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"ttile-generate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
