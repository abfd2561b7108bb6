"""A layer called again and again: ``ttile.Conv2d`` remembers, per input shape and
thread count, the kernel its call settled on with that kernel's arguments bound, so a
network's layer goes from its arguments' checks straight to the kernel. These tests
hold that shortcut to what the full path would do: the kernel serving now (not the one
that served when it was remembered), and the same checks and conversions of the arrays."""
import numpy as np
import pytest

import ttile
from conftest import AVAILABLE_ISAS, forget_choices, random_tensors
from ttile.core.reference import assert_conv_close
from ttile.runtime import registry

FAMILIES = [isa for isa in AVAILABLE_ISAS if isa != "portable"] or ["portable"]


@pytest.mark.parametrize("isa", FAMILIES, indirect=True)
def test_a_layer_called_again_runs_the_kernel_serving_now(monkeypatch, isa, no_winograd):
    """Another CPU's set served, then not: each call runs what ``plan`` reports."""
    entries = [e for e in registry.KERNELS if e.isa.value == isa]
    if not entries:
        pytest.skip(f"this build ships no tuned {isa} kernels")
    entry = min(entries, key=lambda e: e.spec.flops)
    spec = entry.spec
    x, w = random_tensors(np.random.default_rng(13), spec.input_shape(), spec.weight_shape())
    stride, pads = (spec.stride_h, spec.stride_w), (spec.pad_top, spec.pad_left)
    layer = ttile.Conv2d(w, stride=stride, padding=pads, layout="NHWC")
    tuned_runs = []
    real = ttile._kernels.run_tuned
    monkeypatch.setattr(ttile._kernels, "run_tuned",
                        lambda *args, **kwargs: (tuned_runs.append(args[0]),
                                                 real(*args, **kwargs))[1])

    def serves_tuned() -> bool:
        return ttile.plan(x.shape, w.shape, stride=stride, padding=pads, layout="NHWC",
                          threads=entry.threads, prepacked=True).kind == "tuned"

    def call_twice() -> np.ndarray:
        tuned_runs.clear()
        first, again = layer(x, threads=entry.threads), layer(x, threads=entry.threads)
        np.testing.assert_array_equal(first, again)
        assert len(tuned_runs) == (2 if serves_tuned() else 0)
        return again

    outside = call_twice()
    try:
        with registry.pretend_cpu(entry.cpu):
            assert serves_tuned()
            inside = call_twice()
            assert tuned_runs == [entry.index, entry.index]
        after = call_twice()
    finally:
        forget_choices()
    for y in (outside, inside, after):
        assert_conv_close(y, x, w, stride, (spec.pad_top, spec.pad_bottom, spec.pad_left,
                                            spec.pad_right), layout="NHWC")


@pytest.mark.parametrize("isa", AVAILABLE_ISAS, indirect=True)
def test_a_layer_called_again_checks_its_arrays_as_on_the_first_call(isa):
    """Arrays the full path would not take as they are (another dtype, a strided view, a
    list, a residual of another shape or dtype, a bool thread count) are converted or
    refused as on a first call."""
    rng = np.random.default_rng(14)
    x, w = random_tensors(rng, (1, 9, 8, 6), (3, 3, 6, 16))
    residual = rng.uniform(-1, 1, (1, 9, 8, 16)).astype(np.float32)
    layer = ttile.Conv2d(w, padding=1, layout="NHWC", activation="relu")
    expected = layer(x, threads=1)
    with_residual = layer(x, threads=1, residual=residual)
    np.testing.assert_array_equal(layer(x, threads=1), expected)
    np.testing.assert_array_equal(layer(x, threads=1, residual=residual), with_residual)
    np.testing.assert_array_equal(layer(x.astype(np.float64), threads=1), expected)
    strided = np.zeros((1, 9, 8, 12), np.float32)
    strided[..., ::2] = x
    np.testing.assert_array_equal(layer(strided[..., ::2], threads=1), expected)
    np.testing.assert_array_equal(
        layer(x, threads=1, residual=residual.astype(np.float64)), with_residual)
    np.testing.assert_array_equal(layer(x, threads=1, residual=residual.tolist()),
                                  with_residual)
    with pytest.raises(ValueError, match="residual"):
        layer(x, threads=1, residual=residual[:, :8])
    with pytest.raises(ValueError, match="threads"):
        layer(x, threads=0)
    with pytest.raises(TypeError, match="threads"):
        layer(x, threads=True)   # equal to 1 as a dictionary key, refused as an argument
    bare = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=1)
    np.testing.assert_allclose(expected, np.maximum(bare, 0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(with_residual, np.maximum(bare + residual, 0), rtol=1e-5,
                               atol=1e-5)
    assert_conv_close(bare, x, w, (1, 1), (1, 1, 1, 1), layout="NHWC")
