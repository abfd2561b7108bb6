"""The vector ISAs kernels are generated for, as the pipeline needs to know them.

The TTile method is not tied to one ISA: a microkernel is an outer product of ``alpha``
weight vectors by ``beta`` broadcast inputs held in registers, and only three facts of
the ISA enter the search and the code: how many fp32 lanes a vector has (the width of
``V k`` and of a weight panel), how many vector registers there are (the budget every
block is checked against: ``alpha * beta + alpha + 1``), and how the C spells a vector.
Each generated kernel belongs to one family; its name ends with the family
(``__avx512f`` / ``__avx2``), its file is compiled with that family's flags only, and
its tuning records, microkernel table and registry entries are kept per family.
"""
from __future__ import annotations

from dataclasses import dataclass

from .kinds import Isa


@dataclass(frozen=True)
class VectorIsa:
    """One vector family of generated kernels."""

    isa: Isa
    lanes: int                  # fp32 lanes per vector
    registers: int              # architectural vector registers
    cflags: tuple[str, ...]     # what a file of this family is compiled with
    vector_type: str            # the C type of a vector
    prefix: str                 # of the intrinsics: _mm512_fmadd_ps, _mm256_fmadd_ps
    register_name: str          # in messages: zmm, ymm

    @property
    def suffix(self) -> str:
        """What ends the names of its kernels and files (``__avx512f``)."""
        return f"__{self.isa.value}"


#: AVX-512F + FMA: 16 lanes, zmm0-zmm31, masked loads and stores for K tails.
AVX512F = VectorIsa(Isa.AVX512F, 16, 32, ("-mavx512f", "-mfma"), "__m512", "_mm512", "zmm")
#: AVX2 + FMA: 8 lanes, ymm0-ymm15, vmaskmovps for K tails (no mask registers).
AVX2 = VectorIsa(Isa.AVX2, 8, 16, ("-mavx2", "-mfma"), "__m256", "_mm256", "ymm")

_BY_ISA = {Isa.AVX512F: AVX512F, Isa.AVX2: AVX2}
#: The vector families in the order run-time dispatch prefers them.
VECTOR_ISAS: tuple[VectorIsa, ...] = (AVX512F, AVX2)


def vector_isa(isa: Isa | str) -> VectorIsa:
    """The family of ``isa`` (an :class:`Isa` or its name); ValueError for a family
    that has no generated kernels (portable, auto)."""
    try:
        return _BY_ISA[Isa(isa)]
    except (KeyError, ValueError):
        raise ValueError(f"no generated kernels for ISA {isa!r}: one of "
                         f"{', '.join(v.isa.value for v in VECTOR_ISAS)}") from None


_EXTENSION_CODES: dict = {}


def extension_code(isa: Isa | str) -> int:
    """The extension's number (``_kernels.ISA_AVX512F`` / ``ISA_AVX2``) of a vector
    family's kernels: what the generic kernel, the FMA-peak and bandwidth benchmarks take.
    Remembered per argument: every kernel call asks (the import and the family lookup
    were about a microsecond of each converted layer's call)."""
    code = _EXTENSION_CODES.get(isa)
    if code is None:
        from .. import _kernels
        code = _kernels.ISA_AVX2 if vector_isa(isa) is AVX2 else _kernels.ISA_AVX512F
        _EXTENSION_CODES[isa] = code
    return code


def family_stem(cpu_id: str, isa: Isa | str = Isa.AVX512F) -> str:
    """The name (less its extension) of a CPU's per-family data file: the CPU id for
    AVX-512F, as before there were two families, ``<cpu-id>.avx2`` for AVX2. Tuning
    records and microkernel tables are named this way."""
    family = vector_isa(isa)
    return cpu_id if family is AVX512F else f"{cpu_id}.{family.isa.value}"


def parse_family_stem(stem: str) -> tuple[str, Isa]:
    """(CPU id, vector family) of a per-family data file's name (less its extension)."""
    cpu_id, dot, family = stem.rpartition(".")
    if dot and family in (v.isa.value for v in VECTOR_ISAS if v is not AVX512F):
        return cpu_id, Isa(family)
    return stem, Isa.AVX512F
