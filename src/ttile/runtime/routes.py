"""Which kernel serves a call, and the route its arrays take to it.

A call's kernel comes from one chain, ``choose``: the families dispatch does not decide
(depthwise, grouped, NCHW 1x1), then ``dispatch.choose`` (registry, memory, disk cache,
run-time tuning, generic kernel) and ``dispatch.for_call`` (a per-call call pays for
packing weights). The route - which layout conversions surround the kernel, or which
entry point reads torch's layout itself - is then a pure function of the plan, the
kernel and the thread count: :func:`route`. ``conv2d`` and ``plan`` both call
:func:`select`, so what ``plan`` reports is what a call runs; ``execute`` has one runner
per :class:`Route`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

from .. import _kernels
from ..core.kinds import GenericBlocking, Isa, KernelKind
from ..core.spec import ConvSpec
from . import dispatch, registry, settings, winograd
from .call_plan import CallPlan, Family


class Route(Enum):
    """How a call's arrays reach its kernel and come back."""

    NHWC = "nhwc"                      # an NHWC call: the kernel on the arrays as they are
    NCHW_POINTWISE = "nchw-pointwise"  # the NCHW 1x1 kernel: a matrix product per image
    NCHW_DEPTHWISE = "nchw-depthwise"  # the NCHW depthwise kernel, rows in the lanes
    NCHW_ENTRY = "nchw-entry"          # a searched kernel's NCHW entry point
    NCHW_GENERIC_IN_PLACE = "nchw-generic-in-place"  # vector generic reads and writes NCHW
    NCHW_GENERIC = "nchw-generic"      # input converted, the vector generic writes NCHW
    NCHW_CONVERTED = "nchw-converted"  # input and output converted around an NHWC kernel


@dataclass(frozen=True)
class Selection:
    """The kernel that serves a call and the route its arrays take."""

    choice: dispatch.KernelChoice
    route: Route


#: The narrowest output rows the NCHW depthwise kernel serves (it puts 16 outputs of a
#: row in the vector lanes): on a Zen 4 core, 1 thread, it took 0.46-0.83x the time of
#: converting around the NHWC kernel on rows of 10 to 112 outputs, and 1.22-1.33x on rows
#: of 7 (MobileNet's 7x7 layers and 14x14 stride-2 ones), where most lanes are idle.
DEPTHWISE_NCHW_MIN_WIDTH = 8

#: The largest weights the NCHW pointwise kernel serves: it reads all of them once per
#: 64-pixel column, from the caches; Yolo9000-23's 115 MB came from memory for each of its
#: 5 columns (195 ms against 171 through the generic kernel, Zen 4, 1 thread).
POINTWISE_MAX_WEIGHT_BYTES = 8 << 20

#: Input bytes per FLOP from which the AVX-512 generic kernel reads an NCHW call's input
#: as it is rather than converting it first, on one thread and on several (see
#: generic_reads_nchw).
GENERIC_NCHW_IN_BYTES_PER_FLOP = 2e-3
GENERIC_NCHW_IN_BYTES_PER_FLOP_THREADS = 0.6e-3


def select(plan: CallPlan, nthreads: int, per_call: bool = True,
           tune: bool = True, with_winograd: bool = True) -> Selection:
    """The kernel and route serving ``plan`` on ``nthreads`` threads, for a per-call
    ``conv2d`` or (``per_call`` False) a ``Conv2d`` with its weights packed. With
    ``tune`` False nothing is searched or built (``plan``): a shape not tuned yet reports
    the generic kernel it would run meanwhile. ``with_winograd`` False leaves the
    Winograd kernel out (a per-call call that would transform large weights on every
    call). A final selection is remembered in the plan, so a repeated call costs one
    dictionary lookup."""
    key = _choice_key(nthreads, per_call, with_winograd)
    selection = plan.choices.get(key)
    if selection is not None:
        return selection
    isa = settings.get_isa()
    use_tuned = settings.tuned_kernels_on()
    choice = _family_choice(plan, isa, nthreads, per_call, use_tuned, with_winograd, tune)
    if choice is None:
        choice = dispatch.for_call(
            dispatch.choose(plan.spec, plan.layout, nthreads, isa, use_tuned, tune=tune),
            plan.spec, plan.layout, per_call, nthreads, isa)
    selection = Selection(choice, route(plan, choice, nthreads))
    if choice.final and tune:
        plan.choices[key] = selection
    return selection


