"""``ttile-generate``: the offline generator's command line.

Subcommands:
  microkernels   step 1: measure microkernels on this CPU, save the table under
                 generator/microkernels/ (resumes if interrupted), optionally plot it.
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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threshold", 0.5) is not None and not 0 < getattr(args, "threshold", 0.5) <= 1:
        print("--threshold must be in (0, 1]", file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
