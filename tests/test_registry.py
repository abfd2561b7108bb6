"""The offline search's verdicts compiled into the extension: every kernel checked
against float64, served by conv2d only on its own CPU at its own thread count, and the
generic-kernel verdicts keeping known layers from being tuned again. Needs no generator
libraries (islpy, scipy): the registry is part of every install."""
import dataclasses

import numpy as np
import pytest

import ttile
from ttile import _kernels
from ttile.core.kinds import Activation
from ttile.core.reference import assert_conv_close, conv2d_nhwc_f64
from ttile.core.spec import ConvSpec
from ttile.core.vectors import extension_code
from ttile.runtime import dispatch, registry
from ttile.runtime.scratch import aligned_empty
from conftest import AVAILABLE_ISAS, forget_choices, requires_avx2, requires_avx512

# the direct kernels' machinery, on 3x3 stride-1 shapes too (see conftest.no_winograd)
pytestmark = pytest.mark.usefixtures("no_winograd")


def _kernel_cases():
    return [pytest.param(e, id=f"{e.layer}-{e.cpu[:16]}-t{e.threads}") for e in registry.KERNELS]


def test_entries_name_their_cpu_and_thread_count():
    assert registry.ENTRIES and registry.KERNELS
    raw = ttile.tuned_kernels()
    assert len(raw) == len(registry.KERNELS)
    for entry, data in zip(registry.KERNELS, raw):
        assert data["cpu"] == entry.cpu and data["threads"] == entry.threads >= 1
        assert data["isa"] == entry.isa.value
        assert data["scheme"] == entry.scheme and data["k"] == entry.spec.k
        assert entry.microkernels.startswith("[U") and entry.microkernels.endswith("V k]")
    for entry in registry.ENTRIES:
        found = registry.lookup(entry.spec, entry.threads, entry.cpu, entry.isa)
        # a searched verdict of a set this build left out serves nothing
        assert found == (entry if entry.compiled else None)
        assert entry.compiled or entry.kind is ttile.KernelKind.TUNED
        assert (entry.kind is ttile.KernelKind.GENERIC) == (entry.scheme == "" == entry.microkernels)
    assert registry.lookup(ConvSpec(1, 16, 3, 5, 5, 1, 1), 1) is None


def test_a_verdict_serves_only_its_cpu_and_thread_count():
    entry = registry.KERNELS[0]
    others = {e.threads for e in registry.ENTRIES if e.spec == entry.spec and e.cpu == entry.cpu}
    unmeasured = next(t for t in (3, 4, 5, 7, 16) if t not in others)
    assert registry.lookup(entry.spec, entry.threads, "another-cpu-0-0-00000000") is None
    assert registry.lookup(entry.spec, unmeasured, entry.cpu) is None
    with registry.pretend_cpu(entry.cpu):
        assert registry.lookup(entry.spec, entry.threads, isa=entry.isa) == entry


def _pointwise(spec: ConvSpec) -> bool:
    """An NCHW call of this problem runs the NCHW pointwise kernel (at any stride), not a
    searched one."""
    return (spec.r == spec.s == 1
            and spec.pad_top == spec.pad_bottom == spec.pad_left == spec.pad_right == 0)


def _skip_unless_runnable(entry) -> None:
    runs = ttile.has_avx512f() if entry.isa is ttile.Isa.AVX512F else ttile.has_avx2()
    if not runs:
        pytest.skip(f"this CPU does not run the {entry.isa.value} family")


