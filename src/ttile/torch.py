"""``ttile.torch``: a PyTorch model's convolutions served by ttile, for inference.

``convert(model)`` returns the model with every eligible ``nn.Conv2d`` replaced by a
:class:`TTileConv2d`, which calls the ``ttile::conv2d`` custom operator. Where the model
traces with ``torch.fx``, the graph is rewritten so that one ttile call does what several
torch modules did:

* a ``BatchNorm2d`` (eval statistics) right after the convolution is folded into its
  weights and bias, once, at conversion;
* a residual add after it (``out = bn(conv(x)) + identity``, ResNet's blocks) becomes the
  kernel's residual operand;
* a ReLU / ReLU6 (or ``hardtanh(0, 6)``) / LeakyReLU / SiLU / Sigmoid after that becomes
  its activation;

all applied in the kernel's output store; and an inverted residual block (1x1 expand,
3x3 depthwise, 1x1 project, + the block's input: MobileNetV2's) becomes one
:class:`TTileInvertedResidual`, served by one fused kernel where that is faster than its
three layers. A classifier after a global average pooling (flatten, dropouts, a linear
layer) becomes a 1x1 :class:`TTileConv2d` on the pooled map. Consecutive ttile layers and
blocks then run as one :class:`TTileSequence`, NHWC arrays passed from kernel to kernel.
A model that does not trace gets a plain module swap (each convolution served alone).
Layers ttile cannot serve stay torch's: other dtypes or devices, ``padding_mode`` other
than "zeros", a string padding that is not symmetric.

Tensors are handed over without copies: a channels_last input is ttile's native NHWC
(``x.permute(0, 2, 3, 1)`` is contiguous, viewed by numpy), a contiguous NCHW input is
served by the NCHW entry; the output has the input's memory format, so a channels_last
model stays channels_last from layer to layer.

Each :class:`TTileConv2d` owns its packed weights (one ttile layer per layout, packed on
first use) and packs again whenever its ``weight`` or ``bias`` is not the tensor it packed:
another tensor (``load_state_dict(assign=True)``, ``module.weight = ...``, ``.to()``), other
memory, or an in-place change torch counts (``load_state_dict``, ``weight.mul_()``,
``weight.copy_()``). A copy (``copy.deepcopy``, ``pickle``, ``torch.save`` / ``torch.load``)
starts with nothing packed and packs its own weights; the packed memory goes with the
module. Writes through ``weight.data`` are invisible to torch's version counter (as they
are to autograd): call :func:`repack` after them.

Importing ``ttile`` never imports this module or torch; ``import ttile.torch`` needs
torch (the optional extra ``ttile[torch]``).
"""
from __future__ import annotations

import itertools
import operator
import statistics
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module   # torch's global module hooks

from . import _kernels
from .core.kinds import Activation
from .runtime.arguments import as_pair
from .runtime.conv_layer import Conv2d, bindings_revision
from .runtime.api import plan as _ttile_plan
from .runtime import dispatch as _dispatch
from .runtime import settings as _settings
from .runtime.program import Program, Step
from .runtime.epilogue import describe as _describe_epilogue
from .runtime.inverted_residual import (BlockPlan, BlockVerdict, InvertedResidual,
                                        modelled_verdict)

__all__ = ["convert", "TTileConv2d", "TTileInvertedResidual", "TTilePool2d", "TTileSequence",
           "PoolKind", "served_layers", "repack"]

# layer id -> the packed state of one live TTileConv2d. The custom operator takes tensors
# and plain values only, so it reaches the packed weights through this id; the module
# owns the state, and the entry goes when the module does.
_LAYERS: "weakref.WeakValueDictionary[int, _PackedLayer]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def _packed_state(layer: int) -> "_PackedLayer":
    packed = _LAYERS.get(layer)
    if packed is None:
        raise RuntimeError(f"ttile::conv2d: layer {layer} belongs to a TTileConv2d that no "
                           f"longer exists (a graph traced from a module that was deleted)")
    return packed


def _output_size(size: int, pad: int, dilation: int, kernel: int, stride: int) -> int:
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def _conv2d_cpu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], layer: int, stride: list[int],
                padding: list[int], dilation: list[int], groups: int, activation: str,
                negative_slope: float, threads: int) -> torch.Tensor:
    """``ttile::conv2d``: ``act(conv2d(x, weight) + bias + residual)`` by ttile's kernels.
    ``layer`` names the packed weights (made from ``weight`` and ``bias`` when the module
    was built); ``activation`` is "" for none; ``threads`` 0 for torch's thread count."""
    return _packed_state(layer).run(x, residual, threads or torch.get_num_threads())


# The operator is defined and implemented through torch.library.Library, the dispatcher's
# own registration: torch.library.custom_op wraps every call in Python checks (16 us of
# dispatch against 6 on an empty problem, and a compiled MobileNetV2 calls it 52 times).
# It computes no gradients, as TTileConv2d.forward says, and holds no state of its own.
_library = torch.library.Library("ttile", "DEF")
_library.define("conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, int layer, "
                "int[] stride, int[] padding, int[] dilation, int groups, str activation, "
                "float negative_slope, int threads) -> Tensor")
_library.impl("conv2d", _conv2d_cpu, "CPU")
conv2d_op = torch.ops.ttile.conv2d.default


@torch.library.register_fake("ttile::conv2d", lib=_library)
def _conv2d_fake(x, weight, bias, residual, layer, stride, padding, dilation, groups,
                 activation, negative_slope, threads):
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    shape = (n, k, _output_size(h, padding[0], dilation[0], r, stride[0]),
             _output_size(w, padding[1], dilation[1], s, stride[1]))
    channels_last = (not x.is_contiguous()
                     and x.is_contiguous(memory_format=torch.channels_last))
    return torch.empty(shape, dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last if channels_last
                       else torch.contiguous_format)


def _identity(tensor: Optional[torch.Tensor]):
    """What says a tensor is still the one whose values were packed: the object, its
    memory and layout, and torch's count of in-place changes to it. An inference tensor
    (made under ``torch.inference_mode``) has no such count, so nothing vouches for its
    values: it gets an identity of its own on every call, and its layer is packed again
    each time (:func:`_tracked` keeps the module's own parameters out of that case)."""
    if tensor is None:
        return None
    try:
        version = tensor._version
    except RuntimeError:   # "Inference tensors do not track version counter"
        version = object()
    return (id(tensor), tensor.data_ptr(), version, tuple(tensor.shape),
            tuple(tensor.stride()))


