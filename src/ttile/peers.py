"""The engines a user compares ttile with, as single-convolution callables.

``ttile-generate run`` times each layer on ttile and on whichever of these is installed,
in the same process and the same rounds, so the table answers "is it faster than what I
use, on this CPU?". Each engine is optional: :func:`available` lists the ones that import,
and a missing one is a column left out, never an error. ``import ttile`` never imports this
module; it imports each engine only when asked for it.

Each runner takes an NCHW input and KCRS weights (what the engines take), is built once per
layer with its thread count fixed, and returns the output:

* ``torch``: ``torch.nn.functional.conv2d`` under ``torch.no_grad`` on the NCHW input
  (oneDNN on the CPU), torch's thread count set;
* ``onnxruntime``: a one-Conv ONNX model, default graph optimizations, ``intra_op``
  threads set;
* ``openvino``: the same ONNX model compiled for the CPU with ``INFERENCE_PRECISION_HINT``
  f32, ``PERFORMANCE_HINT`` LATENCY and ``INFERENCE_NUM_THREADS`` set. ``precision``
  None leaves the hint out: OpenVINO's default, bf16 on CPUs with AVX512_BF16 or AMX
  (``openvino_precision`` says what it picked).
"""
from __future__ import annotations

import importlib.util
from enum import Enum
from typing import Callable, Optional

import numpy as np


class Peer(str, Enum):
    TORCH = "torch"
    ONNXRUNTIME = "onnxruntime"
    OPENVINO = "openvino"


#: (module to import, extra modules the runner needs) per engine
_NEEDS = {Peer.TORCH: ("torch",), Peer.ONNXRUNTIME: ("onnxruntime", "onnx"),
          Peer.OPENVINO: ("openvino", "onnx")}


def available() -> list[Peer]:
    """The engines installed here, in table order."""
    return [peer for peer, modules in _NEEDS.items()
            if all(importlib.util.find_spec(m) is not None for m in modules)]


def version(peer: Peer) -> str:
    module = importlib.import_module(peer.value)
    return str(getattr(module, "__version__", "?")).split("-")[0]


def _conv_model(x_shape, w: np.ndarray, stride: tuple[int, int], pads: tuple[int, ...],
                groups: int) -> bytes:
    """One ONNX Conv node with the weights as an initializer (pads top, left, bottom,
    right as ONNX orders them)."""
    from onnx import TensorProto, helper, numpy_helper
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=list(stride),
                            pads=list(pads), group=groups)
    graph = helper.make_graph([node], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8   # opset 17's IR: an older runtime refuses a newer one
    return model.SerializeToString()


def runner(peer: Peer, x: np.ndarray, w: np.ndarray, stride: tuple[int, int],
           pads: tuple[int, int, int, int], groups: int,
           threads: int) -> Optional[Callable[[], np.ndarray]]:
    """A callable running the convolution of NCHW ``x`` by KCRS ``w`` on ``peer``;
    ``pads`` is (top, bottom, left, right). None when the engine cannot take it."""
    top, bottom, left, right = pads
    if peer is Peer.TORCH:
        import torch
        torch.set_num_threads(threads)
        if (top, left) != (bottom, right):
            return None
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)

        def run_torch():
            with torch.no_grad():
                return torch.nn.functional.conv2d(tx, tw, None, stride, (top, left), 1,
                                                  groups).numpy()
        return run_torch
    model = _conv_model(x.shape, w, stride, (top, left, bottom, right), groups)
    return onnx_runner(peer, model, x, threads)


def onnx_runner(peer: Peer, model: bytes, x: np.ndarray, threads: int,
                precision: Optional[str] = "f32") -> Callable[[], np.ndarray]:
    """A callable running the serialized ONNX ``model`` on its one input ``x`` with
    onnxruntime or OpenVINO, configured as the module text says (one place, so a single
    convolution and a whole network meet the same engine settings)."""
    if peer is Peer.ONNXRUNTIME:
        session = onnxruntime_session(model, threads)
        name = session.get_inputs()[0].name
        return lambda: session.run(None, {name: x})[0]
    if peer is not Peer.OPENVINO:
        raise ValueError(f"{peer.value} does not run ONNX models")
    request = openvino_request(model, threads, precision=precision)

    def run_openvino():
        request.infer({0: x})
        return request.get_output_tensor(0).data
    return run_openvino


def onnxruntime_session(model: bytes, threads: int, profile_prefix: Optional[str] = None):
    """An onnxruntime CPU session for ``model`` with the module text's settings; with
    ``profile_prefix``, profiling each node into a file of that prefix."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def openvino_request(model: bytes, threads: int, perf_counters: bool = False,
                     precision: Optional[str] = "f32"):
    """An OpenVINO CPU infer request for ``model`` with the module text's settings; with
    ``perf_counters``, timing each node (``PERF_COUNT``); ``precision`` the inference
    precision hint ("f32", "bf16"; None: OpenVINO's default for this CPU)."""
    import openvino as ov
    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": str(threads)}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    if perf_counters:
        config["PERF_COUNT"] = "YES"
    return core.compile_model(core.read_model(model=model), "CPU", config) \
        .create_infer_request()


def openvino_precision(threads: int = 1) -> str:
    """The inference precision OpenVINO picks by default on this CPU ("f32", "bf16", ...),
    read from a compiled one-node model."""
    import openvino as ov
    w = np.zeros((16, 16, 1, 1), np.float32)
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model=_conv_model((1, 16, 8, 8), w, (1, 1),
                                                                    (0, 0, 0, 0), 1)),
                                  "CPU", {"INFERENCE_NUM_THREADS": str(threads)})
    picked = compiled.get_property("INFERENCE_PRECISION_HINT")
    return picked.get_type_name() if hasattr(picked, "get_type_name") else str(picked)
