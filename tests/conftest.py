import os

import numpy as np
import pytest

import ttile

# Tests must not tune on the first call of every shape, nor touch the user's cache:
# tuning is off unless a test turns it on (with its own cache directory).
_SESSION_POLICY = ttile.set_tuning(mode="never")

# TTILE_TEST_AS_CPU=<fingerprint id> runs the suite as if this machine were that CPU for
# the registry (e.g. a stranger the wheel ships no set for: the user's usual case), to
# check that the tests of the shipped sets run and assert there too.
if os.environ.get("TTILE_TEST_AS_CPU"):
    from ttile.runtime import registry as _registry
    _registry._serving_cpu = os.environ["TTILE_TEST_AS_CPU"]

def pytest_collection_finish(session):
    """Lets test modules start their long compiles as soon as the run knows it needs them:
    a module's ``start_in_background(test_name)`` runs for each of its collected tests.
    The sanitized build (minutes of GCC) and any hand-written kernel's assembly that the
    installed extension cannot show (test_codegen.py) then overlap the tests that run
    before the ones reading them."""
    started = set()
    for item in session.items:
        module = getattr(item, "module", None)
        start = getattr(module, "start_in_background", None)
        name = getattr(item, "originalname", None) or item.name
        if start is not None and (module, name) not in started:
            started.add((module, name))
            start(name)


requires_avx512 = pytest.mark.skipif(not ttile.has_avx512f(),
                                     reason="this CPU (or OS) does not support AVX-512F")
requires_avx2 = pytest.mark.skipif(not ttile.has_avx2(),
                                   reason="this CPU (or OS) does not support AVX2 + FMA")

#: Kernel families a test can run on this machine (an AVX-512 machine runs the AVX2
#: family too: ttile.set_isa("avx2")).
AVAILABLE_ISAS = (["portable"] + (["avx2"] if ttile.has_avx2() else [])
                  + (["avx512f"] if ttile.has_avx512f() else []))


@pytest.fixture
def isa(request):
    """Run the test body with ttile dispatching to the requested kernel family."""
    previous = ttile.set_isa(request.param)
    yield request.param
    ttile.set_isa(previous)


@pytest.fixture
def no_winograd(monkeypatch):
    """The Winograd kernel off (in this process and the processes a test starts), for
    tests of the direct kernels' machinery - registry, run-time tuning, weight packing -
    on the 3x3 stride-1 shapes it would otherwise serve (tests/test_winograd.py tests it)."""
    monkeypatch.setenv("TTILE_WINOGRAD", "0")
    previous = ttile.use_winograd(False)
    yield
    ttile.use_winograd(previous)


def random_tensors(rng: np.random.Generator, x_shape, w_shape):
    x = rng.uniform(-1.0, 1.0, x_shape).astype(np.float32)
    w = rng.uniform(-1.0, 1.0, w_shape).astype(np.float32)
    return x, w


@pytest.fixture
def jit_cache(tmp_path):
    """Run-time tuning on ("now", short budget, every size), into a fresh cache directory;
    the previous policy and the process's remembered choices are restored afterwards."""
    from ttile.runtime import dispatch
    previous = ttile.set_tuning(mode="now", budget_seconds=4.0, min_mflops=0.0,
                                cache_dir=tmp_path / "cache")
    forget_choices()
    yield tmp_path / "cache"
    dispatch.wait_for_background(60)
    ttile.restore_tuning(previous)
    forget_choices()


def forget_choices():
    """Forget which kernel serves each problem (dispatch's memory and every call plan's),
    so the next call decides again: after a test changed the tuning policy, the cache or
    the CPU whose registry verdicts serve."""
    from ttile.runtime import call_plan, dispatch
    dispatch.forget_choices()
    call_plan.forget_choices()


def shipped_cpu(isa=None) -> str:
    """The CPU whose shipped kernel set the registry tests exercise: this CPU's own when
    the wheel carries one (with verdicts in ``isa``, default AVX-512F), else the shipped
    set with the most searched kernels in that family. A kernel searched on one CPU
    computes the same result on any CPU of its vector family, so the registry path (lookup,
    dispatch, packing, the tuned kernels themselves) is tested on every CPU that runs the
    family, not only on the machines the sets were searched on."""
    from collections import Counter
    from ttile.runtime import registry
    isa = isa or ttile.Isa.AVX512F
    here = registry.serving_cpu()
    if any(e.cpu == here and e.isa is isa for e in registry.KERNELS):
        return here
    counts = Counter(e.cpu for e in registry.KERNELS if e.isa is isa)
    assert counts, f"the wheel ships no {isa.value} kernel set"
    return counts.most_common(1)[0][0]


@pytest.fixture
def shipped_set():
    """Serve calls from :func:`shipped_cpu`'s set for the test's duration; yields its id."""
    from ttile.runtime import registry
    if not ttile.has_avx512f():
        pytest.skip("the shipped AVX-512F sets need an AVX-512F CPU")
    cpu = shipped_cpu()
    forget_choices()
    with registry.pretend_cpu(cpu):
        yield cpu
    forget_choices()
