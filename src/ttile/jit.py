"""The quick search that tunes a shape nobody tuned for, on the user's machine.

The same pipeline as ``ttile-generate`` cut to fit a budget (20 s by default), for
the first call of a shape: the model ranks the schemes of the best few microkernel
classes (steps 2-4), the cheapest few by the model's data movement are compiled with
the system compiler, each is checked against the float64 reference and timed, and the
fastest two are timed again beside the generic kernel in interleaved rounds (the machine
drifts; only a side-by-side comparison decides). The fastest wins - or the generic
kernel does, which is remembered too.

Needs the generator's libraries (islpy with Barvinok, sympy, scipy: ``pip install
ttile[jit]``) and a C compiler; without them :class:`JitUnavailable` says which is
missing and the caller keeps the generic kernel.
"""
from __future__ import annotations

import functools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .spec import ConvSpec

#: A tuned kernel must beat the generic one by this factor to be kept (noise margin).
MIN_SPEEDUP = 1.03


class JitUnavailable(RuntimeError):
    """Run-time tuning cannot run here (missing compiler or libraries)."""


@dataclass(frozen=True)
class JitSettings:
    budget_seconds: float = 20.0
    model_fraction: float = 0.4      # of the budget spent ranking schemes with the model
    max_classes: int = 4             # microkernel classes ranked, best measured first
    per_class: int = 4               # schemes kept per class
    max_candidates: int = 12
    max_points: int = 20_000         # completions ranked per loop order (a wide class has 100 000+)
    batch_size: int = 4
    jobs: int = 2
    target_seconds_per_kernel: float = 0.15  # timing calls per candidate add up to this
    finalists: int = 2               # re-timed beside the generic kernel, interleaved
    final_seconds: float = 1.0       # what that comparison may take


@dataclass(frozen=True)
class JitResult:
    """The outcome of one quick search."""

    kind: str                          # "jit" or "generic"
    scheme: str
    microkernels: str
    function: str
    panel: int
    library: Optional[Path]            # the built shared object holding ``function``
    gflops: float
    generic_gflops: float
    search_seconds: float
    measured: int                      # candidates checked and timed


def _data_directories(kind: str, cache_root: Optional[Path]) -> list[Path]:
    """Where tables of ``kind`` ("microkernels" or "machine") may live: the user cache,
    the data installed with the package, and a source checkout's generator/."""
    here = Path(__file__).resolve().parent
    dirs = []
    if cache_root is not None:
        dirs.append(cache_root / kind)
    dirs += [here / "data" / kind, here.parent.parent / "generator" / kind]
    try:
        from importlib.resources import files
        dirs.append(Path(str(files("ttile") / "data" / kind)))
    except (ImportError, TypeError, ModuleNotFoundError):
        pass
    return [d for d in dirs if d.is_dir()]


def _load_microkernel_table(cache_root: Optional[Path]):
    """This CPU's table, else any AVX-512 table shipped with ttile: the classes are
    register blocks that suit any core with 32 zmm registers, only their measured
    rates differ."""
    from .cpuinfo import fingerprint
    from .microkernels import MicrokernelTable
    cpu = fingerprint()
    directories = _data_directories("microkernels", cache_root)
    for directory in directories:
        path = directory / f"{cpu.id}.json"
        if path.exists():
            return MicrokernelTable.from_json(json.loads(path.read_text()))
    for directory in directories:
        for path in sorted(directory.glob("*.json")):
            try:
                table = MicrokernelTable.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                continue
            if "avx512f" in table.cpu.flags:
                return table
    raise JitUnavailable("no microkernel table found (ttile's data files are missing)")


def _load_caches(cache_root: Optional[Path]):
    from .cpuinfo import fingerprint
    from .machine import MachineModel, load_or_measure
    cpu = fingerprint()
    for directory in _data_directories("machine", cache_root):
        path = directory / f"{cpu.id}.json"
        if path.exists():
            return MachineModel.from_json(json.loads(path.read_text())).caches()
    if cache_root is not None:
        try:
            return load_or_measure(cache_root / "machine").caches()  # about a second, once
        except OSError:
            pass  # a read-only or full cache: measure without saving
    return _measured_in_memory().caches()


@functools.lru_cache(maxsize=1)
def _measured_in_memory():
    """This CPU's bandwidths, measured once per process when no cache can keep them (a
    CPU ttile ships no machine model for, with a read-only or full cache): tuning then
    costs a second more per process instead of not happening at all."""
    from .machine import measure
    return measure()


