"""The layout conversions of kernels/layout.c (NCHW <-> NHWC, KCRS weights into panels),
AVX-512 tiles and portable loop alike, against numpy, on sizes around the 16- and
32-float tiles."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttile import _kernels
from conftest import AVAILABLE_ISAS

ISAS = ([_kernels.ISA_PORTABLE] + ([_kernels.ISA_AVX2] if "avx2" in AVAILABLE_ISAS else [])
        + ([_kernels.ISA_AVX512F] if "avx512f" in AVAILABLE_ISAS else []))
SIZES = st.sampled_from([1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 64, 65])


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), c=SIZES, h=SIZES, w=st.integers(1, 9),
       threads=st.integers(1, 3))
def test_activations_round_trip_between_layouts(isa, n, c, h, w, threads):
    rng = np.random.default_rng(n * 1000 + c * 10 + h)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    nhwc = _kernels.nchw_to_nhwc(x, threads, isa=isa)
    np.testing.assert_array_equal(nhwc, x.transpose(0, 2, 3, 1))
    back = _kernels.nhwc_to_nchw(nhwc, threads, isa=isa)
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=40, deadline=None)
@given(k=SIZES, c=SIZES, rs=st.sampled_from([(1, 1), (3, 3), (1, 3), (5, 5), (7, 7)]),
       panel=st.sampled_from([0, 16, 32, 48, 64]), threads=st.integers(1, 3))
def test_kcrs_weights_pack_like_rsck(isa, k, c, rs, panel, threads):
    r, s = rs
    w = np.random.default_rng(k * 100 + c).standard_normal((k, c, r, s)).astype(np.float32)
    rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    packed = _kernels.pack_weights_kcrs(w, panel, threads, isa=isa)
    expected = rsck if panel == 0 else _kernels.pack_weights(rsck, panel, 1)
    np.testing.assert_array_equal(packed, expected)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 64, 272, 272), (1, 35, 301, 299), (2, 17, 289, 310)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("offset", [0, 1])
def test_large_outputs_convert_past_the_caches(isa, shape, offset):
    """Past 8 MB the NCHW output is written with streaming stores where whole aligned
    lines allow, the rest (planes off a line, masked edges, an output that starts
    `offset` floats into a line) with ordinary ones; tiles of 1024 pixels."""
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    flat = np.full(x.size + 16, np.nan, np.float32)
    out = flat[offset:offset + x.size].reshape(shape)
    back = _kernels.nhwc_to_nchw(nhwc, 2, out, isa=isa)
    assert back is out
    np.testing.assert_array_equal(out, x)


def test_conversions_check_their_output_buffers():
    x = np.zeros((1, 4, 5, 6), np.float32)
    with pytest.raises(ValueError, match="shape"):
        _kernels.nchw_to_nhwc(x, 1, np.zeros((1, 4, 5, 6), np.float32))
    with pytest.raises(ValueError, match="writeable"):
        out = np.zeros((1, 5, 6, 4), np.float32)
        out.flags.writeable = False
        _kernels.nchw_to_nhwc(x, 1, out)
    with pytest.raises(ValueError, match="unknown isa"):
        _kernels.nchw_to_nhwc(x, 1, isa=7)


@pytest.mark.skipif("avx2" not in AVAILABLE_ISAS, reason="a vector generic kernel")
@pytest.mark.parametrize("residual", [False, True])
def test_the_generic_kernel_streams_a_large_nchw_output(residual):
    """An NCHW output past 8 MB leaves the generic kernel's tiles with streaming stores,
    except with a residual, whose pass reads the rows back at once; rows of 250 pixels
    put most planes off a line."""
    import ttile
    from ttile.core.reference import assert_conv_close
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (1, 3, 250, 250)).astype(np.float32)
    w = rng.uniform(-1, 1, (40, 3, 3, 3)).astype(np.float32)
    res = rng.uniform(-1, 1, (1, 40, 250, 250)).astype(np.float32) if residual else None
    previous = ttile.set_tuning(mode="never")
    try:
        y = ttile.conv2d(x, w, padding=1, threads=2, residual=res)
        assert ttile.plan(x.shape, w.shape, padding=1, threads=2).kind.value == "generic"
    finally:
        ttile.restore_tuning(previous)
    assert_conv_close(y - res if residual else y, x, w, (1, 1), (1, 1, 1, 1), layout="NCHW")
