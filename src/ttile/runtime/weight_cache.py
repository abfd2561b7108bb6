"""Packed weights of per-call ``conv2d`` calls, reused while the caller's array is unchanged.

A per-call ``conv2d`` hands its kernel the weights in the kernel's format (panels), so
each call packs them again. On one or two cores that is a pass at memory speed; on many
it is worse than its bytes suggest: the threads that pack write lines that other cores'
kernel threads then read, and every call moves them back (ResNet18-10's 9.4 MB at 16
threads on a Xeon: 0.33 ms of packing against 0.53 ms of convolution).

This cache keeps, for the most recently used weight arrays, the packed weights and a
private copy of the bytes they were packed from. A later call whose weights hold exactly
those bytes (compared in full, in parallel, bit for bit: ``_kernels.same_bytes``) runs
on the packed weights as a :class:`ttile.Conv2d` would; the comparison only reads, so on
many cores both arrays stay in the caches of the threads that compare them. A caller
that changes a single bit of its weights gets them packed again, so the cache is never
wrong, only sometimes useless: an array found changed on two calls is not cached any
more (a training loop would pay a copy on every call for nothing).

It pays on many threads only, and is used from :data:`MIN_THREADS` on. On a 16-core
Xeon (model 207) per-call calls with the cache took 0.76-0.96 of the time without it at
16 threads, 0.86-1.00 at 8, but 0.96-1.26 at 4 and 1.08-1.38 at 1 (ResNet18-9/-10/-11/-12,
Yolo9000-19): on few cores the comparison reads twice the bytes that packing reads,
from memory (one server core reads at 10-15 GB/s), where the generic kernel's threads
pack the panels they need as they go. On a 2-core Zen 4 it was 0.95-1.05 at 1 and 2
threads, 0.69 on ResNet18-11 (a searched kernel's separate packing pass).

Only the caller's own float32 C-contiguous arrays are cached (a converted copy is new on
every call), and only weights of at least :data:`MIN_BYTES`; the cache holds at most
``max_bytes`` (copies and packed weights together, least recently used dropped first;
``ttile.set_weight_cache``). Thread-safe: entries are never written after they are made.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import numpy as np

from .. import _kernels

#: Weights smaller than this are packed per call: it takes microseconds.
MIN_BYTES = 128 << 10
#: Calls on fewer threads pack per call (see the module text).
MIN_THREADS = 8
#: Default bound of the cache (copies and packed weights together).
DEFAULT_MAX_BYTES = 256 << 20
#: An array found changed this many times is not cached again.
MAX_CHANGES = 2
#: Keys remembered as changing (oldest forgotten first).
MAX_VOLATILE = 256


@dataclass(frozen=True)
class _Entry:
    source: np.ndarray   # a private copy of the bytes ``packed`` was made from
    packed: np.ndarray   # read-only
    changes: int         # times the caller's array was found changed before this entry

    @property
    def nbytes(self) -> int:
        return self.source.nbytes + self.packed.nbytes


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
               nthreads: int) -> Optional[np.ndarray]:
        """The packed weights of ``w`` in format ``fmt`` (what ``pack`` makes of an array
        of w's bytes), from the cache when w holds the bytes they were packed from; None
        when w is not to be cached (too small or too large, or found changing): the
        caller packs it itself then."""
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
            if _kernels.same_bytes(entry.source, w, nthreads):
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
        source = w.copy()           # packed from the copy: the two agree whatever w does
        packed = pack(source)
        packed.flags.writeable = False
        source.flags.writeable = False
        entry = _Entry(source, packed, changes)
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
