"""Generated kernels: loop structure (golden), register use, and results vs float64.

Each case is a (problem, scheme) pair chosen to exercise one feature of the generator:
lambda-seq composition, K tails by masks, strides, asymmetric and large padding, the
three parallel strategies of the paper's section 5.5, partial reductions around the
accumulators, unrolls over c/r/s/n, and a k loop inside the reduction band.
"""
import re
from typing import Optional

import numpy as np
import pytest

import ttile

from ttile.core.cbuild import EpilogueArgs, assembly, build, find_compiler
from ttile.core import codegen
from ttile.core.codegen import generate, kernel_name
from ttile.core.kinds import Isa
from ttile.core.scheme import Scheme
from ttile.core.spec import ConvSpec
from conftest import random_tensors, requires_avx512
from ttile.core.reference import assert_conv_close
from ttile.runtime.scratch import aligned_empty

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler on PATH")


def same(n, k, c, hw, rs, stride=1, w=None):
    pad = rs // 2
    return ConvSpec(n, k, c, hw, w or hw, rs, rs, stride, stride, pad, pad, pad, pad)


CASES = {
    # The paper's Yolo9000-13 scheme shape on a smaller problem: 17 = 8 + 9 along h.
    "lseq": (same(1, 64, 32, 17, 3),
             "[T2 k; Lseq h [(1,8),(1,9)]; T17 w; T3 r; T3 s; T32 c; U beta h; U2 k; V k]"),
    # Two parametric levels: 34 = 2*11 + 12, with T1 loops as in the paper's example.
    "lseq_paper": (same(1, 64, 16, 34, 3),
                   "[T2 k; T1 h; Lseq h [(2,11),(1,12)]; T17 w; T1 h; T1 h; T3 s; T3 r; "
                   "T2 w; T16 c; U beta h; U2 k; V k]"),
    # K = 40: three vectors, the last one masked.
    "k_tail": (same(1, 40, 16, 10, 3), "[T3 k; T5 h; T10 w; T3 r; T3 s; T16 c; U2 h; V k]"),
    "k_tail_unrolled": (same(1, 21, 5, 9, 3),
                        "[T9 h; T3 w; T3 r; T3 s; T5 c; U3 w; U2 k; V k]"),
    # ResNet18-1 in miniature: 7x7, stride 2, pad 3, three input channels.
    "stride2_7x7": (same(1, 16, 3, 20, 7, stride=2),
                    "[T10 h; T2 w; T7 r; T7 s; T3 c; U5 w; V k]"),
    "stride3_valid": (ConvSpec(1, 32, 8, 17, 14, 2, 3, 3, 2),
                      "[T2 k; T6 h; T6 w; T2 r; T3 s; T8 c; U1 h; V k]"),
    "asymmetric_pad": (ConvSpec(1, 16, 4, 9, 8, 4, 2, pad_top=1, pad_bottom=2,
                                pad_left=0, pad_right=1),
                       "[T9 h; T8 w; T4 r; T2 s; T4 c; V k]"),
    # Parallel strategy 1: the largest band of non-reduction loops, collapsed.
    "parallel_band": (same(1, 32, 16, 10, 3),
                      "[PT2 k; PT5 h; T2 w; T3 r; T3 s; T16 c; U2 h; U5 w; V k]"),
    # Strategy 2: reductions innermost, everything above collapsed.
    "parallel_reductions_inner": (same(2, 32, 16, 10, 3),
                                  "[PR n; PT5 h; PT2 w; PT2 k; T3 r; T3 s; T16 c; U2 h; U5 w; V k]"),
    # Strategy 3: reductions outermost, the rest collapsed below them.
    "parallel_reductions_outer": (same(1, 32, 16, 10, 3),
                                  "[T3 r; T3 s; PT2 k; PT5 h; PT2 w; T16 c; U2 h; U5 w; V k]"),
    "r_and_batch": (ConvSpec(2, 32, 32, 8, 8, 1, 1), "[R n; R k; R h; R w; T32 c; U4 w; V k]"),
    "unroll_rsc": (same(1, 64, 16, 8, 3),
                   "[T4 k; T8 h; T2 w; T8 c; U3 r; U3 s; U2 c; U4 w; V k]"),
    "k_inside_c": (same(1, 32, 16, 16, 3, w=8),
                   "[T8 h; T8 w; T3 r; T3 s; T16 c; T2 k; U2 h; V k]"),
    "unroll_n": (same(2, 16, 8, 4, 3), "[T2 h; T4 w; T3 r; T3 s; T8 c; U2 n; U2 h; V k]"),
}


