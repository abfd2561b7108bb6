"""Full conv2d semantics: bias, dilation, groups (depthwise included), fused epilogues
(activation, residual), ``out=``, batches - against torch.nn.functional.conv2d in float64.

Every kernel family serves some of these calls: dense (tuned, run-time tuned or generic),
depthwise, grouped generic, and the portable kernels; hypothesis draws the shapes.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ttile
from conftest import AVAILABLE_ISAS, requires_avx512

torch = pytest.importorskip("torch")
F = torch.nn.functional

ACTIVATIONS = [None, "relu", "relu6", "leaky_relu", "silu", "sigmoid"]


def torch_reference(x, w, bias, stride, padding, dilation, groups, activation, slope,
                    residual):
    """The float64 oracle, NCHW in and out."""
    t = lambda a: None if a is None else torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    y = F.conv2d(t(x), t(w), t(bias), stride, padding, dilation, groups)
    magnitude = F.conv2d(t(np.abs(x)), t(np.abs(w)), None if bias is None else t(np.abs(bias)),
                         stride, padding, dilation, groups)
    if residual is not None:
        y = y + t(residual)
        magnitude = magnitude + t(np.abs(residual))
    if activation == "relu":
        y = F.relu(y)
    elif activation == "relu6":
        y = F.relu6(y)
    elif activation == "leaky_relu":
        y = F.leaky_relu(y, slope)
    elif activation == "silu":
        y = F.silu(y)
    elif activation == "sigmoid":
        y = torch.sigmoid(y)
    return y.numpy(), magnitude.numpy()


def assert_matches(actual, expected, magnitude, terms):
    tolerance = 8 * np.sqrt(terms) * np.finfo(np.float32).eps * (magnitude + 1) + 1e-6
    error = np.abs(actual.astype(np.float64) - expected)
    bad = ~(error <= tolerance)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} outputs off, worst "
                           f"{error.max():.3g}")


def run_both_layouts(x, w, bias, stride, padding, dilation, groups, activation, slope,
                     residual, threads):
    """ttile.conv2d in NCHW and in NHWC (converted back to NCHW), and Conv2d's call."""
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  threads=threads, activation=activation, negative_slope=slope)
    nchw = ttile.conv2d(x, w, bias, residual=residual, **kwargs)
    x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w_rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    r_nhwc = None if residual is None else np.ascontiguousarray(residual.transpose(0, 2, 3, 1))
    nhwc = ttile.conv2d(x_nhwc, w_rsck, bias, layout="NHWC", residual=r_nhwc, **kwargs)
    layer = ttile.Conv2d(w_rsck, bias, layout="NHWC", **kwargs)
    out = np.full(nhwc.shape, np.nan, np.float32)
    packed = layer(x_nhwc, residual=r_nhwc, out=out)
    assert packed is out
    return [nchw, nhwc.transpose(0, 3, 1, 2), packed.transpose(0, 3, 1, 2)]


