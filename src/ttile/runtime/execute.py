"""Running a selected kernel: one runner per :class:`~ttile.runtime.routes.Route`.

Each runner takes the input in the call's layout and the weights already in the
kernel's format, fuses the epilogue into the kernel's store and returns the output
(``out`` when given). The only copies are the layout conversions a route names: an NCHW
input converted to NHWC by one blocked, parallel pass into a per-thread scratch buffer
(``NCHW_GENERIC``, ``NCHW_CONVERTED``) and an NHWC output converted back
(``NCHW_CONVERTED``, with the residual converted for it first); every other route reads
and writes the caller's arrays as they are.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import _kernels
from ..core.kinds import KernelKind
from ..core.spec import ConvSpec
from ..core.vectors import extension_code
from . import dispatch
from .arguments import FLOAT32
from .call_plan import CallPlan, Family
from .epilogue import BARE, Fused
from .routes import Route, Selection
from .scratch import aligned_empty, scratch
from .settings import layout_isa


def _generic_args(spec: ConvSpec) -> tuple:
    return (spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left)


def _dilation(spec: ConvSpec) -> dict:
    return {"dil_h": spec.dilation_h, "dil_w": spec.dilation_w}


def _run_searched(choice: dispatch.KernelChoice, x: np.ndarray, weights: np.ndarray,
                  y: np.ndarray, nthreads: int, fused: dict, nchw_out: bool = False) -> None:
    """A tuned or JIT kernel on arrays of exactly its problem's shapes (``nchw_out``: its
    NCHW entry point, x, y and the residual in NCHW)."""
    _searched_call(choice, weights, nthreads, fused, nchw_out)(x, y, fused["residual"])


#: A kernel bound to its weights, thread count, geometry and the epilogue's bias and
#: activation: ``call(x, y, residual)`` runs it.
KernelCall = Callable[[np.ndarray, np.ndarray, Optional[np.ndarray]], None]


def _searched_call(choice: dispatch.KernelChoice, weights: np.ndarray, nthreads: int,
                   fused: dict, nchw_out: bool = False) -> KernelCall:
    bias, activation, slope = fused["bias"], fused["activation"], fused["slope"]
    if choice.kind is KernelKind.TUNED:
        index = choice.index
        return lambda x, y, residual: _kernels.run_tuned(
            index, x, weights, y, nthreads, bias, residual, activation, slope, nchw_out)
    # The kernel's sizes are those of the problem it was compiled for: the arrays are
    # checked against that problem, not against themselves.
    problem = choice.problem
    n, ho, wo, k = problem.output_shape()
    _, h, w, c = problem.input_shape()
    address = choice.address_nchw if nchw_out else choice.address
    x_shape = (n, c, h, w) if nchw_out else (n, h, w, c)
    w_shape = problem.packed_weight_shape(choice.panel)
    y_shape = (n, k, ho, wo) if nchw_out else (n, ho, wo, k)
    isa = extension_code(choice.isa)
    return lambda x, y, residual: _kernels.run_compiled(
        address, x, weights, y, nthreads, x_shape, w_shape, y_shape, bias, residual,
        activation, slope, nchw_out, isa=isa, groups=problem.groups)


def nhwc_kernel_call(choice: dispatch.KernelChoice, plan: CallPlan, weights: np.ndarray,
                     nthreads: int, fused: dict) -> KernelCall:
    """``choice`` bound to run on NHWC x into NHWC y with the epilogue ``fused``
    (Fused.kwargs; its residual is the call's argument, not bound); ``weights`` are in
    the kernel's format (panels of ``choice.panel``, RSCK for panel 0; (R, S, 1, C) for
    the NHWC depthwise kernel; KCRS for the vector generic kernel, grouped; blocks of 16
    output channels for the grouped kernel). Binding once
    is what lets a ``Conv2d`` called again skip every decision below (a few
    microseconds of Python per call)."""
    kind, spec = choice.kind, plan.spec
    bias, activation, slope = fused["bias"], fused["activation"], fused["slope"]
    stride_h, stride_w, pad_top, pad_left = spec.stride_h, spec.stride_w, spec.pad_top, \
        spec.pad_left
    dil_h, dil_w, groups = spec.dilation_h, spec.dilation_w, plan.groups
    if kind in (KernelKind.TUNED, KernelKind.JIT):
        searched = _searched_call(choice, weights, nthreads, fused)
        if choice.problem.n == spec.n:
            return searched

        def image_by_image(x, y, residual):
            # a kernel searched for one image, on a batch: NHWC images are contiguous,
            # so the slices are views
            for i in range(spec.n):
                searched(x[i:i + 1], y[i:i + 1], None if residual is None
                         else residual[i:i + 1])
        return image_by_image
    if not choice.panel and kind not in (KernelKind.WINOGRAD, KernelKind.DEPTHWISE,
                                         KernelKind.GROUPED):
        # the portable generic kernel (no vector family to name)
        return lambda x, y, residual: _kernels.conv2d_generic_nhwc(
            x, weights, y, stride_h, stride_w, pad_top, pad_left, nthreads,
            _kernels.ISA_PORTABLE, groups=groups, dil_h=dil_h, dil_w=dil_w, bias=bias,
            residual=residual, activation=activation, slope=slope)
    isa = extension_code(choice.isa)
    if kind is KernelKind.WINOGRAD:
        return lambda x, y, residual: _kernels.conv2d_winograd(
            x, weights, y, pad_top, pad_left, nthreads, bias=bias, residual=residual,
            activation=activation, slope=slope, isa=isa, tile=choice.tile)
    if kind is KernelKind.GROUPED:
        return lambda x, y, residual: _kernels.conv2d_grouped(
            x, weights, y, stride_h, stride_w, pad_top, pad_left, nthreads, groups=groups,
            dil_h=dil_h, dil_w=dil_w, bias=bias, residual=residual, activation=activation,
            slope=slope)
    if kind is KernelKind.DEPTHWISE:
        return lambda x, y, residual: _kernels.conv2d_depthwise(
            x, weights, y, stride_h, stride_w, pad_top, pad_left, nthreads, dil_h=dil_h,
            dil_w=dil_w, bias=bias, residual=residual, activation=activation, slope=slope,
            isa=isa)
    # the vector generic kernel; 4-D weights: RSCK for a dense NHWC call, KCRS for NCHW
    # and grouped calls
    kcrs = weights.ndim == 4 and (plan.family is not Family.DENSE or plan.layout == "NCHW")
    return lambda x, y, residual: _kernels.conv2d_generic_packed(
        x, weights, y, stride_h, stride_w, pad_top, pad_left, nthreads, False, kcrs,
        dil_h=dil_h, dil_w=dil_w, groups=groups, bias=bias, residual=residual,
        activation=activation, slope=slope, isa=isa, blocking=int(choice.blocking))


def run_nhwc_kernel(choice: dispatch.KernelChoice, plan: CallPlan, x: np.ndarray,
                    weights: np.ndarray, y: np.ndarray, nthreads: int, fused: dict) -> None:
    """Run ``choice`` on NHWC x into NHWC y with the epilogue ``fused`` (Fused.kwargs),
    see :func:`nhwc_kernel_call`."""
    nhwc_kernel_call(choice, plan, weights, nthreads, fused)(x, y, fused["residual"])


def nhwc_output(plan: CallPlan, choice: dispatch.KernelChoice, x: np.ndarray) -> np.ndarray:
    """A new NHWC output for ``choice`` on ``x``."""
    if choice.kind is KernelKind.DEPTHWISE and plan.out_shape[-1] % 16 == 0:
        return aligned_empty(plan.out_shape, x)   # stores along x's lines, as its loads
    return aligned_empty(plan.out_shape)


def _nhwc(plan, choice, x, weights, nthreads, fused: Fused, out,
          kernel: Optional[KernelCall] = None):
    # ``kernel``: this call's kernel already bound (a Conv2d called again)
    y = out if out is not None else nhwc_output(plan, choice, x)
    if kernel is None:
        kernel = nhwc_kernel_call(choice, plan, weights, nthreads, fused.kwargs())
    kernel(x, y, fused.residual)
    return y


def _nchw_pointwise(plan, choice, x, weights, nthreads, fused: Fused, out):
    # x, y, the residual and torch's (K, C, 1, 1) weights as they are (family_weights
    # gives a Conv2d's back in that layout); a strided layer's pixels gathered into a
    # scratch input first
    spec = plan.spec
    if spec.stride_h > 1 or spec.stride_w > 1:
        x = _kernels.subsample_nchw(x, spec.stride_h, spec.stride_w, nthreads,
                                    scratch("x", (spec.n, spec.c, spec.ho, spec.wo)))
    y = out if out is not None else aligned_empty(plan.out_shape)
    _kernels.conv2d_pointwise_nchw(x, weights, y, nthreads, **fused.kwargs())
    return y


def _nchw_depthwise(plan, choice, x, weights, nthreads, fused: Fused, out):
    # x, y, the residual and torch's weights as they are
    y = out if out is not None else aligned_empty(plan.out_shape)
    _kernels.conv2d_depthwise_nchw(x, weights, y, *_generic_args(plan.spec), nthreads,
                                   **_dilation(plan.spec), **fused.kwargs())
    return y


def _nchw_entry(plan, choice, x, weights, nthreads, fused: Fused, out):
    # the searched kernel reads x and writes y in NCHW itself (tiles buffered and
    # transposed in cache), the residual as it is
    y = out if out is not None else aligned_empty(plan.out_shape)
    _run_searched(choice, x, weights, y, nthreads, fused.kwargs(), nchw_out=True)
    return y


def _nchw_input_converted(plan: CallPlan, x: np.ndarray, nthreads: int) -> np.ndarray:
    spec = plan.spec
    return _kernels.nchw_to_nhwc(x, nthreads, scratch("x", spec.input_shape()[:3]
                                                      + (spec.c * plan.groups,)), layout_isa())


def _nchw_generic(plan, choice, x, weights, nthreads, fused: Fused, out, in_place=False):
    # the vector generic kernel (AVX-512F or AVX2) writes NCHW from its tiles, the NCHW
    # residual as it is: no second pass; it takes KCRS weights (a per-call conv2d) or
    # packed ones (Conv2d)
    if not in_place:
        x = _nchw_input_converted(plan, x, nthreads)
    spec = plan.spec
    y = out if out is not None else aligned_empty(plan.out_shape)
    _kernels.conv2d_generic_packed(x, weights, y, *_generic_args(spec), nthreads, True,
                                   weights.ndim == 4, groups=plan.groups, **_dilation(spec),
                                   **fused.kwargs(), isa=extension_code(choice.isa),
                                   nchw_in=in_place, blocking=int(choice.blocking))
    return y


def _nchw_generic_in_place(plan, choice, x, weights, nthreads, fused: Fused, out):
    return _nchw_generic(plan, choice, x, weights, nthreads, fused, out, in_place=True)


def _nchw_converted(plan, choice, x, weights, nthreads, fused: Fused, out):
    x = _nchw_input_converted(plan, x, nthreads)
    nhwc = plan.nhwc_out_shape
    residual = None
    if fused.residual is not None:
        residual = _kernels.nchw_to_nhwc(fused.residual, nthreads, scratch("r", nhwc),
                                         layout_isa())
    y = scratch("y", nhwc)
    if y is None:
        y = np.empty(nhwc, dtype=FLOAT32)
    run_nhwc_kernel(choice, plan, x, weights, y, nthreads, fused.kwargs(residual))
    return _kernels.nhwc_to_nchw(y, nthreads, out, layout_isa())


_Runner = Callable[..., np.ndarray]

#: The runner of each route.
RUNNERS: dict[Route, _Runner] = {
    Route.NHWC: _nhwc,
    Route.NCHW_POINTWISE: _nchw_pointwise,
    Route.NCHW_DEPTHWISE: _nchw_depthwise,
    Route.NCHW_ENTRY: _nchw_entry,
    Route.NCHW_GENERIC_IN_PLACE: _nchw_generic_in_place,
    Route.NCHW_GENERIC: _nchw_generic,
    Route.NCHW_CONVERTED: _nchw_converted,
}
assert set(RUNNERS) == set(Route), "every route has a runner"


def execute(plan: CallPlan, selection: Selection, x: np.ndarray, weights: np.ndarray,
            nthreads: int, fused: Fused = BARE, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Run the selected kernel on input ``x`` (the plan's layout) with weights already in
    the kernel's format, the epilogue fused; returns the output (``out`` when given)."""
    return RUNNERS[selection.route](plan, selection.choice, x, weights, nthreads, fused, out)
