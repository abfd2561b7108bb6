"""Thread counts: a call uses no more threads than its work keeps busy, a kernel tuned at
N threads serves exactly N, and any count from 1 to 64 computes the right result."""
import numpy as np
import pytest

import ttile
from ttile.core.reference import assert_conv_close
from ttile.runtime import registry
from ttile.core.spec import MIN_FLOPS_PER_THREAD


def test_a_tiny_problem_runs_on_one_thread_however_many_are_asked():
    # K 24, C 12, 9x9, 5x5: 1.2 MFLOP (it ran 11x slower on 16 threads than on one)
    plan = ttile.plan((1, 9, 9, 12), (5, 5, 12, 24), padding=2, layout="NHWC", threads=16)
    assert plan.threads == 1


def test_a_large_problem_keeps_the_threads_it_asks_for():
    plan = ttile.plan((1, 56, 56, 64), (3, 3, 64, 64), padding=1, layout="NHWC", threads=16)
    assert plan.problem.flops // MIN_FLOPS_PER_THREAD >= 16 and plan.threads == 16


def test_a_registry_verdict_serves_only_its_own_thread_count():
    entry = next(e for e in registry.KERNELS if e.threads == 2)
    spec, isa = entry.spec, entry.isa
    with registry.pretend_cpu(entry.cpu):
        assert registry.lookup(spec, 2, isa=isa) is entry
        for threads in (1, 3, 8):
            found = registry.lookup(spec, threads, isa=isa)
            assert found is None or (found.threads == threads and found is not entry)
        assert registry.lookup(spec, 3, isa=isa) is None
        assert registry.lookup(spec, 8, isa=isa) is None


@pytest.mark.parametrize("threads", [1, 3, 7, 16, 64])
def test_any_thread_count_computes_the_right_result(threads):
    rng = np.random.default_rng(threads)
    x = rng.uniform(-1, 1, (2, 31, 29, 20)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 20, 40)).astype(np.float32)
    previous = ttile.set_tuning(mode="never")
    try:
        for layout in ("NHWC", "NCHW"):
            xl = x if layout == "NHWC" else np.ascontiguousarray(x.transpose(0, 3, 1, 2))
            wl = w if layout == "NHWC" else np.ascontiguousarray(w.transpose(3, 2, 0, 1))
            y = ttile.conv2d(xl, wl, padding=1, layout=layout, threads=threads)
            assert_conv_close(y, xl, wl, (1, 1), (1, 1, 1, 1), layout=layout)
    finally:
        ttile.restore_tuning(previous)


@pytest.mark.skipif(not ttile.has_avx512f(), reason="AVX-512F generic kernel")
@pytest.mark.parametrize("threads", [3, 16, 64])
@pytest.mark.parametrize("shape", [(1, 7, 7, 64, 96, 3), (2, 5, 9, 16, 20, 1), (1, 17, 17, 8, 33, 3)])
def test_the_generic_kernel_splits_rows_for_many_threads(shape, threads):
    """Fewer (image, row) tasks than threads: rows are cut into runs of blocks."""
    from ttile import _kernels
    n, h, w_, c, k, r = shape
    rng = np.random.default_rng(threads + r)
    x = rng.uniform(-1, 1, (n, h, w_, c)).astype(np.float32)
    w = rng.uniform(-1, 1, (r, r, c, k)).astype(np.float32)
    packed = _kernels.pack_weights(w, _kernels.generic_panel(k, w_))
    pad = r // 2
    y = np.full((n, h, w_, k), np.nan, np.float32)
    _kernels.conv2d_generic_packed(x, packed, y, 1, 1, pad, pad, threads)
    assert_conv_close(y, x, w, (1, 1), (pad,) * 4)
    y_nchw = np.full((n, k, h, w_), np.nan, np.float32)
    _kernels.conv2d_generic_packed(x, packed, y_nchw, 1, 1, pad, pad, threads, True)
    np.testing.assert_array_equal(y_nchw, y.transpose(0, 3, 1, 2))