@st.composite
def problems(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3, "depthwise"]))
    cg = draw(st.integers(1, 9))
    if groups == "depthwise":
        c = draw(st.integers(1, 40))
        groups, cg = c, 1
        k = c * draw(st.sampled_from([1, 1, 2]))
    else:
        c = cg * groups
        k = groups * draw(st.integers(1, 20))
    r, s = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    span = ((r - 1) * dilation[0] + 1, (s - 1) * dilation[1] + 1)
    h = draw(st.integers(max(1, span[0] - 2 * padding[0]), 14))
    w = draw(st.integers(max(1, span[1] - 2 * padding[1]), 14))
    n = draw(st.integers(1, 3))
    return dict(n=n, c=c, h=h, w=w, k=k, r=r, s=s, groups=groups, stride=stride,
                padding=padding, dilation=dilation, bias=draw(st.booleans()),
                residual=draw(st.booleans()), activation=draw(st.sampled_from(ACTIVATIONS)),
                slope=draw(st.sampled_from([0.01, 0.2, -0.5])), threads=draw(st.integers(1, 2)))


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(), seed=st.integers(0, 2**16))
def test_matches_torch_float64(isa, p, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (p["n"], p["c"], p["h"], p["w"])).astype(np.float32)
    w = rng.uniform(-1, 1, (p["k"], p["c"] // p["groups"], p["r"], p["s"])).astype(np.float32)
    bias = rng.uniform(-1, 1, p["k"]).astype(np.float32) if p["bias"] else None
    shape = F.conv2d(torch.zeros(x.shape), torch.zeros(w.shape), None, p["stride"],
                     p["padding"], p["dilation"], p["groups"]).shape
    residual = rng.uniform(-1, 1, tuple(shape)).astype(np.float32) if p["residual"] else None
    expected, magnitude = torch_reference(x, w, bias, p["stride"], p["padding"],
                                          p["dilation"], p["groups"], p["activation"],
                                          p["slope"], residual)
    previous = ttile.set_isa(isa)
    try:
        results = run_both_layouts(x, w, bias, p["stride"], p["padding"], p["dilation"],
                                   p["groups"], p["activation"], p["slope"], residual,
                                   p["threads"])
    finally:
        ttile.set_isa(previous)
    terms = (p["c"] // p["groups"]) * p["r"] * p["s"] + 2
    for result in results:
        assert result.shape == expected.shape and result.dtype == np.float32
        assert_matches(result, expected, magnitude, terms)


# The MobileNetV2 depthwise layers of the benchmark, smaller batch of checks.
MOBILENET_DEPTHWISE = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (192, 28, 1), (384, 14, 1),
                       (576, 14, 2), (960, 7, 1)]


@requires_avx512
@pytest.mark.parametrize("c,hw,stride", MOBILENET_DEPTHWISE)
def test_mobilenet_depthwise_layers_are_served_by_the_depthwise_kernel(c, hw, stride):
    rng = np.random.default_rng(c)
    x = rng.uniform(-1, 1, (1, c, hw, hw)).astype(np.float32)
    w = rng.uniform(-1, 1, (c, 1, 3, 3)).astype(np.float32)
    bias = rng.uniform(-1, 1, c).astype(np.float32)
    plan = ttile.plan(x.shape, w.shape, bias, stride, 1, 1, c, activation="relu6")
    assert plan.kind == ttile.KernelKind.DEPTHWISE and plan.groups == c
    assert plan.epilogue == "bias+relu6"
    expected, magnitude = torch_reference(x, w, bias, stride, 1, 1, c, "relu6", 0.01, None)
    for result in run_both_layouts(x, w, bias, stride, 1, 1, c, "relu6", 0.01, None, 2):
        assert_matches(result, expected, magnitude, 11)


#: NCHW depthwise calls the NCHW kernel serves (column stride 1 or 2, up to 8 taps along
#: w): MobileNetV3's 5x5 layers, rows of one, two and seven vectors with tails, a partial
#: last block of rows, dilation, unequal strides, a 7x7 (run-time sizes), a batch.
NCHW_DEPTHWISE = [
    # (n, c, h, w, r, s, stride, padding, dilation)
    (1, 40, 28, 28, 5, 5, 1, 2, 1),
    (1, 72, 56, 56, 5, 5, 2, 2, 1),
    (1, 17, 19, 37, 3, 3, 1, 1, 1),
    (2, 5, 23, 115, 3, 3, 2, 1, 1),
    (1, 8, 13, 21, 3, 3, 1, 2, 2),
    (1, 6, 15, 17, 3, 3, (3, 2), 1, 1),
    (1, 3, 11, 11, 7, 7, 1, 3, 1),
    (1, 4, 9, 30, 1, 8, 1, 0, 1),
]


@requires_avx512
@pytest.mark.parametrize("case", NCHW_DEPTHWISE, ids=lambda c: "c{1}h{2}w{3}r{4}s{5}".format(*c))
def test_nchw_depthwise_calls_run_the_nchw_kernel(case):
    n, c, h, w_, r, s, stride, padding, dilation = case
    rng = np.random.default_rng(c)
    x = rng.uniform(-1, 1, (n, c, h, w_)).astype(np.float32)
    w = rng.uniform(-1, 1, (c, 1, r, s)).astype(np.float32)
    bias = rng.uniform(-1, 1, c).astype(np.float32)
    plan = ttile.plan(x.shape, w.shape, bias, stride, padding, dilation, c, activation="silu")
    assert plan.kind == ttile.KernelKind.DEPTHWISE and "NCHW depthwise" in plan.note
    expected, magnitude = torch_reference(x, w, bias, stride, padding, dilation, c, "silu",
                                          0.01, None)
    for threads in (1, 2):
        y = ttile.conv2d(x, w, bias, stride, padding, dilation, c, threads=threads,
                         activation="silu")
        assert_matches(y, expected, magnitude, r * s + 2)
    layer = ttile.Conv2d(w, bias, stride, padding, dilation, c, activation="silu")
    assert_matches(layer(x), expected, magnitude, r * s + 2)


@requires_avx512
@pytest.mark.parametrize("hw,stride", [(12, 3), (7, 1), (14, 2)])
def test_nchw_depthwise_calls_it_does_not_serve_convert_for_the_nhwc_kernel(hw, stride):
    """Column stride 3, and rows narrower than half a vector (7x7 maps, 14x14 at stride 2),
    where converting around the NHWC kernel measured faster."""
    rng = np.random.default_rng(hw)
    x = rng.uniform(-1, 1, (1, 48, hw, hw)).astype(np.float32)
    w = rng.uniform(-1, 1, (48, 1, 3, 3)).astype(np.float32)
    plan = ttile.plan(x.shape, w.shape, None, stride, 1, 1, 48)
    assert plan.kind == ttile.KernelKind.DEPTHWISE and "NCHW" not in plan.note
    expected, magnitude = torch_reference(x, w, None, stride, 1, 1, 48, None, 0.01, None)
    assert_matches(ttile.conv2d(x, w, None, stride, 1, 1, 48), expected, magnitude, 11)


#: NCHW 1x1 calls (stride 1, no padding): pixel counts off the 64-pixel column (tails of
#: 1 to 4 vectors), output channels off the 6-channel block, a batch, a single channel.
NCHW_POINTWISE = [(1, 128, 64, 17, 17), (2, 20, 37, 9, 11), (1, 3, 6, 8, 8), (1, 1, 1, 5, 3),
                  (1, 96, 24, 56, 56), (3, 33, 50, 7, 7), (1, 16, 96, 16, 4)]


@requires_avx512
@pytest.mark.parametrize("case", NCHW_POINTWISE, ids=lambda c: "n{}c{}k{}h{}w{}".format(*c))
@pytest.mark.parametrize("activation", [None, "relu6", "sigmoid"])
def test_nchw_pointwise_calls_run_the_nchw_1x1_kernel(case, activation):
    n, c, k, h, w_ = case
    rng = np.random.default_rng(c * k)
    x = rng.uniform(-1, 1, (n, c, h, w_)).astype(np.float32)
    w = rng.uniform(-1, 1, (k, c, 1, 1)).astype(np.float32)
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, k, h, w_)).astype(np.float32)
    plan = ttile.plan(x.shape, w.shape, bias, residual=residual, activation=activation)
    assert plan.kind == ttile.KernelKind.POINTWISE
    expected, magnitude = torch_reference(x, w, bias, 1, 0, 1, 1, activation, 0.01, residual)
    for threads in (1, 2):
        y = ttile.conv2d(x, w, bias, threads=threads, activation=activation,
                         residual=residual)
        assert_matches(y, expected, magnitude, c + 2)
    layer = ttile.Conv2d(w, bias, activation=activation)   # keeps the weights as RSCK
    out = np.full(expected.shape, np.nan, np.float32)
    assert layer(x, residual=residual, out=out) is out
    assert_matches(out, expected, magnitude, c + 2)