@requires_avx512
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_kernel_matches_reference(case, threads):
    spec, text = CASES[case]
    kernel = generate(Scheme.parse(text), spec)
    library = build([kernel])
    rng = np.random.default_rng(7)
    x, w = random_tensors(rng, (spec.n, spec.h, spec.w, spec.c), (spec.r, spec.s, spec.c, spec.k))
    y = np.full((spec.n, spec.ho, spec.wo, spec.k), np.nan, dtype=np.float32)
    library.run(kernel, x, w, y, nthreads=threads)
    assert_conv_close(y, x, w, (spec.stride_h, spec.stride_w),
                      (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right))


@requires_avx512
@pytest.mark.parametrize("case", ["lseq", "unroll_rsc", "k_inside_c"])
def test_a_kernel_prefetching_its_weights_computes_the_same_bits(case):
    spec, text = CASES[case]
    plain = generate(Scheme.parse(text), spec)
    ahead = generate(Scheme.parse(text), spec, weight_prefetch=True)
    assert ahead.name != plain.name and "_mm_prefetch" in ahead.code
    assert "_mm_prefetch" not in plain.code
    library = build([plain, ahead])
    rng = np.random.default_rng(11)
    x, w = random_tensors(rng, (spec.n, spec.h, spec.w, spec.c), (spec.r, spec.s, spec.c, spec.k))
    outputs = []
    for kernel in (plain, ahead):
        y = np.full((spec.n, spec.ho, spec.wo, spec.k), np.nan, dtype=np.float32)
        library.run(kernel, x, w, y, nthreads=2)
        outputs.append(y)
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_weight_prefetch_asks_for_each_line_once_per_step():
    spec = CASES["unroll_rsc"][0]   # K 64
    text = "[T2 k; T8 h; T4 w; T8 c; U3 r; U3 s; U2 c; U2 w; U2 k; V k]"
    code = _nhwc_code(generate(Scheme.parse(text), spec, weight_prefetch=True))
    # two 64-byte vectors per step: a prefetch each
    assert code.count("_mm_prefetch((const char *)(w + ") == code.count("const __m512 wv") > 0
    text = "[T4 k; T8 h; T4 w; T8 c; U3 r; U3 s; U2 c; U2 w; U2 k; V k]"
    avx2 = _nhwc_code(generate(Scheme.parse(text), spec, isa=Isa.AVX2, weight_prefetch=True))
    # AVX2 vectors are half a line: one prefetch per two weight loads
    assert 2 * avx2.count("_mm_prefetch((const char *)(w + ") == avx2.count("const __m256 wv") > 0


def _loop_trip_counts(code: str) -> list[int]:
    return [int(m) for m in re.findall(r"for \(int i\d+ = 0; i\d+ < (\d+);", code)]


def _nhwc_code(kernel) -> str:
    """The NHWC kernel's part of a generated unit (its NCHW entry point follows it)."""
    code = kernel.code
    return code[:code.index("/* NCHW output")] if kernel.nchw_name else code


def test_golden_loop_structure_of_lseq_scheme():
    spec, text = CASES["lseq"]
    code = _nhwc_code(generate(Scheme.parse(text), spec))
    # k, then the two Seq branches (1 iteration of 8, 1 of 9), each w r s, then the c
    # loop twice: interior (base pointer) and border (guarded pointers) versions.
    assert _loop_trip_counts(code) == [2, 1, 17, 3, 3, 32, 32, 1, 17, 3, 3, 32, 32]
    assert code.count("_mm512_fmadd_ps") == 2 * (8 + 9) * 2  # fast + guarded bodies
    assert "omp parallel" not in code


