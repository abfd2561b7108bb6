"""Out-of-bounds guards: every kernel family runs on tensors that end exactly at a
PROT_NONE page (then start right after one), on shapes with tails in every dimension.
An overread or overwrite faults the test process instead of passing silently; writes
below or above the output land in a canary region that is checked afterwards."""
import ctypes
import math

import numpy as np
import pytest

import ttile
from conftest import AVAILABLE_ISAS, requires_avx512
from guarded import guarded_copy
from ttile import _kernels
from ttile.runtime import jit, registry, routes
from ttile.core.cbuild import symbol_address
from ttile.core.reference import assert_conv_close
from ttile.core.spec import ConvSpec
from ttile.core.vectors import extension_code

SIDES = ["end", "start"]

#: (n, h, w, c, k, r, s, stride, (top, bottom, left, right)): K, C, H, W off the vector
#: and unroll sizes, strides 1-3, no / symmetric / asymmetric padding, pointwise layers.
TAIL_SHAPES = [
    (1, 7, 9, 3, 17, 3, 3, (1, 1), (1, 1, 1, 1)),
    (2, 11, 5, 13, 33, 5, 3, (2, 1), (2, 2, 1, 1)),
    (1, 13, 13, 17, 47, 7, 7, (3, 3), (3, 3, 3, 3)),
    (1, 6, 10, 1, 1, 1, 1, (1, 2), (0, 0, 0, 0)),
    (3, 9, 8, 5, 70, 4, 2, (2, 3), (1, 2, 0, 1)),
    (1, 17, 17, 31, 129, 1, 1, (2, 2), (0, 0, 0, 0)),
    # 1x1, stride 1, no padding: the generic kernel runs each image as one row of H*W.
    (2, 9, 7, 21, 50, 1, 1, (1, 1), (0, 0, 0, 0)),
    (1, 23, 1, 5, 65, 1, 1, (1, 1), (0, 0, 0, 0)),
]


def _spec(case) -> ConvSpec:
    n, h, w, c, k, r, s, (sh, sw), (pt, pb, pl, pr) = case
    return ConvSpec(n=n, k=k, c=c, h=h, w=w, r=r, s=s, stride_h=sh, stride_w=sw,
                    pad_top=pt, pad_bottom=pb, pad_left=pl, pad_right=pr)


def _tensors(spec: ConvSpec, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (spec.n, spec.h, spec.w, spec.c)).astype(np.float32)
    w = rng.uniform(-1, 1, (spec.r, spec.s, spec.c, spec.k)).astype(np.float32)
    return x, w


def _pads(spec: ConvSpec):
    return (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)


def _run_guarded(spec: ConvSpec, side: str, weights: np.ndarray, launch,
                 nchw_out: bool = False) -> None:
    """Place x, weights and y against guard pages on ``side``, launch, check the output
    (NHWC; x and y NCHW with ``nchw_out``) against float64 and the canaries around y."""
    x, w = _tensors(spec)
    gx = guarded_copy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nchw_out else x, side)
    gw = guarded_copy(weights, side)
    shape = (spec.n, spec.k, spec.ho, spec.wo) if nchw_out else (spec.n, spec.ho, spec.wo, spec.k)
    gy = guarded_copy(np.zeros(shape, np.float32), side)
    gy.array.view(np.uint32)[...] = 0xA5A5A5A5  # a kernel must overwrite every output
    launch(gx.array, gw.array, gy.array)
    assert gy.canary_intact(), "the kernel wrote outside its output"
    assert gx.canary_intact() and gw.canary_intact(), "the kernel wrote into its inputs' fences"
    # inputs untouched
    np.testing.assert_array_equal(gx.array.transpose(0, 2, 3, 1) if nchw_out else gx.array, x)
    y = gy.array.transpose(0, 2, 3, 1) if nchw_out else gy.array
    assert_conv_close(np.ascontiguousarray(y), x, w, (spec.stride_h, spec.stride_w),
                      _pads(spec), layout="NHWC")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", TAIL_SHAPES, ids=lambda c: f"k{c[4]}c{c[3]}r{c[5]}s{c[6]}")
@pytest.mark.parametrize("family", ["portable", "avx2", "avx2-packed", "avx512f",
                                    "avx512f-packed"])
def test_generic_kernels_stay_in_bounds(family, case, side):
    name = family.split("-")[0]
    if name not in AVAILABLE_ISAS:
        pytest.skip(f"this CPU cannot run the {name} family")
    spec = _spec(case)
    x, w = _tensors(spec)
    isa = {"portable": _kernels.ISA_PORTABLE, "avx2": _kernels.ISA_AVX2,
           "avx512f": _kernels.ISA_AVX512F}[name]
    for threads in (1, 2):
        if family.endswith("-packed"):
            panel = _kernels.generic_panel(spec.k, spec.wo, isa)
            _run_guarded(spec, side, _kernels.pack_weights(w, panel),
                         lambda gx, gw, gy:
                         _kernels.conv2d_generic_packed(gx, gw, gy, spec.stride_h,
                                                        spec.stride_w, spec.pad_top,
                                                        spec.pad_left, threads, isa=isa))
        else:
            _run_guarded(spec, side, w, lambda gx, gw, gy:
                         _kernels.conv2d_generic_nhwc(gx, gw, gy, spec.stride_h, spec.stride_w,
                                                      spec.pad_top, spec.pad_left, threads, isa))


