"""A user's network into the generator: the 2-D convolutions of an ONNX file as Layers.

``ttile-generate --onnx model.onnx`` searches these like a built-in network, and
``ttile-generate layers --onnx model.onnx`` lists them. Shapes come from ONNX shape
inference, so a file needs static channel and spatial sizes; a symbolic batch size is
read as 1 (the batch ttile's kernels are tuned for), a fixed one is kept.

Each Conv node's attributes are read as the ONNX operator set defines them: ``pads``
(begin values then end values), ``strides``, ``dilations``, ``group``, ``kernel_shape``
and ``auto_pad`` (NOTSET, VALID, SAME_UPPER with the odd pixel at the end, SAME_LOWER
with it at the start). Identical problems (ResNet repeats its blocks) are searched once:
a layer keeps the first node's name and counts the others.

Nodes that are not float32 2-D convolutions (Conv1d/3d, float16, ConvTranspose,
QLinearConv, ...) are listed as skipped with the reason, never dropped silently; a file
that cannot be read, has no graph, fails shape inference or has no 2-D convolution at
all is an ``OnnxImportError`` naming what is wrong. ``onnx`` is an optional extra,
imported only here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..core.spec import ConvSpec
from .networks import Layer

#: Operators that convolve but that ttile does not serve (listed, not searched).
_OTHER_CONVOLUTIONS = frozenset({"ConvTranspose", "ConvInteger", "QLinearConv", "FusedConv",
                                 "NhwcConv", "DeformConv"})


class OnnxImportError(ValueError):
    """The file cannot give the generator its convolution layers; the message says why."""


@dataclass(frozen=True)
class Skipped:
    """A convolution node of the file that the generator does not search."""

    node: str
    op_type: str
    reason: str


@dataclass(frozen=True)
class OnnxLayers:
    """What an ONNX file holds for the generator: distinct layers, in graph order, with the
    names of every node each one serves, and the convolutions it skips."""

    path: Path
    layers: tuple[Layer, ...]
    nodes: tuple[tuple[str, ...], ...]   # per layer: the nodes with that problem
    skipped: tuple[Skipped, ...]
    batch_from_symbol: bool              # a symbolic batch size was read as 1


def read_onnx_layers(path: str | Path) -> OnnxLayers:
    """The distinct 2-D float32 convolutions of the ONNX model at ``path``."""
    path = Path(path)
    try:
        import onnx
        from onnx import shape_inference
    except ImportError:
        raise OnnxImportError("reading an ONNX file needs the onnx package: "
                              "pip install 'ttile[onnx]'") from None
    if not path.is_file():
        raise OnnxImportError(f"{path}: no such file")
    try:
        # Only shapes are needed: weights kept in external files are not loaded.
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: not an ONNX model
        raise OnnxImportError(f"{path}: not an ONNX model ({type(exc).__name__}: "
                              f"{exc})") from None
    if not model.HasField("graph") or not model.graph.node:
        raise OnnxImportError(f"{path}: the model has no graph nodes")
    _check_order(path, model.graph)
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:
        reasons = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise OnnxImportError(f"{path}: ONNX shape inference failed: {reasons}") from None
    shapes = _tensor_shapes(inferred.graph)
    producers = {out: node for node in inferred.graph.node for out in node.output}
    stem = path.stem
    layers: list[Layer] = []
    nodes: list[list[str]] = []
    index: dict[tuple, int] = {}
    skipped: list[Skipped] = []
    symbolic_batch = False
    for number, node in enumerate(inferred.graph.node):
        name = _layer_name(node.name, stem, number)
        if node.domain not in ("", "ai.onnx") or node.op_type != "Conv":
            if node.op_type in _OTHER_CONVOLUTIONS:
                skipped.append(Skipped(name, node.op_type, f"{node.op_type} is not served"))
            continue
        try:
            spec, groups, batch_symbol = _conv_problem(node, shapes, producers)
        except _Skip as skip:
            skipped.append(Skipped(name, node.op_type, str(skip)))
            continue
        except (OnnxImportError, ValueError) as exc:
            raise OnnxImportError(f"{path}: Conv node {name!r}: {exc}") from None
        symbolic_batch |= batch_symbol
        key = (spec.key(), groups)
        if key in index:
            nodes[index[key]].append(name)
            continue
        index[key] = len(layers)
        layers.append(Layer.from_spec(name, spec, groups))
        nodes.append([name])
    if not layers:
        found = f"; skipped: {', '.join(f'{s.node} ({s.reason})' for s in skipped)}" \
            if skipped else ""
        raise OnnxImportError(f"{path}: no 2-D float32 Conv node to tune{found}")
    return OnnxLayers(path, tuple(layers), tuple(tuple(n) for n in nodes), tuple(skipped),
                      symbolic_batch)


class _Skip(Exception):
    """A well-formed convolution that ttile does not serve."""


def _tensor_shapes(graph) -> dict[str, tuple[tuple, int]]:
    """name -> (dims, element type) for every tensor whose type is known; a dim is an int
    or None when symbolic/unknown."""
    out: dict[str, tuple[tuple, int]] = {}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor = info.type.tensor_type
        if not info.type.HasField("tensor_type") or not tensor.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else None
                     for d in tensor.shape.dim)
        out[info.name] = (dims, tensor.elem_type)
    for init in graph.initializer:   # initializers win: they are the weights themselves
        out[init.name] = (tuple(init.dims), init.data_type)
    return out


def _check_order(path: Path, graph) -> None:
    """ONNX graphs list their nodes in topological order: a node reading a tensor that
    only a later node makes is a cycle (or a damaged file), which shape inference would
    report only as missing types."""
    known = {t.name for t in graph.input} | {t.name for t in graph.initializer} | {""}
    made_later = {out for node in graph.node for out in node.output}
    for node in graph.node:
        for tensor in node.input:
            if tensor not in known and tensor in made_later:
                raise OnnxImportError(f"{path}: node {node.name or node.op_type!r} reads "
                                      f"{tensor!r} before any node makes it: the graph has "
                                      f"a cycle or is not in topological order")
        known.update(node.output)


#: The most elements a tensor of a served convolution may hold: the kernels index
#: tensors with 32-bit offsets.
MAX_ELEMENTS = 2**31 - 1


def _conv_problem(node, shapes, producers) -> tuple[ConvSpec, int, bool]:
    """(one group's ConvSpec, groups, batch was symbolic) of a Conv node."""
    from onnx import TensorProto

    if len(node.input) < 2:
        raise OnnxImportError("a Conv needs an input X and weights W")
    x_name, w_name = node.input[0], node.input[1]
    for tensor in (x_name, w_name):
        if tensor not in shapes:
            producer = producers.get(tensor)
            why = (f"it is made by a {producer.op_type} node of domain {producer.domain!r}, "
                   f"which ONNX shape inference does not know"
                   if producer is not None and producer.domain not in ("", "ai.onnx")
                   else "export the model with static input sizes")
            raise OnnxImportError(f"shape inference gave no shape for {tensor!r}: {why}")
    x_dims, x_type = shapes[x_name]
    w_dims, w_type = shapes[w_name]
    if len(x_dims) != 4 or len(w_dims) != 4:
        raise _Skip(f"{len(x_dims) - 2}-D convolution (only 2-D is served)")
    if x_type != TensorProto.FLOAT:
        raise _Skip(f"element type {TensorProto.DataType.Name(x_type)} (only FLOAT is served)")
    if w_type != x_type:
        raise OnnxImportError(f"weights {w_name!r} are {TensorProto.DataType.Name(w_type)}, "
                              f"the input {TensorProto.DataType.Name(x_type)}: ONNX's Conv "
                              f"takes one element type for both")
    batch, c, h, w = x_dims
    if None in (c, h, w) or None in w_dims:
        raise OnnxImportError(f"input {x_name!r} has shape {_show(x_dims)} and weights "
                              f"{w_name!r} {_show(w_dims)}: channels and spatial sizes must "
                              f"be static (export with fixed input sizes)")
    for label, dims in (("input", x_dims), ("weights", w_dims)):
        if any(d is not None and d < 1 for d in dims):
            raise OnnxImportError(f"the {label} shape {_show(dims)} has a size below 1")
        elements = 1
        for d in dims:
            elements *= d or 1
        if elements > MAX_ELEMENTS:
            raise OnnxImportError(f"the {label} shape {_show(dims)} is too large: {elements} "
                                  f"elements, ttile's kernels index at most {MAX_ELEMENTS}")
    m, c_per_group, r, s = w_dims
    attrs = {a.name: a for a in node.attribute}
    groups = _int_attr(attrs, "group", 1)
    if groups < 1 or c != c_per_group * groups or m % groups:
        raise OnnxImportError(f"group={groups} does not fit input channels {c}, weights "
                              f"{_show(w_dims)}")
    kernel = _ints_attr(attrs, "kernel_shape", (r, s))
    if tuple(kernel) != (r, s):
        raise OnnxImportError(f"kernel_shape {list(kernel)} differs from the weights' "
                              f"{r}x{s}")
    strides = _ints_attr(attrs, "strides", (1, 1))
    dilations = _ints_attr(attrs, "dilations", (1, 1))
    if len(strides) != 2 or len(dilations) != 2 or min(strides + dilations) < 1:
        raise OnnxImportError(f"strides {list(strides)} / dilations {list(dilations)} must "
                              f"be two integers >= 1")
    auto_pad = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
    if auto_pad == "NOTSET":
        pads = _ints_attr(attrs, "pads", (0, 0, 0, 0))
        if len(pads) != 4 or min(pads) < 0:
            raise OnnxImportError(f"pads {list(pads)} must be four integers >= 0")
        top, left, bottom, right = pads
    elif auto_pad == "VALID":
        top = left = bottom = right = 0
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        (top, bottom), (left, right) = (
            _same_pads(size, k, stride, dilation, upper=auto_pad == "SAME_UPPER")
            for size, k, stride, dilation in ((h, r, strides[0], dilations[0]),
                                              (w, s, strides[1], dilations[1])))
    else:
        raise OnnxImportError(f"auto_pad {auto_pad!r} is not one of NOTSET, VALID, "
                              f"SAME_UPPER, SAME_LOWER")
    spec = ConvSpec(n=batch or 1, k=m // groups, c=c_per_group, h=h, w=w, r=r, s=s,
                    stride_h=strides[0], stride_w=strides[1], pad_top=top,
                    pad_bottom=bottom, pad_left=left, pad_right=right,
                    dilation_h=dilations[0], dilation_w=dilations[1])
    return spec, groups, batch is None


def _same_pads(size: int, k: int, stride: int, dilation: int, upper: bool) -> tuple[int, int]:
    """auto_pad SAME_*: the output has ceil(size / stride) pixels; the odd padding pixel
    goes to the end (UPPER) or the start (LOWER)."""
    out = -(-size // stride)
    total = max(0, (out - 1) * stride + (k - 1) * dilation + 1 - size)
    small, large = total // 2, total - total // 2
    return (small, large) if upper else (large, small)


def _int_attr(attrs, name: str, default: int) -> int:
    return int(attrs[name].i) if name in attrs else default


def _ints_attr(attrs, name: str, default: tuple) -> tuple[int, ...]:
    return tuple(int(v) for v in attrs[name].ints) if name in attrs else tuple(default)


def _show(dims: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def _layer_name(node_name: str, stem: str, number: int) -> str:
    """A layer name that is safe in records, C strings and C comments (protobuf hands a
    name that is not valid UTF-8 back as bytes)."""
    if isinstance(node_name, bytes):
        node_name = node_name.decode("utf-8", errors="replace")
    name = re.sub(r"[^A-Za-z0-9._/-]+", "_", node_name).strip("_/") if node_name else ""
    return f"{stem}/{name}" if name else f"{stem}/node{number}"
