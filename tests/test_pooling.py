"""The NHWC pooling kernels a converted network's sequence runs (kernels/pool_nhwc.c, and
pool_avx512.c's max pooling on AVX-512 CPUs) against torch's max_pool2d and
adaptive_avg_pool2d, and their refusals."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from ttile import _kernels  # noqa: E402

MAX_CASES = [  # (n, h, w, c), kernel, stride, padding
    ((1, 112, 112, 64), (3, 3), (2, 2), (1, 1)),    # ResNet's stem pooling
    ((2, 9, 7, 5), (3, 3), (2, 2), (1, 1)),         # odd sizes, a channel tail, a batch
    ((1, 8, 8, 16), (2, 2), (2, 2), (0, 0)),
    ((1, 5, 6, 3), (3, 2), (1, 2), (1, 1)),         # unequal kernel and stride
    ((3, 4, 4, 33), (4, 4), (1, 1), (2, 2)),        # padding of half the window
    ((1, 10, 11, 150), (3, 3), (2, 2), (1, 1)),     # 8 vectors, then 2 with an even tail
    ((2, 7, 6, 37), (3, 3), (1, 1), (1, 1)),        # an odd tail after 2 vectors
    ((1, 9, 9, 24), (3, 3), (2, 2), (1, 1)),        # a vector and a tail of 8
]


#: The max pooling's loops: the default (AVX-512's windows in registers on CPUs with it),
#: and the plain C one every CPU runs.
ISAS = [pytest.param(None, id="default"), pytest.param(_kernels.ISA_PORTABLE, id="plain C")]


def nhwc(tensor):
    return tensor.permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, kernel, stride, padding", MAX_CASES)
def test_max_pooling_is_torchs(shape, kernel, stride, padding, threads, isa):
    x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    x[0, 0, 0, 0] = np.nan   # a NaN in a window is that window's maximum, as in torch
    x[-1, -1, -1, -1] = -np.inf
    got = _kernels.maxpool_nhwc(x, *kernel, *stride, *padding, threads, isa=isa)
    expected = nhwc(F.max_pool2d(torch.from_numpy(x).permute(0, 3, 1, 2), kernel, stride,
                                 padding))
    assert got.shape == expected.shape
    assert np.array_equal(got, expected, equal_nan=True)
    assert got.ctypes.data % 64 == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, kernel, stride, padding", MAX_CASES)
def test_max_pooling_of_bf16_bits_is_torchs_on_their_values(shape, kernel, stride,
                                                             padding, threads, isa):
    """On bf16 bits (uint16) the pooling's maximum is torch's on the values they hold,
    NaN and -inf included, returned as bits of the same values."""
    from ttile.runtime.bf16 import round_to_bf16
    x = np.random.default_rng(3).standard_normal(shape, dtype=np.float32)
    x[0, 0, 0, 0] = np.nan
    x[-1, -1, -1, -1] = -np.inf
    values = round_to_bf16(x)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    got = _kernels.maxpool_nhwc(bits, *kernel, *stride, *padding, threads, isa=isa)
    assert got.dtype == np.uint16 and got.ctypes.data % 64 == 0
    expected = nhwc(F.max_pool2d(torch.from_numpy(values).permute(0, 3, 1, 2), kernel,
                                 stride, padding))
    assert np.array_equal((got.astype(np.uint32) << 16).view(np.float32), expected,
                          equal_nan=True)
    out = np.zeros_like(got)
    assert _kernels.maxpool_nhwc(bits, *kernel, *stride, *padding, threads, out=out,
                                 isa=isa) is out
    assert np.array_equal(out, got)
    with pytest.raises(TypeError, match="uint16"):   # bits in, bits out
        _kernels.maxpool_nhwc(bits, *kernel, *stride, *padding, threads,
                              out=np.zeros(got.shape, np.float32))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 7, 7, 2048), (3, 5, 4, 300), (2, 1, 1, 7),
                                   (1, 13, 11, 257)])
def test_global_average_pooling_is_torchs(shape, threads):
    x = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)
    got = _kernels.global_avgpool_nhwc(x, threads)
    expected = nhwc(F.adaptive_avg_pool2d(torch.from_numpy(x).permute(0, 3, 1, 2), 1))
    assert got.shape == expected.shape == (shape[0], 1, 1, shape[3])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_poolings_refuse_what_they_cannot_compute():
    x = np.zeros((1, 4, 4, 8), np.float32)
    with pytest.raises(ValueError, match="at most half"):
        _kernels.maxpool_nhwc(x, 3, 3, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="does not fit"):
        _kernels.maxpool_nhwc(x, 5, 5, 1, 1, 0, 0)
    with pytest.raises(ValueError, match=">= 1"):
        _kernels.maxpool_nhwc(x, 3, 3, 0, 1, 1, 1)
    with pytest.raises(TypeError, match="float32"):
        _kernels.global_avgpool_nhwc(x.astype(np.float64))
    with pytest.raises(ValueError, match="no pixels"):
        _kernels.global_avgpool_nhwc(np.zeros((1, 0, 3, 4), np.float32))
