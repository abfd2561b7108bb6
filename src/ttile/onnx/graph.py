"""An ONNX model made ready to serve: read, checked, its shapes fixed and its constants
folded.

Folding is onnxruntime's: its basic graph optimizations (the level that keeps every node
a standard ONNX operator) compute what the graph computes from constants (``Constant``,
``ConstantOfShape``, ``Identity``, shape arithmetic), drop inference no-ops (``Dropout``)
and fold batch norms and constant scalings into the convolutions before them. Building
that session is also the check that every operator of the file can run somewhere: an
operator onnxruntime does not know is refused here, before anything else is built.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np


class OnnxModelError(ValueError):
    """The model cannot be served; the message says why (nothing was built)."""


@dataclass(frozen=True)
class GraphInput:
    """One input the caller gives: its name and the static shape it is served at."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PreparedGraph:
    """A folded model with static input shapes, and its value shapes where inference
    knows them (name -> dims)."""

    model: object                      # onnx.ModelProto
    inputs: tuple[GraphInput, ...]
    outputs: tuple[str, ...]
    shapes: dict
    source: str                        # the file, or "<ModelProto>"


def _imports():
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"ttile.onnx needs onnx and onnxruntime ({exc.name} is missing): "
                          f"pip install 'ttile[onnx]'") from None
    return onnx, onnxruntime


def read_model(model: Union[str, os.PathLike, bytes, object]):
    """The ModelProto of a path, serialized bytes or a ModelProto, and a name for it in
    messages."""
    onnx, _ = _imports()
    if isinstance(model, onnx.ModelProto):
        return model, "<ModelProto>"
    if isinstance(model, (bytes, bytearray)):
        try:
            return onnx.load_from_string(bytes(model)), "<bytes>"
        except Exception as exc:
            raise OnnxModelError(f"<bytes>: not an ONNX model ({type(exc).__name__}: "
                                 f"{exc})") from None
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"ttile.onnx.load takes a file path, bytes or an onnx.ModelProto, "
                        f"got {type(model).__name__}")
    path = Path(model)
    if not path.is_file():
        raise OnnxModelError(f"{path}: no such file")
    try:
        return onnx.load(str(path)), str(path)
    except Exception as exc:   # protobuf's DecodeError, a missing external data file, ...
        raise OnnxModelError(f"{path}: not an ONNX model ({type(exc).__name__}: "
                             f"{exc})") from None


def _graph_inputs(model, source: str, examples: Optional[Sequence[np.ndarray]]
                  ) -> tuple[GraphInput, ...]:
    """The inputs a caller gives (graph inputs that are not initializers), float32, with
    static shapes: the file's, or the examples' where the file leaves a dimension
    symbolic."""
    onnx, _ = _imports()
    initialized = {t.name for t in model.graph.initializer}
    declared = [v for v in model.graph.input if v.name not in initialized]
    if not declared:
        raise OnnxModelError(f"{source}: the graph takes no input")
    if examples is not None and len(examples) != len(declared):
        raise OnnxModelError(f"{source}: the graph takes {len(declared)} input(s) "
                             f"({', '.join(v.name for v in declared)}), "
                             f"example_input gives {len(examples)}")
    inputs = []
    for i, value in enumerate(declared):
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or \
                tensor.elem_type != onnx.TensorProto.FLOAT:
            kind = onnx.TensorProto.DataType.Name(tensor.elem_type) \
                if value.type.HasField("tensor_type") else value.type.WhichOneof("value")
            raise OnnxModelError(f"{source}: input {value.name!r} is {kind}; ttile.onnx "
                                 f"serves float32 inputs")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if examples is not None:
            shape = tuple(np.shape(examples[i]))
            if len(shape) != len(dims) or any(d is not None and d != s
                                               for d, s in zip(dims, shape)):
                shown = tuple(d if d is not None else "?" for d in dims)
                raise OnnxModelError(f"{source}: example input {i} has shape {shape}, the "
                                     f"graph's input {value.name!r} is {shown}")
        elif any(d is None for d in dims) or not tensor.HasField("shape"):
            shown = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                          for d in tensor.shape.dim)
            raise OnnxModelError(f"{source}: input {value.name!r} has dynamic dimensions "
                                 f"{shown}: pass example_input= to serve it at one shape")
        else:
            shape = tuple(dims)
        inputs.append(GraphInput(value.name, shape))
    return tuple(inputs)


def declared_shapes(model, symbolic_batch: Optional[int] = None) -> list[tuple[int, ...]]:
    """The shapes of the inputs a caller gives, as the file declares them; with
    ``symbolic_batch``, a symbolic first dimension read as that size (any other symbolic
    dimension is an error naming it)."""
    onnx, _ = _imports()
    proto, source = read_model(model)
    initialized = {t.name for t in proto.graph.initializer}
    shapes = []
    for value in proto.graph.input:
        if value.name in initialized:
            continue
        dims = []
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif i == 0 and symbolic_batch is not None:
                dims.append(symbolic_batch)
            else:
                raise OnnxModelError(f"{source}: input {value.name!r} has a dynamic "
                                     f"dimension {i} ({d.dim_param or '?'}): give an input "
                                     f"of the shape to serve (ttile.onnx.load's example_input)")
        shapes.append(tuple(dims))
    return shapes


def _fix_input_shapes(model, inputs: Sequence[GraphInput]) -> None:
    by_name = {i.name: i.shape for i in inputs}
    for value in model.graph.input:
        shape = by_name.get(value.name)
        if shape is None:
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for size in shape:
            dims.add().dim_value = size


def prepare(model, examples: Optional[Sequence[np.ndarray]] = None) -> PreparedGraph:
    """``model`` (see :func:`read_model`) checked, served at static input shapes, its
    constants and batch norms folded by onnxruntime."""
    onnx, ort = _imports()
    proto, source = read_model(model)
    if not proto.HasField("graph") or not proto.graph.node:
        raise OnnxModelError(f"{source}: the model has no graph nodes")
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise OnnxModelError(f"{source}: not a valid ONNX model: {str(exc).strip()}") from None
    proto = onnx.ModelProto.FromString(proto.SerializeToString())   # a copy to edit
    inputs = _graph_inputs(proto, source, examples)
    _fix_input_shapes(proto, inputs)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="ttile-onnx-") as folder:
        folded_path = os.path.join(folder, "folded.onnx")
        options.optimized_model_filepath = folded_path
        try:
            ort.InferenceSession(proto.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise OnnxModelError(f"{source}: onnxruntime cannot run this model, so neither "
                                 f"can ttile.onnx: {first}") from None
        folded = onnx.load(folded_path)
    try:
        inferred = onnx.shape_inference.infer_shapes(folded, data_prop=True)
    except Exception:
        inferred = folded   # shapes are a help (SAME padding), not a requirement
    shapes = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.input) + \
            list(inferred.graph.output):
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else None
                         for d in tensor.shape.dim)
            shapes[value.name] = (dims, tensor.elem_type)
    return PreparedGraph(inferred, inputs, tuple(o.name for o in inferred.graph.output),
                         shapes, source)


__all__ = ["OnnxModelError", "GraphInput", "PreparedGraph", "declared_shapes", "prepare",
           "read_model"]
