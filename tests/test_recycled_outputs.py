"""Large outputs (past glibc's 32 MiB mmap threshold) reuse the memory of outputs that
are gone, never of one an array can still see, and keep at most RECYCLE_KEEP_BYTES."""
import gc

import numpy as np

import ttile
from ttile import _kernels

LARGE = (1, 32, 544, 544)   # 37.9 MB: Yolo9000-0's output


def _drain():
    gc.collect()
    _kernels.release_recycled()
    assert _kernels.recycled_bytes() == 0


def test_a_gone_output_is_reused_and_a_visible_one_is_not():
    _drain()
    a = _kernels.empty_aligned(LARGE)
    address = a.ctypes.data
    view = a[0, 3]            # a view keeps the memory out of reach
    del a
    assert _kernels.recycled_bytes() == 0
    b = _kernels.empty_aligned(LARGE)
    assert abs(b.ctypes.data - address) >= 4 * np.prod(LARGE)  # not the viewed memory
    view[...] = 7.0
    del view
    kept = _kernels.recycled_bytes()
    assert kept >= 4 * np.prod(LARGE)
    c = _kernels.empty_aligned(LARGE)
    assert abs(c.ctypes.data - address) < 64   # the memory whose last view is gone
    assert _kernels.recycled_bytes() < kept
    assert c.flags.writeable and c.flags.c_contiguous and c.ctypes.data % 64 == 0
    del b, c


def test_small_outputs_are_not_kept():
    _drain()
    a = _kernels.empty_aligned((1, 64, 56, 56))
    del a
    assert _kernels.recycled_bytes() == 0


def test_at_most_the_cap_is_kept_and_release_gives_it_back():
    _drain()
    outputs = [_kernels.empty_aligned(LARGE) for _ in range(9)]
    del outputs
    assert 0 < _kernels.recycled_bytes() <= _kernels.RECYCLE_KEEP_BYTES
    from ttile.runtime import scratch
    scratch.release()
    assert _kernels.recycled_bytes() == 0


def test_calls_on_recycled_outputs_are_right():
    """Two calls in a row on Yolo9000-0's shape: the second writes the memory of the
    first's output once it is gone; each result is the float64 reference's."""
    from ttile.core.reference import assert_conv_close
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, 3, 544, 544)).astype(np.float32)
    w = rng.uniform(-1, 1, (32, 3, 3, 3)).astype(np.float32)
    first = ttile.conv2d(x, w, padding=1)
    kept = first.copy()
    del first
    second = ttile.conv2d(x * 2, w, padding=1)
    assert_conv_close(kept, x, w, (1, 1), (1, 1, 1, 1), layout="NCHW")
    np.testing.assert_allclose(second, 2 * kept, rtol=1e-5, atol=1e-5)


def test_a_layer_keeps_its_weights_on_a_cache_line():
    """A Conv2d's own copy of its weights, and every format made from it, starts on a
    64-byte line: numpy's copy of a large array starts 16 or 48 bytes in, and a kernel
    reading it as its panel (a 64-channel layer's RSCK is its only panel) splits every
    vector load over two lines."""
    rng = np.random.default_rng(3)
    cases = [("NHWC", (1, 1, 1024, 64), (1, 7, 7, 1024), 1),     # RSCK is the panel
             ("NHWC", (3, 3, 96, 80), (1, 9, 9, 96), 1),
             ("NCHW", (64, 1024, 1, 1), (1, 1024, 7, 7), 1),     # NCHW pointwise
             ("NCHW", (512, 1, 3, 3), (1, 512, 7, 7), 512),      # depthwise
             ("NHWC", (3, 3, 1, 512), (1, 7, 7, 512), 512)]
    for layout, w_shape, x_shape, groups in cases:
        w = rng.standard_normal(w_shape).astype(np.float32)
        x = rng.standard_normal(x_shape).astype(np.float32)
        layer = ttile.Conv2d(w, padding="same", groups=groups, layout=layout, threads=1)
        got = layer(x)
        assert layer._rsck.ctypes.data % 64 == 0, (layout, w_shape)
        assert layer._packed, "the call made its kernel's weights"
        for packed in layer._packed.values():
            assert packed.ctypes.data % 64 == 0, (layout, w_shape)
        expected = ttile.conv2d(x, w, padding="same", groups=groups, layout=layout)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