def _registry_cases(limit=None):
    """The registry's kernels, smallest first; with ``limit``, that many of each family."""
    entries = sorted(registry.KERNELS,
                     key=lambda e: e.spec.n * e.spec.h * e.spec.w * (e.spec.c + e.spec.k)
                     + e.spec.r * e.spec.s * e.spec.c * e.spec.k)
    if limit is not None:
        entries = [e for isa in (ttile.Isa.AVX512F, ttile.Isa.AVX2)
                   for e in [e for e in entries if e.isa is isa][:limit]]
    return [pytest.param(e, id=f"{e.layer}-{e.cpu[:16]}-t{e.threads}-{e.isa.value}")
            for e in entries]


def _check_registry_entry(entry, side):
    if entry.isa.value not in AVAILABLE_ISAS:
        pytest.skip(f"this CPU cannot run the {entry.isa.value} family")
    spec = entry.spec
    _, w = _tensors(spec)
    threads = entry.threads
    _run_guarded(spec, side, _kernels.pack_weights(w, entry.panel),
                 lambda gx, gw, gy: _kernels.run_tuned(entry.index, gx, gw, gy, threads))
    if entry.nchw:   # its NCHW entry point, storing tile by tile
        _run_guarded(spec, side, _kernels.pack_weights(w, entry.panel),
                     lambda gx, gw, gy: _kernels.run_tuned(entry.index, gx, gw, gy, threads,
                                                           nchw_out=True), nchw_out=True)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("entry", _registry_cases(limit=6))
def test_smallest_tuned_kernels_stay_in_bounds(entry, side):
    _check_registry_entry(entry, side)


@pytest.mark.slow
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("entry", _registry_cases())
def test_every_tuned_kernel_stays_in_bounds(entry, side):
    _check_registry_entry(entry, side)


@pytest.mark.parametrize("family", ["avx512f", "avx2"])
@pytest.mark.parametrize("case", TAIL_SHAPES[:3] + TAIL_SHAPES[4:5],
                         ids=lambda c: f"k{c[4]}c{c[3]}r{c[5]}s{c[6]}")
def test_jit_kernels_stay_in_bounds(case, family, monkeypatch, tmp_path):
    pytest.importorskip("islpy")
    if family not in AVAILABLE_ISAS:
        pytest.skip(f"this CPU cannot run the {family} family")
    spec = _spec(case)
    # ship the tuned kernel whatever its speed: its bounds are what is tested
    settings = jit.JitSettings(budget_seconds=2.0, ship=ttile.ShipPolicy(math.inf))
    result = jit.tune(spec, 1, settings, cache_root=tmp_path, isa=ttile.Isa(family))
    assert result.wrong == 0
    if result.kind is not ttile.KernelKind.JIT:
        pytest.skip("no scheme of the space fits this shape")  # generic: tested above
    library = ctypes.CDLL(str(result.library))
    address = symbol_address(library, result.function)
    _, w = _tensors(spec)
    packed = _kernels.pack_weights(w, result.panel)
    for side in SIDES:
        _run_guarded(spec, side, packed, lambda gx, gw, gy: _kernels.run_compiled(
            address, gx, gw, gy, 1, spec.input_shape(), spec.packed_weight_shape(result.panel),
            spec.output_shape(), isa=extension_code(ttile.Isa(family))))


@pytest.mark.parametrize("side,offset", [("end", 1), ("start", -1)])
def test_the_guard_page_really_faults(side, offset):
    """The helper itself: touching one float past the array kills the process."""
    import subprocess
    import sys
    from pathlib import Path
    script = (f"import sys, ctypes, numpy as np; sys.path.insert(0, {str(Path(__file__).parent)!r});"
              f"from guarded import guarded_copy;"
              f"g = guarded_copy(np.ones(1000, np.float32), {side!r});"
              f"a = g.array.ctypes.data + 4 * ({offset} if {offset} < 0 else 1000);"
              f"print(ctypes.c_float.from_address(a).value)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    # SIGSEGV; under AddressSanitizer (abort_on_error) a reported SEGV and SIGABRT
    assert proc.returncode == -11 or (proc.returncode == -6 and b"SEGV" in proc.stderr), \
        (proc.returncode, proc.stderr[-500:])


#: RSCK weights handed to the generic kernel, which packs them itself: K on and off the
#: vector width, one and several panel groups, 1x1 layers.
RSCK_SHAPES = [
    (1, 7, 7, 24, 48, 3, 3, (1, 1), (1, 1, 1, 1)),
    (2, 5, 9, 13, 33, 1, 3, (1, 2), (0, 0, 1, 1)),
    (1, 14, 14, 8, 70, 3, 3, (2, 2), (1, 1, 1, 1)),
    (1, 3, 17, 5, 17, 1, 1, (1, 1), (0, 0, 0, 0)),
    (1, 6, 6, 600, 300, 3, 3, (1, 1), (1, 1, 1, 1)),   # panels larger than L2_PANEL_BYTES
    (1, 6, 6, 600, 96, 3, 3, (1, 1), (1, 1, 1, 1)),    # read in place: small output, K % 16 == 0
]


@requires_avx512
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", RSCK_SHAPES, ids=lambda c: f"k{c[4]}c{c[3]}r{c[5]}s{c[6]}")
@pytest.mark.parametrize("weights", ["RSCK", "KCRS"])
def test_generic_kernel_packing_weights_itself_stays_in_bounds(weights, case, side):
    """The caller's weights handed to the generic kernel, whose threads pack the panels
    they use: RSCK (a per-call NHWC conv2d) or torch's KCRS (a per-call NCHW one)."""
    spec = _spec(case)
    _, w = _tensors(spec)
    kcrs = weights == "KCRS"
    if kcrs:
        w = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    for threads in (1, 2, 5):
        _run_guarded(spec, side, w, lambda gx, gw, gy: _kernels.conv2d_generic_packed(
            gx, gw, gy, spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left, threads,
            False, kcrs))


@requires_avx512
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", TAIL_SHAPES + RSCK_SHAPES,
                         ids=lambda c: f"k{c[4]}c{c[3]}r{c[5]}s{c[6]}")