def _require_libraries() -> None:
    missing = []
    for module in ("islpy", "sympy", "scipy"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise JitUnavailable(f"run-time tuning needs {', '.join(missing)} "
                             f"(pip install 'ttile[jit]')")


def candidates(spec: ConvSpec, threads: int, settings: JitSettings, deadline: float,
               cache_root: Optional[Path]):
    """The schemes worth compiling: the model's best few of each of the best classes."""
    from .search import classes_for, class_fits, parallel_variants, scheme_space
    table = _load_microkernel_table(cache_root)
    caches = _load_caches(cache_root)
    fitting = sorted((c for c in classes_for(spec, table) if class_fits(spec, c)),
                     key=lambda c: -c.best_percent)[:settings.max_classes]
    per_class = []
    for cls in fitting:
        if per_class and time.monotonic() > deadline:
            break
        space = scheme_space(spec, [cls], caches, top=settings.per_class,
                             max_points=settings.max_points)
        if space:
            per_class.append(space)
    chosen = []  # round robin over classes, each class's best first
    for rank in range(settings.per_class):
        for space in per_class:
            if rank < len(space):
                chosen.append(space[rank])
    if threads > 1:
        parallel = []
        for candidate in chosen:
            variants = parallel_variants(candidate, spec, threads)
            if variants:
                parallel.append(variants[0])
        chosen = parallel
    return chosen[:settings.max_candidates], table.peak_gflops


def _screen_generic(spec: ConvSpec, copies, threads: int, calls: int) -> float:
    """Median seconds of the generic kernel over ``copies`` (sizes the timing loops)."""
    from . import _kernels
    times = []
    for i in range(calls + 1):
        x, w, y = copies[i % len(copies)]
        t0 = time.perf_counter()
        _kernels.conv2d_generic_nhwc(x, w, y, spec.stride_h, spec.stride_w, spec.pad_top,
                                     spec.pad_left, threads, _kernels.ISA_AVX512F)
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def head_to_head(spec: ConvSpec, bench, finalists, threads: int, rounds: int
                  ) -> tuple[float, list[float]]:
    """Median seconds of the generic kernel and of each finalist, timed in interleaved
    rounds the way ``conv2d`` runs them (through the extension, weights packed before),
    so that the machine's drift hits every contender alike."""
    import ctypes
    from . import _kernels
    x, w, y = bench.copies[0]
    generic_w = _kernels.pack_weights(w, _kernels.generic_panel(spec.k, spec.wo))
    runs = [lambda: _kernels.conv2d_generic_packed(x, generic_w, y, spec.stride_h,
                                                   spec.stride_w, spec.pad_top,
                                                   spec.pad_left, threads)]
    for kernel, library in finalists:
        address = ctypes.cast(getattr(library.handle, kernel.name), ctypes.c_void_p).value
        packed = _kernels.pack_weights(w, kernel.panel)
        runs.append(lambda a=address, p=packed: _kernels.run_compiled(
            a, x, p, y, threads, x.shape, p.shape, y.shape))
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(rounds + 1):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            if round_:  # round 0 warms up
                times[i].append(time.perf_counter() - t0)
    medians = [statistics.median(t) for t in times]
    return medians[0], medians[1:]


def tune(spec: ConvSpec, threads: int, settings: JitSettings = JitSettings(),
         cache_root: Optional[Path] = None) -> JitResult:
    """Search, check and time within ``settings.budget_seconds``; see the module text."""
    from .cbuild import BuildError, build_batches, find_compiler
    started = time.monotonic()
    if find_compiler() is None:
        raise JitUnavailable("no C compiler on PATH (set CC or install gcc or clang)")
    _require_libraries()
    from .codegen import generate
    from .tune import LayerBench

    budget = settings.budget_seconds
    chosen, _ = candidates(spec, threads, settings, started + settings.model_fraction * budget,
                           cache_root)
    bench = LayerBench.make(spec, copy_bytes=8 << 20, max_copies=4, seed=1)
    generic_seconds = _screen_generic(spec, bench.copies, threads, 5)
    calls = int(max(3, min(25, settings.target_seconds_per_kernel / generic_seconds)))
    flops = spec.flops
    screened: list[tuple[float, object, object, object]] = []  # seconds, cand, kernel, lib
    step = settings.batch_size * settings.jobs
    for start in range(0, len(chosen), step):
        if start and time.monotonic() - started > 0.7 * budget:
            break
        group = chosen[start:start + step]
        batches = [group[i:i + settings.batch_size]
                   for i in range(0, len(group), settings.batch_size)]
        sources = [[generate(c.scheme, spec, "ttile.conv2d (run-time tuning)") for c in batch]
                   for batch in batches]
        libraries = build_batches(sources, jobs=settings.jobs, timers=True)
        for batch, kernels, library in zip(batches, sources, libraries):
            if isinstance(library, BuildError):
                continue
            for candidate, kernel in zip(batch, kernels):
                if screened and time.monotonic() - started > 0.85 * budget:
                    break  # keep the rest of the budget for the final comparison
                x, w, y = bench.copies[0]
                y.fill(np.nan)
                library.run(kernel, x, w, y, threads)
                if bench.check(y) is not None:
                    continue  # a wrong kernel is never kept
                seconds = statistics.median(library.time_each(kernel, bench.copies, calls,
                                                              threads)[1:])
                screened.append((seconds, candidate, kernel, library))
    screened.sort(key=lambda item: item[0])
    finalists = screened[:settings.finalists]
    rounds = int(max(5, min(30, settings.final_seconds / max(generic_seconds, 1e-6)
                             / (1 + len(finalists)))))
    generic_seconds, final = head_to_head(spec, bench, [(k, lib) for _, _, k, lib in finalists],
                                           threads, rounds)
    elapsed = time.monotonic() - started
    generic_gflops = flops / generic_seconds / 1e9
    best = min(range(len(finalists)), key=final.__getitem__, default=None)
    if best is None or final[best] * MIN_SPEEDUP > generic_seconds:
        return JitResult("generic", "", "", "", 0, None, generic_gflops, generic_gflops,
                         elapsed, len(screened))
    _, candidate, kernel, library = finalists[best]
    return JitResult("jit", str(candidate.scheme), candidate.microkernel_text, kernel.name,
                     kernel.panel, library.path, flops / final[best] / 1e9, generic_gflops,
                     elapsed, len(screened))
