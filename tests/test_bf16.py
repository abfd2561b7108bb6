"""precision="bf16": every bf16 kernel this CPU runs (AMX, AVX512_BF16) and the fp32
kernels on rounded values checked against the float64 reference on the bf16-rounded
input and weights; the rounding against ml_dtypes; the API's choices and refusals."""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import ttile
from ttile import _kernels
from ttile.core.kinds import Isa, KernelKind, Precision
from ttile.core.reference import activate_f64, conv2d_nhwc_f64
from ttile.core.spec import ConvSpec
from ttile.runtime import bf16

from guarded import guarded_copy

ml_dtypes = pytest.importorskip("ml_dtypes")

HAS_AMX = _kernels.amx_usable()
HAS_DOT = _kernels.cpu_has_avx512bf16()
KINDS = [pytest.param(KernelKind.AMX, marks=pytest.mark.skipif(
             not HAS_AMX, reason="no AMX-BF16 on this CPU (or Linux refused the tile state)")),
         pytest.param(KernelKind.DOT_BF16, marks=pytest.mark.skipif(
             not HAS_DOT, reason="no AVX512_BF16 on this CPU"))]


def expected(x, w, stride, pads, dilation=(1, 1), bias=None, residual=None,
             activation=None, groups=1, slope=0.01):
    """float64 reference of the bf16 semantics, NHWC: the rounded input and weights
    convolved, then bias, residual and activation; and the tolerance of an fp32 sum."""
    xr, wr = bf16.round_to_bf16(x), bf16.round_to_bf16(w)
    y = conv2d_nhwc_f64(xr, wr, stride, pads, dilation, groups)
    magnitude = conv2d_nhwc_f64(np.abs(xr), np.abs(wr), stride, pads, dilation, groups)
    if bias is not None:
        y = y + bias
        magnitude = magnitude + np.abs(bias)
    if residual is not None:
        y = y + residual
        magnitude = magnitude + np.abs(residual)
    terms = w.shape[0] * w.shape[1] * w.shape[2]
    tol = 8 * np.sqrt(terms) * np.finfo(np.float32).eps * magnitude + 1e-30
    return activate_f64(y, activation, slope), tol


def assert_close(actual, want, tol):
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == want.shape
    bad = ~(np.abs(actual - want) <= tol)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} off; first at "
                           f"{tuple(np.argwhere(bad)[0])}")


# (n, h, w, c, k, r, s, stride, pad, dilation)
SHAPES = [
    (1, 7, 7, 64, 64, 3, 3, 1, 1, 1),       # 7x7 map: virtual rows across the padding
    (2, 14, 13, 48, 40, 3, 3, 1, 1, 1),     # K tail, odd width, batch 2, steps of 24
    (1, 15, 15, 32, 96, 3, 3, 2, 1, 1),     # stride 2 (phase planes)
    (1, 16, 16, 64, 16, 1, 1, 2, 0, 1),     # 1x1 stride 2, a K of 16 (half a pair)
    (2, 14, 14, 64, 64, 3, 3, 2, 1, 1),     # stride 2, 7x7 out, batch 2: tiles across images' rows
    (1, 13, 10, 32, 32, 3, 3, 2, 0, 1),     # stride 2 unpadded, h != w, odd h
    (1, 17, 17, 48, 40, 5, 5, 2, 2, 1),     # 5x5 stride 2: taps two plane pixels on
    (1, 28, 28, 256, 64, 1, 1, 2, 0, 1),    # 1x1 stride 2: plane (0, 0) alone
    (1, 9, 11, 64, 33, 3, 3, 1, 2, 2),      # dilation 2
    (1, 20, 20, 3, 64, 7, 7, 2, 3, 1),      # the first layer: folded
    (2, 21, 19, 3, 40, 3, 3, 1, 1, 1),      # folded, stride 1
    (1, 12, 12, 5, 24, 3, 3, 1, 1, 1),      # folded, odd channels
    (1, 15, 14, 3, 24, 3, 3, 1, 2, 2),      # folded, dilation 2
    (1, 17, 16, 4, 16, 5, 5, 2, 2, 1),      # folded, 5x5 stride 2
    (1, 40, 37, 3, 32, 7, 7, 2, 3, 1),      # folded 7x7 stride 2: 16 pixels a group, 3 more
    (1, 36, 38, 5, 16, 5, 5, 2, 2, 1),      # folded, 25 values of 26 lanes, in groups
    (1, 9, 21, 15, 16, 3, 3, 1, 1, 1),      # folded, 45 values of 48 lanes: 24 vectors a group
    (1, 9, 21, 15, 16, 7, 7, 1, 3, 1),      # folded, 105 values of 112 lanes: pixel by pixel
    (1, 10, 10, 144, 32, 1, 1, 1, 0, 1),    # steps of 30 (144 = 5 x 30 rounded)
    (1, 8, 8, 16, 48, 3, 3, 1, 1, 1),       # 16 channels: one step of 16
    (1, 6, 6, 7, 8, 1, 1, 1, 0, 1),         # 1x1 with few channels (not folded)
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_against_reference(kind, shape):
    n, h, w, c, k, r, s, st, pad, dil = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = rng.standard_normal((r, s, c, k)).astype(np.float32)
    spec = ConvSpec(n=n, k=k, c=c, h=h, w=w, r=r, s=s, stride_h=st, stride_w=st,
                    pad_top=pad, pad_bottom=pad, pad_left=pad, pad_right=pad,
                    dilation_h=dil, dilation_w=dil)
    pack = bf16.packing(spec, kind)
    assert (pack.folded is not None) == (c < bf16.FOLD_BELOW_CHANNELS and s > 1)
    wb = bf16.pack_weights(wt, "NHWC", pack, 2)
    y = np.full(spec.output_shape(), np.nan, dtype=np.float32)
    bf16.run(pack, x, False, wb, y, 2, None, None, 0, 0.01)
    want, tol = expected(x, wt, (st, st), (pad,) * 4, (dil, dil))
    assert_close(y, want, tol)


# (k, c, h, rs, pad): a 3x3 layer whose tiles cross rows and a K tail (stored row by
# row), and a 1x1 one whose tiles are runs of consecutive outputs (stored whole)
EPILOGUE_SPECS = [(40, 32, 9, 3, 1), (64, 32, 8, 1, 0)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", EPILOGUE_SPECS, ids=str)
def test_kernel_epilogue_and_bf16_output(kind, shape):
    k, c, h, rs, pad = shape
    rng = np.random.default_rng(7)
    spec = ConvSpec(n=1, k=k, c=c, h=h, w=h, r=rs, s=rs, pad_top=pad, pad_bottom=pad,
                    pad_left=pad, pad_right=pad)
    x = rng.standard_normal((1, h, h, c)).astype(np.float32)
    wt = rng.standard_normal((rs, rs, c, k)).astype(np.float32)
    bias = rng.standard_normal(k).astype(np.float32)
    res = rng.standard_normal(spec.output_shape()).astype(np.float32)
    pack = bf16.packing(spec, kind)
    wb = bf16.pack_weights(wt, "NHWC", pack, 1)
    acts = (("relu", 1), ("relu6", 2), ("leaky_relu", 3), ("silu", 4), (None, 0))
    for (act, code), with_bias, with_res in itertools.product(acts, (False, True),
                                                              (False, True)):
        b, r = (bias if with_bias else None), (res if with_res else None)
        y = np.empty(spec.output_shape(), np.float32)
        bf16.run(pack, x, False, wb, y, 1, b, r, code, 0.1)
        want, tol = expected(x, wt, (1, 1), (pad,) * 4, bias=b, residual=r,
                             activation=act, slope=0.1)
        assert_close(y, want, tol + 1e-6 * np.abs(want))
        # bf16 output (and residual): the fp32 result rounded once
        yb = np.empty(spec.output_shape(), np.uint16)
        rb = None if r is None else _kernels.bf16_round(r)
        bf16.run(pack, x, False, wb, yb, 1, b, rb, code, 0.1)
        want, tol = expected(x, wt, (1, 1), (pad,) * 4, bias=b,
                             residual=None if r is None else bf16.round_to_bf16(r),
                             activation=act, slope=0.1)
        got = (yb.astype(np.uint32) << 16).view(np.float32)
        assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + tol + 1e-6)


def test_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(3)
    a = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -3e-39, 3.4e38,
                                  1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9],
                                 dtype=np.float32)])
    want = a.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(bf16.round_to_bf16(a).view(np.uint32) >> 16, want)
    if _kernels.cpu_has_avx512f():
        assert np.array_equal(_kernels.bf16_round(a), want)
        assert np.array_equal(_kernels.bf16_widen(want),
                              a.astype(ml_dtypes.bfloat16).astype(np.float32))
    nan = np.array([np.nan], np.float32)
    assert np.isnan(bf16.round_to_bf16(nan)).all()
    if _kernels.cpu_has_avx512f():
        assert np.isnan(_kernels.bf16_widen(_kernels.bf16_round(nan))).all()


