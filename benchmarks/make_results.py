"""Render benchmarks/README.md, the results page, from the result files in
benchmarks/records/ (written by the benchmarks' ``--record``; see ``results.py``).

``python benchmarks/make_results.py`` rewrites the page; ``--check`` exits 1 when the page
on disk is not what the result files give (a test runs it, so the page never drifts from
its data). Each CPU gets a section with its current tables, each stamped with the CPU,
the kernel set that served, thread counts, peer versions, the commit and the command that
reproduces it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

PAGE = results.HERE / "README.md"
ORDER = ["conv-sets-off", "conv-sets-on", "conv-sets-off-tuning-now", "conv-avx2",
         "depthwise", "networks", "grouped", "grouped-bf16", "first-call"]

INTRO = """# Results

What ttile measures against the engines users pick for CPU inference (torch with oneDNN,
onnxruntime, OpenVINO), per CPU, one table per question. Every table comes from a result
file in `records/` written by the benchmark named under it, and this page is generated from
those files by `python benchmarks/make_results.py` (do not edit it by hand). Ratios are
medians over rounds of each round's ratio, the contenders interleaved in a seeded shuffled
order (the machines are shared and noisy); a table whose line says so gave each turn 15
ms of quiet first (an engine's worker threads spin after its call and slow whoever runs
next). Above 1, ttile is faster. A kernel set searched
on one CPU at one thread count is evidence about that CPU and thread count only: the
"kernel set" line of each table says which served.

How to read the Fig. 8 tables: `conv2d` is a per-call `ttile.conv2d` (weights packed per
call, or reused after a check that they are unchanged), `Conv2d` a `ttile.Conv2d` made once
(pre-packed); "peers" is the fastest, round by round, of torch's three ways (NCHW,
channels_last, mkldnn pre-packed), onnxruntime and OpenVINO.
"""


def render(records: list[dict]) -> str:
    rank = {name: i for i, name in enumerate(ORDER)}
    by_cpu: dict[str, list[dict]] = {}
    for r in records:
        by_cpu.setdefault(r["cpu"], []).append(r)
    out = [INTRO.rstrip(), ""]
    if not records:
        out += ["No result files yet: run a benchmark with `--record`.", ""]
    for cpu in sorted(by_cpu):
        tables = sorted(by_cpu[cpu], key=lambda r: (rank.get(r["table"], 99), r["table"]))
        out += [f"## {tables[0]['cpu_model']} (`{cpu}`)", ""]
        for r in tables:
            peers = ", ".join(f"{k} {v}" for k, v in r["peers"].items()) or "none"
            threads = ", ".join(str(t) for t in r["threads"])
            out += [f"### {r['title']}", "",
                    f"Kernel set: {r['kernel_set']}. Threads: {threads}. Run-time tuning: "
                    f"{r['tuning']}. Peers: {peers}. ttile {r['ttile']} at commit "
                    f"`{r['commit']}`, {r['date']}." + (f" {r['notes']}." if r["notes"]
                                                          else ""), "",
                    f"Reproduce: `{r['command']}`", ""]
            out += [line for line in r["lines"]]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the page differs from what the result files give")
    args = parser.parse_args(argv)
    page = render(results.read_all())
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is not what benchmarks/records gives: run "
                  f"python benchmarks/make_results.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