#: Strided NCHW 1x1 calls: the pixels they read gathered, then the pointwise kernel
#: (ResNet18-5's and -11's shapes scaled down, odd sizes, unequal strides).
NCHW_STRIDED_POINTWISE = [((1, 64, 24, 28, 28), (2, 2)), ((2, 20, 37, 15, 13), (2, 2)),
                          ((1, 8, 10, 17, 33), (3, 2)), ((1, 5, 7, 9, 9), (1, 3)),
                          ((1, 3, 6, 1, 1), (2, 2))]


@requires_avx512
@pytest.mark.parametrize("case,stride", NCHW_STRIDED_POINTWISE,
                         ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("activation", [None, "relu"])
def test_strided_nchw_pointwise_calls_gather_their_pixels(case, stride, activation):
    n, c, k, h, w_ = case
    rng = np.random.default_rng(c * k + h)
    x = rng.uniform(-1, 1, (n, c, h, w_)).astype(np.float32)
    w = rng.uniform(-1, 1, (k, c, 1, 1)).astype(np.float32)
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    ho, wo = (h - 1) // stride[0] + 1, (w_ - 1) // stride[1] + 1
    residual = rng.uniform(-1, 1, (n, k, ho, wo)).astype(np.float32)
    plan = ttile.plan(x.shape, w.shape, bias, stride, residual=residual, activation=activation)
    assert plan.kind == ttile.KernelKind.POINTWISE and "gathered" in plan.note
    expected, magnitude = torch_reference(x, w, bias, stride, 0, 1, 1, activation, 0.01,
                                          residual)
    for threads in (1, 2, 5):
        y = ttile.conv2d(x, w, bias, stride, threads=threads, activation=activation,
                         residual=residual)
        assert_matches(y, expected, magnitude, c + 2)
    layer = ttile.Conv2d(w, bias, stride, activation=activation)
    out = np.full(expected.shape, np.nan, np.float32)
    assert layer(x, residual=residual, out=out) is out
    assert_matches(out, expected, magnitude, c + 2)


@requires_avx512
def test_other_nchw_1x1_calls_are_not_the_pointwise_kernels():
    for stride, padding in ((1, 1), (2, 1)):
        plan = ttile.plan((1, 32, 16, 16), (48, 32, 1, 1), None, stride, padding)
        assert plan.kind != ttile.KernelKind.POINTWISE
    plan = ttile.plan((1, 16, 16, 32), (1, 1, 32, 48), layout="NHWC")
    assert plan.kind != ttile.KernelKind.POINTWISE
    # weights past the caches (read once per 64-pixel column): Yolo9000-23
    plan = ttile.plan((1, 1024, 17, 17), (28269, 1024, 1, 1))
    assert plan.kind != ttile.KernelKind.POINTWISE


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batch_of_eight_equals_eight_single_images(layout):
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (8, 16, 12, 12)).astype(np.float32)
    w = rng.uniform(-1, 1, (32, 16, 3, 3)).astype(np.float32)
    bias = rng.uniform(-1, 1, 32).astype(np.float32)
    if layout == "NHWC":
        x, w = x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy()
    batch = ttile.conv2d(x, w, bias, padding=1, layout=layout, activation="relu")
    for i in range(8):
        single = ttile.conv2d(x[i:i + 1], w, bias, padding=1, layout=layout, activation="relu")
        np.testing.assert_allclose(batch[i:i + 1], single, rtol=1e-5, atol=1e-5)