def test_golden_accumulators_hoisted_out_of_reduction_band():
    spec, text = CASES["lseq"]
    code = _nhwc_code(generate(Scheme.parse(text), spec))
    # r, s, c loops all sit inside the accumulator region: zero-init, no output loads.
    first_zero = code.index("_mm512_setzero_ps")
    first_r_loop = code.index("< 3;")
    assert first_zero < first_r_loop
    assert "_mm512_loadu_ps(y" not in code and "memset" not in code
    # each accumulator stored as it is twice: bare calls, and before a memory epilogue
    assert len(re.findall(r"_mm512_storeu_ps\(y [^;]*, acc_[0-9_]+\);", code)) == 2 * 2 * (8 + 9)


def test_golden_partial_reduction_clears_output_and_accumulates():
    spec, text = CASES["parallel_reductions_outer"]
    code = _nhwc_code(generate(Scheme.parse(text), spec))
    assert "memset(y, 0" in code
    assert "_mm512_loadu_ps(y" in code and "= _mm512_setzero_ps();" not in code
    assert "#pragma omp parallel for collapse(3) schedule(static) num_threads(nthreads)" in code


def test_golden_masks_only_when_k_has_a_tail():
    code = _nhwc_code(generate(Scheme.parse(CASES["lseq"][1]), CASES["lseq"][0]))
    # (the epilogue takes a full mask on every vector)
    assert "ttile_tail_mask" not in code and "_mask_storeu" not in code
    code = _nhwc_code(generate(Scheme.parse(CASES["k_tail"][1]), CASES["k_tail"][0]))
    # outputs are masked; weight panels are zero-filled past K, so their loads are not
    assert "_mm512_mask_storeu_ps(y" in code and "_mm512_maskz_loadu_ps(m0, w" not in code


def test_golden_no_guards_without_padding():
    spec, text = CASES["r_and_batch"]
    code = _nhwc_code(generate(Scheme.parse(text), spec))
    # the one branch left is the epilogue's, at the store
    assert "zeros_" not in code and "if (" not in code and "switch (epk)" in code


def test_kernel_names_follow_the_grammar_and_differ_by_scheme():
    spec, text = CASES["parallel_band"]
    name = kernel_name(Scheme.parse(text), spec)
    assert re.fullmatch(r"ttile_f32_conv2d_[0-9a-f]{12}__avx512f", name)
    other = kernel_name(Scheme.parse(CASES["parallel_reductions_outer"][1]), spec)
    assert other != name


def test_generated_header_names_scheme_and_problem():
    spec, text = CASES["k_tail"]
    code = generate(Scheme.parse(text), spec, command="ttile-generate test").code
    assert code.startswith("/* Generated by ttile, do not edit.")
    assert f"scheme:  {Scheme.parse(text)}" in code
    assert "command: ttile-generate test" in code


_ZMM_STACK_STORE = re.compile(r"vmov\w*\s+%zmm\d+,\s*-?\d*\(%r[sb]p\)")


@pytest.mark.parametrize("case, text", [
    ("lseq", "[T2 k; Lseq h [(1,8),(1,9)]; T17 w; T3 r; T3 s; T32 c; U beta h; U2 k; V k]"),
    ("largest_block", "[T17 w; T3 r; T3 s; T32 c; U14 h; U2 k; V k]"),
])
def test_microkernel_keeps_accumulators_in_registers(case, text):
    spec = same(1, 32, 32, 14 if case == "largest_block" else 17, 3, w=17)
    if case == "lseq":
        spec = CASES["lseq"][0]
    kernel = generate(Scheme.parse(text), spec)
    assert kernel.nchw_name is not None
    # both entry points (assembly() moves the NCHW one's tile buffer off the stack)
    asm = assembly(kernel)
    assert f"{kernel.nchw_name}:" in asm
    spills = _ZMM_STACK_STORE.findall(asm)
    assert not spills, f"vector registers spilled to the stack: {spills[:5]}"


