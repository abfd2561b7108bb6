"""When the Winograd kernel serves a call, with which output tile, and its weights.

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

On maps too small for enough 4x4 tiles (7x7: 4), F(2x2, 3x3) serves instead: 16
products per 2x2 tile where the direct method does 36, weights 16/9 of the layer's, and
each transformed weight used by 4x as many tiles (:data:`F2_MIN_TILES`). It serves
layers that keep their weights packed (``ttile.Conv2d``, converted models); a per-call
call there runs the direct kernel (``routes._family_choice``).

F(4x4)'s weights are 4x the layer's (36 transformed points per filter instead of 9) and the
transform runs at 5-14 GB/s, so it is made once: by ``ttile.Conv2d``, or for a per-call
``conv2d`` kept in the weight cache while the caller's array is unchanged. A per-call
call that cannot reuse them (a converted copy, an array that changes between calls, the
weight cache off) transforms them on every call only when they are small
(:data:`PER_CALL_MAX_BYTES`); larger ones are served by the direct kernels then
(``packing.call_weights``).
"""
from __future__ import annotations

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
#: Fewest 2x2 output tiles for F(2x2, 3x3), which serves the maps of fewer than
#: MIN_TILES 4x4 tiles (one 7x7 or 8x8 image: 4 tiles of 4x4, 16 of 2x2): its weights
#: are 16/9 of the layer's, not 4x. Xeon model 167, µs at 1 thread (2), warm / after a
#: cache flush, against the generic kernel: 7x7 256->256 326 / 372 against 369 / 457
#: (173 / 387 against 240 / 493); 7x7 128->128 69 / 161 against 85 / 251. Where F(4x4)
#: serves it stays: on 14x14 256->256 (16 4x4 tiles) F(2x2) took 800-820 against
#: 737-756; on 10x10 128->128 (9) 99 / 199 against 129 / 204, one layer, not enough to
#: move the line.
F2_MIN_TILES = 16
#: The largest transformed weights F(2x2, 3x3) serves with. ResNet-50's 7x7 512->512
#: (16.8 MB transformed, 9.4 MB as they are) ran 1.2-1.3x faster than the generic kernel
#: alone, warm or after a cache flush, but no faster inside the network at 1 thread and
#: 1.09x slower at 2: there the layer's weights come from memory, and F(2x2) reads 1.8x
#: as many.
F2_MAX_WEIGHT_BYTES = 8 << 20
#: The largest weights a per-call conv2d transforms on every call when it cannot reuse
#: a transformed copy (the weight cache's threshold: the transform of 128 KB of weights
#: writes 0.5 MB, about 0.05 ms).
PER_CALL_MAX_BYTES = 128 << 10


#: The vector families with a Winograd kernel (``kernels/winograd_conv.inc``, compiled
#: for each).
FAMILIES = (Isa.AVX512F, Isa.AVX2)


def tiles(spec: ConvSpec, tile: int) -> int:
    """Output tiles of ``tile`` x ``tile`` pixels a call of ``spec`` computes (over the
    batch; the last row and column of tiles may stick out of the output)."""
    return spec.n * -(-spec.ho // tile) * -(-spec.wo // tile)


def tile_for(spec: ConvSpec) -> int:
    """The output tile of the Winograd kernel for ``spec``: 4, or 2 on maps of fewer than
    :data:`MIN_TILES` 4x4 tiles (see ``kernels/winograd_conv.inc``)."""
    return 4 if tiles(spec, 4) >= MIN_TILES else 2


def serves(spec: ConvSpec, isa: Isa, groups: int = 1) -> bool:
    """Whether the Winograd kernel serves ``spec`` (before the per-call weight rule):
    a vector family (AVX-512F or AVX2), 3x3, stride 1, no dilation, one group, at least
    MIN_CHANNELS input and MIN_OUTPUTS output channels, an output at least 4 pixels wide
    and tall with at least MIN_TILES tiles of 4x4 (F(4x4, 3x3)) or F2_MIN_TILES of 2x2
    (F(2x2, 3x3), with at most F2_MAX_WEIGHT_BYTES of transformed weights) in all, and
    the Winograd kernel switched on (``ttile.use_winograd``). No padding wider than 2
    (the filter less one): an output whose window holds padding alone is exactly 0, and
    a Winograd tile would give it the rounding of its transforms of the tile's other
    inputs instead (4.5e-8 on a 1x1 input padded by 3, found by the random shapes)."""
    return (settings.winograd_on() and isa in FAMILIES and groups == 1
            and spec.r == 3 and spec.s == 3 and spec.stride_h == 1 and spec.stride_w == 1
            and spec.dilation_h == 1 and spec.dilation_w == 1
            and max(spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right) <= 2
            and spec.c >= MIN_CHANNELS and spec.k >= MIN_OUTPUTS
            and spec.ho >= 4 and spec.wo >= 4
            and (tiles(spec, 4) >= MIN_TILES or f2_serves(spec)))


def transform_per_call(weight_bytes: int) -> bool:
    """Whether weights of this size are transformed on every call when a per-call call
    cannot reuse a transformed copy (else a direct kernel serves that call)."""
    return weight_bytes <= PER_CALL_MAX_BYTES


def f2_serves(spec: ConvSpec) -> bool:
    """Whether F(2x2, 3x3) may serve ``spec`` (one that :func:`serves`): enough 2x2 tiles
    and at most F2_MAX_WEIGHT_BYTES of transformed weights. On maps with enough 4x4 tiles
    it is the alternative a network's context verdict weighs against F(4x4)
    (``routes.alternatives``): 16/9 of the layer's weights to read instead of 4x."""
    return (tiles(spec, 2) >= F2_MIN_TILES
            and 4 * 16 * spec.c * spec.k <= F2_MAX_WEIGHT_BYTES)


def choice(spec: ConvSpec, isa: Isa, tile: int = 0) -> KernelChoice:
    """The Winograd kernel of family ``isa`` for ``spec`` (already found to be served by
    it), with output ``tile`` (0: :func:`tile_for`'s)."""
    tile = tile or tile_for(spec)
    note = ("the Winograd F(4x4, 3x3) kernel (36 products per 4x4 tile instead of 144; "
            "weights transformed once)" if tile == 4 else
            "the Winograd F(2x2, 3x3) kernel (16 products per 2x2 tile instead of 36; "
            "weights transformed once)")
    return KernelChoice(kind=KernelKind.WINOGRAD, problem=spec, isa=isa,
                        panel=_kernels.winograd_panel(spec.k, extension_code(isa)),
                        note=note, tile=tile)


def transformed(w: np.ndarray, layout: str, nthreads: int, isa: Isa,
                reuse_buffer: bool = False, tile: int = 4) -> np.ndarray:
    """The weights ``w`` (RSCK for NHWC, torch's KCRS for NCHW) transformed for the
    Winograd kernel of family ``isa`` and output ``tile`` (the families' panels and the
    tiles' points differ); in this thread's scratch buffer with ``reuse_buffer`` (a
    per-call call), else in an array of their own."""
    kcrs = layout == "NCHW"
    code = extension_code(isa)
    c, k = (w.shape[1], w.shape[0]) if kcrs else (w.shape[2], w.shape[3])
    out = (scratch("wg", (_kernels.winograd_weight_floats(c, k, code, tile),))
           if reuse_buffer else None)
    return _kernels.winograd_weights(w, kcrs, nthreads, out, code, tile)
