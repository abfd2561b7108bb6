"""The quick search that tunes a shape nobody tuned for, on the user's machine.

The same pipeline as ``ttile-generate`` cut to fit the first call of a shape. By
default the learned ranking (:mod:`ttile.tuning.ranker`, trained on the tuning records)
scores the completions of the best microkernel classes and only its first two are
compiled and timed (about 2 s, compiles included); without a ranker, or for the fuller
search the background mode runs, the IOOpt model ranks the schemes of the best few
classes (steps 2-4) within a budget (20 s by default) and the cheapest few by the model's
data movement are compiled. Either way each candidate is compiled with the system
compiler, checked against the float64 reference and timed, and the fastest two are timed
again beside the generic kernel in interleaved rounds (the machine drifts; only a
side-by-side comparison decides). The fastest wins if the ship policy
(:class:`ttile.tuning.policy.ShipPolicy`, the generator's rule) says it beats the generic
kernel - else the generic kernel does, which is remembered too. Candidates found wrong or
that did not build are counted in the result, never dropped silently.

Needs the generator's libraries (islpy with Barvinok, sympy, scipy: ``pip install
ttile[jit]``) and a C compiler; without them :class:`JitUnavailable` says which is
missing and the caller keeps the generic kernel.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..core.kinds import Isa, KernelKind
from ..core.spec import ConvSpec
from ..tuning.policy import DEFAULT_SHIP_POLICY, ShipPolicy


class JitUnavailable(RuntimeError):
    """Run-time tuning cannot run here (missing compiler or libraries)."""


@dataclass(frozen=True)
class JitSettings:
    #: Rank the candidates with the learned ranking (:mod:`ttile.tuning.ranker`) and
    #: measure only its first few (about 2 s, compiles included); False, or no ranker
    #: installed: the model-ranked search of up to ``budget_seconds``.
    ranked: bool = True
    ranked_classes: int = 6          # microkernel classes whose completions are ranked
    ranked_points: int = 400         # completions per loop order
    ranked_measure: int = 2          # the ranking's first picks compiled and timed (one per compiler)
    ranked_seconds_per_kernel: float = 0.04
    ranked_final_seconds: float = 0.3
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
    compile_seconds: float = 60.0    # a compiler call past this is stopped (generic kernel)
    ship: ShipPolicy = field(default=DEFAULT_SHIP_POLICY)


@dataclass(frozen=True, kw_only=True)
class JitResult:
    """The outcome of one quick search."""

    kind: KernelKind                   # JIT or GENERIC
    problem: ConvSpec
    scheme: str = ""
    microkernels: str = ""
    function: str = ""
    panel: int = 0
    library: Optional[Path] = None     # the built shared object holding ``function``
    gflops: float
    generic_gflops: float
    search_seconds: float
    measured: int                      # candidates checked correct and timed
    wrong: int                         # candidates that computed a wrong result
    failed: int                        # candidates that did not build (error or time-out)
    ranked: bool = False               # the learned ranking chose what was measured


def _load_microkernel_table(cache_root: Optional[Path], isa: Isa = Isa.AVX512F):
    """This CPU's table of the vector family ``isa``, else any table of that family
    shipped with ttile: the classes are register blocks that suit any core with that
    family's registers, only their measured rates differ."""
    from ..core.cpuinfo import fingerprint
    from ..core.vectors import family_stem, parse_family_stem
    from ..generator.data import DataKind, all_files, find_cpu_file, read_json
    from ..generator.microkernels import MicrokernelTable
    path = find_cpu_file(DataKind.MICROKERNELS, family_stem(fingerprint().id, isa),
                         cache_root)
    if path is not None:
        return MicrokernelTable.from_json(read_json(path))
    for path in all_files(DataKind.MICROKERNELS, cache_root):
        if parse_family_stem(path.stem)[1] is not isa:
            continue
        try:
            table = MicrokernelTable.from_json(read_json(path))
        except (OSError, ValueError, KeyError):
            continue
        if table.isa is isa:
            return table
    raise JitUnavailable(f"no {isa.value} microkernel table found (ttile's data files are "
                         f"missing)")


def _load_caches(cache_root: Optional[Path]):
    from ..generator.machine import load_or_measure
    if cache_root is not None:
        try:
            return load_or_measure(cache_root).caches()  # measured once, about a second
        except OSError:
            pass  # a read-only or full cache: measure without saving
    return _measured_in_memory().caches()