@pytest.mark.parametrize("entry", _kernel_cases())
def test_every_shipped_tuned_kernel_matches_the_reference(entry):
    """Each family's kernels, served to calls held to that family (``set_isa``)."""
    _skip_unless_runnable(entry)
    spec = entry.spec
    rng = np.random.default_rng(entry.index)
    x = rng.uniform(-1, 1, spec.input_shape()).astype(np.float32)
    w = rng.uniform(-1, 1, spec.weight_shape()).astype(np.float32)
    y = np.full(spec.output_shape(), np.nan, np.float32)
    packed = _kernels.pack_weights(w, entry.panel)
    _kernels.run_tuned(entry.index, x, packed, y, entry.threads)
    assert_conv_close(y, x, w, (spec.stride_h, spec.stride_w),
                      (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right))
    if entry.nchw:
        _check_nchw_entry_point(entry, x, packed, y, rng)
    # a Conv2d serves the matching call with it on that CPU (the plan says so, the bits
    # agree); a per-call conv2d serves it too unless packing its weights per call is
    # estimated to cost more than the generic kernel (which the plan's note then says)
    pads = (spec.pad_top, spec.pad_left)
    stride = (spec.stride_h, spec.stride_w)
    previous = ttile.set_isa(entry.isa)
    try:
        _serve_on_its_cpu(entry, x, w, y, stride, pads)
    finally:
        ttile.set_isa(previous)
    forget_choices()


def _check_nchw_entry_point(entry, x, packed, y, rng):
    """Its NCHW entry point: the same sums from the NCHW input, stored tile by tile into
    NCHW, bit for bit, and the epilogue applied at that store."""
    spec = entry.spec
    n, ho, wo, k = spec.output_shape()
    y_nchw = aligned_empty((n, k, ho, wo))   # aligned: large outputs take streamed stores
    y_nchw.fill(np.nan)
    x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    _kernels.run_tuned(entry.index, x, packed, y_nchw, entry.threads, nchw_out=True)
    np.testing.assert_array_equal(y_nchw, y.transpose(0, 3, 1, 2))
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, y_nchw.shape).astype(np.float32)
    _kernels.run_tuned(entry.index, x, packed, y_nchw, entry.threads, bias=bias,
                       residual=residual, activation=Activation.RELU.code,
                       nchw_out=True)
    np.testing.assert_allclose(
        y_nchw, np.maximum(y.transpose(0, 3, 1, 2) + bias[:, None, None] + residual, 0),
        rtol=1e-6, atol=1e-6)


def _serve_on_its_cpu(entry, x, w, y, stride, pads):
    spec = entry.spec
    with registry.pretend_cpu(entry.cpu):
        plan = ttile.plan(spec.input_shape(), spec.weight_shape(),
                          stride=stride, padding=pads, layout="NHWC",
                          threads=entry.threads, prepacked=True)
        assert plan.kind == ttile.KernelKind.TUNED and plan.scheme == entry.scheme
        assert plan.isa == entry.isa
        assert (plan.tuned_cpu, plan.tuned_threads) == (entry.cpu, entry.threads)
        out = ttile.Conv2d(w, stride=stride, padding=pads, layout="NHWC",
                           threads=entry.threads)(x)
        per_call = ttile.plan(spec.input_shape(), spec.weight_shape(),
                              stride=stride, padding=pads, layout="NHWC",
                              threads=entry.threads)
        assert per_call.kind == ttile.KernelKind.TUNED or "estimated" in per_call.note
    np.testing.assert_array_equal(out, y)


