"""A fixed run of bound kernel calls on NHWC arrays, its activations in buffers it keeps.

A converted network calls its layers one by one from Python, and each call finds its
kernel again: the layer's checks, its plan and selection, a fresh output, a scratch
buffer, the kernel's own argument checks. Right after a kernel has streamed megabytes
through the caches, that Python work runs on cold data: 10-14 us a layer inside
MobileNetV2 (Zen 5, 1 thread), where the same call costs about 5 us warm, and 0.42 ms of
its 3.6 ms inference against the same kernel calls replayed back to back (0.33 of 2.4 ms
at 2 threads).

A :class:`Program` is that replay made safe: the layers of one input signature, each
bound once to its kernel (weights, thread count, epilogue, scratch), run back to back,
every intermediate written into a buffer the program keeps. Buffers go to activations
by their lifetimes: a value's buffer is free once the last step reading it has run, and
the next output takes the buffer freed most recently, whose lines the previous layers
have just read, so a layer's stores meet lines already in cache. The last step's output
is new on every run: it is what the caller keeps.

The program knows nothing of why its bindings hold; whoever builds it checks that before
each run (``ttile.torch``'s ``TTileSequence``). A run holds the program's lock, taken
without waiting: a second thread running the same program at the same time gets None
and takes the unbound path, so two runs never share its buffers.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .scratch import aligned_empty

#: A bound kernel: ``call(x, y, residual)`` writes y from x (and the residual, or None).
StepCall = Callable[[np.ndarray, np.ndarray, Optional[np.ndarray]], object]


@dataclass(frozen=True)
class Step:
    """One bound kernel call: ``source`` and ``residual`` (or -1) index the values (the
    program's inputs first, then each step's output in order), ``out_shape`` is the
    shape of the float32 array it writes, or of the bf16 values' bits (uint16) with
    ``bits`` (a bf16 layer whose readers are bf16 layers: half the bytes)."""

    call: StepCall
    source: int
    residual: int
    out_shape: tuple
    bits: bool = False


def assign_buffers(inputs: int, steps: Sequence[Step]) -> list[Optional[int]]:
    """The buffer each step's output goes to (None for the last step's, which is new on
    every run): value lifetimes end after their last reader, and an output takes the
    buffer freed most recently (warm in cache), never one its own step reads."""
    last_read: dict[int, int] = {}
    for i, step in enumerate(steps):
        for v in (step.source, step.residual):
            if v >= 0:
                last_read[v] = i
    free: list[int] = []          # buffers free now, the most recently freed last
    holder: dict[int, int] = {}   # value -> buffer
    count = 0
    assigned: list[Optional[int]] = []
    for i, step in enumerate(steps):
        if i == len(steps) - 1:
            assigned.append(None)
            break
        if free:
            buffer = free.pop()
        else:
            buffer, count = count, count + 1
        assigned.append(buffer)
        holder[inputs + i] = buffer
        # values whose last reader is this step are free for the steps after it (a step
        # never writes over what it reads); an output nobody reads is free at once
        for v in {step.source, step.residual, inputs + i}:
            if v in holder and last_read.get(v, -1) <= i:
                free.append(holder.pop(v))
    return assigned


class Program:
    """Steps bound once, run on new inputs of the same shapes (see the module text)."""

    def __init__(self, inputs: int, steps: Sequence[Step]):
        if not steps:
            raise ValueError("a program has at least one step")
        for i, step in enumerate(steps):
            if not (0 <= step.source < inputs + i and -1 <= step.residual < inputs + i):
                raise ValueError(f"step {i} reads a value not made before it "
                                 f"({step.source}, {step.residual})")
        self.inputs = inputs
        self.steps = tuple(steps)
        assigned = assign_buffers(inputs, self.steps)
        if self.steps[-1].bits:
            raise ValueError("a program's last step writes float32")
        sizes: dict[int, int] = {}   # floats
        for buffer, step in zip(assigned, self.steps):
            if buffer is not None:
                floats = -(-math.prod(step.out_shape) // 2) if step.bits \
                    else math.prod(step.out_shape)
                sizes[buffer] = max(sizes.get(buffer, 0), floats)
        memory = {b: aligned_empty((n,)) for b, n in sizes.items()}

        def out(buffer, step):
            if buffer is None:
                return None
            n = math.prod(step.out_shape)
            base = memory[buffer].view(np.uint16) if step.bits else memory[buffer]
            return base[:n].reshape(step.out_shape)
        #: each step's output array (None: the last, allocated per run)
        self._outs = [out(b, s) for b, s in zip(assigned, self.steps)]
        self._plan = tuple((s.call, s.source, s.residual, inputs + i)
                           for i, s in enumerate(self.steps))
        self._lock = threading.Lock()

    @property
    def buffer_bytes(self) -> int:
        """Memory the program keeps for its intermediate values."""
        seen = {}
        for out in self._outs:
            if out is not None:
                seen[id(out.base)] = out.base.nbytes
        return sum(seen.values())

    def run(self, inputs: Sequence[np.ndarray], times: Optional[list] = None
            ) -> Optional[np.ndarray]:
        """The steps on ``inputs`` (NHWC arrays of the shapes it was bound for): the last
        step's output, a new array; None, running nothing, while another thread runs
        this program. With ``times``, each step's seconds are appended to it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            last = aligned_empty(self.steps[-1].out_shape)
            values = list(inputs) + self._outs
            values[-1] = last
            if times is None:
                for call, source, residual, out in self._plan:
                    call(values[source], values[out],
                         None if residual < 0 else values[residual])
            else:
                for call, source, residual, out in self._plan:
                    t0 = time.perf_counter()
                    call(values[source], values[out],
                         None if residual < 0 else values[residual])
                    times.append(time.perf_counter() - t0)
            return last
        finally:
            self._lock.release()


__all__ = ["Program", "Step", "StepCall", "assign_buffers"]
