"""Steps 3-4 of the TTile search (paper sections 5.3-5.5): scheme space, pruning, parallelism.

For a layer, every selected microkernel class that fits it, and the model's permutation
for that class (step 2), the space holds every *completion*:

* the microkernel, either one size beta that divides the spatial axis, or two sizes of the
  class combined with lambda-seq, ``a*beta1 + b*beta2`` dividing it (34 = 2*11 + 12),
* the remaining iterations of every dimension distributed, as exact divisors, over that
  dimension's loops in the permutation (all ordered factorizations),
* the lambda-seq placed at each loop of the spatial axis in turn.

The loop orders come from two families. The model's best permutation (step 2) is the
paper's. Beside it, a few orders keep the whole reduction (the r and s loops not unrolled,
then all of c) innermost, above the block, with k, h and w outside: the accumulators then
stay in registers over every reduction step, and each output is stored once. The IOOpt
model counts data movement between cache levels only, so it ranks those orders low (their
weight panel is re-read from L2 for each block), yet they are the ones that run near the
FMA peak on large layers: the hand-written generic kernel has exactly that structure, and
the model's orders, which split c into two to four loops, lost to it by up to 2x
(Yolo9000-12 on an Intel Xeon: 52 ms against 28). On 3-channel layers the family wins
outright: Yolo9000-0 on an AMD EPYC ran at 107 GFLOP/s against the generic kernel's 67.

Pruning keeps the fraction (40 %) with the largest reduction loop right above the
microkernel, sorts those by the model's data movement and keeps the best (200). It does
so within each family, and the survivors are interleaved, so that a search cut short by
its time budget still measures both.

Parallel variants (section 5.5) rewrite a sequential scheme three ways: the largest band
of outer non-reduction loops made parallel; the reduction loops moved innermost and the
rest parallel; the reduction loops moved outermost and the rest below them parallel.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Optional, Sequence

import numpy as np

from ..core.kinds import Isa
from ..core.scheme import LOOP_KINDS, Scheme, SchemeError, SpecKind, Specifier, lower
from ..core.spec import REDUCTION_DIMS, VECTOR_LANES, ConvSpec
from ..core.vectors import vector_isa
from ..tuning.records import Strategy
from .costmodel import CostModel, RankedPermutation, microkernel_tile
from .iomodel import divisor_splits
from .machine import CacheLevel
from .microkernels import MicrokernelClass, MicrokernelShape, block_fits, select_classes


class LoopFamily(str, Enum):
    """Loop-order families of the scheme space (see the module docstring)."""

    MODEL_ORDER = "model permutation"
    REDUCTION_INNERMOST = "reduction innermost"


@dataclass(frozen=True)
class Candidate:
    """One point of the scheme space: a scheme and what ranked it."""

    scheme: Scheme
    microkernels: tuple[MicrokernelShape, ...]   # one, or the two composed by lambda-seq
    reduction_above: int                          # iterations of the c loop above the block
    model_cost: float                             # seconds of data movement (step 2 model)
    strategy: Strategy = Strategy.SEQUENTIAL
    origin: LoopFamily = LoopFamily.MODEL_ORDER   # the family of its loop order

    @property
    def microkernel_text(self) -> str:
        return " + ".join(f"[{m.block_specifiers()}]" for m in self.microkernels)


@dataclass(frozen=True)
class SpacePoint:
    """A completion before it is written as a scheme (kept to batch the model)."""

    dims: tuple[str, ...]           # loop dims, outermost first (the permutation)
    counts: tuple[int, ...]
    lseq_at: Optional[int]          # index in dims before which the lambda-seq goes
    betas: tuple[tuple[int, int], ...]  # ((count, beta), ...): one entry, or the pair


def class_fits(spec: ConvSpec, cls: MicrokernelClass, lanes: int = VECTOR_LANES) -> bool:
    """Whether a class can appear in a scheme for ``spec`` (k vectors of ``lanes``
    divide, r/s match)."""
    return block_fits(spec, cls.unroll_r, cls.unroll_s, cls.axis, cls.alpha, cls.beta_min,
                      lanes)


def microkernel_choices(axis_extent: int, cls: MicrokernelClass) -> list[tuple[tuple[int, int], ...]]:
    """Single betas dividing the axis, and lambda-seq pairs a*b1 + b*b2 dividing it."""
    betas = range(cls.beta_min, min(cls.beta_max, axis_extent) + 1)
    out: list[tuple[tuple[int, int], ...]] = [((1, b),) for b in betas if axis_extent % b == 0]
    for b1, b2 in itertools.combinations(betas, 2):
        for a in range(1, axis_extent // b1 + 1):
            for b in range(1, (axis_extent - a * b1) // b2 + 1):
                covered = a * b1 + b * b2
                if axis_extent % covered == 0:
                    out.append(((a, b1), (b, b2)))
    return out


#: The parameter a lambda-seq binds in the schemes the search writes.
BETA = "beta"


def _block(cls: MicrokernelClass, beta: str | int) -> tuple[Specifier, ...]:
    """The unrolled block of ``cls``; the parameter ``beta`` names the size along the
    spatial axis under a lambda-seq."""
    if isinstance(beta, str):
        return MicrokernelShape(cls.unroll_r, cls.unroll_s, cls.axis, cls.alpha,
                                cls.beta_min).block(parameter=beta)
    return MicrokernelShape(cls.unroll_r, cls.unroll_s, cls.axis, cls.alpha, beta).block()


def point_specifiers(point: SpacePoint, cls: MicrokernelClass) -> tuple[Specifier, ...]:
    """The scheme of a space point; loops of one iteration are left out (they would only
    add an empty loop), except where the lambda-seq needs an anchor."""
    items: list[Specifier] = []
    lseq = Specifier(SpecKind.LSEQ, cls.axis, parts=point.betas) \
        if point.lseq_at is not None else None
    for i, (d, n) in enumerate(zip(point.dims, point.counts)):
        if point.lseq_at == i:
            items.append(lseq)
        if n > 1:
            items.append(Specifier(SpecKind.T, d, size=n))
    if lseq is not None and point.lseq_at >= len(point.dims):
        items.append(lseq)
    beta: str | int = BETA if lseq is not None else point.betas[0][1]
    return tuple(items) + _block(cls, beta)


def scheme_text(point: SpacePoint, cls: MicrokernelClass) -> str:
    """The paper notation of :func:`point_specifiers` (what records and kernels carry)."""
    return "[" + "; ".join(str(sp) for sp in point_specifiers(point, cls)) + "]"


def model_loop_order(permutation: RankedPermutation) -> tuple[str, ...]:
    """The loops of a model permutation that TileOpt gave more than one iteration,
    outermost first, ending with the reduction loop over c right above the microkernel."""
    dims = [d for d, c in zip(permutation.permutation, permutation.flat_counts) if c > 1 + 1e-9]
    if not dims or dims[-1] != "c":
        dims.append("c")
    return tuple(dims)


def reduction_innermost_orders(spec: ConvSpec, cls: MicrokernelClass) -> list[tuple[str, ...]]:
    """Loop orders whose innermost band is the whole reduction: the r and s loops the
    microkernel does not unroll, then c. Above it, the orders of k, h and w that keep a
    weight panel in cache the longest: k panels outermost (in groups, with a second k loop
    inside the rows, as the generic kernel walks them), or rows outermost."""
    reduction = tuple(d for d, extent, unroll in (("r", spec.r, cls.unroll_r),
                                                  ("s", spec.s, cls.unroll_s))
                      if extent > unroll) + ("c",)
    return [("k", "h", "k", "w") + reduction, ("h", "k", "w") + reduction,
            ("h", "w", "k") + reduction]


def completions(spec: ConvSpec, cls: MicrokernelClass, order: Sequence[str],
                max_points: int = 200_000, lanes: int = VECTOR_LANES) -> list[SpacePoint]:
    """Every completion of the loop ``order`` (outermost first, ending with c) above a
    microkernel of ``cls`` with vectors of ``lanes`` (section 5.3)."""
    extents = spec.iteration_extents(lanes)
    axis = cls.axis
    dims = list(order)
    tile = {"n": 1, "k": cls.alpha * lanes, "c": 1, "h": 1, "w": 1,
            "r": cls.unroll_r, "s": cls.unroll_s}
    points: list[SpacePoint] = []
    for betas in microkernel_choices(extents[axis], cls):
        covered = sum(a * b for a, b in betas)
        remaining = {d: extents[d] // tile[d] for d in extents if d != axis}
        remaining[axis] = extents[axis] // covered
        loop_dims = list(dims)
        for d, q in remaining.items():  # a dimension left over needs a loop somewhere
            if q > 1 and d not in loop_dims:
                loop_dims.insert(0, d)
        occurrences = {d: [i for i, e in enumerate(loop_dims) if e == d] for d in remaining}
        per_dim = []
        for d, q in remaining.items():
            if not occurrences[d]:
                per_dim.append([()])
                continue
            per_dim.append(divisor_splits(q, len(occurrences[d])))
        placements: list[Optional[int]] = [None]
        if len(betas) > 1:
            placements = occurrences[axis] or [len(loop_dims)]
        for splits in itertools.product(*per_dim):
            counts = [1] * len(loop_dims)
            for (d, _), split in zip(remaining.items(), splits):
                for i, value in zip(occurrences[d], split):
                    counts[i] = value
            for place in placements:
                points.append(SpacePoint(tuple(loop_dims), tuple(counts), place, betas))
                if len(points) >= max_points:
                    return points
    return points


def reduction_above(point: SpacePoint) -> int:
    """Iterations of the innermost loop if it runs over c (0 when it does not)."""
    for d, n in zip(reversed(point.dims), reversed(point.counts)):
        if n > 1 or d == "c":
            return n if d == "c" else 0
    return 0


def model_costs(model: CostModel, cls: MicrokernelClass, points: Sequence[SpacePoint]
                ) -> np.ndarray:
    """Data-movement cost of each point, batched per permutation. A lambda-seq pair is
    modelled as its first microkernel with the axis loops stretched to cover the rest."""
    spec = model.spec
    costs = np.empty(len(points))
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault((p.dims, p.betas), []).append(i)
    for (dims, betas), idx in groups.items():
        beta = betas[0][1]
        shape = MicrokernelShape(cls.unroll_r, cls.unroll_s, cls.axis, cls.alpha, beta)
        tile = microkernel_tile(spec, shape, model.lanes)
        stretch = sum(a * b for a, b in betas) / beta
        counts = np.array([points[i].counts for i in idx], float)
        axis_loops = [j for j, d in enumerate(dims) if d == cls.axis]
        if axis_loops:
            counts[:, axis_loops[-1]] *= stretch
        costs[idx] = model.costs(dims, tile, counts)
    return costs


def prune(candidates: list, keep_fraction: float = 0.4, top: int = 200) -> list:
    """Paper section 5.4, within each loop-order family: the ``keep_fraction`` with the
    largest reduction loop above the microkernel, sorted by modelled data movement; the
    families' lists are then interleaved (in the order the families first appear) and
    the first ``top`` kept, so the tuner, which measures in this order until its budget
    runs out, reaches the best of every family early. Takes anything with ``origin``,
    ``reduction_above``, ``model_cost`` and ``scheme`` (candidates, or ranked points)."""
    families: dict[str, list] = {}
    for candidate in candidates:
        families.setdefault(candidate.origin, []).append(candidate)
    ranked = []
    for members in families.values():
        by_reduction = sorted(members, key=lambda c: -c.reduction_above)
        cut = max(1, math.ceil(keep_fraction * len(by_reduction)))
        threshold = by_reduction[cut - 1].reduction_above
        kept = [c for c in by_reduction if c.reduction_above >= threshold]
        kept.sort(key=lambda c: (c.model_cost, str(c.scheme)))
        ranked.append(kept)
    interleaved = [c for tier in itertools.zip_longest(*ranked) for c in tier if c is not None]
    return interleaved[:top]


def classes_for(spec: ConvSpec, table, thresholds: Sequence[float] = (0.75, 0.65, 0.5, 0.0)
                ) -> list[MicrokernelClass]:
    """The table's classes, or when none of them can cover this layer (no size or pair
    divides its axis, or k does not split into their vector counts), classes selected
    with a lower threshold: the paper's fallback to suboptimal microkernels. The
    table's vector family sets the width of a vector."""
    lanes = vector_isa(table.isa).lanes

    def usable(classes) -> list[MicrokernelClass]:
        out = []
        for cls in classes:
            if class_fits(spec, cls, lanes):
                axis_extent = spec.ho if cls.axis == "h" else spec.wo
                if microkernel_choices(axis_extent, cls):
                    out.append(cls)
        return out

    found = usable(table.classes)
    for threshold in thresholds:
        if found:
            break
        found = usable(select_classes(table.measurements, threshold))
    return found