def test_a_verdict_serves_only_its_vector_family():
    """An AVX2 verdict is evidence about the AVX2 family: it serves calls held to AVX2,
    never an AVX-512F call, and an AVX-512F verdict never serves an AVX2 call."""
    families = {e.isa for e in registry.KERNELS}
    assert families == {ttile.Isa.AVX512F, ttile.Isa.AVX2}, "the wheel ships both families"
    for entry in registry.KERNELS:
        other = ttile.Isa.AVX2 if entry.isa is ttile.Isa.AVX512F else ttile.Isa.AVX512F
        assert registry.lookup(entry.spec, entry.threads, entry.cpu, entry.isa) is entry
        twin = registry.lookup(entry.spec, entry.threads, entry.cpu, other)
        assert twin is None or (twin.isa is other and twin.index != entry.index)
    if not ttile.has_avx2():
        pytest.skip("this CPU does not run AVX2")
    entry = next(e for e in registry.KERNELS if e.isa is ttile.Isa.AVX2)
    spec = entry.spec
    args = dict(stride=(spec.stride_h, spec.stride_w), padding=(spec.pad_top, spec.pad_left),
                layout="NHWC", threads=entry.threads, prepacked=True)
    with registry.pretend_cpu(entry.cpu):
        previous = ttile.set_isa("avx2")
        try:
            held = ttile.plan(spec.input_shape(), spec.weight_shape(), **args)
        finally:
            ttile.set_isa(previous)
        assert held.kind == ttile.KernelKind.TUNED and held.isa == "avx2"
        assert "in avx2" in held.note
        if ttile.has_avx512f():
            previous = ttile.set_isa("avx512f")
            try:
                wide = ttile.plan(spec.input_shape(), spec.weight_shape(), **args)
            finally:
                ttile.set_isa(previous)
            assert wide.scheme != entry.scheme or wide.isa == "avx512f"
            assert wide.isa == "avx512f"
    forget_choices()


@pytest.mark.parametrize("kind", ["tuned", "jit"])
def test_a_per_call_conv2d_weighs_packing_against_the_generic_kernel(kind):
    """A searched kernel - compiled in, or tuned here - needs its weights packed per
    call; the generic kernel packs in place. With both warm rates known, the cheaper
    serves a per-call conv2d."""
    from ttile.core.kinds import Isa
    # (a cost model: any searched verdict serves, compiled in or not, so the same one
    # whichever kernel sets a build holds)
    entry = max((e for e in registry.ENTRIES if e.kind is ttile.KernelKind.TUNED
                 and e.warm_gflops and e.generic_gflops),
                key=lambda e: e.spec.k * e.spec.c * e.spec.r * e.spec.s / e.spec.flops)
    choice = dispatch.registry_choice(entry, Isa.AVX512F)
    if kind == "jit":   # what dispatch._load makes of a cache entry: its head-to-head rates
        choice = dataclasses.replace(choice, kind=ttile.KernelKind.JIT, index=-1)
    kept = dispatch.for_call(choice, entry.spec, "NHWC", False, entry.threads, Isa.AVX512F)
    assert kept is choice                           # pre-packed NHWC: the faster kernel
    slow = dataclasses.replace(choice, warm_gflops=entry.generic_gflops * 1.01)
    packed_weights_cost = dispatch.for_call(slow, entry.spec, "NCHW", True, entry.threads,
                                            Isa.AVX512F)
    assert packed_weights_cost.kind is ttile.KernelKind.GENERIC      # 1 % is not worth it
    assert "estimated" in packed_weights_cost.note
    fast = dataclasses.replace(choice, warm_gflops=entry.generic_gflops * 100)
    assert dispatch.for_call(fast, entry.spec, "NCHW", True, entry.threads,
                             Isa.AVX512F) is fast
    unrated = dataclasses.replace(slow, warm_gflops=0.0)   # never compared: kept
    assert dispatch.for_call(unrated, entry.spec, "NCHW", True, entry.threads,
                             Isa.AVX512F) is unrated