def test_out_is_written_in_place_and_returned():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, 8, 9, 9)).astype(np.float32)
    w = rng.uniform(-1, 1, (16, 8, 3, 3)).astype(np.float32)
    out = np.full((1, 16, 9, 9), np.nan, np.float32)
    result = ttile.conv2d(x, w, padding=1, out=out)
    assert result is out
    np.testing.assert_allclose(out, ttile.conv2d(x, w, padding=1), rtol=1e-6, atol=1e-6)


# Each refused call: the keyword arguments that make it wrong, and what the error says.
def _refusals():
    x = np.ones((1, 8, 9, 9), np.float32)
    w = np.ones((16, 4, 3, 3), np.float32)
    good = dict(groups=2, padding=1)
    out_shape = (1, 16, 9, 9)
    return x, w, out_shape, [
        (dict(groups=3), "not divisible by groups"),
        (dict(groups=0), "groups must be >= 1"),
        (dict(good, bias=np.ones(15, np.float32)), "bias must have shape (16,)"),
        (dict(good, bias=np.ones((16, 1), np.float32)), "bias must have shape (16,)"),
        (dict(good, bias=np.ones(16, complex)), "complex"),
        (dict(good, bias=np.ones(16, bool)), "bool"),
        (dict(good, residual=np.ones((1, 16, 9, 8), np.float32)), "residual must have"),
        (dict(good, activation="gelu"), "unknown activation 'gelu'"),
        (dict(good, activation="relu", negative_slope="x"), "negative_slope"),
        (dict(good, dilation=0), "dilation must be >= 1"),
        (dict(good, out=np.empty((1, 16, 9, 8), np.float32)), "out must have"),
        (dict(good, out=np.empty(out_shape, np.float64)), "out must be float32"),
        (dict(good, out=np.empty(out_shape[::-1], np.float32).T), "C-contiguous"),
        (dict(good, out=[0.0]), "numpy array"),
    ]


@pytest.mark.parametrize("case", range(len(_refusals()[3])))
def test_bad_arguments_are_refused_with_the_reason_and_out_untouched(case):
    x, w, out_shape, cases = _refusals()
    kwargs, message = cases[case]
    sentinel = np.full(out_shape, 7.0, np.float32)
    kwargs = dict(kwargs)
    kwargs.setdefault("out", sentinel)
    with pytest.raises((ValueError, TypeError), match=None) as info:
        ttile.conv2d(x, w, **kwargs)
    assert message in str(info.value)
    assert (sentinel == 7.0).all()


def test_out_overlapping_an_input_is_refused():
    x = np.ones((1, 16, 9, 9), np.float32)
    w = np.ones((16, 16, 3, 3), np.float32)
    with pytest.raises(ValueError, match="out overlaps the input"):
        ttile.conv2d(x, w, padding=1, out=x)
    residual = np.ones((1, 16, 9, 9), np.float32)
    with pytest.raises(ValueError, match="out overlaps the residual"):
        ttile.conv2d(x, w, padding=1, residual=residual, out=residual)
    assert (residual == 1).all()