@dataclass(frozen=True)
class _RankedPoint:
    """A completion with what pruning needs, before its text is parsed into a Scheme:
    a wide class (beta 4 to 18) has over 100 000 completions, and parsing them all cost
    more than ranking them, to keep 200."""

    scheme: str                       # paper notation (pruning breaks ties by it)
    specifiers: tuple[Specifier, ...]
    cls: MicrokernelClass
    betas: tuple[tuple[int, int], ...]
    reduction_above: int
    model_cost: float
    origin: LoopFamily

    def candidate(self) -> Candidate:
        shapes = tuple(MicrokernelShape(self.cls.unroll_r, self.cls.unroll_s, self.cls.axis,
                                        self.cls.alpha, b) for _, b in self.betas)
        return Candidate(Scheme(self.specifiers), shapes, self.reduction_above,
                         self.model_cost, origin=self.origin)


def scheme_space(spec: ConvSpec, classes: Iterable[MicrokernelClass],
                 caches: Sequence[CacheLevel], permutations_per_class: int = 1,
                 keep_fraction: float = 0.4, top: int = 200,
                 max_classes: int = 8, max_points: int = 200_000,
                 isa: Isa = Isa.AVX512F) -> list[Candidate]:
    """Steps 3-4 for one layer: every completion of the best fitting classes (of the
    vector family ``isa``), pruned.

    The permutation is analysed once per unroll of k, r and s (and axis), as in the
    paper: it does not change with the microkernel's size along the spatial axis.
    ``max_points`` caps the completions of one loop order (the run-time tuner, on a
    budget of seconds, asks for fewer). ``permutations_per_class`` is how many of the
    IOOpt model's loop permutations join the reduction-innermost orders; 0 solves none
    (each solve is seconds of SLSQP: a quarter of a quick ResNet-18 search).
    """
    lanes = vector_isa(isa).lanes
    model = CostModel(spec, caches, lanes)
    candidates: list[_RankedPoint] = []
    seen: set[tuple[Specifier, ...]] = set()
    fitting = sorted((c for c in classes if class_fits(spec, c, lanes)),
                     key=lambda c: -c.best_percent)[:max_classes]
    permutations: dict[tuple, list[RankedPermutation]] = {}
    for cls in fitting:
        axis_extent = spec.ho if cls.axis == "h" else spec.wo
        key = (cls.alpha, cls.unroll_r, cls.unroll_s, cls.axis)
        if key not in permutations and permutations_per_class < 1:
            permutations[key] = []   # the reduction-innermost orders alone (no solve)
        elif key not in permutations:
            representative = min(cls.beta_max, axis_extent)
            shape = MicrokernelShape(cls.unroll_r, cls.unroll_s, cls.axis, cls.alpha,
                                     representative)
            try:
                permutations[key] = model.rank_permutations(shape,
                                                            top=permutations_per_class)
            except ValueError:
                permutations[key] = []
        orders = [(model_loop_order(p), LoopFamily.MODEL_ORDER) for p in permutations[key]]
        orders += [(o, LoopFamily.REDUCTION_INNERMOST)
                   for o in reduction_innermost_orders(spec, cls)]
        for order, origin in orders:
            points = completions(spec, cls, order, max_points, lanes)
            if not points:
                continue
            costs = model_costs(model, cls, points)
            for point, cost in zip(points, costs):
                specifiers = point_specifiers(point, cls)
                if specifiers in seen:
                    continue
                seen.add(specifiers)
                text = "[" + "; ".join(str(sp) for sp in specifiers) + "]"
                candidates.append(_RankedPoint(text, specifiers, cls, point.betas,
                                               reduction_above(point), float(cost), origin))
    return [point.candidate() for point in prune(candidates, keep_fraction, top)]


