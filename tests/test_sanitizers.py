"""The extension and run-time-compiled kernels under AddressSanitizer and
UndefinedBehaviorSanitizer.

Builds ttile with ``-C cmake.define.TTILE_SANITIZE=ON`` into a fresh virtual
environment, then runs a representative subset of the test suite there with the
compiler's ASan runtime preloaded into Python and ``TTILE_JIT_CFLAGS`` carrying the same
sanitizers into every kernel compiled by the tests. Any finding aborts that run, and
this test fails with the sanitizer's report. Deselect with ``-m 'not sanitize'``.

Instrumented: the extension module, the hand-written kernels of every family this machine
runs (an AVX-512 family it cannot run is compiled at -O0 without the sanitizers,
``-C cmake.define.TTILE_SANITIZE_ALL_FAMILIES=ON`` instruments it anyway), and every
kernel the code generator emits while the tests run (the run-time tuner's and
test_codegen's). The generic kernel applies every epilogue from L1 in this build
(``TTILE_GENERIC_EPILOGUES_FROM_MEMORY``). The build
leaves the committed generated kernels (kernels/gen) out (``TTILE_SHIPPED_KERNELS=OFF``,
an empty registry): the same generator's output is covered instrumented through the
kernels compiled at run time, and the shipped ones' bounds by the guard-page tests in
every build. Compiling them took 200 of the sanitized test's 650 s on two cores (Zen 3),
and instrumenting them takes the build to about 20 minutes
(``-C cmake.define.TTILE_SANITIZE_GENERATED=ON`` does it by hand).
"""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from ttile.core.cbuild import find_compiler

ROOT = Path(__file__).resolve().parent.parent

#: What runs sanitized: out-of-bounds guards, generated kernels compiled at run time
#: (both families), random shapes through every kernel family, bad input, one run-time
#: tuning, Conv2d (shared by threads) and plan. (test_guard_pages.py runs the depthwise,
#: NCHW pointwise and Winograd kernels with every epilogue operand; test_semantics.py
#: needs torch, which the sanitized environment does not have; the tests of the shipped
#: sets need the kernels this build leaves out.)
SUBSET = ["tests/test_guard_pages.py", "tests/test_codegen.py", "tests/test_codegen_avx2.py",
          "tests/test_inverted_residual.py", "tests/test_grouped.py",
          "tests/test_random_shapes.py", "tests/test_bad_input.py",
          "tests/test_runtime.py::test_first_call_tunes_and_caches",
          "tests/test_runtime.py::test_conv2d_layer_matches_conv2d",
          "tests/test_runtime.py::test_conv2d_layer_is_safe_to_share_between_threads"]
#: What CI runs sanitized (the whole subset took 8.4 of CI's 21 minutes on a Xeon model
#: 167): the bounds guards, bad input, the grouped kernel, the fused inverted residual
#: kernel's bounds and
#: reference checks, generated kernels of both thread counts through
#: the code generator's reference check, one run-time tuning and Conv2d. Random shapes
#: and the AVX2 family's generated kernels run sanitized with ``-m slow``.
CI_SUBSET = ["tests/test_guard_pages.py", "tests/test_bad_input.py", "tests/test_grouped.py",
             "tests/test_inverted_residual.py::test_the_fused_block_stays_in_bounds",
             "tests/test_inverted_residual.py::test_the_fused_block_matches_the_float64_reference",
             "tests/test_codegen.py::test_generated_kernel_matches_reference",
             "tests/test_runtime.py::test_first_call_tunes_and_caches",
             "tests/test_runtime.py::test_conv2d_layer_matches_conv2d",
             "tests/test_runtime.py::test_conv2d_layer_is_safe_to_share_between_threads"]
#: The generic kernel's assembly check runs no code (it reads the compiler's output), and
#: with the ASan runtime preloaded into the compiler too it took 145 s of a 5-minute
#: sanitized run. (The guard-page runs of the shipped kernels find none in this build.)
DESELECT = "not stores_vectors_only_to_the_output and not prefetching_its_weights"
#: (the weight prefetch test compares two builds of the same loops; a prefetch reads
#: nothing a sanitizer checks, and the loops run instrumented in the other codegen tests)


