"""``ttile-generate``: the command line over the generator and the run-time cache.

Subcommands:
  microkernels   step 1: measure microkernels on this CPU, save the table under
                 generator/microkernels/ (resumes if interrupted), optionally plot it;
                 --quick measures only those other CPUs' tables selected.
  model          step 2: rank loop permutations above a microkernel for one layer with
                 the IOOpt model, beside IOOpt's lower bound.
  records        migrate a tuning-records file to the current format.
  cache          list or clear the kernels ttile.conv2d tuned at run time.
  layers         list the layers of a network, layers file or ONNX model.
With --network NAME (or --layers-file F, or --onnx model.onnx): steps 3-5 for every layer (scheme space,
pruning, autotuning into generator/records/), then the kernels and their registry are
written to kernels/gen/ for the build to compile. On a CPU without a microkernel table
(its own or one of the same microarchitecture) step 1's quick mode runs first.

Tables are read from --data-dir (default ./generator) and then from the copies installed
with ttile; measurements are written under --data-dir. This module sits above both the
generator and the runtime (its ``cache`` command), and nothing imports it.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

from .core.kinds import Isa, KernelKind
from .core.vectors import family_stem, vector_isa
from .generator.data import DEFAULT_DATA_DIR


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


class SearchDepth(Enum):
    """How much of each layer's ranked candidates the network search measures."""
    QUICK = "quick"   # a new CPU's first search: minutes for a network
    FULL = "full"     # the search the shipped sets come from


@dataclass(frozen=True)
class SearchEffort:
    """What one depth measures per layer: the wall seconds of its measurement at every
    thread count (autotune.LayerClock), the learned ranking's first picks screened, the sequential schemes whose parallel
    variants are tuned, the finalists re-timed with the paper's protocol, and how many of
    the fastest microkernel classes the scheme space is built on, with how many
    completions per loop order the model ranks (the run-time tuner ranks 20 000)."""
    budget_seconds: float
    rank_measure: int
    parallel_from: int
    refine_top: int
    classes: Optional[int] = None   # the microkernel classes searched (None: every one
                                    # that fits; the model ranks permutations above each,
                                    # 5-8 s per class and layer on a Zen 3)
    max_points: int = 200_000       # completions ranked per loop order: the model's cost
                                    # of ~300 000 of them took 60 s of ResNet18-8's search
    model_orders: int = 1           # the IOOpt model's loop permutations per class beside
                                    # the reduction-innermost orders (0: none solved)


#: The full search found the ResNet-18 kernels of the shipped sets; the quick one tunes
#: ResNet-18 at 1 and 2 threads from no microkernel table (step 1's quick mode included)
#: in about 2 minutes on 2 cores of a Xeon model 167 (4 min 47 s with every quick shape
#: measured and the model's permutations solved). It solves no model permutation (the
#: reduction-innermost orders' completions, ranked): the solves were a quarter of its
#: time, and its kernels were no faster for them.
EFFORTS = {SearchDepth.FULL: SearchEffort(90.0, 24, 4, 4),
           SearchDepth.QUICK: SearchEffort(12.0, 6, 1, 2, classes=2, max_points=20_000,
                                           model_orders=0)}

#: Candidates per layer the offline search screens in the learned ranking's order (the
#: Yolo9000 search on a Zen 5: 22.7 minutes in the model's order, 9.5 this way).
DEFAULT_RANK_MEASURE = EFFORTS[SearchDepth.FULL].rank_measure


def _search_isa(args: argparse.Namespace) -> Isa:
    """The vector family ``--isa`` names (auto: AVX-512F where the CPU has it, else
    AVX2); SystemExit when this CPU cannot run it."""
    from . import _kernels
    has = {Isa.AVX512F: _kernels.cpu_has_avx512f(), Isa.AVX2: _kernels.cpu_has_avx2()}
    if args.isa == "auto":
        for isa in (Isa.AVX512F, Isa.AVX2):
            if has[isa]:
                return isa
        raise SystemExit("ttile-generate: this CPU has neither AVX-512F nor AVX2 + FMA: "
                         "there is no vector family to search")
    isa = Isa(args.isa)
    if not has[isa]:
        raise SystemExit(f"ttile-generate: --isa {isa.value}: this CPU does not run it")
    return isa


def _cmd_train_ranker(args: argparse.Namespace) -> int:
    import json

    from .generator.data import DataKind, search_path
    from .generator.microkernels import MicrokernelTable
    from .tuning import ranker
    tables = {}
    for directory in reversed(search_path(DataKind.MICROKERNELS, args.data_dir)):
        for path in sorted(directory.glob("*.json")):   # the data directory's win
            table = MicrokernelTable.from_json(json.loads(path.read_text()))
            tables[(table.cpu.id, table.isa)] = table
    started = time.monotonic()
    groups = ranker.training_groups(args.data_dir / DataKind.RECORDS.value, tables)
    if args.hold_out:   # a network's problems left out, to measure the search on them
        held = {layer.spec().key() for layer in _load_layers(args.hold_out)}
        groups = [g for g in groups if g.spec.key() not in held]
    if not groups:
        print(f"no screened measurements with a microkernel table under {args.data_dir}",
              file=sys.stderr)
        return 2
    fit = dict(rounds=args.rounds, depth=args.depth)
    results = ranker.evaluate(groups, folds=args.folds, **fit)
    held_out = ranker.summary(results)
    model = ranker.train(groups, **fit)
    model = ranker.Ranker(model.trees, {**model.trained_on, "held_out": held_out,
                                        "folds": args.folds, **fit,
                                        "networks_left_out": args.hold_out or []})
    path = model.save(args.data_dir / DataKind.RANKER.value / "ranker.json")
    report = ranker.evaluation_report(results, held_out, model, args.folds)
    (path.parent / "evaluation.md").write_text(report)
    print(report)
    print(f"trained on {model.trained_on['measurements']} measurements in {len(groups)} "
          f"groups in {time.monotonic() - started:.0f} s: {path}")
    return 0