def test_generic_kernel_writing_nchw_stays_in_bounds(case, side):
    """The NCHW output path: each thread's row buffer is transposed into y[n][k][oh][ow];
    the NHWC input comes from the layout conversion, also fenced."""
    spec = _spec(case)
    x, w = _tensors(spec)
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    for threads in (1, 2, 3):
        gx = guarded_copy(x_nchw, side)
        gxh = guarded_copy(np.zeros(spec.input_shape(), np.float32), side)
        _kernels.nchw_to_nhwc(gx.array, threads, gxh.array)
        gy = guarded_copy(np.zeros((spec.n, spec.k, spec.ho, spec.wo), np.float32), side)
        gy.array.view(np.uint32)[...] = 0xA5A5A5A5
        _kernels.conv2d_generic_packed(gxh.array, w, gy.array, spec.stride_h, spec.stride_w,
                                       spec.pad_top, spec.pad_left, threads, True)
        assert gy.canary_intact() and gxh.canary_intact() and gx.canary_intact()
        assert_conv_close(np.ascontiguousarray(gy.array.transpose(0, 2, 3, 1)), x, w,
                          (spec.stride_h, spec.stride_w), _pads(spec), layout="NHWC")


#: Rows wide enough for the NCHW-input blocks of 12-24 pixels (K <= 32), whose interior
#: blocks read through one pointer at stride 1 or 2, and their padded edge blocks.
WIDE_ROW_SHAPES = [
    (1, 9, 60, 12, 16, 3, 3, (1, 2), (1, 1, 1, 1)),
    (2, 5, 50, 9, 16, 3, 3, (1, 1), (1, 1, 1, 1)),
    (1, 4, 61, 8, 30, 5, 5, (2, 2), (2, 2, 2, 2)),
    (1, 6, 45, 10, 20, 3, 3, (1, 3), (0, 0, 0, 0)),
]


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512f") if i in AVAILABLE_ISAS])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", TAIL_SHAPES + RSCK_SHAPES + WIDE_ROW_SHAPES,
                         ids=lambda c: f"k{c[4]}c{c[3]}r{c[5]}s{c[6]}w{c[2]}")
def test_generic_kernel_reading_nchw_stays_in_bounds(isa, case, side):
    """The NCHW input path (TTILE_NCHW_IN): every pixel's channels a plane apart, padded
    pixels read at stride 0 from the zero row, wide interior blocks through one pointer;
    packed and KCRS weights, NCHW and NHWC outputs, dilation 1 and 2."""
    spec = _spec(case)
    x, w = _tensors(spec)
    code = {"avx2": _kernels.ISA_AVX2, "avx512f": _kernels.ISA_AVX512F}[isa]
    packed = _kernels.pack_weights(w, _kernels.generic_panel(spec.k, spec.wo, code))
    kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    gx = guarded_copy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), side)
    for threads, weights, nchw_out in ((1, packed, True), (2, kcrs, True), (3, packed, False)):
        gw = guarded_copy(weights, side)
        shape = ((spec.n, spec.k, spec.ho, spec.wo) if nchw_out
                 else (spec.n, spec.ho, spec.wo, spec.k))
        gy = guarded_copy(np.zeros(shape, np.float32), side)
        gy.array.view(np.uint32)[...] = 0xA5A5A5A5
        _kernels.conv2d_generic_packed(gx.array, gw.array, gy.array, spec.stride_h,
                                       spec.stride_w, spec.pad_top, spec.pad_left, threads,
                                       nchw_out, weights is kcrs, isa=code, nchw_in=True)
        assert gy.canary_intact() and gx.canary_intact() and gw.canary_intact()
        y = gy.array.transpose(0, 2, 3, 1) if nchw_out else gy.array
        assert_conv_close(np.ascontiguousarray(y), x, w, (spec.stride_h, spec.stride_w),
                          _pads(spec), layout="NHWC")
    # dilation 2 where the input is large enough for it
    if spec.h >= 2 * spec.r and spec.w >= 2 * spec.s and spec.pad_top == spec.pad_bottom \
            and spec.pad_left == spec.pad_right:
        from ttile.core.reference import conv2d_nhwc_f64
        ho = (spec.h + 2 * spec.pad_top - 2 * (spec.r - 1) - 1) // spec.stride_h + 1
        wo = (spec.w + 2 * spec.pad_left - 2 * (spec.s - 1) - 1) // spec.stride_w + 1
        gy = guarded_copy(np.zeros((spec.n, spec.k, ho, wo), np.float32), side)
        panel = _kernels.generic_panel(spec.k, wo, code)
        _kernels.conv2d_generic_packed(gx.array, _kernels.pack_weights(w, panel), gy.array,
                                       spec.stride_h, spec.stride_w, spec.pad_top,
                                       spec.pad_left, 2, True, isa=code, nchw_in=True,
                                       dil_h=2, dil_w=2)
        assert gy.canary_intact() and gx.canary_intact()
        expected = conv2d_nhwc_f64(x, w, (spec.stride_h, spec.stride_w), _pads(spec), (2, 2))
        np.testing.assert_allclose(gy.array.transpose(0, 2, 3, 1), expected, rtol=1e-4,
                                   atol=1e-4 * spec.c * spec.r * spec.s)