@pytest.mark.skipif(not ttile.has_avx512f(), reason="AVX-512F NCHW pointwise kernel")
@pytest.mark.parametrize("threads", [2, 3, 16, 64])
@pytest.mark.parametrize("shape", [(1, 17, 17, 40, 100), (2, 13, 13, 24, 70), (1, 7, 7, 16, 7),
                                   (3, 56, 56, 8, 13)], ids=lambda s: "n{}h{}w{}c{}k{}".format(*s))
def test_the_nchw_pointwise_kernel_splits_channels_and_columns(shape, threads):
    """Few 64-pixel columns for the threads: the work is cut into ranges of output
    channels times ranges of columns (pw_split), each output written exactly once."""
    from ttile import _kernels
    n, h, w_, c, k = shape
    rng = np.random.default_rng(threads + k)
    x = rng.uniform(-1, 1, (n, c, h, w_)).astype(np.float32)
    w = rng.uniform(-1, 1, (k, c, 1, 1)).astype(np.float32)
    y = np.full((n, k, h, w_), np.nan, np.float32)
    _kernels.conv2d_pointwise_nchw(x, w, y, threads)
    assert_conv_close(y, x, w, (1, 1), (0, 0, 0, 0), layout="NCHW")


_DEFAULT_THREADS = ("import os, ttile\n"
                    "from ttile.runtime.arguments import default_threads\n"
                    "print(default_threads(), len(os.sched_getaffinity(0)))")


def _default_threads_in_child(cpus, **env):
    import os
    import subprocess
    import sys
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_PROC_BIND", "OMP_PLACES", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _DEFAULT_THREADS], check=True, text=True,
                         capture_output=True, env={**environment, **env},
                         preexec_fn=lambda: os.sched_setaffinity(0, cpus)).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.parametrize("binding", [{"OMP_PROC_BIND": "true"}, {"OMP_PLACES": "cores"}])
def test_the_default_thread_count_is_every_cpu_when_openmp_binds_the_importing_thread(binding):
    import os
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    threads, affinity_after_import = _default_threads_in_child(cpus, **binding)
    # the runtime bound the importing thread to one CPU; the default still counts them all
    assert affinity_after_import == 1
    assert threads == len(cpus)


@pytest.mark.parametrize("binding", [{}, {"OMP_PROC_BIND": "true"}])
def test_the_default_thread_count_follows_an_affinity_narrowed_before_start(binding):
    import os
    cpus = sorted(os.sched_getaffinity(0))
    assert _default_threads_in_child(cpus[-1:], **binding)[0] == 1
    if len(cpus) >= 2:
        assert _default_threads_in_child(cpus[:2], **binding)[0] == 2


@pytest.mark.skipif(not ttile.has_avx512f(), reason="AVX-512F generic kernel")
@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 14, 14, 40, 200, 1), (2, 9, 11, 24, 70, 3)],
                         ids=["pointwise", "3x3"])