def _cmd_microkernels(args: argparse.Namespace) -> int:
    from .generator.microkernels import explore
    if args.plot:
        try:  # say so now, not after minutes of measurement
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'ttile[plot]'", file=sys.stderr)
            return 2
    out_dir = args.data_dir / "microkernels"
    progress = _Progress("microkernels")
    started = time.monotonic()
    try:
        table = explore(args.data_dir, kernel_sizes=args.kernel_sizes, threshold=args.threshold,
                        jobs=args.jobs, progress=progress, isa=_search_isa(args),
                        quick=args.quick)
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    ok = [m for m in table.measurements if m.status == "ok"]
    failed = len(table.measurements) - len(ok)
    print(f"{len(table.measurements)} {table.isa.value} microkernels measured in {elapsed:.0f} s "
          f"({failed} failed){' (quick: those other CPUs selected)' if table.quick else ''}, "
          f"{table.isa.value} peak {table.peak_gflops:.1f} GFLOP/s per core")
    print("best per unrolling scheme:")
    for family, m in sorted(table.best_per_family().items()):
        print(f"  [T{table.reduction} c; {m.shape.block_specifiers()}]  "
              f"{m.gflops:.1f} GFLOP/s  {m.percent_of_peak:.0f} %")
    selected = sum(c.beta_max - c.beta_min + 1 for c in table.classes)
    print(f"{selected} selected (>= {100 * table.threshold:.0f} % of their scheme's best) "
          f"in {len(table.classes)} classes; table: "
          f"{out_dir / (family_stem(table.cpu.id, table.isa) + '.json')}")
    if args.plot:
        from .generator.plot import plot_microkernels
        print(f"plot: {plot_microkernels(table, args.plot)}")
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from .generator.costmodel import CostModel, default_microkernel
    from .generator.machine import load_or_measure
    from .generator.microkernels import MicrokernelShape, load_table
    from .generator.networks import layer

    spec = layer(args.layer).spec()
    machine = load_or_measure(args.data_dir)
    isa = _search_isa(args)
    model = CostModel(spec, machine.caches(), vector_isa(isa).lanes)
    caches = model.caches
    if args.microkernel:
        r, s, axis, alpha, beta = args.microkernel
        shape = MicrokernelShape(int(r), int(s), axis, int(alpha), int(beta))
    else:
        try:
            table = load_table(args.data_dir, isa=isa)
        except FileNotFoundError as exc:
            print(f"note: {exc}; using a default microkernel", file=sys.stderr)
            table = None
        shape = default_microkernel(spec, table)
    started = time.monotonic()
    ranked = model.rank_permutations(shape, top=args.top)
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
    for report in model.lower_bounds(ranked[0]):
        print(f"   {report.cache}: upper {report.volume:.3g} (this scheme), lower "
              f"{report.lower_bound:.3g}, dominant term: {report.dominant_term}")
    print(f"({elapsed:.1f} s)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Serve every layer of a built-in network (or, with --onnx, a user's model:
    :func:`_cmd_run_onnx`) with ``ttile.Conv2d`` on this CPU: check
    each against the float64 reference, time it beside the engines installed here (torch,
    onnxruntime, OpenVINO: :mod:`ttile.peers`) in the same shuffled rounds, and say what
    served it."""
    if args.run_onnx is not None:
        return _cmd_run_onnx(args)
    import random
    import statistics

    import numpy as np

    import ttile
    from . import peers as engines
    from .core.reference import conv_mismatch
    from .generator.networks import NETWORKS
    from .runtime import registry

    previous = ttile.set_tuning(mode=args.tuning)
    threads = args.threads
    rng = np.random.default_rng(0)
    order = random.Random(0)
    peers = engines.available() if args.peers else []
    total_flops = total_seconds = 0.0
    peer_seconds = {peer: 0.0 for peer in peers}
    wrong = tuned_here = 0
    kernel_set = (registry.serving_set(ttile.get_isa()).describe() if ttile.get_isa().vector
                  else "none (portable C)")
    print(f"{args.network} on {_cpu_name()}, {threads} thread(s), NHWC, batch 1; kernel "
          f"set: {kernel_set}; run-time tuning {args.tuning!r}")
    if peers:
        print("peers: " + ", ".join(f"{p.value} {engines.version(p)}" for p in peers)
              + " (NCHW input, same thread count, timed in the same shuffled rounds)")
    heads = [f"{p.value} ms" for p in peers] + (["best peer / ttile"] if peers else [])
    print(f"| layer | served by | ttile ms (median of {args.reps}) | GFLOP/s | "
          + "".join(f"{h} | " for h in heads) + "check |")
    print("|---|---|---|---|" + "---|" * len(heads) + "---|")
    try:
        for layer in NETWORKS[args.network]:
            spec = layer.spec()
            x = rng.uniform(-1, 1, (1, layer.hw, layer.hw, layer.c)).astype(np.float32)
            w = rng.uniform(-1, 1, (layer.rs, layer.rs, layer.c // layer.groups,
                                    layer.k)).astype(np.float32)
            pad = (spec.pad_top, spec.pad_left)
            pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
            before = ttile.plan(x.shape, w.shape, stride=layer.stride, padding=pad,
                                groups=layer.groups, layout="NHWC", threads=threads,
                                prepacked=True)
            conv = ttile.Conv2d(w, stride=layer.stride, padding=pad, groups=layer.groups,
                                layout="NHWC", threads=threads)
            y = conv(x)                       # the first call tunes, if the policy says so
            problem = conv_mismatch(y, x, w, (spec.stride_h, spec.stride_w), pads,
                                    groups=layer.groups)
            wrong += problem is not None
            runs = {"ttile": lambda: conv(x)}
            x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
            w_kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
            expected = y.transpose(0, 3, 1, 2)
            for peer in peers:
                run = engines.runner(peer, x_nchw, w_kcrs, (spec.stride_h, spec.stride_w),
                                     pads, layer.groups, threads)
                if run is not None and np.allclose(run(), expected, rtol=1e-3, atol=1e-3):
                    runs[peer] = run
            times = _interleaved_times(runs, args.reps, order)
            seconds = statistics.median(times["ttile"])
            total_flops += layer.flops
            total_seconds += seconds
            plan = ttile.plan(x.shape, w.shape, stride=layer.stride, padding=pad,
                              groups=layer.groups, layout="NHWC", threads=threads,
                              prepacked=True)
            tuned_here += plan.kind is ttile.KernelKind.JIT \
                and before.kind is not ttile.KernelKind.JIT
            served = plan.kind.value + (f" `{plan.scheme}`" if plan.scheme else "")
            cells, best = [], None
            for peer in peers:
                if peer in times:
                    t = statistics.median(times[peer])
                    peer_seconds[peer] += t
                    best = t if best is None else min(best, t)
                    cells.append(f"{t * 1e3:.3f}")
                else:
                    peer_seconds[peer] = float("nan")
                    cells.append("n/a")
            if peers:
                cells.append("n/a" if best is None else f"{best / seconds:.2f}")
            print(f"| {layer.name} | {served} | {seconds * 1e3:.3f} | "
                  f"{layer.flops / seconds / 1e9:.1f} | " + "".join(f"{c} | " for c in cells)
                  + f"{'ok' if problem is None else problem} |", flush=True)
    finally:
        ttile.restore_tuning(previous)
    print(f"whole network: {total_seconds * 1e3:.2f} ms, "
          f"{total_flops / total_seconds / 1e9:.1f} GFLOP/s; {wrong} wrong result(s)")
    for peer in peers:
        print(f"  {peer.value}: {peer_seconds[peer] * 1e3:.2f} ms "
              f"(ttile {peer_seconds[peer] / total_seconds:.2f}x as fast)")
    print(f"run-time tuning: {tuned_here} layer(s) tuned in this run" if args.tuning != "never"
          else "run-time tuning: off")
    return 1 if wrong else 0


def _interleaved_times(runs: dict, reps: int, order) -> dict:
    """Seconds of each run over ``reps`` rounds, the runs in an order ``order`` (a
    seeded random.Random) shuffles each round, each timed call right after an untimed
    one of its own (the previous contender's threads may still spin)."""
    times = {name: [] for name in runs}
    names = list(runs)
    for _ in range(reps):
        order.shuffle(names)
        for name in names:
            runs[name]()              # warm, then timed
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def _cmd_run_onnx(args: argparse.Namespace) -> int:
    """Serve a user's ONNX model with ``ttile.onnx.load`` on this CPU: the table of what
    serves each layer, the output checked against onnxruntime on the same file and
    input, and the whole model timed beside onnxruntime and OpenVINO (at f32 and at its
    default precision) in the same shuffled rounds."""
    import random
    import statistics

    import numpy as np

    import ttile.onnx
    from . import peers as engines
    from .onnx.graph import declared_shapes

    threads = args.threads
    path = args.run_onnx
    shapes = declared_shapes(path, symbolic_batch=1)
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, shape).astype(np.float32) for shape in shapes]
    print(f"{path} on {_cpu_name()}, {threads} thread(s), batch from the file (a symbolic "
          f"one read as 1), precision {args.precision}")
    served = ttile.onnx.load(path, tuple(xs) if len(xs) > 1 else xs[0], threads=threads,
                             precision=args.precision, progress=True)
    print(served.describe())
    data = Path(path).read_bytes()
    runs = {"ttile": lambda: served(*xs)}
    peers = [p for p in engines.available() if p is not engines.Peer.TORCH] \
        if args.peers else []
    expected = None
    if engines.Peer.ONNXRUNTIME in peers or not args.peers:
        session = engines.onnxruntime_session(data, threads)
        feed = dict(zip([i.name for i in session.get_inputs()], xs))
        expected = session.run(None, feed)
        if engines.Peer.ONNXRUNTIME in peers:
            runs["onnxruntime"] = lambda: session.run(None, feed)
    if engines.Peer.OPENVINO in peers and len(xs) == 1:
        for label, precision in (("OpenVINO f32", "f32"), ("OpenVINO default", None)):
            runs[label] = engines.onnx_runner(engines.Peer.OPENVINO, data, xs[0], threads,
                                              precision=precision)
    y = served(*xs)
    ys = y if isinstance(y, tuple) else (y,)
    error = None
    if expected is not None:
        error = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                    for a, b in zip(ys, expected))
    bound = 1e-4 if args.precision == "fp32" else 3e-2
    verdict = "not checked" if error is None else \
        f"{'ok' if error <= bound else 'WRONG'} ({error:.1e} of the largest value, " \
        f"bound {bound:.0e})"
    print(f"check against onnxruntime: {verdict}")
    for run in runs.values():
        run()
    times = _interleaved_times(runs, args.reps, random.Random(0))
    ttile_s = statistics.median(times["ttile"])
    print(f"| contender | ms (median of {args.reps}) | its time / ttile's |")
    print("|---|---|---|")
    for name in runs:
        t = statistics.median(times[name])
        print(f"| {name} | {t * 1e3:.3f} | {t / ttile_s:.2f} |")
    return 1 if error is not None and error > bound else 0