def test_a_per_call_nhwc_conv2d_on_weights_that_stay_in_cache_keeps_the_faster_kernel():
    """Weights that fit the threads' L2 caches are checked (NHWC, searched kernel) or
    packed (generic kernel) from cache at like rates: the faster kernel serves per call
    as it does packed. Where the generic kernel reads them in place (a small output),
    the searched kernel's check is weighed against nothing. NCHW calls, which transpose
    torch's weights, still weigh."""
    from ttile.core.kinds import Isa
    from ttile.generator.networks import layer
    spec = layer("ResNet18-11").spec()   # 1x1 256->512 on 7x7 outputs: 512 KB of weights
    weight_bytes = 4 * spec.k * spec.c * spec.r * spec.s
    if _kernels.cpu_l2_bytes() < weight_bytes or _kernels.generic_cache_bytes() > weight_bytes:
        pytest.skip("this CPU's L2 is smaller than the layer's weights, or its cache "
                    "blocking larger")
    entry = next(e for e in registry.KERNELS if e.warm_gflops and e.generic_gflops)
    choice = dataclasses.replace(dispatch.registry_choice(entry, Isa.AVX512F),
                                 kind=ttile.KernelKind.JIT, index=-1, panel=32,
                                 warm_gflops=200.0, generic_gflops=190.0)
    # read in place: 0.064 ms + 26 us of checking against 0.067 ms
    assert dispatch._generic_reads_in_place(spec, 1, Isa.AVX512F)
    direct = dispatch.for_call(choice, spec, "NHWC", True, 1, Isa.AVX512F)
    assert direct.kind is ttile.KernelKind.GENERIC and "estimated" in direct.note
    fast = dataclasses.replace(choice, warm_gflops=400.0)   # 0.032 + 0.026 ms: kept
    assert dispatch.for_call(fast, spec, "NHWC", True, 1, Isa.AVX512F) is fast
    packing = layer("ResNet18-6").spec()   # 590 KB on 28x28 outputs: packed in the kernel
    assert not dispatch._generic_reads_in_place(packing, 1, Isa.AVX512F)
    assert dispatch.for_call(choice, packing, "NHWC", True, 1, Isa.AVX512F) is choice
    nchw = dispatch.for_call(choice, spec, "NCHW", True, 1, Isa.AVX512F)
    assert nchw.kind is ttile.KernelKind.GENERIC and "estimated" in nchw.note
    large = layer("ResNet18-12").spec()   # 9.4 MB: from memory, weighed in both layouts
    assert dispatch.for_call(choice, large, "NHWC", True, 1,
                             Isa.AVX512F).kind is ttile.KernelKind.GENERIC


@pytest.mark.parametrize("isa_code", ["avx512f", "avx2"])
def test_the_generic_kernel_says_which_weights_it_reads_in_place(isa_code):
    """Its direct path serves small outputs (at most 64 pixels) whose weights reach its
    cache blocking: ResNet18-10 and -12 (7x7 outputs, 9.4 MB), not ResNet18-9 (14x14)
    nor 221 KB of weights on 7x7 - until the blocking is made smaller than those."""
    from ttile.generator.networks import layer
    if isa_code == "avx512f" and not ttile.has_avx512f() or not ttile.has_avx2():
        pytest.skip(f"this CPU does not run the {isa_code} family")
    isa = _kernels.ISA_AVX512F if isa_code == "avx512f" else _kernels.ISA_AVX2

    def reads_in_place(spec, threads=1):
        return _kernels.generic_reads_in_place(
            spec.n, spec.h, spec.w, spec.c, spec.k, spec.r, spec.s, spec.ho, spec.wo,
            spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left, 1, 1, threads, isa)

    for name in ("ResNet18-10", "ResNet18-12"):
        assert reads_in_place(layer(name).spec()) and reads_in_place(layer(name).spec(), 2)
    assert not reads_in_place(layer("ResNet18-9").spec())
    small = ConvSpec(1, 96, 64, 7, 7, 3, 3, 1, 1, 1, 1, 1, 1)   # one block a row
    assert not reads_in_place(small)
    previous = _kernels.set_generic_cache_bytes(64 << 10)
    try:
        assert reads_in_place(small)
    finally:
        _kernels.set_generic_cache_bytes(previous)
    with pytest.raises(ValueError, match=">= 1"):
        _kernels.generic_reads_in_place(1, 7, 7, 64, 64, 3, 3, 7, 7, 1, 1, 1, 1, 1, 1, 0,
                                        isa)


