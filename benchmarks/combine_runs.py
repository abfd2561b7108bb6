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


def read_ratios(path: Path) -> dict[tuple[int, str], dict[str, float]]:
    """(threads, layer) -> {ratio column: value} from one run's markdown tables (the
    columns torch.../...: torch/conv2d, torch/Conv2d, torch NCHW/conv2d NCHW, ...)."""
    ratios, threads, header = {}, None, None
    for line in path.read_text().splitlines():
        section = SECTION.match(line)
        if section:
            threads, header = int(section.group(1)), None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if threads is None or not line.startswith("|") or cells[0].startswith("---"):
            continue
        if cells[0] == "layer":
            header = cells
            continue
        if header is None or len(cells) != len(header):
            continue
        ratios[threads, cells[0]] = {name: float(value) for name, value in zip(header, cells)
                                     if name.startswith("torch") and "/" in name}
    if not ratios:
        raise ValueError(f"{path}: no bench_conv.py tables found")
    return ratios


def combine(paths: list[Path]) -> list[str]:
    runs = [read_ratios(path) for path in paths]
    keys = [key for key in runs[0] if all(key in run for run in runs)]
    lines = []
    for threads in sorted({t for t, _ in keys}):
        layers = [name for t, name in keys if t == threads]
        names = [n for n in runs[0][threads, layers[0]] if all(n in run[threads, layers[0]]
                                                               for run in runs)]
        lines += [f"### {threads} thread{'s' if threads > 1 else ''}: median of "
                  f"{len(runs)} runs", "",
                  "| layer | " + " | ".join(f"{n} per run | median" for n in names) + " |",
                  "|---|" + "---|---|" * len(names)]
        medians: dict[str, list[float]] = {n: [] for n in names}
        for layer in layers:
            cells = []
            for n in names:
                values = [run[threads, layer][n] for run in runs]
                medians[n].append(statistics.median(values))
                cells.append(f"{' '.join(f'{v:.2f}' for v in values)} | {medians[n][-1]:.2f}")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        summary = "; ".join(f"{n} {_geomean(v):.2f} (lowest {min(v):.2f})"
                            for n, v in medians.items())
        lines += ["", f"Geometric means of the medians: {summary}.", ""]
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
