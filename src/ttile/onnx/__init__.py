"""``ttile.onnx``: an ONNX model served by ttile, in one line.

    import ttile.onnx
    model = ttile.onnx.load("resnet50.onnx")          # or an onnx.ModelProto, or bytes
    y = model(x)                                      # numpy (or torch) NCHW in, numpy out

:func:`load` reads and checks the file, fixes its input shapes (the file's, or
``example_input``'s where the file leaves them symbolic), lets onnxruntime fold what the
graph computes from constants (weights made by ``Constant`` / ``Identity`` nodes, shared
initializers, batch norms after convolutions), and builds a ``torch.fx`` graph in which
the operators ttile serves are torch modules and every other run of operators is one
onnxruntime sub-model (:mod:`ttile.onnx.to_fx` lists which are which). That graph goes
through :func:`ttile.torch.convert`, so a loaded model is served exactly as a converted
PyTorch model is: fused epilogues and residuals, fused inverted residual blocks, NHWC
sequences bound into programs, the context verdicts made on an input of the served
shape at load.

Why onnxruntime for the rest, and not a converter to torch: the semantics of the ONNX
operators ttile does not serve stay those of the engine the file was made for, with no
operator re-implemented here (onnx2torch, the library that converts whole graphs to
torch, needs torchvision, whose compiled operators do not load with the CPU build of
torch). Needs the optional extra ``pip install 'ttile[onnx]'`` (onnx, onnxruntime, torch);
``import ttile`` never imports this module.
"""
from __future__ import annotations

import threading
from typing import Optional, Union

import numpy as np

from ..core.kinds import Precision
from .graph import GraphInput, OnnxModelError, prepare
from .to_fx import Declined, translate


class OnnxModel:
    """A loaded ONNX model: call it with the graph's inputs (numpy arrays or torch
    tensors, float32, the shapes it was loaded for); returns numpy arrays (one, or a
    tuple for several outputs).

    Attributes: ``module`` (the converted ``torch.fx.GraphModule``), ``inputs`` (names
    and served shapes), ``declined`` (the nodes onnxruntime runs, each with its reason),
    ``segments`` (how many onnxruntime sub-models), ``source``, ``precision``."""

    def __init__(self, module, inputs: tuple[GraphInput, ...], declined: tuple[Declined, ...],
                 segments: int, source: str, precision: Precision,
                 threads: Optional[int] = None):
        self.module = module
        self.inputs = inputs
        self.declined = declined
        self.segments = segments
        self.source = source
        self.precision = precision
        self._threads = threads
        self._staging = threading.Lock()   # the kept input buffers, one call at a time
        self._buffers: dict = {}

    def __call__(self, *xs):
        import torch
        if len(xs) != len(self.inputs):
            raise TypeError(f"the model takes {len(self.inputs)} input(s) "
                            f"({', '.join(i.name for i in self.inputs)}), got {len(xs)}")
        tensors = []
        for x, spec in zip(xs, self.inputs):
            if not isinstance(x, torch.Tensor):
                x = _float32(x, spec.name)
            elif x.dtype != torch.float32:
                raise TypeError(f"input {spec.name!r} must be float32, got {x.dtype}")
            if tuple(x.shape) != spec.shape:
                raise ValueError(f"input {spec.name!r} must have shape {spec.shape} (the "
                                 f"shape the model was loaded for), got {tuple(x.shape)}")
            tensors.append(x)
        threads = self._threads or torch.get_num_threads()
        staged = self._staging.acquire(blocking=False)   # (busy: another thread's call)
        try:
            tensors = [_native(x, self._buffers if staged else {}, i, threads)
                       for i, x in enumerate(tensors)]
            with torch.no_grad():
                y = self.module(*tensors)
        finally:
            if staged:
                self._staging.release()
        if isinstance(y, (tuple, list)):
            return tuple(_numpy(v) for v in y)
        return _numpy(y)

    def describe(self) -> str:
        """What serves the model: its ttile layers and what onnxruntime runs."""
        from ..torch import served_layers
        lines = [f"{self.source}: {len(served_layers(self.module))} convolution(s) served "
                 f"by ttile ({self.precision.value}), {self.segments} onnxruntime "
                 f"sub-model(s)"]
        lines += [f"  onnxruntime runs {d.node} ({d.op_type}): {d.reason}" for d in self.declined]
        return "\n".join(lines)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{i.name}{list(i.shape)}" for i in self.inputs)
        return (f"OnnxModel({self.source}, inputs {shapes}, {len(self.declined)} node(s) on "
                f"onnxruntime)")