LAYER_CASES = [  # (layout, stride, padding, activation, residual?)
    ("NCHW", 1, 1, None, False),
    ("NHWC", 2, 1, "relu", True),
    ("NCHW", 2, 0, "relu6", True),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=str)
@pytest.mark.parametrize("isa", [Isa.AVX512F, Isa.AVX2])
def test_conv2d_and_layer(case, isa):
    """conv2d and Conv2d with precision="bf16" on the kernel this CPU picks, and (AVX2
    asked for) on the fp32 kernels with rounded values: the same numbers."""
    if isa is Isa.AVX512F and not _kernels.cpu_has_avx512f():
        pytest.skip("no AVX-512")
    if isa is Isa.AVX2 and not _kernels.cpu_has_avx2():
        pytest.skip("no AVX2")
    layout, stride, pad, act, with_res = case
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 24, 12, 12)).astype(np.float32)
    w = rng.standard_normal((40, 24, 3, 3)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    ho = (12 + 2 * pad - 3) // stride + 1
    res = rng.standard_normal((2, 40, ho, ho)).astype(np.float32) if with_res else None
    want, tol = expected(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), (stride,) * 2,
                         (pad,) * 4, bias=b,
                         residual=None if res is None else res.transpose(0, 2, 3, 1),
                         activation=act)
    if layout == "NCHW":
        want, tol = want.transpose(0, 3, 1, 2), tol.transpose(0, 3, 1, 2)
    else:
        x, w = x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy()
        res = None if res is None else res.transpose(0, 2, 3, 1).copy()
    previous = ttile.set_isa(isa)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y = ttile.conv2d(x, w, b, stride, pad, layout=layout, activation=act,
                             residual=res, precision="bf16")
            layer = ttile.Conv2d(w, b, stride, pad, layout=layout, activation=act,
                                 precision="bf16")
            y2 = layer(x, residual=res)
            y3 = layer(x.astype(ml_dtypes.bfloat16), residual=res)
        plan = ttile.plan(x.shape, w.shape, b, stride, pad, layout=layout,
                          activation=act, residual=res, precision="bf16")
    finally:
        ttile.set_isa(previous)
    assert y.dtype == np.float32 and y2.dtype == np.float32
    assert_close(y, want, tol)
    assert_close(y2, want, tol)
    assert y3.dtype == ml_dtypes.bfloat16
    # bf16 out: the input rounded is the same input; the residual (taken in the
    # output's type) and the result rounded once more
    res_term = 0 if res is None else 2.0 ** -8 * np.abs(res)
    assert np.all(np.abs(y3.astype(np.float32) - want)
                  <= 2.0 ** -8 * np.abs(want) + res_term + tol)
    assert plan.precision is Precision.BF16
    kind = bf16.kernel_kind(isa)
    if kind is None:
        assert plan.kind not in bf16.BF16_KINDS and "bf16-rounded" in plan.note
    else:
        assert plan.kind is kind and plan.note.startswith("bf16")


