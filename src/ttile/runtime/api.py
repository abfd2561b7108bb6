"""``ttile.conv2d``: argument checking, layout handling and kernel dispatch.

The semantics are those of ``torch.nn.functional.conv2d`` (bias, stride, padding,
dilation, groups), plus an epilogue fused into the kernels' output store:
``act(conv + bias + residual)``. Everything a caller can get wrong is caught here with a
ValueError or TypeError that names the problem, before any pointer reaches C and before
anything is written to ``out``.

Three kernel families serve a call (``_CallPlan.family``): the dense one (groups 1:
tuned, run-time tuned or generic kernels), the depthwise kernel (groups == channels, one
output channel each) and the generic kernel's grouped form (any other grouping).

Kept free of heavy imports: this is the hot path of every call.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Union

import numpy as np

from .. import _kernels
from ..core.kinds import Activation, Isa, KernelKind
from ..core.vectors import extension_code
from ..core.spec import MIN_FLOPS_PER_THREAD, ConvSpec  # noqa: F401 (re-exported)
from . import dispatch, registry, weight_cache
from .scratch import aligned_empty, scratch

IntPair = Union[int, tuple[int, int]]

#: Which kernel family serves calls: Isa.AUTO (the best this CPU runs), AVX512F, AVX2 or
#: PORTABLE. Change it with :func:`set_isa`, or before import with $TTILE_ISA.
_HAS_AVX512F = _kernels.cpu_has_avx512f()
_HAS_AVX2 = _kernels.cpu_has_avx2()
_isa = Isa.AUTO
_use_tuned = True
#: the extension's number for each vector family


def use_tuned_kernels(enabled: bool) -> bool:
    """Serve registry problems with their tuned kernels (default) or always with the
    generic one (for comparisons and tests); returns the previous setting."""
    global _use_tuned
    previous, _use_tuned = _use_tuned, bool(enabled)
    return previous


def has_avx512f() -> bool:
    """True when this CPU and OS can run the AVX-512F kernels."""
    return _HAS_AVX512F


def has_avx2() -> bool:
    """True when this CPU and OS can run the AVX2 + FMA kernels."""
    return _HAS_AVX2


def set_isa(isa: Union[str, Isa]) -> Isa:
    """Choose the kernel family: "auto", "avx512f", "avx2" or "portable" (or an
    :class:`Isa`); returns the previous one.

    "avx2" runs the AVX2 family on an AVX-512 machine too (for tests, and to measure what
    a CPU without AVX-512 gets). Asking for a family the CPU cannot run raises instead of
    crashing later. $TTILE_ISA sets the same at import.
    """
    global _isa
    try:
        chosen = Isa(isa)
    except ValueError:
        raise ValueError(f"isa must be one of {', '.join(repr(i.value) for i in Isa)}, "
                         f"got {isa!r}") from None
    if chosen is Isa.AVX512F and not _HAS_AVX512F:
        raise ValueError("this CPU (or OS) does not support AVX-512F")
    if chosen is Isa.AVX2 and not _HAS_AVX2:
        raise ValueError("this CPU (or OS) does not support AVX2 with FMA")
    previous, _isa = _isa, chosen
    return previous


def get_isa() -> Isa:
    """The kernel family calls use now: Isa.AVX512F, Isa.AVX2 or Isa.PORTABLE (equal to
    the strings "avx512f", "avx2" and "portable")."""
    if _isa is Isa.AUTO:
        return Isa.AVX512F if _HAS_AVX512F else Isa.AVX2 if _HAS_AVX2 else Isa.PORTABLE
    return _isa


def _isa_from_environment() -> None:
    """$TTILE_ISA (auto, avx512f, avx2, portable): the family for this process."""
    value = os.environ.get("TTILE_ISA", "").strip().lower()
    if value:
        try:
            set_isa(value)
        except ValueError as exc:
            raise ImportError(f"TTILE_ISA={value!r}: {exc}") from None


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memory_limit_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


#: Largest stride or padding accepted: the kernels index with 64-bit offsets but take
#: these as C ints.
MAX_EXTENT = 2**31 - 1
#: More threads than this is a mistake, not a request (OpenMP would try to start them).
MAX_THREADS = 1024


def _strict_int(item, message: str) -> int:
    """``item`` as an int if it is an integer (numpy ones included) and not a bool;
    otherwise TypeError(message)."""
    if isinstance(item, (bool, np.bool_)):
        raise TypeError(message)
    try:
        return operator.index(item)
    except TypeError:
        raise TypeError(message) from None


def _as_pair(value, name: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
        items = tuple(value)
    else:
        items = (value, value)
    pair = []
    for item in items:
        number = _strict_int(item, f"{name} must be an int or a pair of ints, got {value!r}")
        if number < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
        if number > MAX_EXTENT:
            raise ValueError(f"{name} must be <= {MAX_EXTENT}, got {value!r}")
        pair.append(number)
    return pair[0], pair[1]


_FLOAT32 = np.dtype(np.float32)


def _as_float32(array, name: str) -> np.ndarray:
    """A C-contiguous, aligned float32 view or copy of ``array``; refuses what is not real."""
    if type(array) is np.ndarray and array.dtype == _FLOAT32:
        flags = array.flags
        if flags.c_contiguous and flags.aligned:
            return array  # the common case, kept to a few attribute reads
    if not isinstance(array, np.ndarray):
        try:
            array = np.asarray(array)
        except Exception as exc:  # e.g. ragged nested lists
            raise TypeError(f"{name} cannot be read as an array: {exc}") from None
    kind = array.dtype.kind
    if kind == "b":
        raise TypeError(f"{name} has dtype bool; convolution needs a real numeric dtype")
    if kind == "c":
        raise TypeError(f"{name} has complex dtype {array.dtype}; only real inputs are supported")
    if kind not in "fiu":
        raise TypeError(f"{name} has dtype {array.dtype}; expected float32 (float16, float64 "
                        f"and integer arrays are converted to float32)")
    return np.require(array, dtype=np.float32, requirements=("C", "A"))


def _padding(padding, r: int, s: int, stride: tuple[int, int],
             dilation: tuple[int, int] = (1, 1)) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) for torch's padding argument."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding == "same":
            if stride != (1, 1):
                raise ValueError("padding='same' is not supported for strided convolutions "
                                 "(as in torch); pass explicit padding instead")
            total_h, total_w = (r - 1) * dilation[0], (s - 1) * dilation[1]
            top, left = total_h // 2, total_w // 2
            return top, total_h - top, left, total_w - left
        raise ValueError(f"padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
    if isinstance(padding, (tuple, list)) and len(padding) == 2 \
            and all(isinstance(side, (tuple, list)) for side in padding):
        # ((top, bottom), (left, right)): the asymmetric padding an ONNX model may carry
        # (auto_pad SAME_* with a stride, explicit pads); torch needs F.pad for it.
        top, bottom = _as_pair(padding[0], "padding", 0)
        left, right = _as_pair(padding[1], "padding", 0)
        return top, bottom, left, right
    ph, pw = _as_pair(padding, "padding", 0)
    return ph, ph, pw, pw


def _threads(threads) -> int:
    if threads is None:
        return _default_threads()
    count = _strict_int(threads, f"threads must be a positive int or None, got {threads!r}")
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    if count > MAX_THREADS:
        raise ValueError(f"threads must be <= {MAX_THREADS}, got {count}")
    return count


def _groups(groups) -> int:
    count = _strict_int(groups, f"groups must be a positive int, got {groups!r}")
    if count < 1:
        raise ValueError(f"groups must be >= 1, got {count}")
    return count


def make_spec(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: IntPair = 1,
              padding: Union[IntPair, str] = 0, layout: str = "NCHW",
              dilation: IntPair = 1, groups: int = 1) -> ConvSpec:
    """The ConvSpec of a conv2d call - of one group's convolution when ``groups`` > 1 -
    checking ranks, channels and sizes."""
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    if len(x_shape) != 4:
        raise ValueError(f"input must have 4 dimensions ({layout}), got {len(x_shape)}: "
                         f"shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        expected = "(K, C, R, S)" if layout == "NCHW" else "(R, S, C, K)"
        raise ValueError(f"weights must have 4 dimensions {expected}, got {len(w_shape)}: "
                         f"shape {tuple(w_shape)}")
    if layout == "NCHW":
        n, c, h, w = x_shape
        k, wc, r, s = w_shape
    else:
        n, h, w, c = x_shape
        r, s, wc, k = w_shape
    if 0 in x_shape or 0 in w_shape:
        raise ValueError(f"zero-size dimension: input {tuple(x_shape)}, weights {tuple(w_shape)}")
    g = _groups(groups)
    if c % g:
        raise ValueError(f"input channels ({c}) are not divisible by groups ({g})")
    if k % g:
        raise ValueError(f"output channels ({k}) are not divisible by groups ({g})")
    if wc * g != c:
        if g == 1:
            raise ValueError(f"channel mismatch: input has {c} channels, weights expect {wc}")
        raise ValueError(f"channel mismatch: input has {c} channels, {g} groups of weights "
                         f"with {wc} each expect {wc * g}")
    sh, sw = _as_pair(stride, "stride", 1)
    dh, dw = _as_pair(dilation, "dilation", 1)
    pt, pb, pl, pr = _padding(padding, r, s, (sh, sw), (dh, dw))
    span_h, span_w = (r - 1) * dh + 1, (s - 1) * dw + 1
    if h + pt + pb < span_h or w + pl + pr < span_w:
        raise ValueError(f"kernel {span_h}x{span_w} (dilated) is larger than the padded input "
                         f"{h + pt + pb}x{w + pl + pr}")
    return ConvSpec(n=n, k=k // g, c=wc, h=h, w=w, r=r, s=s, stride_h=sh, stride_w=sw,
                    pad_top=pt, pad_bottom=pb, pad_left=pl, pad_right=pr,
                    dilation_h=dh, dilation_w=dw)


class Family(Enum):
    """Which kernels can serve a call (see the module docstring)."""

    DENSE = "dense"            # groups 1: tuned, run-time tuned or generic
    DEPTHWISE = "depthwise"    # groups == channels, one output channel per group
    GROUPED = "grouped"        # any other grouping: the generic kernel, group by group


def _family(spec: ConvSpec, groups: int) -> Family:
    """The family of ``groups`` convolutions of one group's problem ``spec``."""
    if groups == 1:
        return Family.DENSE
    return Family.DEPTHWISE if spec.c == 1 and spec.k == 1 else Family.GROUPED


