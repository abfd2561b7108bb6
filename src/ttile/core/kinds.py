"""Enums shared across layers: which kind of kernel serves a call, which ISA it runs.

They subclass ``str`` so that values read from JSON, the C registry or a user's
``set_isa("avx512f")`` compare equal to them, and so that ``ttile.plan(...).kind`` keeps
reading ``"tuned"`` for code written against the string API.
"""
from __future__ import annotations

from enum import Enum, IntFlag


class GenericBlocking(IntFlag):
    """How the vector generic kernel splits its work where the default blocking, chosen
    for weights in the caches, may lose to another with weights coming from memory (a
    network's context verdict, ``routes.alternatives``). The values are the kernel's
    flags (``kernels/ttile_runtime.h``)."""

    DEFAULT = 0
    #: each thread takes whole panel groups (its share of the weights) even where all
    #: the panels fit in its L2 and it would take whole rows (reading all of them)
    GROUPS_FIRST = 16
    #: panel groups of half the cache blocking: the first group, read before anything
    #: streams it in, is half as large
    SMALL_GROUPS = 32


class KernelKind(str, Enum):
    """What serves a convolution."""

    #: searched offline and compiled into the extension (``kernels/gen``)
    TUNED = "tuned"
    #: searched on this machine at run time and loaded from the disk cache
    JIT = "jit"
    #: the hand-written generic kernel (AVX-512F, or portable C)
    GENERIC = "generic"
    #: the depthwise kernel (groups == channels, one output channel per group)
    DEPTHWISE = "depthwise"
    #: the grouped kernel (2, 4, 8 or 16 channels a group, as many in as out: the output
    #: channels of several groups in the vector lanes; ResNeXt's grouped layers)
    GROUPED = "grouped"
    #: the NCHW 1x1 kernel (stride 1, no padding, one group: a matrix product per image
    #: in torch's layout)
    POINTWISE = "pointwise"
    #: the Winograd F(4x4, 3x3) kernel, or F(2x2, 3x3) on small maps (3x3, stride 1, one
    #: group: 4x or 2.25x fewer multiplications than the direct kernels, on weights
    #: transformed once)
    WINOGRAD = "winograd"
    #: the AMX bf16 kernel (``precision="bf16"`` on a CPU with AMX-BF16)
    AMX = "amx"
    #: the AVX512_BF16 kernel (vdpbf16ps: ``precision="bf16"`` on a CPU without AMX)
    DOT_BF16 = "avx512_bf16"

    def __str__(self) -> str:
        return self.value


class Precision(str, Enum):
    """What a convolution multiplies: fp32 values, or bf16 values (inputs and weights
    rounded to nearest even) with products accumulated in fp32 and the epilogue in fp32.
    The element type is a parameter of the pipeline, not a fork of it: the packed formats
    and kernels it selects are in ``ttile.runtime.bf16``."""

    FP32 = "fp32"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


class Isa(str, Enum):
    """Kernel families, as ``ttile.set_isa`` names them: AUTO picks the first this CPU
    runs of AVX512F (AVX-512F + FMA), AVX2 (AVX2 + FMA) and PORTABLE (baseline C)."""

    AUTO = "auto"
    AVX512F = "avx512f"
    AVX2 = "avx2"
    PORTABLE = "portable"

    @property
    def vector(self) -> bool:
        """A family of vector kernels (packed weight panels, the generic kernel's tiles)."""
        return self in (Isa.AVX512F, Isa.AVX2)

    def __str__(self) -> str:
        return self.value


class Activation(str, Enum):
    """The activations a kernel can fuse into its output store: y = act(conv + bias +
    residual). ``code`` is the kernels' number for it (kernels/ttile_epilogue.h)."""

    NONE = "none"
    RELU = "relu"
    RELU6 = "relu6"
    LEAKY_RELU = "leaky_relu"
    SILU = "silu"
    SIGMOID = "sigmoid"

    @property
    def code(self) -> int:
        return _ACTIVATION_CODES[self]

    def __str__(self) -> str:
        return self.value


_ACTIVATION_CODES = {Activation.NONE: 0, Activation.RELU: 1, Activation.RELU6: 2,
                     Activation.LEAKY_RELU: 3, Activation.SILU: 4, Activation.SIGMOID: 5}


class SetMatch(str, Enum):
    """How the kernel set serving this CPU was matched to it."""

    EXACT = "exact"                          # measured on a CPU with this fingerprint
    MICROARCHITECTURE = "microarchitecture"  # same vendor, family and model, another VM
    NONE = "none"                            # no set of this vector family for this core
