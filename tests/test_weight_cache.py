"""Per-call conv2d reuses the weights it packed while the caller's array is unchanged, and
never computes with stale weights (src/ttile/runtime/weight_cache.py)."""
import threading

import numpy as np
import pytest

import ttile
from ttile import _kernels
from ttile.core.reference import assert_conv_close
from ttile.runtime import weight_cache
from ttile.runtime.weight_cache import WeightCache

# the direct kernels' machinery, on 3x3 stride-1 shapes too (see conftest.no_winograd)
pytestmark = pytest.mark.usefixtures("no_winograd")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    """Each test starts from an empty process cache of the default size, used from one
    thread on (by default only calls on many threads use it)."""
    cache = WeightCache()
    monkeypatch.setattr(weight_cache, "CACHE", cache)
    monkeypatch.setattr(weight_cache, "MIN_THREADS", 1)
    return cache


def test_calls_on_few_threads_pack_per_call(fresh_cache, monkeypatch):
    monkeypatch.setattr(weight_cache, "MIN_THREADS", 3)
    x, w = _problem(seed=6)
    for threads in (1, 2, 1, 2):
        ttile.conv2d(x, w, padding=1, layout="NHWC", threads=threads)
    assert len(fresh_cache) == 0 and fresh_cache.misses == 0


def _problem(k=128, c=64, hw=9, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (1, hw, hw, c)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, c, k)).astype(np.float32)   # 295 KB: cached
    return x, w


def _check(y, x, w):
    """y (NHWC) against the float64 reference of x (NHWC) and w (RSCK), padding 1."""
    assert_conv_close(y, x, w, pads=(1, 1, 1, 1))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_repeated_call_reuses_the_packed_weights(fresh_cache, threads):
    x, w = _problem()
    first = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=threads)
    packs = fresh_cache.misses
    second = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=threads)
    choice_plan = ttile.plan(x.shape, w.shape, padding=1, layout="NHWC", threads=threads,
                             prepacked=True)
    if choice_plan.kind is ttile.KernelKind.GENERIC and not ttile.has_avx512f() \
            and not ttile.has_avx2():
        pytest.skip("the portable kernel packs nothing")
    assert packs == 1 and fresh_cache.misses == 1 and fresh_cache.hits == 1
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(
        second, ttile.Conv2d(w, padding=1, layout="NHWC", threads=threads)(x))
    _check(second, x, w)


def _flip_one_bit(w, index, bit):
    w.view(np.uint32).reshape(-1)[index] ^= np.uint32(1 << bit)


@pytest.mark.parametrize("index, bit", [(0, 0), (5000, 31), (-1, 3)])
def test_a_changed_bit_anywhere_packs_again(fresh_cache, index, bit):
    x, w = _problem(seed=1)
    ttile.conv2d(x, w, padding=1, layout="NHWC", threads=2)
    ttile.conv2d(x, w, padding=1, layout="NHWC", threads=2)
    if not ttile.has_avx2():
        pytest.skip("the portable kernel packs nothing")
    assert fresh_cache.hits == 1, "a repeated call did not reuse its packed weights"
    _flip_one_bit(w, index, bit)
    y = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=2)
    assert fresh_cache.misses == 2
    _check(y, x, w)
    np.testing.assert_array_equal(
        y, ttile.Conv2d(w.copy(), padding=1, layout="NHWC", threads=2)(x))


def test_an_array_that_keeps_changing_is_not_cached(fresh_cache):
    x, w = _problem(seed=2)
    for step in range(5):
        w *= np.float32(0.5)
        y = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=2)
        _check(y, x, w)
    # packed and copied on the first call and after the first change; then left alone
    assert fresh_cache.misses <= weight_cache.MAX_CHANGES
    assert len(fresh_cache) == 0 and fresh_cache.nbytes == 0


def test_nchw_calls_reuse_torch_layout_weights_too(fresh_cache):
    x, w = _problem(seed=3)
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    w_kcrs = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    first = ttile.conv2d(x_nchw, w_kcrs, padding=1, threads=2)
    second = ttile.conv2d(x_nchw, w_kcrs, padding=1, threads=2)
    np.testing.assert_array_equal(first, second)
    w_kcrs[3, 7, 1, 2] += 1
    third = ttile.conv2d(x_nchw, w_kcrs, padding=1, threads=2)
    _check(third.transpose(0, 2, 3, 1), x, np.ascontiguousarray(w_kcrs.transpose(2, 3, 1, 0)))


def test_what_is_not_cached(fresh_cache):
    x, w = _problem(k=32, c=16)            # 18 KB of weights: packed per call
    ttile.conv2d(x, w, padding=1, layout="NHWC")
    x, w = _problem(seed=4)
    y = ttile.conv2d(x, w.astype(np.float64), padding=1, layout="NHWC")   # a converted copy
    ttile.conv2d(x, w[:, :, :, ::-1], padding=1, layout="NHWC")          # not contiguous
    assert len(fresh_cache) == 0
    _check(y, x, w)