def test_conv2d_layer_takes_the_same_keywords():
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (2, 12, 10, 10)).astype(np.float32)
    w = rng.uniform(-1, 1, (24, 4, 3, 3)).astype(np.float32)
    bias = rng.uniform(-1, 1, 24).astype(np.float32)
    layer = ttile.Conv2d(w, bias, 1, 2, 2, 3, activation="leaky_relu", negative_slope=0.2)
    residual = rng.uniform(-1, 1, (2, 24, 10, 10)).astype(np.float32)
    expected, magnitude = torch_reference(x, w, bias, 1, 2, 2, 3, "leaky_relu", 0.2, residual)
    bias[:] = 0  # the layer holds its own copy
    assert_matches(layer(x, residual=residual), expected, magnitude, 40)
    with pytest.raises(ValueError, match="unknown activation"):
        ttile.Conv2d(w, activation="tanh")
    with pytest.raises(ValueError, match="bias must have shape"):
        ttile.Conv2d(w, np.ones(3, np.float32), groups=3)


def test_plan_names_the_epilogue_and_groups():
    p = ttile.plan((1, 8, 9, 9), (8, 4, 3, 3), (8,), 1, 1, 1, 2, activation="silu",
                   residual=(1, 8, 9, 9))
    assert p.groups == 2 and p.epilogue == "bias+residual+silu"
    assert p.problem.c == 4 and p.problem.k == 4
    with pytest.raises(ValueError, match="residual must have"):
        ttile.plan((1, 8, 9, 9), (8, 4, 3, 3), groups=2, padding=1, residual=(1, 8, 9, 8))


def test_a_positional_stride_reads_as_a_bias_and_is_refused():
    # torch's order: conv2d(x, w, bias, stride, padding, dilation, groups)
    x = np.ones((1, 3, 8, 8), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match="bias must have shape"):
        ttile.conv2d(x, w, 2)


def test_a_depthwise_call_uses_threads_by_the_bytes_it_moves():
    # 7 MFLOP would keep a dense layer on one thread; a depthwise layer moves 3.2 MB
    big = ttile.plan((1, 32, 112, 112), (32, 1, 3, 3), None, 1, 1, 1, 32, threads=2)
    assert big.threads == 2
    tiny = ttile.plan((1, 16, 4, 4), (16, 1, 3, 3), None, 1, 1, 1, 16, threads=2)
    assert tiny.threads == 1


@requires_avx512
@pytest.mark.parametrize("reads_nchw", [False, True])
@pytest.mark.parametrize("case", [(16, 24, 1, 1, 1), (32, 48, 2, 1, 2), (24, 36, 1, 2, 3)],
                         ids=lambda c: "c{}k{}s{}d{}g{}".format(*c))
def test_nchw_generic_calls_read_the_input_either_way(monkeypatch, case, reads_nchw):
    """The generic kernel's NCHW calls, the input converted first or read in place (the
    choice forced both ways), with bias, residual, activation, stride, dilation, groups;
    per call and pre-packed, 1 and 2 threads."""
    from ttile.runtime import routes
    c, k, stride, dilation, groups = case
    monkeypatch.setattr(routes, "generic_reads_nchw", lambda *args: reads_nchw)
    rng = np.random.default_rng(c + k)
    x = rng.uniform(-1, 1, (2, c, 19, 23)).astype(np.float32)
    w = rng.uniform(-1, 1, (k, c // groups, 3, 3)).astype(np.float32)
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    expected, magnitude = torch_reference(x, w, bias, stride, dilation, dilation, groups,
                                          "relu", 0.01, None)
    residual = rng.uniform(-1, 1, expected.shape).astype(np.float32)
    expected, magnitude = torch_reference(x, w, bias, stride, dilation, dilation, groups,
                                          "relu", 0.01, residual)
    previous = ttile.set_tuning(mode="never")
    try:
        for threads in (1, 2):
            y = ttile.conv2d(x, w, bias, stride, dilation, dilation, groups, threads=threads,
                             activation="relu", residual=residual)
            assert_matches(y, expected, magnitude, 9 * c // groups + 2)
            layer = ttile.Conv2d(w, bias, stride, dilation, dilation, groups, threads=threads,
                                 activation="relu")
            assert_matches(layer(x, residual=residual), expected, magnitude,
                           9 * c // groups + 2)
    finally:
        ttile.restore_tuning(previous)