def _guarded_epilogue_call(side, x, w, bias, residual, out_shape, call) -> np.ndarray:
    """x, w, bias and residual copied against guard pages on ``side`` and an output of
    ``out_shape`` filled with a canary pattern; ``call(x, w, bias, residual, out)`` runs
    on them, then no write may have left the output. Returns the output."""
    gx, gw = guarded_copy(x, side), guarded_copy(w, side)
    gb, gr = guarded_copy(bias, side), guarded_copy(residual, side)
    gy = guarded_copy(np.zeros(out_shape, np.float32), side)
    gy.array.view(np.uint32)[...] = 0xA5A5A5A5
    call(gx.array, gw.array, gb.array, gr.array, gy.array)
    assert gy.canary_intact(), "the kernel wrote outside its output"
    for fence in (gx, gw, gb, gr):
        assert fence.canary_intact(), "the kernel wrote into an input's fence"
    return gy.array


#: (n, h, w, channels, k, r, s, stride, pad, dilation, groups): depthwise with channel
#: tails and both fast-path strides, a 5x5, a dilated and a 7x7 (general blocks), rows
#: wider than one fast-path block (edge blocks apart from the inside ones, whose partial
#: channel vector runs as two general blocks; no padding: no left edge), and grouped
#: layers with several channels per group.
GROUPED_SHAPES = [
    (1, 5, 41, 40, 40, 3, 3, 1, 1, 1, 40),
    (1, 6, 37, 33, 33, 5, 5, 2, 2, 1, 33),
    (1, 4, 35, 32, 32, 3, 3, 1, 0, 1, 32),
    (1, 9, 13, 37, 37, 3, 3, 1, 1, 1, 37),
    (2, 8, 11, 20, 20, 3, 3, 2, 1, 1, 20),
    (1, 10, 19, 16, 16, 5, 5, 2, 2, 1, 16),
    (1, 12, 12, 24, 24, 3, 3, 1, 2, 2, 24),
    (1, 9, 9, 5, 5, 7, 7, 1, 3, 1, 5),
    (1, 7, 9, 12, 20, 3, 3, 1, 1, 1, 4),
    (2, 6, 7, 9, 6, 1, 1, 1, 0, 1, 3),
]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", GROUPED_SHAPES,
                         ids=lambda c: f"c{c[3]}k{c[4]}r{c[5]}s{c[7]}d{c[9]}g{c[10]}")
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512f"])
def test_grouped_kernels_and_epilogues_stay_in_bounds(isa, case, side):
    """The depthwise kernel and the generic kernels' grouped form, with every epilogue
    operand (bias, residual) against guard pages too."""
    if isa not in AVAILABLE_ISAS:
        pytest.skip(f"this CPU cannot run the {isa} family")
    n, h, w, c, k, r, s, stride, pad, dil, groups = case
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (n, h, w, c)).astype(np.float32)
    wt = rng.uniform(-1, 1, (r, s, c // groups, k)).astype(np.float32)
    ho = (h + 2 * pad - (r - 1) * dil - 1) // stride + 1
    wo = (w + 2 * pad - (s - 1) * dil - 1) // stride + 1
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, ho, wo, k)).astype(np.float32)
    from ttile.core.reference import conv2d_nhwc_f64
    expected = np.maximum(conv2d_nhwc_f64(x, wt, (stride, stride), (pad,) * 4, (dil, dil),
                                          groups) + bias + residual, 0)
    previous = ttile.set_isa(isa)
    try:
        for threads in (1, 2):
            def call(gx, gw, gb, gr, gy):
                out = ttile.conv2d(gx, gw, gb, stride, pad, dil, groups, layout="NHWC",
                                   threads=threads, activation="relu", residual=gr, out=gy)
                assert out is gy
            y = _guarded_epilogue_call(side, x, wt, bias, residual, (n, ho, wo, k), call)
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    finally:
        ttile.set_isa(previous)


@requires_avx512
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", [c for c in GROUPED_SHAPES if c[3] == c[4] == c[10]
                                  and (c[2] + 2 * c[8] - (c[6] - 1) * c[9] - 1) // c[7] + 1
                                  >= routes.DEPTHWISE_NCHW_MIN_WIDTH],
                         ids=lambda c: f"c{c[3]}r{c[5]}s{c[7]}p{c[8]}d{c[9]}")