@requires_avx512
def test_a_generic_verdict_serves_the_generic_kernel_without_tuning(jit_cache, monkeypatch):
    verdicts = [e for e in registry.ENTRIES if e.kind is ttile.KernelKind.GENERIC]
    if not verdicts:
        pytest.skip("this build ships no generic-kernel verdict")
    entry = min(verdicts, key=lambda e: e.spec.flops)
    from ttile.runtime import jit

    def forbidden(*args, **kwargs):
        raise AssertionError("a layer the offline search decided was tuned again")

    monkeypatch.setattr(jit, "tune", forbidden)
    spec = entry.spec
    with registry.pretend_cpu(entry.cpu):
        plan = ttile.plan(spec.input_shape(), spec.weight_shape(),
                          stride=(spec.stride_h, spec.stride_w),
                              padding=(spec.pad_top, spec.pad_left), layout="NHWC", threads=entry.threads)
        assert plan.kind == ttile.KernelKind.GENERIC and "offline search" in plan.note
        assert plan.tuned_cpu == entry.cpu
        x = np.ones(spec.input_shape(), np.float32)
        w = np.ones(spec.weight_shape(), np.float32)
        ttile.conv2d(x, w,
                     stride=(spec.stride_h, spec.stride_w),
                         padding=(spec.pad_top, spec.pad_left), layout="NHWC", threads=entry.threads)
    forget_choices()


def test_run_tuned_refuses_a_verdict_without_a_kernel():
    verdicts = [e for e in registry.ENTRIES if e.kind is ttile.KernelKind.GENERIC]
    if not verdicts or not ttile.has_avx512f():
        pytest.skip("no generic verdict or no AVX-512F")
    spec = verdicts[0].spec
    with pytest.raises(ValueError, match="verdict"):
        _kernels.run_tuned(verdicts[0].index, np.zeros(spec.input_shape(), np.float32),
                           np.zeros((1, 1, 1, 1, 16), np.float32),
                           np.zeros(spec.output_shape(), np.float32), 1)


