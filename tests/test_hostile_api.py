"""Hostile input to the public API: hypothesis draws arbitrary types and values for every
argument of conv2d, Conv2d (construction and call) and plan. Every outcome must be a
result or a ValueError/TypeError: never a crash, a hang, or another exception type."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ttile

ALLOWED = (ValueError, TypeError)

small_ints = st.integers(-3, 12)
huge_ints = st.sampled_from([2**31, 2**31 - 1, 2**62, 2**63, 2**64 + 5, -2**63, 10**30])
scalars = st.one_of(small_ints, huge_ints, st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none(), st.text(max_size=6),
                    st.sampled_from(["same", "valid", "SAME", "", "full", b"same"]),
                    st.sampled_from([np.int64(2), np.uint8(1), np.float32(1.0), np.bool_(True)]),
                    st.just(object()), st.just(1j))
pairs = st.one_of(st.tuples(scalars, scalars), st.lists(scalars, max_size=4),
                  st.tuples(small_ints, small_ints), st.just(np.array([1, 2])))
options = st.one_of(scalars, pairs)
layouts = st.one_of(st.sampled_from(["NCHW", "NHWC", "nchw", "NWHC", ""]), scalars)
threads = st.one_of(st.none(), st.integers(-2, 3), huge_ints, st.floats(), st.booleans(),
                    st.text(max_size=3), st.just(np.int32(2)))
dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.int8, np.int64, np.uint16,
                          np.bool_, np.complex64, np.object_, "U3", "V4", "M8[s]"])


@st.composite
def arrays(draw, max_dims=5):
    dims = draw(st.integers(0, max_dims))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=dims, max_size=dims)))
    dtype = np.dtype(draw(dtypes))
    if dtype.kind in "OUVM":
        return np.empty(shape, dtype=dtype)
    values = draw(hnp.arrays(dtype, shape, elements=None if dtype.kind in "fc" else None))
    if draw(st.booleans()) and values.ndim:
        values = values[..., ::-1]  # non-contiguous
    return values


tensors = st.one_of(arrays(), st.none(), st.integers(), st.text(max_size=4),
                    st.lists(st.lists(st.floats(), max_size=3), max_size=3),
                    st.just([[1, 2], [3]]), st.just(object()))
shapes = st.one_of(st.lists(st.integers(-2, 9), max_size=6).map(tuple), st.text(max_size=4),
                   st.lists(scalars, max_size=4), st.none(), st.integers())


def _outcome(fn):
    try:
        result = fn()
    except ALLOWED:
        return None
    return result


SETTINGS = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(x=tensors, w=tensors, stride=options, padding=options, layout=layouts, threads=threads)
def test_conv2d_survives_anything(x, w, stride, padding, layout, threads):
    y = _outcome(lambda: ttile.conv2d(x, w, stride=stride, padding=padding, layout=layout,
                                      threads=threads))
    assert y is None or (isinstance(y, np.ndarray) and y.dtype == np.float32 and y.ndim == 4)


@SETTINGS
@given(w=tensors, stride=options, padding=options, layout=layouts, threads=threads,
       x=tensors, call_threads=threads)
def test_conv2d_layer_survives_anything(w, stride, padding, layout, threads, x, call_threads):
    layer = _outcome(lambda: ttile.Conv2d(w, stride=stride, padding=padding, layout=layout,
                                          threads=threads))
    if layer is None:
        return
    y = _outcome(lambda: layer(x, threads=call_threads))
    assert y is None or (isinstance(y, np.ndarray) and y.ndim == 4)


@SETTINGS
@given(x_shape=shapes, w_shape=shapes, stride=options, padding=options, layout=layouts,
       threads=threads)
def test_plan_survives_anything(x_shape, w_shape, stride, padding, layout, threads):
    result = _outcome(lambda: ttile.plan(x_shape, w_shape,
                                         stride=stride, padding=padding, layout=layout,
                                         threads=threads))
    assert result is None or (isinstance(result.kind, ttile.KernelKind)
                              and result.threads >= 1)


# The three tests above accept a refusal of every call; these draw calls that are valid by
# construction from the same kinds of options, and require each to succeed and be right
# (a regression that refused valid calls would pass the hostile tests alone).
@st.composite
def valid_calls(draw):
    layout = draw(st.sampled_from(["NCHW", "NHWC"]))
    groups = draw(st.sampled_from([1, 1, 2]))
    c = groups * draw(st.integers(1, 5))
    k = groups * draw(st.integers(1, 6))
    r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    h, w = draw(st.integers(r, 9)), draw(st.integers(s, 9))
    stride = draw(st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3)),
                            st.just(np.int64(2))))
    padding = draw(st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2)),
                             st.just("valid")))
    threads = draw(st.one_of(st.none(), st.integers(1, 3), st.just(np.int32(2))))
    x_shape = (1, c, h, w) if layout == "NCHW" else (1, h, w, c)
    w_shape = (k, c // groups, r, s) if layout == "NCHW" else (r, s, c // groups, k)
    return layout, groups, x_shape, w_shape, stride, padding, threads


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=valid_calls(), seed=st.integers(0, 2**16))
def test_valid_calls_of_every_entry_point_succeed_and_are_right(call, seed):
    from ttile.core.reference import conv_mismatch
    layout, groups, x_shape, w_shape, stride, padding, threads = call
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, x_shape).astype(np.float32)
    w = rng.uniform(-1, 1, w_shape).astype(np.float32)
    kp = ttile.plan(x_shape, w_shape, None, stride, padding, 1, groups, layout=layout,
                    threads=threads)
    assert isinstance(kp.kind, ttile.KernelKind)
    y = ttile.conv2d(x, w, None, stride, padding, 1, groups, layout=layout, threads=threads)
    y2 = ttile.Conv2d(w, None, stride, padding, 1, groups, layout=layout)(x, threads=threads)
    np.testing.assert_allclose(y, y2, rtol=1e-5, atol=1e-5)
    sh, sw = (stride, stride) if not isinstance(stride, tuple) else stride
    ph, pw = ((0, 0) if padding == "valid" else (padding, padding)
              if not isinstance(padding, tuple) else padding)
    problem = conv_mismatch(y, x, w, (int(sh), int(sw)), (ph, ph, pw, pw), layout,
                            groups=groups)
    assert problem is None, problem


@pytest.mark.parametrize("value", [2**31, 2**63, 10**30])
def test_huge_stride_padding_and_threads_are_value_errors(value):
    x, w = np.ones((1, 3, 8, 8), np.float32), np.ones((4, 3, 3, 3), np.float32)
    for kwargs in ({"stride": value}, {"padding": value}, {"threads": value}):
        with pytest.raises(ValueError):
            ttile.conv2d(x, w, **kwargs)
