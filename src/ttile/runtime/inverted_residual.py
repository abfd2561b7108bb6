"""The inverted residual block (1x1 expand -> 3x3 depthwise -> 1x1 project, plus the
block's input) in one kernel call, NHWC, AVX-512 (kernels/inverted_residual_avx512.c).

Served as three layers, the block writes its expanded map (MobileNetV2: up to 4.8 MB) and
its depthwise output to memory and reads both back, for layers that do a few dozen FMAs
per value; the fused kernel keeps three expanded rows and one depthwise row per thread
in L2. What it gives up is weight reuse: each output row streams the two 1x1 layers'
weights from L2, so a block whose weights outgrow L2 runs faster as layers. Which one serves a block at a thread count is a verdict: timed on
the block's first call when run-time tuning is on, else :func:`modelled_verdict`.

``ttile.torch.convert`` finds the pattern in a traced model and serves it through
:class:`InvertedResidual`; this module knows nothing of torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import numpy as np

from .. import _kernels
from ..core.kinds import Activation, Isa, Precision
from . import scratch
from .bf16 import is_bfloat16, round_to_bf16
from .settings import get_isa


class BlockVerdict(str, Enum):
    """What serves an inverted residual block at one input shape and thread count."""

    #: the fused kernel
    FUSED = "fused"
    #: the block's three layers, one call each
    LAYERS = "layers"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BlockShape:
    """One block's problem: input (n, h, w, c) NHWC, e expanded and k output channels."""

    n: int
    h: int
    w: int
    c: int
    e: int
    k: int
    stride: int
    residual: bool
    expands: bool = True

    @property
    def weight_bytes(self) -> int:
        """The 1x1 layers' packed weights, which each output row streams once."""
        ep, kp = _round16(self.e), _round16(self.k)
        return 4 * ((self.c * ep if self.expands else 0) + ep * kp)


@dataclass(frozen=True)
class BlockPlan:
    """Which way a block is served and why: ``fused_us`` / ``layers_us`` are the medians
    timed on its first call (None when the verdict was modelled, not timed); ``epilogue``
    what each stage fuses, e.g. "bias+relu6 | bias+relu6 | bias+residual"."""

    verdict: BlockVerdict
    threads: int
    note: str
    fused_us: Optional[float] = None
    layers_us: Optional[float] = None
    epilogue: str = ""


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def _round32(n: int) -> int:
    return (n + 31) // 32 * 32


def _pack_1x1(w: np.ndarray, c: int, k: int) -> np.ndarray:
    """A 1x1 stage's (c, k) fp32 weights rounded and packed for the tile kernel
    (ttile_bf16_pack_weights: kc 32, cp and kp c and k rounded up to 32)."""
    problem = (1, 1, 1, k, 1, 1, _round32(c), 32, _round32(k), 1, 1, 1, 1, 1, 1, 0)
    return _kernels.bf16_pack_weights(np.ascontiguousarray(w, dtype=np.float32)
                                      .reshape(1, 1, c, k), problem)


def modelled_verdict(shape: BlockShape) -> BlockVerdict:
    """The verdict without timing: fused unless the 1x1 weights exceed this core's L2,
    which each output row streams (measured on a Xeon model 167, 2 MB L2: fused 1.0-1.9x
    the speed of the layers on every MobileNetV2 block, the last, 1.8 MB, at parity)."""
    l2 = _kernels.cpu_l2_bytes() or (1 << 20)
    return BlockVerdict.FUSED if shape.weight_bytes <= l2 else BlockVerdict.LAYERS


def _as_float32(a, shape: tuple, name: str) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a


