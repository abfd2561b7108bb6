"""The Winograd F(4x4, 3x3) and F(2x2, 3x3) kernels: their results against the float64
reference (edges, channel tails, batches, super-blocks, every epilogue, threads), which
calls they serve, and how a per-call call gets its transformed weights."""
import numpy as np
import pytest

import ttile
from conftest import forget_choices, requires_avx2
from ttile import KernelKind, Route, _kernels
from ttile.core.reference import conv_mismatch
from ttile.runtime import execute, weight_cache, winograd
from ttile.runtime.scratch import aligned_empty

pytestmark = requires_avx2

#: The Winograd kernels this CPU runs, by the extension's ISA code (the AVX2 one runs on
#: every AVX-512 CPU too).
KERNEL_ISAS = [pytest.param(_kernels.ISA_AVX2, id="avx2")] + (
    [pytest.param(_kernels.ISA_AVX512F, id="avx512f")] if ttile.has_avx512f() else [])


#: The output tiles: F(4x4, 3x3) and F(2x2, 3x3).
TILES = [pytest.param(4, id="F4"), pytest.param(2, id="F2")]


def _run(rng, n, c, k, h, w, pad, threads, code, tile=4, **fused):
    """The kernel of ISA ``code`` and output ``tile`` on random data: (x, weights, y,
    pads) for the reference."""
    pt, pb, pl, pr = pad
    ho, wo = h + pt + pb - 2, w + pl + pr - 2
    x = aligned_empty((n, h, w, c))
    x[...] = rng.uniform(-1, 1, x.shape)
    wt = rng.uniform(-1, 1, (3, 3, c, k)).astype(np.float32)
    y = aligned_empty((n, ho, wo, k))
    u = _kernels.winograd_weights(wt, False, threads, isa=code, tile=tile)
    _kernels.conv2d_winograd(x, u, y, pt, pl, threads, **fused, isa=code, tile=tile)
    return x, wt, y, pad


# (n, c, k, h, w, pads): tiles cut by the output's edge, channel and output tails,
# every padding, a batch, and one layer whose tiles need two super-blocks
SHAPES = [
    (1, 16, 16, 8, 8, (1, 1, 1, 1)),
    (1, 17, 33, 7, 9, (1, 1, 1, 1)),
    (2, 20, 40, 13, 11, (1, 1, 1, 1)),
    (1, 24, 100, 6, 6, (2, 2, 2, 2)),
    (1, 32, 16, 6, 5, (0, 0, 0, 0)),
    (1, 16, 48, 10, 12, (0, 1, 1, 0)),
    (1, 64, 64, 78, 78, (1, 1, 1, 1)),
]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("code", KERNEL_ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
def test_matches_the_float64_reference(shape, threads, code, tile):
    rng = np.random.default_rng(sum(shape[:5]) + threads)
    x, wt, y, pads = _run(rng, *shape, threads, code, tile)
    assert conv_mismatch(y, x, wt, (1, 1), pads) is None


@pytest.mark.parametrize("code", KERNEL_ISAS)
def test_a_changed_weight_changes_the_f2_output(code):
    """The F(2x2) comparison can fail: one weight changed moves the outputs it reaches."""
    rng = np.random.default_rng(5)
    x, wt, y, pads = _run(rng, 1, 16, 16, 6, 6, (1, 1, 1, 1), 1, code, 2)
    wt[1, 2, 3, 4] += 0.5
    assert conv_mismatch(y, x, wt, (1, 1), pads) is not None


def test_two_super_blocks_are_needed_by_the_largest_shape():
    """The last shape above is there to cross a super-block boundary: its transformed
    input and products exceed the kernel's WG_BLOCK_BYTES (6 MiB)."""
    _, c, k, h, w, _ = SHAPES[-1]
    tiles = ((h + 2 - 2 + 3) // 4) * ((w + 2 - 2 + 3) // 4)
    assert 36 * tiles * (c + k) * 4 > 6 << 20


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("code", KERNEL_ISAS)
@pytest.mark.parametrize("activation", [0, 1, 2, 3, 4, 5])
def test_the_epilogue_is_fused(activation, code, tile):
    """bias, residual and each activation in the store: the plain kernel's result with
    them applied after (in float32: the same sums), to within rounding."""
    rng = np.random.default_rng(activation)
    n, c, k, h, w = 1, 24, 40, 9, 10
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, h, w, k)).astype(np.float32)
    x, wt, plain, pads = _run(np.random.default_rng(0), n, c, k, h, w, (1, 1, 1, 1), 2,
                              code, tile)
    _, _, y, _ = _run(np.random.default_rng(0), n, c, k, h, w, (1, 1, 1, 1), 2, code,
                      tile, bias=bias, residual=residual, activation=activation, slope=0.1)
    assert conv_mismatch(plain, x, wt, (1, 1), pads) is None
    z = plain.astype(np.float64) + bias + residual
    expected = {0: z, 1: np.maximum(z, 0), 2: np.clip(z, 0, 6),
                3: np.where(z > 0, z, 0.1 * z), 4: z / (1 + np.exp(-z)),
                5: 1 / (1 + np.exp(-z))}[activation]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("code", KERNEL_ISAS)
