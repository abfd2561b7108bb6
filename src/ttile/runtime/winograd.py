"""When the Winograd F(4x4, 3x3) kernel serves a call, and its weights.

The direct kernels (searched, tuned here or generic) run 3x3 layers at 85-99 % of the
FMA peak, as oneDNN's and MLAS's do: past that only fewer multiplications help.
F(4x4, 3x3) (``kernels/winograd_conv.inc``, compiled for AVX-512F and for AVX2) does 36
per 4x4 output tile and channel pair where the direct method does 144. Measured against
the generic kernel of the same family on the same arrays, weights transformed
beforehand: on an AMD EPYC Zen 5 core (AVX-512F) 1.4-3.4x on the 3x3 stride-1 layers of
Fig. 8 with 32 to 512 input channels at 1 thread, 1.1-3.3x at 2 (Yolo9000-2's 32 channels
on 272x272 the least, its transforms being most of its work), and 0.6x on Yolo9000-0's 3
input channels, whose reduction is too short to amortise the transforms; on a Zen 3
core (AVX2) 2.1-3.6x at 1 thread on the same nine layers.

Its weights are 4x the layer's (36 transformed points per filter instead of 9) and the
transform runs at 5-14 GB/s, so it is made once: by ``ttile.Conv2d``, or for a per-call
``conv2d`` kept in the weight cache while the caller's array is unchanged. A per-call
call that cannot reuse them (a converted copy, an array that changes between calls, the
weight cache off) transforms them on every call only when they are small
(:data:`PER_CALL_MAX_BYTES`); larger ones are served by the direct kernels then
(``packing.call_weights``). A per-call call that can reuse them still reads them and the
caller's weights on every call, which costs more than the products save on a CPU whose
memory is slow for its FLOPs (:func:`per_call_serves`).
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from .. import _kernels
from ..core.kinds import Isa, KernelKind
from ..core.spec import ConvSpec
from ..core.vectors import extension_code
from . import settings
from .dispatch import KernelChoice
from .scratch import scratch

#: Fewest input channels per group: with 3 (Yolo9000-0) the transforms outweigh the
#: products (0.59x the generic kernel at 1 thread, Zen 5); from 32 on it won everywhere
#: measured.
MIN_CHANNELS = 16
#: Fewest output channels: one 16-lane vector.
MIN_OUTPUTS = 16
#: Fewest 4x4 output tiles (over the batch): the transformed weights, 4x the layer's, are
#: read once per call however few tiles use them. ResNet18-12 (512 channels, 7x7: 4 tiles)
#: ran at 0.96x OpenVINO pre-packed and 0.59-0.67x per call (the 38 MB of transformed
#: weights and the check of the caller's 9.4 MB against its copy from memory, Zen 5),
#: where the generic kernel reads 9.4 MB once; with 16 tiles (ResNet18-9) it won 1.4-1.8x.
MIN_TILES = 9
#: The largest weights a per-call conv2d transforms on every call when it cannot reuse
#: a transformed copy (the weight cache's threshold: the transform of 128 KB of weights
#: writes 0.5 MB, about 0.05 ms).
PER_CALL_MAX_BYTES = 128 << 10


#: A per-call call reads, on each call, the transformed weights and, to check that they
#: are still the caller's, the caller's weights and their copy: 6x the weight bytes, from
#: memory wherever other work ran in between (a network's other layers, a benchmark's
#: other contenders). Where the layer's FLOPs per byte of that traffic fall below this
#: fraction of the core's own FLOPs per byte of memory bandwidth (its FMA peak over its
#: DRAM read bandwidth), a per-call call runs a direct kernel instead. Measured on a Xeon
#: model 167 (balance 24: 242 GFLOP/s, 9.9 GB/s), in rounds that interleave eight
#: contenders: ResNet18-9 (16 FLOPs per byte) ran per call in 1.65 ms on Winograd and
#: 1.57 on the generic kernel; Yolo9000-18 (24) in 15.7 against 16.2; ResNet18-6 and -8
#: (65) 1.8-1.9x faster on Winograd. A Zen 5 (balance about 8) keeps Winograd on all
#: of them, where ResNet18-9 measured 1.4-1.8x faster on it. ``ttile.Conv2d`` keeps its
#: transformed weights and reads nothing more: it is not affected.
PER_CALL_BALANCE_FRACTION = 0.85
#: From this many FLOPs per byte, no balance is looked up: above every balance measured.
PER_CALL_ALWAYS_INTENSITY = 64.0


def per_call_intensity(spec: ConvSpec) -> float:
    """FLOPs of a per-call Winograd call per byte it reads besides the activations (the
    transformed weights, the caller's weights and the copy they are checked against)."""
    weight_bytes = 4.0 * spec.k * spec.c * spec.r * spec.s
    transformed = 4.0 * spec.k * spec.c * 36
    return spec.flops / (transformed + 2 * weight_bytes)


def per_call_serves(spec: ConvSpec, isa: Isa) -> bool:
    """Whether a per-call call of ``spec`` (one :func:`serves`) runs the Winograd kernel:
    see :data:`PER_CALL_BALANCE_FRACTION`. Where this CPU's balance is not known (no
    machine model of its microarchitecture shipped or measured into the cache by
    run-time tuning), it does."""
    intensity = per_call_intensity(spec)
    if intensity >= PER_CALL_ALWAYS_INTENSITY:
        return True
    balance = machine_balance(isa)
    return balance is None or intensity >= PER_CALL_BALANCE_FRACTION * balance


@functools.lru_cache(maxsize=4)
def machine_balance(isa: Isa) -> Optional[float]:
    """FLOPs per byte of DRAM bandwidth of one core of this CPU in the vector family
    ``isa``: its FMA peak (measured once per process, a few ms) over the DRAM read
    bandwidth of its machine model (shipped for its microarchitecture, or measured into
    the cache directory by run-time tuning); None without a model."""
    from ..core.cpuinfo import fingerprint
    from ..generator.data import DataKind, find_cpu_file, read_json
    from .cache import default_directory
    try:
        path = find_cpu_file(DataKind.MACHINE, fingerprint().id, default_directory())
        if path is None:
            return None
        dram = float(read_json(path)["bandwidths"]["dram"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if dram <= 0:
        return None
    iterations = 200_000
    code = extension_code(isa)
    peak = max(iterations * _kernels.fma_peak_flops(code)
               / _kernels.fma_peak_seconds(iterations, code) for _ in range(3))
    return peak / dram


#: The vector families with a Winograd kernel (``kernels/winograd_conv.inc``, compiled
#: for each).
FAMILIES = (Isa.AVX512F, Isa.AVX2)


def serves(spec: ConvSpec, isa: Isa, groups: int = 1) -> bool:
    """Whether the Winograd kernel serves ``spec`` (before the per-call weight rule):
    a vector family (AVX-512F or AVX2), 3x3, stride 1, no dilation, one group, at least
    MIN_CHANNELS input and MIN_OUTPUTS output channels, an output at least one tile (4x4) wide and tall and at
    least MIN_TILES tiles in all, and the Winograd kernel switched on
    (``ttile.use_winograd``)."""
    return (settings.winograd_on() and isa in FAMILIES and groups == 1
            and spec.r == 3 and spec.s == 3 and spec.stride_h == 1 and spec.stride_w == 1
            and spec.dilation_h == 1 and spec.dilation_w == 1
            and spec.c >= MIN_CHANNELS and spec.k >= MIN_OUTPUTS
            and spec.ho >= 4 and spec.wo >= 4
            and spec.n * -(-spec.ho // 4) * -(-spec.wo // 4) >= MIN_TILES)


def transform_per_call(weight_bytes: int) -> bool:
    """Whether weights of this size are transformed on every call when a per-call call
    cannot reuse a transformed copy (else a direct kernel serves that call)."""
    return weight_bytes <= PER_CALL_MAX_BYTES


def choice(spec: ConvSpec, isa: Isa) -> KernelChoice:
    """The Winograd kernel of family ``isa`` for ``spec`` (already found to be served by
    it)."""
    return KernelChoice(kind=KernelKind.WINOGRAD, problem=spec, isa=isa,
                        panel=_kernels.winograd_panel(spec.k, extension_code(isa)),
                        note="the Winograd F(4x4, 3x3) kernel (36 products per 4x4 tile "
                             "instead of 144; weights transformed once)")


def transformed(w: np.ndarray, layout: str, nthreads: int, isa: Isa,
                reuse_buffer: bool = False) -> np.ndarray:
    """The weights ``w`` (RSCK for NHWC, torch's KCRS for NCHW) transformed for the
    Winograd kernel of family ``isa`` (the families' panels differ); in this thread's
    scratch buffer with ``reuse_buffer`` (a per-call call), else in an array of their
    own."""
    kcrs = layout == "NCHW"
    code = extension_code(isa)
    c, k = (w.shape[1], w.shape[0]) if kcrs else (w.shape[2], w.shape[3])
    out = (scratch("wg", (_kernels.winograd_weight_floats(c, k, code),))
           if reuse_buffer else None)
    return _kernels.winograd_weights(w, kcrs, nthreads, out, code)