# (n, c, h, w, k, r, stride, pad, activation, residual?): NCHW outputs the AMX kernel
# writes itself - 16 x 16 blocks transposed, stored whole where a tile's pixels are
# consecutive in their planes, scattered where tiles cross output rows (7x7 and 14x14
# maps, a batch), a K tail, the activations without a straight-line store
NCHW_OUT_CASES = [
    (1, 32, 16, 16, 64, 3, 1, 1, "relu", True),
    (2, 24, 7, 7, 40, 3, 1, 1, None, True),
    (1, 64, 14, 14, 48, 1, 1, 0, "relu6", False),
    (1, 16, 15, 15, 33, 3, 2, 1, "silu", True),
    (1, 3, 20, 20, 32, 7, 2, 3, "leaky_relu", False),
    (3, 40, 9, 11, 16, 3, 1, 1, "sigmoid", True),
]


@pytest.mark.parametrize("case", NCHW_OUT_CASES, ids=str)
def test_nchw_output_is_the_nhwc_output_transposed(case):
    """An NCHW call's output, written NCHW by the kernel (AMX), is the NHWC call's output
    transposed, bit for bit: the same sums, the same epilogue in the same order."""
    if not HAS_AMX:
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile state)")
    n, c, h, w, k, r, stride, pad, act, with_res = case
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((k, c, r, r)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    ho, wo = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    res = rng.standard_normal((n, k, ho, wo)).astype(np.float32) if with_res else None
    y = ttile.conv2d(x, wt, b, stride, pad, activation=act, residual=res, precision="bf16")
    y_nhwc = ttile.conv2d(np.ascontiguousarray(x.transpose(0, 2, 3, 1)),
                          np.ascontiguousarray(wt.transpose(2, 3, 1, 0)), b, stride, pad,
                          layout="NHWC", activation=act,
                          residual=None if res is None else np.ascontiguousarray(
                              res.transpose(0, 2, 3, 1)), precision="bf16")
    np.testing.assert_array_equal(y, y_nhwc.transpose(0, 3, 1, 2))
    out = np.full((n, k, ho, wo), np.nan, np.float32)
    assert ttile.Conv2d(wt, b, stride, pad, activation=act, precision="bf16")(
        x, residual=res, out=out) is out
    np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize("bf16_out", [False, True], ids=["fp32 out", "bf16 out"])
@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_outputs_larger_than_the_l2_streamed_past_the_caches(epilogue, threads, bf16_out):
    """An NHWC output larger than the L2, fp32 or bf16, is stored with non-temporal
    stores (the AMX kernel): the same numbers as the reference, with and without an
    epilogue, on one and two threads (each fences its own stores)."""
    if not HAS_AMX:
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile state)")
    l2 = _kernels.cpu_l2_bytes() or (2 << 20)
    k, c = 64, 32
    element = 2 if bf16_out else 4
    hw = int(np.sqrt(l2 / (element * k))) + 8     # k hw^2 elements > the L2
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, hw, hw, c)).astype(np.float32)
    w = rng.standard_normal((1, 1, c, k)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32) if epilogue else None
    act = "relu" if epilogue else None
    y = ttile.conv2d(x.astype(ml_dtypes.bfloat16) if bf16_out else x, w, b, layout="NHWC",
                     activation=act, threads=threads, precision="bf16")
    assert y.nbytes > l2
    want, tol = expected(x, w, (1, 1), (0, 0, 0, 0), bias=b, activation=act)
    if bf16_out:   # the fp32 result rounded once more
        assert y.dtype == ml_dtypes.bfloat16
        tol = tol + 2.0 ** -8 * np.abs(want)
    assert_close(y.astype(np.float32), want, tol)


# (n, h, w, groups, cg, kg, r, stride, pad): groups taken as super-groups of 32 output
# channels (or a multiple), each with block-diagonal weights
GROUPED_SHAPES = [
    (1, 12, 12, 32, 4, 4, 3, 1, 1),     # ResNeXt's first stage: 8 groups a super-group
    (2, 9, 11, 16, 8, 8, 3, 2, 1),      # groups of 8, stride 2 (phase planes), batch 2
    (1, 7, 7, 8, 16, 16, 3, 1, 1),      # groups of 16: 2 a super-group
    (1, 7, 9, 4, 32, 32, 3, 1, 1),      # groups of 32: each its own
    (1, 13, 13, 2, 48, 128, 5, 1, 2),   # AlexNet's: 4 channel pairs a super-group, steps of 24
    (1, 10, 10, 8, 24, 12, 1, 1, 0),    # ShuffleNet's 1x1: 12 channels a group, 8 groups
    (1, 9, 9, 4, 6, 16, 3, 1, 1),       # 2 groups of 6 channels: one step of 12
    (1, 9, 10, 3, 80, 20, 1, 1, 0),     # ShuffleNet's 3 groups of 20: one super-group, 60 of 64
    (1, 9, 9, 3, 20, 80, 1, 1, 0),      # and of 80: 240 of 256 channels
    (2, 8, 9, 3, 10, 6, 3, 2, 1),       # one super-group of 18 channels, stride 2
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=str)
def test_grouped_kernel_against_reference(kind, shape):
    n, h, w, groups, cg, kg, r, st, pad = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    x = rng.standard_normal((n, h, w, cg * groups)).astype(np.float32)
    wt = rng.standard_normal((r, r, cg, kg * groups)).astype(np.float32)
    bias = rng.standard_normal(kg * groups).astype(np.float32)
    spec = ConvSpec(n=n, k=kg, c=cg, h=h, w=w, r=r, s=r, stride_h=st, stride_w=st,
                    pad_top=pad, pad_bottom=pad, pad_left=pad, pad_right=pad, groups=groups)
    if bf16.grouped_supers(spec, kind) is None:
        assert kind is KernelKind.DOT_BF16   # more groups a super-group than it takes
        pytest.skip("the dot-product kernel takes at most "
                    f"{bf16.MAX_GROUPS_PER_SUPER[kind]} groups a super-group")
    pack = bf16.packing(spec, kind)
    assert pack.folded is None and len(pack.problem) == 18
    for layout, w_in, threads in (("NHWC", wt, 2), ("NCHW", wt.transpose(3, 2, 0, 1), 1)):
        wb = bf16.pack_weights(np.ascontiguousarray(w_in), layout, pack, threads)
        y = np.full(spec.output_shape(), np.nan, dtype=np.float32)
        bf16.run(pack, x, False, wb, y, threads, bias, None, 1, 0.01)
        want, tol = expected(x, wt, (st, st), (pad,) * 4, bias=bias, activation="relu",
                             groups=groups)
        assert_close(y, want, tol)


