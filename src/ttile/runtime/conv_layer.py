"""``ttile.Conv2d``: a convolution with fixed weights, packed once.

``conv2d`` converts and packs the weights on every call because it cannot know they
repeat; a network layer's weights do, and packing Yolo9000-23's 115 MB per call costs
more than some layers' whole convolution. Conv2d keeps the weights in RSCK once and the
packed panels per panel width a kernel asks for (the generic kernel's, each tuned or
JIT kernel's own), made on first use and shared by every later call and thread.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Optional, Union

import numpy as np

from .. import _kernels
from ..core.kinds import Isa, KernelKind, Precision
from . import bf16, epilogue, winograd
from .arguments import (FLOAT32, IntPair, as_float32, as_pair, default_threads,
                        thread_count)
from .call_plan import CallPlan, Family, call_plan
from .epilogue import Fused
from .execute import RUNNERS, execute, nhwc_kernel_call
from .packing import family_weights
from .routes import Route, alternatives, remembered, select
from .scratch import aligned_copy
from .settings import get_isa


#: The most input signatures a Conv2d remembers a bound call for.
_MAX_BOUND = 64

#: Bumped whenever any Conv2d drops or replaces a binding (a pin, dropped packed
#: weights, a new selection): what was bound from one (``bound_nhwc``) checks this one
#: number instead of every layer's bindings (``ttile.torch``'s sequence programs).
_bindings_revision = 0


def bindings_revision() -> int:
    """The current bindings revision (see ``_bindings_revision``)."""
    return _bindings_revision


def _bindings_changed() -> None:
    global _bindings_revision
    _bindings_revision += 1


class _Bound:
    """A repeated call of a layer, bound: the plan, the final selection and the packed
    weights of one input shape and thread count (and for an NHWC call the kernel with
    its arguments bound), so that a layer in a network, called again and again, goes from
    its arguments' checks straight to its route's runner and kernel: 4 us per call on an
    empty problem where the full path took 7 (Zen 3).

    It serves while the plan still holds its selection under the current settings
    generation - exactly when :func:`~ttile.runtime.routes.select` would return it - and
    the arrays are what the full path accepts without converting (float32, C-contiguous,
    aligned); otherwise it answers None and the call takes the full path.
    """

    __slots__ = ("plan", "selection", "guard", "weights", "nthreads", "fused",
                 "bound_kernel")

    def __init__(self, plan, selection, weights, nthreads, fused, guard):
        self.plan, self.selection, self.weights = plan, selection, weights
        self.nthreads, self.fused = nthreads, fused
        self.guard = guard   # select's selection: the binding holds while it does
        # an NHWC call's kernel itself, bound (the NHWC runner's last argument)
        self.bound_kernel = (
            (nhwc_kernel_call(selection.choice, plan, weights, nthreads, fused.kwargs()),)
            if selection.route is Route.NHWC else ())

    @classmethod
    def of(cls, plan, selection, weights, nthreads, fused, guard) -> Optional["_Bound"]:
        """The bound call of ``selection`` while ``guard``, the selection ``select``
        made, is final (remembered in its plan): the two are one unless a selection is
        pinned in place of the default (:meth:`Conv2d.pin`)."""
        if remembered(plan, nthreads, per_call=False) is not guard:
            return None
        return cls(plan, selection, weights, nthreads, fused, guard)

    def holds(self) -> bool:
        """Whether ``select`` would still return this binding's selection."""
        return remembered(self.plan, self.nthreads, per_call=False) is self.guard

    def __call__(self, x: np.ndarray, residual) -> Optional[np.ndarray]:
        if x.dtype != FLOAT32 or not _plain(x):
            return None
        plan, selection = self.plan, self.selection
        if remembered(plan, self.nthreads, per_call=False) is not self.guard:
            return None
        fused = self.fused
        if residual is not None:
            if type(residual) is not np.ndarray or residual.dtype != FLOAT32 \
                    or residual.shape != plan.out_shape or not _plain(residual):
                return None
            fused = Fused(fused.bias, residual, fused.activation, fused.negative_slope)
        return RUNNERS[selection.route](plan, selection.choice, x, self.weights,
                                        self.nthreads, fused, None, *self.bound_kernel)


