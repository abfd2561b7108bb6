"""The ``ttile::conv2d`` custom operator and the packed state behind it: the operator (and
its fake kernel, so that ``torch.export`` and ``torch.compile`` see through it) reaches
a converted layer's packed weights by the layer's id; :class:`_PackedLayer` packs them
from the module's current tensors and packs again when those change."""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional

import numpy as np
import torch
from torch import nn

from ..core.kinds import Precision
from ..runtime.conv_layer import Conv2d


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

    def __init__(self, owner: nn.Module):   # its TTileConv2d (modules.py)
        self._owner = weakref.ref(owner)
        self.options = dict(stride=owner.stride, padding=owner.padding,
                            dilation=owner.dilation, groups=owner.groups,
                            activation=owner.activation,
                            negative_slope=owner.negative_slope,
                            precision=getattr(owner, "precision", Precision.FP32))
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




#: Bumped whenever a converted layer or block packs its weights anew or is told to
#: (``repack``): a sequence's program checks this one number instead of each unit's
#: packed copy.
_units_revision = 0


def _units_changed() -> None:
    global _units_revision
    _units_revision += 1



def _units_revision_now() -> int:
    """The packing revision of every converted unit (see ``_units_revision``)."""
    return _units_revision
