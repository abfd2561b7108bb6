"""The layout conversions of kernels/layout.c (NCHW <-> NHWC, KCRS weights into panels),
AVX-512 tiles and portable loop alike, against numpy, on sizes around the 16- and
32-float tiles."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttile import _kernels
from conftest import AVAILABLE_ISAS

ISAS = [_kernels.ISA_PORTABLE] + ([_kernels.ISA_AVX512F] if "avx512f" in AVAILABLE_ISAS else [])
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
