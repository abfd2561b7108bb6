"""Kernel families by ISA: AVX-512F, AVX2 + FMA and portable C, chosen by cpuid at run
time, forced with ``ttile.set_isa`` or $TTILE_ISA. (Each family's numerics are checked
by the isa-parametrized tests: semantics, random shapes, guard pages, concurrency.)"""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import ttile
from conftest import AVAILABLE_ISAS
from ttile import _kernels
from ttile.core.reference import conv2d_nhwc_f64

needs_avx2 = pytest.mark.skipif("avx2" not in AVAILABLE_ISAS,
                                reason="this CPU (or OS) does not run AVX2 + FMA")


def test_auto_picks_the_widest_family_the_cpu_runs():
    previous = ttile.set_isa("auto")
    try:
        expected = "avx512f" if ttile.has_avx512f() else "avx2" if ttile.has_avx2() \
            else "portable"
        assert ttile.get_isa() == expected
    finally:
        ttile.set_isa(previous)
    if ttile.has_avx512f():
        assert ttile.has_avx2()   # every AVX-512F CPU ttile knows has AVX2 and FMA too


@needs_avx2
def test_forced_avx2_serves_its_generic_kernel_with_its_own_panels(no_winograd):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, 13, 11, 40)).astype(np.float32)    # NHWC
    w = rng.uniform(-1, 1, (3, 3, 40, 36)).astype(np.float32)     # RSCK, K not a multiple of 8
    previous = ttile.set_isa("avx2")
    try:
        plan = ttile.plan(x.shape, w.shape, padding=1, layout="NHWC", threads=1)
        assert plan.isa == "avx2" and plan.kind == "generic"
        conv = ttile.Conv2d(w, padding=1, layout="NHWC", threads=2)
        y = conv(x)
    finally:
        ttile.set_isa(previous)
    np.testing.assert_allclose(y, conv2d_nhwc_f64(x, w, (1, 1), (1, 1, 1, 1)),
                               rtol=1e-4, atol=1e-4)
    # panels of 8 floats per vector: 36 channels in 2-vector blocks are panels of 16
    assert _kernels.generic_panel(36, 11, _kernels.ISA_AVX2) % 8 == 0
    assert _kernels.generic_panel(36, 11, _kernels.ISA_AVX2) <= 24


def _isa_in_subprocess(value):
    env = dict(os.environ, TTILE_ISA=value)
    return subprocess.run([sys.executable, "-c", "import ttile; print(ttile.get_isa())"],
                          env=env, capture_output=True, text=True)


def test_environment_variable_forces_a_family():
    result = _isa_in_subprocess("portable")
    assert result.returncode == 0 and result.stdout.strip() == "portable", result.stderr
    if "avx2" in AVAILABLE_ISAS:
        result = _isa_in_subprocess("avx2")
        assert result.stdout.strip() == "avx2", result.stderr
    result = _isa_in_subprocess("sse9")
    assert result.returncode != 0 and "TTILE_ISA='sse9'" in result.stderr


def test_vector_kernels_refuse_a_family_the_cpu_lacks(monkeypatch):
    from ttile.runtime import settings
    monkeypatch.setattr(settings, "_HAS_AVX2", False)
    with pytest.raises(ValueError, match="does not support AVX2"):
        ttile.set_isa("avx2")
    with pytest.raises(ValueError, match="no vector generic kernel"):
        _kernels.generic_panel(16, 7, _kernels.ISA_PORTABLE)


ROOT = Path(__file__).resolve().parent.parent


def _no_avx512(listing: str, where: str) -> None:
    assert "%ymm" in listing, f"{where}: no AVX instruction at all?"
    found = re.search(r".*(%zmm|\{%k[1-7]\}|%k[1-7]\b).*", listing)
    assert found is None, f"{where}: {found.group(0)}"