#: (source, flags) of the hand-written kernels whose assembly a test reads -> the test
_ASSEMBLY_READERS = {
    ("generic_avx512.c", ("-mavx512f", "-mfma")):
        "test_generic_kernel_stores_vectors_only_to_the_output",
    ("depthwise_avx2.c", ("-mavx2", "-mfma")):
        "test_avx2_depthwise_blocks_keep_their_vectors_in_registers",
    ("inverted_residual_avx512.c", ("-mavx512f", "-mfma")):
        "test_fused_block_kernels_keep_their_vectors_in_registers",
}
_assembly_jobs: dict = {}   # (source, flags) -> [(process, output file)], started early


#: hand-written kernels built from several translation units -> those units
_UNITS = {"generic_avx512.c": ("generic_avx512.c", *(f"generic_blocks_avx512_{i}.c"
                                                     for i in range(1, 5)))}


def _assembly_commands(source: str, flags) -> Optional[list]:
    """The compiler commands that print the assembly of ``source``'s units, or None."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    compiler = find_compiler()
    paths = [root / "kernels" / unit for unit in _UNITS.get(source, (source,))]
    if compiler is None or not all(path.exists() for path in paths):
        return None
    return [[compiler, "-O3", *flags, "-fopenmp", "-fno-math-errno",
             "-I", str(root / "kernels"), "-S", "-o", "-", str(path)] for path in paths]


def start_in_background(test_name: str) -> None:
    """conftest.py's hook: compile the assembly this test reads while others run."""
    import subprocess
    import tempfile
    if not ttile.has_avx512f():
        return
    for key, reader in _ASSEMBLY_READERS.items():
        if reader != test_name or key in _assembly_jobs:
            continue
        commands = _assembly_commands(*key)
        if commands is not None and _installed_machine_code(key[0]) is None:
            jobs = []
            for command in commands:
                output = tempfile.TemporaryFile(mode="w+")
                jobs.append((subprocess.Popen(command, stdout=output,
                                              stderr=subprocess.PIPE, text=True), output))
            _assembly_jobs[key] = jobs


#: sources whose functions the installed extension's symbols name -> (the pattern of the
#: FILE symbols of the translation units it is built from, the pattern of its named
#: functions). Static functions follow their unit's FILE symbol; the exported ones and
#: the hidden ones shared between its units (the generic kernel's blocks, LOCAL in the
#: linked extension) are found by name.
_INSTALLED_SOURCES = {"generic_avx512.c": (r"generic_(avx512|blocks_avx512_\d+)\.c",
                                           r"ttile_(conv_)?generic\w*_avx512")}


def _installed_machine_code(source: str) -> Optional[str]:
    """The installed extension's own machine code for the functions compiled from
    kernels/``source`` (objdump's listing), or None where that cannot be read: no
    binutils, or an extension stripped of its symbols (pyproject.toml keeps them).

    The extension is what the build made of the source with CMakeLists.txt's flags; the
    generic kernel's 1.8 MB of blocks take GCC 8 minutes of a CI run to compile again,
    and objdump a quarter of a second to list."""
    import extension_code
    if source not in _INSTALLED_SOURCES:
        return None
    units, named = _INSTALLED_SOURCES[source]
    symbols = extension_code.functions(extension_code.matcher(units),
                                       extension_code.matcher(named))
    if symbols is None:
        return None   # stripped, or no binutils
    names = [f.name for f in symbols.functions]
    if not any("_omp_fn" in name for name in names) \
            or not any(re.fullmatch(named, name) and "block" in name for name in names):
        return None   # not the layout this reader expects: compile instead
    return "\n".join(extension_code.disassembly(f) for f in symbols.functions)


@requires_avx512
def _hand_written_assembly(source: str, flags: list[str]) -> str:
    """The assembly GCC makes of kernels/``source`` with the build's optimisation and
    ``flags``: read from the installed extension where it keeps its symbols, otherwise
    compiled (skips outside a source checkout or without a compiler), from the compile
    started at collection when there is one."""
    import subprocess
    installed = _installed_machine_code(source)
    if installed is not None:
        return installed
    key = (source, tuple(flags))
    commands = _assembly_commands(source, flags)
    if commands is None:
        pytest.skip("needs a source checkout and a C compiler")
    jobs = _assembly_jobs.pop(key, None)
    if jobs is None:
        jobs = [(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True), None) for command in commands]
    listings = []
    for process, output in jobs:
        stdout, stderr = process.communicate()
        assert process.returncode == 0, stderr
        if output is not None:
            output.seek(0)
            stdout = output.read()
            output.close()
        listings.append(stdout)
    return "\n".join(listings)


