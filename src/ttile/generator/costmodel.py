"""Step 2 of the TTile search (paper section 5.2): the data-movement cost of a tiled nest
for one problem, and the loop permutation above a microkernel that it ranks best.

:class:`CostModel` owns the model. It is made once per problem and cache hierarchy: the
problem becomes a polyhedral computation once, and its footprints are turned into
numeric functions once; every cost the search asks for after that (a permutation being
solved by TileOpt, a hundred thousand completions being pruned) is numeric evaluation
through the pure math of :mod:`ttile.generator.iomodel`.

For a convolution and a microkernel, the loops above the microkernel form four bands,
one per memory level (outermost first: memory, L3, L2, L1), each a permutation of the
dimensions that still have iterations left. Each band's candidates come from IOOpt's
Algorithm 1 (a handful instead of 7!); the combination is chosen band by band (L1, then
L2, then L3), with TileOpt choosing the loop counts, which are then rounded to integers
that divide the problem. The result is written as in the paper, e.g.
``[[K,H],[W,H],[H],[S,R,W,C]]`` (loops that TileOpt left at one iteration are omitted).

Imports islpy, sympy and scipy: generator and run-time tuner only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.spec import VECTOR_LANES, ConvSpec
from ..core.vectors import vector_isa
from .iomodel import (Estimate, conv_lower_bound, estimate_nest, generate_permutations,
                      nest_volumes, numeric_footprints, reuse_sets, round_counts, tileopt,
                      weighted_costs)
from ..tuning.records import RecordStatus
from .machine import CacheLevel
from .microkernels import MicrokernelShape
from .polyhedral import conv2d_computation

BANDS = ("memory", "L3", "L2", "L1")  # outermost first


def microkernel_tile(spec: ConvSpec, shape: MicrokernelShape,
                     lanes: int = VECTOR_LANES) -> dict[str, int]:
    """The microkernel's extents along every dimension (c = 1: its reduction loop is the
    innermost loop above it, part of the L1 band; k is ``alpha`` vectors of ``lanes``)."""
    tile = {"n": 1, "k": shape.alpha * lanes, "c": 1, "h": 1, "w": 1,
            "r": shape.unroll_r, "s": shape.unroll_s}
    tile[shape.axis] = shape.beta
    extents = spec.iteration_extents(lanes)
    too_big = [d for d, v in tile.items() if v > extents[d]]
    if too_big:
        raise ValueError(f"microkernel {shape.key} is larger than the problem along "
                         f"{', '.join(too_big)}")
    return tile


@dataclass(frozen=True)
class RankedPermutation:
    """A four-band permutation with its integer loop counts and estimated data movement."""

    bands: tuple[tuple[str, ...], ...]
    counts: tuple[tuple[float, ...], ...]
    estimate: Estimate

    def notation(self, with_counts: bool = False) -> str:
        """The paper's form, e.g. ``[[K,H],[W,H],[H],[S,R,W,C]]``; count-1 loops omitted."""
        parts = []
        for dims, counts in zip(self.bands, self.counts):
            loops = [f"{d.upper()}{_fmt(c)}" if with_counts else d.upper()
                     for d, c in zip(dims, counts) if c > 1 + 1e-9]
            parts.append("[" + ",".join(loops) + "]")
        return "[" + ",".join(parts) + "]"

    @property
    def permutation(self) -> tuple[str, ...]:
        return tuple(d for band in self.bands for d in band)

    @property
    def flat_counts(self) -> tuple[float, ...]:
        return tuple(c for band in self.counts for c in band)


def _fmt(value: float) -> str:
    return str(int(round(value))) if abs(value - round(value)) < 1e-6 else f"{value:.2f}"


def _prime_factors(value: int) -> list[int]:
    out, p = [], 2
    while p * p <= value:
        while value % p == 0:
            out.append(p)
            value //= p
        p += 1
    if value > 1:
        out.append(value)
    return out


def _diverse(permutations: list[tuple[str, ...]], count: int) -> list[tuple[str, ...]]:
    """Up to ``count`` permutations, alternating between innermost dimensions (Algorithm 1
    lists permutations depth first, so its first few differ only in the outer loops)."""
    if not permutations:
        return [()]
    groups: dict[str, list[tuple[str, ...]]] = {}
    for p in permutations:
        groups.setdefault(p[-1] if p else "", []).append(p)
    out = []
    while len(out) < count and any(groups.values()):
        for key in list(groups):
            if groups[key] and len(out) < count:
                out.append(groups[key].pop(0))
    return out