def _tracked(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32, contiguous, detached, and a normal tensor whose in-place
    changes torch counts: a model converted under ``torch.inference_mode`` (or its folded
    batch norms) hands over inference tensors, which count nothing; those are copied
    outside inference mode. Others are used as they are (no copy of a plain conv's
    weights)."""
    tensor = tensor.detach().to(torch.float32).contiguous()
    if tensor.is_inference():
        with torch.inference_mode(False):
            tensor = tensor.clone()
    return tensor


class _PackedLayer:
    """The ttile layers of one :class:`TTileConv2d`, one per layout, packed on first use
    from the module's current ``weight`` and ``bias`` and packed again when either is not
    the tensor (or the values) they were packed from."""

    def __init__(self, owner: "TTileConv2d"):
        self._owner = weakref.ref(owner)
        self.options = dict(stride=owner.stride, padding=owner.padding,
                            dilation=owner.dilation, groups=owner.groups,
                            activation=owner.activation,
                            negative_slope=owner.negative_slope)
        self._layers: dict[str, Conv2d] = {}
        self._source: tuple = ()      # (weight, bias) identities the layers were packed from
        self._tensors: tuple = ()     # the tensors themselves (so an id is not reused)
        self._lock = threading.Lock()

    def forget(self) -> None:
        with self._lock:
            self._layers.clear()
            self._source = self._tensors = ()
            _units_changed()

    def current(self, layout: str) -> Optional[Conv2d]:
        """The layer packed for ``layout``, unchecked (None if none): a
        :class:`TTileSequence`'s program checks the weights itself."""
        return self._layers.get(layout)

    def layer(self, layout: str) -> Conv2d:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("ttile: the TTileConv2d of these packed weights is gone")
        parameters = owner._parameters   # module attribute lookup costs a microsecond
        weight, bias = parameters["weight"], parameters.get("bias")
        source = (_identity(weight), _identity(bias))
        layer = self._layers.get(layout)
        if layer is not None and source == self._source:
            return layer
        with self._lock:
            if source != self._source:   # other tensors or changed values: pack again
                self._layers.clear()
                self._source, self._tensors = source, (weight, bias)
                _units_changed()
            layer = self._layers.get(layout)
            if layer is None:
                w = weight.detach().numpy()
                if layout == "NHWC":
                    w = w.transpose(2, 3, 1, 0)
                b = None if bias is None else np.ascontiguousarray(bias.detach().numpy())
                layer = Conv2d(np.ascontiguousarray(w), b, layout=layout, **self.options)
                self._layers[layout] = layer
        return layer

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], threads: int):
        # numpy's transpose of a view costs a third of torch's permute
        if x.is_contiguous(memory_format=torch.channels_last):
            layout, x_np = "NHWC", x.numpy().transpose(0, 2, 3, 1)
        else:
            layout, x_np = "NCHW", x.contiguous().numpy()
        r_np = None
        if residual is not None:
            if layout == "NHWC":
                r_np = residual.contiguous(memory_format=torch.channels_last)
                r_np = r_np.numpy().transpose(0, 2, 3, 1)
            else:
                r_np = residual.contiguous().numpy()
        y = self.layer(layout)(x_np, threads, residual=r_np)
        return torch.from_numpy(y.transpose(0, 3, 1, 2) if layout == "NHWC" else y)


def _serve_check(conv: nn.Conv2d) -> Optional[str]:
    """Why ttile cannot serve this convolution, or None."""
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not nn.Conv2d"
    if conv.weight.dtype != torch.float32:
        return f"weights are {conv.weight.dtype}, not float32"
    if conv.weight.device.type != "cpu":
        return f"weights are on {conv.weight.device}, not the CPU"
    if conv.padding_mode != "zeros":
        return f"padding_mode {conv.padding_mode!r}"
    if _numeric_padding(conv) is None:
        return f"padding {conv.padding!r} is not symmetric"
    return None