def test_generic_kernel_stores_vectors_only_to_the_output():
    """The hand-written generic kernel's register blocks stay in registers: no block
    function stores a vector register to the stack, and the blocks' stores are masked
    output stores. Register arrays sized by function arguments become stack VLAs; that
    once halved its speed. (The driver that calls them may store vectors to the stack:
    GCC fills the blocks' shared arguments with 64-byte moves.)"""
    asm = _hand_written_assembly("generic_avx512.c", ["-mavx512f", "-mfma"])
    # objdump's "0000 <name>:" or the assembler's "name:" starts each function
    bodies = re.split(r"\n(?=[0-9a-f]* ?<?[A-Za-z_][\w.]*>?:\n)", asm)
    blocks = {}
    for body in bodies:
        name = re.match(r"[0-9a-f]* ?<?(ttile_generic_block_(?:nchw_)?\d+_\d+_avx512)>?:", body)
        if name is not None:
            blocks[name.group(1)] = body
    # every block function: 6, 8, 12 and 24 widths of 4, 3, 2 and 1 vectors, on NHWC and
    # on NCHW inputs
    assert len(blocks) == 2 * (6 + 8 + 12 + 24), sorted(blocks)[:4]
    for name, body in blocks.items():
        stores = re.findall(r"vmov\w*\s+%zmm\d+,\s*[^%\s].*", body)
        assert any("{%k" in s for s in stores), f"{name}: no masked stores"
        spills = [s for s in stores if "%rsp" in s or "%rbp" in s]
        assert not spills, f"{name}: vector registers stored to the stack: {spills[:5]}"


def _functions(asm: str) -> list[str]:
    """The assembly cut at each function's label: names may hold dots (OpenMP's outlined
    ``f._omp_fn.0``, GCC's clones), local labels (``.L12``) start with one."""
    return re.split(r"\n(?=[A-Za-z_][\w.]*:\n)", asm)


def test_fused_block_kernels_keep_their_vectors_in_registers():
    """The fused inverted residual kernel's GEMM blocks (up to 8 pixels x 3 vectors: 24
    accumulators) and depthwise blocks (8 outputs, 9 taps) keep their vectors in
    registers: no block function stores a vector register to the stack or reads one
    back (a scalar broadcast from the stack is the leaky slope argument, not a spill)."""
    asm = _hand_written_assembly("inverted_residual_avx512.c", ["-mavx512f", "-mfma"])
    functions = _functions(asm)
    blocks = [f for f in functions if re.match(r"ir_(block|dw)_\d+_\d+:", f)]
    assert len(blocks) == 8 * 3 + 8 * 2, "not the fused kernel's block functions"
    for body in blocks:
        stack = [line for line in re.findall(
                     r"v\w+\s+[^\n]*-?\d*\(%r[sb]p\)[^\n]*%zmm\d+|"
                     r"v\w+\s+%zmm\d+,\s*-?\d*\(%r[sb]p\)", body)
                 if not line.startswith("vbroadcastss")]
        assert not stack, f"{body.split(':')[0]} moves vectors through the stack: {stack[:4]}"


def test_avx2_depthwise_blocks_keep_their_vectors_in_registers():
    """The AVX2 depthwise kernel's blocks keep their accumulators, weights and pixels in
    registers: no block function reads a vector register back from the stack (an
    epilogue loop left rolled once kept the general block's accumulators in memory).
    (GCC 12 leaves one dead store of a weight vector in the 3-wide 5x5 stride-2 block,
    never read back: not a spill. The AVX-512 kernel's 5x5 two-vector blocks do spill,
    with 27 live zmm registers at 8 outputs; they are not held to this.)"""
    asm = _hand_written_assembly("depthwise_avx2.c", ["-mavx2", "-mfma"])
    functions = _functions(asm)
    blocks = [f for f in functions if re.match(r"dw2_(fast|block)_\w+:", f)]
    assert len(blocks) == 8 + 4 * 8, "not the depthwise kernel's block functions"
    for body in blocks:
        reloads = re.findall(r"v\w+\s+-?\d*\(%r[sb]p\),.*%ymm\d+", body)
        assert not reloads, f"{body.split(':')[0]} reads vectors back from the stack: " \
                            f"{reloads[:4]}"