def alternatives(plan: CallPlan, nthreads: int) -> tuple[Selection, ...]:
    """What else could serve a ``Conv2d`` call of ``plan`` (weights packed) on
    ``nthreads`` threads: :func:`select`'s selection first, then the kernels a network's
    context verdict weighs against it (``ttile.torch``'s ``TTileSequence.settle``).

    Each verdict here was measured on one layer alone, warm; in a network a layer's
    weights come from memory and its input from the previous layer, and the order can
    change: ResNet-50's 14x14 256->256 3x3 took 690 us alone and 1160 in the network
    through Winograd F(4x4) (9.4 MB of transformed weights), 800 and 900 through F(2x2)
    (4.2 MB); a run-time tuned scheme on a 56x56 layer lost 15-30 % to the generic kernel
    there (Xeon model 167, 1 thread). So: a Winograd layer's other tile where it serves
    and its direct kernel, and a searched kernel's generic one. Only final selections
    take part (a background tuning may still replace the rest)."""
    default = select(plan, nthreads, per_call=False)
    found = [default]
    if not default.choice.final or plan.family is not Family.DENSE:
        return tuple(found)
    spec, isa = plan.spec, default.choice.isa

    def add(choice: dispatch.KernelChoice) -> None:
        def same(a: dispatch.KernelChoice) -> bool:
            return (a.kind, a.panel, a.tile, a.index, a.address, a.blocking) == (
                choice.kind, choice.panel, choice.tile, choice.index, choice.address,
                choice.blocking)
        if not any(same(s.choice) for s in found):
            found.append(Selection(choice, route(plan, choice, nthreads)))

    direct = default
    if default.choice.kind is KernelKind.WINOGRAD:
        if default.choice.tile == 4 and winograd.f2_serves(spec):
            add(winograd.choice(spec, isa, tile=2))
        direct = select(plan, nthreads, per_call=False, with_winograd=False)
        if direct.choice.final:
            add(direct.choice)
    generic = None
    if direct.choice.kind in (KernelKind.TUNED, KernelKind.JIT) and isa.vector:
        generic = dispatch.generic_choice(isa, spec, "the generic kernel (faster in the "
                                                     "network's context than the searched one)")
        add(generic)
    elif direct.choice.kind is KernelKind.GENERIC and direct.choice.panel:
        generic = direct.choice
    if generic is not None:
        for blocking in generic_blockings(spec, generic.panel, nthreads):
            add(replace(generic, blocking=blocking,
                        note=f"the generic kernel, blocking {blocking.name} (faster in the "
                             f"network's context than the default blocking)"))
    return tuple(found)


