"""``precision="bf16"``: the call's inputs and weights rounded to bf16, products
accumulated in fp32, the epilogue applied in fp32 before the store (OpenVINO's default
on CPUs with AVX512_BF16 or AMX, and torch autocast's meaning).

Which kernel serves (``kernel_kind``):

* AMX (``KernelKind.AMX``) where the CPU has AMX-BF16 and Linux grants the tile state;
* AVX512_BF16 (``KernelKind.DOT_BF16``, vdpbf16ps) where the CPU has that and no AMX;
* elsewhere, and for depthwise layers and the grouped layers the bf16 kernels cannot take
  (``grouped_supers``), the fp32 kernels on the bf16-rounded input and weights: the same
  numbers (a product of two bf16 values is exact in fp32, the sums are fp32 sums), at
  fp32 speed. A CPU without bf16 instructions says so once.

A grouped layer runs on the bf16 kernels as super-groups: a few groups side by side, so
that a super-group has 32 output channels (or a multiple), each a dense problem with block
diagonal weights (its groups' own, zeros between them). The tiles compute the zeros too:
ResNeXt's groups of 4 channels do 8 times the products they need, and still ran faster
than the fp32 grouped kernel, where the products are not the cost.

Both bf16 kernels read one packed format (``kernels/ttile_bf16.h``): the input rounded
into padded NHWC, the weights in 16-channel blocks of channel pairs. A layer of few input
channels (the first layer's 3) is folded: the filter's columns become channels, so that
the reduction steps are full. ``Bf16Packing`` is that decision for one problem.

Arrays: fp32 in, fp32 out; bf16 arrays (numpy's ``ml_dtypes.bfloat16``) in, bf16 out,
so that a network can keep its activations in bf16 from layer to layer (half the bytes).
The reference a kernel is checked against is the float64 convolution of the
bf16-rounded inputs (``round_to_bf16``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .. import _kernels
from ..core.kinds import Isa, KernelKind, Precision
from ..core.spec import ConvSpec
from .arguments import FLOAT32, as_float32
from .scratch import aligned_empty

#: The kernels of this module, and their codes in the extension.
BF16_KINDS = (KernelKind.AMX, KernelKind.DOT_BF16)
_KERNEL_CODES = {KernelKind.AMX: _kernels.BF16_KERNEL_AMX,
                 KernelKind.DOT_BF16: _kernels.BF16_KERNEL_AVX512}

#: Layers with fewer input channels than this and a filter wider than one column are
#: folded (ttile_bf16_pack_input_folded): ResNet's first layer, 3 channels of a 7x7
#: filter, ran at 53 GFLOP/s on AMX with its 3 channels padded to a 32-channel step and
#: at 240 folded (21 of 32), one thread of a Xeon model 207.
FOLD_BELOW_CHANNELS = 16


def is_bfloat16(array) -> bool:
    """Whether ``array`` is a numpy array of bf16 (ml_dtypes.bfloat16) values."""
    dtype = getattr(array, "dtype", None)
    return (isinstance(dtype, np.dtype) and dtype.name == "bfloat16"
            and dtype.itemsize == 2)


def round_to_bf16(a) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even; NaN stays NaN), as
    float32: what the bf16 kernels multiply. Exact for bf16 arrays."""
    if is_bfloat16(a):
        return (bf16_bits(a).astype(np.uint32) << 16).view(FLOAT32)
    a = np.ascontiguousarray(a, dtype=FLOAT32)
    if _kernels.cpu_has_avx512f():   # one pass, where numpy takes five
        return _kernels.bf16_round_f32(a)
    u = a.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(a), a, rounded.view(FLOAT32)).astype(FLOAT32, copy=False)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """A bf16 array's bits as uint16 (a view), C-contiguous."""
    return np.ascontiguousarray(a).view(np.uint16)


def kernel_kind(isa: Isa) -> Optional[KernelKind]:
    """The bf16 kernel this CPU runs for a call of vector family ``isa`` (None: the
    fp32 kernels on rounded values serve). ``ttile.set_isa`` to AVX2 or portable C
    turns the bf16 kernels off too: they are AVX-512 code. The dot-product kernel serves
    only where ``dot_products_pay`` measured vdpbf16ps worth it."""
    if isa is not Isa.AVX512F:
        return None
    if _kernels.amx_usable():
        return KernelKind.AMX
    if _kernels.cpu_has_avx512bf16() and dot_products_pay()[0]:
        return KernelKind.DOT_BF16
    return None