@pytest.mark.skipif(not (HAS_AMX or HAS_DOT), reason="no bf16 instructions on this CPU")
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_grouped_conv2d_and_layer_on_bf16_kernels(layout):
    """ResNeXt's grouped 3x3 and a grouped 1x1 through conv2d and Conv2d: served by a bf16
    kernel (plan says so), on fp32 and bf16 arrays (a 1x1 on bf16 NHWC input is read in
    place), with a residual."""
    rng = np.random.default_rng(11)
    for c, k, r, groups in ((64, 64, 3, 16), (96, 64, 1, 4)):
        x = rng.standard_normal((1, 10, 9, c)).astype(np.float32)
        w = rng.standard_normal((r, r, c // groups, k)).astype(np.float32)
        res = rng.standard_normal((1, 10, 9, k)).astype(np.float32)
        want, tol = expected(x, w, (1, 1), (r // 2,) * 4, residual=bf16.round_to_bf16(res),
                             activation="relu", groups=groups)
        if layout == "NCHW":
            x_in, w_in, res_in = x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), \
                res.transpose(0, 3, 1, 2)
            want, tol = want.transpose(0, 3, 1, 2), tol.transpose(0, 3, 1, 2)
        else:
            x_in, w_in, res_in = x, w, res
        plan = ttile.plan(x_in.shape, w_in.shape, padding=r // 2, groups=groups,
                          layout=layout, precision="bf16")
        assert plan.kind in bf16.BF16_KINDS and "super-group" in plan.note
        y = ttile.conv2d(x_in, w_in, padding=r // 2, groups=groups, layout=layout,
                         residual=bf16.round_to_bf16(res_in), activation="relu",
                         precision="bf16")
        assert_close(y, want, tol)
        layer = ttile.Conv2d(w_in, padding=r // 2, groups=groups, layout=layout,
                             activation="relu", precision="bf16")
        yb = layer(x_in.astype(ml_dtypes.bfloat16),
                   residual=res_in.astype(ml_dtypes.bfloat16))
        assert yb.dtype == ml_dtypes.bfloat16
        got = yb.astype(np.float32)
        assert_close(got, want, tol + 2.0 ** -8 * np.abs(want))


def test_grouped_and_depthwise_are_served_on_rounded_values():
    """Depthwise layers, and groups that make no super-group (3 groups of 3 channels: 9,
    an odd reduction), run the fp32 kernels on rounded values."""
    rng = np.random.default_rng(5)
    for groups, w in ((3, rng.standard_normal((12, 3, 3, 3))),
                      (8, rng.standard_normal((8, 1, 3, 3)))):
        x = rng.standard_normal((1, w.shape[1] * groups, 10, 10)).astype(np.float32)
        w = w.astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y = ttile.conv2d(x, w, padding=1, groups=groups, precision="bf16")
        want, tol = expected(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), (1, 1),
                             (1,) * 4, groups=groups)
        assert_close(y, want.transpose(0, 3, 1, 2), tol.transpose(0, 3, 1, 2))
        plan = ttile.plan(x.shape, w.shape, padding=1, groups=groups, precision="bf16")
        assert plan.kind not in bf16.BF16_KINDS
        assert ("depthwise" if groups == 8 else "no super-groups") in plan.note


@pytest.mark.parametrize("kind", KINDS)
def test_output_fenced_by_guard_pages(kind):
    """The kernel writes exactly the output: a guard page after y and x faults on any
    stray access, the canary before them stays."""
    rng = np.random.default_rng(2)
    gx = guarded_copy(rng.standard_normal((1, 13, 11, 24)).astype(np.float32), "end")
    w = rng.standard_normal((3, 3, 24, 20)).astype(np.float32)
    gy = guarded_copy(np.zeros((1, 13, 11, 20), np.float32), "end")
    x, out = gx.array, gy.array
    previous = ttile.set_isa(Isa.AVX512F)
    try:
        ttile.conv2d(x, w, padding=1, layout="NHWC", out=out, precision="bf16")
    finally:
        ttile.set_isa(previous)
    assert gy.canary_intact() and gx.canary_intact()
    want, tol = expected(np.asarray(x), w, (1, 1), (1,) * 4)
    assert_close(out, want, tol)


def test_bad_arguments():
    x = np.zeros((1, 4, 8, 8), np.float32)
    w = np.zeros((8, 4, 3, 3), np.float32)
    with pytest.raises(ValueError, match="precision"):
        ttile.conv2d(x, w, precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        ttile.Conv2d(w, precision="int8")
    with pytest.raises(ValueError, match="precision"):
        ttile.plan(x.shape, w.shape, precision="bfloat")
    with pytest.raises(TypeError, match="out must be float32"):
        ttile.conv2d(x, w, out=np.zeros((1, 8, 6, 6), np.float64), precision="bf16")
    with pytest.raises(ValueError, match="channel"):
        ttile.conv2d(np.zeros((1, 5, 8, 8), np.float32), w, precision="bf16")
    with pytest.raises(ValueError, match="residual"):
        ttile.conv2d(x, w, residual=np.zeros((1, 8, 5, 5), np.float32), precision="bf16")
    with pytest.raises(TypeError):
        ttile.conv2d(x.astype(bool), w, precision="bf16")


@pytest.mark.skipif(not _kernels.cpu_has_avx512f(), reason="the packing needs AVX-512F")
def test_extension_refuses_bad_problems():
    w = np.zeros((3, 3, 8, 16), np.float32)
    good = (1, 6, 6, 16, 8, 8, 8, 8, 32, 3, 3, 1, 1, 1, 1, 0)
    _kernels.bf16_pack_weights(w, good)
    for bad in ((1, 6, 6, 16, 8, 8, 8, 6, 32, 3, 3, 1, 1, 1, 1, 0),   # kc does not divide cp
                (1, 6, 6, 16, 8, 8, 8, 8, 16, 3, 3, 1, 1, 1, 1, 0),   # kp not a multiple of 32
                (1, 6, 6, 16, 7, 8, 8, 8, 32, 3, 3, 1, 1, 1, 1, 0),   # hp too small
                (1, 6, 6, 16, 8, 8, 8, 8, 32, 3, 3, 1, 1, 1, 1, 1),   # phases at stride 1
                (1, 6, 6, 16, 7, 7, 8, 8, 32, 3, 3, 2, 2, 2, 2, 1),   # phases with dilation
                (1, 6, 6, 16, 6, 7, 8, 8, 32, 3, 3, 2, 2, 1, 1, 1),   # a plane too short
                (1, 6, 6, 16, 7, 7, 8, 8, 32, 3, 3, 2, 2, 1, 1, 2),   # phases neither 0 nor 1
                (1, 6, 6, 16, 8, 8, 8, 8, 32, 3, 3, 1, 1, 1, 1),      # 15 fields
                (1, 6, 6, 16, 8, 8)):
        with pytest.raises(ValueError):
            _kernels.bf16_pack_weights(w, bad)
    wb = _kernels.bf16_pack_weights(w, good)
    y = np.zeros((1, 6, 6, 16), np.float32)
    with pytest.raises(ValueError):   # an input larger than the packed rows
        _kernels.conv2d_bf16(np.zeros((1, 9, 8, 8), np.float32), False, wb, y, good, 8, 9, 8,
                             0, 0, _kernels.BF16_KERNEL_AVX512, 1)
    with pytest.raises(TypeError):
        _kernels.conv2d_bf16(np.zeros((1, 8, 8, 8), np.float64), False, wb, y, good, 8, 8,
                             8, 0, 0, _kernels.BF16_KERNEL_AVX512, 1)


def test_torch_convert_bf16():
    """A converted network in bf16 against a layer-by-layer float64 reference of the same
    converted layers on bf16-rounded inputs and weights, and against the fp32 model."""
    torch = pytest.importorskip("torch")
    import types

    import torch.nn.functional as F
    from torch import nn

    import ttile.torch as tt
    from test_torch_convert import Basic, randomize_batch_norms

    torch.manual_seed(0)
    model = randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
        Basic(32, 32), Basic(32, 48, 2), nn.Conv2d(48, 48, 3, 1, 1, groups=48),
        nn.ReLU6(), nn.Conv2d(48, 40, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(40, 10))).eval()
    x = torch.randn(2, 3, 32, 32)

    def rounded(t):
        return torch.from_numpy(bf16.round_to_bf16(t.detach().float().numpy())).double()

    def reference(self, x, residual=None):
        y = F.conv2d(rounded(x), rounded(self.weight),
                     None if self.bias is None else self.bias.double(), self.stride,
                     self.padding, self.dilation, self.groups)
        if residual is not None:
            y = y + residual.double()
        act = {None: lambda v: v, "relu": F.relu, "relu6": F.relu6,
               "leaky_relu": lambda v: F.leaky_relu(v, self.negative_slope),
               "silu": F.silu, "sigmoid": torch.sigmoid}[self.activation]
        return act(y).float()

    checked = []

    def checked_forward(self, x, residual=None):
        """Each layer on the input the network gives it, against its reference."""
        want = reference(self, x, residual)
        got = self.ttile_forward(x, residual)
        checked.append((self.source, float((got - want).abs().max() / want.abs().max())))
        return got

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fp32 = model(x)
        converted = tt.convert(model, example_input=x, progress=False, precision="bf16")
        got = converted(x)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        got_cl = converted(x_cl)
        # later calls run the sequence's bound program (bf16 kernels, the fused block's
        # fp32 kernel behind its rounding pass, bf16 buffers); the first call went
        # module by module (the block's verdict is made on tensors), its activations
        # fp32 between layers, so its residuals were not rounded to bf16
        runs = [converted(x_cl) for _ in range(3)]
        sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
        assert sequences and all(type(p).__name__ == "_BoundSequence"
                                 for m in sequences for p in m._programs.values())
        assert torch.equal(runs[1], runs[2])
        assert float((runs[2] - got_cl).abs().max()) <= 2e-3 * float(got_cl.abs().max())
        layered = tt.convert(model, sequences=False, precision="bf16")
        layers = [m for m in layered.modules() if isinstance(m, tt.TTileConv2d)]
        assert len(layers) == 9 and all(m.precision is Precision.BF16 for m in layers)
        for m in layers:
            m.ttile_forward = m.forward
            m.forward = types.MethodType(checked_forward, m)
        by_layer = layered(x)
    assert len(checked) == 9
    assert all(error <= 1e-6 for _, error in checked), checked
    # The sequences' run matches the layers' up to bf16 roundings that an fp32 ulp
    # flipped (sums in another order), and stays near the fp32 model.
    scale = float(by_layer.abs().max())
    assert float((got - by_layer).abs().max()) <= 2e-3 * scale
    assert float((got_cl - got).abs().max()) <= 2e-3 * scale
    drift = float((got - fp32).abs().max()) / scale
    assert 1e-6 < drift < 3e-2   # bf16 rounding shows, and stays small
    served = [m for m in converted.modules() if isinstance(m, tt.TTileConv2d)]
    assert served and all(m.precision is Precision.BF16 for m in served)


@pytest.mark.parametrize("refuse_amx", [False, True])
def test_fused_block_bf16_rounds_weights_and_input(monkeypatch, refuse_amx):
    """A bf16 network's fused inverted residual block: products of the bf16-rounded
    weights and block input (the expanded activations inside stay fp32; the tile kernel
    rounds the depthwise output for its project stage), against float64 on the same
    values."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch import nn

    import ttile.torch as tt
    from ttile.runtime.inverted_residual import InvertedResidual
    from test_torch_convert import randomize_batch_norms
    if InvertedResidual.unsupported() is not None:
        pytest.skip(InvertedResidual.unsupported())
    if refuse_amx:   # the fp32 fused kernel on the rounded values serves instead
        monkeypatch.setattr(_kernels, "amx_usable", lambda: False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Sequential(
                nn.Conv2d(16, 96, 1, bias=False), nn.BatchNorm2d(96), nn.ReLU6(),
                nn.Conv2d(96, 96, 3, 1, 1, groups=96, bias=False), nn.BatchNorm2d(96),
                nn.ReLU6(), nn.Conv2d(96, 16, 1, bias=False), nn.BatchNorm2d(16))

        def forward(self, x):
            return x + self.conv(x)

    torch.manual_seed(3)
    model = randomize_batch_norms(nn.Sequential(Block())).eval()
    x = torch.randn(1, 16, 12, 12).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        converted = tt.convert(model, sequences=False, precision="bf16")
        blocks = [m for m in converted.modules() if isinstance(m, tt.TTileInvertedResidual)]
        assert len(blocks) == 1 and blocks[0].bf16
        block = blocks[0]
        x_np = x.numpy().transpose(0, 2, 3, 1)
        got = block.fused_call(x_np, 1)

        def rounded(t):
            return torch.from_numpy(bf16.round_to_bf16(t.detach().numpy())).double()
        xr = rounded(x)
        e, d, p = block.expand, block.depthwise, block.project
        y = F.relu6(F.conv2d(xr, rounded(e.weight), e.bias.double()))
        y = F.relu6(F.conv2d(y, rounded(d.weight), d.bias.double(), 1, 1, groups=96))
        if block._block().amx:
            y = rounded(y)
        assert block._block().amx == (_kernels.amx_usable() and not refuse_amx)
        want = (F.conv2d(y, rounded(p.weight), p.bias.double()) + xr).numpy()
    want = want.transpose(0, 2, 3, 1)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and the weights really were rounded: the unrounded ones give other sums
    with torch.no_grad():
        y = F.relu6(F.conv2d(xr, e.weight.double(), e.bias.double()))
        y = F.relu6(F.conv2d(y, d.weight.double(), d.bias.double(), 1, 1, groups=96))
        unrounded = (F.conv2d(y, p.weight.double(), p.bias.double()) + xr).numpy()
    assert np.abs(unrounded.transpose(0, 2, 3, 1) - want).max() > 1e-4 * np.abs(want).max()


def _block_reference(x, w1, b1, w2, b2, w3, b3, stride, acts, residual):
    """The bf16 block in float64: x and the weights rounded to bf16, the depthwise
    output rounded before the project stage (what the tile kernel multiplies)."""
    from ttile.core.reference import activate_f64

    def rounded(a):
        return bf16.round_to_bf16(np.asarray(a, np.float32)).astype(np.float64)
    x = rounded(x)
    n, h, w, _ = x.shape
    t = x if w1 is None else activate_f64(
        np.einsum("nhwc,ec->nhwe", x, rounded(w1)[:, :, 0, 0]) + b1, acts[0], 0.01)
    e = t.shape[3]
    padded = np.zeros((n, h + 2, w + 2, e))
    padded[:, 1:-1, 1:-1] = t
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    d = np.zeros((n, ho, wo, e))
    taps = rounded(w2)[:, 0]
    for r in range(3):
        for s in range(3):
            d += padded[:, r:r + stride * (ho - 1) + 1:stride,
                        s:s + stride * (wo - 1) + 1:stride] * taps[:, r, s]
    d = rounded(activate_f64(d + b2, acts[1], 0.01))
    y = np.einsum("nhwe,ke->nhwk", d, rounded(w3)[:, :, 0, 0]) + b3
    return activate_f64(y + x if residual else y, acts[2], 0.01)


MOBILENET = ("relu6", "relu6", "none")


@pytest.mark.skipif(not _kernels.amx_usable(), reason="needs AMX (CPU and Linux)")
@pytest.mark.parametrize("n,h,w,c,e,k,stride,residual,expand,acts", [
    (1, 12, 12, 16, 96, 16, 1, True, True, MOBILENET),  # MobileNetV2's, smaller maps
    (1, 14, 14, 24, 144, 24, 1, True, True, ("relu", "relu", "relu")),  # c, e, k off 32
    (2, 9, 17, 24, 144, 32, 2, False, True, MOBILENET),  # two images, odd width, stride 2
    (1, 7, 7, 160, 960, 320, 1, False, True, MOBILENET),  # five reduction steps
    (1, 5, 33, 40, 120, 40, 1, True, True,               # three pixel tiles a row, the
     ("leaky_relu", "relu6", "silu")),                   # activations read at run time
    (1, 16, 16, 32, 32, 16, 1, False, False, ("none", "relu6", "sigmoid")),  # no expand
    # wide rows: 7 and 13 pixel tiles a row, an expanded row of 100-250 KB
    (1, 10, 100, 24, 256, 24, 1, True, True, MOBILENET),
    (1, 11, 100, 32, 256, 48, 2, False, True, MOBILENET),
    (1, 4, 200, 16, 320, 16, 1, True, True, MOBILENET),
])
def test_amx_fused_block_bf16(n, h, w, c, e, k, stride, residual, expand, acts):
    """The bf16 block with its 1x1 stages on AMX, on fp32 and on bf16-bits inputs, at
    one and two threads, against float64 on the rounded values; its bf16 outputs are its
    fp32 outputs rounded. The activations and residual kinds reach each compiled variant
    of the stages' epilogue."""
    from ttile.core.kinds import Precision
    from ttile.runtime.inverted_residual import InvertedResidual
    rng = np.random.default_rng(n * h + w + c + e + k)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    w1 = (rng.standard_normal((e, c, 1, 1)) * 0.2).astype(np.float32) if expand else None
    b1 = rng.standard_normal(e).astype(np.float32) if expand else None
    w2 = (rng.standard_normal((e, 1, 3, 3)) * 0.3).astype(np.float32)
    b2 = rng.standard_normal(e).astype(np.float32)
    w3 = (rng.standard_normal((k, e, 1, 1)) * 0.1).astype(np.float32)
    b3 = rng.standard_normal(k).astype(np.float32)
    block = InvertedResidual(w1, b1, w2, b2, w3, b3, stride=stride, activations=acts,
                             residual=residual, precision=Precision.BF16)
    assert block.amx
    want = _block_reference(x, w1, 0.0 if b1 is None else b1, w2, b2, w3, b3, stride, acts,
                            residual)
    bits = _kernels.bf16_round(x)
    for threads in (1, 2):
        for given in (x, bits):
            got = block(given, threads)
            error = np.abs(got - want) / np.abs(want).max()
            # the kernel's fp32 sums (in another order) may round a depthwise output to
            # the neighbouring bf16 value, which moves the outputs it feeds by one of
            # its products' bf16 ulp (~3e-4 here); all else agrees to fp32 precision
            assert error.max() <= 1e-3, (threads, given.dtype, error.max())
            assert np.mean(error > 1e-5) <= 0.01, (threads, given.dtype)
            rounded = block(given, threads, bits_out=True)
            assert bf16.is_bfloat16(rounded) and rounded.shape == got.shape
            assert np.array_equal(bf16.bf16_bits(rounded), _kernels.bf16_round(got))
    # and a program's bound call writes the same
    out = np.empty(block.output_shape(x.shape), np.float32)
    call, _ = block.bound_call(x.shape, 2, _kernels.empty_aligned(
        (block.scratch_floats(x.shape, 2),)))
    call(x, out, None)
    assert np.array_equal(out, block(x, 2))


@pytest.mark.skipif(not _kernels.cpu_has_avx512f(), reason="the fused block is AVX-512F")
@pytest.mark.parametrize("refuse_amx", [False, True])
def test_bf16_block_takes_and_gives_bf16_values(monkeypatch, refuse_amx):
    """A bf16 block reads bf16 arrays (ml_dtypes' or their bits) as the values they
    hold, and writes bf16 ones that are its fp32 outputs rounded: on AMX as the tile
    kernel reads and writes them, elsewhere through the fp32 kernel's widening and
    rounding passes; bound for a program, too. An fp32 block refuses them."""
    from ttile.runtime.inverted_residual import InvertedResidual
    if refuse_amx:
        monkeypatch.setattr(_kernels, "amx_usable", lambda: False)
    elif not HAS_AMX:
        pytest.skip("needs AMX (CPU and Linux)")
    rng = np.random.default_rng(5)
    c, e, k = 24, 72, 24
    weights = ((rng.standard_normal((e, c, 1, 1)) * 0.2).astype(np.float32),
               rng.standard_normal(e).astype(np.float32),
               (rng.standard_normal((e, 1, 3, 3)) * 0.3).astype(np.float32),
               rng.standard_normal(e).astype(np.float32),
               (rng.standard_normal((k, e, 1, 1)) * 0.1).astype(np.float32),
               rng.standard_normal(k).astype(np.float32))
    block = InvertedResidual(*weights, stride=1, activations=MOBILENET, residual=True,
                             precision=Precision.BF16)
    assert block.amx is not refuse_amx
    x = bf16.round_to_bf16(rng.standard_normal((1, 10, 13, c)).astype(np.float32))
    values = x.astype(ml_dtypes.bfloat16)
    want = block(x, 2)
    for given in (values, bf16.bf16_bits(values)):
        assert np.array_equal(block(given, 2), want)
        got = block(given, 2, bits_out=True)
        assert bf16.is_bfloat16(got)
        assert np.array_equal(bf16.bf16_bits(got), _kernels.bf16_round(want))
    call, out_shape = block.bound_call(x.shape, 2, _kernels.empty_aligned(
        (block.scratch_floats(x.shape, 2),)))
    out = _kernels.empty_aligned_bits(out_shape)
    call(bf16.bf16_bits(values), out, None)
    assert np.array_equal(out, _kernels.bf16_round(want))
    fp32 = InvertedResidual(*weights, stride=1, activations=MOBILENET, residual=True)
    with pytest.raises(TypeError, match="bf16 block"):
        fp32(values, 1)
    with pytest.raises(ValueError, match="bits_out"):
        fp32(x, 1, bits_out=True)


@pytest.mark.skipif(not _kernels.cpu_has_avx512f(), reason="the fused block is AVX-512F")
@pytest.mark.parametrize("refuse_amx", [False, True])
def test_sequence_keeps_bf16_between_amx_blocks(monkeypatch, refuse_amx):
    """In a bf16 network the activations between bf16 layers and AMX blocks stay bf16
    (the blocks' steps are bf16 steps where AMX serves them, not elsewhere), and that
    changes no value: each reader rounds its input to bf16 anyway. Unbound and bound
    runs give the same bits as the same sequence with fp32 between its units."""
    torch = pytest.importorskip("torch")
    from torch import nn

    import ttile.torch as tt
    from test_torch_convert import InvertedResidual as Block, randomize_batch_norms
    if refuse_amx:
        monkeypatch.setattr(_kernels, "amx_usable", lambda: False)
    elif not HAS_AMX:
        pytest.skip("needs AMX (CPU and Linux)")

    torch.manual_seed(7)
    model = randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        Block(16, 64, 16, 1), Block(16, 64, 24, 2), Block(24, 96, 24, 1),
        nn.Conv2d(24, 40, 1), nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(40, 10))).eval()
    x = torch.randn(1, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        converted = tt.convert(model, example_input=x, progress=False, precision="bf16")
        sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
        assert len(sequences) == 1
        seq = sequences[0]
        blocks = [i for i, (name, _) in enumerate(seq.steps)
                  if isinstance(getattr(seq, name), tt.TTileInvertedResidual)]
        assert len(blocks) == 3
        if refuse_amx:
            assert not set(blocks) & seq._bf16_steps
        else:
            assert set(blocks) <= seq._bf16_steps and 0 in seq._bf16_steps
        converted(x)   # the blocks' verdicts, on tensors
        kept = [converted(x) for _ in range(3)]   # unbound, bound, through the program
        assert all(type(p).__name__ == "_BoundSequence" for p in seq._programs.values())
        seq._bf16_steps = frozenset()
        seq._programs.clear()
        fp32 = [converted(x) for _ in range(3)]
    for a, b in zip(kept, fp32):
        assert torch.equal(a, b)


def test_sequence_keeps_bf16_through_max_pooling():
    """A bf16 ResNet-like network's stem writes bf16 through its max pooling (the
    maximum of bf16 values is one of them) and the global average pooling gets fp32;
    the outputs differ from those with fp32 between the sequence's units only by the
    residuals' bf16 rounding (a bf16 layer adds an fp32 residual as it is)."""
    torch = pytest.importorskip("torch")
    from torch import nn

    import ttile.torch as tt
    from test_torch_convert import Basic, randomize_batch_norms
    torch.manual_seed(11)
    model = randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1), Basic(16, 16), Basic(16, 32, 2), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10))).eval()
    x = torch.randn(1, 3, 40, 40).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # no bf16 instructions: emulated
        converted = tt.convert(model, example_input=x, progress=False, precision="bf16")
        seq, = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
        kinds = [type(getattr(seq, name)).__name__ for name, _ in seq.steps]
        pools = [i for i, kind in enumerate(kinds) if kind == "TTilePool2d"]
        assert len(pools) == 2
        assert {0, pools[0]} <= seq._bf16_steps and pools[1] not in seq._bf16_steps
        assert pools[1] - 1 not in seq._bf16_steps   # the average pooling reads fp32
        kept = [converted(x) for _ in range(3)]   # unbound, bound, through the program
        assert all(type(p).__name__ == "_BoundSequence" for p in seq._programs.values())
        seq._bf16_steps = frozenset()
        seq._programs.clear()
        fp32 = [converted(x) for _ in range(3)]
    assert torch.equal(kept[1], kept[2]) and torch.equal(fp32[1], fp32[2])
    scale = float(fp32[2].abs().max())
    assert 0 < float((kept[2] - fp32[2]).abs().max()) <= 1e-2 * scale