def test_the_generic_kernel_splits_rows_when_all_its_panels_fit_in_l2(shape, threads):
    """Small weights cut into several panel groups (a 8 KB cache blocking): the threads
    take whole rows, each row's groups together, instead of whole groups. Each block sums
    in the same order either way, so every thread count matches one thread exactly, and
    one thread matches the float64 reference."""
    from ttile import _kernels
    if _kernels.cpu_l2_bytes() < (256 << 10):   # the row split needs the panels in 5/8 of it
        pytest.skip("the L2 size is unknown or too small for the row split")
    n, h, w_, c, k, r = shape
    rng = np.random.default_rng(threads * 10 + r)
    x = rng.uniform(-1, 1, (n, h, w_, c)).astype(np.float32)
    w = rng.uniform(-1, 1, (r, r, c, k)).astype(np.float32)
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, (n, h, w_, k)).astype(np.float32)
    packed = _kernels.pack_weights(w, _kernels.generic_panel(k, w_))
    pad = r // 2
    previous = _kernels.set_generic_cache_bytes(8192)
    try:
        plain = {}
        for t in (1, threads):
            plain[t] = np.full((n, h, w_, k), np.nan, np.float32)
            _kernels.conv2d_generic_packed(x, packed, plain[t], 1, 1, pad, pad, t)
            fused = np.full((n, h, w_, k), np.nan, np.float32)
            _kernels.conv2d_generic_packed(x, packed, fused, 1, 1, pad, pad, t, bias=bias,
                                           residual=residual, activation=1)
            np.testing.assert_allclose(fused, np.maximum(plain[t] + bias + residual, 0),
                                       rtol=1e-5, atol=1e-5)
            nchw = np.full((n, k, h, w_), np.nan, np.float32)
            _kernels.conv2d_generic_packed(x, packed, nchw, 1, 1, pad, pad, t, True)
            np.testing.assert_array_equal(nchw, plain[t].transpose(0, 3, 1, 2))
        # the other blockings a context verdict weighs: whole groups per thread (the
        # same sums), and groups of half the cache blocking
        groups_first = np.full((n, h, w_, k), np.nan, np.float32)
        _kernels.conv2d_generic_packed(x, packed, groups_first, 1, 1, pad, pad, threads,
                                       blocking=_kernels.GENERIC_GROUPS_FIRST)
        small = np.full((n, h, w_, k), np.nan, np.float32)
        _kernels.conv2d_generic_packed(x, packed, small, 1, 1, pad, pad, threads,
                                       blocking=_kernels.GENERIC_SMALL_GROUPS
                                       | _kernels.GENERIC_GROUPS_FIRST)
        with pytest.raises(ValueError, match="blocking"):
            _kernels.conv2d_generic_packed(x, packed, small, 1, 1, pad, pad, threads,
                                           blocking=8)
    finally:
        _kernels.set_generic_cache_bytes(previous)
    assert_conv_close(plain[1], x, w, (1, 1), (pad,) * 4)
    np.testing.assert_array_equal(plain[threads], plain[1])
    np.testing.assert_array_equal(groups_first, plain[1])
    assert_conv_close(small, x, w, (1, 1), (pad,) * 4)


def _generic_epilogue_case(isa_code: str, k: int, epilogue: str, h: int, w: int, c: int):
    """(isa, x, w, bias, residual, activation) of a 3x3 layer, padding 1, on an h x w x c
    input with k outputs, for the generic kernel of ``isa_code`` (skips a family this CPU
    does not run) and ``epilogue``: "none", "bias_relu", "bias_residual_relu" or "silu"."""
    from ttile import _kernels
    from ttile.core.kinds import Activation
    if isa_code == "avx512f" and not ttile.has_avx512f() or not ttile.has_avx2():
        pytest.skip(f"this CPU does not run the {isa_code} family")
    isa = _kernels.ISA_AVX512F if isa_code == "avx512f" else _kernels.ISA_AVX2
    rng = np.random.default_rng(k)
    x = rng.uniform(-1, 1, (1, h, w, c)).astype(np.float32)
    weights = rng.uniform(-1, 1, (3, 3, c, k)).astype(np.float32)
    bias = rng.uniform(-1, 1, k).astype(np.float32) if epilogue != "none" else None
    residual = rng.uniform(-1, 1, (1, h, w, k)).astype(np.float32) \
        if "residual" in epilogue else None
    act = {"none": Activation.NONE, "silu": Activation.SILU}.get(epilogue, Activation.RELU)
    return isa, x, weights, bias, residual, act


def _expected_f64(x, w, bias, residual, act):
    """act(conv + bias + residual) in float64, padding 1."""
    from ttile.core.reference import activate_f64, conv2d_nhwc_f64
    expected = conv2d_nhwc_f64(x, w, pads=(1, 1, 1, 1))
    if bias is not None:
        expected = expected + bias
    if residual is not None:
        expected = expected + residual
    return activate_f64(expected, act)