def hoist_above_lambda_seq(specs: Sequence[Specifier], first_block: int) -> list[Specifier]:
    """``specs`` with the tile loops right below its opening lambda-seq that run along
    neither the sequence's axis nor a reduction moved above it. The iterations are the
    same, the sequence now runs inside each of them; without this, a scheme like
    ``[Lseq h [(8,13),(2,16)]; T136 w; T8 k; ...]``, which the search often finds best,
    has no loop to run in parallel."""
    lseq = specs[0]
    end = 1
    while (end < first_block and specs[end].kind is SpecKind.T
           and not specs[end].is_parametric
           and specs[end].dim != lseq.dim and specs[end].dim not in REDUCTION_DIMS):
        end += 1
    return list(specs[1:end]) + [lseq] + list(specs[end:])


def parallel_variants(candidate: Candidate, spec: ConvSpec, threads: int,
                      isa: Isa = Isa.AVX512F) -> list[Candidate]:
    """The three parallel strategies of section 5.5 applied to a sequential scheme.

    Only loops above the first lambda-seq can be parallel; a variant whose parallel band
    runs fewer iterations than ``threads`` is dropped. A scheme that opens with its
    lambda-seq first has the tile loops right below it hoisted above it (see
    :func:`hoist_above_lambda_seq`).
    """
    specs = list(candidate.scheme.specifiers)
    first_block = len(specs) - len(candidate.scheme.block)
    if specs[0].kind is SpecKind.LSEQ:
        specs = hoist_above_lambda_seq(specs, first_block)
    first_lseq = next((i for i, s in enumerate(specs) if s.kind is SpecKind.LSEQ),
                      first_block)
    head, tail = specs[:first_lseq], specs[first_lseq:]
    loops = [s for s in head if s.kind in LOOP_KINDS]
    if len(loops) != len(head):
        return []

    def with_band(order: list[Specifier], parallel_from: int, parallel_to: int
                  ) -> tuple[Specifier, ...]:
        band = [dataclasses.replace(s, parallel=True) if parallel_from <= i < parallel_to
                else s for i, s in enumerate(order)]
        return tuple(band + tail)

    def band_iterations(order, start, end) -> int:
        return math.prod(s.size for s in order[start:end])

    variants: list[tuple[Strategy, tuple[Specifier, ...]]] = []
    # 1. the largest band of non-reduction loops at the top
    end = 0
    while end < len(loops) and loops[end].dim not in REDUCTION_DIMS:
        end += 1
    if end and band_iterations(loops, 0, end) >= threads:
        variants.append((Strategy.PARALLEL_OUTER_BAND, with_band(loops, 0, end)))
    # 2. reductions innermost, the rest collapsed
    outer = [s for s in loops if s.dim not in REDUCTION_DIMS]
    inner = [s for s in loops if s.dim in REDUCTION_DIMS]
    if outer and band_iterations(outer, 0, len(outer)) >= threads:
        variants.append((Strategy.REDUCTIONS_INNERMOST,
                         with_band(outer + inner, 0, len(outer))))
    # 3. reductions outermost, the rest collapsed below them
    if outer and inner and band_iterations(outer, 0, len(outer)) >= threads:
        variants.append((Strategy.REDUCTIONS_OUTERMOST,
                         with_band(inner + outer, len(inner), len(inner) + len(outer))))
    out, seen = [], set()
    for strategy, specifiers in variants:
        if specifiers in seen:
            continue
        seen.add(specifiers)
        try:
            scheme = Scheme(specifiers)
            lower(scheme, spec, isa)
        except SchemeError:
            continue
        out.append(Candidate(scheme, candidate.microkernels, candidate.reduction_above,
                             candidate.model_cost, strategy, candidate.origin))
    return out
