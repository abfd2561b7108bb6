"""The code generator's AVX2 + FMA family: 8-lane vectors, 16 registers, vmaskmovps tails.

The same loop nests as the AVX-512F family (tests/test_codegen.py), each case sized for
the AVX2 register budget and for ``V k`` covering 8 output channels: lambda-seq, K tails
(unrolled or not), strides, the parallel strategies, a k loop inside the reduction, the
largest block the 16 ymm registers hold, and the fused epilogues. Every kernel is checked
against the float64 reference; the assembly must hold no AVX-512 instruction and no
vector register spilled to the stack.
"""
import re

import numpy as np
import pytest

from ttile.core.cbuild import EpilogueArgs, assembly, build, find_compiler
from ttile.core.codegen import generate, kernel_cflags, kernel_name
from ttile.core.kinds import Isa
from ttile.core.reference import assert_conv_close, conv2d_nhwc_f64
from ttile.core.scheme import Scheme, SchemeError, lower
from ttile.core.spec import ConvSpec
from conftest import random_tensors, requires_avx2

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler on PATH")


def same(n, k, c, hw, rs, stride=1, w=None):
    pad = rs // 2
    return ConvSpec(n, k, c, hw, w or hw, rs, rs, stride, stride, pad, pad, pad, pad)


CASES = {
    # 17 = 8 + 9 along h, two 8-lane vectors of K = 16 by the outer k loop.
    "lseq": (same(1, 16, 16, 17, 3),
             "[T2 k; Lseq h [(1,8),(1,9)]; T17 w; T3 r; T3 s; T16 c; U beta h; V k]"),
    # K = 20: three vectors, the last one masked to 4 lanes.
    "k_tail": (same(1, 20, 16, 10, 3), "[T3 k; T5 h; T10 w; T3 r; T3 s; T16 c; U2 h; V k]"),
    "k_tail_unrolled": (same(1, 21, 5, 9, 3),
                        "[T9 h; T3 w; T3 r; T3 s; T5 c; U3 w; U3 k; V k]"),
    "stride2_7x7": (same(1, 8, 3, 20, 7, stride=2),
                    "[T10 h; T2 w; T7 r; T7 s; T3 c; U5 w; V k]"),
    "parallel_band": (same(1, 16, 16, 10, 3),
                      "[PT2 k; PT5 h; T2 w; T3 r; T3 s; T16 c; U2 h; U5 w; V k]"),
    "parallel_reductions_outer": (same(1, 16, 16, 10, 3),
                                  "[T3 r; T3 s; PT2 k; PT5 h; PT2 w; T16 c; U2 h; U5 w; V k]"),
    "k_inside_c": (same(1, 16, 16, 16, 3, w=8),
                   "[T8 h; T8 w; T3 r; T3 s; T16 c; T2 k; U2 h; V k]"),
    "unroll_n": (same(2, 8, 8, 4, 3), "[T2 h; T4 w; T3 r; T3 s; T8 c; U2 n; U2 h; V k]"),
    # The largest block: 4 x 3 accumulators + 3 weight vectors + 1 broadcast = 16 ymm.
    "largest_block": (same(1, 24, 16, 8, 3, w=8),
                      "[T8 h; T2 w; T3 r; T3 s; T16 c; U4 w; U3 k; V k]"),
}


def _kernel(case):
    spec, text = CASES[case]
    return spec, generate(Scheme.parse(text), spec, isa=Isa.AVX2)


@requires_avx2
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_avx2_kernel_matches_reference(case, threads):
    spec, kernel = _kernel(case)
    assert kernel.isa is Isa.AVX2 and kernel.panel % 8 == 0
    library = build([kernel])
    rng = np.random.default_rng(7)
    x, w = random_tensors(rng, spec.input_shape(), spec.weight_shape())
    y = np.full(spec.output_shape(), np.nan, dtype=np.float32)
    library.run(kernel, x, w, y, nthreads=threads)
    assert_conv_close(y, x, w, (spec.stride_h, spec.stride_w),
                      (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right))


@requires_avx2
@pytest.mark.parametrize("activation,code", [(None, 0), ("relu", 1), ("relu6", 2),
                                             ("leaky_relu", 3), ("silu", 4)])
