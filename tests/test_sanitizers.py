"""The extension and run-time-compiled kernels under AddressSanitizer and
UndefinedBehaviorSanitizer.

Builds ttile with ``-C cmake.define.TTILE_SANITIZE=ON`` into a fresh virtual
environment, then runs a representative subset of the test suite there with the
compiler's ASan runtime preloaded into Python and ``TTILE_JIT_CFLAGS`` carrying the same
sanitizers into every kernel compiled by the tests. Any finding aborts that run, and
this test fails with the sanitizer's report. Deselect with ``-m 'not sanitize'``.

Instrumented: the extension module, the hand-written kernels, and every kernel the code
generator emits while the tests run (the run-time tuner's and test_codegen's). The
committed generated kernels (kernels/gen) are compiled as in a release build: the same
generator's output is covered instrumented through those, their bounds by the guard-page
tests, and instrumenting all of them took the build from under 5 minutes to about 20 on
a two-core Zen 4 (``-C cmake.define.TTILE_SANITIZE_GENERATED=ON`` does it by hand).
"""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from ttile.core.cbuild import find_compiler

ROOT = Path(__file__).resolve().parent.parent

#: What runs sanitized: out-of-bounds guards, generated kernels compiled at run time,
#: AVX2 generated kernels, random shapes through every kernel family, the tuned kernels on Fig. 8 layers of
#: moderate size, bad input, one run-time tuning, Conv2d (shared by threads) and plan.
SUBSET = ["tests/test_guard_pages.py", "tests/test_codegen.py", "tests/test_codegen_avx2.py",
          "tests/test_random_shapes.py",
          "tests/test_bad_input.py", "tests/test_fig8_layers.py",
          "tests/test_runtime.py::test_first_call_tunes_and_caches",
          "tests/test_runtime.py::test_plan_reports_a_tuned_kernel_of_the_registry",
          "tests/test_runtime.py::test_conv2d_layer_matches_conv2d",
          "tests/test_runtime.py::test_conv2d_layer_runs_tuned_kernels_on_prepacked_weights",
          "tests/test_runtime.py::test_conv2d_layer_is_safe_to_share_between_threads"]
# (test_guard_pages.py runs the NCHW pointwise and depthwise kernels with every epilogue
# operand; test_semantics.py needs torch, which the sanitized environment does not have)
#: Fig. 8 layers above ~1 GFLOP would only repeat what smaller ones cover, slowly, and
#: MobileNetV3's layers what MobileNetV2's do (the same kernel families and epilogues).
#: The Fig. 8 layers run sanitized on the shipped sets' kernels; their generic-kernel and
#: AVX2-family runs would repeat what test_guard_pages and test_random_shapes run
#: sanitized on both generic kernels. The generic kernel's assembly check runs no code
#: (it reads the compiler's output), and with the ASan runtime preloaded into the
#: compiler too it took 145 s of the 5-minute sanitized run.
DESELECT = "not Yolo9000-0 and not Yolo9000-2 and not Yolo9000-4 and not Yolo9000-23 " \
           "and not ResNet18-1 and not MobileNetV3 " \
           "and not (nhwc_default_kernel and generic) and not avx2_family " \
           "and not stores_vectors_only_to_the_output"


def _asan_runtime(compiler: str) -> str:
    out = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else ""


@pytest.mark.sanitize
def test_subset_runs_clean_under_asan_and_ubsan(tmp_path):
    compiler = find_compiler()
    if compiler is None or not (ROOT / "CMakeLists.txt").exists():
        pytest.skip("needs a compiler and a source checkout")
    libasan = _asan_runtime(compiler)
    if not libasan:
        pytest.skip(f"{compiler} has no AddressSanitizer runtime")
    env_dir = tmp_path / "venv"
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
    build = subprocess.run([*pip, "--no-deps", "-C", "cmake.define.TTILE_SANITIZE=ON",
                            str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
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
    assert str(env_dir) in where.stdout, where.stdout + where.stderr[-2000:]
    run = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "-m", "not slow and not wheel and not sanitize", "-k", DESELECT,
                          *[str(ROOT) + "/" + t for t in SUBSET]],
                         env=env, capture_output=True, text=True, cwd=tmp_path)
    report = run.stdout[-4000:] + run.stderr[-6000:]
    assert run.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report
    print(run.stdout.splitlines()[-1])
