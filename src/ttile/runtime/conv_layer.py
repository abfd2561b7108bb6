"""``ttile.Conv2d``: a convolution with fixed weights, packed once.

``conv2d`` converts and packs the weights on every call because it cannot know they
repeat; a network layer's weights do, and packing Yolo9000-23's 115 MB per call costs
more than some layers' whole convolution. Conv2d keeps the weights in RSCK once and the
packed panels per panel width a kernel asks for (the generic kernel's, each tuned or
JIT kernel's own), made on first use and shared by every later call and thread.
"""
from __future__ import annotations

import threading
from typing import Optional, Union

import numpy as np

from .. import _kernels
from .api import (IntPair, _as_float32, _as_pair, _choice, _execute, _padding, _plan,
                  _threads)


class Conv2d:
    """Callable convolution with fixed weights (no bias), like ``torch.nn.Conv2d``.

    Args:
        w: weights, (K, C, R, S) for layout "NCHW" or (R, S, C, K) for "NHWC".
        stride, padding, layout: as for :func:`ttile.conv2d`.
        threads: default thread count of calls (None: all CPUs this process may use).

    ``layer(x)`` (or ``layer(x, threads=n)``) returns ``conv2d(x, w, ...)``. The weights
    are copied: changing the array passed in later does not change the layer. Calls
    from several threads at once are safe; the kernel runs without the GIL.
    """

    def __init__(self, w, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
                 layout: str = "NCHW", threads: Optional[int] = None):
        weights = _as_float32(w, "weights")
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if weights.ndim != 4:
            expected = "(K, C, R, S)" if layout == "NCHW" else "(R, S, C, K)"
            raise ValueError(f"weights must have 4 dimensions {expected}, got "
                             f"{weights.ndim}: shape {weights.shape}")
        if 0 in weights.shape:
            raise ValueError(f"zero-size dimension in weights {weights.shape}")
        if layout == "NCHW":
            rsck = _kernels.pack_weights_kcrs(weights, 0, _threads(None))
        else:
            rsck = weights.copy()
        rsck.flags.writeable = False
        # Stride and padding are checked now, so a bad layer fails where it is made.
        _padding(padding, rsck.shape[0], rsck.shape[1], _as_pair(stride, "stride", 1))
        self._rsck = rsck
        self._w_shape = tuple(weights.shape)
        self.stride = stride
        self.padding = padding
        self.layout = layout
        self.threads = None if threads is None else _threads(threads)
        self._packed: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """Shape of the weights as given (in the layer's layout)."""
        return self._w_shape

    def _weights_for(self, panel: int) -> np.ndarray:
        if panel == 0:
            return self._rsck
        packed = self._packed.get(panel)
        if packed is None:
            with self._lock:
                packed = self._packed.get(panel)
                if packed is None:
                    packed = _kernels.pack_weights(self._rsck, panel, _threads(None))
                    packed.flags.writeable = False
                    self._packed[panel] = packed
        return packed

    def __call__(self, x, threads: Optional[int] = None) -> np.ndarray:
        x_arr = _as_float32(x, "input")
        plan = _plan(x_arr.shape, self._w_shape, self.stride, self.padding, self.layout)
        if threads is None:
            threads = self.threads
        nthreads = plan.fit(_threads(threads))
        choice = _choice(plan, nthreads, per_call=False)
        return _execute(plan, choice, x_arr, self._weights_for(choice.panel), nthreads)

    def __repr__(self) -> str:
        return (f"ttile.Conv2d(weights {self._w_shape}, stride={self.stride!r}, "
                f"padding={self.padding!r}, layout={self.layout!r})")