def _plain(array: np.ndarray) -> bool:
    flags = array.flags
    return flags.c_contiguous and flags.aligned


class Conv2d:
    """Callable convolution with fixed weights and bias, like ``torch.nn.Conv2d``.

    Args:
        w: weights, (K, C/groups, R, S) for layout "NCHW" or (R, S, C/groups, K) for
            "NHWC".
        bias, stride, padding, dilation, groups, layout, activation, negative_slope,
            precision: as for :func:`ttile.conv2d` (bf16: the weights are rounded and
            packed for the bf16 kernel once, see ``_Bf16Layer``).
        threads: default thread count of calls (None: all CPUs this process may use).

    ``layer(x)`` (or ``layer(x, threads=n, residual=r, out=y)``) returns
    ``conv2d(x, w, bias, ...)``. A call runs on no more threads than its work keeps busy
    (one per :data:`ttile.core.spec.MIN_FLOPS_PER_THREAD`); ``whole_team=True`` runs it
    on all ``threads`` - for layers called back to back, as a network runs them (see
    :meth:`__call__`). The weights and bias are copied: changing the arrays
    passed in later does not change the layer. Calls from several threads at once are
    safe; the kernel runs without the GIL.
    """

    def __init__(self, w, bias=None, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
                 dilation: IntPair = 1, groups: int = 1, *, layout: str = "NCHW",
                 threads: Optional[int] = None, activation: Optional[str] = None,
                 negative_slope: float = 0.01,
                 precision: Union[str, Precision] = Precision.FP32):
        self.precision = bf16.precision_of(precision)
        weights = as_float32(w, "weights")
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if weights.ndim != 4:
            expected = "(K, C, R, S)" if layout == "NCHW" else "(R, S, C, K)"
            raise ValueError(f"weights must have 4 dimensions {expected}, got "
                             f"{weights.ndim}: shape {weights.shape}")
        if 0 in weights.shape:
            raise ValueError(f"zero-size dimension in weights {weights.shape}")
        # Everything but the input's size is checked now, so a bad layer fails where it
        # is made: a stand-in input as large as the dilated kernel.
        wc = weights.shape[1] if layout == "NCHW" else weights.shape[2]
        r, s = weights.shape[2:] if layout == "NCHW" else weights.shape[:2]
        channels = wc * groups if type(groups) is int and groups > 0 else wc
        dh, dw = as_pair(dilation, "dilation", 1)
        probe_h, probe_w = 1 + (r - 1) * dh, 1 + (s - 1) * dw
        probe = ((1, channels, probe_h, probe_w) if layout == "NCHW"
                 else (1, probe_h, probe_w, channels))
        probe_plan = call_plan(probe, tuple(weights.shape), stride, padding, layout, dilation,
                           groups)
        self._fused = epilogue.fused(probe_plan, bias, None, activation, negative_slope)
        if self._fused.bias is not None:
            self._fused = replace(self._fused, bias=self._fused.bias.copy())
            self._fused.bias.flags.writeable = False
        if probe_plan.family is Family.DENSE:
            rsck = (_kernels.pack_weights_kcrs(weights, 0, thread_count(None))
                    if layout == "NCHW" else aligned_copy(weights))
        else:
            rsck = aligned_copy(weights)   # the family's format is made on first use
        rsck.flags.writeable = False
        self._rsck = rsck
        self._w_shape = tuple(weights.shape)
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        self.groups = groups
        self.layout = layout
        self.activation = activation
        self.negative_slope = negative_slope
        self.threads = None if threads is None else thread_count(threads)
        self._packed: dict = {}
        self._lock = threading.Lock()
        # (input shape, threads asked, no residual?, whole team?): _Bound
        self._bound: dict = {}
        # (input shape, threads): (select's selection, the one serving in its place)
        self._pinned: dict = {}
        self._bf16 = (_Bf16Layer(weights, self) if self.precision is Precision.BF16
                      else None)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """Shape of the weights as given (in the layer's layout)."""
        return self._w_shape

    def _weights_for(self, plan, choice) -> np.ndarray:
        key = (choice.kind, choice.panel, choice.tile)
        packed = self._packed.get(key)
        if packed is not None:
            return packed
        with self._lock:
            packed = self._packed.get(key)
            if packed is None:
                packed = (winograd.transformed(self._rsck, "NHWC", thread_count(None),
                                               choice.isa, tile=choice.tile)
                          if choice.kind is KernelKind.WINOGRAD
                          else family_weights(self._rsck, self.layout, plan, choice,
                                              thread_count(None)))
                if packed is None:  # dense: RSCK, or panels of the kernel's width
                    packed = (_kernels.pack_weights(self._rsck, choice.panel,
                                                    thread_count(None))
                              if choice.panel else self._rsck)
                packed.flags.writeable = False
                self._packed[key] = packed
        return packed

    def __call__(self, x, threads: Optional[int] = None, *, residual=None,
                 out=None, whole_team: bool = False) -> np.ndarray:
        """``whole_team``: every one of the threads asked for takes part, however small
        the layer. Layers run back to back (a converted network's) keep one OpenMP team
        that way; a team that shrinks for a small layer and grows again at the next one
        wakes its sleeping threads each time, which cost more than the idle threads
        (MobileNetV2 at 16 threads on a Xeon model 207: 3.5 ms with teams fitted to each
        layer, 2.0 ms with all 16 in every layer)."""
        if self._bf16 is not None:
            return self._bf16(x, threads, residual, out, whole_team)
        if threads is None:
            threads = self.threads
        if out is None and type(x) is np.ndarray:
            asked = default_threads() if threads is None else threads
            bound = (self._bound.get((x.shape, asked, residual is None, whole_team))
                     if type(asked) is int else None)
            if bound is not None:
                y = bound(x, residual)
                if y is not None:
                    return y
        x_arr = as_float32(x, "input")
        plan = call_plan(x_arr.shape, self._w_shape, self.stride, self.padding, self.layout,
                     self.dilation, self.groups)
        fused = self._fused
        if residual is not None:
            fused = replace(epilogue.fused(plan, None, residual, None, 0.01), bias=fused.bias,
                            activation=fused.activation, negative_slope=fused.negative_slope)
        y = epilogue.checked_out(out, plan, ("input", x_arr), ("weights", self._rsck),
                 ("bias", fused.bias), ("residual", fused.residual))
        asked = thread_count(threads)
        nthreads = asked if whole_team else plan.fit(asked)
        guard = selection = select(plan, nthreads, per_call=False)
        pinned = self._pinned.get((x_arr.shape, nthreads)) if self._pinned else None
        if pinned is not None and pinned[0] is guard:
            selection = pinned[1]
        weights = self._weights_for(plan, selection.choice)
        result = execute(plan, selection, x_arr, weights, nthreads, fused, y)
        if out is None and x_arr is x:   # bound once per selection, not on every call
            key = (x.shape, asked, residual is None, whole_team)
            known = self._bound.get(key)
            if (known.selection is not selection if known is not None
                    else len(self._bound) < _MAX_BOUND):
                bound = _Bound.of(plan, selection, weights, nthreads, self._fused, guard)
                if bound is not None:
                    if known is not None:
                        _bindings_changed()
                    self._bound[key] = bound
        return result

    def bound_nhwc(self, x_shape, threads: int, residual: bool,
                   bf16_out: bool = False) -> Optional[_Bound]:
        """The binding an NHWC call on ``threads`` threads (``whole_team``) with an input
        of ``x_shape`` left behind, while it holds: its ``bound_kernel[0]`` is the
        kernel, ``kernel(x, y, residual)``, and ``plan.out_shape`` its output's shape
        (``ttile.runtime.program``). None before such a call has made a final choice,
        for other layouts, and once a pin or the settings changed the choice; a binding
        stays right while :meth:`bound_nhwc` returns it, or while neither
        :func:`bindings_revision` nor the settings generation has changed since. A bf16
        layer's binding is its bf16 kernel's (``_Bf16Layer.bound_nhwc``: its input and
        residual fp32 or bf16 bits, its output bf16 bits with ``bf16_out``)."""
        if self.layout != "NHWC":
            return None
        if self._bf16 is not None:
            return self._bf16.bound_nhwc(tuple(x_shape), threads, residual, bf16_out)
        bound = self._bound.get((tuple(x_shape), threads, not residual, True))
        if bound is None or not bound.bound_kernel or not bound.holds():
            return None
        return bound

    def _plan_of(self, x_shape) -> CallPlan:
        return call_plan(tuple(x_shape), self._w_shape, self.stride, self.padding,
                         self.layout, self.dilation, self.groups)

    def alternatives(self, x_shape, threads: int) -> tuple:
        """The selections that could serve a call on an input of ``x_shape`` on
        ``threads`` threads (``whole_team``): the one chosen by default first, then the
        others a context verdict weighs against it (``routes.alternatives``). A bf16
        layer has none to weigh: its kernel is the one bf16 kernel that serves."""
        if self._bf16 is not None:
            return ()
        return alternatives(self._plan_of(x_shape), thread_count(threads))

    def pin(self, x_shape, threads: int, selection=None) -> None:
        """Serve calls on an input of ``x_shape`` on ``threads`` threads by
        ``selection`` (one of :meth:`alternatives`) instead of the default; None serves
        the default again. A pin holds while the default stays what it was (the same
        settings: ``ttile.use_tuned_kernels`` and the like undo it) - a verdict made in
        one context, a network's, for this layer only."""
        plan, nthreads = self._plan_of(x_shape), thread_count(threads)
        key = (tuple(x_shape), nthreads)
        if selection is None:
            self._pinned.pop(key, None)
        else:
            if selection not in alternatives(plan, nthreads):
                raise ValueError("pin takes one of the layer's alternatives() at that "
                                 "input shape and thread count")
            self._pinned[key] = (select(plan, nthreads, per_call=False), selection)
        for bound_key in [k for k in self._bound if k[0] == key[0]]:
            del self._bound[bound_key]
        _bindings_changed()

    def forget_packed(self, keep) -> None:
        """Drop the packed weights of every kernel but ``keep`` (a kernel choice): after
        a context verdict, the losers' copies (a Winograd layer's other tile: megabytes)
        are not kept; a later call that needs one packs it again."""
        key = (keep.kind, keep.panel, keep.tile)
        with self._lock:
            for other in [k for k in self._packed if k != key]:
                del self._packed[other]
            self._bound.clear()
        _bindings_changed()

    def pinned(self, x_shape, threads: int):
        """The selection pinned for calls on an input of ``x_shape`` on ``threads``
        threads while it still holds (see :meth:`pin`), or None."""
        plan, nthreads = self._plan_of(x_shape), thread_count(threads)
        pinned = self._pinned.get((tuple(x_shape), nthreads))
        if pinned is None or pinned[0] is not select(plan, nthreads, per_call=False):
            return None
        return pinned[1]

    def __repr__(self) -> str:
        extras = "".join(f", {name}={getattr(self, name)!r}"
                         for name, default in (("dilation", 1), ("groups", 1),
                                               ("activation", None))
                         if getattr(self, name) != default)
        bias = "" if self._fused.bias is None else ", bias"
        precision = "" if self.precision is Precision.FP32 else f", precision='{self.precision}'"
        return (f"ttile.Conv2d(weights {self._w_shape}{bias}, stride={self.stride!r}, "
                f"padding={self.padding!r}{extras}, layout={self.layout!r}{precision})")


