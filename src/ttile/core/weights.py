"""Weights in the formats the kernels read, from RSCK ((R, S, C, K); (R, S, C/groups, K)
for a grouped layer): one place for what both the tuner's measurements and the calls
hand a kernel, so that a kernel is timed on exactly the weights it is later served.

* Panels (``pack_panels``): the searched and generic kernels' K split into panels of
  ``panel`` outputs, [ceil(K / panel)][R][S][C][panel] (``ConvSpec.packed_weight_shape``),
  a grouped problem's groups one after the other.
* Blocks (``grouped_blocks``): the grouped kernel's (``kernels/grouped_avx512.c``) 16
  output channels' taps and steps contiguous.
"""
from __future__ import annotations

import numpy as np

from .. import _kernels
from .spec import ConvSpec


def pack_panels(w: np.ndarray, spec: ConvSpec, panel: int, nthreads: int = 1) -> np.ndarray:
    """RSCK weights of ``spec`` in panels of ``panel`` output channels (``_kernels.
    pack_weights``); a grouped problem's group by group, each group's panels after the
    previous group's."""
    if spec.groups == 1:
        return _kernels.pack_weights(w, panel, nthreads)
    k, per = spec.k, -(-spec.k // panel)
    out = _kernels.empty_aligned(spec.packed_weight_shape(panel))   # on a line, as one group's
    for g in range(spec.groups):
        part = out[g * per:(g + 1) * per]
        packed = _kernels.pack_weights(np.ascontiguousarray(w[..., g * k:(g + 1) * k]), panel,
                                       nthreads, part)
        if packed is not part:   # a panel as wide as the group: its RSCK, given as a view
            part[...] = packed
    return out


def grouped_blocks(rsck: np.ndarray) -> np.ndarray:
    """The grouped kernel's weights, (K/16, R, S, cg * 16), on a cache line: each block of
    16 output channels' taps and steps contiguous (read in place from RSCK, a step's 16
    weights were K floats apart: the block's 16 steps fell in two L1 sets on 512-channel
    layers)."""
    r, s, cg, k = rsck.shape
    out = _kernels.empty_aligned((k // 16, r, s, cg * 16))
    out[...] = rsck.reshape(r, s, cg, k // 16, 16).transpose(3, 0, 1, 2, 4).reshape(
        k // 16, r, s, cg * 16)
    return out
