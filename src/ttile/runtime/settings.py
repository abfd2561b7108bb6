"""Process-wide settings every call reads: the vector family that serves calls and
whether the kernels compiled into the wheel serve at all.

The CPU's abilities are read once at import (cpuid through the extension): they decide
what may run. ``set_isa`` may only narrow them, so asking for a family the CPU cannot run
fails here rather than as an illegal instruction later.
"""
from __future__ import annotations

import os
from typing import Optional, Union

from .. import _kernels
from ..core.kinds import Isa

_HAS_AVX512F = _kernels.cpu_has_avx512f()
_HAS_AVX2 = _kernels.cpu_has_avx2()
#: Which kernel family serves calls: Isa.AUTO (the best this CPU runs), AVX512F, AVX2 or
#: PORTABLE. Change it with :func:`set_isa`, or before import with $TTILE_ISA.
_isa = Isa.AUTO
_use_tuned = True
_use_winograd = os.environ.get("TTILE_WINOGRAD", "1").strip() not in ("0", "off", "no")
#: Bumped by every change that can change which kernel serves a call (the family, tuned
#: kernels on or off, the CPU whose set serves): a call plan's remembered choices carry
#: the generation they were made in and are not used in another.
_generation = 0


def generation() -> int:
    """The current settings generation (see ``_generation``)."""
    return _generation


def invalidate_choices() -> None:
    """Make every remembered kernel choice stale: the next call of each problem chooses
    again."""
    global _generation
    _generation += 1


def use_tuned_kernels(enabled: bool) -> bool:
    """Serve registry problems with their tuned kernels (default) or always with the
    generic one (for comparisons and tests); returns the previous setting."""
    global _use_tuned
    previous, _use_tuned = _use_tuned, bool(enabled)
    invalidate_choices()
    return previous


def use_winograd(enabled: bool) -> bool:
    """Let the Winograd kernels (F(4x4, 3x3), F(2x2, 3x3) on small maps) serve the 3x3
    stride-1 layers they win on (default; $TTILE_WINOGRAD=0 turns them off at import), or
    serve those with the direct kernels only, whose rounding is the plain sum's; returns
    the previous setting."""
    global _use_winograd
    previous, _use_winograd = _use_winograd, bool(enabled)
    invalidate_choices()
    return previous


def winograd_on() -> bool:
    """Whether the Winograd kernel may serve calls."""
    return _use_winograd


def tuned_kernels_on() -> bool:
    """Whether searched kernels (compiled in or tuned here) may serve calls."""
    return _use_tuned


def has_avx512f() -> bool:
    """True when this CPU and OS can run the AVX-512F kernels."""
    return _HAS_AVX512F


def has_avx2() -> bool:
    """True when this CPU and OS can run the AVX2 + FMA kernels."""
    return _HAS_AVX2


def set_isa(isa: Union[str, Isa]) -> Isa:
    """Choose the kernel family: "auto", "avx512f", "avx2" or "portable" (or an
    :class:`Isa`); returns the previous one.

    "avx2" runs the AVX2 family on an AVX-512 machine too (for tests, and to measure what
    a CPU without AVX-512 gets). Asking for a family the CPU cannot run raises instead of
    crashing later. $TTILE_ISA sets the same at import.
    """
    global _isa
    try:
        chosen = Isa(isa)
    except ValueError:
        raise ValueError(f"isa must be one of {', '.join(repr(i.value) for i in Isa)}, "
                         f"got {isa!r}") from None
    if chosen is Isa.AVX512F and not _HAS_AVX512F:
        raise ValueError("this CPU (or OS) does not support AVX-512F")
    if chosen is Isa.AVX2 and not _HAS_AVX2:
        raise ValueError("this CPU (or OS) does not support AVX2 with FMA")
    previous, _isa = _isa, chosen
    invalidate_choices()
    return previous


def get_isa() -> Isa:
    """The kernel family calls use now: Isa.AVX512F, Isa.AVX2 or Isa.PORTABLE (equal to
    the strings "avx512f", "avx2" and "portable")."""
    if _isa is Isa.AUTO:
        return Isa.AVX512F if _HAS_AVX512F else Isa.AVX2 if _HAS_AVX2 else Isa.PORTABLE
    return _isa


def layout_isa() -> Optional[int]:
    """The layout conversions' and weight packers' ISA code: the tiles of the family
    calls use (a call held to AVX2 runs no AVX-512 instruction anywhere: AVX2 tiles), and
    portable C in the portable family."""
    isa = get_isa()
    return (None if isa is Isa.AVX512F else _kernels.ISA_AVX2 if isa is Isa.AVX2
            else _kernels.ISA_PORTABLE)


def _isa_from_environment() -> None:
    """$TTILE_ISA (auto, avx512f, avx2, portable): the family for this process."""
    value = os.environ.get("TTILE_ISA", "").strip().lower()
    if value:
        try:
            set_isa(value)
        except ValueError as exc:
            raise ImportError(f"TTILE_ISA={value!r}: {exc}") from None


_isa_from_environment()
