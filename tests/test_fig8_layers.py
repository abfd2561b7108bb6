"""Every Fig. 8 layer of the TTile paper through ttile.conv2d, against float64."""
import zlib

import numpy as np
import pytest

import ttile
from ttile.generator.networks import ALL_LAYERS, RESNET18
from conftest import AVAILABLE_ISAS, forget_choices, random_tensors, shipped_cpu
from ttile.runtime import registry
from ttile.core.reference import assert_conv_close

# the direct kernels' machinery, on 3x3 stride-1 shapes too (see conftest.no_winograd)
pytestmark = pytest.mark.usefixtures("no_winograd")


def _run_layer(layer, layout, threads, expect_tuned=None):
    """Run and check one layer; ``expect_tuned`` True asserts that the registry's tuned
    kernel serves it (where one was tuned for it), False that none does."""
    spec = layer.spec()
    rng = np.random.default_rng(zlib.crc32(layer.name.encode()))  # the same in every process
    pad = layer.rs // 2
    if layout == "NHWC":
        x, w = random_tensors(rng, (1, spec.h, spec.w, spec.c), (spec.r, spec.s, spec.c, spec.k))
    else:
        x, w = random_tensors(rng, (1, spec.c, spec.h, spec.w), (spec.k, spec.c, spec.r, spec.s))
    plan = ttile.plan(x.shape, w.shape, stride=layer.stride, padding=pad, layout=layout,
                      threads=threads, prepacked=True)   # the verdict itself
    family = ttile.get_isa()
    entry = registry.lookup(spec, threads, isa=family) if family.vector else None
    if expect_tuned and entry is not None and entry.kind is ttile.KernelKind.TUNED:
        assert plan.kind == ttile.KernelKind.TUNED, plan
    elif expect_tuned is False:
        assert plan.kind != ttile.KernelKind.TUNED, plan
    expected_shape = ((1, spec.ho, spec.wo, spec.k) if layout == "NHWC"
                      else (1, spec.k, spec.ho, spec.wo))
    # the kernel the plan reported (pre-packed), and whatever a per-call conv2d runs
    prepacked = ttile.Conv2d(w, stride=layer.stride, padding=pad, layout=layout,
                             threads=threads)(x)
    y = ttile.conv2d(x, w, stride=layer.stride, padding=pad, layout=layout, threads=threads)
    for out in (prepacked, y):
        assert out.shape == expected_shape
        assert out.flags.c_contiguous
        assert_conv_close(out, x, w, (layer.stride,) * 2, (pad,) * 4, layout=layout)
    return plan


@pytest.fixture(params=["tuned", "generic"])
def kernel_choice(request):
    """Run once with a shipped set's tuned kernels (this CPU's, or another AVX-512F CPU's
    when this one has none: ``conftest.shipped_cpu``) and once with the generic kernel
    only, so both serve every Fig. 8 layer under test on any CPU."""
    previous = ttile.use_tuned_kernels(request.param == "tuned")
    if request.param == "tuned" and ttile.has_avx512f():
        with registry.pretend_cpu(shipped_cpu()):
            forget_choices()
            yield request.param
    else:
        yield request.param
    forget_choices()
    ttile.use_tuned_kernels(previous)


@pytest.mark.parametrize("layer", ALL_LAYERS, ids=lambda l: l.name)
def test_layer_nhwc_default_kernel(layer, kernel_choice):
    _run_layer(layer, "NHWC", threads=2, expect_tuned=kernel_choice == "tuned")


def test_the_shipped_set_serves_searched_kernels(kernel_choice):
    """The tuned parameter is not vacuous: the set in use serves searched kernels on a
    share of the Fig. 8 layers (prepacked, at 2 threads)."""
    if kernel_choice != "tuned" or not ttile.has_avx512f():
        pytest.skip("the shipped AVX-512F sets serve the tuned case only")
    tuned = [layer.name for layer in ALL_LAYERS
             if ttile.plan(layer.spec().input_shape(), layer.spec().weight_shape(),
                           stride=layer.stride, padding=layer.rs // 2, layout="NHWC",
                           threads=2, prepacked=True).kind is ttile.KernelKind.TUNED]
    assert len(tuned) >= 5, tuned


@pytest.mark.parametrize("layer", [l for l in ALL_LAYERS if l.k * l.c <= 512 * 512],
                         ids=lambda l: l.name)
def test_layer_nchw_default_kernel(layer):
    _run_layer(layer, "NCHW", threads=1)


@pytest.mark.skipif("avx2" not in AVAILABLE_ISAS, reason="this CPU does not run AVX2")
@pytest.mark.parametrize("isa", ["avx2"], indirect=True)
@pytest.mark.parametrize("layer", ALL_LAYERS, ids=lambda l: l.name)
def test_layer_avx2_family(layer, isa):
    """The AVX2 family's searched kernels (where this CPU has them) and generic kernel."""
    _run_layer(layer, "NHWC", threads=1, expect_tuned=True)


@pytest.mark.parametrize("isa", ["portable"], indirect=True)
@pytest.mark.parametrize("layer", RESNET18, ids=lambda l: l.name)
def test_resnet18_portable_kernel(layer, isa):
    _run_layer(layer, "NHWC", threads=2)


@pytest.mark.slow
@pytest.mark.parametrize("isa", AVAILABLE_ISAS, indirect=True)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("layer", ALL_LAYERS, ids=lambda l: l.name)
def test_layer_every_kernel_and_layout(layer, layout, isa):
    _run_layer(layer, layout, threads=2)
