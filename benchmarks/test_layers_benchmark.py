"""The per-layer benchmarks as a pytest-benchmark suite: one group per layer and thread
count, ttile's ways (per call and pre-packed, NHWC and NCHW) beside torch's three.

    python -m pytest benchmarks --benchmark-only                      # every Fig. 8 layer
    TTILE_BENCH_THREADS=2 python -m pytest benchmarks --benchmark-only -k ResNet18
    python -m pytest benchmarks --benchmark-only --benchmark-json=out.json

Not part of the test suite (``testpaths`` is ``tests``); needs the ``bench`` extra.
``TTILE_BENCH_THREADS`` sets the thread count (default 1, ``all`` for every CPU this
process may use). Each contender is checked against torch before it is timed. The
paired-ratio tables of ``bench_conv.py`` remain the reference for claims: pytest-benchmark
times each contender in its own block of rounds, so machine drift between blocks shows
in its comparisons.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark")

import ttile  # noqa: E402
from ttile.generator.networks import ALL_LAYERS  # noqa: E402

_env = os.environ.get("TTILE_BENCH_THREADS", "1")
THREADS = len(os.sched_getaffinity(0)) if _env == "all" else int(_env)
WAYS = ("ttile conv2d NHWC", "ttile Conv2d NHWC", "ttile conv2d NCHW", "ttile Conv2d NCHW",
        "torch NCHW", "torch channels_last", "torch mkldnn")


@functools.lru_cache(maxsize=1)
def _tensors(name: str):
    layer = next(l for l in ALL_LAYERS if l.name == name)
    spec = layer.spec()
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, spec.c, spec.h, spec.w)).astype(np.float32)
    w = rng.uniform(-1, 1, (spec.k, spec.c, spec.r, spec.s)).astype(np.float32)
    with torch.no_grad():
        expected = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w),
                                              stride=layer.stride, padding=layer.rs // 2).numpy()
    return layer, x, w, expected


def _contender(layer, x, w, way: str):
    """The call to time, and a function bringing its result to NCHW numpy for checking."""
    import torch.utils.mkldnn  # noqa: F401
    pad, stride = layer.rs // 2, layer.stride
    x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w_rsck = np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    to_nchw = lambda y: y.transpose(0, 3, 1, 2)  # noqa: E731
    same = lambda y: y  # noqa: E731
    if way == "ttile conv2d NHWC":
        return lambda: ttile.conv2d(x_nhwc, w_rsck, stride=stride, padding=pad, layout="NHWC",
                                    threads=THREADS), to_nchw
    if way == "ttile Conv2d NHWC":
        layer_nhwc = ttile.Conv2d(w_rsck, stride=stride, padding=pad, layout="NHWC",
                                  threads=THREADS)
        return lambda: layer_nhwc(x_nhwc), to_nchw
    if way == "ttile conv2d NCHW":
        return lambda: ttile.conv2d(x, w, stride=stride, padding=pad, threads=THREADS), same
    if way == "ttile Conv2d NCHW":
        layer_nchw = ttile.Conv2d(w, stride=stride, padding=pad, layout="NCHW",
                                  threads=THREADS)
        return lambda: layer_nchw(x), same
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    if way == "torch NCHW":
        return (lambda: torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad),
                lambda y: y.numpy())
    if way == "torch channels_last":
        xc = xt.to(memory_format=torch.channels_last)
        wc = wt.to(memory_format=torch.channels_last)
        return (lambda: torch.nn.functional.conv2d(xc, wc, stride=stride, padding=pad),
                lambda y: y.contiguous().numpy())
    module = torch.nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], stride=stride, padding=pad,
                             bias=False)
    with torch.no_grad():
        module.weight.copy_(wt)
    packed, xm = torch.utils.mkldnn.to_mkldnn(module.eval()), xt.to_mkldnn()
    return lambda: packed(xm), lambda y: y.to_dense().numpy()


@pytest.fixture(scope="module", autouse=True)
def _setup():
    torch.set_num_threads(THREADS)
    previous = ttile.set_tuning(mode="never")  # what the wheel ships
    yield
    ttile.restore_tuning(previous)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("layer_name", [l.name for l in ALL_LAYERS])
def test_layer(benchmark, layer_name, way):
    layer, x, w, expected = _tensors(layer_name)
    call, as_nchw = _contender(layer, x, w, way)
    with torch.no_grad():
        got = as_nchw(call())
        scale = np.abs(expected).max() + 1e-30
        assert np.abs(got - expected).max() / scale < 1e-4, f"{way} differs from torch"
        benchmark.group = f"{layer_name} t{THREADS}"
        benchmark.extra_info["gflops_per_call"] = layer.spec().flops / 1e9
        benchmark(call)
