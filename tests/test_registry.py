"""The tuned kernels compiled into the extension: each checked against float64, served
by conv2d for its exact problem, and looked up by its ConvSpec. Needs no generator
libraries (islpy, scipy): the registry is part of every install."""
import numpy as np
import pytest

import ttile
from ttile import _kernels
from ttile.core.reference import assert_conv_close
from ttile.core.spec import ConvSpec
from ttile.runtime import registry
from conftest import requires_avx512


def _registry_cases():
    return [pytest.param(e, id=f"{e.layer}-{'par' if e.parallel else 'seq'}")
            for e in registry.ENTRIES]


def test_registry_entries_are_keyed_by_their_problem():
    raw = ttile.tuned_kernels()
    assert len(registry.ENTRIES) == len(raw) > 0
    for entry, data in zip(registry.ENTRIES, raw):
        assert entry.index == data["index"] and entry.scheme == data["scheme"]
        assert entry.spec.k == data["k"] and entry.spec.pad_right == data["pad_right"]
        assert registry.lookup(entry.spec, 2 if entry.parallel else 1) == entry
        assert entry.microkernels.startswith("[U") and entry.microkernels.endswith("V k]")
    assert registry.lookup(ConvSpec(1, 16, 3, 5, 5, 1, 1), 1) is None


@requires_avx512
@pytest.mark.parametrize("entry", _registry_cases())
def test_every_shipped_tuned_kernel_matches_the_reference(entry):
    spec = entry.spec
    rng = np.random.default_rng(entry.index)
    x = rng.uniform(-1, 1, spec.input_shape()).astype(np.float32)
    w = rng.uniform(-1, 1, spec.weight_shape()).astype(np.float32)
    y = np.full(spec.output_shape(), np.nan, np.float32)
    threads = 2 if entry.parallel else 1
    _kernels.run_tuned(entry.index, x, _kernels.pack_weights(w, entry.panel), y, threads)
    assert_conv_close(y, x, w, (spec.stride_h, spec.stride_w),
                      (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right))
    # conv2d serves the matching call with it (the plan says so, and the bits agree)
    pads = (spec.pad_top, spec.pad_left)
    plan = ttile.plan(spec.input_shape(), spec.weight_shape(), (spec.stride_h, spec.stride_w),
                      pads, "NHWC", threads=threads)
    assert plan.kind == ttile.KernelKind.TUNED and plan.scheme == entry.scheme
    out = ttile.conv2d(x, w, stride=(spec.stride_h, spec.stride_w), padding=pads,
                       layout="NHWC", threads=threads)
    np.testing.assert_array_equal(out, y)


@requires_avx512
def test_run_compiled_checks_arrays_against_the_kernels_problem():
    """A compiled kernel's sizes are constants: arrays of another problem are refused
    even when they agree with each other."""
    entry = min(registry.ENTRIES, key=lambda e: e.spec.flops)
    spec = entry.spec
    other = ConvSpec(spec.n, spec.k, spec.c, spec.h + 1, spec.w, spec.r, spec.s,
                     spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_bottom,
                     spec.pad_left, spec.pad_right)
    x = np.zeros(other.input_shape(), np.float32)
    w = _kernels.pack_weights(np.zeros(other.weight_shape(), np.float32), entry.panel)
    y = np.zeros(other.output_shape(), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        _kernels.run_compiled(1, x, w, y, 1, spec.input_shape(),
                              spec.packed_weight_shape(entry.panel), spec.output_shape())