@pytest.mark.parametrize("case", ["lseq", "k_tail", "k_tail_unrolled",
                                  "parallel_reductions_outer", "largest_block"])
def test_avx2_kernel_fuses_bias_residual_and_activation(case, activation, code):
    spec, kernel = _kernel(case)
    library = build([kernel])
    rng = np.random.default_rng(11)
    x, w = random_tensors(rng, spec.input_shape(), spec.weight_shape())
    bias = rng.uniform(-1, 1, spec.k).astype(np.float32)
    residual = rng.uniform(-1, 1, spec.output_shape()).astype(np.float32)
    y = np.full(residual.shape, np.nan, dtype=np.float32)
    library.run(kernel, x, w, y, nthreads=2, epilogue=EpilogueArgs.of(bias, residual, code, 0.1))
    pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
    z = conv2d_nhwc_f64(x, w, (spec.stride_h, spec.stride_w), pads) + bias + residual
    expected = {None: z, "relu": np.maximum(z, 0), "relu6": np.clip(z, 0, 6),
                "leaky_relu": np.where(z >= 0, z, 0.1 * z),
                "silu": z / (1 + np.exp(-z))}[activation]
    np.testing.assert_allclose(y, expected, rtol=2e-5,
                               atol=2e-5 * np.sqrt(spec.c * spec.r * spec.s))


_YMM_STACK = re.compile(r"vmov\w*\s+%ymm\d+,\s*-?\d*\(%r[sb]p\)")


@pytest.mark.parametrize("case", ["lseq", "k_tail_unrolled", "largest_block"])
def test_avx2_kernel_has_no_avx512_and_no_spills(case):
    """Compiled with AVX2 flags only: no zmm and no mask register can appear, and the
    block (up to the whole 16-register budget) stays in registers."""
    _, kernel = _kernel(case)
    asm = assembly(kernel)
    assert kernel.nchw_name is None   # NCHW entry points are AVX-512F only
    assert "%ymm" in asm
    assert "%zmm" not in asm and not re.search(r"%k[1-7]\b", asm)
    spills = _YMM_STACK.findall(asm)
    assert not spills, f"vector registers spilled to the stack: {spills[:5]}"
    assert "-mavx2" in kernel_cflags(Isa.AVX2) and "-mavx512f" not in kernel_cflags(Isa.AVX2)


def test_avx2_vectors_are_8_lanes_and_16_registers():
    spec = same(1, 16, 16, 8, 3)
    # V k covers 8 channels: two vectors cover K = 16 in AVX2, one in AVX-512F
    lower(Scheme.parse("[T8 h; T8 w; T3 r; T3 s; T16 c; U2 k; V k]"), spec, Isa.AVX2)
    with pytest.raises(SchemeError, match="8-lane"):
        lower(Scheme.parse("[T8 h; T8 w; T3 r; T3 s; T16 c; V k]"), spec, Isa.AVX2)
    # 4 x 4 accumulators fit 32 zmm, not 16 ymm
    text = "[T8 h; T2 w; T3 r; T3 s; T16 c; U4 w; U4 k; V k]"
    big = same(1, 64, 16, 8, 3)
    lower(Scheme.parse(text), big, Isa.AVX512F)
    with pytest.raises(SchemeError, match="avx2 has 16"):
        lower(Scheme.parse(text), same(1, 32, 16, 8, 3), Isa.AVX2)


def test_kernel_names_carry_the_family():
    spec, text = CASES["k_tail"]
    scheme = Scheme.parse(text)
    avx2, avx512 = kernel_name(scheme, spec, Isa.AVX2), kernel_name(scheme, spec)
    assert avx2.endswith("__avx2") and avx512.endswith("__avx512f")
    assert avx2.split("__")[0] != avx512.split("__")[0]
    code = generate(scheme, spec, isa=Isa.AVX2).code
    assert "__m512" not in code and "_mm512" not in code and "vector family avx2" in code


def test_one_build_is_one_family():
    spec, text = CASES["k_tail"]
    scheme = Scheme.parse(text)
    with pytest.raises(ValueError, match="one vector family"):
        build([generate(scheme, spec, isa=Isa.AVX2), generate(scheme, same(1, 48, 16, 10, 3))])