@dataclass(frozen=True)
class _CallPlan:
    """What conv2d derives from a call's shapes and options, computed once per signature.

    ``spec`` is one group's problem; ``out_shape`` the whole output in the call's layout.
    ``choices`` remembers, per (thread count, ISA, tuned kernels on?, per call?), the
    kernel that serves the call once that is final (a background tuning may still
    replace a provisional choice).
    """

    spec: ConvSpec
    layout: str
    out_shape: tuple[int, int, int, int]
    max_threads: int
    groups: int = 1
    family: "Family" = None  # set in __post_init__
    choices: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", _family(self.spec, self.groups))

    @property
    def channels_out(self) -> int:
        return self.spec.k * self.groups

    def fit(self, threads: int) -> int:
        """The threads a call of this problem uses when ``threads`` are asked for: no
        more than its work keeps busy (see :data:`MIN_FLOPS_PER_THREAD`)."""
        return threads if threads <= self.max_threads else self.max_threads




def tuned_kernels() -> list[dict]:
    """The searched kernels compiled into this build, for every CPU they were tuned on:
    problem fields, ``cpu`` (fingerprint id) and ``threads`` they were measured at,
    ``scheme``, measured ``gflops``, ``panel``, ``layer``. Each serves only on its CPU at
    its thread count (``plan`` says what serves a call)."""
    return [e.to_dict() for e in registry.KERNELS]