class InvertedResidual:
    """One block's weights, packed once for the fused kernel.

    Weights are torch's KCRS: ``expand`` (E, C, 1, 1), ``depthwise`` (E, 1, 3, 3),
    ``project`` (K, E, 1, 1); biases (E,), (E,), (K,) or None. ``activations`` are the
    three stages' (MobileNetV2: relu6, relu6, none), ``slopes`` their leaky slopes.
    The depthwise layer pads by 1 and has ``stride`` 1 or 2; ``residual`` adds the
    block's input to its output (stride 1, K == C).

    ``expand`` None (and its bias None, its activation "none"): a block without its
    expand stage, the depthwise layer on the block's input (E == C) feeding the 1x1
    project: MobileNetV2's first block, MobileNetV1's depthwise-pointwise pairs. The
    depthwise output, as large as the input, then stays in L2 too.

    ``precision`` bf16: the weights and the block's input are rounded to bf16 and the
    products are of bf16 values, the sums fp32. Where this process may run AMX
    (``_kernels.amx_usable``) the block runs kernels/inverted_residual_amx.c: its 1x1
    stages on the tile unit, the depthwise output rounded to bf16 before the project
    stage. Elsewhere the fp32 kernel runs on the rounded weights and input (its depthwise
    output stays fp32). A bf16 block reads and writes bf16 values as well as float32: the
    AMX kernel as they are, the fp32 kernel through a widening or rounding pass
    (:meth:`runs_on_amx`).
    """

    def __init__(self, expand, expand_bias, depthwise, depthwise_bias, project,
                 project_bias, *, stride: int, activations: tuple, slopes: tuple = (
                     0.01, 0.01, 0.01), residual: bool = False,
                 precision: Precision = Precision.FP32):
        self.expands = expand is not None
        if self.expands:
            expand = np.asarray(expand)
            if expand.ndim != 4 or expand.shape[2:] != (1, 1):
                raise ValueError(f"expand weights must be (E, C, 1, 1), got {expand.shape}")
            e, c = expand.shape[:2]
        else:
            if expand_bias is not None or Activation(activations[0]) is not Activation.NONE:
                raise ValueError("a block without an expand stage has no expand bias or "
                                 "activation")
            e = c = np.asarray(depthwise).shape[0]
        depthwise = _as_float32(depthwise, (e, 1, 3, 3), "depthwise weights")
        project = np.asarray(project)
        if project.ndim != 4 or project.shape[1:] != (e, 1, 1):
            raise ValueError(f"project weights must be (K, {e}, 1, 1), got {project.shape}")
        k = project.shape[0]
        if stride not in (1, 2):
            raise ValueError(f"the depthwise stride must be 1 or 2, got {stride}")
        if residual and (stride != 1 or k != c):
            raise ValueError(f"a residual needs stride 1 and K == C (stride {stride}, "
                             f"{c} -> {k})")
        if len(activations) != 3 or len(slopes) != 3:
            raise ValueError("activations and slopes name the three stages")
        self.c, self.e, self.k = int(c), int(e), int(k)
        self.stride, self.residual = int(stride), bool(residual)
        self.activations = tuple(Activation(a) for a in activations)
        self.slopes = tuple(float(s) for s in slopes)
        ep, kp = _round16(e), _round16(k)

        def padded(shape):
            out = _kernels.empty_aligned(shape)
            out.fill(0.0)
            return out
        self._w1 = self._b1 = None
        if self.expands:
            self._w1 = padded((c, ep))
            _kernels.inverted_residual_pack(
                np.ascontiguousarray(expand.astype(np.float32)[:, :, 0, 0].T), self._w1)
            self._b1 = padded((ep,))
        self._w2 = padded((9, ep))
        self._w2[:, :e] = depthwise.reshape(e, 9).T
        w3 = np.zeros((ep, k), dtype=np.float32)
        w3[:e] = project.astype(np.float32)[:, :, 0, 0].T
        self._w3 = padded((ep, kp))
        _kernels.inverted_residual_pack(w3, self._w3)
        self._b2, self._b3 = padded((ep,)), padded((kp,))
        for out, bias, n, name in ((self._b1, expand_bias, e, "expand bias"),
                                   (self._b2, depthwise_bias, e, "depthwise bias"),
                                   (self._b3, project_bias, k, "project bias")):
            if bias is not None:
                out[:n] = _as_float32(bias, (n,), name)
        self._codes = tuple(a.code for a in self.activations)
        self._calls: dict[tuple, tuple] = {}   # (x shape, threads) -> _call_for's answer
        self.precision = Precision(precision)
        self.amx = self.runs_on_amx(self.precision)
        if self.precision is Precision.BF16:
            for w in (self._w1, self._w2, self._w3):
                if w is not None:
                    w[...] = round_to_bf16(w)
        if self.amx:   # the 1x1 stages in the tile kernel's layout (RSCK, kc 32)
            self._w1 = None if not self.expands else _pack_1x1(
                expand.astype(np.float32)[:, :, 0, 0].T, c, e)
            self._w3 = _pack_1x1(project.astype(np.float32)[:, :, 0, 0].T, e, k)

    def shape_of(self, x_shape: tuple) -> BlockShape:
        n, h, w, c = x_shape
        return BlockShape(n, h, w, c, self.e, self.k, self.stride, self.residual,
                          self.expands)

    @staticmethod
    def unsupported() -> Optional[str]:
        """Why the fused kernel cannot serve calls now, or None: it is AVX-512F code, and
        calls held to another family (``ttile.set_isa``) run none."""
        isa = get_isa()
        return None if isa is Isa.AVX512F else (
            f"the fused kernel is AVX-512F code and calls run the {isa.value} family")

    @staticmethod
    def runs_on_amx(precision: Precision) -> bool:
        """Whether a block of ``precision`` runs the AMX kernel here: a bf16 block where
        this process may run AMX. That block reads and writes bf16 bits at no cost (it
        rounds or widens each row as it reads it anyway), so a network keeps bits
        between such blocks, half the bytes of fp32. The fp32 kernel of a bf16 block
        serves bits too, but each costs it a pass."""
        return precision is Precision.BF16 and _kernels.amx_usable()

    def __call__(self, x: np.ndarray, threads: int, out: Optional[np.ndarray] = None,
                 bits_out: bool = False) -> np.ndarray:
        """The block on ``x`` (N, H, W, C), float32, or for a bf16 block bf16 values
        (ml_dtypes.bfloat16, or their bits as uint16): a new (N, Ho, Wo, K) float32
        array, or with ``bits_out`` (bf16 blocks) a bfloat16 one; or ``out``, float32 or
        (bf16 blocks) bf16, which says what is written."""
        bf16_block = self.precision is Precision.BF16
        if x.dtype == np.uint16 or is_bfloat16(x):
            if not bf16_block:
                raise TypeError("bf16 values are read by a bf16 block only; this block is "
                                "fp32: pass float32")
            x = np.ascontiguousarray(x).view(np.uint16)
        elif x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        key = (x.shape, threads)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = self._call_for(x.shape, threads)
        out_shape, threads, scratch_floats = call
        result = None
        if out is None:
            if bits_out:
                if not bf16_block:
                    raise ValueError("bits_out is for bf16 blocks")
                import ml_dtypes
                out = _kernels.empty_aligned_bits(out_shape)
                result = out.view(ml_dtypes.bfloat16)
            else:
                out = scratch.aligned_empty(out_shape)
        elif is_bfloat16(out) or out.dtype == np.uint16:
            if not bf16_block:
                raise TypeError("an fp32 block writes float32")
            result, out = out, out.view(np.uint16)
        buffer = scratch.scratch("inverted_residual", (scratch_floats,))
        if buffer is None:
            buffer = _kernels.empty_aligned((scratch_floats,))
        self._kernel(x, out, buffer, threads)
        return out if result is None else result

    def _kernel(self, x: np.ndarray, y: np.ndarray, buffer: np.ndarray, threads: int,
                rounded: Optional[np.ndarray] = None, result: Optional[np.ndarray] = None
                ) -> None:
        """The block from x into y, each float32 or (bf16 blocks) bf16 bits. The fp32
        kernel of a bf16 block reads x rounded (or widened) into ``rounded`` and, for bf16
        bits out, writes ``result`` (float32 of y's shape) first (None: new arrays)."""
        if self.amx:
            if not _kernels.inverted_residual_amx(
                    x, self._w1, self._b1, self._w2, self._b2, self._w3, self._b3, y, buffer,
                    self.e, self.stride, self._codes, self.slopes, self.residual, threads):
                raise RuntimeError("the AMX inverted residual kernel was refused after "
                                   "AMX was granted")
            return
        if self.precision is Precision.BF16:
            x = (_kernels.bf16_widen(x, threads) if x.dtype == np.uint16
                 else _kernels.bf16_round_f32(x, threads, rounded))
        out = y
        if y.dtype == np.uint16:
            out = scratch.aligned_empty(y.shape) if result is None else result
        _kernels.inverted_residual(x, self._w1, self._b1, self._w2, self._b2, self._w3,
                                   self._b3, out, buffer, self.e, self.stride, self._codes,
                                   self.slopes, self.residual, threads)
        if out is not y:
            _kernels.bf16_round(out, threads, y)

    def scratch_floats(self, x_shape: tuple, threads: int) -> int:
        """Floats of scratch a call on ``x_shape`` at ``threads`` needs."""
        return self._call_for(tuple(x_shape), threads)[2]

    def output_shape(self, x_shape: tuple) -> tuple:
        """The (N, Ho, Wo, K) output of a call on ``x_shape``."""
        return self._call_for(tuple(x_shape), 1)[0]

    def bound_call(self, x_shape: tuple, threads: int, buffer: np.ndarray):
        """The block bound for inputs of ``x_shape`` at ``threads``, with ``buffer`` (at
        least :meth:`scratch_floats` float32s, aligned, used by nothing else while the
        call runs) as its scratch: ``(call, out_shape)``, ``call(x, y, residual)``
        writing y (the residual argument is ignored: the block adds its own input), as
        ``ttile.runtime.program`` runs it. A bf16 block's x and y may each be float32 or
        bf16 bits (uint16)."""
        out_shape, threads, floats = self._call_for(tuple(x_shape), threads)
        if buffer.dtype != np.float32 or buffer.size < floats:
            raise ValueError(f"the scratch buffer needs {floats} float32s")
        scratch_buffer = buffer.reshape(-1)[:floats]
        w1, b1, w2, b2, w3, b3 = self._w1, self._b1, self._w2, self._b2, self._w3, self._b3
        e, stride, codes, slopes, residual = (self.e, self.stride, self._codes,
                                              self.slopes, self.residual)
        kernel = self._kernel
        if self.amx:
            def call(x, y, _residual):
                kernel(x, y, scratch_buffer, threads)
            return call, out_shape
        if self.precision is Precision.BF16:   # the input rounded into a buffer of its own
            rounded = _kernels.empty_aligned(tuple(x_shape))
            result = _kernels.empty_aligned(out_shape)

            def call(x, y, _residual):
                kernel(x, y, scratch_buffer, threads, rounded, result)
            return call, out_shape
        fp32_kernel = _kernels.inverted_residual

        def call(x, y, _residual):
            fp32_kernel(x, w1, b1, w2, b2, w3, b3, y, scratch_buffer, e, stride, codes,
                        slopes, residual, threads)
        return call, out_shape

    def _call_for(self, x_shape: tuple, threads: int) -> tuple:
        """(output shape, threads used, scratch floats) of a call on x_shape."""
        if len(x_shape) != 4 or x_shape[3] != self.c:
            raise ValueError(f"x must be (N, H, W, {self.c}), got {x_shape}")
        n, h, w, _ = x_shape
        ho, wo = (h - 1) // self.stride + 1, (w - 1) // self.stride + 1
        threads = max(1, int(threads))
        if self.amx:
            floats = -(-_kernels.inverted_residual_amx_scratch_bytes(
                tuple(x_shape), self.e, self.k, self.stride, threads) // 4)
        else:
            floats = _kernels.inverted_residual_scratch_floats(x_shape, self.e, self.k,
                                                               self.stride, threads,
                                                               self._codes[2])
        return (n, ho, wo, self.k), threads, floats


def reference(x, expand, expand_bias, depthwise, depthwise_bias, project, project_bias, *,
              stride: int, activations: tuple, slopes: tuple = (0.01, 0.01, 0.01),
              residual: bool = False) -> np.ndarray:
    """The block in float64 numpy (NHWC), for tests: what the kernel must match."""
    from ..core.reference import activate_f64 as activate
    x = np.asarray(x, dtype=np.float64)
    n, h, w, c = x.shape
    e, k = np.asarray(depthwise).shape[0], project.shape[0]

    def bias(b, size):
        return np.zeros(size) if b is None else np.asarray(b, dtype=np.float64)
    if expand is None:   # no expand stage: the depthwise layer reads x
        t = x
    else:
        t = np.einsum("nhwc,ec->nhwe", x, np.asarray(expand, np.float64)[:, :, 0, 0])
        t = activate(t + bias(expand_bias, e), activations[0], slopes[0])
    padded = np.zeros((n, h + 2, w + 2, e))
    padded[:, 1:-1, 1:-1] = t
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    d = np.zeros((n, ho, wo, e))
    taps = np.asarray(depthwise, np.float64)[:, 0]
    for r in range(3):
        for s in range(3):
            d += padded[:, r:r + stride * (ho - 1) + 1:stride,
                        s:s + stride * (wo - 1) + 1:stride] * taps[:, r, s]
    d = activate(d + bias(depthwise_bias, e), activations[1], slopes[1])
    y = np.einsum("nhwe,ke->nhwk", d, np.asarray(project, np.float64)[:, :, 0, 0])
    y = y + bias(project_bias, k)
    if residual:
        y = y + x
    return activate(y, activations[2], slopes[2])


__all__ = ["BlockVerdict", "BlockShape", "BlockPlan", "InvertedResidual", "modelled_verdict",
           "reference"]
