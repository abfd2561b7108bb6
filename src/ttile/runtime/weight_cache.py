"""Packed weights of per-call ``conv2d`` calls, reused while the caller's array is unchanged.

A per-call ``conv2d`` hands its kernel the weights in the kernel's format (panels), so
each call packs them again. On one or two cores that is a pass at memory speed; on many
it is worse than its bytes suggest: the threads that pack write lines that other cores'
kernel threads then read, and every call moves them back (ResNet18-10's 9.4 MB at 16
threads on a Xeon: 0.33 ms of packing against 0.53 ms of convolution).

This cache keeps, for the most recently used weight arrays, the packed weights. A later
call whose weights hold exactly what they were packed from runs on them as a
:class:`ttile.Conv2d` would. The check reads everything, in parallel, bit for bit: RSCK
weights (an NHWC call) against the panels themselves, whose rows are RSCK's rows cut
into panels (``_kernels.packed_matches``: nothing more is kept, and the panels the
kernel reads next are in cache); torch's KCRS weights (an NCHW call), which packing
transposes, against a private copy of the bytes packed (``_kernels.same_bytes``). The
check only reads, so on many cores both arrays stay in the caches of the threads that
compare them. A caller
that changes a single bit of its weights gets them packed again, so the cache is never
wrong, only sometimes useless: an array found changed on two calls is not cached any
more (a training loop would pay for packing, and copying, on every call for nothing).

It pays on many threads, and where a kernel's weights are packed in a pass of their
own (an NHWC call on a searched kernel); ``packing.call_weights`` uses it there only. Paired
with it off, per-call NHWC calls took on a 16-core Xeon (model 207) 0.66-1.00 of the time
at 16 threads, 0.79-1.02 at 8, but 0.96-1.11 at 4, 0.89-1.14 at 2 and 0.95-1.30 at 1
(ResNet18-9/-10/-11/-12, Yolo9000-18/-19: on few cores the check reads the weights and
the panels from memory, where the generic kernel's threads read the weights once and
pack the panels they use as they go), except ResNet18-11, whose searched kernel packs in
a pass of its own: 0.86-0.95 at every thread count (0.34-0.71 at 2 threads on a Zen 4).
Checking against the panels took 0.81-1.05 of the time of checking against a copy on
that Xeon (0.98-1.08 on the Zen 4), and half the memory: so it is done for RSCK.

A bf16 call's packed weights hold the weights rounded to bf16, and the kernel reads
nothing else: the cache keeps a bf16 copy of the rounded weights and compares the
caller's array, rounded, with it (:attr:`Check.BF16`), so a change the rounding hides
keeps the packing, and a caller's bf16 weights (``ml_dtypes.bfloat16``) are cached too.

Only the caller's own C-contiguous float32 (and, for bf16 calls, bfloat16) arrays are
cached (a converted copy is new on every call), and only weights of at least
:data:`MIN_BYTES`; the cache holds at most ``max_bytes`` (copies and packed weights
together, least recently used dropped first; ``ttile.set_weight_cache``). Thread-safe: entries are never written after they are made.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Hashable, Optional

import numpy as np

from .. import _kernels
from .scratch import aligned_copy

#: Weights smaller than this are packed per call: it takes microseconds.
MIN_BYTES = 128 << 10
#: From this many threads on, every dense per-call call reuses (see the module text).
MIN_THREADS = 8
#: Default bound of the cache (copies and packed weights together).
DEFAULT_MAX_BYTES = 256 << 20
#: An array found changed this many times is not cached again.
MAX_CHANGES = 2
#: Keys remembered as changing (oldest forgotten first).
MAX_VOLATILE = 256


class Check(Enum):
    """How a later call's weights are compared with what was packed."""

    #: RSCK fp32 weights against the panels themselves (their rows cut into panels).
    PANELS = "panels"
    #: Against a private copy of the bytes packed (weights packing transposes or transforms).
    COPY = "copy"
    #: Rounded to bf16, against a private copy of the bf16 values packed: a bf16 kernel
    #: reads nothing else, so a change the rounding hides needs no new packing, and the
    #: copy is half the bytes of an fp32 one (of the caller's fp32 or bf16 array alike).
    BF16 = "bf16"