def _asan_runtime(compiler: str) -> str:
    out = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else ""


_CI_TEST = "test_subset_runs_clean_under_asan_and_ubsan"
_builds: dict = {}   # test name -> Future of _sanitized_build's answer, started early


def start_in_background(test_name: str) -> None:
    """conftest.py's hook: build the sanitized environment of the CI test (minutes of GCC
    on two cores) while the tests before it run."""
    if test_name != _CI_TEST or test_name in _builds:
        return
    import atexit
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    workdir = Path(tempfile.mkdtemp(prefix="ttile-sanitized-"))
    atexit.register(shutil.rmtree, workdir, True)
    pool = ThreadPoolExecutor(max_workers=1)
    _builds[test_name] = pool.submit(_sanitized_build, workdir)
    pool.shutdown(wait=False)


@pytest.mark.sanitize
def test_subset_runs_clean_under_asan_and_ubsan(tmp_path):
    _run_sanitized(tmp_path, CI_SUBSET, _builds.pop(_CI_TEST, None))


@pytest.mark.slow
@pytest.mark.sanitize
def test_whole_subset_runs_clean_under_asan_and_ubsan(tmp_path):
    _run_sanitized(tmp_path, SUBSET)


def _sanitized_build(workdir: Path):
    """(python of a new environment with ttile built sanitized, its directory, the ASan
    runtime), or (None, why not, None) for a skip; failures raise AssertionError."""
    compiler = find_compiler()
    if compiler is None or not (ROOT / "CMakeLists.txt").exists():
        return None, "needs a compiler and a source checkout", None
    libasan = _asan_runtime(compiler)
    if not libasan:
        return None, f"{compiler} has no AddressSanitizer runtime", None
    env_dir = workdir / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    from importlib.metadata import version
    # The versions this environment tested with; the run-time tuner's libraries too, so
    # JIT kernels are searched, compiled and run under the sanitizers as well.
    deps = subprocess.run([*pip, *(f"{name}=={version(name)}" for name in (
        "numpy", "pytest", "hypothesis", "platformdirs", "islpy-barvinok", "sympy", "scipy"))],
                          capture_output=True, text=True)
    assert deps.returncode == 0, deps.stderr[-3000:]
    # a build folder of its own: the checkout's build/ (pyproject.toml's build-dir) holds
    # the release build, which these flags would recompile from scratch
    build = subprocess.run([*pip, "--no-deps", "-C", "cmake.define.TTILE_SANITIZE=ON",
                            "-C", "cmake.define.TTILE_SHIPPED_KERNELS=OFF",
                            "-C", f"build-dir={workdir / 'build'}", str(ROOT)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return python, str(env_dir), libasan


def _run_sanitized(tmp_path, subset: list[str], build=None) -> None:
    """Runs ``subset`` in the sanitized environment: the one ``build`` (a Future started
    at collection) makes, else one built now in tmp_path."""
    python, env_dir, libasan = (build.result() if build is not None
                                else _sanitized_build(tmp_path))
    if python is None:
        pytest.skip(env_dir)
    env = {**os.environ,
           "LD_PRELOAD": libasan,
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
           "TTILE_JIT_CFLAGS": "-fsanitize=address,undefined -fno-sanitize-recover=all "
                               "-fno-omit-frame-pointer",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    where = subprocess.run([python, "-c", "import ttile._kernels as k; print(k.__file__)"],
                           env=env, capture_output=True, text=True, cwd=tmp_path)
    assert env_dir in where.stdout, where.stdout + where.stderr[-2000:]
    run = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "-m", "not slow and not wheel and not sanitize", "-k", DESELECT,
                          *[str(ROOT) + "/" + t for t in subset]],
                         env=env, capture_output=True, text=True, cwd=tmp_path)
    report = run.stdout[-4000:] + run.stderr[-6000:]
    assert run.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report
    print(run.stdout.splitlines()[-1])