def test_nchw_depthwise_kernel_stays_in_bounds(case, side):
    """The NCHW depthwise kernel (NCHW input, output and residual, torch's weights) with
    its masked row ends and padding against guard pages, at both thread counts."""
    n, h, w, c, _, r, s, stride, pad, dil, _ = case
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32)
    wt = rng.uniform(-1, 1, (c, 1, r, s)).astype(np.float32)
    ho = (h + 2 * pad - (r - 1) * dil - 1) // stride + 1
    wo = (w + 2 * pad - (s - 1) * dil - 1) // stride + 1
    bias = rng.uniform(-1, 1, c).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, c, ho, wo)).astype(np.float32)
    plan = ttile.plan(x.shape, wt.shape, bias, stride, pad, dil, c)
    assert plan.kind == ttile.KernelKind.DEPTHWISE and "NCHW depthwise" in plan.note
    from ttile.core.reference import conv2d_nhwc_f64
    expected = np.maximum(conv2d_nhwc_f64(
        np.ascontiguousarray(x.transpose(0, 2, 3, 1)),
        np.ascontiguousarray(wt.transpose(2, 3, 1, 0)), (stride, stride), (pad,) * 4,
        (dil, dil), c).transpose(0, 3, 1, 2) + bias[:, None, None] + residual, 0)
    for threads in (1, 2):
        def call(gx, gw, gb, gr, gy):
            out = ttile.conv2d(gx, gw, gb, stride, pad, dil, c, threads=threads,
                               activation="relu", residual=gr, out=gy)
            assert out is gy
        y = _guarded_epilogue_call(side, x, wt, bias, residual, (n, c, ho, wo), call)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@requires_avx512
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", [(1, 21, 13, 9, 11), (2, 7, 70, 8, 9), (1, 64, 17, 8, 8)],
                         ids=lambda c: "n{}c{}k{}h{}w{}".format(*c))
