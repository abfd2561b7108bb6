"""Result files: what a benchmark measured, with what it needs to be trusted later.

Each benchmark script that feeds the results page writes one JSON file per table and CPU
(``benchmarks/records/<table>--<cpu-id>.json``, committed): the markdown table it printed
and the facts without which no number can be tied to code or machine - the CPU (model
name and ttile's fingerprint id), which kernel set served (this CPU's shipped set, none,
or sets switched off), thread counts, ttile's and each peer's version, the commit
(``+dirty`` when the tree had uncommitted changes), the date, and the command that
reproduces it. ``make_results.py`` renders ``benchmarks/README.md`` from these files; a new
run of the same table on the same CPU replaces its file.
"""
from __future__ import annotations

import datetime
import json
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records"
FORMAT = 1


def kernel_set(use_tuned: bool = True) -> str:
    """Which kernel set serves calls here: this CPU's shipped set, none, or sets off."""
    import ttile
    from ttile.runtime import registry
    if not use_tuned:
        return "shipped sets switched off (ttile.use_tuned_kernels(False))"
    serving = registry.serving_set(ttile.get_isa())
    count = sum(1 for e in registry.KERNELS if e.cpu == serving.cpu)
    if count:
        return f"{serving.describe()}, {count} searched kernels"
    return f"none shipped for this CPU ({ttile.get_isa().value} generic kernel or run-time tuning)"


def write(table: str, title: str, lines: list[str], *, threads, peers: dict[str, str],
          kernels: str, tuning: str, notes: str = "") -> Path:
    """Write the result file of ``table`` on this CPU; returns its path."""
    import ttile
    from bench_conv import commit, cpu_model
    from ttile.core.cpuinfo import fingerprint
    cpu = fingerprint().id
    data = {"format": FORMAT, "table": table, "title": title,
            "cpu_model": cpu_model(), "cpu": cpu, "kernel_set": kernels,
            "threads": list(threads), "tuning": tuning, "ttile": ttile.__version__,
            "peers": peers, "commit": commit(), "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join(shlex.quote(a) for a in
                                            [_relative(sys.argv[0]), *sys.argv[1:]]),
            "notes": notes, "lines": lines}
    RECORDS.mkdir(exist_ok=True)
    path = RECORDS / f"{table}--{cpu}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _relative(script: str) -> str:
    try:
        return str(Path(script).resolve().relative_to(HERE.parent))
    except ValueError:
        return script


def read_all() -> list[dict]:
    out = []
    for path in sorted(RECORDS.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT:
            out.append(data)
    return out