@requires_avx2
def test_run_compiled_checks_arrays_against_the_kernels_problem():
    """A compiled kernel's sizes are constants: arrays of another problem are refused
    even when they agree with each other."""
    entry = min((e for e in registry.KERNELS if e.isa.value in AVAILABLE_ISAS),
                key=lambda e: e.spec.flops)
    spec = entry.spec
    other = ConvSpec(spec.n, spec.k, spec.c, spec.h + 1, spec.w, spec.r, spec.s,
                     spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_bottom,
                     spec.pad_left, spec.pad_right)
    x = np.zeros(other.input_shape(), np.float32)
    w = _kernels.pack_weights(np.zeros(other.weight_shape(), np.float32), entry.panel)
    y = np.zeros(other.output_shape(), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        _kernels.run_compiled(1, x, w, y, 1, spec.input_shape(),
                              spec.packed_weight_shape(entry.panel), spec.output_shape(),
                              isa=extension_code(entry.isa))


@pytest.mark.skipif(ttile.has_avx512f(), reason="this CPU runs AVX-512F")
def test_a_kernel_of_a_family_this_cpu_lacks_is_refused():
    """On a CPU without AVX-512F an AVX-512F kernel raises before its address is called
    (it would fault); the AVX2 family's kernels run (test_every_shipped_tuned_kernel...)."""
    spec = ConvSpec(1, 16, 16, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1)
    x = np.zeros(spec.input_shape(), np.float32)
    w = _kernels.pack_weights(np.zeros(spec.weight_shape(), np.float32), 16)
    y = np.zeros(spec.output_shape(), np.float32)
    with pytest.raises(RuntimeError, match="without AVX-512F"):
        _kernels.run_compiled(1, x, w, y, 1, spec.input_shape(),
                              spec.packed_weight_shape(16), spec.output_shape(),
                              isa=_kernels.ISA_AVX512F)


@requires_avx512
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_a_batch_of_a_searched_layer_runs_its_kernel_image_by_image(layout):
    """No search ran for N = 3: the one-image kernel serves each image, with the epilogue
    (its residual sliced per image)."""
    entry = min((e for e in registry.KERNELS if e.isa is ttile.get_isa()
                 and (layout == "NHWC" or not _pointwise(e.spec))),
                key=lambda e: e.spec.flops)
    spec = dataclasses.replace(entry.spec, n=3)
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, spec.input_shape()).astype(np.float32)
    w = rng.uniform(-1, 1, spec.weight_shape()).astype(np.float32)
    bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
    residual = rng.uniform(-1, 1, spec.output_shape()).astype(np.float32)
    from ttile.core.reference import conv2d_nhwc_f64
    pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
    expected = np.maximum(conv2d_nhwc_f64(x, w, (spec.stride_h, spec.stride_w), pads)
                          + bias + residual, 0)
    if layout == "NCHW":
        x, w = x.transpose(0, 3, 1, 2).copy(), w.transpose(3, 2, 0, 1).copy()
        residual = residual.transpose(0, 3, 1, 2).copy()
        expected = expected.transpose(0, 3, 1, 2)
    kwargs = dict(stride=(spec.stride_h, spec.stride_w), padding=(spec.pad_top, spec.pad_left),
                  layout=layout, threads=entry.threads, activation="relu")
    with registry.pretend_cpu(entry.cpu):
        forget_choices()
        plan = ttile.plan(x.shape, w.shape, bias, prepacked=True, residual=residual, **kwargs)
        assert plan.kind == ttile.KernelKind.TUNED and plan.problem.n == 3
        layer = ttile.Conv2d(w, bias, kwargs["stride"], kwargs["padding"], layout=layout,
                             threads=entry.threads, activation="relu")
        y = layer(x, residual=residual)
    forget_choices()
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


@requires_avx512
@pytest.mark.parametrize("prepacked", [False, True])
def test_an_nchw_call_of_a_searched_layer_stores_nchw_from_the_kernel(prepacked):
    """conv2d / Conv2d in NCHW serve a searched kernel through its NCHW entry point: the
    output is written by the kernel (no NHWC copy converted back), the residual read in
    NCHW, and the result is torch's."""
    entries = [e for e in registry.KERNELS if e.nchw and e.isa is ttile.Isa.AVX512F
               and e.spec.flops < 2e8 and not _pointwise(e.spec)]
    if not entries:
        pytest.skip("no searched kernel with an NCHW entry point")
    entry = min(entries, key=lambda e: e.spec.flops)
    spec = entry.spec
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (spec.n, spec.c, spec.h, spec.w)).astype(np.float32)
    w = rng.uniform(-1, 1, (spec.k, spec.c, spec.r, spec.s)).astype(np.float32)
    bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
    residual = rng.uniform(-1, 1, (spec.n, spec.k, spec.ho, spec.wo)).astype(np.float32)
    kwargs = dict(stride=(spec.stride_h, spec.stride_w), padding=(spec.pad_top, spec.pad_left),
                  threads=entry.threads)
    with registry.pretend_cpu(entry.cpu):
        plan = ttile.plan(x.shape, w.shape, **kwargs, prepacked=True)
        assert plan.kind == ttile.KernelKind.TUNED and plan.scheme == entry.scheme
        if prepacked:
            out = ttile.Conv2d(w, bias, **kwargs, activation="relu")(x, residual=residual)
        else:
            out = ttile.conv2d(x, w, bias, **kwargs, activation="relu", residual=residual)
    forget_choices()
    expected = conv2d_nhwc_f64(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0),
                               (spec.stride_h, spec.stride_w),
                               (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right))
    expected = np.maximum(expected.transpose(0, 3, 1, 2) + bias[:, None, None] + residual, 0)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-3)