#: Input and output bytes per thread of a depthwise call (see ``_plan``): 7x7 layers of
#: 960 channels (376 KB) ran in 10 us on two threads, 16 on one.
DEPTHWISE_BYTES_PER_THREAD = 128 * 1024

#: The narrowest output rows the NCHW depthwise kernel serves (it puts 16 outputs of a
#: row in the vector lanes): on a Zen 4 core, 1 thread, it took 0.46-0.83x the time of
#: converting around the NHWC kernel on rows of 10 to 112 outputs, and 1.22-1.33x on rows
#: of 7 (MobileNet's 7x7 layers and 14x14 stride-2 ones), where most lanes are idle.
DEPTHWISE_NCHW_MIN_WIDTH = 8

#: The largest weights the NCHW pointwise kernel serves: it reads all of them once per
#: 64-pixel column, from the caches; Yolo9000-23's 115 MB came from memory for each of its
#: 5 columns (195 ms against 171 through the generic kernel, Zen 4, 1 thread).
POINTWISE_MAX_WEIGHT_BYTES = 8 << 20

_plans: dict[tuple, _CallPlan] = {}
_MAX_PLANS = 4096


def _exact_key(value):
    """``value`` if it is an int, str or pair of ints by exact type, else None.

    Exact types keep the plan cache from conflating 1 with True or 1.0, which must still
    be refused by the full checks.
    """
    kind = type(value)
    if kind is int or kind is str:
        return value
    if kind is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return value
    if kind is tuple and len(value) == 2 and all(_exact_key(side) is side and type(side) is
                                                 tuple for side in value):
        return value   # ((top, bottom), (left, right))
    return None