def test_rsck_and_kcrs_weights_transform_alike(code, tile):
    rng = np.random.default_rng(3)
    w = rng.uniform(-1, 1, (3, 3, 20, 37)).astype(np.float32)
    kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    a = _kernels.winograd_weights(w, False, 2, isa=code, tile=tile)
    b = _kernels.winograd_weights(kcrs, True, 1, isa=code, tile=tile)
    assert a.size == _kernels.winograd_weight_floats(20, 37, code, tile)
    assert a.ctypes.data % 64 == 0   # on a line: no product's weight load spans two
    np.testing.assert_array_equal(a, b)


def test_the_families_panels_differ():
    """The AVX2 kernel's panels are of 8-float vectors, the AVX-512F one's of 16: the
    transformed weights of one family are not the other's (37 outputs: 5 x 8 = 40 in
    AVX2's panels, 3 x 16 = 48 in AVX-512F's)."""
    assert _kernels.winograd_panel(37, _kernels.ISA_AVX2) % 8 == 0
    assert _kernels.winograd_panel(37, _kernels.ISA_AVX512F) % 16 == 0
    assert _kernels.winograd_weight_floats(20, 37, _kernels.ISA_AVX2) == 36 * 20 * 40
    assert _kernels.winograd_weight_floats(20, 37, _kernels.ISA_AVX512F) == 36 * 20 * 48
    assert _kernels.winograd_weight_floats(20, 37, _kernels.ISA_AVX512F, 2) == 16 * 20 * 48


@pytest.mark.parametrize("code", KERNEL_ISAS)
def test_bad_arguments_raise(code):
    x = aligned_empty((1, 8, 8, 16))
    y = aligned_empty((1, 8, 8, 16))
    with pytest.raises(ValueError, match="transformed weights"):
        _kernels.conv2d_winograd(x, np.zeros(10, np.float32), y, 1, 1, 1, isa=code)
    with pytest.raises(ValueError, match=r"\(3, 3, C, K\)"):
        _kernels.winograd_weights(np.zeros((5, 5, 16, 16), np.float32), False, 1,
                                  isa=code)
    with pytest.raises(ValueError, match="out must be"):
        _kernels.winograd_weights(np.zeros((3, 3, 16, 16), np.float32), False, 1,
                                  np.zeros(7, np.float32), isa=code)
    with pytest.raises(ValueError, match="unknown vector isa"):
        _kernels.winograd_weights(np.zeros((3, 3, 16, 16), np.float32), False, 1,
                                  isa=_kernels.ISA_PORTABLE)
    u = _kernels.winograd_weights(np.zeros((3, 3, 16, 16), np.float32), False, 1, isa=code)
    with pytest.raises(ValueError, match="tile is 2 or 4"):
        _kernels.conv2d_winograd(x, u, y, 1, 1, 1, isa=code, tile=3)
    with pytest.raises(ValueError, match="tile is 2 or 4"):
        _kernels.winograd_weights(np.zeros((3, 3, 16, 16), np.float32), False, 1, isa=code,
                                  tile=6)
    with pytest.raises(ValueError, match="transformed weights"):   # F(4x4)'s, not F(2x2)'s
        _kernels.conv2d_winograd(x, u, y, 1, 1, 1, isa=code, tile=2)


@pytest.mark.skipif(ttile.has_avx512f(), reason="this CPU runs AVX-512F")
def test_the_avx512_kernel_is_refused_without_avx512():
    """On a CPU without AVX-512F its kernel raises instead of faulting."""
    w = np.zeros((3, 3, 16, 16), np.float32)
    with pytest.raises(RuntimeError, match="without AVX-512F"):
        _kernels.winograd_weights(w, False, 1, isa=_kernels.ISA_AVX512F)