def test_nchw_pointwise_kernel_stays_in_bounds(case, side):
    """The NCHW 1x1 kernel's masked last column, short last block of output channels and
    next-column prefetches, with both weight layouts, against guard pages."""
    n, c, k, h, w = case
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32)
    wt = rng.uniform(-1, 1, (k, c, 1, 1)).astype(np.float32)
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, k, h, w)).astype(np.float32)
    expected = np.maximum(np.einsum("kc,nchw->nkhw", wt[:, :, 0, 0].astype(np.float64), x)
                          + bias[:, None, None] + residual, 0)
    for weights in (wt, np.ascontiguousarray(wt.transpose(2, 3, 1, 0))):
        for threads in (1, 2):
            def call(gx, gw, gb, gr, gy):
                _kernels.conv2d_pointwise_nchw(gx, gw, gy, threads, bias=gb, residual=gr,
                                               activation=1)
            y = _guarded_epilogue_call(side, x, weights, bias, residual, (n, k, h, w), call)
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def _off_line(a: np.ndarray, off: int) -> np.ndarray:
    """A copy of ``a`` that starts ``off`` floats into a 64-byte line of a buffer filled
    with NaN, so that a kernel using any float outside the array (the rest of its first
    and last lines, or further) puts NaN where the line-aligned copy has a number."""
    flat = np.full(a.size + 64, np.nan, np.float32)
    start = (-flat.ctypes.data // 4) % 16 + 16 + off
    view = flat[start:start + a.size].reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 64 == 4 * off
    return view


#: (n, h, w, channels, r, stride, pad): NHWC depthwise layers whose rows are wider than
#: one fast-path block, so the blocks between the edges follow the input's lines when it
#: is off them: stride 1 (vector 0 wraps; several blocks, one) and 2 (dw_fast0), 3x3 and
#: 5x5, one to seven channel vectors, no padding (no left edge), a batch.
OFF_LINE_SHAPES = [
    (2, 6, 40, 32, 3, 1, 1),
    (1, 5, 19, 16, 3, 1, 1),
    (1, 7, 37, 96, 3, 2, 1),
    (1, 6, 30, 48, 5, 1, 2),
    (2, 9, 45, 64, 5, 2, 2),
    (1, 5, 35, 112, 3, 1, 0),
    (1, 4, 36, 32, 3, 2, 0),
]


@pytest.mark.parametrize("off", [1, 4, 8, 12, 15])
@pytest.mark.parametrize("case", OFF_LINE_SHAPES,
                         ids=lambda c: f"n{c[0]}w{c[2]}c{c[3]}r{c[4]}s{c[5]}p{c[6]}")
@pytest.mark.parametrize("isa", ["avx2", "avx512f"])
def test_depthwise_input_off_its_lines_gives_the_line_aligned_result(isa, case, off):
    """An NHWC input that does not start on a line (numpy's own arrays start 16 bytes into
    one) runs other code in the AVX-512 kernel (channel vectors along the input's lines,
    dw_fast0 and the wrapped vector 0), and vector loads across lines in the AVX2 one:
    its results must be those of the same input on a line, bit for bit, with every
    epilogue operand, inf and NaN in the input staying in the outputs whose windows hold
    them, and nothing read from outside the array."""
    if isa not in AVAILABLE_ISAS:
        pytest.skip(f"this CPU cannot run the {isa} family")
    previous = ttile.set_isa(isa)
    try:
        _check_off_line_depthwise(case, off)
    finally:
        ttile.set_isa(previous)


def _check_off_line_depthwise(case, off):
    n, h, w, c, r, stride, pad = case
    rng = np.random.default_rng(off)
    x = rng.uniform(-1, 1, (n, h, w, c)).astype(np.float32)
    x[0, h // 2, w // 3, 5] = np.inf
    x[-1, 1, w - 2, c - 1] = np.nan
    x[0, 0, 17, 0] = -np.inf
    wt = rng.uniform(-1, 1, (r, r, 1, c)).astype(np.float32)
    ho, wo = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    bias = rng.uniform(-1, 1, c).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, ho, wo, c)).astype(np.float32)
    x_line = _off_line(x, 0)
    for threads in (1, 2):
        for epilogue in ({}, {"activation": "relu6", "residual": residual}):
            b = bias if epilogue else None
            expected = ttile.conv2d(x_line, wt, b, stride, pad, 1, c, layout="NHWC",
                                    threads=threads, **epilogue)
            got = ttile.conv2d(_off_line(x, off), wt, b, stride, pad, 1, c, layout="NHWC",
                               threads=threads, **epilogue)
            assert np.array_equal(got, expected, equal_nan=True)
    # and the line-aligned result is the convolution (the finite outputs)
    from ttile.core.reference import conv2d_nhwc_f64
    reference = conv2d_nhwc_f64(x, wt, (stride, stride), (pad,) * 4, (1, 1), c)
    plain = ttile.conv2d(x_line, wt, None, stride, pad, 1, c, layout="NHWC", threads=1)
    finite = np.isfinite(reference)
    assert np.array_equal(np.isnan(plain), np.isnan(reference))
    np.testing.assert_allclose(plain[finite], reference[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("off", [0, 4, 8, 12])
@pytest.mark.parametrize("isa", ["avx2", "avx512f"])
def test_a_new_depthwise_output_is_placed_like_its_input(isa, off):
    """Without out=, the NHWC depthwise kernel's output starts as far into a line as its
    input (its stores then follow whole lines, like its loads); other outputs start on a
    line."""
    if isa not in AVAILABLE_ISAS:
        pytest.skip(f"this CPU cannot run the {isa} family")
    previous = ttile.set_isa(isa)
    try:
        _check_depthwise_output_placement(off)
    finally:
        ttile.set_isa(previous)


def _check_depthwise_output_placement(off):
    x = _off_line(np.ones((1, 20, 40, 48), np.float32), off)
    wt = np.ones((3, 3, 1, 48), np.float32)
    y = ttile.conv2d(x, wt, None, 1, 1, 1, 48, layout="NHWC")
    assert y.ctypes.data % 64 == 4 * off and y.flags.c_contiguous
    assert y[0, 5, 5, 0] == 9.0 and y[0, 0, 0, 0] == 4.0
    dense = ttile.conv2d(x, np.ones((3, 3, 48, 16), np.float32), None, 1, 1, layout="NHWC")
    assert dense.ctypes.data % 64 == 0


@pytest.mark.parametrize("side", ["end", "start"])
@pytest.mark.parametrize("k, panel", [(40, 16), (100, 48), (64, 32)])
def test_the_weight_checks_stay_inside_their_arrays(side, k, panel):
    """The checks of reused packed weights (runtime/weight_cache.py) read every word of
    the weights and the panels, masked tails included, and nothing past them."""
    w = np.random.default_rng(k).standard_normal((3, 3, 5, k)).astype(np.float32)
    packed = _kernels.pack_weights(w, panel, 1, np.empty(
        ((k + panel - 1) // panel, 3, 3, 5, panel), np.float32))
    gw, gp, gc = guarded_copy(w, side), guarded_copy(packed, side), guarded_copy(w, side)
    codes = {"portable": _kernels.ISA_PORTABLE, "avx2": _kernels.ISA_AVX2,
             "avx512f": _kernels.ISA_AVX512F}
    for isa in AVAILABLE_ISAS:
        flag = codes[isa]
        for threads in (1, 3):
            assert _kernels.packed_matches(gw.array, gp.array, threads, flag)
    for threads in (1, 3):
        assert _kernels.same_bytes(gw.array, gc.array, threads)
    if "avx512f" in AVAILABLE_ISAS:   # a bf16 call's check: its rounded copy
        gb = guarded_copy(_kernels.bf16_round(w), side)
        for threads in (1, 3):
            assert _kernels.bf16_same_rounded(gw.array, gb.array, threads)


@pytest.mark.parametrize("isa", ["portable"] + (["avx512f"] if "avx512f" in AVAILABLE_ISAS
                                                else []))
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("shape,stride", [((1, 3, 7, 9), (2, 2)), ((2, 5, 33, 31), (2, 2)),
                                          ((1, 4, 17, 40), (3, 2)), ((1, 2, 5, 5), (1, 3))],
                         ids=lambda v: "x".join(map(str, v)))
def test_strided_pixel_gathering_stays_in_bounds(isa, side, shape, stride):
    """The strided 1x1 gather's masked stride-2 loads end at the row's last pixel read."""
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    flag = {"portable": _kernels.ISA_PORTABLE, "avx512f": _kernels.ISA_AVX512F}[isa]
    gx = guarded_copy(x, side)
    expected = x[:, :, ::stride[0], ::stride[1]]
    for threads in (1, 2):
        gy = guarded_copy(np.zeros(expected.shape, np.float32), side)
        _kernels.subsample_nchw(gx.array, *stride, threads, gy.array, isa=flag)
        assert gy.canary_intact() and gx.canary_intact()
        np.testing.assert_array_equal(gy.array, expected)


@pytest.mark.parametrize("isa", ["portable"] + (["avx512f"] if "avx512f" in AVAILABLE_ISAS
                                                else []))
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("shape", [(1, 3, 7, 9), (2, 1, 5, 5), (1, 2, 67, 65), (1, 4, 3, 1),
                                   (3, 3, 70, 61)], ids=lambda v: "x".join(map(str, v)))
def test_small_channel_conversion_stays_in_bounds(isa, side, shape):
    """NCHW -> NHWC of 1-4 channels (an RGB image): masked loads of the last pixels of
    each plane, masked stores of the last interleaved vectors, 4096-pixel tasks."""
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    flag = {"portable": _kernels.ISA_PORTABLE, "avx512f": _kernels.ISA_AVX512F}[isa]
    gx = guarded_copy(x, side)
    for threads in (1, 2, 3):
        gy = guarded_copy(np.zeros(x.transpose(0, 2, 3, 1).shape, np.float32), side)
        _kernels.nchw_to_nhwc(gx.array, threads, gy.array, isa=flag)
        assert gy.canary_intact() and gx.canary_intact()
        np.testing.assert_array_equal(gy.array, x.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("shape", [(1, 9, 7, 9), (2, 17, 5, 11), (1, 33, 13, 3), (1, 8, 8, 8)],
                         ids=lambda v: "x".join(map(str, v)))
def test_layout_tiles_stay_in_bounds(isa, side, shape):
    """NCHW <-> NHWC through each family's tiles (8x8 AVX2 or 16x16 AVX-512 registers, the
    ragged edges in plain C) and KCRS weights into panels: nothing read or written past
    the arrays."""
    flag = {"portable": _kernels.ISA_PORTABLE, "avx2": _kernels.ISA_AVX2,
            "avx512f": _kernels.ISA_AVX512F}[isa]
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    gx = guarded_copy(x, side)
    for threads in (1, 2):
        gy = guarded_copy(np.zeros(x.transpose(0, 2, 3, 1).shape, np.float32), side)
        _kernels.nchw_to_nhwc(gx.array, threads, gy.array, isa=flag)
        assert gy.canary_intact() and gx.canary_intact()
        np.testing.assert_array_equal(gy.array, x.transpose(0, 2, 3, 1))
        gb = guarded_copy(np.zeros(shape, np.float32), side)
        _kernels.nhwc_to_nchw(gy.array, threads, gb.array, isa=flag)
        assert gb.canary_intact() and gy.canary_intact()
        np.testing.assert_array_equal(gb.array, x)
    k, c = shape[1], shape[2]
    w = np.random.default_rng(5).standard_normal((k, c, 3, 3)).astype(np.float32)
    gw = guarded_copy(w, side)
    for panel in (8, 16, 24):
        expected = _kernels.pack_weights(np.ascontiguousarray(w.transpose(2, 3, 1, 0)), panel, 1)
        gp = guarded_copy(np.zeros(expected.shape, np.float32), side)
        _kernels.pack_weights_kcrs(gw.array, panel, 2, gp.array, isa=flag)
        assert gp.canary_intact() and gw.canary_intact()
        np.testing.assert_array_equal(gp.array, expected)


#: (n, h, w, c, k, r, s, stride, pad): the bf16 kernels' packings - stride 1 over the
#: packed width, stride-2 phase planes (3x3, 5x5, a 1x1 reading one plane, odd sizes, a
#: batch), a folded first layer and a 1x1 layer on its bf16 input in place.
BF16_SHAPES = [
    (1, 9, 11, 24, 40, 3, 3, 1, 1),
    (2, 14, 14, 64, 48, 3, 3, 2, 1),
    (1, 13, 10, 32, 32, 3, 3, 2, 0),
    (1, 11, 11, 40, 24, 5, 5, 2, 2),
    (1, 15, 15, 64, 40, 1, 1, 2, 0),
    (1, 20, 20, 3, 32, 7, 7, 2, 3),
    (1, 7, 9, 64, 40, 1, 1, 1, 0),
]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", BF16_SHAPES, ids=lambda c: f"n{c[0]}h{c[1]}c{c[3]}k{c[4]}r{c[5]}s{c[7]}")
@pytest.mark.parametrize("kind", ["amx", "dot"])
def test_bf16_kernels_stay_in_bounds(kind, case, side):
    """The bf16 kernels' reads of the packed input (its slack included), the input they
    pack, the packed weights and the epilogue's operands, and their writes, against guard
    pages: bf16 input and output (the network's case) with bias, residual and ReLU."""
    from ttile.core.kinds import KernelKind
    from ttile.runtime import bf16
    if kind == "amx" and not _kernels.amx_usable():
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile state)")
    if kind == "dot" and not _kernels.cpu_has_avx512bf16():
        pytest.skip("no AVX512_BF16 on this CPU")
    n, h, w, c, k, r, s, stride, pad = case
    spec = ConvSpec(n=n, k=k, c=c, h=h, w=w, r=r, s=s, stride_h=stride, stride_w=stride,
                    pad_top=pad, pad_bottom=pad, pad_left=pad, pad_right=pad)
    pack = bf16.packing(spec, KernelKind.AMX if kind == "amx" else KernelKind.DOT_BF16)
    code = _kernels.BF16_KERNEL_AMX if kind == "amx" else _kernels.BF16_KERNEL_AVX512
    rng = np.random.default_rng(5)
    x = _kernels.bf16_round(rng.uniform(-1, 1, (n, h, w, c)).astype(np.float32))
    wb = bf16.pack_weights(rng.uniform(-1, 1, (r, s, c, k)).astype(np.float32), "NHWC",
                           pack, 1)
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    out_shape = spec.output_shape()
    residual = _kernels.bf16_round(rng.uniform(-1, 1, out_shape).astype(np.float32))
    elems = _kernels.bf16_input_elems(pack.problem)
    results = []
    for fenced in (False, True):
        for threads in (1, 2):
            if fenced:
                gx, gw = guarded_copy(x, side), guarded_copy(wb, side)
                gb, gr = guarded_copy(bias, side), guarded_copy(residual, side)
                gxb = guarded_copy(np.zeros(elems, np.uint16), side)
                gy = guarded_copy(np.zeros(out_shape, np.uint16), side)
                arrays = [a.array for a in (gx, gw, gb, gr, gxb, gy)]
            else:
                arrays = [x, wb, bias, residual, np.zeros(elems, np.uint16),
                          np.zeros(out_shape, np.uint16)]
            ax, aw, ab, ar, axb, ay = arrays
            _kernels.conv2d_bf16(ax, False, aw, ay, pack.problem, c, h, w, pad, pad, code,
                                 threads, bias=ab, residual=ar, activation=1,
                                 folded=pack.folded, xb=axb)
            if fenced:
                assert gy.canary_intact(), "the kernel wrote outside its output"
                for fence in (gx, gw, gb, gr, gxb):
                    assert fence.canary_intact(), "the kernel wrote into an input's fence"
            results.append(ay.copy())
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


#: (n, c, h, w, r, stride, pad): NCHW fp32 inputs the bf16 packing transposes in blocks
#: of 16 channels by 16 pixels: whole blocks at the array's end, channel and pixel tails,
#: stride-2 phase planes whose gathered columns run past the row.
BF16_NCHW_SHAPES = [
    (1, 32, 5, 32, 3, 1, 1),
    (1, 35, 6, 37, 3, 1, 1),
    (2, 16, 9, 33, 3, 2, 1),
    (1, 20, 7, 32, 1, 2, 0),
    (1, 48, 4, 16, 1, 1, 0),
    (1, 3, 11, 37, 3, 1, 1),      # folded: the filter's columns as channels
    (2, 3, 20, 19, 7, 2, 3),
]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", BF16_NCHW_SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_bf16_nchw_packing_stays_in_bounds(case, side):
    """The bf16 kernels packing an NCHW fp32 input read its planes' rows and nothing past
    them, whole 16 x 16 blocks at the array's edge included."""
    from ttile.core.kinds import KernelKind
    from ttile.runtime import bf16
    if not _kernels.amx_usable() and not _kernels.cpu_has_avx512bf16():
        pytest.skip("no bf16 kernel on this CPU")
    kind = KernelKind.AMX if _kernels.amx_usable() else KernelKind.DOT_BF16
    code = _kernels.BF16_KERNEL_AMX if kind is KernelKind.AMX else _kernels.BF16_KERNEL_AVX512
    n, c, h, w, r, stride, pad = case
    k = 32
    spec = ConvSpec(n=n, k=k, c=c, h=h, w=w, r=r, s=r, stride_h=stride, stride_w=stride,
                    pad_top=pad, pad_bottom=pad, pad_left=pad, pad_right=pad)
    pack = bf16.packing(spec, kind)
    rng = np.random.default_rng(6)
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32)
    wt = rng.uniform(-1, 1, (r, r, c, k)).astype(np.float32)
    wb = bf16.pack_weights(wt, "NHWC", pack, 1)
    elems = _kernels.bf16_input_elems(pack.problem)
    gx = guarded_copy(x, side)
    results = []
    for threads in (1, 2):
        y = np.zeros(spec.output_shape(), np.float32)
        _kernels.conv2d_bf16(gx.array, True, wb, y, pack.problem, c, h, w, pad, pad, code,
                             threads, folded=pack.folded, xb=np.zeros(elems, np.uint16))
        assert gx.canary_intact()
        results.append(y)
    y_nhwc = np.zeros(spec.output_shape(), np.float32)
    _kernels.conv2d_bf16(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), False, wb, y_nhwc,
                         pack.problem, c, h, w, pad, pad, code, 1, folded=pack.folded,
                         xb=np.zeros(elems, np.uint16))
    for got in results:   # the same packed input as from the NHWC copy: the same bits
        np.testing.assert_array_equal(got, y_nhwc)
    if kind is KernelKind.AMX:   # its NCHW output and residual, fenced too
        out = spec.output_shape()
        nchw_out = (out[0], out[3], out[1], out[2])
        res = rng.uniform(-1, 1, nchw_out).astype(np.float32)
        gr = guarded_copy(res, side)
        gy = guarded_copy(np.zeros(nchw_out, np.float32), side)
        _kernels.conv2d_bf16(gx.array, True, wb, gy.array, pack.problem, c, h, w, pad, pad,
                             code, 2, residual=gr.array, folded=pack.folded,
                             xb=np.zeros(elems, np.uint16), y_nchw=True)
        assert gy.canary_intact() and gr.canary_intact() and gx.canary_intact()
        np.testing.assert_array_equal(gy.array, y_nhwc.transpose(0, 3, 1, 2) + res)
