"""Data footprints of affine array accesses, counted with ISL + Barvinok, as sympy.

The IOOpt model (:mod:`ttile.iomodel`) needs, for every array and every rectangular
sub-domain of the iteration space, how many distinct elements the sub-domain touches
(its footprint) and how many of them it shares with the next sub-domain along a
dimension (the reuse). Every sub-domain the model looks at is a box anchored at the
origin, so both quantities are functions of the box's extents alone. They are computed
here once per computation, symbolically, from the access relations:

* ``footprint[A]``: |f_A(box(E))| for extents E_d,
* ``overlap[A][d]``: |f_A(box(E)) ∩ f_A(box(E) shifted by E_d along d)|,

as sympy expressions in the symbols ``E_<dim>`` (piecewise where Barvinok's answer is).
No per-array formula is written by hand: the convolution, the strided convolution and
matrix multiplication all go through the same code.

Imports islpy; only the generator uses this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import islpy as isl
import sympy


@dataclass(frozen=True)
class ArrayAccess:
    """An array and its affine subscript, e.g. ``ArrayAccess("x", "[n, c, 2h + r, 2w + s]")``."""

    name: str
    subscript: str


@dataclass(frozen=True)
class Computation:
    """A perfectly nested affine computation: loop dimensions and the arrays it touches.

    ``output`` names the array written (accumulated into); its footprint is also the
    number of final stores.
    """

    name: str
    dims: tuple[str, ...]
    arrays: tuple[ArrayAccess, ...]
    output: str

    def array(self, name: str) -> ArrayAccess:
        return next(a for a in self.arrays if a.name == name)


def conv2d_computation(stride_h: int = 1, stride_w: int = 1) -> Computation:
    """y[n,k,h,w] += x[n, c, sh*h + r, sw*w + s] * w[k, c, r, s]."""
    return Computation(
        name=f"conv2d_s{stride_h}x{stride_w}",
        dims=("n", "k", "c", "h", "w", "r", "s"),
        arrays=(ArrayAccess("y", "[n, k, h, w]"),
                ArrayAccess("x", f"[n, c, {stride_h}h + r, {stride_w}w + s]"),
                ArrayAccess("w", "[k, c, r, s]")),
        output="y")


def matmul_computation() -> Computation:
    """C[i,j] += A[i,k] * B[k,j] (IOOpt Listing 1)."""
    return Computation(name="matmul", dims=("i", "j", "k"),
                       arrays=(ArrayAccess("C", "[i, j]"), ArrayAccess("A", "[i, k]"),
                               ArrayAccess("B", "[k, j]")),
                       output="C")


def conv1d_computation() -> Computation:
    """Out[f][x] += Image[x+w][c] * Filter[f][w][c] (IOOpt Listing 2)."""
    return Computation(name="conv1d", dims=("c", "f", "x", "w"),
                       arrays=(ArrayAccess("Out", "[f, x]"), ArrayAccess("Image", "[x + w, c]"),
                               ArrayAccess("Filter", "[f, w, c]")),
                       output="Out")


def extent_symbol(dim: str) -> sympy.Symbol:
    return sympy.Symbol(f"E_{dim}", positive=True, integer=True)


@dataclass(frozen=True)
class Footprints:
    """Symbolic footprint and overlap of every array of a computation (see module doc)."""

    computation: Computation
    footprint: dict[str, sympy.Expr]
    overlap: dict[str, dict[str, sympy.Expr]]


def _val(value: isl.Val) -> sympy.Rational:
    return sympy.Rational(value.to_str())


def _linear_to_sympy(obj, divs: list, params: list[sympy.Symbol]) -> sympy.Expr:
    """constant + sum(coefficient * parameter) + sum(coefficient * floor(div)) of an ISL
    affine object (Aff or Constraint), whose existential divs are given as Affs."""
    expr = _val(obj.get_constant_val())
    for i, p in enumerate(params):
        expr += _val(obj.get_coefficient_val(isl.dim_type.param, i)) * p
    for j, div in enumerate(divs):
        coefficient = _val(obj.get_coefficient_val(isl.dim_type.div, j))
        if coefficient:
            expr += coefficient * sympy.floor(_aff_to_sympy(div, params))
    return expr


def _aff_to_sympy(aff: isl.Aff, params: list[sympy.Symbol]) -> sympy.Expr:
    divs = [aff.get_div(j) for j in range(aff.dim(isl.dim_type.div))]
    return _linear_to_sympy(aff, divs, params)


def _constraint_to_sympy(constraint: isl.Constraint, local: isl.LocalSpace,
                         params: list[sympy.Symbol]):
    divs = [local.get_div(j) for j in range(local.dim(isl.dim_type.div))]
    expr = _linear_to_sympy(constraint, divs, params)
    return sympy.Eq(expr, 0) if constraint.is_equality() else expr >= 0


def _set_to_sympy(domain: isl.Set, params: list[sympy.Symbol]):
    clauses = []
    for basic in domain.get_basic_sets():
        local = basic.get_local_space()
        parts = [_constraint_to_sympy(c, local, params) for c in basic.get_constraints()]
        clauses.append(sympy.And(*parts))
    return sympy.Or(*clauses)


def _qpoly_to_sympy(qpoly: isl.QPolynomial, params: list[sympy.Symbol]) -> sympy.Expr:
    expr = sympy.Integer(0)
    for term in qpoly.get_terms():
        value = _val(term.get_coefficient_val())
        for i, p in enumerate(params):
            value *= p ** term.get_exp(isl.dim_type.param, i)
        for j in range(term.dim(isl.dim_type.div)):
            exponent = term.get_exp(isl.dim_type.div, j)
            if exponent:
                value *= sympy.floor(_aff_to_sympy(term.get_div(j), params)) ** exponent
        expr += value
    return expr


def card_to_sympy(count: isl.PwQPolynomial, params: list[sympy.Symbol]) -> sympy.Expr:
    """A Barvinok count as a sympy expression (a Piecewise when there are several pieces;
    points outside every piece count 0, as in ISL)."""
    pieces = [(_qpoly_to_sympy(qp, params), _set_to_sympy(dom, params))
              for dom, qp in count.get_pieces()]
    if not pieces:
        return sympy.Integer(0)
    if len(pieces) == 1:
        return pieces[0][0]
    return sympy.Piecewise(*pieces, (0, True))


def _box(comp: Computation, shift: str | None = None) -> str:
    bounds = []
    for d in comp.dims:
        if d == shift:
            bounds.append(f"E_{d} <= {d} < 2E_{d}")
        else:
            bounds.append(f"0 <= {d} < E_{d}")
    return " and ".join(bounds)


@lru_cache(maxsize=None)
def footprints(comp: Computation) -> Footprints:
    """Count every footprint and overlap of ``comp`` (cached per computation)."""
    names = [f"E_{d}" for d in comp.dims]
    params = [extent_symbol(d) for d in comp.dims]
    header = f"[{', '.join(names)}] -> "
    iteration = f"[{', '.join(comp.dims)}]"
    positive = " and ".join(f"{n} >= 1" for n in names)
    context = isl.Set(f"{header}{{ : {positive} }}")

    footprint: dict[str, sympy.Expr] = {}
    overlap: dict[str, dict[str, sympy.Expr]] = {}
    for array in comp.arrays:
        access = isl.Map(f"{header}{{ {iteration} -> {array.name}{array.subscript} }}")
        base = isl.Set(f"{header}{{ {iteration} : {_box(comp)} }}")
        image = base.apply(access).intersect_params(context)
        footprint[array.name] = card_to_sympy(image.card().coalesce(), params)
        overlap[array.name] = {}
        for d in comp.dims:
            shifted = isl.Set(f"{header}{{ {iteration} : {_box(comp, d)} }}").apply(access)
            common = image.intersect(shifted.intersect_params(context))
            overlap[array.name][d] = card_to_sympy(common.card().coalesce(), params)
    return Footprints(comp, footprint, overlap)
