"""Enums shared across layers: which kind of kernel serves a call, which ISA it runs.

They subclass ``str`` so that values read from JSON, the C registry or a user's
``set_isa("avx512f")`` compare equal to them, and so that ``ttile.plan(...).kind`` keeps
reading ``"tuned"`` for code written against the string API.
"""
from __future__ import annotations

from enum import Enum


class KernelKind(str, Enum):
    """What serves a convolution."""

    #: searched offline and compiled into the extension (``kernels/gen``)
    TUNED = "tuned"
    #: searched on this machine at run time and loaded from the disk cache
    JIT = "jit"
    #: the hand-written generic kernel (AVX-512F, or portable C)
    GENERIC = "generic"

    def __str__(self) -> str:
        return self.value


class Isa(str, Enum):
    """Kernel families, as ``ttile.set_isa`` names them."""

    AUTO = "auto"
    AVX512F = "avx512f"
    PORTABLE = "portable"

    def __str__(self) -> str:
        return self.value
