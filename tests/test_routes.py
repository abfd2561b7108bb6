"""The route selector: which layout conversions surround a call's kernel, decided once by
``routes.select`` for ``conv2d`` and ``plan`` alike.

The table-driven test checks the pure selector on constructed kernel choices without
running anything; the agreement test runs calls and records the route each one took.
"""
from dataclasses import replace

import numpy as np
import pytest

import ttile
from conftest import AVAILABLE_ISAS, requires_avx512
from ttile import KernelKind, Route
from ttile.core.kinds import Isa
from ttile.core.reference import conv_mismatch
from ttile.runtime import call_plan, execute, registry, routes, winograd
from ttile.runtime.dispatch import KernelChoice


def _plan(layout, n=1, c=64, k=64, hw=56, rs=3, stride=1, groups=1, pad=None):
    pad = rs // 2 if pad is None else pad
    if layout == "NCHW":
        x, w = (n, c, hw, hw), (k, c // groups, rs, rs)
    else:
        x, w = (n, hw, hw, c), (rs, rs, c // groups, k)
    return call_plan.call_plan(x, w, stride, pad, layout, 1, groups)


def _choice(plan, kind, panel=16, nchw=False, isa=Isa.AVX512F, n=None):
    problem = plan.spec if n is None else replace(plan.spec, n=n)
    return KernelChoice(kind=kind, problem=problem, panel=panel, nchw=nchw, isa=isa)


G, T, D, P = KernelKind.GENERIC, KernelKind.TUNED, KernelKind.DEPTHWISE, KernelKind.POINTWISE

# (case, plan arguments, choice arguments, threads, route)
TABLE = [
    ("nhwc generic", dict(layout="NHWC"), dict(kind=G), 1, Route.NHWC),
    ("nhwc searched", dict(layout="NHWC"), dict(kind=T, nchw=True), 2, Route.NHWC),
    ("nhwc depthwise", dict(layout="NHWC", c=32, k=32, groups=32), dict(kind=D, panel=0), 1,
     Route.NHWC),
    ("nchw pointwise", dict(layout="NCHW", rs=1), dict(kind=P, panel=0, nchw=True), 1,
     Route.NCHW_POINTWISE),
    ("nchw depthwise kernel", dict(layout="NCHW", c=32, k=32, groups=32),
     dict(kind=D, panel=0, nchw=True), 1, Route.NCHW_DEPTHWISE),
    ("nchw depthwise converted", dict(layout="NCHW", c=32, k=32, groups=32, hw=7),
     dict(kind=D, panel=0), 1, Route.NCHW_CONVERTED),
    ("searched nchw entry", dict(layout="NCHW"), dict(kind=T, nchw=True), 1, Route.NCHW_ENTRY),
    ("searched for one image, on a batch", dict(layout="NCHW", n=2),
     dict(kind=T, nchw=True, n=1), 1, Route.NCHW_CONVERTED),
    ("searched without nchw entry", dict(layout="NCHW"), dict(kind=KernelKind.JIT), 1,
     Route.NCHW_CONVERTED),
    # 56x56x64 3x3: 3.5e-3 input bytes per FLOP, read in place on 1 and 2 threads
    ("generic, input large for the work", dict(layout="NCHW"), dict(kind=G), 1,
     Route.NCHW_GENERIC_IN_PLACE),
    ("generic, input large for the work, 2 threads", dict(layout="NCHW"), dict(kind=G), 2,
     Route.NCHW_GENERIC_IN_PLACE),
    # 7x7x512 3x3: 0.4e-3 bytes per FLOP, converted first
    ("generic, input small for the work", dict(layout="NCHW", c=512, k=512, hw=7),
     dict(kind=G), 1, Route.NCHW_GENERIC),
    # 14x14x256 3x3: 1.7e-3 bytes per FLOP: converted on 1 thread, in place on 2
    ("generic, between the thresholds", dict(layout="NCHW", c=256, k=256, hw=14),
     dict(kind=G), 1, Route.NCHW_GENERIC),
    ("generic, between the thresholds, 2 threads", dict(layout="NCHW", c=256, k=256, hw=14),
     dict(kind=G), 2, Route.NCHW_GENERIC_IN_PLACE),
    ("generic, 3 input channels", dict(layout="NCHW", c=3), dict(kind=G), 1,
     Route.NCHW_GENERIC),
    ("generic avx2 converts", dict(layout="NCHW"), dict(kind=G, isa=Isa.AVX2), 1,
     Route.NCHW_GENERIC),
    ("portable generic", dict(layout="NCHW"), dict(kind=G, panel=0, isa=Isa.PORTABLE), 1,
     Route.NCHW_CONVERTED),
    ("grouped generic", dict(layout="NCHW", groups=4), dict(kind=G), 1,
     Route.NCHW_GENERIC_IN_PLACE),
]


@pytest.mark.parametrize("case,plan_args,choice_args,threads,expected", TABLE,
                         ids=[row[0] for row in TABLE])
def test_route_table(case, plan_args, choice_args, threads, expected):
    plan = _plan(**plan_args)
    assert routes.route(plan, _choice(plan, **choice_args), threads) is expected


def test_every_route_has_a_runner():
    assert set(execute.RUNNERS) == set(Route)
    assert {row[-1] for row in TABLE} == set(Route), "the table covers every route"


# Calls that take each route on an AVX-512 machine with tuning off, no shipped set and
# the Winograd kernel off (its 3x3 calls take NHWC and NCHW_CONVERTED: test_winograd.py)
CALLS = [
    # (x shape, w shape, stride, padding, groups, layout)
    ((1, 14, 14, 16), (3, 3, 16, 32), 1, 1, 1, "NHWC"),
    ((1, 32, 14, 14), (48, 32, 1, 1), 1, 0, 1, "NCHW"),
    ((1, 32, 14, 14), (48, 32, 1, 1), 2, 0, 1, "NCHW"),
    ((1, 32, 20, 20), (32, 1, 3, 3), 1, 1, 32, "NCHW"),
    ((1, 32, 5, 5), (32, 1, 3, 3), 1, 1, 32, "NCHW"),
    ((1, 16, 30, 30), (24, 16, 3, 3), 1, 1, 1, "NCHW"),
    ((1, 256, 7, 7), (64, 256, 3, 3), 1, 1, 1, "NCHW"),
    ((2, 24, 9, 9), (36, 6, 3, 3), 1, 1, 4, "NCHW"),
]


@pytest.mark.parametrize("isa", AVAILABLE_ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
def test_plan_reports_the_route_each_call_takes(monkeypatch, isa, threads):
    """``plan().route`` is the route the call ran, per call and pre-packed, and the
    result matches the float64 reference on every route."""
    taken = []
    for route, runner in list(execute.RUNNERS.items()):
        def recorder(*args, _route=route, _runner=runner):
            taken.append(_route)
            return _runner(*args)
        monkeypatch.setitem(execute.RUNNERS, route, recorder)
    rng = np.random.default_rng(7)
    previous = ttile.use_tuned_kernels(False)
    winograd = ttile.use_winograd(False)
    try:
        for x_shape, w_shape, stride, padding, groups, layout in CALLS:
            x = rng.uniform(-1, 1, x_shape).astype(np.float32)
            w = rng.uniform(-1, 1, w_shape).astype(np.float32)
            for prepacked in (False, True):
                reported = ttile.plan(x_shape, w_shape, stride=stride, padding=padding,
                                      groups=groups, layout=layout, threads=threads,
                                      prepacked=prepacked).route
                taken.clear()
                if prepacked:
                    y = ttile.Conv2d(w, stride=stride, padding=padding, groups=groups,
                                     layout=layout)(x, threads=threads)
                else:
                    y = ttile.conv2d(x, w, stride=stride, padding=padding, groups=groups,
                                     layout=layout, threads=threads)
                assert taken == [reported], (x_shape, w_shape, layout, prepacked)
                assert conv_mismatch(y, x, w, (stride, stride), (padding,) * 4, layout,
                                     groups=groups) is None, (x_shape, w_shape, prepacked)
    finally:
        ttile.use_tuned_kernels(previous)
        ttile.use_winograd(winograd)


@requires_avx512
def test_the_routes_without_a_searched_kernel_are_all_reached():
    """On AVX-512 with tuning off, the calls above reach every route but the searched
    kernel's NCHW entry point (which needs a shipped set: next test)."""
    previous = ttile.use_tuned_kernels(False)
    winograd = ttile.use_winograd(False)
    try:
        reached = {ttile.plan(x, w, stride=s, padding=p, groups=g, layout=lay,
                              threads=t).route
                   for x, w, s, p, g, lay in CALLS for t in (1, 2)}
    finally:
        ttile.use_tuned_kernels(previous)
        ttile.use_winograd(winograd)
    assert reached == set(Route) - {Route.NCHW_ENTRY}


@requires_avx512
def test_a_shipped_kernel_with_an_nchw_entry_takes_it(shipped_set):
    entries = [e for e in registry.KERNELS
               if e.cpu == shipped_set and e.isa is Isa.AVX512F and e.nchw
               and e.kind is KernelKind.TUNED and e.spec.r > 1 and e.spec.n == 1
               and not winograd.serves(e.spec, Isa.AVX512F)]
    assert entries, "the shipped set has kernels with an NCHW entry point"
    entry = entries[0]
    spec = entry.spec
    plan = ttile.plan((1, spec.c, spec.h, spec.w), (spec.k, spec.c, spec.r, spec.s),
                      stride=(spec.stride_h, spec.stride_w),
                      padding=((spec.pad_top, spec.pad_bottom),
                               (spec.pad_left, spec.pad_right)),
                      threads=entry.threads, prepacked=True)
    assert plan.kind is KernelKind.TUNED
    assert plan.route is Route.NCHW_ENTRY
