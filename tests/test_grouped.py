"""The grouped kernel (kernels/grouped_avx512.c): 2, 4, 8 or 16 channels a group, as
many in as out, the output channels of several groups in the vector lanes. Checked
against the float64 reference through conv2d and Conv2d, in both layouts, every tail
of a row (blocks of 8 or 6, 4, 2, 1 pixels), strides, dilation, padding and epilogues."""
from __future__ import annotations

import numpy as np
import pytest

import ttile
from ttile import _kernels
from ttile.core.reference import activate_f64, conv2d_nhwc_f64, conv_mismatch

pytestmark = pytest.mark.skipif(not ttile.has_avx512f(), reason="an AVX-512F kernel")

CASES = [  # (channels, groups, height, width, filter, stride, padding, dilation)
    (128, 32, 9, 15, 3, 1, 1, 1),    # 4 a group: blocks of 8, 4, 2, 1 along a row
    (64, 32, 7, 13, 3, 2, 1, 1),     # 2 a group, stride 2
    (64, 8, 8, 19, 3, 1, 1, 1),      # 8 a group: blocks of 6, 4, 2, 1
    (256, 16, 6, 7, 3, 1, 2, 2),     # 16 a group (broadcast steps), dilation 2
    (48, 12, 7, 11, 5, 1, 2, 1),     # 5x5, 48 channels: three 16-channel blocks
    (32, 8, 5, 9, 1, 1, 0, 1),       # 1x1 grouped (ShuffleNet-like)
    (64, 16, 10, 10, 3, 2, 0, 1),    # no padding, stride 2
]


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("case", CASES, ids=[f"c{c[0]}g{c[1]}r{c[4]}s{c[5]}" for c in CASES])
def test_the_grouped_kernel_gives_the_reference_result(case, layout):
    c, g, h, wd, r, stride, pad, dil = case
    rng = np.random.default_rng(c + g + r)
    x = rng.uniform(-1, 1, (2, h, wd, c)).astype(np.float32)
    w = rng.uniform(-1, 1, (r, r, c // g, c)).astype(np.float32)
    xa, wa = (x, w) if layout == "NHWC" else (x.transpose(0, 3, 1, 2).copy(),
                                              w.transpose(3, 2, 0, 1).copy())
    plan = ttile.plan(xa.shape, wa.shape, stride=stride, padding=pad, dilation=dil,
                      groups=g, layout=layout)
    assert plan.kind is ttile.KernelKind.GROUPED, plan
    pads = (pad,) * 4
    for threads in (1, 2):
        y = ttile.conv2d(xa, wa, None, stride, pad, dil, g, layout=layout, threads=threads)
        problem = conv_mismatch(y, xa, wa, (stride, stride), pads, layout, (dil, dil), g)
        assert problem is None, problem
    layer = ttile.Conv2d(wa, None, stride, pad, dil, g, layout=layout)
    problem = conv_mismatch(layer(xa), xa, wa, (stride, stride), pads, layout, (dil, dil), g)
    assert problem is None, problem


@pytest.mark.parametrize("activation", ["relu", "silu", "leaky_relu"])
def test_epilogues_are_fused_into_the_store(activation):
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (1, 9, 11, 64)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 4, 64)).astype(np.float32)
    b = rng.uniform(-1, 1, 64).astype(np.float32)
    res = rng.uniform(-1, 1, (1, 9, 11, 64)).astype(np.float32)
    y = ttile.conv2d(x, w, b, 1, 1, 1, 16, layout="NHWC", activation=activation,
                     residual=res, negative_slope=0.2)
    expected = activate_f64(conv2d_nhwc_f64(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 16) + b + res,
                            activation, 0.2)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_other_groupings_stay_with_the_generic_kernel():
    for c, k, g in ((128, 128, 4), (96, 96, 32), (64, 128, 16)):   # 32 a group; 3; 4 -> 8
        plan = ttile.plan((1, 8, 8, c), (3, 3, c // g, k), padding=1, groups=g, layout="NHWC")
        assert plan.kind is ttile.KernelKind.GENERIC, (c, k, g, plan)
    assert _kernels.grouped_lanes_supported(4, 4, 32)
    assert not _kernels.grouped_lanes_supported(4, 8, 32)
    assert not _kernels.grouped_lanes_supported(4, 4, 2)     # 8 channels: half a vector


def test_the_entry_point_refuses_mismatched_weights():
    x = np.zeros((1, 4, 4, 64), np.float32)
    y = np.zeros((1, 4, 4, 64), np.float32)
    with pytest.raises(ValueError, match="grouped weights must be"):
        _kernels.conv2d_grouped(x, np.zeros((4, 3, 3, 32), np.float32), y, 1, 1, 1, 1, 1,
                                groups=16)
    with pytest.raises(ValueError, match="does not serve"):
        _kernels.conv2d_grouped(x, np.zeros((4, 3, 3, 512), np.float32), y, 1, 1, 1, 1, 1,
                                groups=2)


@pytest.mark.parametrize("side", ["end", "start"])
def test_the_grouped_kernel_stays_in_bounds(side):
    """Input and output against an inaccessible page: a read or write past either faults;
    the canary around them stays (padding and the last row's tail blocks included)."""
    from guarded import guarded_copy
    rng = np.random.default_rng(9)
    x = rng.uniform(-1, 1, (1, 7, 13, 64)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 4, 64)).astype(np.float32)
    gx = guarded_copy(x, side)
    gy = guarded_copy(np.zeros((1, 7, 13, 64), np.float32), side)
    ttile.conv2d(gx.array, w, None, 1, 1, 1, 16, layout="NHWC", out=gy.array)
    assert gx.canary_intact() and gy.canary_intact()
    problem = conv_mismatch(gy.array, x, w, (1, 1), (1, 1, 1, 1), "NHWC", (1, 1), 16)
    assert problem is None, problem


def test_a_grouped_call_is_searched_as_one_problem(jit_cache):
    """A grouped layer no lane kernel serves (ShuffleNet-like: 4 groups of 12 -> 24, 1x1)
    is tuned as one problem (``ConvSpec.groups``), cached under its own key, and its
    kernel serves NHWC conv2d and Conv2d with the epilogue fused (an NCHW call keeps the
    generic kernel); the same layer with tuning off keeps the generic kernel."""
    import json
    import math
    from conftest import forget_choices
    previous = ttile.set_tuning(ship=ttile.ShipPolicy(max_time_ratio=math.inf))
    try:
        rng = np.random.default_rng(4)
        c, k, g = 48, 96, 4
        x = rng.uniform(-1, 1, (1, 10, 12, c)).astype(np.float32)
        w = rng.uniform(-1, 1, (1, 1, c // g, k)).astype(np.float32)
        b = rng.uniform(-1, 1, k).astype(np.float32)
        res = rng.uniform(-1, 1, (1, 10, 12, k)).astype(np.float32)
        want = activate_f64(conv2d_nhwc_f64(x, w, (1, 1), (0, 0, 0, 0), (1, 1), g) + b + res,
                            "relu")
        y = ttile.conv2d(x, w, b, groups=g, layout="NHWC", activation="relu", residual=res)
        plan = ttile.plan(x.shape, w.shape, groups=g, layout="NHWC", threads=1)
        assert plan.kind is ttile.KernelKind.JIT, plan
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        [meta] = sorted(jit_cache.glob("kernels-v*/*.json"))
        assert json.loads(meta.read_text())["key"]["problem"].endswith("_g4")
        layer = ttile.Conv2d(w, b, groups=g, layout="NHWC", activation="relu")
        np.testing.assert_allclose(layer(x, residual=res), want, rtol=1e-5, atol=1e-5)
        x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        w_kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
        y_nchw = ttile.conv2d(x_nchw, w_kcrs, b, groups=g, activation="relu",
                              residual=np.ascontiguousarray(res.transpose(0, 3, 1, 2)))
        np.testing.assert_allclose(y_nchw.transpose(0, 2, 3, 1), want, rtol=1e-5, atol=1e-5)
        # NCHW calls keep the kernel that reads NCHW in place (no searched NCHW entry)
        assert ttile.plan(x_nchw.shape, w_kcrs.shape, groups=g).kind is ttile.KernelKind.GENERIC
    finally:
        ttile.restore_tuning(previous)
    ttile.set_tuning(mode="never")
    forget_choices()
    plan = ttile.plan(x.shape, w.shape, groups=g, layout="NHWC", threads=1)
    assert plan.kind is ttile.KernelKind.GENERIC and "tuning is off" in plan.note, plan


def test_a_grouped_search_that_loses_keeps_the_grouped_kernel(jit_cache):
    """Where no searched kernel beats the grouped kernel (a policy no kernel can meet),
    the grouped kernel serves, and plan() says the search's verdict."""
    from conftest import forget_choices
    previous = ttile.set_tuning(ship=ttile.ShipPolicy(max_time_ratio=1e-9))
    try:
        x = np.random.default_rng(6).uniform(-1, 1, (1, 8, 9, 64)).astype(np.float32)
        w = np.random.default_rng(7).uniform(-1, 1, (3, 3, 4, 64)).astype(np.float32)
        y = ttile.conv2d(x, w, None, 1, 1, 1, 16, layout="NHWC")
        plan = ttile.plan(x.shape, w.shape, padding=1, groups=16, layout="NHWC", threads=1)
        assert plan.kind is ttile.KernelKind.GROUPED, plan
        assert "no scheme beat the kernel serving its groups" in plan.note, plan
        problem = conv_mismatch(y, x, w, (1, 1), (1, 1, 1, 1), "NHWC", (1, 1), 16)
        assert problem is None, problem
    finally:
        ttile.restore_tuning(previous)
        forget_choices()