@pytest.mark.parametrize("isa_code", ["avx512f", "avx2"])
@pytest.mark.parametrize("k", [32, 40])
@pytest.mark.parametrize("epilogue", ["none", "bias_relu", "bias_residual_relu", "silu"])
def test_generic_outputs_past_the_last_level_cache_are_stored_around_it(isa_code, k,
                                                                        epilogue):
    """An NHWC output larger than ``generic_stream_bytes`` (the last-level cache) is
    written with non-temporal stores by the blocks' last stores: made small here, so
    that a small layer takes that path. The output equals the one stored plainly, bit for
    bit, and the float64 reference; an output channel count off the vector width, and an
    epilogue applied from memory after the stores (SiLU), are stored plainly."""
    from ttile import _kernels
    isa, x, w, bias, residual, act = _generic_epilogue_case(isa_code, k, epilogue, 23, 19, 12)
    packed = _kernels.pack_weights(w, _kernels.generic_panel(k, 19, isa))
    outputs = []
    for stream_bytes in (1 << 40, 1024):
        previous = _kernels.set_generic_stream_bytes(stream_bytes)
        try:
            for threads in (1, 2, 3):
                y = _kernels.empty_aligned((1, 23, 19, k))
                y[...] = np.nan
                _kernels.conv2d_generic_packed(x, packed, y, 1, 1, 1, 1, threads, isa=isa,
                                               bias=bias, residual=residual,
                                               activation=act.code)
                outputs.append(y)
        finally:
            _kernels.set_generic_stream_bytes(previous)
    for y in outputs[1:]:
        np.testing.assert_array_equal(y, outputs[0])
    expected = _expected_f64(x, w, bias, residual, act)
    np.testing.assert_allclose(outputs[0], expected, rtol=1e-4, atol=1e-4)
    assert _kernels.set_generic_stream_bytes(0) == _kernels.generic_stream_bytes() > 0


@pytest.mark.parametrize("isa_code", ["avx512f", "avx2"])
@pytest.mark.parametrize("k", [48, 80])
@pytest.mark.parametrize("epilogue", ["none", "bias_relu", "bias_residual_relu", "silu"])
def test_generic_direct_weights_anywhere_in_a_line_give_the_same_bits(isa_code, k, epilogue):
    """RSCK weights larger than the cache blocking, on a small output, are read where
    they are (the generic kernel's direct path), slab by slab, each task asking for the
    next panel's columns meanwhile; AVX-512's panels then start on the weights' cache
    lines, the lanes outside [0, K) masked. Made small here (16 KB of cache blocking:
    slabs of 11 or 18 channels), with the weights at every float offset in a line: the
    output is the same bit for bit as on weights on a line, at 1, 2 and 3 threads, with
    epilogues in registers and from memory, and matches the float64 reference."""
    from ttile import _kernels
    isa, x, w, bias, residual, act = _generic_epilogue_case(isa_code, k, epilogue, 7, 7, 40)
    lines = _kernels.empty_aligned((w.size + 16,))
    outputs = {}
    previous = _kernels.set_generic_cache_bytes(16 << 10)
    try:
        for offset in range(16):
            placed = lines[offset:offset + w.size].reshape(w.shape)
            placed[...] = w
            for threads in (1, 2, 3):
                y = np.full((1, 7, 7, k), np.nan, np.float32)
                _kernels.conv2d_generic_packed(x, placed, y, 1, 1, 1, 1, threads, isa=isa,
                                               bias=bias, residual=residual,
                                               activation=act.code)
                outputs[offset, threads] = y
    finally:
        _kernels.set_generic_cache_bytes(previous)
    expected = _expected_f64(x, w, bias, residual, act)
    for (offset, threads), y in outputs.items():   # (the slabs follow the thread count)
        np.testing.assert_array_equal(y, outputs[0, threads],
                                      err_msg=f"offset {offset}, {threads} threads")
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