class _Bf16Layer:
    """The bf16 side of a :class:`Conv2d` made with ``precision="bf16"``: its weights
    packed once per packing (``bf16.Bf16Packing``: it depends on the kernel, the
    channels and the filter, not on the input's size), or, where no bf16 kernel serves,
    an fp32 ``Conv2d`` of the bf16-rounded weights called on the rounded input."""

    def __init__(self, weights: np.ndarray, layer: "Conv2d") -> None:
        self._w = np.array(weights, dtype=FLOAT32, order="C")   # the layer's layout
        self._w.flags.writeable = False
        self._layer = layer
        self._packed: dict = {}
        self._emulated: Optional[Conv2d] = None
        self._lock = threading.Lock()
        self._calls: dict = {}   # (shape, bf16?, threads, whole team?, isa): _prepare's

    def _weights(self, pack: bf16.Bf16Packing, threads: int) -> np.ndarray:
        key = pack.weights_key
        packed = self._packed.get(key)
        if packed is None:
            with self._lock:
                packed = self._packed.get(key)
                if packed is None:
                    packed = bf16.pack_weights(self._w, self._layer.layout, pack, threads)
                    self._packed[key] = packed
        return packed

    def _fp32_layer(self) -> "Conv2d":
        if self._emulated is None:
            layer = self._layer
            self._emulated = Conv2d(bf16.round_to_bf16(self._w), layer._fused.bias,
                                    layer.stride, layer.padding, layer.dilation,
                                    layer.groups, layout=layer.layout, threads=layer.threads,
                                    activation=layer.activation,
                                    negative_slope=layer.negative_slope)
        return self._emulated

    def _prepare(self, x_shape, threads, whole_team: bool, isa: Isa) -> tuple:
        """What a call on an input of ``x_shape`` needs, decided once: its plan, the
        kernel, the thread count and the epilogue."""
        layer = self._layer
        call = call_plan(tuple(x_shape), self._w.shape, layer.stride, layer.padding,
                         layer.layout, layer.dilation, layer.groups)
        asked = thread_count(threads if threads is not None else layer.threads)
        nthreads = asked if whole_team else call.fit(asked)
        fused = epilogue.fused(call, layer._fused.bias, None, layer.activation,
                               layer.negative_slope)
        return call, bf16.choose(call.spec, call.groups, isa), nthreads, fused

    def __call__(self, x, threads: Optional[int], residual, out, whole_team: bool):
        bf16_in = bf16.is_bfloat16(x)
        if not bf16_in:
            x = as_float32(x, "input")
        isa = get_isa()
        key = (x.shape, bf16_in, threads, whole_team, isa)
        known = self._calls.get(key)
        if known is None:
            known = self._prepare(x.shape, threads, whole_team, isa)
            if len(self._calls) < 64:
                self._calls[key] = known
        call, choice, nthreads, fused = known
        if residual is not None:
            epilogue.check_residual_shape(call, tuple(np.shape(residual)))
        if out is not None:
            bf16.check_out(out, call, ("input", x), ("residual", residual))
        if choice.pack is None:
            bf16.warn_missing(choice)
            return bf16.emulated(
                lambda xr, res, o: self._fp32_layer()(xr, nthreads, residual=res, out=o,
                                                      whole_team=True), x, residual, out)
        bf16.warn_missing(choice)
        return bf16.run_packed(call, choice.pack, x, self._weights(choice.pack, nthreads),
                               self._layer.layout, nthreads, fused, residual, out)

    def bound_nhwc(self, x_shape: tuple, threads: int, residual: bool,
                   bf16_out: bool) -> Optional[bf16.Bf16Bound]:
        """This layer's bf16 kernel bound for NHWC inputs of ``x_shape`` on all
        ``threads`` (a sequence's program step, ``call(x, y, residual)``); None where no
        bf16 kernel serves it. x and the residual may be fp32 or bf16 bits (uint16), y is
        bf16 bits with ``bf16_out``, else fp32. Where the fp32 kernels on rounded values
        serve, their binding (made by an earlier call) behind a rounding pass."""
        call, choice, nthreads, fused = self._prepare(x_shape, threads, True, get_isa())
        if choice.pack is None:
            inner = self._fp32_layer().bound_nhwc(x_shape, threads, residual)
            return None if inner is None else bf16.RoundingBound(inner, nthreads, bf16_out)
        return bf16.Bf16Bound(call, choice.pack, self._weights(choice.pack, nthreads),
                              nthreads, fused, bf16_out)