def _hill_climb(perm: tuple[str, ...], counts: list[float], integral: set[str],
                evaluate_batch, max_steps: int = 60) -> tuple[list[float], float]:
    """Integer polishing: move one prime factor between two loops of the same dimension
    while that lowers the cost (all moves of a step are evaluated in one batch)."""
    current = list(counts)
    value = float(evaluate_batch(np.array([current]))[0])
    for _ in range(max_steps):
        moves = []
        for i, d in enumerate(perm):
            if d not in integral or current[i] <= 1:
                continue
            for p in set(_prime_factors(int(round(current[i])))):
                for j, e in enumerate(perm):
                    if j != i and e == d:
                        moved = list(current)
                        moved[i] /= p
                        moved[j] *= p
                        moves.append(moved)
        if not moves:
            break
        values = evaluate_batch(np.array(moves))
        best = int(np.argmin(values))
        if not values[best] < value * (1 - 1e-9):
            break
        current, value = moves[best], float(values[best])
    return current, value


def _rank_permutations(model: "CostModel", shape: MicrokernelShape, top: int,
                       candidates_per_band: int, polish: int) -> list[RankedPermutation]:
    """Ranked four-band permutations above ``shape`` for ``spec``, cheapest first.

    Band candidates come from Algorithm 1; the L1, L2 and L3 bands are chosen in turn,
    each candidate's loop counts set by TileOpt (SLSQP). The ``polish`` best are then
    rounded to integer counts that divide the problem and improved by moving prime
    factors between loops of a dimension; that integer estimate is what is ranked.
    """
    spec, comp = model.spec, model.computation
    tile = microkernel_tile(spec, shape, model.lanes)
    extents = spec.iteration_extents(model.lanes)
    remaining = {d: extents[d] / tile[d] for d in comp.dims}
    active = [d for d in comp.dims if remaining[d] > 1 + 1e-9]
    integral = {d for d in active if abs(remaining[d] - round(remaining[d])) < 1e-9}
    reuse = reuse_sets(comp, small={"r": spec.r, "s": spec.s, "n": spec.n})
    candidates = _diverse(generate_permutations(active, reuse), candidates_per_band)
    # The loop right above the microkernel is its reduction loop over c (the paper's
    # [T512 c; U...] microkernel, and [S,R,W,C] bands): the L1 band ends with c.
    outer_dims = [d for d in active if d != "c"]
    l1_candidates = [p + ("c",) for p in _diverse(generate_permutations(outer_dims, reuse),
                                                  candidates_per_band)] if "c" in active \
        else candidates

    def objective_batch(perm, counts_2d):
        return model.costs(perm, tile, counts_2d)

    solved: dict[tuple, tuple[float, tuple[float, ...]]] = {}

    def solve(choice: dict[str, tuple[str, ...]]) -> float:
        perm = tuple(d for band in BANDS for d in choice[band])
        if perm not in solved:
            sol = tileopt(None, {d: remaining[d] for d in comp.dims}, {},
                          lambda _t, counts: float(objective_batch(perm, np.array([counts]))[0]),
                          permutation=perm, dims=active,
                          batch_objective=lambda pts: objective_batch(perm, pts),
                          starts=1, maxiter=20)
            solved[perm] = (sol.value, sol.counts)
        return solved[perm][0]

    choice = {band: candidates[0] for band in BANDS}
    choice["L1"] = l1_candidates[0]
    for band in ("L1", "L2", "L3"):
        options = l1_candidates if band == "L1" else candidates
        choice[band] = min(options, key=lambda c: solve({**choice, band: c}))

    ranked = []
    size = len(active)
    for perm, (_, counts) in sorted(solved.items(), key=lambda item: item[1][0])[:max(top, polish)]:
        rounded = list(round_counts(perm, counts, {d: round(remaining[d]) for d in integral}))
        for i, d in enumerate(perm):
            if d not in integral:  # not divisible: lambda-seq territory, keep the real count
                rounded[i] = counts[i]
        if len(ranked) < polish:
            rounded, _ = _hill_climb(perm, rounded, integral,
                                     lambda pts, perm=perm: objective_batch(perm, pts))
        est = model.estimate(perm, tile, rounded)
        bands = tuple(perm[i * size:(i + 1) * size] for i in range(len(BANDS)))
        band_counts = tuple(tuple(rounded[i * size:(i + 1) * size]) for i in range(len(BANDS)))
        ranked.append(RankedPermutation(bands, band_counts, est))
    ranked.sort(key=lambda rp: rp.estimate.cost)
    unique, seen = [], set()
    for rp in ranked:  # permutations differing only in one-iteration loops are the same
        if rp.notation(with_counts=True) not in seen:
            seen.add(rp.notation(with_counts=True))
            unique.append(rp)
    return unique[:top]