def generic_blockings(spec: ConvSpec, panel: int, nthreads: int) -> list[GenericBlocking]:
    """The generic kernel's blockings other than the default that change how it splits
    ``spec`` (dense, packed weights of ``panel`` wide panels) on ``nthreads``: mirrors the
    kernel's rules (``kernels/generic_conv.inc``: panel groups of the cache blocking,
    whole rows per thread where all the panels fit in 5/8 of the L2)."""
    panel_bytes = 4 * spec.r * spec.s * spec.c * panel
    kchunks = -(-spec.k // panel)
    cache = _kernels.generic_cache_bytes()
    group = max(1, cache // panel_bytes)
    found = []
    if -(-kchunks // group) > 1:
        if nthreads > 1 and 8 * kchunks * panel_bytes <= 5 * _kernels.cpu_l2_bytes():
            found.append(GenericBlocking.GROUPS_FIRST)
        if max(1, cache // 2 // panel_bytes) < group:
            found.append(GenericBlocking.SMALL_GROUPS)
        if len(found) == 2:   # both: each thread's share of the weights comes sooner
            found.append(GenericBlocking.GROUPS_FIRST | GenericBlocking.SMALL_GROUPS)
    return found


def _choice_key(nthreads: int, per_call: bool, with_winograd: bool) -> tuple:
    return (nthreads, per_call, with_winograd, settings.generation())


def remembered(plan: CallPlan, nthreads: int, per_call: bool = True,
               with_winograd: bool = True) -> Optional[Selection]:
    """The final selection ``select`` would return for these arguments without deciding
    anything, or None (none made yet, or made under other settings)."""
    return plan.choices.get(_choice_key(nthreads, per_call, with_winograd))


def route(plan: CallPlan, choice: dispatch.KernelChoice, nthreads: int) -> Route:
    """The route of a call of ``plan`` served by ``choice``: pure, nothing run or read
    but the measured thresholds below."""
    if plan.layout == "NHWC":
        return Route.NHWC
    if choice.kind is KernelKind.POINTWISE:
        return Route.NCHW_POINTWISE
    if choice.kind is KernelKind.DEPTHWISE and choice.nchw:
        return Route.NCHW_DEPTHWISE
    if choice.nchw and choice.problem.n == plan.spec.n:
        return Route.NCHW_ENTRY
    if choice.kind is KernelKind.GENERIC and choice.panel:
        return (Route.NCHW_GENERIC_IN_PLACE if generic_reads_nchw(plan, nthreads, choice.isa)
                else Route.NCHW_GENERIC)
    return Route.NCHW_CONVERTED


def generic_reads_nchw(plan: CallPlan, nthreads: int, isa: Isa) -> bool:
    """Whether the vector generic kernel reads this NCHW call's input in place.

    Reading NCHW, each pixel's channels are a plane apart, and a register block's
    broadcasts come from as many lines as it has pixels: 2-9 % slower than the NHWC call
    on the Fig. 8 layers (Zen 5), against a conversion pass over the input. On several
    threads the pass also costs the kernel: split among the threads by pixels, its
    output is read by threads that take panel groups across all rows, half of it from
    the other core's cache (ResNet18-7, 2 threads: conversion + kernel 0.30 ms, reading
    NCHW 0.245, NHWC 0.230). So reading in place pays where the input is large for the
    work. On one thread: from 3.4e-3 input bytes per FLOP (Yolo9000-2, ResNet18-2, -4,
    -7) it was 3-7 % faster; at 1.7e-3, 4 % faster (Yolo9000-4), even (ResNet18-6) or 4 %
    slower (ResNet18-10); below, 1-5 % slower. On two: 1-6 % faster down to 0.87e-3
    (ResNet18-9), even or 3-5 % slower at 0.43e-3 and 0.22e-3 (Yolo9000-12, ResNet18-12,
    Yolo9000-18). Inputs of fewer than 8 channels convert: NHWC's contiguous (s, c)
    steps served a 3-channel 7x7 layer 10 % faster. Measured on the AVX-512 family only;
    the AVX2 one converts."""
    spec = plan.spec
    if isa is not Isa.AVX512F or spec.c < 8:
        return False
    input_bytes = 4 * spec.n * spec.c * spec.h * spec.w   # per group, as spec.flops
    per_flop = (GENERIC_NCHW_IN_BYTES_PER_FLOP_THREADS if nthreads > 1
                else GENERIC_NCHW_IN_BYTES_PER_FLOP)
    return input_bytes >= per_flop * spec.flops


def _searched_nchw_entry(spec: ConvSpec, nthreads: int, isa: Isa, per_call: bool,
                         use_tuned: bool) -> bool:
    """Whether the registry serves an NCHW call of ``spec`` here with a searched kernel
    through its NCHW entry point (and a per-call call keeps it rather than the generic
    kernel, see ``dispatch.for_call``)."""
    if not use_tuned:
        return False
    entry = registry.lookup(spec, nthreads, isa=isa)
    if entry is None or entry.kind is not KernelKind.TUNED or not entry.nchw:
        return False
    choice = dispatch.for_call(dispatch.registry_choice(entry, isa), spec, "NCHW", per_call,
                               nthreads, isa)
    return choice.kind is KernelKind.TUNED


def _family_choice(plan: CallPlan, isa: Isa, nthreads: int, per_call: bool,
                   use_tuned: bool, with_winograd: bool,
                   tune: bool = True) -> Optional[dispatch.KernelChoice]:
    """The kernel of a depthwise or grouped call, of a 3x3 call the Winograd kernel
    serves, or of an NCHW 1x1 call (None for any other dense call: dispatch decides)."""
    if plan.family is Family.DENSE:
        spec = plan.spec
        if with_winograd and winograd.serves(spec, isa) and not (
                per_call and winograd.tile_for(spec) == 2):
            # 4x (F(4x4)) or 2.25x (F(2x2)) fewer multiplications than any direct kernel
            # (see runtime/winograd.py). F(2x2) serves the small maps with many
            # channels, whose weights a per-call call would check against its copy
            # (9.4 MB for 7x7 512->512) and read transformed (16.8 MB) where the direct
            # kernel reads them once: it serves layers that keep their weights packed
            return winograd.choice(spec, isa)
        if plan.layout == "NCHW" and isa is Isa.AVX512F and spec.r == spec.s == 1 \
                and spec.pad_top == spec.pad_bottom == spec.pad_left == spec.pad_right == 0 \
                and 4 * spec.k * spec.c <= POINTWISE_MAX_WEIGHT_BYTES:
            # a matrix product per image in torch's layout: on a Zen 4 core it took 0.35-0.9x
            # the time of the searched kernels' NCHW entry points and of converting around
            # the NHWC kernels (Yolo9000-5: 4.0 ms against 8.7; MobileNetV2's 96->24
            # projection at 56x56: 0.15 against 0.41). A strided layer runs on the pixels
            # it reads, gathered first (ResNet18-5 and -11 on a Zen 5 core: 0.105 and 0.092
            # ms converting around the NHWC kernel, 0.069 and 0.072 gathered by numpy)
            strided = spec.stride_h > 1 or spec.stride_w > 1
            if strided and _searched_nchw_entry(spec, nthreads, isa, per_call, use_tuned):
                # a searched kernel's NCHW entry point reads just those pixels, with no
                # gathering pass (ResNet18-5, Zen 5, 2 threads: 0.037 ms against 0.042)
                return None
            note = ("the NCHW pointwise kernel (a matrix product per image in torch's "
                    "layout" + (", on the strided pixels gathered first)" if strided
                                else ", nothing converted)"))
            return dispatch.KernelChoice(kind=KernelKind.POINTWISE, problem=spec, panel=0,
                                         nchw=True, note=note)
        return None
    if plan.family is Family.DEPTHWISE and isa in (Isa.AVX512F, Isa.AVX2):
        if plan.layout == "NCHW" and isa is Isa.AVX512F \
                and plan.spec.wo >= DEPTHWISE_NCHW_MIN_WIDTH \
                and _kernels.depthwise_nchw_supported(plan.spec.s, plan.spec.stride_w):
            return dispatch.KernelChoice(kind=KernelKind.DEPTHWISE, problem=plan.spec,
                                         panel=0, nchw=True,
                                         note="the NCHW depthwise kernel (16 outputs of a "
                                              "row in the vector lanes, nothing converted)")
        return dispatch.KernelChoice(kind=KernelKind.DEPTHWISE, problem=plan.spec, panel=0,
                                     isa=isa, note="the depthwise kernel (channels in the "
                                                   "vector lanes)")
    searched = _grouped_search(plan, isa, nthreads, use_tuned, tune)
    if searched is not None and searched.kind in (KernelKind.TUNED, KernelKind.JIT):
        return searched
    fallback = _grouped_fallback(plan, isa)
    if searched is None:
        return fallback
    # the search's verdict (or why there is none) on the kernel that serves instead
    return replace(fallback, final=searched.final, degraded=searched.degraded,
                   note=f"{fallback.note}; {searched.note}" if searched.note
                   else fallback.note)


def _grouped_search(plan: CallPlan, isa: Isa, nthreads: int, use_tuned: bool,
                    tune: bool) -> Optional[dispatch.KernelChoice]:
    """The verdict on a grouped call's problem searched as one (``ConvSpec.groups``: a
    scheme tiles one group, its kernel runs it on every group, reading and writing each
    group's channels where they are), measured against the kernel that serves the call
    otherwise (``_grouped_fallback``); None where no vector kernel can be searched.
    ShuffleNet's grouped 1x1 layers and AlexNet's groups of 2 are such problems: layers
    of 12-192 channels a group, which the generic kernel ran group by group at half the
    speed of their searched kernels; ResNeXt's groups of 4 and 8 channels stay with the
    grouped kernel, which their searched kernels did not beat, its groups of 16 and 32
    go to theirs (Xeon model 207, 1 and 2 threads).

    NHWC calls only: a searched grouped kernel has no NCHW entry point, and converting
    around it lost to the generic kernel reading NCHW in place (per call, 1 thread:
    AlexNet-conv4 5.2 ms against 2.2-2.6, ResNeXt-50's last grouped layer 1.2-1.3
    against 0.55, ShuffleNet's 0.27-0.44 against 0.21-0.34). A converted network's
    layers are NHWC calls."""
    if not isa.vector or plan.layout != "NHWC":
        return None
    return dispatch.choose(replace(plan.spec, groups=plan.groups), plan.layout, nthreads,
                           isa, use_tuned, tune=tune)


def _grouped_fallback(plan: CallPlan, isa: Isa) -> dispatch.KernelChoice:
    """The kernel of a grouped call that no searched kernel serves."""
    spec = plan.spec
    if isa is Isa.AVX512F and _kernels.grouped_lanes_supported(spec.c, spec.k, plan.groups):
        # a group's 4 output channels left 12 of the generic kernel's 16 lanes idle:
        # ResNeXt-50's first grouped layer (56x56, 32 groups of 4) took 6.1 ms there and
        # 1.2 ms here on a Xeon model 207 core (torch 2.3); its 16-channel groups (14x14)
        # 0.73 and 0.49 (C timings of the kernel alone, 0.34-0.62 in noisy spells)
        return dispatch.KernelChoice(kind=KernelKind.GROUPED, problem=spec, panel=0, isa=isa,
                                     note=f"the grouped kernel ({plan.groups} groups of "
                                          f"{spec.c} channels, several groups in the lanes)")
    return dispatch.generic_choice(isa, plan.spec, f"the generic kernel, {plan.groups} groups")
