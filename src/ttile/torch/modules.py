"""The converted modules that serve one layer or block: :class:`TTileConv2d` (a convolution
with its fused epilogue), :class:`TTileInvertedResidual` (a fused inverted residual block)
and :class:`TTilePool2d` (an NHWC pooling)."""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import replace
from enum import Enum
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import _kernels
from ..core.kinds import Activation, Precision
from ..runtime.arguments import as_pair
from ..runtime.bf16 import bf16_bits, is_bfloat16
from ..runtime.scratch import aligned_empty
from ..runtime.settings import layout_isa
from ..runtime import dispatch as _dispatch
from ..runtime.epilogue import describe as _describe_epilogue
from ..runtime.inverted_residual import (BlockPlan, BlockVerdict, InvertedResidual,
                                         modelled_verdict)
from .op import _LAYERS, _PackedLayer, _ids, _tracked, _units_changed, conv2d_op


class TTileConv2d(nn.Module):
    """A convolution (with its folded batch norm, residual add and activation) served by
    ttile. Made by :func:`convert`; ``forward(x, residual=None)``.

    ``source`` names the torch modules it replaces; ``not_fused`` says why a following
    batch norm, residual add or activation could not be looked for ("" when the graph
    was traced). ``precision`` is what its ``ttile.Conv2d`` multiplies (fp32 or bf16,
    see :func:`ttile.conv2d`); fp32 tensors come in and go out either way."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], stride, padding,
                 dilation, groups: int, activation: Optional[str] = None,
                 negative_slope: float = 0.01, residual: bool = False,
                 threads: Optional[int] = None, source: str = "", not_fused: str = "",
                 precision: Precision = Precision.FP32):
        super().__init__()
        self.precision = Precision(precision)
        self.weight = nn.Parameter(_tracked(weight), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(_tracked(bias), requires_grad=False)
        self.stride, self.padding = tuple(stride), tuple(padding)
        self.dilation, self.groups = tuple(dilation), int(groups)
        self.activation, self.negative_slope = activation, float(negative_slope)
        self.residual = residual
        self.threads = threads
        self.source = source   # what it replaced, e.g. "layer1.0.conv2+bn2+add+relu"
        self.not_fused = not_fused
        self._attach()
        self.eval()

    def _attach(self) -> None:
        """A fresh id and packed state of this module's own (at creation and in a copy)."""
        self.layer_id = next(_ids)
        self._packed = _PackedLayer(self)
        _LAYERS[self.layer_id] = self._packed

    def __getstate__(self):
        # copies and pickles carry the parameters, never the packed state or its id
        state = self.__dict__.copy()
        state.pop("_packed", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._attach()

    def repack(self) -> None:
        """Pack the weights again on the next call (after writes through ``.data``,
        which torch does not count as changes)."""
        self._packed.forget()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.training:
            raise RuntimeError("ttile.torch serves inference only: this module is in training "
                               "mode; call model.eval() (ttile computes no gradients)")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("ttile.torch computes no gradients, and this input requires "
                               "grad: run the model under torch.no_grad() or "
                               "torch.inference_mode()")
        if x.dtype is not torch.float32 or not x.is_cpu or x.ndim != 4:
            raise TypeError(f"ttile serves 4-D float32 CPU inputs, got a {x.dim()}-D "
                            f"{x.dtype} tensor on {x.device}")
        if self.residual != (residual is not None):
            raise TypeError("this layer was converted " + ("with" if self.residual else
                            "without") + " a residual operand")
        if type(x) is torch.Tensor and (residual is None or type(residual) is torch.Tensor) \
                and not torch.compiler.is_compiling():
            # eager, on plain tensors: what the custom op would run, without its dispatch
            # (24 of the 44 us a 1x1 layer on a 4x4 input took; 1.2 ms of MobileNetV2's
            # forward at 1 thread). Tracing, export and fake tensors still meet the op: a
            # compiled or exported model pays the dispatch per layer (MobileNetV2 at 1
            # thread on a Xeon model 167: 9.3 ms compiled, 9.0 exported, 8.1 eager).
            return self._packed.run(x, residual, self.threads or torch.get_num_threads())
        return conv2d_op(x, self.weight, self.bias, residual, self.layer_id,
                         list(self.stride), list(self.padding), list(self.dilation),
                         self.groups, self.activation or "", self.negative_slope,
                         self.threads or 0)

    def run_nhwc(self, x: np.ndarray, residual: Optional[np.ndarray], threads: int,
                 bf16_out: bool = False) -> np.ndarray:
        """The layer on an NHWC float32 array, for :class:`TTileSequence` (which has made
        the checks ``forward`` makes on tensors): on all ``threads``, the sequence's one
        team (``Conv2d``'s ``whole_team``). A bf16 layer also takes bf16 arrays (x and
        residual), and with ``bf16_out`` returns one (ml_dtypes' bfloat16)."""
        layer = self._packed.layer("NHWC")
        out = None
        if bf16_out:
            import ml_dtypes
            out = np.empty(layer._plan_of(x.shape).out_shape, ml_dtypes.bfloat16)
        elif x.dtype != np.float32:   # a bf16 input, an fp32 output
            out = aligned_empty(layer._plan_of(x.shape).out_shape)
        return layer(x, self.threads or threads, residual=residual, out=out,
                     whole_team=True)

    def extra_repr(self) -> str:
        k, cg, r, s = self.weight.shape
        return (f"{cg * self.groups}, {k}, kernel_size=({r}, {s}), stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, activation={self.activation}, "
                f"residual={self.residual}, source={self.source!r}"
                + ("" if self.precision is Precision.FP32 else f", precision={self.precision}"))


class TTileInvertedResidual(nn.Module):
    """An inverted residual block (MobileNetV2's): the converted 1x1 expand, 3x3 depthwise
    and 1x1 project layers (``expand``, ``depthwise``, ``project``, the last with the
    block's input as its residual when the block has one), served by the fused kernel
    (:mod:`ttile.runtime.inverted_residual`) where that is faster, else by the three
    layers. ``expand`` is None for a depthwise layer feeding a 1x1 layer with no expand
    before it (MobileNetV2's first block, MobileNetV1's pairs): the fused kernel then
    reads the block's input in its depthwise stage.

    The verdict is per input shape and thread count: with run-time tuning "now" both
    ways are timed on the block's first call at that shape (the layers tuned first),
    otherwise it is modelled. The fused kernel serves channels_last float32 inputs on
    AVX-512 CPUs, in eager mode; everything else (NCHW inputs, tracing, ``torch.compile``,
    the checks on training mode and gradients) goes through the layers.

    With ``precision`` bf16 (``convert(..., precision="bf16")``) the fused kernel runs
    on the bf16-rounded weights and block input: its products are those of bf16 values,
    its sums and the expanded activations inside the block fp32. Where AMX may run, its
    1x1 stages run on the tile unit (see ``InvertedResidual``)."""

    def __init__(self, expand: Optional[TTileConv2d], depthwise: TTileConv2d,
                 project: TTileConv2d):
        super().__init__()
        self.expand, self.depthwise, self.project = expand, depthwise, project
        self.source = " | ".join(m.source for m in self.layers)
        self.precision = Precision.FP32
        self._attach()
        self.eval()

    @property
    def layers(self) -> tuple:
        """The block's converted layers in order (without ``expand`` where it has none)."""
        return ((self.depthwise, self.project) if self.expand is None
                else (self.expand, self.depthwise, self.project))

    def _attach(self) -> None:
        self._fused: Optional[InvertedResidual] = None
        self._packed_from: tuple = ()
        self._tensors: tuple = ()
        self.plans: dict[tuple, BlockPlan] = {}   # (NHWC shape, threads) -> verdict
        self._lock = threading.Lock()

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in ("_fused", "_packed_from", "_tensors", "plans", "_lock"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._attach()

    def repack(self) -> None:
        """Pack the fused kernel's weights again on its next call (see :func:`repack`)."""
        with self._lock:
            self._fused, self._packed_from, self._tensors = None, (), ()
            _units_changed()

    def _sources(self) -> tuple:
        modules = self._modules   # nn.Module's attribute lookup costs half a microsecond
        d, p = modules["depthwise"]._parameters, modules["project"]._parameters
        expand = modules.get("expand")
        e = {"weight": None} if expand is None else expand._parameters
        return (e["weight"], e.get("bias"), d["weight"], d.get("bias"), p["weight"],
                p.get("bias"))

    @staticmethod
    def _stamp(tensors: tuple) -> tuple:
        """The objects, memory and torch's change counts of the packed tensors (what
        :func:`_identity` says, for six tensors in about a microsecond; an inference
        tensor counts nothing, and gets a stamp of its own on every call)."""
        try:
            return tuple(None if t is None else (id(t), t._version, t.data_ptr())
                         for t in tensors)
        except RuntimeError:   # inference tensors do not track a version counter
            return (object(),)

    def _block(self) -> InvertedResidual:
        tensors = self._sources()
        stamp = self._stamp(tensors)
        fused = self._fused
        if fused is not None and stamp == self._packed_from:
            return fused
        with self._lock:
            if self._fused is None or stamp != self._packed_from:
                arrays = [None if t is None else t.detach().numpy() for t in tensors]
                stages = (self.expand, self.depthwise, self.project)
                self._fused = InvertedResidual(
                    *arrays, stride=self.depthwise.stride[0],
                    activations=tuple("none" if m is None else m.activation or "none"
                                      for m in stages),
                    slopes=tuple(0.01 if m is None else m.negative_slope for m in stages),
                    residual=self.project.residual,
                    precision=Precision.BF16 if self.bf16 else Precision.FP32)
                self._packed_from, self._tensors = stamp, tensors
                _units_changed()
            return self._fused

    @property
    def bf16(self) -> bool:
        return getattr(self, "precision", Precision.FP32) is Precision.BF16

    def fused_call(self, x: np.ndarray, threads: int, bf16_out: bool = False) -> np.ndarray:
        """The fused kernel on NHWC x (a bf16 block rounds it, and takes bf16 arrays too:
        ``InvertedResidual``); with ``bf16_out`` a bf16 block returns a bf16 array."""
        return self._block()(x, threads, bits_out=bf16_out)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x if self.expand is None else self.expand(x))
        return self.project(y, x) if self.project.residual else self.project(y)

    def _layers_unhooked(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`_layers` through the layers' ``forward`` (timing: no hooks fire)."""
        y = self.depthwise.forward(x if self.expand is None else self.expand.forward(x))
        return self.project.forward(y, x if self.project.residual else None)

    def _plan(self, x: torch.Tensor, x_np: np.ndarray, threads: int) -> BlockPlan:
        key = (x_np.shape, threads)
        with self._lock:
            plan = self.plans.get(key)
        if plan is not None:
            return plan
        block = self._block()
        if _dispatch.tuning_policy().mode != "now":
            verdict = modelled_verdict(block.shape_of(x_np.shape))
            plan = BlockPlan(verdict, threads, "modelled: fused unless the 1x1 weights "
                             "exceed L2 (run-time tuning is off)")
        else:
            for _ in range(3):   # the layers' own first-call tuning and warm-up, untimed
                self._layers_unhooked(x)
                block(x_np, threads)
            layers, fused = [], []
            for _ in range(7):
                t0 = time.perf_counter()
                self._layers_unhooked(x)
                t1 = time.perf_counter()
                block(x_np, threads)
                t2 = time.perf_counter()
                layers.append(t1 - t0)
                fused.append(t2 - t1)
            layers_us = statistics.median(layers) * 1e6
            fused_us = statistics.median(fused) * 1e6
            verdict = BlockVerdict.FUSED if fused_us <= layers_us else BlockVerdict.LAYERS
            plan = BlockPlan(verdict, threads, f"timed on the first call: fused "
                             f"{fused_us:.0f} us, layers {layers_us:.0f} us",
                             fused_us, layers_us)
        stages = [_describe_epilogue(m.bias is not None, m is self.project and m.residual,
                                     Activation(m.activation or "none"))
                  for m in self.layers]
        plan = replace(plan, epilogue=" | ".join(stages))
        with self._lock:
            self.plans[key] = plan
        return plan

    def run_nhwc(self, x: np.ndarray, threads: int, bf16_out: bool = False
                 ) -> Optional[np.ndarray]:
        """The block on an NHWC float32 array, for :class:`TTileSequence`; None while
        its verdict at this shape is not known (the tensor path makes it). Without
        AVX-512 its layers serve it. A bf16 block also takes bf16 arrays, and with
        ``bf16_out`` returns one, whichever way it is served."""
        threads = self._modules["project"].threads or threads
        if InvertedResidual.unsupported() is None:
            plan = self.plans.get((x.shape, threads))
            if plan is None:
                return None
            if plan.verdict is BlockVerdict.FUSED:
                return self.fused_call(x, threads, bf16_out)
        y = x if self.expand is None else self.expand.run_nhwc(x, None, threads)
        y = self.depthwise.run_nhwc(y, None, threads)
        return self.project.run_nhwc(y, x if self.project.residual else None, threads,
                                     bf16_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (type(x) is torch.Tensor and not self.training and x.dtype is torch.float32
                and x.is_cpu and x.ndim == 4
                and not (x.requires_grad and torch.is_grad_enabled())
                and x.is_contiguous(memory_format=torch.channels_last)
                and x.shape[1] == self.layers[0].weight.shape[1] * self.layers[0].groups
                and InvertedResidual.unsupported() is None
                and not torch.compiler.is_compiling()):
            threads = self.project.threads or torch.get_num_threads()
            x_np = x.numpy().transpose(0, 2, 3, 1)
            plan = self.plans.get((x_np.shape, threads))
            if plan is None:
                plan = self._plan(x, x_np, threads)
            if plan.verdict is BlockVerdict.FUSED:
                y = self.fused_call(x_np, threads)
                return torch.from_numpy(y.transpose(0, 3, 1, 2))
        return self._layers(x)


class PoolKind(str, Enum):
    """The poolings :class:`TTilePool2d` serves."""

    MAX = "max"
    GLOBAL_AVERAGE = "global average"


class TTilePool2d(nn.Module):
    """A max pooling (``nn.MaxPool2d`` without dilation, ceil mode or indices) or global
    average pooling (``nn.AdaptiveAvgPool2d(1)``) that a :class:`TTileSequence` runs on
    its NHWC arrays with ttile's own kernel (``kernels/pool_nhwc.c``), so that a network's
    sequence of layers goes on through its pooling instead of stopping for a torch call:
    ResNet-50's MaxPool2d took 0.74 ms in torch inside the network at 1 thread, its input
    fresh from the stem convolution (a Xeon model 167), and split the network in two.
    Called as a module (outside a sequence, on tensors), it is the torch operation."""

    def __init__(self, source: nn.Module):
        super().__init__()
        if isinstance(source, nn.MaxPool2d):
            self.kind = PoolKind.MAX
            self.kernel_size = as_pair(source.kernel_size, "kernel_size", 1)
            self.stride = as_pair(source.stride if source.stride is not None
                                  else source.kernel_size, "stride", 1)
            self.padding = as_pair(source.padding, "padding", 0)
        else:
            self.kind = PoolKind.GLOBAL_AVERAGE
            self.kernel_size = self.stride = self.padding = (1, 1)
        self.eval()

    @staticmethod
    def serves(module: nn.Module) -> bool:
        """Whether ``module`` is a pooling this class serves."""
        if type(module) is nn.MaxPool2d:
            kernel = as_pair(module.kernel_size, "kernel_size", 1)
            padding = as_pair(module.padding, "padding", 0)
            return (as_pair(module.dilation, "dilation", 1) == (1, 1) and not module.ceil_mode
                    and not module.return_indices
                    and all(2 * p <= k for p, k in zip(padding, kernel)))
        if type(module) is nn.AdaptiveAvgPool2d:
            return module.output_size in (1, (1, 1))
        return False

    def run_nhwc(self, x: np.ndarray, threads: int) -> np.ndarray:
        """The pooling of an NHWC float32 array, for :class:`TTileSequence`; a max pooling
        also of a bf16 array (ml_dtypes'), into one: the maximum of bf16 values is one of
        them."""
        if self.kind is PoolKind.MAX:
            (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
            if is_bfloat16(x):
                return _kernels.maxpool_nhwc(bf16_bits(x), kh, kw, sh, sw, ph, pw,
                                             threads, isa=layout_isa()).view(x.dtype)
            return _kernels.maxpool_nhwc(x, kh, kw, sh, sw, ph, pw, threads,
                                         isa=layout_isa())
        return _kernels.global_avgpool_nhwc(x, threads)

    def bound_call(self, x_shape: tuple, threads: int) -> tuple:
        """``(call, out_shape)``: the pooling of NHWC inputs of ``x_shape`` as
        ``call(x, y, residual)`` writing y (no residual), for a sequence's
        :class:`~ttile.runtime.program.Program`; a max pooling's x and y may both be
        bf16 bits."""
        n, h, w, c = x_shape
        if self.kind is PoolKind.MAX:
            (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
            out_shape = (n, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1, c)
            maxpool, isa = _kernels.maxpool_nhwc, layout_isa()

            def call(x, y, _residual):
                maxpool(x, kh, kw, sh, sw, ph, pw, threads, out=y, isa=isa)
            return call, out_shape
        average = _kernels.global_avgpool_nhwc

        def call(x, y, _residual):
            average(x, threads, out=y)
        return call, (n, 1, 1, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is PoolKind.MAX:
            return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)
        return F.adaptive_avg_pool2d(x, 1)

    def extra_repr(self) -> str:
        if self.kind is PoolKind.MAX:
            return (f"max, kernel_size={self.kernel_size}, stride={self.stride}, "
                    f"padding={self.padding}")
        return "global average"