@dataclass(frozen=True)
class LevelReport:
    cache: str
    capacity_elements: float
    volume: float
    lower_bound: float
    dominant_term: str


def _compare_with_lower_bound(spec: ConvSpec, ranked: RankedPermutation,
                              caches: Sequence[CacheLevel]) -> list[LevelReport]:
    reports = []
    for cache in caches:
        capacity = cache.capacity_bytes / 4
        bound, term = conv_lower_bound(spec.n, spec.k, spec.c, spec.ho, spec.wo, spec.r,
                                       spec.s, capacity)
        reports.append(LevelReport(cache.name, capacity, ranked.estimate.volume(cache.name),
                                   bound, term))
    return reports


def default_microkernel(spec: ConvSpec, table=None) -> MicrokernelShape:
    """The best measured selected microkernel that fits ``spec`` (no r/s unroll family
    unless the layer's kernel size matches), or a safe default without a table."""
    lanes = vector_isa(table.isa).lanes if table is not None else VECTOR_LANES
    extents = spec.iteration_extents(lanes)
    if table is not None:
        fits = []
        for cls in table.classes:
            if (cls.unroll_r, cls.unroll_s) not in {(1, 1), (spec.r, 1), (1, spec.s),
                                                     (spec.r, spec.s)}:
                continue
            for shape in cls.shapes():
                if shape.alpha * lanes <= extents["k"] and \
                        shape.beta <= extents[shape.axis]:
                    fits.append(shape)
        measured = {m.shape: m.gflops for m in table.measurements
                    if m.status is RecordStatus.OK}
        if fits:
            return max(fits, key=lambda s: measured.get(s, 0.0))
    alpha = max(1, min(2, extents["k"] // lanes))
    beta = max(1, min(8 if alpha == 2 else 14, extents["h"]))
    return MicrokernelShape(1, 1, "h", alpha, beta)


class CostModel:
    """The IOOpt cost model of one problem on one cache hierarchy (see the module text).

    ``costs`` is what the search calls in its inner loops; the footprints behind it are
    derived once per problem (per stride, in fact: the convolution's access functions
    depend on nothing else) and shared by every method.
    """

    def __init__(self, spec: ConvSpec, caches: Sequence[CacheLevel],
                 lanes: int = VECTOR_LANES):
        self.spec = spec
        self.caches = tuple(caches)
        self.lanes = lanes          # of the vector family the microkernels are written in
        self.computation = conv2d_computation(spec.stride_h, spec.stride_w)
        self.footprints = numeric_footprints(self.computation)

    def costs(self, permutation: Sequence[str], tile: dict[str, float], counts_2d
              ) -> np.ndarray:
        """Seconds of data movement of the nests ``permutation`` (loop dims, outermost
        first) above ``tile``, one per row of loop counts ``counts_2d``."""
        fps, ios = nest_volumes(self.footprints, permutation, tile,
                                np.atleast_2d(np.asarray(counts_2d, float)))
        return weighted_costs(fps, ios, self.caches)

    def estimate(self, permutation: Sequence[str], tile: dict[str, float],
                 counts: Sequence[float]) -> Estimate:
        """Volumes per cache and weighted cost of one concrete nest."""
        return estimate_nest(self.footprints, permutation, tile, counts, self.caches)

    def rank_permutations(self, shape: MicrokernelShape, top: int = 6,
                          candidates_per_band: int = 3, polish: int = 3
                          ) -> list[RankedPermutation]:
        """Ranked four-band permutations above ``shape``, cheapest first.

        Band candidates come from Algorithm 1; the L1, L2 and L3 bands are chosen in
        turn, each candidate's loop counts set by TileOpt (SLSQP). The ``polish`` best
        are then rounded to integer counts that divide the problem and improved by
        moving prime factors between loops of a dimension; that integer estimate is what
        is ranked.
        """
        return _rank_permutations(self, shape, top, candidates_per_band, polish)

    def lower_bounds(self, ranked: RankedPermutation) -> list[LevelReport]:
        """Model volume (upper bound of the scheme) beside IOOpt's lower bound, per cache."""
        return _compare_with_lower_bound(self.spec, ranked, self.caches)