def _numeric_padding(conv: nn.Conv2d) -> Optional[tuple[int, int]]:
    if not isinstance(conv.padding, str):
        return tuple(conv.padding)
    if conv.padding == "valid":
        return (0, 0)
    # "same" (stride 1): total padding dilation * (k - 1) per side pair, symmetric only
    # when it is even.
    pads = []
    for k, d in zip(conv.kernel_size, conv.dilation):
        total = d * (k - 1)
        if total % 2:
            return None
        pads.append(total // 2)
    return tuple(pads)


class TTileConv2d(nn.Module):
    """A convolution (with its folded batch norm, residual add and activation) served by
    ttile. Made by :func:`convert`; ``forward(x, residual=None)``.

    ``source`` names the torch modules it replaces; ``not_fused`` says why a following
    batch norm, residual add or activation could not be looked for ("" when the graph
    was traced)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], stride, padding,
                 dilation, groups: int, activation: Optional[str] = None,
                 negative_slope: float = 0.01, residual: bool = False,
                 threads: Optional[int] = None, source: str = "", not_fused: str = ""):
        super().__init__()
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
            # forward at 1 thread). Tracing, export and fake tensors still meet the op.
            return self._packed.run(x, residual, self.threads or torch.get_num_threads())
        return conv2d_op(x, self.weight, self.bias, residual, self.layer_id,
                         list(self.stride), list(self.padding), list(self.dilation),
                         self.groups, self.activation or "", self.negative_slope,
                         self.threads or 0)

    def run_nhwc(self, x: np.ndarray, residual: Optional[np.ndarray], threads: int
                 ) -> np.ndarray:
        """The layer on an NHWC float32 array, for :class:`TTileSequence` (which has made
        the checks ``forward`` makes on tensors): on all ``threads``, the sequence's one
        team (``Conv2d``'s ``whole_team``)."""
        return self._packed.layer("NHWC")(x, self.threads or threads, residual=residual,
                                          whole_team=True)

    def extra_repr(self) -> str:
        k, cg, r, s = self.weight.shape
        return (f"{cg * self.groups}, {k}, kernel_size=({r}, {s}), stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, activation={self.activation}, "
                f"residual={self.residual}, source={self.source!r}")


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
    the checks on training mode and gradients) goes through the layers."""

    def __init__(self, expand: Optional[TTileConv2d], depthwise: TTileConv2d,
                 project: TTileConv2d):
        super().__init__()
        self.expand, self.depthwise, self.project = expand, depthwise, project
        self.source = " | ".join(m.source for m in self.layers)
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
                    residual=self.project.residual)
                self._packed_from, self._tensors = stamp, tensors
                _units_changed()
            return self._fused

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

    def run_nhwc(self, x: np.ndarray, threads: int) -> Optional[np.ndarray]:
        """The block on an NHWC float32 array, for :class:`TTileSequence`; None while
        its verdict at this shape is not known (the tensor path makes it). Without
        AVX-512 its layers serve it."""
        threads = self._modules["project"].threads or threads
        if InvertedResidual.unsupported() is None:
            plan = self.plans.get((x.shape, threads))
            if plan is None:
                return None
            if plan.verdict is BlockVerdict.FUSED:
                return self._block()(x, threads)
        y = x if self.expand is None else self.expand.run_nhwc(x, None, threads)
        y = self.depthwise.run_nhwc(y, None, threads)
        return self.project.run_nhwc(y, x if self.project.residual else None, threads)

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
                y = self._block()(x_np, threads)
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
        """The pooling of an NHWC float32 array, for :class:`TTileSequence`."""
        if self.kind is PoolKind.MAX:
            (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
            return _kernels.maxpool_nhwc(x, kh, kw, sh, sw, ph, pw, threads)
        return _kernels.global_avgpool_nhwc(x, threads)

    def bound_call(self, x_shape: tuple, threads: int) -> tuple:
        """``(call, out_shape)``: the pooling of NHWC inputs of ``x_shape`` as
        ``call(x, y, residual)`` writing y (no residual), for a sequence's
        :class:`~ttile.runtime.program.Program`."""
        n, h, w, c = x_shape
        if self.kind is PoolKind.MAX:
            (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
            out_shape = (n, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1, c)
            maxpool = _kernels.maxpool_nhwc

            def call(x, y, _residual):
                maxpool(x, kh, kw, sh, sw, ph, pw, threads, out=y)
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


def _kernel_name(choice) -> str:
    """A kernel choice in a few words, for the context verdict's table."""
    if choice.tile:
        return f"{choice.kind.value} F({choice.tile}x{choice.tile})"
    if choice.blocking:
        names = [b.name.lower().replace("_", " ") for b in type(choice.blocking)
                 if b and b in choice.blocking]
        return f"{choice.kind.value} ({', '.join(names)})"
    return choice.kind.value


@dataclass(frozen=True)
class ContextVerdict:
    """One layer's context verdict (:meth:`TTileSequence.settle`): the kernels that could
    serve it, the median time of each in place in the network, and which serves
    (``chosen``, an index; 0 is the default choice)."""

    layer: str
    input_shape: tuple
    threads: int
    alternatives: tuple
    medians_us: tuple
    chosen: int

    def describe(self) -> str:
        times = ", ".join(f"{name} {us:.0f} us" for name, us in
                          zip(self.alternatives, self.medians_us))
        return f"{self.layer}: {self.alternatives[self.chosen]} ({times})"


#: Bumped whenever a converted layer or block packs its weights anew or is told to
#: (``repack``): a sequence's program checks this one number instead of each unit's
#: packed copy.
_units_revision = 0


def _units_changed() -> None:
    global _units_revision
    _units_revision += 1


class _BoundSequence:
    """A sequence's :class:`~ttile.runtime.program.Program` at one input signature, and
    what its steps were bound from: it may run while :meth:`holds`."""

    __slots__ = ("program", "revisions", "tensors", "units", "unit_shapes")

    def __init__(self, program: Program, tensors: tuple, units: tuple, unit_shapes: tuple):
        self.program = program
        self.revisions = _BoundSequence.current_revisions()
        # (a module's _parameters, name, the tensor there or None, its version, address)
        self.tensors = tensors
        self.units = units               # each step's unit (its index in the sequence)
        self.unit_shapes = unit_shapes   # each unit's first input's shape

    @staticmethod
    def current_revisions() -> tuple:
        """The settings generation (kernel choices), the layers' bindings revision and
        the converted units' packing revision."""
        return _settings.generation(), bindings_revision(), _units_revision

    @staticmethod
    def stamps(modules) -> Optional[tuple]:
        """The ``tensors`` stamps of the modules' weights and biases now; None where one
        is an inference tensor (it counts no changes, so nothing vouches for it)."""
        stamps = []
        try:
            for module in modules:
                params = module._parameters
                for name in ("weight", "bias"):
                    t = params.get(name)
                    stamps.append((params, name, t, None if t is None else t._version,
                                   None if t is None else t.data_ptr()))
        except RuntimeError:   # "Inference tensors do not track version counter"
            return None
        return tuple(stamps)

    def holds(self) -> bool:
        """Whether every unit would still run what its step runs: no setting that
        chooses kernels changed, no layer's binding dropped or replaced (a pin, a new
        choice), no unit packed anew or told to (``repack``), and every weight and bias
        still the same tensor at the same address with no in-place change counted
        (what ``_PackedLayer`` and the blocks check before they use their packed
        copies). Run right after the previous inference's kernels, on cold caches, the
        tensors' check is most of it: about 85 us for MobileNetV2's 106 tensors at 1
        thread on a Zen 5 (13 us warm)."""
        if _BoundSequence.current_revisions() != self.revisions:
            return False
        for params, name, tensor, version, address in self.tensors:
            if params.get(name) is not tensor:
                return False
            if tensor is not None and (tensor._version != version
                                       or tensor.data_ptr() != address):
                return False
        return True


class TTileSequence(nn.Module):
    """Consecutive ttile layers, blocks and poolings (:class:`TTilePool2d`) of a traced
    model in one call: between them the activations stay NHWC numpy arrays, and no torch
    operation runs.

    Why: a torch operation right after a kernel meets caches the kernel has filled with
    its own data, and costs 15-20 us where it costs 1-2 warm (a Xeon model 167: the
    first ``torch.empty`` after a MobileNetV2 block's kernel); each layer called as a
    module runs two (the input's numpy view, the output's tensor). Run as one sequence,
    MobileNetV2's 20 layers and blocks took 2.9 ms at 2 threads against 3.3 called one by
    one.

    After the first run at an input signature (shapes and thread count) has made every
    unit's choice, the units are bound into a :class:`~ttile.runtime.program.Program`:
    their kernels called back to back, the activations in buffers the sequence keeps,
    no layer's Python in between. Later runs at that signature go through it while it
    holds (``_BoundSequence.holds``: the same weights, packed copies, choices and
    settings); otherwise the units run one by one and are bound again. MobileNetV2 ran
    1.06x faster through its program at 1 thread and 1.10x at 2 (Zen 5), ResNet-50
    1.03x at 2.

    ``steps`` are (unit name, value indices): value i < ``inputs`` is the i-th input, and
    each step's output is the next value; the last step's output is the sequence's. The
    sequence runs its units as modules, one by one, whenever the fast path does not
    apply: inputs that are not channels_last float32 CPU tensors, tracing and
    ``torch.compile``, training mode or inputs that need gradients (the units raise
    their errors), hooks on any unit (``ttile.torch.tune`` and the benchmarks' per-layer
    timing see every call), and a block's first call at a shape (its verdict is timed
    on tensors)."""

    def __init__(self, units: dict, steps: list, inputs: int):
        super().__init__()
        for name, unit in units.items():
            self.add_module(name, unit)
        self.steps = [(name, tuple(args)) for name, args in steps]
        self.inputs = int(inputs)
        self.verdicts: list = []   # the last context verdict (settle)
        self._refresh()
        self.eval()

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_programs", None)   # bound kernels, buffers and a lock: made again
        return state

    def _refresh(self) -> None:
        """The steps with their modules and the values each step is the last to read."""
        # input signature -> _BoundSequence, or the count of unbound runs since binding
        # last failed (see forward)
        self._programs: dict = {}
        last_read: dict = {}
        for i, (_, args) in enumerate(self.steps):
            for a in args:
                last_read[a] = i
        self._plan = [(getattr(self, name), args,
                       tuple(a for a in set(args) if last_read[a] == i))
                      for i, (name, args) in enumerate(self.steps)]
        # the modules whose hooks send a call down the slow path (_fast)
        self._watched = tuple(m for unit, _, _ in self._plan for m in (
            (unit, *unit._modules.values()) if type(unit) is TTileInvertedResidual
            else (unit,)))

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("verdicts", [])
        self._refresh()

    def _fast(self, xs) -> bool:
        if self.training or torch.compiler.is_compiling():
            return False
        grad = torch.is_grad_enabled()
        for x in xs:
            if (type(x) is not torch.Tensor or x.dtype is not torch.float32 or not x.is_cpu
                    or x.ndim != 4 or (grad and x.requires_grad)
                    or not x.is_contiguous(memory_format=torch.channels_last)):
                return False
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return False
        for module in self._watched:   # hooks on a unit or a block's layer see each call
            if module._forward_hooks or module._forward_pre_hooks:
                return False
        return True

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self._fast(xs):
            threads = torch.get_num_threads()
            values: list = [x.numpy().transpose(0, 2, 3, 1) for x in xs]
            key = (tuple(v.shape for v in values), threads)
            bound = self._programs.get(key)
            holds = type(bound) is _BoundSequence and bound.holds()
            if holds:
                y = bound.program.run(values)
                if y is not None:   # (None: another thread is running it)
                    return torch.from_numpy(y.transpose(0, 3, 1, 2))
            y = self._unbound(values, threads)
            if y is None:   # a verdict to make on tensors: this call goes slow
                return self._one_by_one(xs)
            if not holds:
                # bound after a run that made every choice; after a failed binding,
                # again every BIND_RETRY runs (a background tuning may have finished)
                if type(bound) is int and (bound + 1) % self.BIND_RETRY:
                    self._programs[key] = bound + 1
                else:
                    self._programs.pop(key, None)
                    bound = self._bind(key[0], threads)
                    self._keep(key, bound or 0)
            return torch.from_numpy(y.transpose(0, 3, 1, 2))
        return self._one_by_one(xs)

    #: Input signatures a sequence keeps a program for.
    MAX_PROGRAMS = 8
    #: Activation memory a sequence keeps for its programs beyond the newest one (each
    #: keeps about the peak of what a call of it has live at once).
    MAX_PROGRAM_BYTES = 256 << 20
    #: Unbound runs between two tries to bind a sequence that could not be bound.
    BIND_RETRY = 16

    def _keep(self, key, entry) -> None:
        """Keep ``entry`` (a bound program, or a count of runs since binding failed) for
        ``key``, the oldest signatures dropped beyond MAX_PROGRAMS and
        MAX_PROGRAM_BYTES."""
        programs = self._programs
        programs[key] = entry
        def kept_bytes():
            return sum(p.program.buffer_bytes for p in list(programs.values())
                       if type(p) is _BoundSequence)
        for old in list(programs):
            if old == key:
                continue
            if len(programs) <= self.MAX_PROGRAMS and kept_bytes() <= \
                    self.MAX_PROGRAM_BYTES + (entry.program.buffer_bytes
                                              if type(entry) is _BoundSequence else 0):
                break
            programs.pop(old, None)

    def _unbound(self, values: list, threads: int, shapes: Optional[list] = None,
                 elapsed: Optional[list] = None) -> Optional[np.ndarray]:
        """The units called one by one on NHWC arrays (each layer's own checks and
        choices): the output, or None where a unit's verdict is still to be made on
        tensors. With ``shapes`` and ``elapsed`` (:meth:`_timed_pass`), each unit's
        first input shape and its seconds are appended to them."""
        timed = elapsed is not None
        for unit, args, done in self._plan:
            if timed:
                shapes.append(values[args[0]].shape)
                t0 = time.perf_counter()
            if type(unit) is TTileConv2d:
                y = unit.run_nhwc(values[args[0]],
                                  values[args[1]] if len(args) > 1 else None, threads)
            else:
                y = unit.run_nhwc(values[args[0]], threads)
            if timed:
                elapsed.append(time.perf_counter() - t0)
            if y is None:
                return None
            for a in done:
                if a >= self.inputs:
                    values[a] = None   # the memory goes back as soon as it can
            values.append(y)
        return values[-1]

    def _bind(self, shapes: tuple, threads: int) -> Optional["_BoundSequence"]:
        """The units bound to their kernels for inputs of ``shapes`` at ``threads``, as
        the unbound run just made them choose (a :class:`~ttile.runtime.program.Program`
        and what it was bound from), or None where a unit has no final binding yet."""
        index = list(range(self.inputs))   # the sequence's values -> the program's
        shapes = list(shapes)               # the program's values' shapes
        steps: list = []
        layers: list = []
        blocks: list = []
        pending: list = []   # fused blocks: (step number, block, x shape, threads)

        def add(call, source: int, residual: int, out_shape) -> int:
            steps.append(Step(call, source, residual, tuple(out_shape)))
            shapes.append(tuple(out_shape))
            return len(shapes) - 1

        def add_layer(unit: TTileConv2d, source: int, residual: int) -> Optional[int]:
            t = unit.threads or threads
            layer = unit._packed.layer("NHWC")
            bound = layer.bound_nhwc(shapes[source], t, residual >= 0)
            if bound is None:
                return None
            layers.append(unit)
            return add(bound.bound_kernel[0], source, residual, bound.plan.out_shape)

        step_units: list = []
        unit_shapes: list = []
        for u, (unit, args, _) in enumerate(self._plan):
            source = index[args[0]]
            unit_shapes.append(shapes[source])
            residual = index[args[1]] if len(args) > 1 else -1
            kind = type(unit)
            if kind is TTileConv2d:
                value = add_layer(unit, source, residual)
            elif kind is TTilePool2d:
                call, out_shape = unit.bound_call(shapes[source], threads)
                value = add(call, source, -1, out_shape)
            else:
                t = unit._modules["project"].threads or threads
                key = (shapes[source], t)
                plan = unit.plans.get(key)
                if plan is None:
                    return None
                if (plan.verdict is BlockVerdict.FUSED
                        and InvertedResidual.unsupported() is None):
                    fused = unit._block()
                    blocks.append(unit)
                    pending.append((len(steps), fused, shapes[source], t))
                    value = add(None, source, -1, fused.output_shape(shapes[source]))
                else:
                    value = (source if unit.expand is None
                             else add_layer(unit.expand, source, -1))
                    if value is not None:
                        value = add_layer(unit.depthwise, value, -1)
                    if value is not None:
                        value = add_layer(unit.project, value,
                                          source if unit.project.residual else -1)
            if value is None:
                return None
            step_units += [u] * (len(steps) - len(step_units))
            index.append(value)
        modules = list(layers)
        for unit in blocks:
            modules += unit.layers
        tensors = _BoundSequence.stamps(modules)
        if tensors is None:
            return None
        if pending:   # the fused blocks share one scratch buffer: steps run one by one
            floats = max(block.scratch_floats(shape, t) for _, block, shape, t in pending)
            buffer = _kernels.empty_aligned((floats,))
            for i, block, shape, t in pending:
                call, _ = block.bound_call(shape, t, buffer)
                steps[i] = replace(steps[i], call=call)
        return _BoundSequence(Program(self.inputs, steps), tensors, tuple(step_units),
                              tuple(unit_shapes))

    def settle(self, *xs: torch.Tensor, rounds: int = 8, margin: float = 0.03,
               seed: int = 0) -> list["ContextVerdict"]:
        """The network's context verdict: each layer's alternatives (``Conv2d.
        alternatives``: a Winograd layer's other tile and direct kernel, a searched
        kernel's generic one, the generic kernel's other blockings) timed in place, in
        this sequence's fast path on ``xs``, and the fastest kept (``Conv2d.pin``) where
        it beats the default by more than ``margin`` in median; returns the verdicts,
        one per layer with alternatives. Interrupted, it leaves every layer on its
        default.

        Why in place: a layer alone runs with its weights and input warm; in a network
        its weights come from memory and its input from the previous layer, and the
        order of the kernels can change (``routes.alternatives``). Each round runs the
        whole sequence, every layer on one of its alternatives (layer i on alternative
        (round + offset_i) mod n_i, the offsets seeded), so each alternative is timed
        between the same neighbours as the others; the first rounds, one per
        alternative, pack the weights and are not counted. ``rounds`` timed calls per
        alternative. Nothing is settled (an empty list) where the fast path does not
        apply."""
        if not self._fast(xs):
            return []
        threads = torch.get_num_threads()
        first = self._timed_pass(xs, threads)   # the input shape each layer meets
        if first is None:
            return []
        units = {}   # step: (layer, input shape, threads, alternatives)
        for i, (unit, _, _) in enumerate(self._plan):
            if type(unit) is TTileConv2d:
                shape, t = first[0][i], unit.threads or threads
                layer = unit._packed.layer("NHWC")
                layer.pin(shape, t, None)
                alternatives = layer.alternatives(shape, t)
                if len(alternatives) > 1:
                    units[i] = (layer, shape, t, alternatives)
        if not units:
            return []
        rng = np.random.default_rng(seed)
        offsets = {i: int(rng.integers(len(alts))) for i, (*_, alts) in units.items()}
        widest = max(len(alts) for *_, alts in units.values())
        times: dict = {(i, a): [] for i, (*_, alts) in units.items()
                       for a in range(len(alts))}
        try:
            for round_ in range(widest * (rounds + 1)):
                picks = {i: (round_ + offsets[i]) % len(alts)
                         for i, (*_, alts) in units.items()}
                for i, (layer, shape, t, alts) in units.items():
                    layer.pin(shape, t, alts[picks[i]] if picks[i] else None)
                _, elapsed = self._timed_pass(xs, threads)
                if round_ >= widest:   # the first round of each alternative packs
                    for i, a in picks.items():
                        times[(i, a)].append(elapsed[i])
        except BaseException:
            for layer, shape, t, _ in units.values():
                layer.pin(shape, t, None)
            raise
        verdicts = []
        for i, (layer, shape, t, alts) in units.items():
            medians = tuple(statistics.median(times[(i, a)]) for a in range(len(alts)))
            best = min(range(len(alts)), key=medians.__getitem__)
            if medians[best] >= (1.0 - margin) * medians[0]:
                best = 0
            layer.pin(shape, t, alts[best] if best else None)
            layer.forget_packed(keep=alts[best].choice)
            verdicts.append(ContextVerdict(
                layer=self.steps[i][0], input_shape=tuple(shape), threads=t,
                alternatives=tuple(_kernel_name(a.choice) for a in alts),
                medians_us=tuple(round(m * 1e6, 1) for m in medians), chosen=best))
        return verdicts

    def _timed_pass(self, xs, threads: int) -> Optional[tuple[list, list]]:
        """One run of the fast path for :meth:`settle` and the benchmarks: each step's
        first input shape and its time in seconds, or None where a unit's verdict is
        still to be made on tensors. Through the program while one holds (a unit's
        time is then its kernels' calls alone), else unit by unit."""
        values: list = [x.numpy().transpose(0, 2, 3, 1) for x in xs]
        bound = self._programs.get((tuple(v.shape for v in values), threads))
        if type(bound) is _BoundSequence and bound.holds():
            times: list = []
            if bound.program.run(values, times) is not None:
                elapsed = [0.0] * len(self._plan)
                for unit, seconds in zip(bound.units, times):
                    elapsed[unit] += seconds
                return list(bound.unit_shapes), elapsed
        shapes: list = []
        elapsed: list = []
        if self._unbound(values, threads, shapes, elapsed) is None:
            return None
        return shapes, elapsed

    def _one_by_one(self, xs) -> torch.Tensor:
        values = list(xs)
        for unit, args, _ in self._plan:
            values.append(unit(*(values[a] for a in args)))
        return values[-1]

    def extra_repr(self) -> str:
        return f"{len(self.steps)} steps, {self.inputs} input{'s' if self.inputs > 1 else ''}"


# --- what follows a convolution in the graph -------------------------------------------

_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.LeakyReLU: "leaky_relu",
                       nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}