def _avx2_sources() -> list[str]:
    """The AVX2 family's sources as CMakeLists.txt lists them (its variables expanded,
    the generated AVX2 kernels by name), checking that they get the AVX2 flags only."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    lists = {name: body.split() for name, body in re.findall(r"set\((\w+) ([^)]*)\)", cmake)}
    sources = lists["avx2_sources"]
    assert "${generated_avx2}" in sources   # the searched AVX2 kernels, by their names
    expanded = []
    for source in sources:
        variable = re.fullmatch(r"\$\{(\w+)\}", source)
        if variable is None:
            expanded.append(source)
        elif variable.group(1) != "generated_avx2":
            expanded.extend(lists[variable.group(1)])
    expanded += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kernels" / "gen").glob("*__avx2.c"))
    flags = re.search(r"\$\{avx2_sources\} PROPERTIES COMPILE_OPTIONS \"([^\"]*)\"",
                      cmake).group(1).split(";")
    assert flags == ["-mavx2", "-mfma"]
    return expanded


def _functions_of(sources: list[str]):
    """The installed extension's functions compiled from ``sources`` (the static ones
    after each source's FILE symbol, the others by their family suffix: ``_avx2``,
    ``__avx2``) and how many sources it was built from; None where the extension keeps no
    symbols. The generated kernels are compiled several to a unit (``avx2_<n>.c``,
    CMakeLists.txt's ttile_generated_units), so each is looked for by its function."""
    import extension_code
    handwritten = {Path(s).name for s in sources if not Path(s).name.startswith("ttile_f32_conv2d_")}
    generated = {Path(s).stem for s in sources if Path(s).name.startswith("ttile_f32_conv2d_")}
    symbols = extension_code.functions(
        lambda unit: unit in handwritten or re.fullmatch(r"avx2_\d+\.c", unit) is not None,
        lambda name: re.search(r"_avx2(\.|$)", name) is not None)
    if symbols is None:
        return None
    missing = handwritten - symbols.units
    assert not missing, f"AVX2 sources with no FILE symbol in the extension: {sorted(missing)}"
    names = {function.name for function in symbols.functions}
    # A build holds the generated kernels of the sets it compiles (TTILE_KERNEL_SETS,
    # CMakeLists.txt), every one of them checked here; one that a compiled verdict names
    # must be there.
    from ttile.runtime import registry
    held = generated & names
    if any(e.compiled and e.isa is ttile.Isa.AVX2 and e.kind is ttile.KernelKind.TUNED
           for e in registry.ENTRIES):
        assert held, "no generated AVX2 kernel found in the extension, yet it holds some"
    return symbols.functions, len(handwritten) + len(held)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
@pytest.mark.skipif(not (ROOT / "kernels" / "generic_avx2.c").exists(),
                    reason="not a source checkout")
def test_the_avx2_family_contains_no_avx512_instruction(tmp_path):
    """The AVX2 sources (the generated AVX2 kernels included), as the extension was built
    from them with the flags CMakeLists.txt gives them, hold no zmm or opmask register (a
    CPU without AVX-512 would fault on one). Read from the extension's own machine code,
    function by function (pyproject.toml keeps its symbols); a stripped extension's
    sources are compiled instead."""
    import extension_code
    sources = _avx2_sources()
    found = _functions_of(sources)
    if found is None:
        if shutil.which("cc") is None:
            pytest.skip("a stripped extension, and no compiler to build its sources")
        _compile_and_check(sources, tmp_path)
        return
    ranges, built_from = found
    assert len(ranges) > built_from, "too few AVX2 functions found: not this layout?"
    vector_functions = 0
    for function in ranges:
        listing = extension_code.disassembly(function)
        avx512 = re.search(r".*(%zmm|\{%k[1-7]\}|%k[1-7]\b).*", listing)
        assert avx512 is None, f"{function.name}: {avx512.group(0)}"
        vector_functions += "%ymm" in listing
    # the kernels themselves: every generic block and searched kernel is AVX code
    assert vector_functions >= built_from, "no AVX instructions: not the AVX2 family?"


def _compile_and_check(sources: list[str], tmp_path) -> None:
    flags = ["-mavx2", "-mfma"]
    def check(source):
        # -O1: the vector flags decide which instructions exist, not the optimisation
        # level (at -O3, compiling them one by one took 85 s of the test suite)
        obj = tmp_path / (Path(source).stem + ".o")
        subprocess.run(["cc", "-O1", "-fopenmp", "-fno-math-errno", *flags,
                        "-I", str(ROOT / "kernels"), "-c", str(ROOT / source), "-o", str(obj)],
                       check=True)
        _no_avx512(subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)],
                                  capture_output=True, text=True, check=True).stdout, source)
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        list(pool.map(check, sources))


