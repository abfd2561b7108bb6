"""Combine several ``bench_conv.py --output`` files: per layer, the median of the runs'
torch/ttile ratios, then the geometric means and the lowest layer.

One run on the shared development machine can catch a slow phase that lasts a whole
layer's rounds (a layer's ratio then moves by 30 % between runs while the kernels are the
same); the median over runs made at different times does not carry one such phase.

    python benchmarks/combine_runs.py benchmarks/results/run9.md run10.md run11.md
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import numpy as np

SECTION = re.compile(r"^### (\d+) threads?")


def read_ratios(path: Path) -> dict[tuple[int, str], tuple[float, float]]:
    """(threads, layer) -> (torch/conv2d, torch/Conv2d) from one run's markdown tables."""
    ratios, threads = {}, None
    for line in path.read_text().splitlines():
        section = SECTION.match(line)
        if section:
            threads = int(section.group(1))
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if threads is None or len(cells) != 11 or cells[0] in ("layer", "") \
                or cells[0].startswith("---"):
            continue
        ratios[threads, cells[0]] = (float(cells[9]), float(cells[10]))
    if not ratios:
        raise ValueError(f"{path}: no bench_conv.py tables found")
    return ratios


def combine(paths: list[Path]) -> list[str]:
    runs = [read_ratios(path) for path in paths]
    keys = [key for key in runs[0] if all(key in run for run in runs)]
    lines = []
    for threads in sorted({t for t, _ in keys}):
        layers = [name for t, name in keys if t == threads]
        lines += [f"### {threads} thread{'s' if threads > 1 else ''}: median of "
                  f"{len(runs)} runs", "",
                  "| layer | torch/conv2d per run | torch/Conv2d per run | median conv2d | "
                  "median Conv2d |", "|---|---|---|---|---|"]
        medians_call, medians = [], []
        for name in layers:
            per_call = [run[threads, name][0] for run in runs]
            prepacked = [run[threads, name][1] for run in runs]
            medians_call.append(statistics.median(per_call))
            medians.append(statistics.median(prepacked))
            lines.append(f"| {name} | {' '.join(f'{r:.2f}' for r in per_call)} | "
                         f"{' '.join(f'{r:.2f}' for r in prepacked)} | "
                         f"{medians_call[-1]:.2f} | {medians[-1]:.2f} |")
        lines += ["", f"Geometric mean of the medians: {_geomean(medians):.2f} with Conv2d "
                      f"(lowest {min(medians):.2f}), {_geomean(medians_call):.2f} with conv2d "
                      f"(lowest {min(medians_call):.2f}).", ""]
    return lines


def _geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench_conv.py --output files")
    args = parser.parse_args(argv)
    try:
        print("\n".join(combine(args.runs)))
    except (OSError, ValueError) as error:
        print(f"combine_runs: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