# -- which calls it serves -----------------------------------------------------------------
# served: the output tile of the Winograd kernel that serves the call (0: none), per call
# and pre-packed alike unless ``packed_only``
@pytest.mark.parametrize("x_shape, w_shape, kwargs, served, packed_only", [
    ((1, 32, 14, 14), (32, 32, 3, 3), {"padding": 1}, 4, False),
    ((2, 16, 11, 9), (16, 16, 3, 3), {}, 4, False),               # 2 x 3 x 2 tiles
    ((1, 64, 7, 7), (64, 64, 3, 3), {"padding": 1}, 2, True),     # 4 tiles of 4x4, 16 of 2x2
    ((1, 64, 5, 5), (64, 64, 3, 3), {"padding": 1}, 0, False),    # 9 tiles of 2x2: too few
    ((1, 512, 7, 7), (512, 512, 3, 3), {"padding": 1}, 0, False),  # F(2x2) weights too large
    ((1, 32, 14, 14), (32, 32, 3, 3), {"padding": 1, "stride": 2}, 0, False),
    ((1, 32, 14, 14), (32, 32, 3, 3), {"padding": 2, "dilation": 2}, 0, False),
    ((1, 32, 14, 14), (32, 16, 3, 3), {"padding": 1, "groups": 2}, 0, False),
    ((1, 3, 64, 64), (32, 3, 3, 3), {"padding": 1}, 0, False),     # too few input channels
    ((1, 32, 14, 14), (8, 32, 3, 3), {"padding": 1}, 0, False),    # too few outputs
    ((1, 32, 5, 5), (32, 32, 3, 3), {}, 0, False),                 # output under one tile
    ((1, 32, 14, 14), (32, 32, 5, 5), {"padding": 2}, 0, False),
    ((3, 16, 14, 14), (16, 16, 3, 3), {"padding": 2}, 4, False),   # windows of padding...
    ((3, 16, 1, 1), (16, 16, 3, 3), {"padding": 3}, 0, False),     # ...alone: exact zeros
])
def test_which_calls_it_serves(x_shape, w_shape, kwargs, served, packed_only):
    for prepacked in (False, True):
        plan = ttile.plan(x_shape, w_shape, prepacked=prepacked, **kwargs)
        tile = served if prepacked or not packed_only else 0
        assert (plan.kind is KernelKind.WINOGRAD) == bool(tile), (plan.kind, prepacked)
        if tile:
            assert f"F({tile}x{tile}, 3x3)" in plan.note, plan.note


def test_a_layer_runs_f2_on_a_small_map_and_f4_on_a_larger_one():
    """One Conv2d called at two input sizes keeps one set of transformed weights per
    tile, and each call matches the float64 reference."""
    rng = np.random.default_rng(8)
    w = rng.uniform(-1, 1, (3, 3, 32, 48)).astype(np.float32)
    layer = ttile.Conv2d(w, padding=1, layout="NHWC", threads=2)
    for hw, tile in ((7, 2), (14, 4), (7, 2)):
        x = rng.uniform(-1, 1, (1, hw, hw, 32)).astype(np.float32)
        assert f"F({tile}x{tile}" in ttile.plan(x.shape, w.shape, padding=1, layout="NHWC",
                                                prepacked=True).note
        assert conv_mismatch(layer(x), x, w, (1, 1), (1, 1, 1, 1)) is None
    assert sorted(key[2] for key in layer._packed) == [2, 4]


