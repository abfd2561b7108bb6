"""IOOpt data-movement model (Olivry et al., PLDI 2021, sections 4.1-4.3) for tiled nests.

A *nest* is a tile (the microkernel, or any box of extents ``U_d``) enclosed by loops
``L_m ... L_1`` (outermost first) over dimensions that may repeat, each running ``t_i``
times; dimension d is covered exactly when ``U_d * prod(t_i over d) = N_d``. This is the
shape of a TTile scheme above its microkernel, and with one loop per dimension it is
IOOpt's tiling ``(P, T)``.

For the loop at level j (1 = innermost) the *sub-domain* fixes the loops at levels >= j
and lets the inner ones run, so it is a box of extents
``E_d(j) = U_d * prod(t_i : i < j, dim(L_i) = d)``. With the symbolic footprint F_A and
overlap O_A of :mod:`ttile.polyhedral`:

* SDF_{A,j} = F_A(E(j)),  SDR_{A,j} = O_A along dim(L_j) at E(j),
* ID_front = SDF / |SD|,  ID_back = (SDF - SDR) / |SD|,
* IO_{A,j} = |I| * (ID_front / t_j + ID_back * (1 - 1/t_j)),

the number of elements of A loaded into a cache that keeps A's level-j sub-domain
(IOOpt's "outermost reuse dimension" is the j chosen). Level ``m + 1`` is the whole
iteration space (the array is loaded once). For a cache of S elements the model picks a
level per array so that the kept sub-domains fit together (IOOpt's split of the cache
into per-array parts) and the loads are fewest. Volumes per cache level, weighted by
measured inverse bandwidths, give the cost used to rank permutations.

Everything symbolic (sympy) is derived once per (computation, permutation) and turned
into plain Python functions; evaluation is numeric and fast.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np
import sympy

from .machine import CacheLevel
from .polyhedral import Computation, extent_symbol, footprints

# ----------------------------------------------------------------------------------
# Symbolic cost of a permutation


def loop_symbol(index: int) -> sympy.Symbol:
    """Trip count of loop ``index`` of a permutation (0 = outermost)."""
    return sympy.Symbol(f"t{index}", positive=True)


def tile_symbol(dim: str) -> sympy.Symbol:
    return sympy.Symbol(f"U_{dim}", positive=True)


@dataclass(frozen=True)
class LevelCost:
    """The symbolic quantities of one array at one level of a permutation."""

    array: str
    level: int                 # 1 = innermost loop; m + 1 = the whole iteration space
    footprint: sympy.Expr      # SDF_{A,level}
    reuse: sympy.Expr          # SDR_{A,level}
    subdomain: sympy.Expr      # |SD_level|
    io: sympy.Expr             # loads of A into a cache keeping this level's sub-domain


@dataclass(frozen=True)
class SymbolicCost:
    """IO and footprint of every array at every level of one permutation, symbolically
    in the tile extents ``U_d`` and loop counts ``t_i``; plus compiled evaluators."""

    computation: Computation
    permutation: tuple[str, ...]            # loop dims, outermost first
    levels: tuple[LevelCost, ...]
    symbols: tuple[sympy.Symbol, ...]       # argument order of the evaluators
    _footprint_fn: Callable
    _io_fn: Callable

    def evaluate(self, tile: dict[str, float], counts: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        """(footprints, ios), each of shape (arrays, levels) for numeric tile and counts."""
        args = [float(tile.get(d, 1)) for d in self.computation.dims] + [float(c) for c in counts]
        return np.asarray(self._footprint_fn(*args), float), np.asarray(self._io_fn(*args), float)

    def level_cost(self, array: str, level: int) -> LevelCost:
        return next(lc for lc in self.levels if lc.array == array and lc.level == level)


@lru_cache(maxsize=4096)
def symbolic_cost(computation: Computation, permutation: tuple[str, ...]) -> SymbolicCost:
    """Derive every SDF, SDR, ID and IO of ``permutation`` (cached)."""
    fp = footprints(computation)
    dims = computation.dims
    m = len(permutation)
    tiles = {d: tile_symbol(d) for d in dims}
    counts = [loop_symbol(i) for i in range(m)]
    # Level j (1-based from the inside) is loop index m - j.
    extents_at: list[dict[str, sympy.Expr]] = []
    for j in range(1, m + 2):
        ext = {}
        for d in dims:
            value = tiles[d]
            for i in range(m - j + 1, m):        # loops strictly inside level j
                if permutation[i] == d:
                    value *= counts[i]
            if j == m + 1:                       # whole iteration space
                value = tiles[d] * _prod(counts[i] for i in range(m) if permutation[i] == d)
            ext[d] = value
        extents_at.append(ext)
    total = _prod(extents_at[m][d] for d in dims)

    levels: list[LevelCost] = []
    for array in computation.arrays:
        name = array.name
        for j in range(1, m + 2):
            ext = extents_at[j - 1]
            subs = {extent_symbol(d): ext[d] for d in dims}
            sdf = fp.footprint[name].subs(subs)
            size = _prod(ext.values())
            if j == m + 1:
                sdr, io = sympy.Integer(0), sdf
            else:
                loop = m - j
                sdr = fp.overlap[name][permutation[loop]].subs(subs)
                t = counts[loop]
                io = total * (sdf / size / t + (sdf - sdr) / size * (1 - 1 / t))
            levels.append(LevelCost(name, j, sdf, sdr, size, io))

    symbols = tuple(tiles[d] for d in dims) + tuple(counts)
    n_arrays, n_levels = len(computation.arrays), m + 1
    footprint_exprs = [lc.footprint for lc in levels]
    io_exprs = [lc.io for lc in levels]
    f_fn = sympy.lambdify(symbols, footprint_exprs, modules="math")
    i_fn = sympy.lambdify(symbols, io_exprs, modules="math")

    def footprint_fn(*args):
        return np.reshape(f_fn(*args), (n_arrays, n_levels))

    def io_fn(*args):
        return np.reshape(i_fn(*args), (n_arrays, n_levels))

    return SymbolicCost(computation, tuple(permutation), tuple(levels), symbols,
                        footprint_fn, io_fn)


def _prod(values) -> sympy.Expr:
    out = sympy.Integer(1)
    for v in values:
        out = out * v
    return out


# ----------------------------------------------------------------------------------
# Numeric evaluation of a concrete nest


def best_levels(footprints_: np.ndarray, ios: np.ndarray, capacity: float) -> tuple[float, tuple[int, ...]]:
    """Fewest loads with the arrays' kept sub-domains fitting ``capacity`` together.

    Returns (loads, chosen level per array, 1-based). As in IOOpt every array keeps at
    least its tile (level 1); when even the tiles do not fit together the loads are
    infinite. Footprints grow with the level (each sub-domain contains the previous
    one), so each array's useful levels are the ones that fit and load strictly less
    than all smaller ones; the last array then takes the largest level that still fits.
    Plain Python: it runs for every point the solver tries, on a few dozen numbers.
    """
    fl, il = footprints_.tolist(), ios.tolist()
    options = []
    for fa, ia in zip(fl, il):
        if fa[0] > capacity:
            return math.inf, ()
        useful, lowest = [], math.inf
        for level, (f, io) in enumerate(zip(fa, ia)):
            if f > capacity:
                break
            if io < lowest:
                useful.append((f, io, level + 1))
                lowest = io
        options.append(useful)

    best, choice = math.inf, ()
    last = options[-1]

    def combine(index: int, used: float, loads: float, levels: tuple[int, ...]) -> None:
        nonlocal best, choice
        if index == len(options) - 1:
            for f, io, level in reversed(last):
                if used + f <= capacity:
                    if loads + io < best:
                        best, choice = loads + io, levels + (level,)
                    return
            return
        for f, io, level in options[index]:
            if used + f > capacity:
                break
            combine(index + 1, used + f, loads + io, levels + (level,))

    combine(0, 0.0, 0.0, ())
    return best, choice


@dataclass(frozen=True)
class Estimate:
    """Data moved into each cache level (elements) and the weighted cost (seconds)."""

    volumes: tuple[tuple[str, float], ...]
    levels: tuple[tuple[str, tuple[int, ...]], ...]
    cost: float

    def volume(self, cache: str) -> float:
        return dict(self.volumes)[cache]


def estimate(cost: SymbolicCost, tile: dict[str, float], counts: Sequence[float],
             caches: Sequence[CacheLevel], element_bytes: int = 4) -> Estimate:
    """Volumes and weighted cost of one concrete nest for a cache hierarchy."""
    fps, ios = cost.evaluate(tile, counts)
    return _weigh(fps, ios, caches, element_bytes)


def _weigh(fps: np.ndarray, ios: np.ndarray, caches: Sequence[CacheLevel],
           element_bytes: int) -> Estimate:
    volumes, chosen, total = [], [], 0.0
    for cache in caches:
        loads, levels = best_levels(fps, ios, cache.capacity_bytes / element_bytes)
        volumes.append((cache.name, loads))
        chosen.append((cache.name, levels))
        total += loads * element_bytes * cache.seconds_per_byte
    return Estimate(tuple(volumes), tuple(chosen), total)


# ----------------------------------------------------------------------------------
# Fast numeric path: the same quantities without per-permutation symbolic work


@dataclass(frozen=True)
class NumericFootprints:
    """F_A and O_{A,d} of a computation as numpy functions of the extents (vectorized
    over sub-domains): the symbolic counts of :mod:`ttile.generator.polyhedral` turned
    into code once, then evaluated for every nest the model weighs."""

    computation: Computation
    footprint: dict[str, Callable]
    overlap: dict[str, dict[str, Callable]]


@lru_cache(maxsize=None)
def numeric_footprints(computation: Computation) -> NumericFootprints:
    """The :class:`NumericFootprints` of ``computation`` (derived once per process)."""
    fp = footprints(computation)
    symbols = [extent_symbol(d) for d in computation.dims]
    f = {a.name: sympy.lambdify(symbols, fp.footprint[a.name], modules="numpy")
         for a in computation.arrays}
    o = {a.name: {d: sympy.lambdify(symbols, fp.overlap[a.name][d], modules="numpy")
                  for d in computation.dims} for a in computation.arrays}
    return NumericFootprints(computation, f, o)


def nest_volumes(fp: NumericFootprints, permutation: Sequence[str], tile: dict[str, float],
                 counts) -> tuple[np.ndarray, np.ndarray]:
    """(footprints, ios) of shape (arrays, levels), numerically; equal to
    ``symbolic_cost(...).evaluate`` but without deriving anything per permutation.

    ``counts`` may also be a 2-D array (points, loops): the result then has a leading
    points axis, all evaluated in one vectorized pass (finite differences use this).
    """
    counts = np.asarray(counts, float)
    single = counts.ndim == 1
    counts = np.atleast_2d(counts)
    computation = fp.computation
    f_fns, o_fns = fp.footprint, fp.overlap
    dims = computation.dims
    points, m = counts.shape
    position = {d: i for i, d in enumerate(dims)}
    extents = np.empty((points, m + 1, len(dims)))
    extents[:, 0, :] = [float(tile.get(d, 1)) for d in dims]
    for j in range(m):                   # row j = level j + 1; loop m-1-j is level j+1
        loop = m - 1 - j
        extents[:, j + 1, :] = extents[:, j, :]
        extents[:, j + 1, position[permutation[loop]]] *= counts[:, loop]
    sizes = extents.prod(axis=2)
    total = sizes[:, -1:]
    columns = [extents[:, :, i] for i in range(len(dims))]
    level_dims = [permutation[m - 1 - j] for j in range(m)]
    t = counts[:, ::-1]                  # level order
    fps = np.empty((points, len(computation.arrays), m + 1))
    ios = np.empty_like(fps)
    for a, array in enumerate(computation.arrays):
        f = np.broadcast_to(f_fns[array.name](*columns), (points, m + 1)).astype(float)
        overlap = np.zeros((points, m))
        for d in set(level_dims):
            mask = np.array([ld == d for ld in level_dims])
            values = np.broadcast_to(o_fns[array.name][d](*columns), (points, m + 1))
            overlap[:, mask] = values[:, :m][:, mask]
        fs = f[:, :m] / sizes[:, :m]
        ios[:, a, :m] = total * (fs / t + (f[:, :m] - overlap) / sizes[:, :m] * (1 - 1 / t))
        ios[:, a, m] = f[:, m]
        fps[:, a, :] = f
    if single:
        return fps[0], ios[0]
    return fps, ios


def estimate_nest(fp: NumericFootprints, permutation: Sequence[str], tile: dict[str, float],
                  counts: Sequence[float], caches: Sequence[CacheLevel],
                  element_bytes: int = 4) -> Estimate:
    """:func:`estimate` through the fast numeric path."""
    fps, ios = nest_volumes(fp, permutation, tile, counts)
    return _weigh(fps, ios, caches, element_bytes)


def weighted_costs(fps: np.ndarray, ios: np.ndarray, caches: Sequence[CacheLevel],
                   element_bytes: int = 4) -> np.ndarray:
    """Seconds of data movement of each point of batched :func:`nest_volumes` output
    (leading points axis): loads into each cache times its inverse bandwidth."""
    out = np.empty(len(fps))
    for p in range(len(fps)):
        out[p] = sum(best_levels(fps[p], ios[p], c.capacity_bytes / element_bytes)[0]
                     * element_bytes * c.seconds_per_byte for c in caches)
    return out


# ----------------------------------------------------------------------------------
# Permutation pruning (IOOpt Algorithm 1)


def reuse_sets(computation: Computation, small: dict[str, int],
               large: int = 32, threshold: float = 0.5) -> dict[str, frozenset[str]]:
    """The reuse oracle: for each dim d, the arrays with reuse when d is innermost.

    Array A has reuse along d when a sub-domain one step long in d shares at least
    ``threshold`` of its footprint with the next one; the other dimensions take their
    full size when ``small`` names them (kernel rows, columns) and ``large`` otherwise.
    """
    fp = footprints(computation)
    sets = {}
    for d in computation.dims:
        ext = {extent_symbol(e): (small.get(e, large) if e != d else 1) for e in computation.dims}
        arrays = set()
        for array in computation.arrays:
            f = float(fp.footprint[array.name].subs(ext))
            o = float(fp.overlap[array.name][d].subs(ext))
            if f > 0 and o / f >= threshold:
                arrays.add(array.name)
        sets[d] = frozenset(arrays)
    return sets


def generate_permutations(dims: Sequence[str], reuse: dict[str, frozenset[str]]) -> list[tuple[str, ...]]:
    """IOOpt Algorithm 1: permutations (outermost first) that maximize reuse.

    Built from the innermost dimension out: at each step only dimensions whose set of
    arrays with remaining reuse is maximal (not strictly inside another's) are tried;
    once no reuse is left the remaining dimensions come in the given order.
    """

    def gen(remaining: tuple[str, ...], sets: dict[str, frozenset[str]]) -> list[tuple[str, ...]]:
        if not remaining:
            return [()]
        if all(not sets[d] for d in remaining):
            return [remaining]
        out = []
        for d in remaining:
            if any(sets[d] < sets[e] for e in remaining if e != d):
                continue
            rest = tuple(e for e in remaining if e != d)
            narrowed = {e: sets[e] & sets[d] for e in rest}
            out += [p + (d,) for p in gen(rest, narrowed)]
        return out

    seen, result = set(), []
    for perm in gen(tuple(dims), {d: reuse[d] for d in dims}):
        if perm not in seen:
            seen.add(perm)
            result.append(perm)
    return result


# ----------------------------------------------------------------------------------
# TileOpt: tile sizes / loop counts minimizing the cost


@dataclass(frozen=True)
class TileSolution:
    tile: dict
    counts: tuple[float, ...]
    value: float


def tileopt(cost: Optional[SymbolicCost], sizes: dict[str, int], fixed_tile: dict[str, float],
            objective: Callable[[dict, Sequence[float]], float],
            free_tile: Sequence[str] = (), tile_capacity: Optional[float] = None,
            starts: int = 3, seed: int = 0, permutation: Optional[Sequence[str]] = None,
            dims: Optional[Sequence[str]] = None,
            batch_objective: Optional[Callable[[np.ndarray], np.ndarray]] = None,
            maxiter: int = 200) -> TileSolution:
    """Minimize ``objective(tile, counts)`` over free tile extents and loop counts.

    Variables live in log space; for each dimension the tile extent times the loop
    counts along it must equal the problem size (a linear equality in log space), every
    extent and count >= 1, and with ``tile_capacity`` the tiles of all arrays must fit
    in it together (IOOpt's footprint constraint). Solved with scipy's SLSQP from a few
    starting points; the result is continuous (see :func:`round_counts`).

    ``batch_objective(counts_2d)``, when given (and no tile extent is free), evaluates
    many count vectors at once and is used for the finite-difference gradient.
    """
    from scipy.optimize import minimize

    perm = tuple(permutation if permutation is not None else cost.permutation)
    dims = tuple(dims if dims is not None else cost.computation.dims)
    names = [("U", d) for d in free_tile] + [("t", i) for i in range(len(perm))]

    def unpack(z):
        tile = dict(fixed_tile)
        counts = [1.0] * len(perm)
        for (kind, key), value in zip(names, np.exp(z)):
            if kind == "U":
                tile[key] = value
            else:
                counts[key] = value
        return tile, counts

    constraints, upper = [], []
    even_split = np.zeros(len(names))    # a point meeting every equality: shares of log size
    small_tiles = np.zeros(len(names))   # the same with free tiles at 1 (inside any capacity)
    for d in dims:
        target = math.log(sizes[d]) - (0.0 if d in free_tile else math.log(fixed_tile.get(d, 1)))
        idx = [i for i, (kind, key) in enumerate(names)
               if (kind == "U" and key == d) or (kind == "t" and perm[key] == d)]
        if not idx:
            continue
        even_split[idx] = target / len(idx)
        loops_only = [i for i in idx if names[i][0] == "t"]
        if tile_capacity is not None and loops_only:
            # Tiles of one element fit any cache: start there, the loops doing all the work.
            small_tiles[idx] = 0.0
            small_tiles[loops_only] = target / len(loops_only)
        else:
            small_tiles[idx] = target / len(idx)
        row = np.zeros(len(names))
        row[idx] = 1.0
        constraints.append({"type": "eq", "fun": lambda z, row=row, target=target: row @ z - target,
                            "jac": lambda z, row=row: row})
    for kind, key in names:
        d = key if kind == "U" else perm[key]
        upper.append(max(0.0, math.log(sizes[d]) - (0.0 if kind == "U" or d in free_tile
                                                    else math.log(fixed_tile.get(d, 1)))))
    upper = [max(u, 0.0) for u in upper]
    bounds = [(0.0, u) for u in upper]
    if tile_capacity is not None:
        def fits(z):
            tile, counts = unpack(z)
            fps, _ = cost.evaluate(tile, counts)
            return 1.0 - fps[:, 0].sum() / tile_capacity
        constraints.append({"type": "ineq", "fun": fits})

    def f(z):
        tile, counts = unpack(z)
        value = objective(tile, counts)
        return value if math.isfinite(value) else 1e300

    jac = None
    if batch_objective is not None and not free_tile:
        def jac(z, step=1e-4):
            points = np.exp(np.vstack([z, z + step * np.eye(len(z))]))
            values = np.asarray(batch_objective(points), float)
            values[~np.isfinite(values)] = 1e300
            return (values[1:] - values[0]) / step

    def feasible(z) -> bool:
        return all(abs(c["fun"](z)) < 1e-6 if c["type"] == "eq" else c["fun"](z) >= -1e-6
                   for c in constraints)

    # SLSQP works on the objective divided by its value at a feasible start: raw counts
    # of loads (1e8 and more) made its line search stop at once ("positive directional
    # derivative") with scipy >= 1.15.
    scale = f(small_tiles)
    scale = scale if 0 < scale < 1e300 else 1.0

    def scaled(z):
        return f(z) / scale

    scaled_jac = None if jac is None else (lambda z: jac(z) / scale)
    rng = np.random.default_rng(seed)
    best: Optional[TileSolution] = None
    candidates = []
    for attempt in range(starts):
        # Start inside the capacity: from a point where the tiles do not fit, the
        # objective is flat (infinite) and SLSQP's subproblem can be singular.
        z0 = small_tiles if attempt == 0 else rng.uniform(0, 1, len(upper)) * upper
        result = minimize(scaled, z0, jac=scaled_jac, method="SLSQP", bounds=bounds, constraints=constraints,
                          options={"maxiter": maxiter, "ftol": 1e-10})
        candidates.append(result.x)
    candidates += [even_split, small_tiles]  # when the solver strays, these still stand
    for z in candidates:
        if feasible(z):
            tile, counts = unpack(z)
            value = f(z)
            if best is None or value < best.value:
                best = TileSolution(tile, tuple(counts), value)
    if best is None:
        raise RuntimeError("TileOpt found no feasible point")
    return best


def round_tile(cost: SymbolicCost, sizes: dict[str, int], solution: TileSolution,
               free_tile: Sequence[str], objective: Callable[[dict, Sequence[float]], float],
               tile_capacity: Optional[float] = None, divisible: bool = False) -> TileSolution:
    """Integer tile extents near a continuous TileOpt solution (one loop per dimension).

    Tries floor and ceiling of every free extent (or, with ``divisible``, the nearest
    divisors of the problem size below and above) and keeps the best that fits.
    """
    choices = []
    for d in free_tile:
        value = solution.tile[d]
        if divisible:
            divisors = [q for q in range(1, sizes[d] + 1) if sizes[d] % q == 0]
            below = max((q for q in divisors if q <= value), default=1)
            above = min((q for q in divisors if q >= value), default=sizes[d])
            choices.append(sorted({below, above}))
        else:
            choices.append(sorted({max(1, math.floor(value)), min(sizes[d], math.ceil(value))}))
    best: Optional[TileSolution] = None
    for combo in itertools.product(*choices):
        tile = dict(solution.tile)
        tile.update(dict(zip(free_tile, combo)))
        counts = [sizes[d] / tile.get(d, 1) for d in cost.permutation]
        if tile_capacity is not None:
            fps, _ = cost.evaluate(tile, counts)
            if fps[:, 0].sum() > tile_capacity:
                continue
        value = objective(tile, counts)
        if best is None or value < best.value:
            best = TileSolution({k: int(v) if k in free_tile else v for k, v in tile.items()},
                                tuple(counts), value)
    if best is None:
        raise RuntimeError("no integer tile near the TileOpt solution fits")
    return best


def divisor_splits(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered way to write ``total`` as a product of ``parts`` integers >= 1."""
    if parts == 1:
        return [(total,)]
    out = []
    for first in range(1, total + 1):
        if total % first == 0:
            out += [(first,) + rest for rest in divisor_splits(total // first, parts - 1)]
    return out


def round_counts(permutation: Sequence[str], counts: Sequence[float],
                 remaining: dict[str, int]) -> tuple[int, ...]:
    """Integer loop counts with exact divisibility, closest (in log) to ``counts``.

    For each dimension, the counts of its loops are replaced by the ordered product
    split of ``remaining[d]`` (problem size over tile extent) nearest to the solver's.
    """
    out = [1] * len(permutation)
    for d, total in remaining.items():
        idx = [i for i, p in enumerate(permutation) if p == d]
        if not idx:
            continue
        target = np.log(np.maximum([counts[i] for i in idx], 1.0))
        best = min(divisor_splits(int(total), len(idx)),
                   key=lambda split: float(np.sum((np.log(split) - target) ** 2)))
        for i, value in zip(idx, best):
            out[i] = value
    return tuple(out)


# ----------------------------------------------------------------------------------
# The convolution lower bound (IOOpt Fig. 6)


def conv_lower_bound(n: int, k: int, c: int, ho: int, wo: int, r: int, s: int,
                     capacity: float) -> tuple[float, str]:
    """IOOpt's combined lower bound for a 2D convolution and the row that dominates.

    In the paper's names: B batch, C input channels, F filters, X, Y output extents,
    H, W kernel extents, S the fast memory in elements.
    """
    B, C, F, X, Y, H, W, S = n, c, k, wo, ho, r, s, capacity
    base = -2 - S + C + 4 * F + B * Y + B * X + 2 * B * X * Y - 2 * B * X * Y * F
    rows = {
        "sum of array sizes": B * C * (Y + H - 1) * (X + W - 1) + B * F * X * Y + F * C * H * W,
        "reduction": base + B * F * X * Y * (W * H * C - 1) / S,
        "small H, W: 2BXYCF*sqrt(HW)/sqrt(S)":
            base + 2 * B * X * Y * C * F * math.sqrt(H * W) / math.sqrt(S)
            - 2 * B * X * Y * F / math.sqrt(H * W * S),
        "small H, W, B: 2XYCF*sqrt(BHW)/sqrt(S)":
            base + 2 * X * Y * C * F * math.sqrt(B * H * W) / math.sqrt(S)
            - 2 * X * Y * F * math.sqrt(B) / math.sqrt(H * W * S),
    }
    name = max(rows, key=rows.get)
    return rows[name], name