#: vdpbf16ps must do at least this share of the fp32 FMA's flops for the dot-product
#: kernel to serve (it also halves the bytes moved). Zen 4: 2.0 (235 against 117
#: GFLOP/s a core); a Xeon model 207: 0.44 (65-75 against 145-170), where the fp32
#: kernels on rounded values are the faster way when AMX is refused.
DOT_MIN_SHARE = 0.8
_dot_verdict: Optional[tuple] = None


def dot_products_pay() -> tuple:
    """(verdict, vdpbf16ps GFLOP/s, fp32 FMA GFLOP/s) on this core, measured once per
    process (about 20 ms: the best of three runs of each)."""
    global _dot_verdict
    if _dot_verdict is None:
        rounds = 200000
        dot = max(rounds * 1536 / _kernels.dot_bf16_peak_seconds(rounds) for _ in range(3))
        fma = max(rounds * _kernels.fma_peak_flops() / _kernels.fma_peak_seconds(rounds)
                  for _ in range(3))
        _dot_verdict = (dot >= DOT_MIN_SHARE * fma, dot / 1e9, fma / 1e9)
    return _dot_verdict


def missing_instructions() -> str:
    """Why this CPU has no bf16 kernel ("" when it has one)."""
    if not _kernels.cpu_has_avx512f():
        return "this CPU has no AVX-512"
    if _kernels.cpu_has_amx_bf16() and not _kernels.cpu_has_avx512bf16():
        return "this CPU has AMX but not AVX512_BF16"
    if not _kernels.cpu_has_avx512bf16():
        return "this CPU has no AVX512_BF16 and no AMX"
    pays, dot, fma = dot_products_pay()
    if not pays:
        amx = (_AMX_REFUSED if _kernels.cpu_has_amx_bf16() else "no AMX")
        return (f"{amx}, and vdpbf16ps ran at {dot:.0f} GFLOP/s against fp32 FMA's "
                f"{fma:.0f} on this core")
    return ""


_AMX_REFUSED = ("AMX refused: Linux did not grant the tile state (arch_prctl "
                "ARCH_REQ_XCOMP_PERM), or this build's compiler has no AMX")


@dataclass(frozen=True)
class Bf16Packing:
    """How one dense problem is packed for a bf16 kernel (``kernels/ttile_bf16.h``).

    ``problem`` is the extension's 16 fields (n, ho, wo, k, hp, wp, cp, kc, kp, r, s,
    stride_h, stride_w, dil_h, dil_w, phases) of the problem as the kernel computes it, and
    a grouped problem's super-groups after them (gc, gkq: see ``grouped_supers``); a
    folded layer's (``folded``: the layer's s, stride_w and dil_w) has s, stride_w and
    dil_w 1; a stride-2 layer's input is packed in phase planes (``phases`` 1: hp and wp
    are then a plane's extents).
    ``weights_key`` is what the packed weights depend on (not the input's size). ``spec``
    is the whole problem (``groups`` as the layer's)."""

    kind: KernelKind
    spec: ConvSpec
    problem: tuple
    folded: Optional[tuple]

    @property
    def weights_key(self) -> tuple:
        p = self.problem
        return (self.kind, p[6], p[7], p[8], p[9], p[10], self.folded is not None) + p[16:]

    @property
    def channels(self) -> int:
        """The input's channels (all groups')."""
        return self.spec.c * self.spec.groups


#: The most groups a super-group holds, per kernel: its products are that many times the
#: layer's. AMX: at 8 (ResNeXt's groups of 4) it ran 3.0-3.5x faster than the fp32
#: kernels on rounded values, at 1-4 (its other stages, AlexNet's) 2.6-4.8x (1 and 2
#: threads, Xeon model 207, bf16 arrays, interleaved); more were not measured. The
#: dot-product kernel serves where vdpbf16ps does at most about twice fp32 FMA's flops
#: (Zen 4: 235 against 117 GFLOP/s a core); on the Xeon (86 against 173) it ran ResNeXt's
#: grouped layers at 0.45x the fp32 kernels with one group a super-group, 0.31 with 2,
#: 0.33 with 4, 0.23 with 8: scaled by the fourfold ratio, 2 is the most that can gain,
#: an estimate until measured on a Zen.
MAX_GROUPS_PER_SUPER = {KernelKind.AMX: 8, KernelKind.DOT_BF16: 2}


