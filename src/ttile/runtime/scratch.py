"""Per-thread scratch buffers for what a call needs only while it runs.

A per-call ``conv2d`` packs its weights, and an NCHW call converts its input and output,
into temporary arrays. Fresh arrays of megabytes cost page faults on every call (the OS
zeroes each new page: 9.4 MB of ResNet18-12 weights took longer to fault in than to
pack); these buffers are allocated once per thread and reused. Each Python thread has its
own (``threading.local``), so concurrent calls never share one, and nothing a call
returns lives in them. Buffers larger than :data:`MAX_BYTES` are not kept.
"""
from __future__ import annotations

import math
import threading
from typing import Optional

import numpy as np

from .. import _kernels

#: Largest buffer kept per slot and thread; larger requests get a fresh array each call.
MAX_BYTES = 128 << 20


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.slots: dict[str, np.ndarray] = {}


_local = _Buffers()


def scratch(slot: str, shape: tuple[int, ...]) -> Optional[np.ndarray]:
    """A float32 array of ``shape`` that this thread's later calls reuse under ``slot``
    (its contents are garbage), or None when it would exceed :data:`MAX_BYTES`."""
    size = math.prod(shape)
    if 4 * size > MAX_BYTES:
        return None
    buffer = _local.slots.get(slot)
    if buffer is None or buffer.size < size:
        buffer = _kernels.empty_aligned((size,))   # on a line, like every output
        _local.slots[slot] = buffer
    return buffer[:size].reshape(shape)


def aligned_empty(shape: tuple[int, ...], line_of: Optional[np.ndarray] = None) -> np.ndarray:
    """A new output of ``shape`` on a 64-byte line (see ``_kernels.empty_aligned``; past
    32 MiB in memory an earlier output gave back, ``_kernels.RECYCLE_MIN_BYTES``): the
    kernels' vector stores then never span two lines, and those that stream whole lines
    past the caches (non-temporal stores of large outputs) can. With ``line_of``, as far
    into a line as that array starts (for the NHWC depthwise kernel, whose stores follow
    its input's lines)."""
    return _kernels.empty_aligned(tuple(shape), line_of)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy of ``a`` on a 64-byte line: what a layer keeps of its
    weights. numpy's copy of a large array starts 16 or 48 bytes into a line, and a
    kernel reading RSCK as its panel (64 output channels and a 64-wide panel) or a
    family's own format from it splits every vector load over two lines: ResNet-50's
    56x56 1x1 256->64 layer ran 1.14x slower from numpy's copy than from this one
    (Xeon model 167, 1 thread)."""
    out = aligned_empty(a.shape)
    out[...] = a
    return out


def release() -> None:
    """Drop this thread's buffers and the memory kept for large outputs (tests, or a
    thread done with large layers)."""
    _local.slots.clear()
    _kernels.release_recycled()