@functools.lru_cache(maxsize=1)
def _measured_in_memory():
    """This CPU's model (shipped, or its bandwidths measured once per process when no
    cache can keep them: tuning then costs a second more per process instead of not
    happening at all)."""
    from ..generator.machine import load_or_measure
    return load_or_measure(None)


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


@functools.lru_cache(maxsize=4)
def _load_ranker(cache_root: Optional[Path]):
    """The learned ranking (:func:`ttile.generator.data.load_ranker`), read once per
    process."""
    from ..generator.data import load_ranker
    return load_ranker(cache_root)


def ranker_problem() -> str:
    """Why the learned ranking is not loaded ("" : it is)."""
    from ..generator.data import ranker_problem as problem
    return problem() or "none loaded"


def ranked_candidates(spec: ConvSpec, threads: int, settings: JitSettings,
                      cache_root: Optional[Path], isa: Isa, model,
                      across: bool = False) -> list:
    """The learned ranking's first picks among the completions of the best classes'
    reduction-innermost loop orders (no model permutation is solved: that took most of
    the 20 s search), parallel variants at ``threads`` > 1; with ``across``, also the
    first one-thread pick (a grouped problem's kernel then shares its groups among the
    threads)."""
    from ..core.cpuinfo import fingerprint
    from ..core.scheme import Scheme
    from ..core.vectors import vector_isa
    from ..generator.microkernels import MicrokernelShape
    from ..generator.search import (Candidate, LoopFamily, class_fits, classes_for,
                                    completions, parallel_variants, point_specifiers,
                                    reduction_above, reduction_innermost_orders)
    from ..tuning.ranker import CpuContext, features
    table = _load_microkernel_table(cache_root, isa)
    here = fingerprint()
    context = CpuContext(here.l1d_bytes or 32768, here.l2_bytes or (1 << 20),
                         CpuContext.from_table(table).microkernel_percent)
    lanes = vector_isa(isa).lanes
    fitting = sorted((c for c in classes_for(spec, table) if class_fits(spec, c, lanes)),
                     key=lambda c: -c.best_percent)[:settings.ranked_classes]
    pool, seen = [], set()
    for cls in fitting:
        for order in reduction_innermost_orders(spec, cls):
            for point in completions(spec, cls, order, settings.ranked_points, lanes):
                specifiers = point_specifiers(point, cls)
                if specifiers in seen:
                    continue
                seen.add(specifiers)
                shapes = tuple(MicrokernelShape(cls.unroll_r, cls.unroll_s, cls.axis,
                                                cls.alpha, b) for _, b in point.betas)
                pool.append(Candidate(Scheme(specifiers), shapes, reduction_above(point),
                                      0.0, origin=LoopFamily.REDUCTION_INNERMOST))
    def first(pool: list, threads: int, count: int) -> list:
        rows, kept = [], []
        for candidate in pool:
            row = features(spec, candidate.scheme, threads, isa, context)
            if row is not None:
                rows.append(row)
                kept.append(candidate)
        if not kept:
            return []
        order = np.argsort(-model.scores(np.stack(rows)), kind="stable")
        return [kept[i] for i in order[:count]]

    if threads == 1:
        return first(pool, 1, settings.ranked_measure)
    parallel = [v for c in pool for v in parallel_variants(c, spec, threads, isa)]
    return first(parallel, threads, settings.ranked_measure) + (
        first(pool, 1, 1) if across else [])


def candidates(spec: ConvSpec, threads: int, settings: JitSettings, deadline: float,
               cache_root: Optional[Path], isa: Isa = Isa.AVX512F, across: bool = False):
    """The schemes worth compiling: the model's best few of each of the best classes
    of the vector family ``isa`` (at ``threads`` > 1 their parallel variants, and with
    ``across`` the best two as they are: see ``ranked_candidates``)."""
    from ..core.vectors import vector_isa
    from ..generator.search import classes_for, class_fits, parallel_variants, scheme_space
    table = _load_microkernel_table(cache_root, isa)
    caches = _load_caches(cache_root)
    lanes = vector_isa(isa).lanes
    fitting = sorted((c for c in classes_for(spec, table) if class_fits(spec, c, lanes)),
                     key=lambda c: -c.best_percent)[:settings.max_classes]
    per_class = []
    for cls in fitting:
        if per_class and time.monotonic() > deadline:
            break
        space = scheme_space(spec, [cls], caches, top=settings.per_class,
                             max_points=settings.max_points, isa=isa)
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
            variants = parallel_variants(candidate, spec, threads, isa)
            if variants:
                parallel.append(variants[0])
        chosen = parallel[:settings.max_candidates] + (chosen[:2] if across else [])
    return chosen[:settings.max_candidates + 2], table.peak_gflops