def _plan(x_shape, w_shape, stride, padding, layout, dilation=1, groups=1) -> _CallPlan:
    stride_key, padding_key = _exact_key(stride), _exact_key(padding)
    dilation_key = _exact_key(dilation)
    key = None
    if stride_key is not None and padding_key is not None and dilation_key is not None \
            and type(layout) is str and type(groups) is int:
        key = (x_shape, w_shape, stride_key, padding_key, layout, dilation_key, groups)
        plan = _plans.get(key)
        if plan is not None:
            return plan
    spec = make_spec(x_shape, w_shape, stride, padding, layout, dilation, groups)
    g = _groups(groups)
    k = spec.k * g
    out_bytes = 4 * spec.n * k * spec.ho * spec.wo
    if out_bytes > _memory_limit_bytes():
        raise ValueError(f"output of shape ({spec.n}, {k}, {spec.ho}, {spec.wo}) needs "
                         f"{out_bytes / 2**30:.1f} GiB, more than this machine's memory")
    out_shape = ((spec.n, k, spec.ho, spec.wo) if layout == "NCHW"
                 else (spec.n, spec.ho, spec.wo, k))
    threads = spec.useful_threads(g)
    if _family(spec, g) is Family.DEPTHWISE:
        # depthwise: R*S FMAs per output, bound by memory rather than FMAs; a thread per
        # 4 MFLOP kept MobileNetV2's 112x112 layers (7 MFLOP) on one thread, where two
        # ran them in half the time (a thread per 128 KB of input and output instead)
        moved = 4 * g * (spec.n * spec.h * spec.w + spec.n * spec.ho * spec.wo)
        threads = max(1, moved // DEPTHWISE_BYTES_PER_THREAD)
    plan = _CallPlan(spec, layout, out_shape, threads, g)
    if key is not None and len(_plans) < _MAX_PLANS:
        _plans[key] = plan
    return plan


def _choice(plan: _CallPlan, nthreads: int, per_call: bool = True) -> dispatch.KernelChoice:
    """The kernel serving ``plan`` on ``nthreads`` threads (tuning it if the policy says
    so), for a per-call ``conv2d`` or for a ``Conv2d`` with its weights packed."""
    isa = get_isa()
    cache_key = (nthreads, isa, _use_tuned, per_call)
    choice = plan.choices.get(cache_key)
    if choice is None:
        choice = _family_choice(plan, isa, nthreads, per_call)
        if choice is None:
            choice = dispatch.for_call(
                dispatch.choose(plan.spec, plan.layout, nthreads, isa, _use_tuned),
                plan.spec, plan.layout, per_call, nthreads, isa)
        if choice.final:
            plan.choices[cache_key] = choice
    return choice


def _searched_nchw_entry(spec: ConvSpec, nthreads: int, isa: Isa, per_call: bool) -> bool:
    """Whether the registry serves an NCHW call of ``spec`` here with a searched kernel
    through its NCHW entry point (and a per-call call keeps it rather than the generic
    kernel, see ``dispatch.for_call``)."""
    if not _use_tuned:
        return False
    entry = registry.lookup(spec, nthreads, isa=isa)
    if entry is None or entry.kind is not KernelKind.TUNED or not entry.nchw:
        return False
    choice = dispatch.for_call(dispatch.registry_choice(entry, isa), spec, "NCHW", per_call,
                               nthreads, isa)
    return choice.kind is KernelKind.TUNED


def _family_choice(plan: _CallPlan, isa: Isa, nthreads: int,
                   per_call: bool) -> Optional[dispatch.KernelChoice]:
    """The kernel of a depthwise or grouped call, or of an NCHW 1x1 call (None for any
    other dense call: dispatch decides)."""
    if plan.family is Family.DENSE:
        spec = plan.spec
        if plan.layout == "NCHW" and isa is Isa.AVX512F and spec.r == spec.s == 1 \
                and spec.pad_top == spec.pad_bottom == spec.pad_left == spec.pad_right == 0 \
                and 4 * spec.k * spec.c <= POINTWISE_MAX_WEIGHT_BYTES:
            # a matrix product per image in torch's layout: on a Zen 4 core it took 0.35-0.9x
            # the time of the searched kernels' NCHW entry points and of converting around
            # the NHWC kernels (Yolo9000-5: 4.0 ms against 8.7; MobileNetV2's 96->24
            # projection at 56x56: 0.15 against 0.41). A strided layer runs on the pixels
            # it reads, gathered first (ResNet18-5 and -11 on a Zen 5 core: 0.105 and 0.092
            # ms converting around the NHWC kernel, 0.069 and 0.072 gathered by numpy)
            strided = spec.stride_h > 1 or spec.stride_w > 1
            if strided and _searched_nchw_entry(spec, nthreads, isa, per_call):
                # a searched kernel's NCHW entry point reads just those pixels, with no
                # gathering pass (ResNet18-5, Zen 5, 2 threads: 0.037 ms against 0.042)
                return None
            note = ("the NCHW pointwise kernel (a matrix product per image in torch's "
                    "layout" + (", on the strided pixels gathered first)" if strided
                                else ", nothing converted)"))
            return dispatch.KernelChoice(kind=KernelKind.POINTWISE, problem=spec, panel=0,
                                         nchw=True, note=note)
        return None
    if plan.family is Family.DEPTHWISE and isa is Isa.AVX512F:
        if plan.layout == "NCHW" and plan.spec.wo >= DEPTHWISE_NCHW_MIN_WIDTH \
                and _kernels.depthwise_nchw_supported(plan.spec.s, plan.spec.stride_w):
            return dispatch.KernelChoice(kind=KernelKind.DEPTHWISE, problem=plan.spec,
                                         panel=0, nchw=True,
                                         note="the NCHW depthwise kernel (16 outputs of a "
                                              "row in the vector lanes, nothing converted)")
        return dispatch.KernelChoice(kind=KernelKind.DEPTHWISE, problem=plan.spec, panel=0,
                                     note="the depthwise kernel (channels in the vector "
                                          "lanes)")
    return dispatch.generic_choice(isa, plan.spec, f"the generic kernel, {plan.groups} groups")


@dataclass(frozen=True)
class _Fused:
    """The epilogue of one call, checked: what the kernels fuse into their store."""

    bias: Optional[np.ndarray] = None      # float32, (K,)
    residual: Optional[np.ndarray] = None  # float32, the output's shape and layout
    activation: Activation = Activation.NONE
    negative_slope: float = 0.01

    def kwargs(self, residual: Optional[np.ndarray] = None) -> dict:
        """Keyword arguments of the _kernels entry points (``residual`` replaces the
        call's, when the kernel writes another layout)."""
        return {"bias": self.bias,
                "residual": self.residual if residual is None else residual,
                "activation": self.activation.code, "slope": self.negative_slope}


_BARE = _Fused()


def _activation(activation) -> Activation:
    if activation is None:
        return Activation.NONE
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        try:
            return Activation(activation)
        except ValueError:
            pass
    names = ", ".join(repr(a.value) for a in Activation if a is not Activation.NONE)
    raise ValueError(f"unknown activation {activation!r}; expected None or one of {names}")


def _slope(negative_slope) -> float:
    if isinstance(negative_slope, (bool, np.bool_)) or not isinstance(
            negative_slope, (int, float, np.integer, np.floating)):
        raise TypeError(f"negative_slope must be a real number, got {negative_slope!r}")
    value = float(negative_slope)
    if not np.isfinite(value):
        raise ValueError(f"negative_slope must be finite, got {negative_slope!r}")
    return value


def _bias(bias, channels: int) -> Optional[np.ndarray]:
    if bias is None:
        return None
    array = _as_float32(bias, "bias")
    if array.ndim != 1 or array.shape[0] != channels:
        raise ValueError(f"bias must have shape ({channels},) (one value per output "
                         f"channel), got {array.shape}")
    return array


def _fused(plan: _CallPlan, bias, residual, activation, negative_slope) -> _Fused:
    if bias is None and residual is None and activation is None:
        return _BARE
    fused_residual = None
    if residual is not None:
        fused_residual = _as_float32(residual, "residual")
        if fused_residual.shape != plan.out_shape:
            raise ValueError(f"residual must have the output's shape {plan.out_shape} "
                             f"({plan.layout}), got {fused_residual.shape}")
    return _Fused(_bias(bias, plan.channels_out), fused_residual, _activation(activation),
                  _slope(negative_slope))


def _out(out, plan: _CallPlan, *inputs) -> Optional[np.ndarray]:
    """The caller's ``out`` checked (None: allocate); refused when it overlaps an input."""
    if out is None:
        return None
    if type(out) is not np.ndarray:
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != _FLOAT32:
        raise TypeError(f"out must be float32, got {out.dtype}")
    if out.shape != plan.out_shape:
        raise ValueError(f"out must have the output's shape {plan.out_shape} ({plan.layout}), "
                         f"got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.aligned:
        raise ValueError("out must be C-contiguous and aligned")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    for name, array in inputs:
        if array is not None and np.may_share_memory(out, array):
            raise ValueError(f"out overlaps the {name}: the kernels would read what they "
                             f"have already written")
    return out


def _nhwc_shape(plan: _CallPlan) -> tuple[int, int, int, int]:
    spec = plan.spec
    return (spec.n, spec.ho, spec.wo, plan.channels_out)


def _generic_args(spec: ConvSpec) -> tuple:
    return (spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left)


def _run_searched(choice: dispatch.KernelChoice, x: np.ndarray, weights: np.ndarray,
                  y: np.ndarray, nthreads: int, fused: dict, nchw_out: bool = False) -> None:
    """A tuned or JIT kernel on arrays of exactly its problem's shapes (``nchw_out``: its
    NCHW entry point, x, y and the residual in NCHW)."""
    if choice.kind is KernelKind.TUNED:
        _kernels.run_tuned(choice.index, x, weights, y, nthreads, **fused, nchw_out=nchw_out)
    else:
        # The kernel's sizes are those of the problem it was compiled for: the arrays
        # are checked against that problem, not against themselves.
        problem = choice.problem
        n, ho, wo, k = problem.output_shape()
        _, h, w, c = problem.input_shape()
        _kernels.run_compiled(choice.address_nchw if nchw_out else choice.address, x,
                              weights, y, nthreads,
                              (n, c, h, w) if nchw_out else (n, h, w, c),
                              problem.packed_weight_shape(choice.panel),
                              (n, k, ho, wo) if nchw_out else (n, ho, wo, k), **fused,
                              nchw_out=nchw_out)


def _run(choice: dispatch.KernelChoice, plan: _CallPlan, x: np.ndarray, weights: np.ndarray,
         y: np.ndarray, nthreads: int, fused: dict) -> None:
    """Run ``choice`` on NHWC x into NHWC y with the epilogue ``fused`` (_Fused.kwargs);
    ``weights`` are in the kernel's format (panels of ``choice.panel``, RSCK for panel 0;
    (R, S, 1, C) for the NHWC depthwise kernel; KCRS for the vector generic kernel,
    grouped)."""
    kind, spec = choice.kind, plan.spec
    dilation = {"dil_h": spec.dilation_h, "dil_w": spec.dilation_w}
    if kind in (KernelKind.TUNED, KernelKind.JIT):
        if choice.problem.n == spec.n:
            _run_searched(choice, x, weights, y, nthreads, fused)
            return
        # a kernel searched for one image, on a batch: image by image (NHWC images are
        # contiguous, so the slices are views)
        residual = fused["residual"]
        for i in range(spec.n):
            one = dict(fused, residual=None if residual is None else residual[i:i + 1])
            _run_searched(choice, x[i:i + 1], weights, y[i:i + 1], nthreads, one)
    elif kind is KernelKind.DEPTHWISE:
        _kernels.conv2d_depthwise(x, weights, y, *_generic_args(spec), nthreads, **dilation,
                                  **fused)
    elif choice.panel:
        # 4-D weights: RSCK for a dense NHWC call, KCRS for NCHW and grouped calls
        kcrs = weights.ndim == 4 and (plan.family is not Family.DENSE or plan.layout == "NCHW")
        _kernels.conv2d_generic_packed(x, weights, y, *_generic_args(spec), nthreads, False,
                                       kcrs, groups=plan.groups, **dilation, **fused,
                                       isa=extension_code(choice.isa))
    else:
        _kernels.conv2d_generic_nhwc(x, weights, y, *_generic_args(spec), nthreads,
                                     _kernels.ISA_PORTABLE, groups=plan.groups, **dilation,
                                     **fused)


def _execute(plan: _CallPlan, choice: dispatch.KernelChoice, x: np.ndarray,
             weights: np.ndarray, nthreads: int, fused: _Fused = _BARE,
             out: Optional[np.ndarray] = None) -> np.ndarray:
    """Run ``choice`` on input ``x`` in the plan's layout with weights already in the
    kernel's format, the epilogue fused; returns the output (``out`` when given).

    A searched kernel with an NCHW entry point (``choice.nchw``) reads the NCHW input and
    writes the NCHW output itself (tiles buffered and transposed in cache), the residual
    as it is; so do the NCHW pointwise kernel and the NCHW depthwise kernel (a depthwise
    choice with ``nchw``), with torch's weights. Otherwise an NCHW input is converted to
    NHWC by one blocked, parallel pass into a per-thread scratch buffer, unless the
    vector generic kernel reads it as it is (``_generic_reads_nchw``); that kernel
    (AVX-512F or AVX2) writes the NCHW output directly (and takes the NCHW residual as it
    is), other kernels' NHWC output is converted back by a second pass (and an NCHW
    residual converted for them first)."""
    spec = plan.spec
    if plan.layout == "NHWC":
        if out is not None:
            y = out
        elif choice.kind is KernelKind.DEPTHWISE and plan.out_shape[-1] % 16 == 0:
            y = aligned_empty(plan.out_shape, x)   # stores along x's lines, as its loads
        else:
            y = aligned_empty(plan.out_shape)
        _run(choice, plan, x, weights, y, nthreads, fused.kwargs())
        return y
    if choice.kind is KernelKind.POINTWISE:
        # the NCHW 1x1 kernel: x, y, the residual and torch's (K, C, 1, 1) weights as
        # they are (family_weights gives a Conv2d's back in that layout); a strided
        # layer's pixels gathered into a scratch input first
        if spec.stride_h > 1 or spec.stride_w > 1:
            x = _kernels.subsample_nchw(x, spec.stride_h, spec.stride_w, nthreads,
                                        scratch("x", (spec.n, spec.c, spec.ho, spec.wo)))
        y = out if out is not None else aligned_empty(plan.out_shape)
        _kernels.conv2d_pointwise_nchw(x, weights, y, nthreads, **fused.kwargs())
        return y
    if choice.kind is KernelKind.DEPTHWISE and choice.nchw:
        # the NCHW depthwise kernel: x, y, the residual and torch's weights as they are
        y = out if out is not None else aligned_empty(plan.out_shape)
        _kernels.conv2d_depthwise_nchw(x, weights, y, *_generic_args(spec), nthreads,
                                       dil_h=spec.dilation_h, dil_w=spec.dilation_w,
                                       **fused.kwargs())
        return y
    if choice.nchw and choice.problem.n == spec.n:
        # a searched kernel's NCHW entry point: reads x and writes y in NCHW itself
        y = out if out is not None else aligned_empty(plan.out_shape)
        _run_searched(choice, x, weights, y, nthreads, fused.kwargs(), nchw_out=True)
        return y
    isa = _layout_isa()
    vector_generic = choice.kind is KernelKind.GENERIC and choice.panel
    # the vector generic kernel reads the NCHW input as it is where that measured faster
    # than converting it
    nchw_in = vector_generic and _generic_reads_nchw(plan, nthreads, choice.isa)
    if not nchw_in:
        x = _kernels.nchw_to_nhwc(x, nthreads, scratch("x", spec.input_shape()[:3]
                                                       + (spec.c * plan.groups,)), isa)
    if vector_generic:
        # the vector generic kernel writes NCHW from its tiles: no second pass; it
        # takes KCRS weights (a per-call conv2d) or packed ones (Conv2d)
        y = out if out is not None else aligned_empty(plan.out_shape)
        _kernels.conv2d_generic_packed(x, weights, y, *_generic_args(spec), nthreads, True,
                                       weights.ndim == 4, groups=plan.groups,
                                       dil_h=spec.dilation_h, dil_w=spec.dilation_w,
                                       **fused.kwargs(), isa=extension_code(choice.isa),
                                       nchw_in=nchw_in)
        return y
    nhwc = _nhwc_shape(plan)
    residual = None
    if fused.residual is not None:
        residual = _kernels.nchw_to_nhwc(fused.residual, nthreads, scratch("r", nhwc), isa)
    y = scratch("y", nhwc)
    if y is None:
        y = np.empty(nhwc, dtype=_FLOAT32)
    _run(choice, plan, x, weights, y, nthreads, fused.kwargs(residual))
    return _kernels.nhwc_to_nchw(y, nthreads, out, isa)


#: Input bytes per FLOP from which the AVX-512 generic kernel reads an NCHW call's input
#: as it is rather than converting it first, on one thread and on several (see
#: _generic_reads_nchw).
GENERIC_NCHW_IN_BYTES_PER_FLOP = 2e-3
GENERIC_NCHW_IN_BYTES_PER_FLOP_THREADS = 0.6e-3


def _generic_reads_nchw(plan: _CallPlan, nthreads: int, isa: Isa) -> bool:
    """Whether the vector generic kernel reads this NCHW call's input in place.

    Reading NCHW, each pixel's channels are a plane apart, and a register block's
    broadcasts come from as many lines as it has pixels: 2-9 % slower than the NHWC call
    on the Fig. 8 layers (Zen 5), against a conversion pass over the input. On several
    threads the pass also costs the kernel: split among the threads by pixels, its
    output is read by threads that take panel groups across all rows, half of it from
    the other core's cache (ResNet18-7, 2 threads: conversion + kernel 0.30 ms, reading
    NCHW 0.245, NHWC 0.230). So reading in place pays where the input is large for the
    work. On one thread: from 3.4e-3 input bytes per FLOP (Yolo9000-2, ResNet18-2, -4,
    -7) it was 3-7 % faster; at 1.7e-3, 4 % faster (Yolo9000-4), even (ResNet18-6) or 4 %
    slower (ResNet18-10); below, 1-5 % slower. On two: 1-6 % faster down to 0.87e-3
    (ResNet18-9), even or 3-5 % slower at 0.43e-3 and 0.22e-3 (Yolo9000-12, ResNet18-12,
    Yolo9000-18). Inputs of fewer than 8 channels convert: NHWC's contiguous (s, c)
    steps served a 3-channel 7x7 layer 10 % faster. Measured on the AVX-512 family only;
    the AVX2 one converts."""
    spec = plan.spec
    if isa is not Isa.AVX512F or spec.c < 8:
        return False
    input_bytes = 4 * spec.n * spec.c * spec.h * spec.w   # per group, as spec.flops
    per_flop = (GENERIC_NCHW_IN_BYTES_PER_FLOP_THREADS if nthreads > 1
                else GENERIC_NCHW_IN_BYTES_PER_FLOP)
    return input_bytes >= per_flop * spec.flops


def _layout_isa() -> Optional[int]:
    """The layout conversions' ISA: AVX-512 tiles only in the AVX-512F family (a call
    held to AVX2 runs no AVX-512 instruction anywhere), else portable C."""
    return None if get_isa() is Isa.AVX512F else _kernels.ISA_PORTABLE


def family_weights(w: np.ndarray, layout: str, plan: _CallPlan,
                   choice: dispatch.KernelChoice) -> Optional[np.ndarray]:
    """The weights of a depthwise, grouped or NCHW pointwise call in its kernel's format
    (None for any other dense call): (R, S, 1, C) for the NHWC depthwise kernel, torch's
    (C, 1, R, S) for the NCHW one, KCRS for the vector generic kernel (its threads pack
    each group's panels), RSCK for the portable one; torch's (K, C, 1, 1) for the NCHW
    pointwise kernel."""
    if choice.kind is KernelKind.POINTWISE:
        # KCRS as a per-call conv2d has it; a Conv2d's RSCK transposed back once: read as
        # (C, K), each input channel's weights are K floats apart, a page apart on wide
        # layers (Yolo9000-23: 2.8x slower than from KCRS on a Zen 4)
        spec = plan.spec
        return w if w.shape == (spec.k, spec.c, 1, 1) \
            else np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    if plan.family is Family.DENSE:
        return None
    if choice.kind is KernelKind.DEPTHWISE:
        if choice.nchw or layout == "NHWC":
            return w   # (C, 1, R, S) for the NCHW kernel, (R, S, 1, C) for the NHWC one
        return np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    if choice.panel:  # KCRS (K, C/groups, R, S)
        return w if layout == "NCHW" else np.ascontiguousarray(w.transpose(3, 2, 0, 1))
    return np.ascontiguousarray(w.transpose(2, 3, 1, 0)) if layout == "NCHW" else w


def _pack_per_call(w: np.ndarray, layout: str, plan: _CallPlan,
                   choice: dispatch.KernelChoice, nthreads: int) -> np.ndarray:
    """The weights of one call in the kernel's format (panels of width ``panel``, or RSCK
    for 0), packed in one parallel pass into this thread's scratch buffer: KCRS straight
    into panels for NCHW, RSCK into panels for NHWC (RSCK already is the format of
    panel 0, and of a panel as wide as K). The vector generic kernel takes the weights as
    they are (RSCK, or KCRS): its threads pack the panels they use into buffers of their own,
    so the weights are read once instead of read, written and read back (ResNet18-12 per
    call at 2 threads, caches cold: 1.35 ms packed beforehand against 0.73 pre-packed)."""
    grouped = family_weights(w, layout, plan, choice)
    if grouped is not None:
        return grouped
    spec, panel = plan.spec, choice.panel
    if choice.kind is KernelKind.GENERIC and panel:
        return w  # RSCK or KCRS: the kernel's threads pack what they use
    if layout == "NCHW":
        shape = spec.weight_shape() if panel == 0 else spec.packed_weight_shape(panel)
        return _kernels.pack_weights_kcrs(w, panel, nthreads, scratch("w", shape),
                                          _layout_isa())
    if panel == 0 or panel == spec.k:
        return _kernels.pack_weights(w, panel, nthreads) if panel else w
    return _kernels.pack_weights(w, panel, nthreads,
                                 scratch("w", spec.packed_weight_shape(panel)))


def conv2d(x, w, bias=None, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
           dilation: IntPair = 1, groups: int = 1, *, layout: str = "NCHW",
           threads: int | None = None, activation: Optional[str] = None,
           negative_slope: float = 0.01, residual=None, out=None) -> np.ndarray:
    """2D convolution with the semantics of ``torch.nn.functional.conv2d``, and an
    epilogue fused into the kernel's output store: ``act(conv(x, w) + bias + residual)``.

    Args:
        x: input, (N, C, H, W) for layout "NCHW" or (N, H, W, C) for "NHWC".
        w: weights, (K, C/groups, R, S) for "NCHW" or (R, S, C/groups, K) for "NHWC".
        bias: None or (K,) values added to each output channel.
        stride: int or (sh, sw), >= 1.
        padding: int, (ph, pw), "same" (stride 1 only; the odd extra row/column goes to
            the bottom/right, as in torch), "valid", or ((top, bottom), (left, right))
            for different padding on each side (as an ONNX Conv's pads may be).
        dilation: int or (dh, dw), >= 1: the spacing of the kernel's taps.
        groups: input and output channels are split into this many groups, each
            convolved with its own weights (groups == C: depthwise).
        layout: "NCHW" (default) or "NHWC", the kernels' native layout: NHWC runs with
            no transposition.
        threads: number of threads, default all CPUs this process may use; a small
            problem uses fewer (one thread per 4 MFLOP of work at most).
        activation: None, "relu", "relu6", "leaky_relu" (with ``negative_slope``),
            "silu" or "sigmoid", applied last.
        residual: None or an array of the output's shape (in ``layout``) added before
            the activation (a ResNet shortcut).
        out: None, or a C-contiguous float32 array of the output's shape written in
            place and returned (it must not overlap x, w, bias or residual).

    A problem with no kernel tuned into ttile is tuned on its first call (a search of
    at most 20 s by default, then cached on disk for later processes), in the
    background, or never: see :func:`ttile.set_tuning`. Weights are packed for the
    kernel on every call (one parallel pass into a reused per-thread buffer, or by the
    generic kernel's threads as they go), except where the same array comes back
    unchanged on many threads (or for a searched kernel in NHWC): then the weights
    packed on its first call are reused, see :func:`ttile.set_weight_cache`.
    :class:`ttile.Conv2d` packs them once.

    Returns:
        float32 output, (N, K, Ho, Wo) for "NCHW", (N, Ho, Wo, K) for "NHWC".
        float16, float64 and integer inputs are converted to float32.

    Raises:
        ValueError: wrong ranks or channels, channels not divisible by groups, zero
            sizes, bad stride/padding/dilation/threads, kernel larger than the padded
            input, bias/residual/out of the wrong shape, out overlapping an input, an
            unknown activation, output too large for memory. Nothing is written to
            ``out`` then.
        TypeError: non-numeric, bool or complex data; non-integer stride or padding;
            ``out`` not a float32 numpy array.
    """
    x_arr = _as_float32(x, "input")
    w_arr = _as_float32(w, "weights")
    plan = _plan(x_arr.shape, w_arr.shape, stride, padding, layout, dilation, groups)
    fused = _fused(plan, bias, residual, activation, negative_slope)
    y = _out(out, plan, ("input", x_arr), ("weights", w_arr), ("bias", fused.bias),
             ("residual", fused.residual))
    nthreads = plan.fit(threads if type(threads) is int and 0 < threads <= MAX_THREADS
                        else _threads(threads))
    weights, choice = _call_weights(w_arr, w_arr is w, plan, nthreads)
    return _execute(plan, choice, x_arr, weights, nthreads, fused, y)


def _call_weights(w: np.ndarray, callers: bool, plan: _CallPlan,
                  nthreads: int) -> tuple[np.ndarray, dispatch.KernelChoice]:
    """The weights of a per-call conv2d in its kernel's format, and that kernel: the
    packed weights a Conv2d would hold, with its kernel, when ``w`` (the caller's own
    array, ``callers``) holds the bytes they were packed from on an earlier call (see
    weight_cache); else the per-call kernel, its weights packed for this call.

    The reuse serves calls on many threads (``weight_cache.MIN_THREADS``), and NHWC
    calls whose per-call kernel would pack its weights in a pass of its own: checking
    RSCK weights against their panels reads what that pass reads and writes nothing.
    Below that thread count the generic kernel's threads pack what they use as they go,
    reading the weights once, where a check reads them and the panels (a 16-core Xeon at
    1-4 threads: 0.95-1.30 of the time without it on the generic kernel's layers)."""
    choice = _choice(plan, nthreads)
    if callers and plan.family is Family.DENSE and w.nbytes >= weight_cache.MIN_BYTES:
        separate_pass = plan.layout == "NHWC" and choice.kind in _SEARCHED \
            and choice.panel not in (0, plan.spec.k)
        if separate_pass or nthreads >= weight_cache.MIN_THREADS:
            packed_choice = _choice(plan, nthreads, per_call=False)
            pack = _panel_packer(plan, packed_choice, nthreads)
            if pack is not None:
                packed = weight_cache.CACHE.packed(
                    w, (plan.layout, packed_choice.panel), pack, nthreads,
                    rsck=plan.layout == "NHWC", isa=_layout_isa())
                if packed is not None:
                    return packed, packed_choice
    return _pack_per_call(w, plan.layout, plan, choice, nthreads), choice


_SEARCHED = (KernelKind.TUNED, KernelKind.JIT)


def _panel_packer(plan: _CallPlan, choice: dispatch.KernelChoice, nthreads: int):
    """What packs a dense call's weights (RSCK for NHWC, KCRS for NCHW) into the panels of
    ``choice`` as a Conv2d holds them, or None where nothing is packed (RSCK is already
    the panel of a K-wide kernel; the NCHW pointwise and portable kernels take the
    weights as they are)."""
    panel = choice.panel
    if panel == 0 or choice.kind is KernelKind.POINTWISE or not choice.isa.vector:
        return None
    if plan.layout == "NHWC":
        if panel == plan.spec.k:
            return None
        return lambda w: _kernels.pack_weights(w, panel, nthreads)
    return lambda w: _kernels.pack_weights_kcrs(w, panel, nthreads, None, _layout_isa())


def set_weight_cache(max_bytes: int) -> int:
    """Bound the memory that per-call ``conv2d`` keeps to reuse packed weights across
    calls with the same weight array (the packed weights of arrays of 128 KB and more,
    and for torch's KCRS weights a private copy to check them against; the least
    recently used dropped first); 0 turns the reuse off. Returns the previous bound
    (default 256 MiB). The reuse is never wrong: a call checks the caller's array bit for
    bit and packs again when anything changed. Used on 8 threads or more, and for NHWC
    calls whose searched kernel packs in a pass of its own (see ``_call_weights``)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    return weight_cache.CACHE.resize(max_bytes)


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel serves a call, as :func:`plan` reports it.

    kind: "tuned" (compiled into ttile), "jit" (tuned on this machine, from the cache),
    "generic" or "depthwise". ``tuned_cpu`` / ``tuned_threads`` name the CPU and thread
    count the kernel (or the verdict for the generic kernel) was measured at. ``scheme``
    and ``microkernels`` are in the paper's notation (empty for the hand-written
    kernels); ``expected_gflops`` is what the kernel measured when it was tuned (None
    when unknown); ``note`` says why this kernel was chosen. ``problem`` is one group's
    convolution (``groups`` of them side by side); ``epilogue`` what is fused into the
    store ("" for none, else e.g. "bias+residual+relu"). ``degraded`` says what was lost
    on the way to this kernel ("" when nothing was): run-time tuning that failed or ran
    without the learned ranking, a cache entry that could not be loaded, candidates that
    did not build or computed wrong results.
    """

    kind: KernelKind
    scheme: str
    microkernels: str
    expected_gflops: Optional[float]
    threads: int
    isa: Isa
    problem: ConvSpec
    note: str
    tuned_cpu: Optional[str] = None      # the CPU a tuned/JIT kernel (or verdict) was measured on
    tuned_threads: Optional[int] = None  # and the thread count
    groups: int = 1
    epilogue: str = ""
    degraded: str = ""


def plan(x_shape, w_shape, bias=None, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
         dilation: IntPair = 1, groups: int = 1, *, layout: str = "NCHW",
         threads: int | None = None, activation: Optional[str] = None,
         negative_slope: float = 0.01, residual=None, prepacked: bool = False) -> KernelPlan:
    """Which kernel ``conv2d`` would use for these shapes and options - or, with
    ``prepacked``, a ``Conv2d`` with these weights (a searched kernel that a per-call
    call would have to pack weights for may lose to the generic kernel there, see
    ``dispatch.for_call``) - without running or tuning anything (a disk cache entry from
    an earlier tuning is reported as "jit"). A per-call ``conv2d`` given a weight array
    it packed before, unchanged, runs what ``prepacked`` reports where it reuses packed
    weights (see ``_call_weights``).

    ``x_shape`` and ``w_shape`` are the shapes of the input and weights in ``layout``
    (sequences of ints); ``bias`` and ``residual`` may be arrays or their shapes. Raises
    what ``conv2d`` would raise for them.
    """
    x_dims = _shape_tuple(x_shape, "x_shape")
    w_dims = _shape_tuple(w_shape, "w_shape")
    call = _plan(x_dims, w_dims, stride, padding, layout, dilation, groups)
    bias_dims = None if bias is None else _shape_tuple(getattr(bias, "shape", bias), "bias")
    if bias_dims is not None and bias_dims != (call.channels_out,):
        raise ValueError(f"bias must have shape ({call.channels_out},) (one value per output "
                         f"channel), got {bias_dims}")
    residual_dims = (None if residual is None
                     else _shape_tuple(getattr(residual, "shape", residual), "residual"))
    if residual_dims is not None and residual_dims != call.out_shape:
        raise ValueError(f"residual must have the output's shape {call.out_shape} "
                         f"({call.layout}), got {residual_dims}")
    act = _activation(activation)
    _slope(negative_slope)
    nthreads = call.fit(_threads(threads))
    isa = get_isa()
    per_call = not prepacked
    choice = (call.choices.get((nthreads, isa, _use_tuned, per_call))
              or _family_choice(call, isa, nthreads, per_call)
              or dispatch.for_call(
                  dispatch.choose(call.spec, call.layout, nthreads, isa, _use_tuned,
                                  tune=False),
                  call.spec, call.layout, per_call, nthreads, isa))
    parts = [name for name, given in (("bias", bias_dims), ("residual", residual_dims))
             if given is not None]
    if act is not Activation.NONE:
        parts.append(act.value)
    return KernelPlan(choice.kind, choice.scheme, choice.microkernels, choice.gflops,
                      nthreads, isa, call.spec, choice.note, choice.tuned_cpu,
                      choice.tuned_threads, call.groups, "+".join(parts), choice.degraded)


def _shape_tuple(shape, name: str) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}")
    dims = []
    for item in shape:
        value = _strict_int(item, f"{name} must hold ints, got {shape!r}")
        if value < 0:
            raise ValueError(f"{name} has a negative size: {shape!r}")
        dims.append(value)
    return tuple(dims)


_isa_from_environment()