def test_generic_cache_blocking_follows_this_cores_l2():
    """Half the L2 that cpuid reports, at most 512 KiB; settable, and 0 restores it."""
    l2 = _kernels.cpu_l2_bytes()
    default = _kernels.generic_cache_bytes()
    assert default == (min(l2 // 2, 512 << 10) if l2 >= 128 << 10 else 512 << 10)
    previous = _kernels.set_generic_cache_bytes(64 << 10)
    try:
        assert previous == default and _kernels.generic_cache_bytes() == 64 << 10
    finally:
        _kernels.set_generic_cache_bytes(0)
    assert _kernels.generic_cache_bytes() == default
    with pytest.raises(ValueError):
        _kernels.set_generic_cache_bytes(-1)


@pytest.mark.parametrize("isa_name", [i for i in AVAILABLE_ISAS if i != "portable"])
def test_every_cache_blocking_gives_the_reference_result(isa_name, no_winograd):
    """Small blockings split the reduction into many chunks and the panels into many
    groups (64 KiB: 4 chunks of 3x3x64-channel steps here); each gives the float64
    reference's result."""
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, (1, 9, 10, 200)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 200, 72)).astype(np.float32)
    expected = conv2d_nhwc_f64(x, w, (1, 1), (1, 1, 1, 1))
    previous = ttile.set_isa(isa_name)
    try:
        for nbytes in (16 << 10, 64 << 10, 0):
            _kernels.set_generic_cache_bytes(nbytes)
            y = ttile.conv2d(x, w, padding=1, layout="NHWC", threads=2)
            np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    finally:
        _kernels.set_generic_cache_bytes(0)
        ttile.set_isa(previous)


@pytest.mark.parametrize("isa_name", [i for i in AVAILABLE_ISAS if i != "portable"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_small_outputs_read_rsck_weights_in_place_and_match_the_reference(isa_name, threads,
                                                                           no_winograd):
    """A per-call NHWC conv2d on a small output (at most 64 pixels, one register block per
    row) whose weights exceed the cache blocking reads RSCK where it is, in channel slabs
    whose partial sums wait in the output: slabs of every size (the last one short),
    images and panels shared among threads, the epilogue (bias, residual, relu) applied
    once, after the last slab. A 3x3 layer (AVX2's 4-pixel blocks take two per row there,
    so it packs) and a strided 1x1 one, K a multiple of the vector width, against float64."""
    rng = np.random.default_rng(11)
    cases = [((2, 7, 7, 50), (3, 3, 50, 96), 1, 1), ((1, 12, 11, 130), (1, 1, 130, 64), 2, 0)]
    previous = ttile.set_isa(isa_name)
    try:
        for x_shape, w_shape, stride, pad in cases:
            x = rng.uniform(-1, 1, x_shape).astype(np.float32)
            w = rng.uniform(-1, 1, w_shape).astype(np.float32)
            conv = conv2d_nhwc_f64(x, w, (stride, stride), (pad, pad, pad, pad))
            bias = rng.uniform(-1, 1, w_shape[3]).astype(np.float32)
            residual = rng.uniform(-1, 1, conv.shape).astype(np.float32)
            for nbytes in (8 << 10, 24 << 10, 64 << 10):   # 3x3: slabs of 8 to 50 channels
                _kernels.set_generic_cache_bytes(nbytes)
                y = ttile.conv2d(x, w, stride=stride, padding=pad, layout="NHWC",
                                 threads=threads)
                np.testing.assert_allclose(y, conv, rtol=1e-4, atol=1e-4)
                y = ttile.conv2d(x, w, bias, stride=stride, padding=pad, layout="NHWC",
                                 threads=threads, residual=residual, activation="relu")
                expected = np.maximum(conv + bias + residual, 0)
                np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    finally:
        _kernels.set_generic_cache_bytes(0)
        ttile.set_isa(previous)