def _float32(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(f"input {name!r} must be float32, got {a.dtype}")
    return np.ascontiguousarray(a)


def _native(x, buffers: dict, index: int, threads: int):
    """An input as the converted model takes it fastest: a 4-D NCHW input in
    channels_last, ttile's native NHWC (the layers after it then run with no layout
    change: 1.45x faster on ResNet-50 than from an NCHW input on a Xeon model 207),
    transposed by ttile's blocked kernel into a buffer kept for the next call (23 us for
    a 224x224 image at 2 threads, where torch's channels_last copy took 124)."""
    import torch

    from .. import _kernels
    from ..runtime.scratch import aligned_empty
    if isinstance(x, torch.Tensor):
        if x.dim() != 4 or x.is_contiguous(memory_format=torch.channels_last):
            return x
        if x.requires_grad or not x.is_contiguous() or x.device.type != "cpu":
            return x.contiguous(memory_format=torch.channels_last)
        x = x.numpy()
    elif x.ndim != 4:
        return torch.from_numpy(x)
    n, c, h, w = x.shape
    out = buffers.get(index)
    if out is None or out.shape != (n, h, w, c):
        out = aligned_empty((n, h, w, c))
        buffers[index] = out
    _kernels.nchw_to_nhwc(x, threads, out=out)
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def _numpy(y) -> np.ndarray:
    return y.detach().contiguous().numpy()


def load(model, example_input=None, *, threads: Optional[int] = None,
         precision: Union[str, Precision] = "fp32", progress: bool = False,
         settle: bool = True) -> OnnxModel:
    """An ONNX model (a file path, serialized bytes or an ``onnx.ModelProto``) served by
    ttile (see the module's doc).

    Args:
        model: the ONNX model.
        example_input: an input (or a tuple, one per graph input) of the shape to serve;
            needed where the file leaves a dimension symbolic. Each ttile layer is tuned,
            and each sequence's verdict made, on this input (on a seeded random one of
            the file's shapes without it).
        threads: threads of each ttile call and onnxruntime sub-model (None: torch's
            thread count at call).
        precision: "fp32" or "bf16" (see :func:`ttile.conv2d`).
        progress: print the tuning progress and the table of what serves each layer.
        settle: make the sequences' context verdicts at load (see
            :func:`ttile.torch.convert`).

    Raises :class:`OnnxModelError` (a ``ValueError``) naming what is wrong with a file
    that cannot be served: not ONNX, invalid, inputs that are not float32, dynamic shapes
    without ``example_input``, an operator nothing here can run."""
    import torch

    import ttile.torch as tt
    from ..runtime.bf16 import precision_of
    precision = precision_of(precision)
    examples = None
    if example_input is not None:
        items = example_input if isinstance(example_input, (tuple, list)) else (example_input,)
        examples = [x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
                    for x in items]
    prepared = prepare(model, examples)
    translation = translate(prepared, threads)
    if examples is None:
        rng = np.random.default_rng(0)
        examples = [rng.uniform(-1, 1, i.shape).astype(np.float32) for i in prepared.inputs]
    tensors = tuple(_native(_float32(x, i.name), {}, k, threads or torch.get_num_threads())
                    for k, (x, i) in enumerate(zip(examples, prepared.inputs)))
    converted = tt.convert(translation.module, inplace=True, threads=threads,
                           example_input=tensors if len(tensors) > 1 else tensors[0],
                           progress=progress, settle=settle, precision=precision)
    return OnnxModel(converted, prepared.inputs, translation.declined, translation.segments,
                     prepared.source, precision, threads)


__all__ = ["load", "OnnxModel", "OnnxModelError", "Declined", "GraphInput"]