def _cpu_name() -> str:
    from .core.cpuinfo import fingerprint
    cpu = fingerprint()
    return f"{cpu.model_name} ({cpu.id})"


def _cmd_records(args: argparse.Namespace) -> int:
    from .tuning.records import RECORD_FORMAT, TuningDatabase
    for path in args.files:
        if path.suffix != ".jsonl" or not path.exists():
            print(f"ttile-generate: {path}: not a records file (<cpu-id>.jsonl)",
                  file=sys.stderr)
            return 2
        database = TuningDatabase(path.parent, path.stem)
        database.rewrite()
        print(f"{path}: {len(database.records)} records in format {RECORD_FORMAT}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from .runtime.cache import KernelCache
    cache = KernelCache(args.cache_dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} files from {cache.directory}")
        return 0
    entries = cache.entries()
    print(f"{len(entries)} entries in {cache.directory}")
    for e in entries:
        key = e.get("key", {}) if isinstance(e.get("key"), dict) else {}
        state = "" if e["valid"] else "  (invalid: will be rebuilt)"
        kind = e.get("kind", "?")
        rate = f"{e.get('gflops', 0):.1f} GFLOP/s" if kind == KernelKind.JIT.value else \
            f"generic {e.get('generic_gflops', 0):.1f} GFLOP/s"
        print(f"{e['file']}: {key.get('problem', '?')} {key.get('layout', '?')} "
              f"t{key.get('threads', '?')} {kind} {e.get('scheme', '')} {rate}{state}")
    return 0


def _load_layers(network=None, layers_file=None, onnx=None):
    """The layers named by --network, --layers-file or --onnx (exactly one is given)."""
    from .generator.networks import NETWORKS, Layer
    if network:
        layers = []
        for name in network:
            if name.lower() not in NETWORKS:
                raise ValueError(f"unknown network {name!r}; built in: "
                                 f"{', '.join(NETWORKS)} (or pass --layers-file / --onnx)")
            layers += NETWORKS[name.lower()]
        return layers
    if onnx:
        from .generator.onnx_import import read_onnx_layers
        return list(read_onnx_layers(onnx).layers)
    path = Path(layers_file)
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:            # Python 3.10: the same parser as a package
            import tomli as tomllib
        data = tomllib.loads(path.read_text())
    else:
        import json
        data = json.loads(path.read_text())
    entries = data["layers"] if isinstance(data, dict) else data
    layers = []
    for i, e in enumerate(entries):
        try:
            layers.append(Layer(str(e.get("name", f"layer-{i}")), int(e["k"]), int(e["c"]),
                                int(e["hw"]), int(e["rs"]), int(e.get("stride", 1)),
                                int(e.get("groups", 1))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: layer {i} needs integer k, c, hw, rs (and optional "
                             f"stride, groups, name): {exc}") from None
    return layers


def _cmd_layers(args: argparse.Namespace) -> int:
    """List the layers a network, layers file or ONNX file gives the generator."""
    skipped, shared, note = (), None, ""
    if args.onnx:
        from .generator.onnx_import import read_onnx_layers
        found = read_onnx_layers(args.onnx)
        layers, skipped, shared = found.layers, found.skipped, found.nodes
        if found.batch_from_symbol:
            note = " (a symbolic batch size is read as 1)"
    else:
        layers = _load_layers(args.network, args.layers_file)
    print(f"{len(layers)} distinct convolution layers{note}")
    print("| layer | N | K | C | H x W | R x S | stride | pads t,b,l,r | dilation | groups "
          "| MFLOP | search | nodes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, layer in enumerate(layers):
        s = layer.spec()
        search = "depthwise kernel" if layer.depthwise else \
            _grouped_server(layer) if layer.groups > 1 else "searched"
        nodes = len(shared[i]) if shared else 1
        print(f"| {layer.name} | {s.n} | {layer.k} | {layer.c} | {s.h} x {s.w} | "
              f"{s.r} x {s.s} | {s.stride_h},{s.stride_w} | {s.pad_top},{s.pad_bottom},"
              f"{s.pad_left},{s.pad_right} | {s.dilation_h},{s.dilation_w} | {layer.groups} "
              f"| {layer.flops / 1e6:.1f} | {search} | {nodes} |")
    for s in skipped:
        print(f"skipped: {s.node} ({s.op_type}): {s.reason}")
    return 0


def _grouped_server(layer) -> str:
    """What the search does with a grouped layer (1 < groups < channels): one problem of
    its groups, measured against the kernel serving it otherwise."""
    from . import _kernels
    cg, kg = layer.c // layer.groups, layer.k // layer.groups
    if _kernels.grouped_lanes_supported(cg, kg, layer.groups):
        return "searched as one grouped problem, against the grouped kernel"
    return "searched as one grouped problem, against the generic kernel"


def _table_or_quick_step1(args: argparse.Namespace, isa: Isa, specs=None):
    """This CPU's microkernel table (or one of the same microarchitecture); where there is
    none, step 1's quick mode measures one first rather than sending the user to run it:
    only the shapes the layers ``specs`` can use (about a minute for ResNet-18 on 2
    cores), and a quick table that lacks some a later network's layers use grows by
    those."""
    from .core.vectors import vector_isa
    from .generator.microkernels import explore, load_table, quick_shapes, shapes_for
    try:
        table = load_table(args.data_dir, isa=isa)
    except FileNotFoundError:
        table = None
    if table is not None and not table.quick:
        return table
    if table is not None:
        if specs is None:
            return table
        measured = {m.shape for m in table.measurements}
        missing = [s for s in shapes_for(quick_shapes(isa, args.data_dir), specs,
                                         vector_isa(isa).lanes)
                   if s not in measured]
        if not missing:
            return table
        print(f"the quick {isa.value} microkernel table lacks {len(missing)} shapes these "
              f"layers can use: measuring them", file=sys.stderr)
    else:
        print(f"no {isa.value} microkernel table for this CPU: measuring the quick step 1 "
              f"first, the shapes these layers can use ('ttile-generate microkernels' "
              f"measures every shape)", file=sys.stderr)
    progress = _Progress("microkernels")
    started = time.monotonic()
    try:
        table = explore(args.data_dir, progress=progress, isa=isa, quick=True,
                        layers=specs, base=table)
    finally:
        progress.close()
    print(f"{len(table.measurements)} microkernels measured in "
          f"{time.monotonic() - started:.0f} s, {len(table.classes)} classes", file=sys.stderr)
    return table


def _search_depth(args: argparse.Namespace, table, cpu_id: Optional[str] = None
                  ) -> SearchDepth:
    """--search, where "auto" is quick on a new CPU - one whose microkernel table is step
    1's quick one, or was measured on another VM of the same microarchitecture and
    borrowed (``cpu_id``: this CPU's): its first network in minutes (ResNet18 at 1 and 2
    threads on a Xeon model 167 with the shipped table: 70 s, against 7 min 22 s for the
    full search) -, and quick where ``--budget`` is below the quick search's own: the
    full search's scheme space (its model ranking 200 000 completions per loop order)
    took 1-105 s a layer, 41 s on average over Yolo9000's 11 on a Xeon model 207, to
    pick 24 candidates that a 2 s budget has time to compile one or two of; the quick
    one's took 0-2 s. Full otherwise."""
    if args.search != "auto":
        return SearchDepth(args.search)
    new_cpu = table is not None and (table.quick or (cpu_id is not None
                                                     and table.cpu.id != cpu_id))
    budget = getattr(args, "budget", None)
    short = budget is not None and budget < EFFORTS[SearchDepth.QUICK].budget_seconds
    return SearchDepth.QUICK if new_cpu or short else SearchDepth.FULL


def _cmd_network(args: argparse.Namespace) -> int:
    from .generator.autotune import (GENERIC_SHARE, LayerClock, Phase, TuneSettings,
                                     compare_warm, measure_generic, tune_layer)
    from .generator.emit import databases_in, emit, registry_entries
    from .generator.machine import load_or_measure
    from .generator.microkernels import measure_peak_gflops
    from .generator.search import classes_for, parallel_variants, scheme_space
    from .tuning.bench import LayerBench
    from .tuning.records import Protocol, TuningDatabase

    layers = _load_layers(args.network, args.layers_file, args.onnx)
    counts = sorted({1, *args.threads})
    isa = _search_isa(args)
    database = TuningDatabase(args.data_dir / "records", isa=isa)
    if args.from_records and not args.warm_check:
        table, caches = None, ()   # nothing is measured: no table needed
    else:
        table = _table_or_quick_step1(args, isa, [layer.spec() for layer in layers
                                                   if not layer.depthwise])
        caches = load_or_measure(args.data_dir).caches()
    depth = _search_depth(args, table, database.cpu_id)
    effort = EFFORTS[depth]
    budget = args.budget if args.budget is not None else effort.budget_seconds
    parallel_from = args.parallel_from if args.parallel_from is not None \
        else effort.parallel_from
    settings = TuneSettings(budget_seconds=budget, refine_top=effort.refine_top)
    search = _distributed_search(args, database)
    ranking = context = None
    if args.rank_measure != 0 and not args.from_records:
        from .generator.data import load_ranker
        from .tuning.ranker import CpuContext
        from .tuning.ranker import order as rank_order
        ranking = load_ranker(args.data_dir)
        if ranking is None and args.rank_measure is not None:
            raise SystemExit("ttile-generate: --rank-measure needs a learned ranking "
                             "(ttile-generate train-ranker)")
        context = CpuContext.from_table(table) if ranking is not None else None
    rank_measure = args.rank_measure or effort.rank_measure
    if not args.from_records:
        picks = f"the ranking's first {rank_measure}" if ranking is not None else "candidates"
        print(f"{depth.value} search: {picks} per layer within {budget:g} s, parallel "
              f"variants of the best {parallel_from}"
              + (" (a new CPU; --search full measures more)"
                 if depth is SearchDepth.QUICK and args.search == "auto" else ""),
              file=sys.stderr)
    source = (f"--network {' '.join(args.network)}" if args.network
              else f"--onnx {Path(args.onnx).name}" if args.onnx
              else f"--layers-file {args.layers_file}")
    command = f"ttile-generate {source}"
    started = time.monotonic()
    verbose = (lambda message: print(message, file=sys.stderr)) if args.verbose else \
        (lambda message: None)
    progress = _Progress("layers")
    rows = []
    # the layers' budgets, the work before them, and the floor within them
    measured_seconds = fixed_seconds = first_seconds = 0.0
    for done, layer in enumerate(layers):
        # a grouped layer is one problem of its groups: its schemes tile one group
        # (``one``), its kernels run every group and are timed against the grouped or
        # generic kernel that serves it otherwise
        spec = layer.problem()
        one = spec.one_group
        progress(done, len(layers), layer.name)
        if layer.depthwise:   # the depthwise kernel serves it: nothing to search
            rows.append((layer, None))
            continue
        if not args.from_records:
            fixed_started = time.monotonic()
            classes = classes_for(one, table)
            if effort.classes is not None:   # the fastest ones
                classes = sorted(classes, key=lambda c: -c.best_percent)[:effort.classes]
            candidates = scheme_space(one, classes, caches, top=args.top,
                                      max_points=effort.max_points,
                                      permutations_per_class=effort.model_orders,
                                      keep_fraction=args.keep_fraction, isa=isa)
            if ranking is not None:   # the learned ranking's first picks, and only those
                candidates = rank_order(ranking, one, candidates, 1, isa,
                                        context)[:rank_measure]
            bench = LayerBench.make(spec)
            # The budget starts here: the scheme space, the inputs and their float64
            # reference above are the layer's fixed work.
            clock = LayerClock(budget, fixed_seconds=time.monotonic() - fixed_started)
            parallel_counts = [t for t in counts[1:] if t <= spec.useful_threads()]
            for threads in [1, *parallel_counts]:
                with clock.timing(Phase.GENERIC):
                    if search is not None and threads == 1:
                        search.measure_generic(layer.name, spec, threads)
                    else:
                        measure_generic(layer.name, spec, threads, database, bench,
                                        seconds=GENERIC_SHARE * budget
                                        / (1 + len(parallel_counts)))
            # one thread two shares of what is left, each parallel count one (its search
            # starts from the single-thread one's best schemes)
            if search is not None:
                search.tune_layer(layer.name, spec, candidates, 1, settings, command,
                                  deadline=clock.share(2 / (2 + len(parallel_counts))))
            else:
                tune_layer(layer.name, spec, candidates, 1, database, bench, settings,
                           verbose, command, clock=clock,
                           deadline=clock.share(2 / (2 + len(parallel_counts))))
            screened = sorted(database.for_layer(spec, 1, Protocol.SCREEN),
                              key=lambda r: r.seconds)
            by_text = {str(c.scheme): c for c in candidates}
            # a kernel tuned at N threads serves N threads; calls of this layer never run
            # on more than its useful threads
            for i, threads in enumerate(parallel_counts):
                parallel, sources = [], 0
                for record in screened:  # the fastest that have a loop to parallelize
                    if sources == parallel_from:
                        break
                    if record.scheme in by_text:
                        variants = parallel_variants(by_text[record.scheme], one, threads,
                                                     isa)
                        if spec.groups >= threads:   # as it is: threads share the groups
                            variants = [by_text[record.scheme], *variants]
                        parallel += variants
                        sources += bool(variants)
                tune_layer(layer.name, spec, parallel, threads, database, bench, settings,
                           verbose, command, clock=clock,
                           deadline=clock.share(1 / (len(parallel_counts) - i)))
            verbose(f"{layer.name}: {clock.summary()}")
            measured_seconds += time.monotonic() - clock.started
            fixed_seconds += clock.fixed_seconds
            first_seconds += clock.first_seconds or 0.0
            del bench
        rows.append((layer, {t: database.best(spec, t) for t in counts}))
    progress(len(layers), len(layers), "done")
    progress.close()
    if search is not None:
        search.close()
    elapsed = time.monotonic() - started
    # The registry holds every layer tuned on this CPU so far, not only this run's, so
    # tuning a second network does not drop the first one's kernels.
    # With --warm-check, each layer's best scheme on this CPU is first timed against the
    # generic kernel warm and side by side (the ship policy weighs those comparisons).
    if args.warm_check:
        for spec, name in database.layers():
            for threads in counts:
                best = database.best(spec, threads)
                if best is None:
                    continue
                searched, generic = compare_warm(name, spec, threads, best, database)
                print(f"{name} t{threads}: searched {searched.seconds * 1e3:.3f} ms, generic "
                      f"{generic.seconds * 1e3:.3f} ms (warm)", file=sys.stderr)
    # The registry holds every CPU's verdicts (generator/records/*.jsonl), this one's included:
    # tuning one CPU's set keeps the others'.
    entries = registry_entries(databases_in(args.data_dir / "records"))
    emit(entries, args.kernels_dir, command)
    shipped = [e for e in entries if e.cpu == database.cpu_id and e.isa is isa
               and e.scheme is not None]
    # This CPU's peak: a table borrowed from the same microarchitecture in another VM
    # (data.find_cpu_file) carries that machine's (the shipped Xeon model 167 table: 136
    # GFLOP/s, where this VM's cores reach 216-230), and percentages against it passed 100
    peak = (table.peak_gflops if table is not None and table.cpu.id == database.cpu_id
            else measure_peak_gflops(isa=isa))
    print(f"| layer | scheme (1 thread) | microkernels | GFLOP/s | % of peak | generic GFLOP/s | "
          + " | ".join(f"{t} threads GFLOP/s | generic" for t in counts[1:]) + " |")
    print("|---|---|---|---|---|---|" + "---|---|" * len(counts[1:]))
    for layer, best in rows:
        if best is None:
            print(f"| {layer.name} | (depthwise kernel, {layer.groups} groups: not searched) "
                  f"| | | | |" + " | |" * len(counts[1:]))
            continue
        spec = layer.problem()
        generic = {t: database.generic(spec, t) for t in counts}
        rate = {t: f"{generic[t].gflops:.1f}" if generic[t] else "-" for t in counts}
        if best[1] is None:
            print(f"| {layer.name} | (no correct kernel found) | | | | {rate[1]} |"
                  + " | |" * len(counts[1:]))
            continue
        multi = "".join(f" {best[t].gflops:.1f} | {rate[t]} |" if best[t] else f" - | {rate[t]} |"
                        for t in counts[1:])
        print(f"| {layer.name} | `{best[1].scheme}` | {best[1].microkernels} | "
              f"{best[1].gflops:.1f} | {100 * best[1].gflops / peak:.0f} | {rate[1]} |{multi}")
    print(f"(GFLOP/s of the cold-cache protocol: calls rotate over tensor copies; a searched "
          f"kernel ships only when its time is below {database.ship.max_time_ratio:g} of the "
          f"generic kernel's)")
    cpus = sorted({e.cpu for e in entries})
    searched = sum(1 for _, best in rows if best is not None)
    if searched and not args.from_records:
        print(f"per layer: {measured_seconds / searched:.1f} s of measurement (budget "
              f"{budget:g} s; the first candidate's compile and check, which no budget "
              f"skips, {first_seconds / searched:.1f} s of it) and "
              f"{fixed_seconds / searched:.1f} s of fixed work before it (scheme space, "
              f"inputs, float64 reference), over {searched} searched layers (--verbose: "
              f"each layer's)")
    print(f"search time: {elapsed:.0f} s; registry of {len(entries)} verdicts for "
          f"{len(cpus)} CPU(s) written to {args.kernels_dir}; this CPU ({database.cpu_id}), "
          f"{isa.value}: {len(shipped)} searched kernels")
    return 0


def _distributed_search(args: argparse.Namespace, database):
    """The Dask workers that measure for this search (``--dask``), or None."""
    if not getattr(args, "dask", None) or args.from_records:
        return None
    from .generator.distributed import (DaskUnavailable, DistributedSearch, connect,
                                        measuring_workers)
    try:
        client = connect(args.dask)
    except DaskUnavailable as exc:
        raise SystemExit(f"ttile-generate: {exc}") from None
    allowed, refused = measuring_workers(client, database.cpu_id)
    for address, cpu in refused.items():
        print(f"dask worker {address} on {cpu}: refused for measuring (the candidates are "
              f"for {database.cpu_id}; run ttile-generate on that CPU for its own set)",
              file=sys.stderr)
    if not allowed:
        client.close()
        raise SystemExit(f"ttile-generate: no Dask worker at {args.dask} can measure for "
                         f"{database.cpu_id}")
    print(f"measuring on {len(allowed)} Dask worker(s) at {args.dask}", file=sys.stderr)
    return DistributedSearch(client, database, allowed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttile-generate",
                                     description="TTile offline generator")
    parser.add_argument("--data-dir", "--generator-dir", dest="data_dir", type=Path,
                        default=DEFAULT_DATA_DIR,
                        help="where measured tables and records are written, and read "
                             "first (default: ./generator; then the tables installed with ttile)")
    parser.add_argument("--isa", choices=("auto", "avx512f", "avx2"), default="auto",
                        help="the vector family to measure microkernels and search kernels "
                             "in (auto: the widest this CPU runs); each family has its own "
                             "microkernel table, records and registry entries")
    parser.add_argument("--network", nargs="+", help="search every layer of built-in "
                        "networks (yolo9000, resnet18) and emit the kernels")
    parser.add_argument("--layers-file", help="search the layers listed in a TOML or JSON "
                        "file: [{name, k, c, hw, rs, stride}, ...]")
    parser.add_argument("--onnx", type=Path, help="search the 2-D convolutions of an ONNX "
                        "model (shapes by ONNX shape inference; needs ttile[onnx])")
    parser.add_argument("--kernels-dir", type=Path, default=Path("kernels/gen"),
                        help="where generated kernels and the registry go")
    parser.add_argument("--search", choices=("auto", "quick", "full"), default="auto",
                        help="how much of each layer's candidates is measured: full (the "
                             "shipped sets' search), quick (a few of the learned ranking's "
                             "picks: a network in minutes), auto (quick on a CPU whose "
                             "microkernel table is step 1's quick one or borrowed from "
                             "another VM of its microarchitecture, or where --budget is "
                             "below the quick search's 12 s, else full)")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall seconds of measurement per layer, every thread count's: "
                             "the generic kernel's timing, the candidates' compiles, checks "
                             "and timings, the finalists' re-timing, each timing with as many "
                             "calls as the time left holds (at least one candidate is "
                             "compiled and measured; the scheme space, inputs and reference "
                             "made before are reported apart; default 90 for the full "
                             "search, 12 for the quick one)")
    parser.add_argument("--threads", type=int, nargs="+", default=[2],
                        help="thread counts of the parallel variants, e.g. 2 4 16 (each is "
                             "tuned, and served at exactly that count)")
    parser.add_argument("--top", type=int, default=200, help="schemes kept after pruning")
    parser.add_argument("--keep-fraction", type=float, default=0.4,
                        help="pruning's first cut: the fraction of each loop-order family "
                             "with the largest reduction loop above the microkernel")
    parser.add_argument("--rank-measure", type=int, default=None, metavar="N",
                        help="order each layer's pruned candidates by the learned ranking "
                             "(train-ranker) and screen only its first N (default "
                             f"{DEFAULT_RANK_MEASURE} where a ranking is installed: yolo9000 "
                             "searched 2.4x faster for the same final kernels; 0: the "
                             "model's order until the budget is spent)")
    parser.add_argument("--parallel-from", type=int, default=None,
                        help="sequential schemes whose parallel variants are tuned (default "
                             "4 for the full search, 1 for the quick one)")
    parser.add_argument("--warm-check", action="store_true",
                        help="before emitting, time each layer's best scheme against the "
                             "generic kernel warm, side by side, and ship it only if faster")
    parser.add_argument("--from-records", action="store_true",
                        help="emit from the tuning records without searching (with "
                             "--warm-check, only the warm comparisons are measured)")
    parser.add_argument("--dask", metavar="ADDRESS",
                        help="measure the single-thread search on Dask workers (needs "
                             "ttile[dask]): tcp://scheduler:8786, or local:N for a "
                             "LocalCluster of N workers. One measurement per worker core at "
                             "a time (start remote workers with --nthreads 1 --resources "
                             "ttile-measure=1, one per core); records are written here as "
                             "whole tasks complete, a dead worker's tasks run elsewhere; "
                             "workers on another CPU model than this one are refused for "
                             "measuring (run ttile-generate there for that CPU's own set). "
                             "Multi-thread variants are measured here")
    parser.add_argument("--verbose", action="store_true", help="print every measurement")
    sub = parser.add_subparsers(dest="command")
    micro = sub.add_parser("microkernels", help="step 1: measure microkernels on this CPU")
    micro.add_argument("--threshold", type=float, default=0.85,
                       help="keep microkernels within this fraction of their scheme's best")
    micro.add_argument("--kernel-sizes", type=int, nargs="+", default=[1, 3, 5, 7],
                       help="kernel sizes R=S whose r/s unrolls are explored")
    micro.add_argument("--jobs", type=int, default=2, help="parallel compiler processes")
    micro.add_argument("--plot", type=Path, help="draw the Fig. 7 heatmaps to this PNG")
    micro.add_argument("--quick", action="store_true",
                       help="measure only the microkernels other CPUs' tables of the family "
                            "selected (about a quarter of them; what --network runs by itself "
                            "on a CPU without a table)")
    micro.set_defaults(run=_cmd_microkernels)
    model = sub.add_parser("model", help="step 2: rank loop permutations for a layer")
    model.add_argument("--layer", required=True, help="a Fig. 8 layer, e.g. Yolo9000-12")
    model.add_argument("--microkernel", nargs=5, metavar=("R", "S", "AXIS", "ALPHA", "BETA"),
                       help="unroll r, unroll s, h|w, k vectors, outputs (default: best "
                            "measured that fits)")
    model.add_argument("--top", type=int, default=3, help="permutations to show")
    model.set_defaults(run=_cmd_model)
    run = sub.add_parser("run", help="serve a built-in network's layers with ttile on this "
                                     "CPU: what serves each, checked and timed")
    run.add_argument("--network", default="resnet18",
                     choices=("resnet18", "yolo9000", "mobilenet_v2", "mobilenet_v3"))
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--reps", type=int, default=5, help="timed calls per layer")
    run.add_argument("--tuning", default="never", choices=("never", "now"),
                     help="tune layers without a shipped kernel first (now: up to 20 s each)")
    run.add_argument("--no-peers", dest="peers", action="store_false",
                     help="time ttile alone (default: beside torch, onnxruntime and OpenVINO "
                          "where installed)")
    run.add_argument("--onnx", dest="run_onnx", type=Path, default=None,
                     help="serve this ONNX model instead (ttile.onnx.load; needs ttile[onnx]): "
                          "the layers' table, a check against onnxruntime, the whole model "
                          "timed beside onnxruntime and OpenVINO")
    run.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                     help="with --onnx: the precision of the convolutions")
    run.set_defaults(run=_cmd_run)
    rank = sub.add_parser("train-ranker", help="train the learned ranking of schemes from "
                                               "the tuning records (generator/records), evaluate "
                                               "it on held-out layers, write generator/ranker/")
    rank.add_argument("--folds", type=int, default=5,
                      help="layers are held out in this many folds for the evaluation")
    rank.add_argument("--rounds", type=int, default=150, help="boosted trees")
    rank.add_argument("--depth", type=int, default=4, help="depth of each tree")
    rank.add_argument("--hold-out", nargs="+", metavar="NETWORK",
                      help="leave these built-in networks' layers out of training (to "
                           "measure a ranked search on layers the ranking never saw)")
    rank.set_defaults(run=_cmd_train_ranker)
    listing = sub.add_parser("layers", help="list the layers of a network, layers file or "
                                            "ONNX model, as the generator would search them")
    chosen = listing.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--network", dest="list_network", nargs="+",
                        help="built-in networks (yolo9000, resnet18, mobilenet_v2)")
    chosen.add_argument("--layers-file", dest="list_layers_file", help="a TOML or JSON file")
    chosen.add_argument("--onnx", dest="list_onnx", type=Path, help="an ONNX model")
    listing.set_defaults(run=_cmd_layers)
    records = sub.add_parser("records", help="tuning records: rewrite a file in the "
                                             "current format")
    records.add_argument("action", choices=("migrate",))
    records.add_argument("files", nargs="+", type=Path, help="<cpu-id>.jsonl files")
    records.set_defaults(run=_cmd_records)
    cache = sub.add_parser("cache", help="list or clear the kernels tuned at run time")
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument("--cache-dir", type=Path, default=None,
                       help="cache root (default: $TTILE_CACHE_DIR or the user cache dir)")
    cache.set_defaults(run=_cmd_cache)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        sources = sum(bool(v) for v in (args.network, args.layers_file, args.onnx))
        if sources != 1:
            parser.error("give a command (microkernels, model, layers, run, ...) or exactly "
                         "one of --network / --layers-file / --onnx")
        args.run = _cmd_network
    if args.command == "layers":   # the subcommand's own options name what it lists
        args.network, args.layers_file, args.onnx = (args.list_network, args.list_layers_file,
                                                     args.list_onnx)
    if args.command is None and not all(1 <= t <= 64 for t in args.threads):
        print("--threads takes thread counts from 1 to 64", file=sys.stderr)
        return 2
    if args.command is None and not 0 < args.keep_fraction <= 1:
        print("--keep-fraction must be in (0, 1]", file=sys.stderr)
        return 2
    if args.command == "run" and (args.threads < 1 or args.reps < 1):
        print("--threads and --reps must be >= 1", file=sys.stderr)
        return 2
    if args.command == "microkernels" and not 0 < args.threshold <= 1:
        print("--threshold must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except (KeyError, ValueError, FileNotFoundError, ImportError) as exc:
        print(f"ttile-generate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
