"""``ttile.conv2d``: argument checking, layout handling and kernel dispatch.

The semantics are those of ``torch.nn.functional.conv2d`` with bias=None, dilation=1,
groups=1. Everything a caller can get wrong is caught here with a ValueError or
TypeError that names the problem, before any pointer reaches C.

Kept free of heavy imports: this is the hot path of every call.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from .. import _kernels
from ..core.kinds import Isa, KernelKind
from ..core.spec import ConvSpec
from . import dispatch, registry
from .scratch import scratch

IntPair = Union[int, tuple[int, int]]

#: Which generic kernel serves calls: Isa.AUTO (AVX-512F when the CPU has it), AVX512F
#: or PORTABLE. Change it with :func:`set_isa`.
_HAS_AVX512F = _kernels.cpu_has_avx512f()
_isa = Isa.AUTO
_use_tuned = True


def use_tuned_kernels(enabled: bool) -> bool:
    """Serve registry problems with their tuned kernels (default) or always with the
    generic one (for comparisons and tests); returns the previous setting."""
    global _use_tuned
    previous, _use_tuned = _use_tuned, bool(enabled)
    return previous


def has_avx512f() -> bool:
    """True when this CPU and OS can run the AVX-512F kernels."""
    return _HAS_AVX512F


def set_isa(isa: Union[str, Isa]) -> Isa:
    """Choose the kernel family: "auto", "avx512f" or "portable" (or an :class:`Isa`);
    returns the previous one.

    For tests and debugging. Asking for "avx512f" on a CPU without it raises instead of
    crashing later.
    """
    global _isa
    try:
        chosen = Isa(isa)
    except ValueError:
        raise ValueError(f"isa must be 'auto', 'avx512f' or 'portable', got {isa!r}") from None
    if chosen is Isa.AVX512F and not _HAS_AVX512F:
        raise ValueError("this CPU (or OS) does not support AVX-512F")
    previous, _isa = _isa, chosen
    return previous


def get_isa() -> Isa:
    """The kernel family calls use now: Isa.AVX512F or Isa.PORTABLE (equal to the
    strings "avx512f" and "portable")."""
    if _isa is Isa.AUTO:
        return Isa.AVX512F if _HAS_AVX512F else Isa.PORTABLE
    return _isa


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


def _padding(padding, r: int, s: int, stride: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) for torch's padding argument."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding == "same":
            if stride != (1, 1):
                raise ValueError("padding='same' is not supported for strided convolutions "
                                 "(as in torch); pass explicit padding instead")
            top, left = (r - 1) // 2, (s - 1) // 2
            return top, r - 1 - top, left, s - 1 - left
        raise ValueError(f"padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
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


def make_spec(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: IntPair = 1,
              padding: Union[IntPair, str] = 0, layout: str = "NCHW") -> ConvSpec:
    """The ConvSpec of a conv2d call, checking ranks, channels and sizes."""
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
    if wc != c:
        raise ValueError(f"channel mismatch: input has {c} channels, weights expect {wc}")
    sh, sw = _as_pair(stride, "stride", 1)
    pt, pb, pl, pr = _padding(padding, r, s, (sh, sw))
    if h + pt + pb < r or w + pl + pr < s:
        raise ValueError(f"kernel {r}x{s} is larger than the padded input "
                         f"{h + pt + pb}x{w + pl + pr}")
    return ConvSpec(n=n, k=k, c=c, h=h, w=w, r=r, s=s, stride_h=sh, stride_w=sw,
                    pad_top=pt, pad_bottom=pb, pad_left=pl, pad_right=pr)


@dataclass(frozen=True)
class _CallPlan:
    """What conv2d derives from a call's shapes and options, computed once per signature.

    ``choices`` remembers, per (thread count, ISA, tuned kernels on?), the kernel that
    serves the call once that is final (a background tuning may still replace a
    provisional choice).
    """

    spec: ConvSpec
    layout: str
    out_shape: tuple[int, int, int, int]
    max_threads: int
    choices: dict = field(default_factory=dict)

    def fit(self, threads: int) -> int:
        """The threads a call of this problem uses when ``threads`` are asked for: no
        more than its work keeps busy (see :data:`MIN_FLOPS_PER_THREAD`)."""
        return threads if threads <= self.max_threads else self.max_threads


#: Work below which another thread costs more than it brings: starting and joining an
#: OpenMP team takes microseconds, 4 MFLOP take about 16 us on one AVX-512 core. A
#: 1.2 MFLOP layer (K 24, C 12, 9x9, 5x5) ran 11x slower on 16 threads than on one.
MIN_FLOPS_PER_THREAD = 4_000_000


def tuned_kernels() -> list[dict]:
    """The searched kernels compiled into this build, for every CPU they were tuned on:
    problem fields, ``cpu`` (fingerprint id) and ``threads`` they were measured at,
    ``scheme``, measured ``gflops``, ``panel``, ``layer``. Each serves only on its CPU at
    its thread count (``plan`` says what serves a call)."""
    return [e.to_dict() for e in registry.KERNELS]


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
    return None


def _plan(x_shape, w_shape, stride, padding, layout) -> _CallPlan:
    stride_key, padding_key = _exact_key(stride), _exact_key(padding)
    key = None
    if stride_key is not None and padding_key is not None and type(layout) is str:
        key = (x_shape, w_shape, stride_key, padding_key, layout)
        plan = _plans.get(key)
        if plan is not None:
            return plan
    spec = make_spec(x_shape, w_shape, stride, padding, layout)
    out_bytes = 4 * spec.n * spec.k * spec.ho * spec.wo
    if out_bytes > _memory_limit_bytes():
        raise ValueError(f"output of shape ({spec.n}, {spec.k}, {spec.ho}, {spec.wo}) needs "
                         f"{out_bytes / 2**30:.1f} GiB, more than this machine's memory")
    plan = _CallPlan(spec, layout, spec.output_shape(),
                     max(1, spec.flops // MIN_FLOPS_PER_THREAD))
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
        choice = dispatch.for_call(
            dispatch.choose(plan.spec, plan.layout, nthreads, isa, _use_tuned),
            plan.spec, plan.layout, per_call, nthreads, isa)
        if choice.final:
            plan.choices[cache_key] = choice
    return choice


def _run(choice: dispatch.KernelChoice, spec: ConvSpec, x: np.ndarray, weights: np.ndarray,
         y: np.ndarray, nthreads: int) -> None:
    """Run ``choice`` on NHWC x into y; ``weights`` are packed for ``choice.panel`` (RSCK
    for panel 0)."""
    kind = choice.kind
    if kind is KernelKind.TUNED:
        _kernels.run_tuned(choice.index, x, weights, y, nthreads)
    elif kind is KernelKind.JIT:
        # The kernel's sizes are those of the problem it was compiled for: the arrays
        # are checked against that problem, not against themselves.
        problem = choice.problem
        _kernels.run_compiled(choice.address, x, weights, y, nthreads, problem.input_shape(),
                              problem.packed_weight_shape(choice.panel),
                              problem.output_shape())
    elif choice.panel:
        _kernels.conv2d_generic_packed(x, weights, y, spec.stride_h, spec.stride_w,
                                       spec.pad_top, spec.pad_left, nthreads)
    else:
        _kernels.conv2d_generic_nhwc(x, weights, y, spec.stride_h, spec.stride_w,
                                     spec.pad_top, spec.pad_left, nthreads,
                                     _kernels.ISA_PORTABLE)


def _execute(plan: _CallPlan, choice: dispatch.KernelChoice, x: np.ndarray,
             weights: np.ndarray, nthreads: int) -> np.ndarray:
    """Run ``choice`` on input ``x`` in the plan's layout with weights already in the
    kernel's format; returns the output. An NCHW input is converted to NHWC by one
    blocked, parallel pass into a per-thread scratch buffer; the generic kernel writes
    the NCHW output directly, other kernels' NHWC output is converted back by a second
    pass."""
    if plan.layout == "NCHW":
        spec, isa = plan.spec, _layout_isa()
        x = _kernels.nchw_to_nhwc(x, nthreads, scratch("x", spec.input_shape()), isa)
        if choice.kind is KernelKind.GENERIC and choice.panel:
            # the AVX-512 generic kernel writes NCHW from its tiles: no second pass; it
            # takes KCRS weights (a per-call conv2d) or packed ones (Conv2d)
            y = np.empty((spec.n, spec.k, spec.ho, spec.wo), dtype=_FLOAT32)
            _kernels.conv2d_generic_packed(x, weights, y, spec.stride_h, spec.stride_w,
                                           spec.pad_top, spec.pad_left, nthreads, True,
                                           weights.ndim == 4)
            return y
        y = scratch("y", plan.out_shape)
        if y is None:
            y = np.empty(plan.out_shape, dtype=_FLOAT32)
        _run(choice, spec, x, weights, y, nthreads)
        return _kernels.nhwc_to_nchw(y, nthreads, None, isa)
    y = np.empty(plan.out_shape, dtype=_FLOAT32)
    _run(choice, plan.spec, x, weights, y, nthreads)
    return y


def _layout_isa() -> Optional[int]:
    """The layout conversions' ISA: portable when calls are held to the portable family."""
    return _kernels.ISA_PORTABLE if get_isa() is Isa.PORTABLE else None


