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

from __future__ import annotations

from .conversion import convert, repack, served_layers, tune
from .modules import PoolKind, TTileConv2d, TTileInvertedResidual, TTilePool2d
from .op import _LAYERS, _PackedLayer, _packed_state, conv2d_op  # noqa: F401  (tests reach them)
from .sequence import ContextVerdict, TTileSequence
from .table import format_table

__all__ = ["convert", "TTileConv2d", "TTileInvertedResidual", "TTilePool2d", "TTileSequence",
           "PoolKind", "served_layers", "repack", "tune", "format_table", "ContextVerdict"]
