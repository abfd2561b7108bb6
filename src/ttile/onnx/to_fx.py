"""A prepared ONNX graph as a ``torch.fx.GraphModule`` that ``ttile.torch.convert``
serves: the operators ttile serves become the torch modules its rewrite passes replace,
and every other run of operators becomes one :class:`OrtSegment`, run by onnxruntime.

Served (mapped to torch, then replaced by ttile units):

* ``Conv`` (2-D, float32, weights and bias initializers, symmetric padding or
  ``auto_pad`` that resolves to it) -> ``nn.Conv2d``;
* ``BatchNormalization`` (inference, initializer statistics) -> ``nn.BatchNorm2d``;
* ``Relu``, ``LeakyRelu``, ``Sigmoid``, ``Clip`` (constant bounds: (0, 6) is ReLU6,
  (0, none) ReLU) and ``x * Sigmoid(x)`` (SiLU) -> the matching activation module;
* ``Add`` and two-input ``Sum`` of two computed values -> ``operator.add`` (a residual);
* ``MaxPool`` (2-D, symmetric padding), ``GlobalAveragePool`` (or ``ReduceMean`` over
  the spatial axes, as torch's dynamo exporter writes it), ``Flatten(axis=1)`` (or a
  ``Reshape`` of a 4-D value to (batch, -1)) and ``Gemm`` with constant weights (the
  classifier) -> ``nn.MaxPool2d``, ``nn.AdaptiveAvgPool2d(1)``, ``nn.Flatten``,
  ``nn.Linear``.

The semantics of everything else stay onnxruntime's: those nodes keep their ONNX form in
a sub-model of their own, so no operator is re-implemented here. A node the mapping
declines is said in :attr:`Translation.declined` with its reason, never dropped.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from .graph import OnnxModelError, PreparedGraph


@dataclass(frozen=True)
class Declined:
    """A node that onnxruntime runs, and why ttile does not."""

    node: str
    op_type: str
    reason: str


@dataclass(frozen=True)
class Translation:
    """The graph module, and what of the file it leaves to onnxruntime."""

    module: torch.fx.GraphModule
    declined: tuple[Declined, ...]
    segments: int                      # onnxruntime sub-models


class OrtSegment(nn.Module):
    """A run of ONNX nodes ttile does not serve, as an onnxruntime session of its own:
    NCHW float tensors in, the run's outputs (one tensor, or a tuple) out. Pickles and
    copies keep the sub-model's bytes and start a session of their own."""

    def __init__(self, model_bytes: bytes, inputs: tuple, outputs: tuple, threads=None):
        super().__init__()
        self._bytes = model_bytes
        self._inputs = inputs
        self._outputs = outputs
        self._threads = threads
        self._session = None

    def _start(self):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.inter_op_num_threads = 1
        if self._threads is not None:
            options.intra_op_num_threads = self._threads
        self._session = ort.InferenceSession(self._bytes, options,
                                             providers=["CPUExecutionProvider"])
        return self._session

    def forward(self, *xs: torch.Tensor):
        session = self._session or self._start()
        feed = {name: x.detach().contiguous().numpy() if isinstance(x, torch.Tensor)
                else np.asarray(x) for name, x in zip(self._inputs, xs)}
        outs = [torch.from_numpy(np.ascontiguousarray(y)) for y in session.run(None, feed)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_session"] = None
        return state

    def extra_repr(self) -> str:
        return f"onnxruntime: {', '.join(self._inputs)} -> {', '.join(self._outputs)}"


def _attrs(node) -> dict:
    import onnx
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _tensor(a) -> torch.Tensor:
    """A float32 tensor of its own (initializers are read-only numpy views)."""
    return torch.from_numpy(np.array(a, dtype=np.float32))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Decline(Exception):
    pass


class _Builder:
    """Walks the prepared graph in order, node by node."""

    def __init__(self, prepared: PreparedGraph):
        import onnx.numpy_helper as nh
        self.prepared = prepared
        graph = prepared.model.graph
        self.consts = {t.name: nh.to_array(t) for t in graph.initializer}
        self.consumers: dict = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        for name in prepared.outputs:
            self.consumers.setdefault(name, []).append(None)
        self.root = nn.Module()
        self.graph = torch.fx.Graph()
        self.values: dict = {}           # ONNX value name -> fx node
        self.declined: list = []
        self.absorbed: set = set()       # node ids handled with another node
        self.count = 0

    # -- helpers ----------------------------------------------------------------------
    def _module(self, kind: str, module: nn.Module) -> str:
        name = f"{kind}_{self.count}"
        self.count += 1
        self.root.add_module(name, module)
        return name

    def _value(self, name: str):
        if name in self.values:
            return self.values[name]
        raise _Decline(f"input {name!r} is a constant tensor, not a computed value")

    def _const(self, name: str, what: str) -> np.ndarray:
        if name not in self.consts:
            raise _Decline(f"its {what} is computed at run time, not a constant")
        return self.consts[name]

    def _shape(self, name: str):
        found = self.prepared.shapes.get(name)
        return None if found is None else found[0]

    def _float(self, name: str) -> None:
        import onnx
        found = self.prepared.shapes.get(name)
        if found is not None and found[1] != onnx.TensorProto.FLOAT:
            raise _Decline(f"{name!r} is {onnx.TensorProto.DataType.Name(found[1])}, "
                           f"not float32")

    # -- the mapping ------------------------------------------------------------------
    def conv(self, node, a) -> nn.Module:
        if len(node.input) < 2:
            raise _Decline("no weights")
        w = self._const(node.input[1], "weight")
        if w.ndim != 4 or w.dtype != np.float32:
            raise _Decline(f"a {w.ndim - 2}-D {w.dtype} convolution (ttile serves 2-D float32)")
        self._float(node.input[0])
        bias = self._const(node.input[2], "bias") if len(node.input) > 2 and node.input[2] \
            else None
        k, cg, r, s = w.shape
        groups = int(a.get("group", 1))
        strides = tuple(a.get("strides", (1, 1)))
        dilations = tuple(a.get("dilations", (1, 1)))
        if "kernel_shape" in a and tuple(a["kernel_shape"]) != (r, s):
            raise _Decline("kernel_shape does not match the weights")
        auto_pad = _text(a.get("auto_pad", "NOTSET"))
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            shape = self._shape(node.input[0])
            if shape is None or len(shape) != 4 or None in shape[2:]:
                raise _Decline("SAME padding on an input of unknown size")
            pads = []
            for size, kk, st, dl in zip(shape[2:], (r, s), strides, dilations):
                total = max((-(-size // st) - 1) * st + (kk - 1) * dl + 1 - size, 0)
                low = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
                pads.append((low, total - low))
            begin, end = (pads[0][0], pads[1][0]), (pads[0][1], pads[1][1])
        elif auto_pad == "VALID":
            begin = end = (0, 0)
        else:
            p = tuple(a.get("pads", (0, 0, 0, 0)))
            begin, end = p[:2], p[2:]
        if begin != end:
            raise _Decline(f"asymmetric padding {begin + end}")
        conv = nn.Conv2d(cg * groups, k, (r, s), strides, begin, dilations, groups,
                         bias=bias is not None)
        with torch.no_grad():
            conv.weight.copy_(_tensor(w))
            if bias is not None:
                conv.bias.copy_(_tensor(bias))
        return conv

    def batch_norm(self, node, a) -> nn.Module:
        if len(node.output) > 1 and any(node.output[1:]) or a.get("training_mode", 0):
            raise _Decline("training-mode batch norm")
        scale, bias, mean, var = (self._const(n, "statistics") for n in node.input[1:5])
        if scale.ndim != 1:
            raise _Decline("statistics are not per channel")
        shape = self._shape(node.input[0])
        if shape is not None and len(shape) != 4:
            raise _Decline(f"a {len(shape)}-D input")
        bn = nn.BatchNorm2d(scale.shape[0], eps=float(a.get("epsilon", 1e-5)))
        with torch.no_grad():
            for param, value in ((bn.weight, scale), (bn.bias, bias),
                                 (bn.running_mean, mean), (bn.running_var, var)):
                param.copy_(_tensor(value))
        return bn.eval()

    def clip(self, node, a) -> nn.Module:
        low = a.get("min")
        high = a.get("max")
        if len(node.input) > 1 and node.input[1]:
            low = float(self._const(node.input[1], "lower bound"))
        if len(node.input) > 2 and node.input[2]:
            high = float(self._const(node.input[2], "upper bound"))
        if low == 0.0 and high == 6.0:
            return nn.ReLU6()
        if low == 0.0 and high is None:
            return nn.ReLU()
        raise _Decline(f"Clip({low}, {high}) is not an activation ttile fuses")

    def max_pool(self, node, a) -> nn.Module:
        if len(node.output) > 1 and node.output[1]:
            raise _Decline("the indices output")
        kernel = tuple(a["kernel_shape"])
        if len(kernel) != 2:
            raise _Decline(f"a {len(kernel)}-D pooling")
        if _text(a.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
            raise _Decline("SAME auto_pad")
        p = tuple(a.get("pads", (0, 0, 0, 0)))
        if p[:2] != p[2:]:
            raise _Decline(f"asymmetric padding {p}")
        if a.get("storage_order", 0):
            raise _Decline("column-major storage order")
        return nn.MaxPool2d(kernel, tuple(a.get("strides", (1, 1))), p[:2],
                            tuple(a.get("dilations", (1, 1))), ceil_mode=bool(a.get("ceil_mode", 0)))

    def gemm(self, node, a) -> nn.Module:
        if a.get("transA", 0):
            raise _Decline("transA")
        w = self._const(node.input[1], "weight")
        if w.ndim != 2:
            raise _Decline("weights are not a matrix")
        w = w if a.get("transB", 0) else w.T
        c = self._const(node.input[2], "bias") if len(node.input) > 2 and node.input[2] \
            else None
        if c is not None and c.size != w.shape[0] and c.size != 1:
            raise _Decline("a bias that is not one value per output")
        linear = nn.Linear(w.shape[1], w.shape[0], bias=c is not None)
        with torch.no_grad():
            linear.weight.copy_(_tensor(float(a.get("alpha", 1.0)) * w))
            if c is not None:
                linear.bias.copy_(_tensor(np.broadcast_to(float(a.get("beta", 1.0)) * c.reshape(-1),
                                                          (w.shape[0],))))
        return linear

    def reduce_mean(self, node, a) -> bool:
        """A mean over the two spatial axes: a global average pooling (and a flatten
        where the axes are not kept)."""
        shape = self._shape(node.input[0])
        if shape is None or len(shape) != 4:
            raise _Decline("not a mean over a 4-D input of known rank")
        axes = a.get("axes")
        if len(node.input) > 1 and node.input[1]:
            axes = self._const(node.input[1], "axes").tolist()
        if axes is None or sorted(int(x) % 4 for x in axes) != [2, 3]:
            raise _Decline(f"a mean over axes {axes}, not the spatial ones")
        pooled = self.graph.call_module(self._module("avg_pool", nn.AdaptiveAvgPool2d(1)),
                                        (self._value(node.input[0]),))
        if not int(a.get("keepdims", 1)):
            pooled = self.graph.call_module(self._module("flatten", nn.Flatten(1)), (pooled,))
        self.values[node.output[0]] = pooled
        return True

    def reshape(self, node, a) -> bool:
        """A reshape to (batch, everything else) of a 4-D value: a flatten, the same
        elements in the same order."""
        shape = self._shape(node.input[0])
        target = [int(x) for x in self._const(node.input[1], "shape").reshape(-1)]
        if shape is None or len(shape) != 4 or None in shape or len(target) != 2:
            raise _Decline("not a flatten of a 4-D value")
        n, rest = shape[0], shape[1] * shape[2] * shape[3]
        batch_ok = target[0] == n or (target[0] == 0 and not a.get("allowzero", 0))
        if not batch_ok or target[1] not in (-1, rest):
            raise _Decline(f"a reshape to {target}, not (batch, -1)")
        return self._call(node, "flatten", nn.Flatten(1), [node.input[0]])

    def serve(self, node) -> bool:
        """Adds ``node`` (and a node it absorbs) to the graph as torch modules; False
        where onnxruntime is to run it (the reason recorded)."""
        op, a = node.op_type, _attrs(node)
        if node.domain not in ("", "ai.onnx"):
            raise _Decline(f"operator domain {node.domain!r}")
        if op == "Conv":
            return self._call(node, "conv", self.conv(node, a), [node.input[0]])
        if op == "BatchNormalization":
            return self._call(node, "bn", self.batch_norm(node, a), [node.input[0]])
        if op == "Relu":
            return self._call(node, "relu", nn.ReLU(), [node.input[0]])
        if op == "LeakyRelu":
            return self._call(node, "leaky_relu", nn.LeakyReLU(float(a.get("alpha", 0.01))),
                              [node.input[0]])
        if op == "Clip":
            return self._call(node, "clip", self.clip(node, a), [node.input[0]])
        if op == "Sigmoid":
            silu = self._silu_of(node)
            if silu is not None:
                self._call(silu, "silu", nn.SiLU(), [node.input[0]])
                self.absorbed.add(id(silu))
                return True
            return self._call(node, "sigmoid", nn.Sigmoid(), [node.input[0]])
        if op in ("Add", "Sum"):
            if len(node.input) != 2:
                raise _Decline(f"{op} of {len(node.input)} inputs")
            shapes = [self._shape(n) for n in node.input]
            if None in shapes or shapes[0] != shapes[1]:
                raise _Decline("operands of other or unknown shapes (broadcasting)")
            args = [self._value(n) for n in node.input]
            self.values[node.output[0]] = self.graph.call_function(operator.add, tuple(args))
            return True
        if op == "MaxPool":
            return self._call(node, "max_pool", self.max_pool(node, a), [node.input[0]])
        if op == "GlobalAveragePool":
            shape = self._shape(node.input[0])
            if shape is None or len(shape) != 4:
                raise _Decline("not a 2-D pooling")
            return self._call(node, "avg_pool", nn.AdaptiveAvgPool2d(1), [node.input[0]])
        if op == "ReduceMean":   # torch's dynamo exporter writes global pooling so
            return self.reduce_mean(node, a)
        if op == "Reshape":      # and flattening after it (x.view(n, -1)) so
            return self.reshape(node, a)
        if op == "Flatten":
            if int(a.get("axis", 1)) != 1:
                raise _Decline(f"axis {a.get('axis')}")
            return self._call(node, "flatten", nn.Flatten(1), [node.input[0]])
        if op == "Gemm":
            shape = self._shape(node.input[0])
            if shape is not None and len(shape) != 2:
                raise _Decline("not a matrix input")
            return self._call(node, "linear", self.gemm(node, a), [node.input[0]])
        if op in ("Identity", "Dropout") and (len(node.output) == 1 or not node.output[1]):
            self.values[node.output[0]] = self._value(node.input[0])
            return True
        raise _Decline(f"{op} is not a ttile operator")

    def _silu_of(self, node):
        """The ``Mul(x, Sigmoid(x))`` node that makes this Sigmoid a SiLU, if any."""
        users = self.consumers.get(node.output[0], [])
        if len(users) != 1 or users[0] is None:
            return None
        mul = users[0]
        if mul.op_type == "Mul" and mul.domain in ("", "ai.onnx") and \
                sorted(mul.input) == sorted([node.input[0], node.output[0]]):
            return mul
        return None

    def _call(self, node, kind: str, module: nn.Module, inputs: list) -> bool:
        args = tuple(self._value(n) for n in inputs)
        target = self._module(kind, module)
        self.values[node.output[0]] = self.graph.call_module(target, args)
        return True


def _segment_model(prepared: PreparedGraph, nodes: list, inputs: list, outputs: list,
                   consts: dict) -> bytes:
    """The ONNX sub-model of ``nodes``: the outer values it reads as inputs, the
    constants it reads as initializers, the values read after it as outputs."""
    import onnx
    from onnx import helper, numpy_helper

    def value(name):
        found = prepared.shapes.get(name)
        if found is None:
            return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        dims, elem = found
        return helper.make_tensor_value_info(name, elem, list(dims))
    used = {n for node in nodes for n in node.input if n in consts}
    graph = helper.make_graph(nodes, "ttile_onnxruntime_segment",
                              [value(n) for n in inputs], [value(n) for n in outputs],
                              [numpy_helper.from_array(consts[n], n) for n in sorted(used)])
    model = helper.make_model(graph, opset_imports=list(prepared.model.opset_import),
                              ir_version=prepared.model.ir_version)
    return model.SerializeToString()


def translate(prepared: PreparedGraph, threads: Optional[int] = None) -> Translation:
    """The prepared graph as a torch.fx GraphModule (see the module's doc)."""
    b = _Builder(prepared)
    for item in prepared.inputs:
        b.values[item.name] = b.graph.placeholder(_identifier(item.name, len(b.values)))
    nodes = list(prepared.model.graph.node)
    run: list = []                        # the current run of nodes onnxruntime serves
    segments = 0

    def flush(later_nodes):
        nonlocal segments
        if not run:
            return
        produced = {o for node in run for o in node.output if o}
        needed_later = {n for node in later_nodes for n in node.input} | set(prepared.outputs)
        inputs, outputs = [], []
        for node in run:
            for name in node.input:
                if name and name not in produced and name not in b.consts \
                        and name not in inputs:
                    inputs.append(name)
        for node in run:
            outputs += [o for o in node.output if o and o in needed_later]
        for name in inputs:
            if name not in b.values:
                raise OnnxModelError(f"{prepared.source}: value {name!r} is read before it "
                                     f"is computed (the nodes are not in order)")
        data = _segment_model(prepared, list(run), inputs, outputs, b.consts)
        target = b._module("onnxruntime", OrtSegment(data, tuple(inputs), tuple(outputs),
                                                     threads))
        call = b.graph.call_module(target, tuple(b.values[n] for n in inputs))
        if len(outputs) == 1:
            b.values[outputs[0]] = call
        else:
            for i, name in enumerate(outputs):
                b.values[name] = b.graph.call_function(operator.getitem, (call, i))
        segments += 1
        run.clear()

    for index, node in enumerate(nodes):
        if id(node) in b.absorbed:
            continue
        try:
            if any(name and name not in b.values and name not in b.consts
                   for name in node.input):
                raise _Decline("reads a value onnxruntime computes in the same run")
            b.serve(node)
            continue
        except _Decline as why:
            b.declined.append(Declined(node.name or f"node {index}", node.op_type, str(why)))
        run.append(node)
        # the run ends where the next node is one ttile serves; flush lazily below
        nxt = nodes[index + 1] if index + 1 < len(nodes) else None
        if nxt is None or _servable_hint(nxt):
            flush(nodes[index + 1:])
    flush([])
    outputs = []
    for name in prepared.outputs:
        if name not in b.values:
            raise OnnxModelError(f"{prepared.source}: output {name!r} is never computed")
        outputs.append(b.values[name])
    b.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    module = torch.fx.GraphModule(b.root, b.graph)
    return Translation(module.eval(), tuple(b.declined), segments)


_SERVED_OPS = frozenset({"Conv", "BatchNormalization", "Relu", "LeakyRelu", "Clip", "Sigmoid",
                         "Add", "Sum", "MaxPool", "GlobalAveragePool", "ReduceMean", "Flatten",
                         "Reshape", "Gemm", "Identity", "Dropout"})


def _servable_hint(node) -> bool:
    """Whether the next node may be served by ttile (the run before it then ends; a node
    that turns out not to be starts a run of its own, which costs a session call, never a
    wrong result)."""
    return node.op_type in _SERVED_OPS and node.domain in ("", "ai.onnx")


def _identifier(name: str, index: int) -> str:
    clean = "".join(ch if ch.isalnum() else "_" for ch in name)
    return clean if clean and clean[0].isalpha() else f"input_{index}"


__all__ = ["Declined", "OrtSegment", "Translation", "translate"]