# Epilogues on every store pattern: complete reductions (zeroed accumulators), partial
# ones (the epilogue only on the last reduction step), K tails, Seq compositions, and the
# three parallel strategies.
EPILOGUE_CASES = ["lseq", "k_tail", "parallel_reductions_outer", "k_inside_c", "unroll_rsc",
                  "stride2_7x7", "unroll_n"]


@requires_avx512
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("activation,code", [(None, 0), ("relu", 1), ("relu6", 2),
                                             ("leaky_relu", 3), ("silu", 4)])
@pytest.mark.parametrize("case", EPILOGUE_CASES)
def test_generated_kernel_fuses_bias_residual_and_activation(case, activation, code,
                                                             with_residual):
    """Every TTILE_EPK_* path: in registers (bias with none, relu, relu6, leaky; residual
    with none or relu) and from memory (silu, leaky with a residual)."""
    spec, text = CASES[case]
    kernel = generate(Scheme.parse(text), spec)
    library = build([kernel])
    rng = np.random.default_rng(11)
    x, w = random_tensors(rng, (spec.n, spec.h, spec.w, spec.c), (spec.r, spec.s, spec.c, spec.k))
    bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
    residual = rng.uniform(-1, 1, (spec.n, spec.ho, spec.wo, spec.k)).astype(np.float32)
    if not with_residual:
        residual[...] = 0
    y = np.full(residual.shape, np.nan, dtype=np.float32)
    library.run(kernel, x, w, y, nthreads=2,
                epilogue=EpilogueArgs.of(bias, residual if with_residual else None, code, 0.1))
    from ttile.core.reference import conv2d_nhwc_f64
    pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
    z = conv2d_nhwc_f64(x, w, (spec.stride_h, spec.stride_w), pads) + bias + residual
    expected = {None: z, "relu": np.maximum(z, 0), "relu6": np.clip(z, 0, 6),
                "leaky_relu": np.where(z >= 0, z, 0.1 * z),
                "silu": z / (1 + np.exp(-z))}[activation]
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5 * np.sqrt(spec.c * spec.r * spec.s))


@requires_avx512
@pytest.mark.parametrize("case", EPILOGUE_CASES)
def test_a_prefetching_kernel_asks_for_its_residual_and_fuses_it(case):
    """Run-time tuning's kernels (weight_prefetch) prefetch the residual lines a block's
    store will add, once per line, only when the call has a residual and, where the
    reduction is split, before its last part; bias + residual + relu against float64."""
    spec, text = CASES[case]
    kernel = generate(Scheme.parse(text), spec, weight_prefetch=True)
    code = _nhwc_code(kernel)
    assert "_mm_prefetch((const char *)(rp + " in code
    assert "rp + " not in _nhwc_code(generate(Scheme.parse(text), spec))
    library = build([kernel])
    rng = np.random.default_rng(12)
    x, w = random_tensors(rng, (spec.n, spec.h, spec.w, spec.c), (spec.r, spec.s, spec.c, spec.k))
    bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
    residual = rng.uniform(-1, 1, (spec.n, spec.ho, spec.wo, spec.k)).astype(np.float32)
    from ttile.core.reference import conv2d_nhwc_f64
    pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
    z = conv2d_nhwc_f64(x, w, (spec.stride_h, spec.stride_w), pads) + bias
    for res in (residual, None):   # and without one: rp is NULL, nothing prefetched
        y = np.full(residual.shape, np.nan, dtype=np.float32)
        library.run(kernel, x, w, y, nthreads=2, epilogue=EpilogueArgs.of(bias, res, 1, 0.1))
        expected = np.maximum(z + (0 if res is None else residual), 0)
        np.testing.assert_allclose(y, expected, rtol=2e-5,
                                   atol=2e-5 * np.sqrt(spec.c * spec.r * spec.s))


