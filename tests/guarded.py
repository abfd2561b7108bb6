"""Arrays fenced by inaccessible pages, to make any out-of-bounds access fault.

``guarded_copy(a, "end")`` returns a copy of ``a`` whose last byte is the last byte of a
read/write page followed by a ``PROT_NONE`` page, so reading or writing one element
past the end raises SIGSEGV; ``"start"`` places the first byte right after a
``PROT_NONE`` page instead. The bytes between the mapping's other edge and the array
(less than a page, plus one spare page) are a canary region filled with a known pattern:
:func:`canary_intact` says whether a kernel wrote there.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_NONE = 0
CANARY_BYTE = 0xA5

# Mappings must outlive their arrays; arrays keep a reference through .base, but the
# guard page must not be unmapped while numpy still points next to it, so the maps are
# also kept here (a test process makes a bounded number of them).
_keep: list[mmap.mmap] = []


class Guarded:
    """An array placed against a guard page, with the mapping and canary around it."""

    def __init__(self, source: np.ndarray, side: str):
        if side not in ("end", "start"):
            raise ValueError(side)
        source = np.ascontiguousarray(source)
        nbytes = source.nbytes
        data_pages = -(-nbytes // PAGE) + 1  # one spare page of canary
        self.map = mmap.mmap(-1, (data_pages + 1) * PAGE)
        _keep.append(self.map)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        raw = np.frombuffer(self.map, dtype=np.uint8)
        raw[:] = CANARY_BYTE
        if side == "end":
            guard_at, offset = data_pages * PAGE, data_pages * PAGE - nbytes
            self.canary = (0, offset)
        else:
            guard_at, offset = 0, PAGE
            self.canary = (PAGE + nbytes, (data_pages + 1) * PAGE)
        if _libc.mprotect(ctypes.c_void_p(base + guard_at), PAGE, _PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self._raw = raw
        self.array = np.frombuffer(self.map, dtype=source.dtype, count=source.size,
                                   offset=offset).reshape(source.shape)
        self.array[...] = source

    def canary_intact(self) -> bool:
        lo, hi = self.canary
        return bool((self._raw[lo:hi] == CANARY_BYTE).all())


def guarded_copy(a: np.ndarray, side: str) -> Guarded:
    return Guarded(a, side)