def grouped_supers(spec: ConvSpec, kind: KernelKind) -> Optional[tuple[int, int, int]]:
    """(groups per super-group m, its input channels gc, its channel pairs gkq) where bf16
    kernel ``kind`` takes grouped ``spec`` (``groups`` > 1, c and k one group's), else None.
    The super-groups of m groups make a multiple of 32 output channels each; where the
    groups do not divide into such (ShuffleNet's 3 groups of 20 channels), all of them
    make one, its output channels padded to a multiple of 32 (a channel pair's output
    channels are 32 kq on, so only the last may be padded). m is at most
    MAX_GROUPS_PER_SUPER[kind]; gc channels split into equal even reduction steps of at
    most 32 (the input is not padded between super-groups)."""
    m = 32 // math.gcd(spec.k, 32)
    if spec.groups < 2:
        return None
    if spec.groups % m:
        m = spec.groups   # one super-group
    if m > MAX_GROUPS_PER_SUPER[kind]:
        return None
    gc = m * spec.c
    steps = -(-gc // 32)
    if gc % (2 * steps):
        return None
    return m, gc, -(-m * spec.k // 32)


@functools.lru_cache(maxsize=512)
def packing(spec: ConvSpec, kind: KernelKind) -> Bf16Packing:
    """The packing of ``spec`` (a dense problem, or a grouped one that ``grouped_supers``
    takes) for bf16 kernel ``kind`` (a pure function of the two, kept for the shapes a
    process calls again: per-call conv2d).

    The reduction step kc: AMX takes up to 32 channels a step (a tile row is 64 bytes);
    the channels are split into equal even steps, so that few are padding (144 channels:
    5 steps of 30, not 160 in steps of 32). The dot-product kernel steps by pairs."""
    supers = grouped_supers(spec, kind) if spec.groups > 1 else None
    if spec.groups > 1 and supers is None:
        raise ValueError(f"the bf16 kernels do not take {spec}")
    fold = supers is None and spec.c < FOLD_BELOW_CHANNELS and spec.s > 1
    reduced = spec.c * spec.s if fold else spec.c
    even = reduced + (reduced & 1)
    if supers is not None:   # the whole input; a super-group's steps
        _, gc, gkq = supers
        kc, cp = gc // -(-gc // 32), gc * (spec.groups // supers[0])
        if kind is KernelKind.DOT_BF16:
            kc = 2
        kp, k = 32 * gkq * (spec.groups // supers[0]), spec.k * spec.groups
        grouped = (gc, gkq)
    elif kind is KernelKind.AMX:
        steps = -(-even // 32)
        kc = -(-even // steps)
        kc += kc & 1
        cp = kc * steps
    else:
        kc, cp = 2, even
    if supers is None:
        kp, k, grouped = -(-spec.k // 32) * 32, spec.k, ()
    ho, wo = spec.ho, spec.wo
    hp = max(spec.pad_top + spec.h, (ho - 1) * spec.stride_h + (spec.r - 1) * spec.dilation_h + 1)
    if fold:
        problem = (spec.n, ho, wo, spec.k, hp, wo, cp, kc, kp, spec.r, 1, spec.stride_h, 1,
                   spec.dilation_h, 1, 0)
        return Bf16Packing(kind, spec, problem, (spec.s, spec.stride_w, spec.dilation_w))
    if spec.stride_h == spec.stride_w == 2 and spec.dilation_h == spec.dilation_w == 1:
        # phase planes: a tile's 16 rows are 16 outputs across output rows, as at stride 1
        problem = (spec.n, ho, wo, k, ho + (spec.r - 1) // 2, wo + (spec.s - 1) // 2,
                   cp, kc, kp, spec.r, spec.s, 2, 2, 1, 1, 1) + grouped
        return Bf16Packing(kind, spec, problem, None)
    wp = max(spec.pad_left + spec.w, (wo - 1) * spec.stride_w + (spec.s - 1) * spec.dilation_w + 1)
    problem = (spec.n, ho, wo, k, hp, wp, cp, kc, kp, spec.r, spec.s, spec.stride_h,
               spec.stride_w, spec.dilation_h, spec.dilation_w, 0) + grouped
    return Bf16Packing(kind, spec, problem, None)


def pack_weights(weights: np.ndarray, layout: str, pack: Bf16Packing,
                 threads: int) -> np.ndarray:
    """fp32 weights of one group, KCRS for ``layout`` "NCHW", RSCK for "NHWC", in the
    bf16 kernels' format for ``pack`` (read-only)."""
    w = np.asarray(weights, dtype=FLOAT32)
    if layout == "NCHW":   # torch's KCRS
        w = w.transpose(2, 3, 1, 0)
    w = np.ascontiguousarray(w)
    if pack.folded is not None:   # the filter's columns as channels: c' = s c + c
        r, s, c, k = w.shape
        w = w.reshape(r, 1, s * c, k)
    if len(pack.problem) > 16:
        packed = _grouped_weights(w, pack, threads)
    else:
        packed = _kernels.bf16_pack_weights(w, pack.problem, threads)
    packed.flags.writeable = False
    return packed


def _grouped_weights(w: np.ndarray, pack: Bf16Packing, threads: int) -> np.ndarray:
    """A grouped layer's RSCK weights (R, S, cg, K) packed super-group by super-group,
    each a dense problem of gc channels whose weights are its groups' on the diagonal."""
    spec = pack.spec
    m, gc, gkq = grouped_supers(spec, pack.kind)
    r, s, cg, kg = spec.r, spec.s, spec.c, spec.k
    supers = spec.groups // m
    # (R, S, cg, supers, m, kg) -> (supers, R, S, m, cg, kg), then each group's block on
    # the diagonal of its super-group's (m cg) x (m kg) matrix
    by_group = w.reshape(r, s, cg, supers, m, kg).transpose(3, 0, 1, 4, 2, 5)
    dense = np.zeros((supers, r, s, m, cg, m, kg), dtype=FLOAT32)
    for i in range(m):
        dense[:, :, :, i, :, i, :] = by_group[:, :, :, i]
    dense = dense.reshape(supers, r, s, gc, m * kg)
    sub = pack.problem[:3] + (m * kg,) + pack.problem[4:6] + (gc, pack.problem[7],
                                                             32 * gkq) + pack.problem[9:16]
    return np.concatenate([_kernels.bf16_pack_weights(np.ascontiguousarray(d), sub, threads)
                           for d in dense])


def run(pack: Bf16Packing, x: np.ndarray, nchw: bool, wb: np.ndarray, y: np.ndarray,
        threads: int, bias: Optional[np.ndarray], residual: Optional[np.ndarray],
        activation: int, slope: float, y_nchw: bool = False) -> None:
    """The bf16 kernel of ``pack`` on x (fp32 NHWC, fp32 NCHW with ``nchw``, or bf16 bits
    NHWC) into y (NHWC, fp32 or bf16 bits; ``residual`` of y's type and shape; with
    ``y_nchw``, fp32 NCHW: see :func:`writes_nchw`)."""
    spec = pack.spec
    _kernels.conv2d_bf16(x, nchw, wb, y, pack.problem, pack.channels, spec.h, spec.w,
                         spec.pad_top, spec.pad_left, _KERNEL_CODES[pack.kind], threads,
                         bias=bias, residual=residual, activation=activation, slope=slope,
                         folded=pack.folded, xb=_input_buffer(pack), y_nchw=y_nchw)


def writes_nchw(pack: Bf16Packing) -> bool:
    """Whether the kernel of ``pack`` writes an fp32 NCHW output itself (the AMX kernel
    does, transposing its tiles in registers; for the dot-product kernel an NCHW call
    converts the NHWC output in a pass of its own). Against that pass, NCHW layers took
    0.37-0.86 of the time (1x1 and first layers, 56x56 to 544x544 maps), and as long on
    3x3 layers of 7x7-56x56 (Xeon model 207, 1 thread, bias + ReLU, interleaved)."""
    return pack.kind is KernelKind.AMX


def _input_buffer(pack: Bf16Packing) -> Optional[np.ndarray]:
    """This thread's reused buffer for a packed input (fresh memory on every call was
    page faults on every call), or None past the scratch bound."""
    from .scratch import scratch
    elems = _kernels.bf16_input_elems(pack.problem)
    buffer = scratch("bf16-input", ((elems + 1) // 2,))
    return None if buffer is None else buffer.view(np.uint16)[:elems]


def precision_of(value) -> Precision:
    """``precision`` as given to conv2d, Conv2d, plan and convert: "fp32" or "bf16"."""
    if isinstance(value, Precision):
        return value
    try:
        return Precision(value)
    except ValueError:
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {value!r}") from None


# ---------------------------------------------------------------------------------------
# A call: conv2d(..., precision="bf16") and Conv2d's bf16 layer (conv_layer) run these.

@dataclass(frozen=True)
class Bf16Choice:
    """What serves a bf16 call: a bf16 kernel with its packing, or (``pack`` None) the
    fp32 kernels on the bf16-rounded input and weights, for the reason in ``note``."""

    kind: Optional[KernelKind]
    pack: Optional[Bf16Packing]
    note: str
    degraded: str = ""


def choose(spec: ConvSpec, groups: int, isa: Isa) -> Bf16Choice:
    """The bf16 kernel for one group's problem ``spec`` of ``groups`` on family ``isa``."""
    kind = kernel_kind(isa)
    if kind is None:
        missing = missing_instructions() if isa is Isa.AVX512F else \
            f"the {isa.value} family was asked for (ttile.set_isa)"
        return Bf16Choice(None, None, f"bf16 requested: fp32 kernels on bf16-rounded input "
                                      f"and weights ({missing})",
                          degraded=f"no bf16 kernel: {missing}" if isa is Isa.AVX512F
                          else "")
    if groups != 1:
        whole = replace(spec, groups=groups)
        supers = grouped_supers(whole, kind) if spec.c > 1 or spec.k > 1 else None
        if supers is None:
            what = "depthwise convolutions" if spec.c == 1 and spec.k == 1 else \
                f"grouped convolutions of {spec.c} -> {spec.k} channels a group: they make " \
                f"no super-groups of 32 output channels of at most " \
                f"{MAX_GROUPS_PER_SUPER[kind]} groups"
            return Bf16Choice(None, None, f"bf16 requested: fp32 kernels on bf16-rounded "
                                          f"input and weights (no bf16 kernel for {what})")
        pack = packing(whole, kind)
        how = "AMX tiles" if kind is KernelKind.AMX else "AVX512_BF16 dot products"
        degraded = _AMX_REFUSED if kind is KernelKind.DOT_BF16 and \
            _kernels.cpu_has_amx_bf16() else ""
        held = "one group a super-group" if supers[0] == 1 else \
            f"{supers[0]} groups a super-group (block-diagonal weights)"
        return Bf16Choice(kind, pack, f"bf16 {how}, fp32 accumulation, {held}", degraded)
    pack = packing(spec, kind)
    how = "AMX tiles" if kind is KernelKind.AMX else "AVX512_BF16 dot products"
    folded = ", the filter's columns folded into channels" if pack.folded else ""
    degraded = ""
    if kind is KernelKind.DOT_BF16 and _kernels.cpu_has_amx_bf16():
        degraded = _AMX_REFUSED
    return Bf16Choice(kind, pack, f"bf16 {how}, fp32 accumulation{folded}", degraded)


def warn_missing(choice: Bf16Choice) -> None:
    """One warning per process where the CPU has no bf16 instructions, or where Linux
    refused AMX."""
    if not choice.degraded:
        return
    from .dispatch import warn_once
    if choice.pack is None:
        warn_once("bf16-instructions", f"{choice.degraded}; precision='bf16' is computed "
                                       f"by fp32 kernels on bf16-rounded values (same "
                                       f"results, fp32 speed)")
    else:
        warn_once("bf16-amx", f"{choice.degraded}; the AVX512_BF16 kernels serve "
                              f"precision='bf16' instead")


def _input_arrays(x, layout: str):
    """(array for the kernel, nchw?, bf16 in/out?): fp32 as it is (NCHW packed from its
    layout), bf16 as its bits in NHWC."""
    if is_bfloat16(x):
        bits = bf16_bits(x)
        if layout == "NCHW":
            bits = np.ascontiguousarray(bits.transpose(0, 2, 3, 1))
        return bits, False, True
    return as_float32(x, "input"), layout == "NCHW", False


def _residual_nhwc(residual, layout: str, bf16_out: bool, threads: int):
    """The residual in NHWC and in the output's type (bf16 bits, or fp32)."""
    if residual is None:
        return None
    if is_bfloat16(residual):
        r = bf16_bits(residual) if bf16_out else round_to_bf16(residual)
    else:
        r = as_float32(residual, "residual")
        if bf16_out:
            r = _kernels.bf16_round(r, threads)
    if layout == "NCHW":
        r = np.ascontiguousarray(r.transpose(0, 2, 3, 1))
    return r


def run_call(call, choice: Bf16Choice, x, weights_packed: Optional[np.ndarray],
             weights_fp32, layout: str, nthreads: int, bias, residual, activation,
             negative_slope: float, out):
    """One bf16 call on its bf16 kernel (``choice.pack`` set). ``weights_packed``: the
    kernel's packed weights (or None, packed here from ``weights_fp32``, the layer's fp32
    weights in ``layout``)."""
    from . import epilogue
    fused = epilogue.fused(call, bias, None, activation, negative_slope)
    if residual is not None:
        epilogue.check_residual_shape(call, tuple(np.shape(residual)))
    if out is not None:
        check_out(out, call, ("input", x), ("residual", residual), ("bias", fused.bias))
    warn_missing(choice)
    wb = weights_packed if weights_packed is not None else pack_weights(
        weights_fp32, layout, choice.pack, nthreads)
    return run_packed(call, choice.pack, x, wb, layout, nthreads, fused, residual, out)


def emulated(fp32_call, x, residual, out):
    """A bf16 call with no bf16 kernel: ``fp32_call(x, residual, out)`` (an fp32 conv2d or
    Conv2d call on weights already rounded) on the rounded input and residual, the result
    in ``out``'s type (or the input's)."""
    bf16_in = is_bfloat16(x)
    xr = round_to_bf16(x if bf16_in else as_float32(x, "input"))
    res = None if residual is None else (
        round_to_bf16(residual) if is_bfloat16(residual) else as_float32(residual, "residual"))
    if out is not None and out.dtype == FLOAT32:
        return fp32_call(xr, res, out)
    y = fp32_call(xr, res, None)
    if out is not None:
        out[...] = y.astype(out.dtype)
        return out
    return y.astype(x.dtype) if bf16_in else y


def run_packed(call, pack: Bf16Packing, x, wb: np.ndarray, layout: str, nthreads: int,
               fused, residual, out):
    """A bf16 kernel's call, its arguments checked (``fused``: the call's epilogue
    without its residual, ``residual`` as the caller gave it)."""
    xa, nchw, bf16_in = _input_arrays(x, layout)
    bf16_io = is_bfloat16(out) if out is not None else bf16_in   # the output's type
    if layout == "NCHW" and not bf16_io and writes_nchw(pack):
        # the kernel writes the NCHW output (and reads an NCHW residual) itself
        y = out if out is not None else aligned_empty(call.out_shape)
        res = None if residual is None else (
            round_to_bf16(residual) if is_bfloat16(residual) else as_float32(residual,
                                                                             "residual"))
        run(pack, xa, nchw, wb, y, nthreads, fused.bias, res, fused.activation.code,
            fused.negative_slope, y_nchw=True)
        return y
    direct = out is not None and layout == "NHWC"
    if direct:
        y = bf16_bits(out) if bf16_io else out
    else:
        y = _kernels.empty_aligned_bits(call.nhwc_out_shape) if bf16_io else \
            aligned_empty(call.nhwc_out_shape)
    res = _residual_nhwc(residual, layout, bf16_io, nthreads)
    run(pack, xa, nchw, wb, y, nthreads, fused.bias, res, fused.activation.code,
        fused.negative_slope)
    if direct:
        return out
    if layout == "NCHW":
        y = np.ascontiguousarray(y.transpose(0, 3, 1, 2)) if bf16_io else \
            _kernels.nhwc_to_nchw(y, nthreads)
    if out is not None:
        out[...] = y.view(out.dtype) if bf16_io else y
        return out
    return y.view(x.dtype) if bf16_io else y


def check_out(out, call, *inputs) -> None:
    """The caller's ``out``: float32, or bfloat16 for a bf16 result (whatever the
    input's type), of the output's shape, not overlapping an input."""
    if type(out) is not np.ndarray:
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != FLOAT32 and not is_bfloat16(out):
        raise TypeError(f"out must be float32 or bfloat16, got {out.dtype}")
    if out.shape != call.out_shape:
        raise ValueError(f"out must have the output's shape {call.out_shape} "
                         f"({call.layout}), got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.aligned or not out.flags.writeable:
        raise ValueError("out must be C-contiguous, aligned and writeable")
    for name, array in inputs:
        if array is not None and np.may_share_memory(out, array):
            raise ValueError(f"out overlaps the {name}: the kernels would read what they "
                             f"have already written")


class Bf16Bound:
    """A bf16 layer bound for a program (see ``Conv2d.bound_nhwc``): ``plan`` the
    call's, ``bound_kernel[0]`` the call, ``bits`` whether it writes bf16 bits. Its
    packed-input buffer is its own: a program runs on one thread at a time."""

    def __init__(self, plan, pack: Bf16Packing, wb: np.ndarray, nthreads: int, fused,
                 bits: bool) -> None:
        self.plan = plan
        self.bits = bits
        spec = pack.spec
        xb = _kernels.empty_aligned_bits((_kernels.bf16_input_elems(pack.problem),))
        args = (pack.problem, pack.channels, spec.h, spec.w, spec.pad_top, spec.pad_left,
                _KERNEL_CODES[pack.kind], nthreads)
        options = dict(bias=fused.bias, activation=fused.activation.code,
                       slope=fused.negative_slope, folded=pack.folded, xb=xb)
        conv = _kernels.conv2d_bf16

        def kernel(x: np.ndarray, y: np.ndarray, residual: Optional[np.ndarray]) -> None:
            if residual is not None and residual.dtype != y.dtype:
                # a bf16 value read by a layer writing fp32 (or the other way round)
                residual = (residual.astype(np.uint32) << 16).view(FLOAT32) \
                    if residual.dtype == np.uint16 else _kernels.bf16_round(residual, nthreads)
            conv(x, False, wb, y, *args, residual=residual, **options)
        self.bound_kernel = (kernel,)

    def holds(self) -> bool:
        """A bf16 binding depends on the vector family only: the settings generation
        that a program checks before each run."""
        return True


class RoundingBound:
    """An fp32 layer's binding (``Conv2d.bound_nhwc``, weights already rounded) behind a
    pass that rounds its input to bf16: a bf16 layer that the fp32 kernels serve
    (grouped, depthwise, or no bf16 instructions), bound for a program like the others.
    Its buffers are its own: a program runs on one thread at a time."""

    def __init__(self, inner, nthreads: int, bits: bool) -> None:
        self.plan = inner.plan
        self.bits = bits
        self._inner = inner
        kernel = inner.bound_kernel[0]
        rounded: dict = {}   # input shape: its rounded copy's buffer
        result = aligned_empty(inner.plan.out_shape) if bits else None

        def call(x: np.ndarray, y: np.ndarray, residual: Optional[np.ndarray]) -> None:
            if x.dtype == np.uint16:   # bf16 bits: exact in fp32
                xr = _kernels.bf16_widen(x, nthreads)
            else:
                buffer = rounded.get(x.shape)
                if buffer is None:
                    buffer = rounded[x.shape] = aligned_empty(x.shape)
                xr = _kernels.bf16_round_f32(x, nthreads, buffer)
            if residual is not None and residual.dtype == np.uint16:
                residual = _kernels.bf16_widen(residual, nthreads)
            if bits:
                kernel(xr, result, residual)
                _kernels.bf16_round(result, nthreads, y)
            else:
                kernel(xr, y, residual)
        self.bound_kernel = (call,)

    def holds(self) -> bool:
        return self._inner.holds()