_ACTIVATION_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.relu6: "relu6",
                         F.leaky_relu: "leaky_relu", F.silu: "silu",
                         torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid"}
_ACTIVATION_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid"}
_ADDS = (operator.add, operator.iadd, torch.add)


@dataclass(frozen=True)
class _Activation:
    name: str
    negative_slope: float = 0.01


def _activation_of(node, modules) -> Optional[_Activation]:
    if node.op == "call_module":
        module = modules[node.target]
        if isinstance(module, nn.Hardtanh) and not isinstance(module, nn.ReLU6):
            return (_Activation("relu6") if (module.min_val, module.max_val) == (0.0, 6.0)
                    else None)
        name = _ACTIVATION_MODULES.get(type(module))
        if name == "leaky_relu":
            return _Activation(name, float(module.negative_slope))
        return None if name is None else _Activation(name)
    if node.op == "call_function":
        if node.target is F.hardtanh:
            low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
            high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
            return _Activation("relu6") if (low, high) == (0.0, 6.0) else None
        name = _ACTIVATION_FUNCTIONS.get(node.target)
        if name == "leaky_relu":
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get(
                "negative_slope", 0.01)
            return _Activation(name, float(slope)) if isinstance(slope, (int, float)) else None
        return None if name is None else _Activation(name)
    if node.op == "call_method" and len(node.args) == 1 and not node.kwargs:
        name = _ACTIVATION_METHODS.get(node.target)
        return None if name is None else _Activation(name)
    return None