@requires_avx512
def test_generated_kernel_with_dilation_matches_reference():
    spec = ConvSpec(1, 32, 8, 15, 13, 3, 3, 1, 2, 2, 2, 2, 2, dilation_h=2, dilation_w=3)
    kernel = generate(Scheme.parse(f"[T{spec.ho} h; T{spec.wo} w; T3 r; T3 s; T8 c; U2 k; V k]"),
                      spec)
    library = build([kernel])
    rng = np.random.default_rng(2)
    x, w = random_tensors(rng, (1, spec.h, spec.w, spec.c), (3, 3, spec.c, spec.k))
    y = np.full((1, spec.ho, spec.wo, spec.k), np.nan, dtype=np.float32)
    library.run(kernel, x, w, y, nthreads=1)
    from ttile.core.reference import conv2d_nhwc_f64
    expected = conv2d_nhwc_f64(x, w, (1, 2), (2, 2, 2, 2), (2, 3))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)


# -- the NCHW entry point ----------------------------------------------------------------
#: Cases whose scheme has no NCHW entry point: a reduction loop above every loop of the
#: output (and an output larger than the tile buffer); tiles of 5 pixels along w, below
#: loops parallel along w, in rows of 10.
NO_NCHW = {"parallel_reductions_outer", "parallel_reductions_inner"}


def _nchw_case(case, small_tiles, monkeypatch):
    if small_tiles:   # regions deep in the tree (inside Seq branches), streamed stores
        monkeypatch.setattr(codegen, "NCHW_TILE_BYTES", 2048)
        monkeypatch.setattr(codegen, "NCHW_STREAM_BYTES", 0)
    spec, text = CASES[case]
    kernel = generate(Scheme.parse(text), spec)
    if case in NO_NCHW and not small_tiles:
        assert kernel.nchw_name is None
        return None
    if kernel.nchw_name is None:
        assert small_tiles or case in NO_NCHW
        pytest.skip("no NCHW entry point at this tile budget (tiles narrower than a vector)")
    return kernel, build([kernel])


