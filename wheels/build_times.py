"""The slowest translation units of the last build, from the build's own log.

`pip install .` builds in ``build/<wheel tag>/`` (pyproject.toml's ``build-dir``), and
ninja records there when each output started and finished (``.ninja_log``). CI prints
this after its install, so that a unit that starts to dominate the build shows in every
run; the build's wall time is set by its slowest unit as soon as the others are done.

    python wheels/build_times.py [--top N] [--limit SECONDS] [BUILD_DIR ...]

With ``--limit``, exits 1 when any unit took longer (a report, not a gate, in CI).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def unit_times(log: Path) -> dict[str, float]:
    """Seconds per output of the newest build recorded in a .ninja_log (v5: start, end,
    mtime, output, hash per line; a rebuilt output keeps its last line)."""
    times: dict[str, float] = {}
    for line in log.read_text().splitlines():
        if line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) < 4:
            continue
        start, end, output = int(fields[0]), int(fields[1]), fields[3]
        times[output] = (end - start) / 1000.0
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build_dirs", nargs="*", type=Path,
                        help="build folders (default: every one under build/)")
    parser.add_argument("--top", type=int, default=12, help="how many units to list")
    parser.add_argument("--limit", type=float, default=None,
                        help="exit 1 when a unit took longer than this many seconds")
    args = parser.parse_args(argv)
    logs = [d / ".ninja_log" for d in args.build_dirs] if args.build_dirs else \
        sorted((ROOT / "build").glob("*/.ninja_log"), key=lambda p: p.stat().st_mtime)[-1:]
    logs = [log for log in logs if log.exists()]
    if not logs:
        print("build_times: no .ninja_log found (was the build made by ninja, in build/?)")
        return 0
    times = unit_times(logs[-1])
    units = {name: s for name, s in times.items() if name.endswith(".o")}
    total = sum(units.values())
    slowest = sorted(units.items(), key=lambda item: -item[1])
    print(f"Build {logs[-1].parent}: {len(units)} translation units, {total:.0f} s of "
          f"compiling in all; the slowest {min(args.top, len(slowest))}:")
    for name, seconds in slowest[:args.top]:
        print(f"  {seconds:7.1f} s  {name.split('.dir/', 1)[-1].removesuffix('.o')}")
    if args.limit is not None and slowest and slowest[0][1] > args.limit:
        print(f"build_times: {slowest[0][0]} took {slowest[0][1]:.0f} s, over "
              f"{args.limit:.0f} s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