def _sole_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _residual_of(add, tail):
    """The other operand of ``tail + other`` (a graph node), or None."""
    if add.op != "call_function" or add.target not in _ADDS or add.kwargs:
        return None
    if len(add.args) != 2:
        return None
    a, b = add.args
    other = b if a is tail else a if b is tail else None
    if other is None or other is tail or not isinstance(other, torch.fx.Node):
        return None
    return other


def _fold_batch_norm(weight, bias, bn: nn.BatchNorm2d):
    """Weights and bias of conv followed by bn (eval statistics), in float64 then float32."""
    scale = bn.weight.detach().double() if bn.weight is not None else torch.ones(
        bn.num_features, dtype=torch.float64)
    shift = bn.bias.detach().double() if bn.bias is not None else torch.zeros(
        bn.num_features, dtype=torch.float64)
    factor = scale / torch.sqrt(bn.running_var.detach().double() + bn.eps)
    w = weight.detach().double() * factor.reshape(-1, 1, 1, 1)
    b = bias.detach().double() if bias is not None else torch.zeros(
        weight.shape[0], dtype=torch.float64)
    b = (b - bn.running_mean.detach().double()) * factor + shift
    return w.float(), b.float()


def _foldable(bn, channels: int) -> bool:
    return (type(bn) is nn.BatchNorm2d and bn.num_features == channels
            and bn.track_running_stats and bn.running_mean is not None
            and bn.running_var is not None)