def _pack_per_call(w: np.ndarray, layout: str, spec: ConvSpec, choice: dispatch.KernelChoice,
                   nthreads: int) -> np.ndarray:
    """The weights of one call in the kernel's format (panels of width ``panel``, or RSCK
    for 0), packed in one parallel pass into this thread's scratch buffer: KCRS straight
    into panels for NCHW, RSCK into panels for NHWC (RSCK already is the format of
    panel 0, and of a panel as wide as K). The AVX-512 generic kernel takes the weights as
    they are (RSCK, or KCRS): its threads pack the panels they use into buffers of their own,
    so the weights are read once instead of read, written and read back (ResNet18-12 per
    call at 2 threads, caches cold: 1.35 ms packed beforehand against 0.73 pre-packed)."""
    panel = choice.panel
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


def conv2d(x, w, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
           layout: str = "NCHW", threads: int | None = None) -> np.ndarray:
    """2D convolution with the semantics of ``torch.nn.functional.conv2d`` (no bias).

    Args:
        x: input, (N, C, H, W) for layout "NCHW" or (N, H, W, C) for "NHWC".
        w: weights, (K, C, R, S) for "NCHW" or (R, S, C, K) for "NHWC".
        stride: int or (sh, sw), >= 1.
        padding: int, (ph, pw), "same" (stride 1 only; the odd extra row/column goes to
            the bottom/right, as in torch) or "valid".
        layout: "NCHW" (default) or "NHWC", the kernels' native layout: NHWC runs with
            no transposition.
        threads: number of threads, default all CPUs this process may use; a small
            problem uses fewer (one thread per 4 MFLOP of work at most).

    A problem with no kernel tuned into ttile is tuned on its first call (a search of
    at most 20 s by default, then cached on disk for later processes), in the
    background, or never: see :func:`ttile.set_tuning`. Weights are packed for the
    kernel on every call (one parallel pass into a reused per-thread buffer);
    :class:`ttile.Conv2d` packs them once.

    Returns:
        float32 output, (N, K, Ho, Wo) for "NCHW", (N, Ho, Wo, K) for "NHWC".
        float16, float64 and integer inputs are converted to float32.

    Raises:
        ValueError: wrong ranks or channels, zero sizes, bad stride/padding/threads,
            kernel larger than the padded input, output too large for memory.
        TypeError: non-numeric, bool or complex data; non-integer stride or padding.
    """
    x_arr = _as_float32(x, "input")
    w_arr = _as_float32(w, "weights")
    plan = _plan(x_arr.shape, w_arr.shape, stride, padding, layout)
    nthreads = plan.fit(threads if type(threads) is int and 0 < threads <= MAX_THREADS
                        else _threads(threads))
    choice = _choice(plan, nthreads)

    weights = _pack_per_call(w_arr, plan.layout, plan.spec, choice, nthreads)
    return _execute(plan, choice, x_arr, weights, nthreads)


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel serves a call, as :func:`plan` reports it.

    kind: "tuned" (compiled into ttile), "jit" (tuned on this machine, from the cache)
    or "generic". ``tuned_cpu`` / ``tuned_threads`` name the CPU and thread count the
    kernel (or the verdict for the generic kernel) was measured at. ``scheme`` and
    ``microkernels`` are in the paper's notation (empty for the generic kernel);
    ``expected_gflops`` is what the kernel measured when it was
    tuned (None when unknown); ``note`` says why this kernel was chosen.
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