@pytest.mark.skipif(not _kernels.cpu_has_avx512f(), reason="no AVX-512")
@pytest.mark.parametrize("missing", ["amx", "all"])
def test_missing_instructions_fall_back_with_one_warning(monkeypatch, missing):
    """Linux refusing AMX falls back to the AVX512_BF16 kernel, a CPU without bf16
    instructions to the fp32 kernels on rounded values: one warning each, ``plan`` says
    so in ``degraded``, and the numbers are the same."""
    from ttile.runtime import dispatch
    if missing == "amx" and not (_kernels.cpu_has_amx_bf16() and HAS_DOT):
        pytest.skip("needs a CPU with AMX and AVX512_BF16")
    monkeypatch.setattr(_kernels, "amx_usable", lambda: False)
    if missing == "all":
        monkeypatch.setattr(_kernels, "cpu_has_avx512bf16", lambda: False)
    dispatch.forget_choices()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 8, 8, 32)).astype(np.float32)
    w = rng.standard_normal((3, 3, 32, 48)).astype(np.float32)
    plan = ttile.plan(x.shape, w.shape, padding=1, layout="NHWC", precision="bf16")
    if missing == "amx":   # the dot-product kernel where it pays, else fp32 kernels
        assert "AMX refused" in plan.degraded
        assert (plan.kind is KernelKind.DOT_BF16) == bf16.dot_products_pay()[0]
    else:
        assert plan.kind not in bf16.BF16_KINDS and "no bf16 kernel" in plan.degraded
    with pytest.warns(RuntimeWarning, match="AMX refused" if missing == "amx"
                      else "no bf16 kernel"):
        y = ttile.conv2d(x, w, padding=1, layout="NHWC", precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per process
        ttile.conv2d(x, w, padding=1, layout="NHWC", precision="bf16")
    dispatch.forget_choices()
    want, tol = expected(x, w, (1, 1), (1,) * 4)
    assert_close(y, want, tol)


@pytest.mark.skipif(not HAS_DOT, reason="no AVX512_BF16 on this CPU")
def test_dot_products_measured_against_fma(monkeypatch):
    """Without AMX, the dot-product kernel serves only where vdpbf16ps does at least
    DOT_MIN_SHARE of the fp32 FMA's flops on this core (Zen 4: twice; a Xeon model 207:
    under half)."""
    pays, dot, fma = bf16.dot_products_pay()
    assert dot > 0 and fma > 0 and pays == (dot >= bf16.DOT_MIN_SHARE * fma)
    monkeypatch.setattr(_kernels, "amx_usable", lambda: False)
    monkeypatch.setattr(bf16, "_dot_verdict", (False, 1.0, 2.0))
    assert bf16.kernel_kind(Isa.AVX512F) is None
    assert "vdpbf16ps ran at 1 GFLOP/s against fp32 FMA's 2" in bf16.missing_instructions()
    monkeypatch.setattr(bf16, "_dot_verdict", (True, 2.0, 1.0))
    assert bf16.kernel_kind(Isa.AVX512F) is KernelKind.DOT_BF16


@pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 on this CPU (or Linux refused the "
                                        "tile state)")
@pytest.mark.parametrize("shape", [(1, 7, 9, 64, 48), (2, 5, 6, 32, 40), (1, 4, 8, 128, 64)],
                         ids=["63-pixel-tail", "two-images-30-pixels", "no-tail"])
def test_unpacked_bf16_input_of_a_1x1_layer_read_in_place(shape):
    """A 1x1, stride-1, unpadded layer on bf16 NHWC input reads the input where it is
    (no packed copy), its last tile's rows from a zero-padded copy: the input fenced by a
    guard page faults on any read past it, and the result equals the packed path's (the
    fp32 input rounded to the same values)."""
    n, h, wd, c, k = shape
    rng = np.random.default_rng(11)
    x32 = bf16.round_to_bf16(rng.standard_normal((n, h, wd, c)).astype(np.float32))
    w = rng.standard_normal((1, 1, c, k)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    gx = guarded_copy(x32.astype(ml_dtypes.bfloat16), "end")
    y = ttile.conv2d(gx.array, w, b, layout="NHWC", activation="relu", precision="bf16")
    assert gx.canary_intact()
    packed = ttile.conv2d(x32, w, b, layout="NHWC", activation="relu", precision="bf16")
    np.testing.assert_array_equal(y.astype(np.float32), bf16.round_to_bf16(packed))
    want, tol = expected(x32, w, (1, 1), (0,) * 4, bias=b, activation="relu")
    assert_close(y.astype(np.float32), want, tol + np.abs(want) * 2.0 ** -8)
