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
        buffer = np.empty(size, np.float32)
        _local.slots[slot] = buffer
    return buffer[:size].reshape(shape)


#: Outputs from this size on are allocated on a 64-byte line (see :func:`aligned_empty`):
#: those the kernels stream to memory (``ttile.core.codegen.NCHW_STREAM_BYTES``).
ALIGNED_OUTPUT_BYTES = 8 << 20


def line_aligned(shape: tuple[int, ...]) -> np.ndarray:
    """A new float32 array of ``shape`` starting on a 64-byte line (numpy gives large
    arrays 16-byte alignment): kernels stream whole lines past the caches (non-temporal
    stores) only on aligned lines."""
    size = math.prod(shape)
    buffer = np.empty(size + 16, np.float32)
    start = (-buffer.ctypes.data % 64) // 4
    return buffer[start:start + size].reshape(shape)


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """A new output of ``shape``: :func:`line_aligned` when it is large enough to be
    streamed, else plain ``np.empty`` (finding the address costs a microsecond)."""
    if 4 * math.prod(shape) < ALIGNED_OUTPUT_BYTES:
        return np.empty(shape, np.float32)
    return line_aligned(shape)


def release() -> None:
    """Drop this thread's buffers (tests, or a thread done with large layers)."""
    _local.slots.clear()
