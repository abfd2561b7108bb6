"""``ttile.conv2d`` and ``ttile.plan``: the public front door, a short pipeline.

A call is checked and planned (``arguments``, ``call_plan``, ``epilogue``), its kernel
and route selected (``routes.select``, the same selector ``plan`` reports from), its
weights put in the kernel's format (``packing``) and run (``execute``):

    x, w -> as_float32 -> call_plan -> epilogue.fused / checked_out
         -> call_weights (select, pack) -> execute(route) -> y

The semantics are those of ``torch.nn.functional.conv2d`` (bias, stride, padding,
dilation, groups), plus an epilogue fused into the kernels' output store:
``act(conv + bias + residual)``. Everything a caller can get wrong is refused with a
ValueError or TypeError that names the problem, before any pointer reaches C and before
anything is written to ``out``.

Kept free of heavy imports: this is the hot path of every call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ..core.kinds import Isa, KernelKind, Precision, SetMatch
from ..core.spec import ConvSpec
from . import bf16, epilogue, registry, weight_cache
from .arguments import IntPair, MAX_THREADS, as_float32, shape_tuple, thread_count
from .call_plan import call_plan
from .execute import execute
from .packing import call_weights
from .routes import Route, select
from .settings import get_isa


def tuned_kernels() -> list[dict]:
    """The searched kernels compiled into this build, for every CPU they were tuned on:
    problem fields, ``cpu`` (fingerprint id) and ``threads`` they were measured at,
    ``scheme``, measured ``gflops``, ``panel``, ``layer``; ``serves_here`` and
    ``set_match`` say whether its set serves this CPU and how it matched ("exact", or
    "microarchitecture" for a set measured on the same core in another VM; "none" for a
    set that does not serve here). Each serves only at its thread count (``plan`` says
    what serves a call)."""
    kernels = []
    for entry in registry.KERNELS:
        serving = registry.serving_set(entry.isa)
        here = serving.cpu == entry.cpu
        kernels.append({**entry.to_dict(), "serves_here": here,
                        "set_match": (serving.match if here else SetMatch.NONE).value})
    return kernels


def conv2d(x, w, bias=None, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
           dilation: IntPair = 1, groups: int = 1, *, layout: str = "NCHW",
           threads: int | None = None, activation: Optional[str] = None,
           negative_slope: float = 0.01, residual=None, out=None,
           precision: Union[str, Precision] = Precision.FP32) -> np.ndarray:
    """2D convolution with the semantics of ``torch.nn.functional.conv2d``, and an
    epilogue fused into the kernel's output store: ``act(conv(x, w) + bias + residual)``.

    Args:
        x: input, (N, C, H, W) for layout "NCHW" or (N, H, W, C) for "NHWC".
        w: weights, (K, C/groups, R, S) for "NCHW" or (R, S, C/groups, K) for "NHWC".
        bias: None or (K,) values added to each output channel.
        stride: int or (sh, sw), >= 1.
        padding: int, (ph, pw), "same" (stride 1 only; the odd extra row/column goes to
            the bottom/right, as in torch), "valid", or ((top, bottom), (left, right))
            for different padding on each side (as an ONNX Conv's pads may be).
        dilation: int or (dh, dw), >= 1: the spacing of the kernel's taps.
        groups: input and output channels are split into this many groups, each
            convolved with its own weights (groups == C: depthwise).
        layout: "NCHW" (default) or "NHWC", the kernels' native layout: NHWC runs with
            no transposition.
        threads: number of threads, default all CPUs this process may use; a small
            problem uses fewer (one thread per 4 MFLOP of work at most).
        activation: None, "relu", "relu6", "leaky_relu" (with ``negative_slope``),
            "silu" or "sigmoid", applied last.
        residual: None or an array of the output's shape (in ``layout``) added before
            the activation (a ResNet shortcut).
        out: None, or a C-contiguous float32 array of the output's shape written in
            place and returned (it must not overlap x, w, bias or residual); with
            ``precision="bf16"``, float32 or bfloat16 (the result rounded to bf16).
        precision: "fp32" (default), or "bf16": the input and weights rounded to bf16
            (to nearest even), products accumulated in fp32, the epilogue in fp32 (what
            OpenVINO runs by default on CPUs with AVX512_BF16 or AMX, and torch
            autocast). Served by AMX or AVX512_BF16 kernels where the CPU has them, else
            by the fp32 kernels on the rounded values (one warning). fp32 arrays give an
            fp32 output; bf16 arrays (``ml_dtypes.bfloat16``) a bf16 output. The
            weights (float32 or bfloat16) are packed for the bf16 kernel on the first
            call and reused while the same array, rounded to bf16, holds the same
            values: each call checks that against a bf16 copy, in parallel
            (``ttile.set_weight_cache``); :class:`ttile.Conv2d` packs them once.

    A problem with no kernel tuned into ttile is tuned on its first call (a search of
    at most 20 s by default, then cached on disk for later processes), in the
    background, or never: see :func:`ttile.set_tuning`. Weights are packed for the
    kernel on every call (one parallel pass into a reused per-thread buffer, or by the
    generic kernel's threads as they go), except where the same array comes back
    unchanged on many threads (or for a searched kernel in NHWC): then the weights
    packed on its first call are reused, see :func:`ttile.set_weight_cache`.
    :class:`ttile.Conv2d` packs them once.

    Returns:
        float32 output, (N, K, Ho, Wo) for "NCHW", (N, Ho, Wo, K) for "NHWC".
        float16, float64 and integer inputs are converted to float32.

    Raises:
        ValueError: wrong ranks or channels, channels not divisible by groups, zero
            sizes, bad stride/padding/dilation/threads, kernel larger than the padded
            input, bias/residual/out of the wrong shape, out overlapping an input, an
            unknown activation, output too large for memory. Nothing is written to
            ``out`` then.
        TypeError: non-numeric, bool or complex data; non-integer stride or padding;
            ``out`` not a float32 numpy array.
    """
    if precision is not Precision.FP32 and precision != "fp32":
        return _conv2d_bf16(x, w, bias, stride, padding, dilation, groups, layout, threads,
                            activation, negative_slope, residual, out, precision)
    x_arr = as_float32(x, "input")
    w_arr = as_float32(w, "weights")
    call = call_plan(x_arr.shape, w_arr.shape, stride, padding, layout, dilation, groups)
    fused = epilogue.fused(call, bias, residual, activation, negative_slope)
    y = epilogue.checked_out(out, call, ("input", x_arr), ("weights", w_arr),
                             ("bias", fused.bias), ("residual", fused.residual))
    nthreads = call.fit(threads if type(threads) is int and 0 < threads <= MAX_THREADS
                        else thread_count(threads))
    weights, selection = call_weights(w_arr, w_arr is w, call, nthreads)
    return execute(call, selection, x_arr, weights, nthreads, fused, y)


def _own_bf16_weights(w) -> Optional[np.ndarray]:
    """``w`` itself where a bf16 call may keep its packed weights for it: the caller's
    own C-contiguous float32 or bfloat16 numpy array (a converted copy is new on every
    call); None otherwise."""
    if type(w) is not np.ndarray or not (w.flags.c_contiguous and w.flags.aligned):
        return None
    return w if w.dtype == np.float32 or bf16.is_bfloat16(w) else None


def _conv2d_bf16(x, w, bias, stride, padding, dilation, groups, layout, threads, activation,
                 negative_slope, residual, out, precision) -> np.ndarray:
    """conv2d with a precision other than fp32 (``ttile.runtime.bf16``)."""
    if bf16.precision_of(precision) is Precision.FP32:
        return conv2d(x, w, bias, stride, padding, dilation, groups, layout=layout,
                      threads=threads, activation=activation, negative_slope=negative_slope,
                      residual=residual, out=out)
    if not bf16.is_bfloat16(x):
        x = as_float32(x, "input")   # once: the calls below take it as it is
    own = _own_bf16_weights(w)
    w_arr = None if own is not None else as_float32(w, "weights")
    call = call_plan(np.shape(x), np.shape(w), stride, padding, layout, dilation, groups)
    nthreads = call.fit(thread_count(threads))
    choice = bf16.choose(call.spec, call.groups, get_isa())
    packed = None
    if choice.pack is not None and own is not None:
        # the caller's own array: its packed weights are reused while it holds, rounded
        # to bf16, the values they were packed from (``weight_cache``)
        pack = choice.pack
        packed = weight_cache.CACHE.packed(
            own, ("bf16", layout) + pack.weights_key,
            lambda source: bf16.pack_weights(source, layout, pack, nthreads), nthreads,
            weight_cache.Check.BF16)
    if packed is None and w_arr is None:
        w_arr = as_float32(w, "weights")
    if choice.pack is None:   # the fp32 kernels on the rounded values
        bf16.warn_missing(choice)
        w_rounded = bf16.round_to_bf16(w_arr)
        if residual is not None:
            epilogue.check_residual_shape(call, tuple(np.shape(residual)))
        if out is not None:
            bf16.check_out(out, call, ("input", x), ("residual", residual), ("bias", bias))
        return bf16.emulated(
            lambda xr, res, o: conv2d(xr, w_rounded, bias, stride, padding, dilation, groups,
                                      layout=layout, threads=nthreads, activation=activation,
                                      negative_slope=negative_slope, residual=res, out=o),
            x, residual, out)
    return bf16.run_call(call, choice, x, packed, w_arr, layout, nthreads, bias, residual,
                         activation, negative_slope, out)


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel serves a call, as :func:`plan` reports it.

    kind: "tuned" (compiled into ttile), "jit" (tuned on this machine, from the cache),
    "generic", "depthwise", "pointwise" or "winograd". ``tuned_cpu`` / ``tuned_threads`` name the CPU and thread
    count the kernel (or the verdict for the generic kernel) was measured at. ``scheme``
    and ``microkernels`` are in the paper's notation (empty for the hand-written
    kernels); ``expected_gflops`` is what the kernel measured when it was tuned (None
    when unknown); ``note`` says why this kernel was chosen. ``problem`` is one group's
    convolution (``groups`` of them side by side); ``epilogue`` what is fused into the
    store ("" for none, else e.g. "bias+residual+relu"). ``degraded`` says what was lost
    on the way to this kernel ("" when nothing was): run-time tuning that failed or ran
    without the learned ranking, a cache entry that could not be loaded, candidates that
    did not build or computed wrong results. ``route`` is how the arrays reach the kernel:
    as they are, through an NCHW entry point, or converted (see :class:`Route`).
    ``kernel_set`` is the shipped set serving this CPU in the call's vector family (its CPU
    id, None when none does) and ``set_match`` how it matched: measured on this exact
    fingerprint, or on the same microarchitecture in another VM. ``precision`` is what
    the call multiplies: a bf16 call is served by a bf16 kernel (kind "amx" or
    "avx512_bf16"), or by an fp32 kernel on bf16-rounded values, as ``note`` says.
    """

    kind: KernelKind
    scheme: str
    microkernels: str
    expected_gflops: Optional[float]
    threads: int
    isa: Isa
    problem: ConvSpec
    note: str
    tuned_cpu: Optional[str] = None      # the CPU a tuned/JIT kernel (or verdict) was measured on
    tuned_threads: Optional[int] = None  # and the thread count
    groups: int = 1
    epilogue: str = ""
    degraded: str = ""
    route: Route = Route.NHWC
    kernel_set: Optional[str] = None
    set_match: SetMatch = SetMatch.NONE
    precision: Precision = Precision.FP32


def plan(x_shape, w_shape, bias=None, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
         dilation: IntPair = 1, groups: int = 1, *, layout: str = "NCHW",
         threads: int | None = None, activation: Optional[str] = None,
         negative_slope: float = 0.01, residual=None, prepacked: bool = False,
         precision: Union[str, Precision] = Precision.FP32) -> KernelPlan:
    """Which kernel ``conv2d`` would use for these shapes and options - or, with
    ``prepacked``, a ``Conv2d`` with these weights (a searched kernel that a per-call
    call would have to pack weights for may lose to the generic kernel there, see
    ``dispatch.for_call``) - without running or tuning anything (a disk cache entry from
    an earlier tuning is reported as "jit"). A per-call ``conv2d`` given a weight array
    it packed before, unchanged, runs what ``prepacked`` reports where it reuses packed
    weights (see ``packing.call_weights``). One that cannot reuse the Winograd kernel's
    transformed weights (a converted copy, a changing array, the weight cache off) and
    whose weights are over ``winograd.PER_CALL_MAX_BYTES`` runs the direct kernel that
    ``ttile.use_winograd(False)`` would report.

    ``x_shape`` and ``w_shape`` are the shapes of the input and weights in ``layout``
    (sequences of ints); ``bias`` and ``residual`` may be arrays or their shapes. Raises
    what ``conv2d`` would raise for them, and ``precision`` as ``conv2d`` takes it.
    """
    prec = bf16.precision_of(precision)
    x_dims = shape_tuple(x_shape, "x_shape")
    w_dims = shape_tuple(w_shape, "w_shape")
    call = call_plan(x_dims, w_dims, stride, padding, layout, dilation, groups)
    has_bias, has_residual = bias is not None, residual is not None
    if has_bias:
        epilogue.check_bias_shape(call, shape_tuple(getattr(bias, "shape", bias), "bias"))
    if has_residual:
        epilogue.check_residual_shape(
            call, shape_tuple(getattr(residual, "shape", residual), "residual"))
    act = epilogue.activation_of(activation)
    epilogue.slope_of(negative_slope)
    nthreads = call.fit(thread_count(threads))
    isa = get_isa()
    serving = (registry.serving_set(isa) if isa.vector
               else registry.KernelSet(None, SetMatch.NONE))
    fused = epilogue.describe(has_bias, has_residual, act)
    if prec is Precision.BF16:
        low = bf16.choose(call.spec, call.groups, isa)
        if low.pack is not None:
            route = Route.NHWC if layout == "NHWC" else Route.NCHW_CONVERTED
            return KernelPlan(low.kind, "", "", None, nthreads, isa, call.spec, low.note,
                              groups=call.groups, epilogue=fused, degraded=low.degraded,
                              route=route,
                              kernel_set=serving.cpu, set_match=serving.match,
                              precision=prec)
    selection = select(call, nthreads, per_call=not prepacked, tune=False)
    choice = selection.choice
    note, degraded = choice.note, choice.degraded
    if prec is Precision.BF16:
        note = f"{low.note}; {note}"
        degraded = "; ".join(d for d in (low.degraded, degraded) if d)
    return KernelPlan(choice.kind, choice.scheme, choice.microkernels, choice.gflops,
                      nthreads, isa, call.spec, note, choice.tuned_cpu,
                      choice.tuned_threads, call.groups, fused, degraded,
                      selection.route, serving.cpu, serving.match, prec)