def test_the_bound_is_kept_and_zero_turns_the_reuse_off(fresh_cache):
    arrays = [_problem(seed=s) for s in range(5)]
    bound = 4 * arrays[0][1].nbytes + 1000   # one array may take up to half the bound
    fresh_cache.resize(bound)
    for x, w in arrays:
        y = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=2)
        _check(y, x, w)
        assert 0 < fresh_cache.nbytes <= bound
    assert 1 <= len(fresh_cache) < len(arrays)    # the oldest were dropped
    assert ttile.set_weight_cache(0) == bound
    assert len(fresh_cache) == 0 and fresh_cache.nbytes == 0
    x, w = arrays[0]
    ttile.conv2d(x, w, padding=1, layout="NHWC")
    assert len(fresh_cache) == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            ttile.set_weight_cache(bad)


def test_threads_sharing_one_weight_array(fresh_cache):
    x, w = _problem(seed=5)
    expected = ttile.Conv2d(w, padding=1, layout="NHWC", threads=1)(x)
    results, errors = [], []

    def work():
        try:
            for _ in range(10):
                results.append(ttile.conv2d(x, w, padding=1, layout="NHWC", threads=1))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors
    for y in results:
        np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("n", [1, 100, 65536, 65537, 300001])
def test_same_bytes(n):
    a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    b = a.copy()
    for threads in (1, 2, 3):
        assert _kernels.same_bytes(a, b, threads)
        for i in {0, n // 2, n - 1}:
            c = b.copy()
            c.view(np.uint32)[i] ^= np.uint32(1)
            assert not _kernels.same_bytes(a, c, threads)
    assert not _kernels.same_bytes(a, b[:-1], 1)
    nan = np.full(4, np.nan, np.float32)
    assert _kernels.same_bytes(nan, nan.copy(), 1)
    assert not _kernels.same_bytes(np.zeros(4, np.float32), np.full(4, -0.0, np.float32), 1)
    with pytest.raises(ValueError):
        _kernels.same_bytes(a[::2], b[::2], 1) if n > 2 else _kernels.same_bytes(
            np.zeros((4, 4), np.float32).T, np.zeros((4, 4), np.float32).T, 1)


@pytest.mark.parametrize("isa", [None, _kernels.ISA_PORTABLE]
                         + ([_kernels.ISA_AVX2] if ttile.has_avx2() else [])
                         + ([_kernels.ISA_AVX512F] if ttile.has_avx512f() else []))
@pytest.mark.parametrize("k, panel", [(128, 48), (96, 32), (40, 16), (64, 64), (36, 24)])
def test_packed_matches(k, panel, isa):
    w = np.random.default_rng(k).standard_normal((3, 3, 24, k)).astype(np.float32)
    packed = _kernels.pack_weights(w, panel, 1, np.empty(((k + panel - 1) // panel, 3, 3, 24,
                                                           panel), np.float32))
    for threads in (1, 2, 5):
        assert _kernels.packed_matches(w, packed, threads, isa)
        for i in {0, 7, w.size // 2, w.size - 1}:   # first, last, middle panels' words
            changed = w.copy()
            changed.reshape(-1).view(np.uint32)[i] ^= np.uint32(1 << (i % 32))
            assert not _kernels.packed_matches(changed, packed, threads, isa)
    if k % panel:   # the tail panel's zero fill is not the weights': not compared
        tail = packed.copy()
        tail[-1, ..., -1] = 1.0
        assert _kernels.packed_matches(w, tail, 1, isa)
    with pytest.raises(ValueError):
        _kernels.packed_matches(w[:, :, :12].copy(), packed, 1)
    with pytest.raises(ValueError):
        _kernels.packed_matches(w, packed.reshape(packed.shape[0], 9, 24, panel), 1)


def test_a_searched_kernel_packing_apart_reuses_on_one_thread(fresh_cache, monkeypatch,
                                                              shipped_set):
    """Below MIN_THREADS, an NHWC call whose per-call kernel packs in a pass of its own
    reuses (the check reads what that pass reads); a generic-kernel call does not."""
    from ttile.generator.networks import ALL_LAYERS
    from ttile.runtime import call_plan, routes
    monkeypatch.setattr(weight_cache, "MIN_THREADS", 64)
    found = None
    for layer in sorted(ALL_LAYERS, key=lambda l: l.spec().flops):
        spec, pad = layer.spec(), layer.rs // 2
        w_shape = spec.weight_shape()
        if 4 * np.prod(w_shape) < weight_cache.MIN_BYTES:
            continue
        plan = call_plan.call_plan(spec.input_shape(), w_shape, layer.stride, pad, "NHWC")
        if plan.family is not call_plan.Family.DENSE:
            continue
        choice = routes.select(plan, 1).choice
        if choice.kind in (ttile.KernelKind.TUNED, ttile.KernelKind.JIT) \
                and choice.panel not in (0, spec.k):
            found = layer
            break
    assert found is not None, f"no searched kernel packing apart serves a Fig. 8 layer " \
                              f"in {shipped_set}'s set"
    spec, pad = found.spec(), found.rs // 2
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, spec.input_shape()).astype(np.float32)
    w = rng.uniform(-1, 1, spec.weight_shape()).astype(np.float32)
    first = ttile.conv2d(x, w, stride=found.stride, padding=pad, layout="NHWC", threads=1)
    second = ttile.conv2d(x, w, stride=found.stride, padding=pad, layout="NHWC", threads=1)
    assert fresh_cache.misses == 1 and fresh_cache.hits == 1
    np.testing.assert_array_equal(first, second)
    assert_conv_close(second, x, w, (found.stride, found.stride), (pad,) * 4)


# ---------------------------------------------------------------------------------------
# bf16 calls: the packed weights are the rounded weights, compared rounded (Check.BF16)

def _bf16_kernel_or_skip():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    plan = ttile.plan((1, 9, 9, 64), (3, 3, 64, 128), padding=1, layout="NHWC",
                      precision="bf16")
    if plan.kind not in (ttile.KernelKind.AMX, ttile.KernelKind.DOT_BF16):
        pytest.skip("no bf16 kernel on this CPU (the fp32 kernels serve bf16 calls)")
    return ml_dtypes


def _bf16_call(x, w, threads=2):
    return ttile.conv2d(x, w, padding=1, layout="NHWC", threads=threads, precision="bf16")


def _bf16_fresh(x, w):
    """The same call with nothing reused: a layer made from a copy of the weights."""
    return ttile.Conv2d(w.copy(), padding=1, layout="NHWC", threads=2, precision="bf16")(x)


def test_bf16_calls_reuse_packed_weights_until_their_rounding_changes(fresh_cache):
    _bf16_kernel_or_skip()
    x, w = _problem(seed=7)
    first = _bf16_call(x, w)
    second = _bf16_call(x, w)
    assert fresh_cache.misses == 1 and fresh_cache.hits == 1
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(second, _bf16_fresh(x, w))
    # the low bit of a weight whose rounding it does not reach: the kernel computes the
    # same, so the packing is kept
    flat = w.reshape(-1)
    hidden = int(np.argmax((flat.view(np.uint32) & 0xFFFF) < 0x4000))
    flat.view(np.uint32)[hidden] ^= np.uint32(1)
    third = _bf16_call(x, w)
    assert fresh_cache.misses == 1 and fresh_cache.hits == 2
    np.testing.assert_array_equal(third, _bf16_fresh(x, w))
    # a change the rounding keeps, in the last weight: packed again
    flat.view(np.uint32)[-1] ^= np.uint32(1 << 20)
    fourth = _bf16_call(x, w)
    assert fresh_cache.misses == 2
    np.testing.assert_array_equal(fourth, _bf16_fresh(x, w))
    assert not np.array_equal(fourth, third)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_bf16_weights_arrays_are_reused_too(fresh_cache, layout):
    ml_dtypes = _bf16_kernel_or_skip()
    x, w = _problem(seed=8)
    if layout == "NCHW":
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        w = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    wb = w.astype(ml_dtypes.bfloat16)

    def call():
        return ttile.conv2d(x, wb, padding=1, layout=layout, threads=2, precision="bf16")

    first, second = call(), call()
    assert fresh_cache.misses == 1 and fresh_cache.hits == 1
    np.testing.assert_array_equal(first, second)
    # the same as the fp32 weights they were rounded from
    np.testing.assert_array_equal(second, ttile.conv2d(x, w, padding=1, layout=layout,
                                                       threads=2, precision="bf16"))
    wb.view(np.uint16).reshape(-1)[wb.size // 2] ^= np.uint16(1 << 3)
    third = call()
    assert fresh_cache.misses == 3   # the fp32 call above was a miss of its own
    np.testing.assert_array_equal(third, ttile.conv2d(
        x, wb.astype(np.float32), padding=1, layout=layout, threads=2, precision="bf16"))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 16384, 16385, 100003])
def test_bf16_same_rounded(n):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not ttile.has_avx512f():
        pytest.skip("the bf16 conversions need AVX-512F")
    a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    bits = a.astype(ml_dtypes.bfloat16).view(np.uint16)
    for threads in (1, 2, 3):
        assert _kernels.bf16_same_rounded(a, bits, threads)
        for i in {0, n // 2, n - 1}:
            changed = bits.copy()
            changed[i] ^= np.uint16(1)
            assert not _kernels.bf16_same_rounded(a, changed, threads)
            below = a.copy()   # a bit the rounding drops: the same values
            below.view(np.uint32)[i] ^= np.uint32(1 << 2)
            assert _kernels.bf16_same_rounded(below, bits, threads) == (
                below.astype(ml_dtypes.bfloat16).view(np.uint16)[i] == bits[i])
    nan = np.full(3, np.nan, np.float32)
    assert _kernels.bf16_same_rounded(nan, nan.astype(ml_dtypes.bfloat16).view(np.uint16), 1)
    with pytest.raises(ValueError):
        _kernels.bf16_same_rounded(a, bits[:-1].copy() if n > 1 else np.zeros(2, np.uint16))
    with pytest.raises(TypeError):
        _kernels.bf16_same_rounded(a, a)