def test_it_can_be_switched_off_and_serves_each_vector_family():
    shapes = ((1, 32, 14, 14), (32, 32, 3, 3))
    previous = ttile.use_winograd(False)
    try:
        assert ttile.plan(*shapes, padding=1).kind is not KernelKind.WINOGRAD
    finally:
        ttile.use_winograd(previous)
    for isa in ["avx2"] + (["avx512f"] if ttile.has_avx512f() else []):
        before = ttile.set_isa(isa)
        try:
            plan = ttile.plan(*shapes, padding=1)
            assert plan.kind is KernelKind.WINOGRAD and plan.isa == isa
        finally:
            ttile.set_isa(before)
    before = ttile.set_isa("portable")
    try:
        assert ttile.plan(*shapes, padding=1).kind is not KernelKind.WINOGRAD
    finally:
        ttile.set_isa(before)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kinds of kernel the calls ran, in order (every route's runner records)."""
    kinds = []
    for route, runner in list(execute.RUNNERS.items()):
        def recorder(plan, choice, *args, _runner=runner):
            kinds.append(choice.kind)
            return _runner(plan, choice, *args)
        monkeypatch.setitem(execute.RUNNERS, route, recorder)
    forget_choices()
    yield kinds
    forget_choices()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("threads", [1, 2])
def test_calls_in_both_layouts_match_and_take_the_reported_route(kernel_calls, layout,
                                                                  threads):
    rng = np.random.default_rng(11)
    x_shape = (1, 48, 15, 17) if layout == "NCHW" else (1, 15, 17, 48)
    w_shape = (64, 48, 3, 3) if layout == "NCHW" else (3, 3, 48, 64)
    x = rng.uniform(-1, 1, x_shape).astype(np.float32)
    w = rng.uniform(-1, 1, w_shape).astype(np.float32)
    bias = rng.uniform(-1, 1, 64).astype(np.float32)
    plan = ttile.plan(x_shape, w_shape, padding=1, layout=layout, threads=threads)
    assert plan.kind is KernelKind.WINOGRAD
    assert plan.route is (Route.NHWC if layout == "NHWC" else Route.NCHW_CONVERTED)
    layer = ttile.Conv2d(w, bias, padding=1, layout=layout, activation="relu")
    for _ in range(2):   # the second per-call call reuses the transformed weights
        y = ttile.conv2d(x, w, bias, padding=1, layout=layout, threads=threads,
                         activation="relu")
        z = layer(x, threads=threads)
        np.testing.assert_array_equal(y, z)
    assert kernel_calls == [KernelKind.WINOGRAD] * 4
    plain = ttile.conv2d(x, w, padding=1, layout=layout, threads=threads)
    assert conv_mismatch(plain, x, w, (1, 1), (1, 1, 1, 1), layout) is None
    per_channel = bias.reshape(-1, 1, 1) if layout == "NCHW" else bias
    np.testing.assert_allclose(y, np.maximum(plain + per_channel, 0), rtol=1e-6,
                               atol=1e-5)


def test_weights_changed_between_calls_are_transformed_again(kernel_calls):
    """The transformed copy is never stale: a caller that changes its array in place
    gets the new weights' result, transformed again; an array found changed twice is
    not kept any more (weight_cache.MAX_CHANGES), and these weights being too large to
    transform on every call, a direct kernel serves it from then on."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (1, 64, 12, 12)).astype(np.float32)
    w = rng.uniform(-1, 1, (64, 64, 3, 3)).astype(np.float32)   # 147 KB: reused
    assert w.nbytes >= weight_cache.MIN_BYTES
    for step in range(3):
        w[step, 0, 1, 1] += 1.0
        y = ttile.conv2d(x, w, padding=1, threads=2)
        assert conv_mismatch(y, x, w, (1, 1), (1, 1, 1, 1), "NCHW") is None, step
    assert weight_cache.MAX_CHANGES == 2
    assert kernel_calls[:2] == [KernelKind.WINOGRAD] * 2
    assert kernel_calls[2] is not KernelKind.WINOGRAD


def test_large_weights_that_cannot_be_reused_get_a_direct_kernel(kernel_calls):
    """float64 weights are converted on every call, so no transformed copy can be kept:
    over PER_CALL_MAX_BYTES a direct kernel serves; small ones are transformed per call."""
    rng = np.random.default_rng(9)
    x = rng.uniform(-1, 1, (1, 64, 12, 12)).astype(np.float32)
    large = rng.uniform(-1, 1, (64, 64, 3, 3))
    small = rng.uniform(-1, 1, (16, 16, 3, 3))
    assert 4 * large.size > winograd.PER_CALL_MAX_BYTES >= 4 * small.size
    y = ttile.conv2d(x, large, padding=1)
    assert conv_mismatch(y, x, large.astype(np.float32), (1, 1), (1, 1, 1, 1),
                         "NCHW") is None
    y = ttile.conv2d(x[:, :16], small, padding=1)
    assert conv_mismatch(y, x[:, :16], small.astype(np.float32), (1, 1), (1, 1, 1, 1),
                         "NCHW") is None
    assert kernel_calls[0] is not KernelKind.WINOGRAD
    assert kernel_calls[1] is KernelKind.WINOGRAD