def tune(spec: ConvSpec, threads: int, settings: JitSettings = JitSettings(),
         cache_root: Optional[Path] = None, isa: Isa = Isa.AVX512F) -> JitResult:
    """Search, check and time within ``settings.budget_seconds`` in the vector family
    ``isa`` (its microkernels, its generic kernel as the bar); see the module text."""
    from ..core.cbuild import find_compiler
    started = time.monotonic()
    if find_compiler() is None:
        raise JitUnavailable("no C compiler on PATH (set CC or install gcc or clang)")
    _require_libraries()
    from ..tuning.bench import (LayerBench, build_check_time, generic_packed_copies,
                                head_to_head, time_generic)
    from ..tuning.records import RecordStatus

    budget = settings.budget_seconds
    model = _load_ranker(cache_root) if settings.ranked else None
    # a grouped problem's schemes tile one group (the kernel runs them group by group),
    # and are compiled, checked and timed on the whole problem; on several threads, a
    # one-thread scheme is a candidate too: its kernel shares the groups among the
    # threads (codegen's group loop)
    across = threads > 1 and spec.groups >= threads
    if model is not None:
        chosen = ranked_candidates(spec.one_group, threads, settings, cache_root, isa, model,
                                   across)
        per_kernel, final_seconds = (settings.ranked_seconds_per_kernel,
                                     settings.ranked_final_seconds)
    else:
        chosen, _ = candidates(spec.one_group, threads, settings,
                               started + settings.model_fraction * budget, cache_root, isa,
                               across)
        per_kernel, final_seconds = settings.target_seconds_per_kernel, settings.final_seconds
    bench = LayerBench.make(spec, copy_bytes=8 << 20, max_copies=4, seed=1)
    generic_seconds = statistics.median(
        time_generic(spec, generic_packed_copies(spec, bench.copies, isa), threads, 5, isa))
    calls = int(max(3, min(25, per_kernel / generic_seconds)))
    screened = []  # (seconds, candidate, kernel, library)
    wrong = failed = 0
    for measured in build_check_time(
            spec, [c.scheme for c in chosen], bench, threads, calls=calls,
            # the ranked picks are few: one batch per compiler, all compiling at once
            batch_size=(-(-len(chosen) // settings.jobs) if model is not None
                        else settings.batch_size), jobs=settings.jobs,
            command="ttile.conv2d (run-time tuning)",
            compile_timeout=settings.compile_seconds,
            next_group=lambda attempted: not attempted
            or time.monotonic() - started <= 0.7 * budget,
            # keep the rest of the budget for the final comparison
            next_kernel=lambda timed: not timed
            or time.monotonic() - started <= 0.85 * budget, isa=isa,
            weight_prefetch=True):
        if measured.status is RecordStatus.OK:
            screened.append((measured.seconds, chosen[measured.index], measured.kernel,
                             measured.library))
        elif measured.status is RecordStatus.WRONG:
            wrong += 1
        else:
            failed += 1
    screened.sort(key=lambda item: item[0])
    finalists = screened[:settings.finalists]
    rounds = int(max(5, min(30, final_seconds / max(generic_seconds, 1e-6)
                             / (1 + len(finalists)))))
    generic_seconds, final = head_to_head(spec, bench, [(k, lib) for _, _, k, lib in finalists],
                                          threads, rounds, isa)
    flops = spec.flops
    outcome = dict(problem=spec, generic_gflops=flops / generic_seconds / 1e9,
                   ranked=model is not None,
                   search_seconds=time.monotonic() - started, measured=len(screened),
                   wrong=wrong, failed=failed)
    best = min(range(len(finalists)), key=final.__getitem__, default=None)
    if best is None or not settings.ship.beats(final[best], generic_seconds):
        return JitResult(kind=KernelKind.GENERIC, gflops=outcome["generic_gflops"], **outcome)
    _, candidate, kernel, library = finalists[best]
    return JitResult(kind=KernelKind.JIT, scheme=str(candidate.scheme),
                     microkernels=candidate.microkernel_text, function=kernel.name,
                     panel=kernel.panel, library=library.path, gflops=flops / final[best] / 1e9,
                     **outcome)