@requires_avx512
@pytest.mark.parametrize("small_tiles", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_nchw_entry_point_stores_the_kernels_sums_in_nchw(case, small_tiles, monkeypatch):
    """The same sums, bit for bit, from an NCHW input stored tile by tile into NCHW, on 1
    and 2 threads; the epilogue (bias, an NCHW residual, activation) applied at that
    store."""
    found = _nchw_case(case, small_tiles, monkeypatch)
    if found is None:
        return
    kernel, library = found
    spec = kernel.spec
    rng = np.random.default_rng(11)
    x, w = random_tensors(rng, (spec.n, spec.h, spec.w, spec.c), (spec.r, spec.s, spec.c, spec.k))
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    shape = (spec.n, spec.k, spec.ho, spec.wo)
    bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
    residual = rng.uniform(-1, 1, shape).astype(np.float32)
    for threads in (1, 2):
        y = np.full((spec.n, spec.ho, spec.wo, spec.k), np.nan, dtype=np.float32)
        library.run(kernel, x, w, y, nthreads=threads)
        y_nchw = aligned_empty(shape)   # so that streamed stores are taken
        y_nchw.fill(np.nan)
        library.run(kernel, x_nchw, w, y_nchw, nthreads=threads, nchw=True)
        np.testing.assert_array_equal(y_nchw, y.transpose(0, 3, 1, 2))
        library.run(kernel, x_nchw, w, y_nchw, nthreads=threads, nchw=True,
                    epilogue=EpilogueArgs.of(bias, residual, 2, 0.0))   # relu6
        expected = np.clip(y.transpose(0, 3, 1, 2) + bias[:, None, None] + residual, 0, 6)
        np.testing.assert_allclose(y_nchw, expected, rtol=1e-6, atol=1e-6)


def test_tile_regions_sit_below_parallel_loops_and_above_reductions():
    spec, text = CASES["parallel_band"]   # [PT2 k; PT5 h; T2 w; ...]
    code = generate(Scheme.parse(text), spec).code
    nchw = code[code.index("_nchw__avx512f("):]
    # one buffer per thread: declared inside the parallel loop, stored after the blocks
    assert nchw.index("#pragma omp parallel") < nchw.index("float yt[")
    assert nchw.index("float yt[") < nchw.index("_mm512_fmadd_ps") \
        < nchw.index("ttile_store_nchw512(yt")
    # a split reduction accumulates into the buffer, cleared per tile, not into y
    spec, text = CASES["k_inside_c"]
    code = generate(Scheme.parse(text), spec).code
    nchw = code[code.index("_nchw__avx512f("):]
    assert "memset(yt, 0" in nchw and "memset(y, 0" not in nchw
    assert "memset(y, 0" in code[:code.index("_nchw__avx512f(")]


def test_no_nchw_entry_point_when_tiles_are_narrower_than_a_vector(monkeypatch):
    """Blocks unrolled along h under a small tile budget leave tiles one pixel wide: NCHW
    rows of a float or two, slower than converting the whole output afterwards."""
    monkeypatch.setattr(codegen, "NCHW_TILE_BYTES", 2048)
    spec, text = CASES["lseq"]   # U beta h under T17 w
    assert generate(Scheme.parse(text), spec).nchw_name is None
    monkeypatch.setattr(codegen, "NCHW_TILE_BYTES", 128 * 1024)
    assert generate(Scheme.parse(text), spec).nchw_name is not None


GROUPED_CASES = ["parallel_reductions_outer", "k_tail", "stride2_7x7", "lseq", "unroll_n"]


@requires_avx512
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_a_grouped_problems_kernel_computes_each_group_in_place(case):
    """A grouped problem (ConvSpec.groups): the scheme of one group, run on each group's
    channels where they lie in the whole input and output, its bias and residual offset
    to the group's; a scheme whose reduction is split clears only its own group's
    channels before accumulating. No NCHW entry point (those calls convert)."""
    from dataclasses import replace
    from ttile.core.weights import pack_panels
    from ttile.core.reference import conv2d_nhwc_f64
    one, text = CASES[case]
    spec = replace(one, groups=3)
    kernel = generate(Scheme.parse(text), spec, weight_prefetch=True)
    assert kernel.nchw_name is None and "_group(" in kernel.code
    # a scheme with parallel loops runs them in each group; one without shares the groups
    # among the threads (each group's kernel on one thread)
    across = "shared among the threads" in kernel.code
    assert across == (case != "parallel_reductions_outer"), case
    if case == "parallel_reductions_outer":
        assert "memset(y, 0" not in kernel.code and "memset(y + p * " in kernel.code
    library = build([kernel])
    rng = np.random.default_rng(5)
    x, w = random_tensors(rng, spec.input_shape(), spec.weight_shape())
    k = spec.k * spec.groups
    bias = rng.uniform(-1, 1, k).astype(np.float32)
    residual = rng.uniform(-1, 1, spec.output_shape()).astype(np.float32)
    y = np.full(spec.output_shape(), np.nan, dtype=np.float32)
    assert pack_panels(w, spec, kernel.panel).shape == spec.packed_weight_shape(kernel.panel)
    library.run(kernel, x, w, y, nthreads=2,
                epilogue=EpilogueArgs.of(bias, residual, 1, 0.0))   # relu
    pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
    z = conv2d_nhwc_f64(x, w, (spec.stride_h, spec.stride_w), pads, (1, 1), 3) + bias + residual
    np.testing.assert_allclose(y, np.maximum(z, 0), rtol=2e-5,
                               atol=2e-5 * np.sqrt(spec.c * spec.r * spec.s))
    bare = np.full(spec.output_shape(), np.nan, dtype=np.float32)
    library.run(kernel, x, w, bare, nthreads=1)
    from ttile.core.reference import conv_mismatch
    problem = conv_mismatch(bare, x, w, (spec.stride_h, spec.stride_w), pads, "NHWC", (1, 1), 3)
    assert problem is None, problem
