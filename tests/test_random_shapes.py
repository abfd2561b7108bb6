"""Hypothesis-generated shapes: odd sizes, K and C not multiples of 16, strides 1-4,
kernels 1-7, padding 0-3, batch 1-4, threads 1-2, both layouts, both kernel families (and
pointwise layers on their own, which random shapes almost never are),
checked against float64.

CI runs 150 shapes per kernel family; the long run sets the count with an environment
variable, e.g. ``TTILE_FUZZ_EXAMPLES=10000 python -m pytest tests/test_random_shapes.py``.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ttile
from conftest import AVAILABLE_ISAS
from ttile.core.reference import assert_conv_close


@st.composite
def conv_cases(draw):
    n = draw(st.integers(1, 4))
    c = draw(st.integers(1, 40))
    k = draw(st.integers(1, 70))
    r = draw(st.integers(1, 7))
    s = draw(st.integers(1, 7))
    h = draw(st.integers(1, 23))
    w = draw(st.integers(1, 23))
    stride = draw(st.tuples(st.integers(1, 4), st.integers(1, 4)))
    padding = draw(st.one_of(st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(0, 3)),
                             st.just("valid"), st.just("same")))
    layout = draw(st.sampled_from(["NCHW", "NHWC"]))
    threads = draw(st.integers(1, 2))
    if padding == "same":
        assume(stride == (1, 1))
        pads = ((r - 1) // 2, r - 1 - (r - 1) // 2, (s - 1) // 2, s - 1 - (s - 1) // 2)
    elif padding == "valid":
        pads = (0, 0, 0, 0)
    else:
        ph, pw = padding if isinstance(padding, tuple) else (padding, padding)
        pads = (ph, ph, pw, pw)
    assume(h + pads[0] + pads[1] >= r and w + pads[2] + pads[3] >= s)
    return n, c, k, h, w, r, s, stride, padding, pads, layout, threads


@pytest.mark.parametrize("isa", AVAILABLE_ISAS, indirect=True)
@settings(max_examples=int(os.environ.get("TTILE_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conv_cases(), seed=st.integers(0, 2**32 - 1))
def test_random_shape_matches_reference(isa, case, seed):
    n, c, k, h, w, r, s, stride, padding, pads, layout, threads = case
    rng = np.random.default_rng(seed)
    if layout == "NCHW":
        x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32)
        wt = rng.uniform(-1, 1, (k, c, r, s)).astype(np.float32)
    else:
        x = rng.uniform(-1, 1, (n, h, w, c)).astype(np.float32)
        wt = rng.uniform(-1, 1, (r, s, c, k)).astype(np.float32)
    y = ttile.conv2d(x, wt, stride=stride, padding=padding, layout=layout, threads=threads)
    assert_conv_close(y, x, wt, stride, pads, layout=layout)


@st.composite
def pointwise_cases(draw):
    """1x1, no padding: at stride 1 the generic AVX-512 kernel runs every image as one row
    of H*W pixels, split into register blocks (and among threads) across the old rows;
    in NCHW the pointwise kernel serves stride 1; strides 2 and 3 take the dense path."""
    return (draw(st.integers(1, 4)), draw(st.integers(1, 40)), draw(st.integers(1, 70)),
            draw(st.integers(1, 23)), draw(st.integers(1, 23)), draw(st.integers(1, 2)),
            draw(st.sampled_from([0, "valid"])), draw(st.booleans()),
            draw(st.sampled_from(["NHWC", "NCHW"])),
            (draw(st.sampled_from([1, 1, 2, 3])), draw(st.sampled_from([1, 1, 2, 3]))))


@pytest.mark.parametrize("isa", AVAILABLE_ISAS, indirect=True)
@settings(max_examples=int(os.environ.get("TTILE_FUZZ_EXAMPLES", "150")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=pointwise_cases(), seed=st.integers(0, 2**32 - 1))
def test_pointwise_shape_matches_reference(isa, case, seed):
    n, c, k, h, w, threads, padding, prepacked, layout, stride = case
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, h, w, c)).astype(np.float32)
    wt = rng.uniform(-1, 1, (1, 1, c, k)).astype(np.float32)
    if layout == "NCHW":  # the NCHW output path writes each panel's pixels from its tiles
        x, wt = np.ascontiguousarray(x.transpose(0, 3, 1, 2)), np.ascontiguousarray(
            wt.transpose(3, 2, 0, 1))
    if prepacked:
        y = ttile.Conv2d(wt, stride=stride, padding=padding, layout=layout,
                         threads=threads)(x)
    else:
        y = ttile.conv2d(x, wt, stride=stride, padding=padding, layout=layout,
                         threads=threads)
    assert_conv_close(y, x, wt, stride, (0, 0, 0, 0), layout=layout)