@dataclass(frozen=True)
class _Entry:
    packed: np.ndarray             # read-only
    source: Optional[np.ndarray]   # the private copy compared with (Check.COPY, BF16)
    check: Check
    changes: int                   # times the caller's array was found changed before

    def matches(self, w: np.ndarray, nthreads: int, isa: Optional[int]) -> bool:
        """Whether ``w`` holds the weights ``packed`` was made from, bit for bit (or, for
        Check.BF16, their bf16 rounding does; ``isa``: that of the layout conversions,
        None for AVX-512 where the CPU has it)."""
        if self.check is Check.PANELS:
            return _kernels.packed_matches(w, self.packed, nthreads, isa)
        if self.check is Check.BF16 and w.dtype == np.float32:
            return _kernels.bf16_same_rounded(w, self.source, nthreads)
        return _kernels.same_bytes(self.source, w, nthreads)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.source is None else self.source.nbytes)


class WeightCache:
    """See the module text."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._volatile: OrderedDict[Hashable, None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def packed(self, w: np.ndarray, fmt: Hashable, pack: Callable[[np.ndarray], np.ndarray],
               nthreads: int, check: Check, isa: Optional[int] = None) -> Optional[np.ndarray]:
        """The packed weights of ``w`` in format ``fmt`` (what ``pack`` makes of an array
        of w's values, float32), from the cache when w holds the values they were packed
        from; None when w is not to be cached (too small or too large, or found
        changing): the caller packs it itself then. ``check`` says how w is compared on
        later calls: Check.PANELS for RSCK weights that ``pack`` cuts into the panels of
        ``_kernels.pack_weights`` (compared with w directly); Check.COPY keeps a copy of
        w (torch's KCRS, transposed by packing); Check.BF16 a copy of w rounded to bf16
        (w float32, or bf16 as ``ml_dtypes.bfloat16``), for a bf16 kernel's packing."""
        nbytes = w.nbytes
        if nbytes < MIN_BYTES or 4 * nbytes > self.max_bytes:   # copy + packed <= half
            return None
        key = (w.__array_interface__["data"][0], w.shape, fmt)
        with self._lock:
            if key in self._volatile:
                return None
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None:
            if entry.matches(w, nthreads, isa):
                self.hits += 1
                return entry.packed
            changes = entry.changes + 1
            if changes >= MAX_CHANGES:
                with self._lock:
                    self._drop(key)
                    self._volatile[key] = None
                    while len(self._volatile) > MAX_VOLATILE:
                        self._volatile.popitem(last=False)
                return None
        else:
            changes = 0
        self.misses += 1
        # packed from the copy, the two agree whatever w does meanwhile; without one,
        # the next call compares w with what the panels hold, whatever that is
        if check is Check.PANELS:
            source = None
            packed = pack(w)
        elif check is Check.COPY:
            source = aligned_copy(w)
            packed = pack(source)
        else:
            source = _kernels.bf16_round(w, nthreads) if w.dtype == np.float32 else \
                w.view(np.uint16).copy()
            packed = pack(_kernels.bf16_widen(source, nthreads))
        packed.flags.writeable = False
        if source is not None:
            source.flags.writeable = False
        entry = _Entry(packed, source, check, changes)
        with self._lock:
            self._drop(key)
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                self._drop(next(iter(self._entries)))
        return packed

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def resize(self, max_bytes: int) -> int:
        """Set the bound (0: cache nothing, and drop what is held); returns the old one."""
        with self._lock:
            previous, self.max_bytes = self.max_bytes, max_bytes
            while self._entries and self._bytes > max_bytes:
                self._drop(next(iter(self._entries)))
            if max_bytes == 0:
                self._volatile.clear()
        return previous

    @property
    def nbytes(self) -> int:
        """Bytes held (copies and packed weights)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


#: The process's cache, used by ``ttile.conv2d``.
CACHE = WeightCache()
