"""Weights in the format of the kernel that serves a call.

Dense kernels read weight panels (K split into vectors of ``panel`` outputs, see
``ConvSpec.packed_weight_shape``); the depthwise, grouped and NCHW pointwise kernels read
their own formats (``family_weights``). A per-call ``conv2d`` packs on every call, in one
parallel pass into a reused per-thread buffer, or lets the generic kernel's threads pack
what they use; where the same array comes back unchanged the packed copy is reused
(``weight_cache``). ``Conv2d`` packs once through ``family_weights`` and the panel packer.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import _kernels
from ..core.kinds import KernelKind
from ..core.weights import grouped_blocks, pack_panels
from . import dispatch, weight_cache, winograd
from .call_plan import CallPlan, Family
from .routes import Selection, select
from .scratch import aligned_copy, scratch
from .settings import layout_isa

_SEARCHED = (KernelKind.TUNED, KernelKind.JIT)


def family_weights(w: np.ndarray, layout: str, plan: CallPlan,
                   choice: dispatch.KernelChoice, nthreads: int = 1) -> Optional[np.ndarray]:
    """The weights of a depthwise, grouped or NCHW pointwise call in its kernel's format
    (None for any other dense call): (R, S, 1, C) for the NHWC depthwise kernel, torch's
    (C, 1, R, S) for the NCHW one, KCRS for the vector generic kernel (its threads pack
    each group's panels), RSCK for the portable one, each group's panels in turn for a
    kernel searched for the grouped problem; torch's (K, C, 1, 1) for the NCHW pointwise
    kernel."""
    if choice.kind is KernelKind.POINTWISE:
        # KCRS as a per-call conv2d has it; a Conv2d's RSCK transposed back once: read as
        # (C, K), each input channel's weights are K floats apart, a page apart on wide
        # layers (Yolo9000-23: 2.8x slower than from KCRS on a Zen 4)
        spec = plan.spec
        return w if w.shape == (spec.k, spec.c, 1, 1) \
            else aligned_copy(w.transpose(3, 2, 0, 1))
    if plan.family is Family.DENSE:
        return None
    if choice.kind in _SEARCHED:
        rsck = w if layout == "NHWC" else np.ascontiguousarray(w.transpose(2, 3, 1, 0))
        return pack_panels(rsck, choice.problem, choice.panel, nthreads)
    if choice.kind is KernelKind.GROUPED:
        return grouped_weights(w, layout)
    if choice.kind is KernelKind.DEPTHWISE:
        if choice.nchw or layout == "NHWC":
            return w   # (C, 1, R, S) for the NCHW kernel, (R, S, 1, C) for the NHWC one
        return aligned_copy(w.transpose(2, 3, 1, 0))
    if choice.panel:  # KCRS (K, C/groups, R, S)
        return w if layout == "NCHW" else aligned_copy(w.transpose(3, 2, 0, 1))
    return aligned_copy(w.transpose(2, 3, 1, 0)) if layout == "NCHW" else w


def grouped_weights(w: np.ndarray, layout: str) -> np.ndarray:
    """The grouped kernel's weights (``weights.grouped_blocks``) from RSCK (R, S, cg, K)
    or torch's KCRS (K, cg, R, S)."""
    return grouped_blocks(w if layout == "NHWC" else w.transpose(2, 3, 1, 0))


def pack_per_call(w: np.ndarray, plan: CallPlan, choice: dispatch.KernelChoice,
                  nthreads: int) -> np.ndarray:
    """The weights of one call in the kernel's format (panels of width ``panel``, or RSCK
    for 0), packed in one parallel pass into this thread's scratch buffer: KCRS straight
    into panels for NCHW, RSCK into panels for NHWC (RSCK already is the format of
    panel 0, and of a panel as wide as K). The vector generic kernel takes the weights as
    they are (RSCK, or KCRS): its threads pack the panels they use into buffers of their own,
    so the weights are read once instead of read, written and read back (ResNet18-12 per
    call at 2 threads, caches cold: 1.35 ms packed beforehand against 0.73 pre-packed), or
    on a small output read RSCK in place (see generic_conv.inc)."""
    grouped = family_weights(w, plan.layout, plan, choice, nthreads)
    if grouped is not None:
        return grouped
    spec, panel = plan.spec, choice.panel
    if choice.kind is KernelKind.WINOGRAD:
        return winograd.transformed(w, plan.layout, nthreads, choice.isa,
                                    reuse_buffer=True, tile=choice.tile)
    if choice.kind is KernelKind.GENERIC and panel:
        return w  # RSCK or KCRS: the kernel's threads pack what they use
    if plan.layout == "NCHW":
        shape = spec.weight_shape() if panel == 0 else spec.packed_weight_shape(panel)
        return _kernels.pack_weights_kcrs(w, panel, nthreads, scratch("w", shape),
                                          layout_isa())
    if panel == 0 or panel == spec.k:
        return _kernels.pack_weights(w, panel, nthreads) if panel else w
    return _kernels.pack_weights(w, panel, nthreads,
                                 scratch("w", spec.packed_weight_shape(panel)))


def call_weights(w: np.ndarray, callers: bool, plan: CallPlan,
                 nthreads: int) -> tuple[np.ndarray, Selection]:
    """The weights of a per-call conv2d in its kernel's format, and what serves it: the
    packed weights a Conv2d would hold, with its kernel, when ``w`` (the caller's own
    array, ``callers``) holds the bytes they were packed from on an earlier call (see
    weight_cache); else the per-call kernel, its weights packed for this call.

    The reuse serves calls on many threads (``weight_cache.MIN_THREADS``), and NHWC
    calls whose per-call kernel would pack its weights in a pass of its own: checking
    RSCK weights against their panels reads what that pass reads and writes nothing.
    Below that thread count the generic kernel's threads pack what they use as they go,
    reading the weights once, where a check reads them and the panels (a 16-core Xeon at
    1-4 threads: 0.95-1.30 of the time without it on the generic kernel's layers). The
    Winograd kernel's transformed weights are always reused this way; where they cannot
    be and are large, a direct kernel serves instead (see ``winograd``)."""
    selection = select(plan, nthreads)
    choice = selection.choice
    if callers and plan.family is Family.DENSE and w.nbytes >= weight_cache.MIN_BYTES:
        # the Winograd kernel's transform is a pass of its own, in every layout (it
        # serves per-call and pre-packed calls alike)
        separate_pass = choice.kind is KernelKind.WINOGRAD or (
            plan.layout == "NHWC" and choice.kind in _SEARCHED
            and choice.panel not in (0, plan.spec.k))
        if separate_pass or nthreads >= weight_cache.MIN_THREADS:
            packed_selection = select(plan, nthreads, per_call=False)
            packed_kind = packed_selection.choice.kind
            pack = panel_packer(plan, packed_selection.choice, nthreads)
            if pack is not None:
                # panels are RSCK's rows cut up, compared with w as they are; the
                # transformed and the KCRS-packed weights keep a copy to compare with
                packed = weight_cache.CACHE.packed(
                    w, (plan.layout, packed_kind, packed_selection.choice.panel,
                        packed_selection.choice.tile), pack,
                    nthreads, weight_cache.Check.PANELS if plan.layout == "NHWC"
                    and packed_kind is not KernelKind.WINOGRAD else weight_cache.Check.COPY,
                    isa=layout_isa())
                if packed is not None:
                    return packed, packed_selection
    if choice.kind is KernelKind.WINOGRAD and not winograd.transform_per_call(w.nbytes):
        # no transformed copy to reuse, and transforming costs more than it saves
        selection = select(plan, nthreads, with_winograd=False)
        choice = selection.choice
    return pack_per_call(w, plan, choice, nthreads), selection


def panel_packer(plan: CallPlan, choice: dispatch.KernelChoice,
                 nthreads: int) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """What packs a dense call's weights (RSCK for NHWC, KCRS for NCHW) into the panels of
    ``choice`` as a Conv2d holds them, or None where nothing is packed (RSCK is already
    the panel of a K-wide kernel; the NCHW pointwise and portable kernels take the
    weights as they are)."""
    panel = choice.panel
    if choice.kind is KernelKind.WINOGRAD:
        return lambda w: winograd.transformed(w, plan.layout, nthreads, choice.isa,
                                              tile=choice.tile)
    if panel == 0 or choice.kind is KernelKind.POINTWISE or not choice.isa.vector:
        return None
    if plan.layout == "NHWC":
        if panel == plan.spec.k:
            return None
        return lambda w: _kernels.pack_weights(w, panel, nthreads)
    return lambda w: _kernels.pack_weights_kcrs(w, panel, nthreads, None, layout_isa())


def set_weight_cache(max_bytes: int) -> int:
    """Bound the memory that per-call ``conv2d`` keeps to reuse packed weights across
    calls with the same weight array (the packed weights of arrays of 128 KB and more,
    and for torch's KCRS weights a private copy to check them against; the least
    recently used dropped first); 0 turns the reuse off. Returns the previous bound
    (default 256 MiB). The reuse is never wrong: a call checks the caller's array bit for
    bit and packs again when anything changed. Used on 8 threads or more, and for NHWC
    calls whose searched kernel packs in a pass of its own (see ``call_weights``)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    return weight_cache.CACHE.resize(max_bytes)
