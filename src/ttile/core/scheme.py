"""Optimization schemes (TTile paper, section 4): the schedule of a convolution as data.

A scheme is a list of specifiers, outermost loop first:

=====================  ===========================================================
text form              meaning
=====================  ===========================================================
``R d``                loop over the outer tiles of d; its count is whatever makes
                       the scheme cover dimension d exactly
``T16 d``              tile loop along d iterating exactly 16 times
``U4 d``               the same loop, fully unrolled (register tile)
``V k``                one vector along k (16 lanes in AVX-512F, 8 in AVX2);
                       innermost, exactly once
``Lseq h [(2,11),(1,12)]``
                       lambda-seq: a sequence of loops along h, the first running 2
                       times with the parameter bound to 11, then once with 12; the
                       parameter is the size of the next parametric specifier along h
``U beta h``           a parametric specifier (here an unroll along h) whose size is
                       bound by the enclosing Lseq
``PT8 h``, ``PR n``    a tile / outer loop run in parallel with OpenMP; consecutive
                       parallel loops form one band that is collapsed
=====================  ===========================================================

Example (the paper's Yolo9000-13 scheme)::

    [T16 k; T1 h; Lseq h [(2,11),(1,12)]; T17 w; T1 h; T1 h; T3 s; T3 r; T2 w;
     T256 c; U beta h; U2 k; V k]

Specifiers are separated by ``;``; ``λseq`` is accepted for ``Lseq``. Dimensions are
those of :mod:`ttile.spec` (n k c h w r s), h and w counting output pixels and k counting
output channels (a ``V k`` covers 16 of them in AVX-512F, 8 in AVX2).

The module has three layers: the frozen :class:`Scheme` value (parse, print, structural
checks that need no problem size), :meth:`Scheme.validate` against a
:class:`~ttile.spec.ConvSpec` (exact coverage, divisibility, register budget), and
:func:`lower`, which applies the paper's section 6.1 rewrite of lambda-seq into ``Seq``
and resolves every loop count, giving the tree the code generator walks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Union

from .kinds import Isa
from .spec import DIMS, REDUCTION_DIMS, ConvSpec
from .vectors import AVX512F, VectorIsa, vector_isa

#: Vector registers of AVX-512 (zmm0-zmm31), the default family's budget (AVX2 has 16:
#: see :mod:`ttile.core.vectors`).
VECTOR_REGISTERS = AVX512F.registers



class SpecKind(str, Enum):
    """The kind of a specifier (see the table above)."""

    R = "R"          # outer loop, count inferred
    T = "T"          # tile loop of a fixed count
    U = "U"          # unrolled loop
    V = "V"          # the vector along k
    LSEQ = "Lseq"    # lambda-seq

    def __str__(self) -> str:
        return self.value


#: Loop specifiers that iterate at run time (may be parallel).
LOOP_KINDS = frozenset({SpecKind.R, SpecKind.T})
#: Specifiers of the unrolled block at the bottom of a scheme.
BLOCK_KINDS = frozenset({SpecKind.U, SpecKind.V})


class SchemeError(ValueError):
    """A scheme that is malformed, or does not fit the problem it is applied to."""


@dataclass(frozen=True)
class Specifier:
    """One element of a scheme.

    ``size`` is an int, a parameter name bound by an Lseq (T and U only), or None
    (R and V). ``parts`` holds the (repetitions, parameter value) pairs of an Lseq.
    """

    kind: SpecKind
    dim: str
    size: Union[int, str, None] = None
    parallel: bool = False
    parts: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        prefix = "P" if self.parallel else ""
        if self.kind is SpecKind.R:
            return f"{prefix}R {self.dim}"
        if self.kind in (SpecKind.T, SpecKind.U):
            if isinstance(self.size, str):
                return f"{prefix}{self.kind.value} {self.size} {self.dim}"
            return f"{prefix}{self.kind.value}{self.size} {self.dim}"
        if self.kind is SpecKind.V:
            return f"V {self.dim}"
        parts = ",".join(f"({count},{value})" for count, value in self.parts)
        return f"Lseq {self.dim} [{parts}]"

    @property
    def is_parametric(self) -> bool:
        return isinstance(self.size, str)


_NAME = r"[A-Za-z_][A-Za-z_0-9]*"
_RE_R = re.compile(r"(P?)R\s*([a-z])")
_RE_TU = re.compile(rf"(P?)([TU])(?:\s*(\d+)\s*|\s+({_NAME})\s+)([a-z])")
_RE_V = re.compile(r"V\s*([a-z])")
_RE_LSEQ = re.compile(r"(?:Lseq|λseq)\s*([a-z])\s*\[(.*)\]")
_RE_PART = re.compile(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def _parse_specifier(text: str) -> Specifier:
    if m := _RE_R.fullmatch(text):
        return Specifier(SpecKind.R, m[2], parallel=bool(m[1]))
    if m := _RE_TU.fullmatch(text):
        size: Union[int, str] = int(m[3]) if m[3] is not None else m[4]
        if m[1] and m[2] == "U":
            raise SchemeError(f"'{text}': an unrolled loop cannot be parallel")
        return Specifier(SpecKind(m[2]), m[5], size=size, parallel=bool(m[1]))
    if m := _RE_V.fullmatch(text):
        return Specifier(SpecKind.V, m[1])
    if m := _RE_LSEQ.fullmatch(text):
        body = m[2].strip()
        parts = tuple((int(a), int(b)) for a, b in _RE_PART.findall(body))
        rebuilt = ",".join(f"({a},{b})" for a, b in parts)
        if not parts or re.sub(r"\s", "", body) != rebuilt.replace(" ", ""):
            raise SchemeError(f"'{text}': Lseq expects a list like [(2,11),(1,12)]")
        return Specifier(SpecKind.LSEQ, m[1], parts=parts)
    raise SchemeError(
        f"cannot parse specifier '{text}' (expected e.g. 'R n', 'T16 k', 'U2 k', "
        f"'U beta h', 'V k', 'Lseq h [(2,11),(1,12)]', 'PT4 h')")


@dataclass(frozen=True)
class Scheme:
    """A validated-for-structure optimization scheme; compare and hash it as a value."""

    specifiers: tuple[Specifier, ...]

    def __post_init__(self) -> None:
        _check_structure(self.specifiers)

    @classmethod
    def parse(cls, text: str) -> "Scheme":
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            raise SchemeError("a scheme is written between brackets: '[T16 k; ...; V k]'")
        items = [item.strip() for item in body[1:-1].split(";")]
        if any(not item for item in items):
            raise SchemeError("empty specifier in scheme (doubled or trailing ';')")
        return cls(tuple(_parse_specifier(item) for item in items))

    def __str__(self) -> str:
        return "[" + "; ".join(str(s) for s in self.specifiers) + "]"

    def to_json(self) -> str:
        return str(self)

    @classmethod
    def from_json(cls, text: str) -> "Scheme":
        return cls.parse(text)

    @property
    def block(self) -> tuple[Specifier, ...]:
        """The unrolled block at the bottom (its U and V specifiers): the microkernel."""
        first = next(i for i, sp in enumerate(self.specifiers) if sp.kind in BLOCK_KINDS)
        return self.specifiers[first:]

    def microkernel_text(self) -> str:
        """The block in paper notation, e.g. ``[U beta h; U2 k; V k]``."""
        return "[" + "; ".join(str(sp) for sp in self.block) + "]"

    def validate(self, spec: ConvSpec, isa: Isa = Isa.AVX512F) -> None:
        """Raise SchemeError unless the scheme covers ``spec`` exactly and fits the
        registers of ``isa``."""
        lower(self, spec, isa)


def _check_structure(specs: tuple[Specifier, ...]) -> None:
    """Checks that need no problem size: the shape of the specifier list itself."""
    if not specs:
        raise SchemeError("empty scheme")
    for i, sp in enumerate(specs):
        if not isinstance(sp.kind, SpecKind):
            raise SchemeError(f"unknown specifier kind {sp.kind!r}")
        if sp.dim not in DIMS:
            raise SchemeError(f"'{sp}': unknown dimension {sp.dim!r} (known: {' '.join(DIMS)})")
        if sp.kind in (SpecKind.T, SpecKind.U):
            if isinstance(sp.size, bool) or not isinstance(sp.size, (int, str)):
                raise SchemeError(f"'{sp}': size must be an integer or a parameter name")
            if isinstance(sp.size, int) and sp.size < 1:
                raise SchemeError(f"'{sp}': size must be >= 1")
        elif sp.size is not None:
            raise SchemeError(f"{sp.kind.value} {sp.dim} takes no size")
        if sp.parallel and sp.kind not in LOOP_KINDS:
            raise SchemeError(f"'{sp}': only R and T loops can be parallel")
        if sp.parallel and sp.dim in REDUCTION_DIMS:
            raise SchemeError(
                f"'{sp}': {sp.dim} is a reduction dimension; parallelizing it would race "
                f"on the output")
        if sp.kind is SpecKind.LSEQ:
            if len(sp.parts) < 2:
                raise SchemeError(f"'{sp}': Lseq needs at least two (count, value) pairs")
            if any(count < 1 or value < 1 for count, value in sp.parts):
                raise SchemeError(f"'{sp}': Lseq counts and values must be >= 1")

    vectors = [i for i, sp in enumerate(specs) if sp.kind is SpecKind.V]
    if len(vectors) != 1 or vectors[0] != len(specs) - 1:
        raise SchemeError("a scheme ends with exactly one vector specifier 'V k' and has no other")
    if specs[-1].dim != "k":
        raise SchemeError(
            f"'V {specs[-1].dim}': only k can be vectorized (k is the contiguous dimension "
            f"of the weights and of the output)")
    first_unroll = next(i for i, sp in enumerate(specs) if sp.kind in BLOCK_KINDS)
    for sp in specs[first_unroll:]:
        if sp.kind not in BLOCK_KINDS:
            raise SchemeError(
                f"'{sp}' appears inside the unrolled block; U and V specifiers must be the "
                f"innermost ones")

    seen_r: set[str] = set()
    seen_lseq = False
    for sp in specs:
        if sp.kind is SpecKind.R:
            if sp.dim in seen_r:
                raise SchemeError(f"R {sp.dim} appears twice; R may appear once per dimension")
            if seen_lseq:
                raise SchemeError(f"'{sp}' after an Lseq: R loops belong above any Lseq")
            seen_r.add(sp.dim)
        seen_lseq = seen_lseq or sp.kind is SpecKind.LSEQ

    # Every Lseq binds the first parametric specifier after it along its dimension;
    # every parametric specifier is bound by exactly one Lseq.
    bound: set[int] = set()
    for i, sp in enumerate(specs):
        if sp.kind is not SpecKind.LSEQ:
            continue
        target = next((j for j in range(i + 1, len(specs))
                       if specs[j].is_parametric and specs[j].dim == sp.dim), None)
        if target is None:
            raise SchemeError(
                f"'{sp}' binds no parameter: a parametric specifier along {sp.dim} "
                f"(e.g. 'U beta {sp.dim}') must follow it")
        if target in bound:
            raise SchemeError(f"'{specs[target]}' is bound by two Lseq specifiers")
        bound.add(target)
    for j, sp in enumerate(specs):
        if sp.is_parametric and j not in bound:
            raise SchemeError(f"'{sp}': parameter {sp.size!r} is not bound by a preceding "
                              f"Lseq along {sp.dim}")

    parallel = [i for i, sp in enumerate(specs) if sp.parallel]
    if parallel:
        if parallel != list(range(parallel[0], parallel[-1] + 1)):
            raise SchemeError("parallel loops must be consecutive (one collapsed band)")
        first_lseq = next((i for i, sp in enumerate(specs) if sp.kind is SpecKind.LSEQ), len(specs))
        if parallel[-1] > first_lseq:
            raise SchemeError("the parallel band must lie above every Lseq")


# ----------------------------------------------------------------------------------
# Lowering: lambda-seq -> Seq (paper section 6.1), resolved counts, validation.


@dataclass(frozen=True)
class Block:
    """The fully unrolled, vectorized innermost block (the microkernel body).

    ``unrolls`` lists (dim, count) in scheme order; k counts vectors, so ``U2 k; V k``
    gives ("k", 2). Dimensions not listed are not unrolled.
    """

    unrolls: tuple[tuple[str, int], ...]

    def count(self, dim: str) -> int:
        total = 1
        for d, c in self.unrolls:
            if d == dim:
                total *= c
        return total

    @property
    def accumulators(self) -> int:
        return self.count("k") * self.count("n") * self.count("h") * self.count("w")

    @property
    def registers(self) -> int:
        """Live vector registers: accumulators, one weight vector per k vector, a
        broadcast."""
        return self.accumulators + self.count("k") + 1


@dataclass(frozen=True)
class Loop:
    """A loop along ``dim`` running ``count`` times, each step advancing ``step``."""

    dim: str
    count: int
    step: int
    parallel: bool
    body: "Node"


@dataclass(frozen=True)
class Seq:
    """Sequential composition along ``dim``: branch i starts at offset ``offsets[i]``."""

    dim: str
    offsets: tuple[int, ...]
    branches: tuple["Node", ...]


Node = Union[Loop, Seq, Block]


def _extents(specs: tuple[Specifier, ...], totals: dict[str, int],
             lanes: int = AVX512F.lanes) -> dict[str, int]:
    """Size of the sub-scheme ``specs`` along every dimension, computed innermost out
    (``V k`` covers ``lanes`` output channels).

    Parametric sizes must already be bound (see :func:`_bind`).
    """
    first_lseq = next((i for i, sp in enumerate(specs) if sp.kind is SpecKind.LSEQ), None)
    if first_lseq is None:
        ext, outer = {d: 1 for d in DIMS}, specs
    else:
        ext = _seq_extents(specs[first_lseq], specs[first_lseq + 1:], totals, lanes)
        outer = specs[:first_lseq]
    for sp in reversed(outer):
        if sp.kind is SpecKind.V:
            ext["k"] = lanes
        elif sp.kind in (SpecKind.T, SpecKind.U):
            ext[sp.dim] *= sp.size
        elif sp.kind is SpecKind.R:
            if totals[sp.dim] % ext[sp.dim]:
                raise SchemeError(
                    f"'{sp}': the loops inside cover {ext[sp.dim]} along {sp.dim}, which "
                    f"does not divide the problem size {totals[sp.dim]}")
            ext[sp.dim] = totals[sp.dim]
    return ext


def _seq_extents(sp: Specifier, rest: tuple[Specifier, ...],
                 totals: dict[str, int], lanes: int) -> dict[str, int]:
    """Extents of ``Lseq d [...]`` followed by ``rest``: branches add up along d only."""
    branch_exts = [_extents(_bind(rest, sp.dim, value), totals, lanes)
                   for _, value in sp.parts]
    combined = dict(branch_exts[0])
    combined[sp.dim] = sum(count * e[sp.dim] for (count, _), e in zip(sp.parts, branch_exts))
    for dim in DIMS:
        if dim != sp.dim and any(e[dim] != combined[dim] for e in branch_exts):
            sizes = ", ".join(str(e[dim]) for e in branch_exts)
            raise SchemeError(f"'{sp}': its branches cover different sizes along {dim} "
                              f"({sizes}); only {sp.dim} may differ")
    return combined


def _bind(specs: tuple[Specifier, ...], dim: str, value: int) -> tuple[Specifier, ...]:
    """S[alpha/value]: give the first parametric specifier along ``dim`` its value."""
    out = list(specs)
    for j, sp in enumerate(out):
        if sp.is_parametric and sp.dim == dim:
            out[j] = replace(sp, size=value)
            break
    return tuple(out)


def _lower_list(specs: tuple[Specifier, ...], totals: dict[str, int],
                vectors: VectorIsa) -> Node:
    sp = specs[0]
    if sp.kind in BLOCK_KINDS:
        unrolls = tuple((u.dim, u.size) for u in specs if u.kind is SpecKind.U)
        block = Block(unrolls)
        if block.registers > vectors.registers:
            raise SchemeError(
                f"unrolled block {' '.join(str(u) for u in specs)} needs {block.registers} "
                f"vector registers ({block.accumulators} accumulators + {block.count('k')} "
                f"weight vectors + 1 broadcast); {vectors.isa.value} has "
                f"{vectors.registers} ({vectors.register_name})")
        return block
    rest = specs[1:]
    if sp.kind is SpecKind.LSEQ:
        offsets, branches, offset = [], [], 0
        for count, value in sp.parts:
            bound = _bind(rest, sp.dim, value)
            step = _extents(bound, totals, vectors.lanes)[sp.dim]
            offsets.append(offset)
            branches.append(Loop(sp.dim, count, step, False,
                                 _lower_list(bound, totals, vectors)))
            offset += count * step
        return Seq(sp.dim, tuple(offsets), tuple(branches))
    step = _extents(rest, totals, vectors.lanes)[sp.dim]
    count = sp.size if sp.kind is SpecKind.T else totals[sp.dim] // step
    return Loop(sp.dim, count, step, sp.parallel, _lower_list(rest, totals, vectors))


def lower(scheme: Scheme, spec: ConvSpec, isa: Isa = Isa.AVX512F) -> Node:
    """Rewrite lambda-seq into Seq, resolve loop counts, and check ``scheme`` covers ``spec``
    with the vectors of ``isa`` (``V k`` is 16 channels in AVX-512F, 8 in AVX2).

    Raises SchemeError naming the first problem: a dimension not covered exactly, an R
    that does not divide, branches of a Seq that disagree, or a block over the register
    budget of ``isa``.
    """
    vectors = vector_isa(isa)
    totals = spec.iteration_extents(vectors.lanes)
    ext = _extents(scheme.specifiers, totals, vectors.lanes)
    for dim in DIMS:
        if ext[dim] != totals[dim]:
            what = f"{totals[dim]}" if dim != "k" else (
                f"{totals[dim]} (K={spec.k} rounded up to whole {vectors.lanes}-lane vectors)")
            raise SchemeError(f"scheme covers {ext[dim]} along {dim}, the problem needs {what}")
    return _lower_list(scheme.specifiers, totals, vectors)