def plan(x_shape, w_shape, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
         layout: str = "NCHW", threads: int | None = None, *,
         prepacked: bool = False) -> KernelPlan:
    """Which kernel ``conv2d`` would use for these shapes and options - or, with
    ``prepacked``, a ``Conv2d`` with these weights (a searched kernel that a per-call
    call would have to pack weights for may lose to the generic kernel there, see
    ``dispatch.for_call``) - without running or tuning anything (a disk cache entry from
    an earlier tuning is reported as "jit").

    ``x_shape`` and ``w_shape`` are the shapes of the input and weights in ``layout``
    (sequences of ints). Raises what ``conv2d`` would raise for them.
    """
    x_dims = _shape_tuple(x_shape, "x_shape")
    w_dims = _shape_tuple(w_shape, "w_shape")
    call = _plan(x_dims, w_dims, stride, padding, layout)
    nthreads = call.fit(_threads(threads))
    isa = get_isa()
    per_call = not prepacked
    choice = call.choices.get((nthreads, isa, _use_tuned, per_call)) or dispatch.for_call(
        dispatch.choose(call.spec, layout, nthreads, isa, _use_tuned, tune=False),
        call.spec, layout, per_call, nthreads, isa)
    return KernelPlan(choice.kind, choice.scheme, choice.microkernels, choice.gflops,
                      nthreads, isa, call.spec, choice.note, choice.tuned_cpu,
                      choice.tuned_threads)


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
