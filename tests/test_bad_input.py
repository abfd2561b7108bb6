"""Everything a caller can get wrong ends in a ValueError/TypeError naming the problem."""
import subprocess
import sys

import numpy as np
import pytest

import ttile
from ttile.core.reference import assert_conv_close

X = np.ones((1, 3, 8, 8), np.float32)
W = np.ones((4, 3, 3, 3), np.float32)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(x=np.ones((3, 8, 8), np.float32)), ValueError, "input must have 4 dimensions"),
    (dict(w=np.ones((4, 3, 3), np.float32)), ValueError, "weights must have 4 dimensions"),
    (dict(w=np.ones((4, 5, 3, 3), np.float32)), ValueError, "channel mismatch"),
    (dict(w=np.ones((4, 3, 9, 9), np.float32)), ValueError, "larger than the padded input"),
    (dict(x=np.ones((0, 3, 8, 8), np.float32)), ValueError, "zero-size"),
    (dict(w=np.ones((0, 3, 3, 3), np.float32)), ValueError, "zero-size"),
    (dict(stride=0), ValueError, "stride must be >= 1"),
    (dict(stride=-2), ValueError, "stride must be >= 1"),
    (dict(stride=(1, 2, 3)), ValueError, "pair"),
    (dict(stride=1.5), TypeError, "stride must be an int"),
    (dict(stride=True), TypeError, "stride must be an int"),
    (dict(padding=-1), ValueError, "padding must be >= 0"),
    (dict(padding="full"), ValueError, "padding must be"),
    (dict(padding="same", stride=2), ValueError, "not supported for strided"),
    (dict(padding=None), TypeError, "padding must be an int"),
    (dict(layout="NWHC"), ValueError, "layout must be"),
    (dict(threads=0), ValueError, "threads must be >= 1"),
    (dict(threads=1.0), TypeError, "threads must be"),
    (dict(x=X.astype(np.complex64)), TypeError, "complex"),
    (dict(x=X.astype(bool)), TypeError, "bool"),
    (dict(x=np.array([["a"]])), TypeError, "dtype <U1"),
    (dict(x=np.empty((1, 3, 8, 8), dtype=object)), TypeError, "dtype object"),
    (dict(w="weights"), TypeError, "dtype <U7"),
    (dict(x=[[1, 2], [3]]), TypeError, "cannot be read as an array"),
])
def test_bad_argument_is_refused_with_a_message(kwargs, error, message):
    args = dict(x=X, w=W)
    args.update(kwargs)
    x, w = args.pop("x"), args.pop("w")
    with pytest.raises(error, match=message):
        ttile.conv2d(x, w, **args)


def test_huge_output_is_refused_before_allocation():
    w = np.ones((1 << 12, 1, 1, 1), np.float32)
    with pytest.raises(ValueError, match="GiB, more than this machine's memory"):
        ttile.conv2d(np.ones((1, 1, 1, 1), np.float32), w, padding=(1 << 19, 1 << 19))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_non_contiguous_read_only_and_misaligned_inputs_are_read_correctly(layout):
    rng = np.random.default_rng(3)
    base_x = rng.uniform(-1, 1, (2, 10, 12, 14)).astype(np.float32)
    base_w = rng.uniform(-1, 1, (6, 10, 3, 3)).astype(np.float32)
    x = base_x[:, :, ::-1, ::2]                       # negative and step-2 strides
    w = base_w
    if layout == "NHWC":
        x = np.transpose(x, (0, 2, 3, 1))             # a non-contiguous NHWC view
        w = np.transpose(base_w, (2, 3, 1, 0))
    x.flags.writeable = False
    raw = np.zeros(x.size * 4 + 1, np.uint8)[1:]      # float32 data at an odd address
    misaligned = raw.view(np.float32).reshape(x.shape)
    misaligned[...] = x
    for candidate in (x, misaligned):
        y = ttile.conv2d(candidate, w, padding=1, layout=layout)
        assert_conv_close(y, np.ascontiguousarray(x), w, (1, 1), (1, 1, 1, 1), layout=layout)


def test_other_real_dtypes_are_converted_to_float32():
    rng = np.random.default_rng(4)
    x = rng.integers(-3, 4, (1, 3, 7, 7))
    w = rng.uniform(-1, 1, (5, 3, 3, 3))
    for xd, wd in ((x.astype(np.int16), w.astype(np.float64)), (x.astype(np.float16), w)):
        y = ttile.conv2d(xd, wd, padding="same")
        assert y.dtype == np.float32
        assert_conv_close(y, xd.astype(np.float32), wd.astype(np.float32), (1, 1), (1, 1, 1, 1),
                          layout="NCHW")


def test_same_padding_with_even_kernel_pads_bottom_right_like_torch():
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (1, 2, 6, 7)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 2, 4, 2)).astype(np.float32)
    y = ttile.conv2d(x, w, padding="same")
    assert y.shape == (1, 3, 6, 7)
    assert_conv_close(y, x, w, (1, 1), (1, 2, 0, 1), layout="NCHW")


def test_extension_refuses_mismatched_arrays_instead_of_misreading():
    from ttile import _kernels
    x = np.ones((1, 4, 4, 3), np.float32)
    w = np.ones((3, 3, 3, 8), np.float32)
    y = np.empty((1, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match="input channels"):
        _kernels.conv2d_generic_nhwc(x, np.ones((3, 3, 2, 8), np.float32), y, 1, 1, 0, 0, 1, 0)
    with pytest.raises(TypeError, match="float32"):
        _kernels.conv2d_generic_nhwc(x.astype(np.float64), w, y, 1, 1, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.conv2d_generic_nhwc(x[:, ::-1], w, y, 1, 1, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="output shape"):
        _kernels.conv2d_generic_nhwc(x, w, np.empty((1, 2, 2, 7), np.float32), 1, 1, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="too large"):
        _kernels.conv2d_generic_nhwc(x, w, np.empty((1, 9, 9, 8), np.float32), 1, 1, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="writeable"):
        y.flags.writeable = False
        _kernels.conv2d_generic_nhwc(x, w, y, 1, 1, 0, 0, 1, 0)


def test_set_isa_refuses_unknown_family():
    with pytest.raises(ValueError, match="isa must be"):
        ttile.set_isa("sse9")


def test_import_is_light():
    code = ("import sys, ttile; heavy = {'sympy', 'islpy', 'torch', 'ttile.core.codegen', "
            "'ttile.core.scheme', 'scipy', 'ttile.runtime.jit', 'ttile.runtime.cache', "
            "'ttile.tuning.bench', 'ttile.tuning.records', "
            "'subprocess', 'concurrent.futures', 'platformdirs'} & set(sys.modules); "
            "heavy |= {m for m in sys.modules if m.startswith('ttile.generator')}; "
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_packing_copies_only_when_the_layout_changes():
    """Weights with K equal to the panel width are already one panel: packing returns a
    read-only view; otherwise a copy whose tail past K is zero."""
    from ttile import _kernels
    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, (3, 3, 5, 32)).astype(np.float32)
    view = _kernels.pack_weights(w, 32)
    assert view.shape == (1, 3, 3, 5, 32) and np.shares_memory(view, w)
    assert not view.flags.writeable
    np.testing.assert_array_equal(view[0], w)
    packed = _kernels.pack_weights(w, 48)
    assert packed.shape == (1, 3, 3, 5, 48) and not np.shares_memory(packed, w)
    np.testing.assert_array_equal(packed[0, ..., :32], w)
    assert not packed[0, ..., 32:].any()
    halves = _kernels.pack_weights(w, 16)
    np.testing.assert_array_equal(halves[1], w[..., 16:])
