"""ttile.onnx.load: ONNX files served through ttile.torch.convert, checked against
onnxruntime on the same file; the operators ttile does not serve run on onnxruntime;
bad files refused with one clear message."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import ttile.onnx  # noqa: E402
from ttile.onnx import OnnxModelError  # noqa: E402


def _export(model, x, dynamic_batch=False) -> bytes:
    buffer = io.BytesIO()
    axes = {"x": {0: "batch"}} if dynamic_batch else None
    torch.onnx.export(model.eval(), (x,), buffer, opset_version=17, dynamo=False,
                      input_names=["x"], dynamic_axes=axes)
    return buffer.getvalue()


def _onnxruntime(data: bytes, *xs):
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, xs)))


def _error(y, ref) -> float:
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def _randomize_batch_norms(model):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=gen) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model


class _Block(nn.Module):
    def __init__(self, c, stride):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride, 1, bias=False),
                               nn.BatchNorm2d(2 * c), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, 1, 1, bias=False),
                               nn.BatchNorm2d(2 * c))
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 1, stride, bias=False),
                                  nn.BatchNorm2d(2 * c))

    def forward(self, x):
        return torch.relu(self.b(self.a(x)) + self.down(x))


def _small_resnet():
    return _randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1), _Block(16, 1), _Block(32, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)))


class _InvertedResidual(nn.Module):
    def __init__(self, c, e):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
            nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
            nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


def _small_mobilenet():
    return _randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        _InvertedResidual(16, 96), _InvertedResidual(16, 96),
        nn.Conv2d(16, 32, 1, groups=2), nn.SiLU(),        # a grouped 1x1, a SiLU
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)))


@pytest.mark.parametrize("make", [_small_resnet, _small_mobilenet], ids=["resnet", "mobilenet"])
def test_an_exported_network_runs_as_onnxruntime_runs_it(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(1, 3, 64, 64)
    data = _export(model, x)
    served = ttile.onnx.load(data, threads=1)
    assert served.segments == 0 and served.declined == ()   # every node is ttile's
    y = served(x.numpy())
    assert isinstance(y, np.ndarray) and y.shape == (1, 10)
    assert _error(y, _onnxruntime(data, x.numpy())[0]) < 1e-4
    assert _error(served(x), _onnxruntime(data, x.numpy())[0]) < 1e-4   # a torch input
    # the same layers as the PyTorch model converted directly
    import ttile.torch as tt
    direct = tt.convert(model, threads=1)
    assert len(tt.served_layers(served.module)) == len(tt.served_layers(direct))


def test_a_file_path_and_a_model_proto_load_alike(tmp_path):
    torch.manual_seed(1)
    model = _small_resnet()
    x = torch.randn(1, 3, 32, 32)
    path = tmp_path / "net.onnx"
    path.write_bytes(_export(model, x))
    by_path = ttile.onnx.load(path, threads=1)
    by_proto = ttile.onnx.load(onnx.load(str(path)), threads=1)
    assert by_path.source == str(path)
    # (each load makes its own timed kernel choices: equal up to the order of sums)
    assert _error(by_path(x.numpy()), by_proto(x.numpy())) < 1e-5


def _weights_computed_in_the_graph() -> bytes:
    """Conv weights made by a Constant node through an Identity, a bias shared by two
    convolutions, then operators ttile does not serve (Concat, Softmax) between and after
    them."""
    rng = np.random.default_rng(3)
    w = rng.uniform(-0.5, 0.5, (8, 4, 3, 3)).astype(np.float32)
    w2 = rng.uniform(-0.5, 0.5, (8, 16, 1, 1)).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, 8).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w_const"], value=numpy_helper.from_array(w)),
        helper.make_node("Identity", ["w_const"], ["w"]),
        helper.make_node("Conv", ["x", "w", "b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["x", "w", "b"], ["c2"], pads=[2, 2, 2, 2], dilations=[2, 2]),
        helper.make_node("Concat", ["r1", "c2"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w2", "b"], ["c3"]),
        helper.make_node("Clip", ["c3", "zero", "six"], ["c3r"]),
        helper.make_node("Softmax", ["c3r"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "computed", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [1, 4, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])],
        [numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(np.array(0, np.float32), "zero"),
         numpy_helper.from_array(np.array(6, np.float32), "six")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_weights_computed_in_the_graph_and_operators_left_to_onnxruntime():
    data = _weights_computed_in_the_graph()
    served = ttile.onnx.load(data, threads=1)
    declined = {d.op_type: d.reason for d in served.declined}
    assert set(declined) == {"Concat", "Softmax"}, declined
    assert "not a ttile operator" in declined["Concat"]
    assert served.segments == 2
    import ttile.torch as tt
    assert len(tt.served_layers(served.module)) == 3   # every Conv, the computed one too
    x = np.random.default_rng(4).uniform(-1, 1, (1, 4, 12, 12)).astype(np.float32)
    assert _error(served(x), _onnxruntime(data, x)[0]) < 1e-4
    assert "onnxruntime runs" in served.describe()


def test_a_symbolic_batch_needs_an_example_input():
    torch.manual_seed(2)
    model = _small_resnet()
    x = torch.randn(2, 3, 32, 32)
    data = _export(model, x, dynamic_batch=True)
    with pytest.raises(OnnxModelError, match="dynamic dimensions.*example_input"):
        ttile.onnx.load(data)
    served = ttile.onnx.load(data, x, threads=1)
    assert served.inputs[0].shape == (2, 3, 32, 32)
    assert _error(served(x.numpy()), _onnxruntime(data, x.numpy())[0]) < 1e-4
    with pytest.raises(ValueError, match=r"shape \(2, 3, 32, 32\)"):
        served(np.zeros((1, 3, 32, 32), np.float32))
    with pytest.raises(TypeError, match="float32"):
        served(np.zeros((2, 3, 32, 32), np.float64))
    with pytest.raises(OnnxModelError, match="example input 0 has shape"):
        ttile.onnx.load(data, torch.randn(2, 4, 32, 32))


def test_bad_files_get_one_clear_error(tmp_path):
    good = _weights_computed_in_the_graph()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(OnnxModelError, match="truncated.onnx: not an ONNX model"):
        ttile.onnx.load(truncated)
    with pytest.raises(OnnxModelError, match="no such file"):
        ttile.onnx.load(tmp_path / "missing.onnx")
    with pytest.raises(TypeError, match="file path, bytes or an onnx.ModelProto"):
        ttile.onnx.load(42)
    # an integer input
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "ints",
                              [helper.make_tensor_value_info("x", TensorProto.INT32, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 4])])
    ints = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(OnnxModelError, match="input 'x' is INT32"):
        ttile.onnx.load(ints)
    # an operator no one here can run
    graph = helper.make_graph([helper.make_node("Frobnicate", ["x"], ["y"], domain="acme")],
                              "custom",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    custom = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                     helper.make_opsetid("acme", 1)])
    with pytest.raises(OnnxModelError, match="onnxruntime cannot run this model"):
        ttile.onnx.load(custom)


def test_bf16_precision_is_passed_on():
    torch.manual_seed(5)
    model = _small_resnet()
    x = torch.randn(1, 3, 32, 32)
    data = _export(model, x)
    served = ttile.onnx.load(data, threads=1, precision="bf16")
    import ttile.torch as tt
    assert all(m.precision is ttile.Precision.BF16 for _, m in tt.served_layers(served.module))
    assert _error(served(x.numpy()), _onnxruntime(data, x.numpy())[0]) < 3e-2


def test_a_loaded_model_pickles():
    import pickle
    data = _weights_computed_in_the_graph()
    served = ttile.onnx.load(data, threads=1)
    copy = pickle.loads(pickle.dumps(served.module))
    x = np.random.default_rng(6).uniform(-1, 1, (1, 4, 12, 12)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(copy(torch.from_numpy(x)).numpy(), served(x), rtol=1e-6,
                                   atol=1e-6)


def test_the_main_job_on_a_users_onnx_file(tmp_path, capsys):
    """``ttile-generate run --onnx``: the layers' table, the check against onnxruntime,
    the whole model timed beside the engines installed here."""
    from ttile.cli import main
    torch.manual_seed(7)
    path = tmp_path / "small.onnx"
    path.write_bytes(_export(_small_resnet(), torch.randn(1, 3, 32, 32)))
    assert main(["run", "--onnx", str(path), "--threads", "1", "--reps", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "check against onnxruntime: ok" in out, out
    assert re.search(r"^\| ttile \| [\d.]+ \| 1\.00 \|$", out, re.M), out
    assert re.search(r"^\| onnxruntime \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
    assert "ttile_conv_0" in captured.err + out          # the table of what serves each layer
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert main(["run", "--onnx", str(bad)]) == 2
    assert "bad.onnx: not an ONNX model" in capsys.readouterr().err


class _TwoInTwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, groups=4, padding=1)   # grouped, not depthwise
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x, z):
        f = torch.relu(self.a(x))
        return f, torch.softmax(self.c(self.b(f) + z), 1)


def test_several_inputs_and_outputs():
    torch.manual_seed(8)
    x, z = torch.randn(1, 3, 16, 16), torch.randn(1, 8, 16, 16)
    buffer = io.BytesIO()
    torch.onnx.export(_TwoInTwoOut().eval(), (x, z), buffer, opset_version=17, dynamo=False,
                      input_names=["x", "z"])
    data = buffer.getvalue()
    served = ttile.onnx.load(data, threads=1)
    assert [i.name for i in served.inputs] == ["x", "z"]
    features, probabilities = served(x.numpy(), z.numpy())
    expected = _onnxruntime(data, x.numpy(), z.numpy())
    assert _error(features, expected[0]) < 1e-4 and _error(probabilities, expected[1]) < 1e-4
    with pytest.raises(TypeError, match="takes 2 input"):
        served(x.numpy())


@pytest.mark.parametrize("keepdims", [1, 0])
def test_the_dynamo_exporters_pooling_and_flatten_are_served(keepdims):
    """torch's dynamo exporter writes a global average pooling as ReduceMean over axes
    (-1, -2) (an input since opset 18) and the flatten after it as a Reshape to
    (batch, -1): both served, the whole model by ttile, as onnxruntime computes it. A
    reshape that is not such a flatten stays onnxruntime's."""
    rng = np.random.default_rng(12)
    w = rng.uniform(-0.5, 0.5, (32, 3, 3, 3)).astype(np.float32)
    fc = rng.uniform(-0.5, 0.5, (10, 32)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("ReduceMean", ["r", "axes"], ["m"], keepdims=keepdims)]
    if keepdims:
        nodes.append(helper.make_node("Reshape", ["m", "flat"], ["v"], allowzero=1))
    nodes.append(helper.make_node("Gemm", ["v" if keepdims else "m", "fc"], ["y"], transB=1))
    graph = helper.make_graph(
        nodes, "dynamo-like", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(fc, "fc"),
         numpy_helper.from_array(np.array([-1, -2], np.int64), "axes"),
         numpy_helper.from_array(np.array([1, 32], np.int64), "flat")])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]) \
        .SerializeToString()
    served = ttile.onnx.load(data, threads=1)
    assert served.segments == 0 and served.declined == (), served.declined
    x = rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)
    assert _error(served(x), _onnxruntime(data, x)[0]) < 1e-4
    # a reshape to something else runs on onnxruntime
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Reshape", ["c", "shape"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 256])],
        [numpy_helper.from_array(w, "w"),
         numpy_helper.from_array(np.array([1, 32, 256], np.int64), "shape")])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]) \
        .SerializeToString()
    served = ttile.onnx.load(data, threads=1)
    assert [d.op_type for d in served.declined] == ["Reshape"]
    assert _error(served(x), _onnxruntime(data, x)[0]) < 1e-4