def _module_for(conv: nn.Conv2d, weight, bias, activation: Optional[_Activation],
                residual: bool, threads, source: str, not_fused: str = "") -> TTileConv2d:
    return TTileConv2d(weight, bias, conv.stride, _numeric_padding(conv), conv.dilation,
                       conv.groups, None if activation is None else activation.name,
                       0.01 if activation is None else activation.negative_slope,
                       residual, threads, source, not_fused)


def _replace_chain(gm: torch.fx.GraphModule, chain: list, module: nn.Module, name: str,
                   args: tuple) -> str:
    """One call of ``module`` in place of the graph nodes ``chain`` (in graph order, the
    last one giving the value the rest of the graph reads), fed ``args``; the module is
    registered under ``name`` (made unique). Returns the name."""
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, module)
    tail = chain[-1]
    with gm.graph.inserting_after(tail):
        new = gm.graph.call_module(name, tuple(args))
    tail.replace_all_uses_with(new)
    for old in reversed(chain):
        gm.graph.erase_node(old)
    return name


def _tidy(gm: torch.fx.GraphModule) -> None:
    """After a rewrite: check the graph, drop the modules it no longer calls, regenerate
    the code."""
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _rewrite_graph(gm: torch.fx.GraphModule, threads) -> int:
    """Replaces each eligible conv (+ bn, + add, + activation) chain by one TTileConv2d;
    returns how many."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.Conv2d):
            continue
        conv = modules[node.target]
        if _serve_check(conv) is not None or len(node.args) != 1 or node.kwargs:
            continue
        chain, source = [node], [node.target]
        weight, bias = conv.weight, conv.bias
        tail = node
        user = _sole_user(tail)
        if (user is not None and user.op == "call_module"
                and _foldable(modules.get(user.target), conv.out_channels)):
            weight, bias = _fold_batch_norm(weight, bias, modules[user.target])
            chain.append(user)
            source.append(user.target)
            tail = user
        residual = None
        user = _sole_user(tail)
        if user is not None:
            residual = _residual_of(user, tail)
            if residual is not None:
                chain.append(user)
                source.append("add")
                tail = user
        activation = None
        user = _sole_user(tail)
        if user is not None:
            activation = _activation_of(user, modules)
            if activation is not None:
                chain.append(user)
                source.append(activation.name)
                tail = user
        module = _module_for(conv, weight, bias, activation, residual is not None, threads,
                             "+".join(source))
        args = (node.args[0],) if residual is None else (node.args[0], residual)
        name = _replace_chain(gm, chain, module, "ttile_" + node.target.replace(".", "_"),
                              args)
        modules[name] = module
        count += 1
    _tidy(gm)
    return count


def _is_pointwise(m) -> bool:
    return (isinstance(m, TTileConv2d) and tuple(m.weight.shape[2:]) == (1, 1)
            and m.stride == (1, 1) and m.padding == (0, 0) and m.dilation == (1, 1)
            and m.groups == 1)


def _fuse_inverted_residuals(gm: torch.fx.GraphModule) -> int:
    """Replaces each expand (1x1) -> depthwise (3x3, padding 1, stride 1 or 2) -> project
    (1x1, residual only from the block's input) chain of converted layers, each feeding
    only the next, by one :class:`TTileInvertedResidual`, and each depthwise -> project
    pair left (its input from anything else: MobileNetV2's first block, MobileNetV1's
    pairs) by one without an expand stage; returns how many."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        project = modules.get(node.target) if node.op == "call_module" else None
        if not _is_pointwise(project) or not node.args:
            continue
        mid = node.args[0]
        if not isinstance(mid, torch.fx.Node) or mid.op != "call_module" \
                or _sole_user(mid) is not node or len(mid.args) != 1:
            continue
        depthwise = modules.get(mid.target)
        if not isinstance(depthwise, TTileConv2d) or depthwise.residual:
            continue
        e = depthwise.weight.shape[0]
        if (tuple(depthwise.weight.shape) != (e, 1, 3, 3) or depthwise.groups != e
                or depthwise.padding != (1, 1) or depthwise.dilation != (1, 1)
                or depthwise.stride not in ((1, 1), (2, 2))
                or project.weight.shape[1] != e):
            continue
        first = mid.args[0]
        expand = None
        if isinstance(first, torch.fx.Node) and first.op == "call_module" \
                and _sole_user(first) is mid and len(first.args) == 1:
            candidate = modules.get(first.target)
            if _is_pointwise(candidate) and not candidate.residual \
                    and candidate.weight.shape[0] == e:
                expand = candidate
        chain = [mid, node] if expand is None else [first, mid, node]
        block_input = first if expand is None else first.args[0]
        if not isinstance(block_input, torch.fx.Node):
            continue
        if project.residual:
            if len(node.args) != 2 or node.args[1] is not block_input \
                    or depthwise.stride != (1, 1):
                continue
        elif len(node.args) != 1:
            continue
        stages = [m for m in (expand, depthwise, project) if m is not None]
        if len({m.threads for m in stages}) != 1:
            continue
        block = TTileInvertedResidual(expand, depthwise, project)
        name = _replace_chain(gm, chain, block,
                              "ttile_block_" + chain[0].target.removeprefix("ttile_"),
                              (block_input,))
        modules[name] = block
        count += 1
    _tidy(gm)
    return count


def _is_global_average(node, modules) -> bool:
    """Whether the graph node is a global average pooling (its output is N x C x 1 x 1)."""
    if node.op == "call_module":
        module = modules.get(node.target)
        if isinstance(module, TTilePool2d):
            return module.kind is PoolKind.GLOBAL_AVERAGE
        return (type(module) is nn.AdaptiveAvgPool2d
                and module.output_size in (1, (1, 1)))
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        return size in (1, (1, 1), [1, 1])
    return False


def _is_flatten(node, modules) -> bool:
    """Whether the graph node flattens every dimension after the batch (``nn.Flatten()``,
    ``torch.flatten(x, 1)``, ``x.flatten(1)``)."""
    if node.op == "call_module":
        module = modules.get(node.target)
        return (type(module) is nn.Flatten and module.start_dim == 1
                and module.end_dim == -1)
    if (node.op == "call_function" and node.target is torch.flatten) or (
            node.op == "call_method" and node.target == "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    return False


def _serve_classifiers(gm: torch.fx.GraphModule, threads) -> int:
    """Replaces each classifier head - a global average pooling, a flatten, eval-mode
    dropouts, an ``nn.Linear`` (ResNet's and MobileNetV2's last layers) - by the pooling,
    a 1x1 :class:`TTileConv2d` whose weights are the linear layer's, then the flatten;
    returns how many.

    Why: after the pooling the map is N x C x 1 x 1, on which the linear layer is a 1x1
    convolution, and as one it joins the network's :class:`TTileSequence`. Left to
    torch, its call came right after ttile's last kernel with torch's own thread team
    cold, and took 200-400 us of MobileNetV2's 2.7 ms at 2 threads on a Zen 5 (65 us
    warm; ttile's kernel 45)."""
    modules = dict(gm.named_modules())
    count = 0
    for node in list(gm.graph.nodes):
        linear = modules.get(node.target) if node.op == "call_module" else None
        if (type(linear) is not nn.Linear or len(node.args) != 1 or node.kwargs
                or linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu"):
            continue
        chain = [node]
        flat = node.args[0]
        while (isinstance(flat, torch.fx.Node) and flat.op == "call_module"
               and type(modules.get(flat.target)) is nn.Dropout and len(flat.args) == 1
               and _sole_user(flat) is chain[0]):
            chain.insert(0, flat)
            flat = flat.args[0]
        if (not isinstance(flat, torch.fx.Node) or _sole_user(flat) is not chain[0]
                or not _is_flatten(flat, modules) or not flat.args
                or not isinstance(flat.args[0], torch.fx.Node)
                or not _is_global_average(flat.args[0], modules)):
            continue
        k, c = linear.weight.shape
        weight = linear.weight.detach().reshape(k, c, 1, 1)
        fc = TTileConv2d(weight, linear.bias, (1, 1), (0, 0), (1, 1), 1, threads=threads,
                         source="+".join(["flatten"] + [n.target for n in chain]))
        name = "ttile_" + node.target.replace(".", "_")
        while hasattr(gm, name):
            name += "_"
        gm.add_submodule(name, fc)
        modules[name] = fc
        with gm.graph.inserting_before(flat):
            fc_node = gm.graph.call_module(name, (flat.args[0],))
        flat.args = (fc_node,) + tuple(flat.args[1:])
        node.replace_all_uses_with(flat)
        for old in reversed(chain):
            gm.graph.erase_node(old)
        count += 1
    _tidy(gm)
    return count


def _is_unit(node, modules) -> bool:
    return (node.op == "call_module" and not node.kwargs
            and isinstance(modules.get(node.target),
                           (TTileConv2d, TTileInvertedResidual, TTilePool2d))
            and all(isinstance(a, torch.fx.Node) for a in node.args))


def _serve_pooling(gm: torch.fx.GraphModule) -> int:
    """Replaces each pooling module ttile serves (:meth:`TTilePool2d.serves`) by a
    :class:`TTilePool2d`, so that a sequence can run through it; returns how many."""
    modules = dict(gm.named_modules())
    count = 0
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and not node.kwargs and len(node.args) == 1
                and TTilePool2d.serves(modules.get(node.target))):
            _replace_chain(gm, [node], TTilePool2d(modules[node.target]),
                           "ttile_pool_" + node.target.replace(".", "_"), node.args)
            count += 1
        elif (node.op == "call_function" and _is_global_average(node, modules)
                and node.args and isinstance(node.args[0], torch.fx.Node)):
            # F.adaptive_avg_pool2d(x, 1), as torchvision's MobileNetV2 pools
            _replace_chain(gm, [node], TTilePool2d(nn.AdaptiveAvgPool2d(1)),
                           "ttile_pool_" + node.name, (node.args[0],))
            count += 1
    _tidy(gm)
    return count


def _sequence_segments(run: list) -> list:
    """Cuts a run of consecutive units where a unit's output is read outside its
    segment (a segment hands out its last output only)."""
    segments, current = [], []
    members = set(run)
    for node in run:
        current.append(node)
        if any(user not in members for user in node.users) and node is not run[-1]:
            segments.append(current)
            members -= set(current)
            current = []
    if current:
        segments.append(current)
    return segments


def _group_sequences(gm: torch.fx.GraphModule) -> int:
    """Replaces each run of two or more consecutive ttile units (layers, blocks and
    poolings) by one :class:`TTileSequence`; returns how many."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    runs, current = [], []
    for node in graph.nodes:
        if _is_unit(node, modules):
            current.append(node)
        else:
            if current:
                runs.append(current)
            current = []
    if current:
        runs.append(current)
    count = 0
    for run in runs:
        for segment in _sequence_segments(run):
            if len(segment) < 2:
                continue
            index = {node: i for i, node in enumerate(segment)}
            inputs: list = []
            for node in segment:
                for a in node.args:
                    if a not in index and a not in inputs:
                        inputs.append(a)
            steps = [(node.target, [index[a] + len(inputs) if a in index
                                    else inputs.index(a) for a in node.args])
                     for node in segment]
            sequence = TTileSequence({node.target: modules[node.target] for node in segment},
                                     steps, len(inputs))
            _replace_chain(gm, segment, sequence, f"ttile_run_{count}", tuple(inputs))
            count += 1
    _tidy(gm)
    return count


def _swap_modules(model: nn.Module, threads, not_fused: str, prefix: str = "") -> int:
    """The fallback for models that do not trace: each eligible nn.Conv2d alone
    (``not_fused`` says why nothing around it was fused)."""
    count = 0
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.Conv2d) and _serve_check(child) is None:
            setattr(model, name, _module_for(child, child.weight, child.bias, None, False,
                                             threads, path, not_fused))
            count += 1
        else:
            count += _swap_modules(child, threads, not_fused, path + ".")
    return count


def repack(model: nn.Module) -> None:
    """Have every ttile layer of ``model`` pack its weights again on its next call: for
    writes through ``.data``, which torch's version counter does not see. (Other changes
    of weights and biases are noticed by themselves.)"""
    for _, module in served_layers(model):
        module.repack()
    for module in model.modules():
        if isinstance(module, TTileInvertedResidual):
            module.repack()


def served_layers(model: nn.Module) -> list[tuple[str, TTileConv2d]]:
    """The (name, module) pairs of a converted model's ttile layers."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TTileConv2d)]


def convert(model: nn.Module, *, inplace: bool = False, threads: Optional[int] = None,
            example_input: Optional[torch.Tensor] = None, trace: bool = True,
            fuse_blocks: bool = True, sequences: bool = True,
            progress: bool = True, settle: bool = True) -> nn.Module:
    """The model with its eligible convolutions served by ttile (see the module's doc).

    Args:
        model: a module in eval mode (``model.eval()``); a model in training mode is
            refused, since ttile computes no gradients.
        inplace: change ``model`` itself (module swap only: a traced model is a new
            ``GraphModule`` either way) rather than a deep copy.
        threads: threads of each ttile call (None: ``torch.get_num_threads()`` at call).
        example_input: an input to run once after conversion: every convolution's shape is
            then tuned up front (a progress bar on stderr) and a table of what serves each
            layer printed, so that later calls run no tuning.
        trace: try ``torch.fx`` (fusing batch norms, residual adds and activations); False
            swaps modules only.
        fuse_blocks: serve inverted residual blocks (1x1 -> 3x3 depthwise -> 1x1) as one
            :class:`TTileInvertedResidual` each (traced models only).
        sequences: run each run of consecutive ttile layers, blocks and poolings as
            one :class:`TTileSequence` (traced models only), NHWC arrays between them
            (max and global average poolings become :class:`TTilePool2d` for that).
            A classifier after a global average pooling becomes a 1x1 layer either way.
        progress: show the progress bar and the table (with ``example_input``).
        settle: with ``example_input``, make each sequence's context verdict
            (:meth:`TTileSequence.settle`): the layers' alternative kernels timed in
            place in the network, the fastest kept.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert takes an nn.Module, got {type(model).__name__}")
    if model.training:
        raise RuntimeError("ttile.torch.convert serves inference only and the model is in "
                           "training mode: call model.eval() first (batch norms are folded "
                           "with their running statistics; ttile computes no gradients)")
    if not inplace:
        import copy
        model = copy.deepcopy(model)
    converted = None
    not_fused = "trace=False"
    if trace:
        try:
            gm = torch.fx.symbolic_trace(model)
        except Exception as exc:   # data-dependent control flow and the like: swap modules
            gm = None
            first_line = (str(exc).strip().splitlines() or [""])[0]
            not_fused = f"torch.fx could not trace the model ({type(exc).__name__}: " \
                        f"{first_line[:200]})"
            warnings.warn(f"ttile.torch.convert: {not_fused}; each convolution is served "
                          f"alone, without folding batch norms or fusing residual adds and "
                          f"activations (trace=False asks for this without the warning)",
                          RuntimeWarning, stacklevel=2)
        if gm is not None:
            _rewrite_graph(gm, threads)
            if fuse_blocks:
                _fuse_inverted_residuals(gm)
            if sequences:
                _serve_pooling(gm)
            _serve_classifiers(gm, threads)
            if sequences:
                _group_sequences(gm)
            converted = gm.eval()
    if converted is None:
        _swap_modules(model, threads, not_fused)
        converted = model
    if example_input is not None:
        tune(converted, example_input, progress=progress, settle=settle)
    return converted


def tune(model: nn.Module, example_input: torch.Tensor, *, progress: bool = True,
         settle: bool = True):
    """Runs the converted model once on ``example_input`` (tuning every ttile layer's
    shape on its first call, by the tuning policy of ``ttile.set_tuning``), then with
    ``settle`` makes each :class:`TTileSequence`'s context verdict on the inputs it met
    (kept in its ``verdicts``), and prints which kernel serves each layer; returns the
    rows of that table."""
    layers = served_layers(model)
    blocks = [(name, m) for name, m in model.named_modules()
              if isinstance(m, TTileInvertedResidual)]
    seen: list = []
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(layers), desc="ttile: tuning layers", unit="layer",
                       file=sys.stderr)
        except ImportError:
            bar = None

    def before(module, args):
        x = args[0]
        layout = ("NHWC" if x.is_contiguous(memory_format=torch.channels_last) else "NCHW")
        seen.append((module, tuple(x.shape), layout, args[1] is not None if len(args) > 1
                     else False))

    def after(module, args, output):
        if bar is not None:
            bar.update(1)

    def block_after(module, args, output):
        x = args[0]
        layout = ("NHWC" if x.is_contiguous(memory_format=torch.channels_last) else "NCHW")
        threads = module.project.threads or torch.get_num_threads()
        shape = tuple(x.shape)
        plan = module.plans.get(((shape[0], shape[2], shape[3], shape[1]), threads))
        if plan is not None and plan.verdict is BlockVerdict.FUSED:
            seen.append((module, shape, layout, plan))
            if bar is not None:
                bar.update(3)

    handles = []
    for _, module in layers:
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    for _, module in blocks:
        handles.append(module.register_forward_hook(block_after))
    sequence_inputs: list = []
    for module in model.modules():
        if isinstance(module, TTileSequence):
            handles.append(module.register_forward_pre_hook(
                lambda module, args: sequence_inputs.append((module, args))))
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        for handle in handles:
            handle.remove()
        if bar is not None:
            bar.close()
    verdicts = []
    if settle:
        for sequence, _ in sequence_inputs:
            sequence.verdicts = []
        for sequence, args in sequence_inputs:   # a sequence called twice: both inputs
            found = sequence.settle(*args)
            sequence.verdicts += found
            verdicts += found
    rows = []
    names = {id(m): name for name, m in layers + blocks}
    for module, shape, layout, residual in seen:
        if isinstance(module, TTileInvertedResidual):
            rows.append((names.get(id(module), "?"), module.source, shape, layout, residual,
                         ""))
            continue
        w_shape = tuple(module.weight.shape)
        n, c, h, w = shape
        x_shape = shape if layout == "NCHW" else (n, h, w, c)
        if layout == "NHWC":
            w_shape = (w_shape[2], w_shape[3], w_shape[1], w_shape[0])
        k, _, r, s = module.weight.shape
        ho = _output_size(h, module.padding[0], module.dilation[0], r, module.stride[0])
        wo = _output_size(w, module.padding[1], module.dilation[1], s, module.stride[1])
        out_shape = (n, k, ho, wo) if layout == "NCHW" else (n, ho, wo, k)
        kp = _ttile_plan(x_shape, w_shape, None if module.bias is None else module.bias.shape,
                         module.stride, module.padding, module.dilation, module.groups,
                         layout=layout, threads=module.threads or torch.get_num_threads(),
                         activation=module.activation, negative_slope=module.negative_slope,
                         residual=out_shape if residual else None, prepacked=True)
        rows.append((names.get(id(module), "?"), module.source, shape, layout, kp,
                     module.not_fused))
    if progress:
        print(format_table(rows), file=sys.stderr)
        changed = [v for v in verdicts if v.chosen]
        if verdicts:
            print(f"In place in the network, {len(changed)} of {len(verdicts)} layers with "
                  f"alternatives run faster on another kernel" + (":" if changed else "."),
                  file=sys.stderr)
        for verdict in changed:
            print(f"  {verdict.describe()}", file=sys.stderr)
    return rows


def format_table(rows) -> str:
    """The table :func:`tune` prints; its last column says what was lost (fusion that
    could not be tried, a degraded kernel choice), empty when nothing was."""
    lines = ["| layer | replaces | input | layout | kernel | threads | tuned for | epilogue "
             "| lost |", "|---|---|---|---|---|---|---|---|---|"]
    for name, source, shape, layout, kp, not_fused in rows:
        if isinstance(kp, BlockPlan):
            lines.append(f"| {name} | {source} | {'x'.join(map(str, shape))} | {layout} | "
                         f"inverted residual, {kp.verdict.value} | {kp.threads} | "
                         f"{kp.note} | {kp.epilogue} | |")
            continue
        tuned = ("" if kp.tuned_cpu is None else
                 f"{kp.tuned_cpu} x{kp.tuned_threads}")
        lost = "; ".join(x for x in (f"not fused: {not_fused}" if not_fused else "",
                                     kp.degraded) if x)
        lines.append(f"| {name} | {source} | {'x'.join(map(str, shape))} | {layout} | "
                     f"{kp.kind.value} | {kp.threads} | {tuned} | {kp.epilogue} | {lost} |")
    return "\n".join(lines)
