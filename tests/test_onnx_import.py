"""A user's network into the generator: the Conv layers of an ONNX file
(``ttile-generate --onnx`` / ``layers --onnx``).

Every attribute form (pads, strides, dilations, group, kernel_shape, each auto_pad) is
checked twice: the ConvSpec read from the file must give the output shape ONNX shape
inference gives, and ttile.conv2d run with that spec's padding must equal the ONNX
reference evaluator's output for the node.
"""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import ttile  # noqa: E402
from ttile.cli import main  # noqa: E402
from ttile.generator.onnx_import import OnnxImportError, read_onnx_layers  # noqa: E402

# (name, input C x H x W, weights K x C/g x R x S, Conv attributes)
CONVS = [
    ("plain", (3, 9, 11), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("asymmetric", (4, 10, 7), (8, 4, 3, 2), {"pads": [0, 1, 2, 0], "strides": [2, 1]}),
    ("same_upper_s2", (5, 10, 9), (6, 5, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("same_lower_s2", (5, 10, 9), (6, 5, 4, 4), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ("valid", (3, 8, 8), (4, 3, 3, 3), {"auto_pad": "VALID"}),
    ("dilated", (6, 12, 10), (8, 6, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2],
                                             "kernel_shape": [3, 3]}),
    ("grouped", (8, 7, 7), (12, 2, 3, 3), {"pads": [1, 1, 1, 1], "group": 4}),
    ("depthwise", (16, 9, 9), (16, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 16}),
]


def _conv_model(name, x_chw, w_shape, attrs, batch=1):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, (batch,) + x_chw)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    rng = np.random.default_rng(len(name))
    weights = rng.uniform(-1, 1, w_shape).astype(np.float32)
    init = helper.make_tensor("w", TensorProto.FLOAT, w_shape, weights.ravel())
    node = helper.make_node("Conv", ["x", "w"], ["y"], name=name, **attrs)
    graph = helper.make_graph([node], name, [x], [y], [init])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


@pytest.mark.parametrize("name,x_chw,w_shape,attrs", CONVS, ids=[c[0] for c in CONVS])
def test_each_attribute_form_reads_as_onnx_computes_it(tmp_path, name, x_chw, w_shape, attrs):
    model, weights = _conv_model(name, x_chw, w_shape, attrs)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    [layer] = read_onnx_layers(path).layers
    spec = layer.spec()
    assert layer.name == f"{name}/{name}"
    assert layer.groups == attrs.get("group", 1) and layer.depthwise == (name == "depthwise")

    x = np.random.default_rng(1).uniform(-1, 1, (1,) + x_chw).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert expected.shape == (1, layer.k, spec.ho, spec.wo)
    got = ttile.conv2d(x, weights, stride=(spec.stride_h, spec.stride_w),
                       padding=((spec.pad_top, spec.pad_bottom),
                                (spec.pad_left, spec.pad_right)),
                       dilation=(spec.dilation_h, spec.dilation_w), groups=layer.groups)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _chain(tmp_path, batch_dim="N"):
    """A small network: two identical 3x3 convs (one layer, two nodes), a 1x1, a
    ConvTranspose and a 1-D Conv (both skipped), with a symbolic batch."""
    f = TensorProto.FLOAT
    inits = [helper.make_tensor(n, f, s, np.zeros(int(np.prod(s)), np.float32))
             for n, s in (("w1", (8, 8, 3, 3)), ("w2", (8, 8, 3, 3)), ("w3", (16, 8, 1, 1)),
                          ("wt", (16, 4, 2, 2)), ("w1d", (4, 4, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="/block/conv1", pads=[1] * 4),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], name="/block/conv2", pads=[1] * 4),
             helper.make_node("Conv", ["c", "w3"], ["d"], name="head*/", strides=[2, 2]),
             helper.make_node("ConvTranspose", ["d", "wt"], ["e"], name="up", strides=[2, 2]),
             helper.make_node("Conv", ["seq", "w1d"], ["z"], name="conv1d", pads=[1, 1])]
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", f, (batch_dim, 8, 14, 14)),
         helper.make_tensor_value_info("seq", f, (1, 4, 20))],
        [helper.make_tensor_value_info("e", f, None), helper.make_tensor_value_info("z", f, None)],
        inits)
    path = tmp_path / "chain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_repeated_problems_are_one_layer_and_skipped_nodes_are_named(tmp_path, capsys):
    found = read_onnx_layers(_chain(tmp_path))
    assert [l.name for l in found.layers] == ["chain/block/conv1", "chain/head"]
    assert found.nodes == (("chain/block/conv1", "chain/block/conv2"), ("chain/head",))
    assert found.batch_from_symbol
    assert found.layers[1].spec().ho == 7 and found.layers[1].spec().n == 1
    assert {(s.node, s.op_type) for s in found.skipped} == {("chain/up", "ConvTranspose"),
                                                            ("chain/conv1d", "Conv")}
    assert main(["layers", "--onnx", str(tmp_path / "chain.onnx")]) == 0
    out = capsys.readouterr().out
    assert "2 distinct convolution layers (a symbolic batch size is read as 1)" in out
    assert "| chain/block/conv1 | 1 | 8 | 8 | 14 x 14 | 3 x 3 | 1,1 | 1,1,1,1 | 1,1 | 1 |" \
        in out and out.count("| searched |") == 2
    assert "skipped: chain/conv1d (Conv): 1-D convolution" in out


def test_a_fixed_batch_is_kept(tmp_path):
    found = read_onnx_layers(_chain(tmp_path, batch_dim=4))
    assert not found.batch_from_symbol
    assert {l.spec().n for l in found.layers} == {4}


def test_bad_files_get_errors_naming_the_problem(tmp_path, capsys):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01 not a protobuf \xff" * 10)
    with pytest.raises(OnnxImportError, match="not an ONNX model"):
        read_onnx_layers(garbage)
    with pytest.raises(OnnxImportError, match="no such file"):
        read_onnx_layers(tmp_path / "missing.onnx")

    # channels that do not match the weights
    model, _ = _conv_model("bad", (5, 8, 8), (4, 3, 3, 3), {})
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(OnnxImportError, match=r"'bad/bad': group=1 does not fit input "
                                              r"channels 5, weights \(4, 3, 3, 3\)"):
        read_onnx_layers(tmp_path / "bad.onnx")

    # shapes that cannot be broadcast: strict shape inference refuses the graph
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x2"], ["s"]),
         helper.make_node("Conv", ["s", "w"], ["y"], name="c")], "broken",
        [helper.make_tensor_value_info("x", f, (1, 3, 4, 4)),
         helper.make_tensor_value_info("x2", f, (1, 5, 4, 4))],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("w", f, (4, 3, 3, 3), np.zeros(108, np.float32))])
    onnx.save(helper.make_model(graph), tmp_path / "broken.onnx")
    with pytest.raises(OnnxImportError, match="shape inference failed"):
        read_onnx_layers(tmp_path / "broken.onnx")

    # a symbolic spatial size cannot be tuned
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "dyn",
        [helper.make_tensor_value_info("x", f, (1, 3, "H", "W"))],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("w", f, (4, 3, 3, 3), np.zeros(108, np.float32))])
    onnx.save(helper.make_model(graph), tmp_path / "dyn.onnx")
    with pytest.raises(OnnxImportError, match=r"Conv node 'dyn/c'.*\(1, 3, \?, \?\).*static"):
        read_onnx_layers(tmp_path / "dyn.onnx")

    # a custom operator's output has no inferred shape
    graph = helper.make_graph(
        [helper.make_node("MyOp", ["x"], ["a"], domain="custom.x"),
         helper.make_node("Conv", ["a", "w"], ["y"], name="c")], "custom",
        [helper.make_tensor_value_info("x", f, (1, 3, 8, 8))],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("w", f, (4, 3, 3, 3), np.zeros(108, np.float32))])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("custom.x", 1)]),
              tmp_path / "custom.onnx")
    with pytest.raises(OnnxImportError, match="MyOp node of domain 'custom.x'"):
        read_onnx_layers(tmp_path / "custom.onnx")

    # no convolution at all
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", f, (1, 3, 4, 4))],
                              [helper.make_tensor_value_info("y", f, None)])
    onnx.save(helper.make_model(graph), tmp_path / "relu.onnx")
    with pytest.raises(OnnxImportError, match="no 2-D float32 Conv node"):
        read_onnx_layers(tmp_path / "relu.onnx")

    # the command line says it in one line and exits with 2
    assert main(["layers", "--onnx", str(garbage)]) == 2
    assert "not an ONNX model" in capsys.readouterr().err
    assert main(["--onnx", str(tmp_path / "relu.onnx")]) == 2
    assert "no 2-D float32 Conv node" in capsys.readouterr().err


def test_asymmetric_padding_argument(tmp_path):
    """conv2d's ((top, bottom), (left, right)) padding equals padding the input first."""
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (1, 4, 9, 8)).astype(np.float32)
    w = rng.uniform(-1, 1, (6, 4, 3, 3)).astype(np.float32)
    padded = np.pad(x, ((0, 0), (0, 0), (2, 0), (1, 3)))
    np.testing.assert_allclose(ttile.conv2d(x, w, padding=((2, 0), (1, 3)), stride=2),
                               ttile.conv2d(padded, w, stride=2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="padding must be >= 0"):
        ttile.conv2d(x, w, padding=((2, -1), (1, 3)))


def _graph_file(tmp_path, name, nodes, inputs, inits=(), outputs=None):
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, name, inputs,
                              outputs or [helper.make_tensor_value_info("y", f, None)],
                              list(inits))
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


def _claimed_tensor(name, dims):
    """An initializer that claims ``dims`` and holds no data (as a forged file would)."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT)
    tensor.dims.extend(dims)
    tensor.raw_data = b""
    return tensor


def _hostile_files(tmp_path):
    """(file, fragment of the one error it must get) for each kind of hostile file."""
    f, conv = TensorProto.FLOAT, lambda *io: helper.make_node("Conv", *io, name="c")
    w = helper.make_tensor("w", f, (4, 3, 3, 3), np.zeros(108, np.float32))
    x = helper.make_tensor_value_info("x", f, (1, 3, 8, 8))
    model, _ = _conv_model("whole", (3, 8, 8), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]})
    payload = model.SerializeToString()
    out = []
    for cut in (1, 7, len(payload) // 2, len(payload) - 3):
        path = tmp_path / f"truncated{cut}.onnx"
        path.write_bytes(payload[:cut])
        out.append((path, "not an ONNX model|no graph nodes|shape inference|Conv node"))
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    out.append((empty, "not an ONNX model|no graph nodes"))
    out.append((_graph_file(tmp_path, "int_weights", [conv(["x", "w"], ["y"])], [x], [
        helper.make_tensor("w", TensorProto.INT64, (4, 3, 3, 3), np.zeros(108, np.int64))]),
        "weights 'w' are INT64, the input FLOAT"))
    out.append((_graph_file(tmp_path, "double_input", [conv(["x", "w"], ["y"])], [
        helper.make_tensor_value_info("x", TensorProto.DOUBLE, (1, 3, 8, 8))], [w]),
        "shape inference failed|no 2-D float32 Conv node"))
    for dims, what in (((1, 3, 2**40, 2**40), "too large"), ((1, 3, -5, 8), "has a size below 1"),
                       ((2**40, 3, 8, 8), "too large")):
        out.append((_graph_file(tmp_path, f"dims{len(out)}", [conv(["x", "w"], ["y"])],
                                [helper.make_tensor_value_info("x", f, dims)], [w]), what))
    out.append((_graph_file(tmp_path, "huge_weights", [conv(["x", "w"], ["y"])], [
        helper.make_tensor_value_info("x", f, (1, 2**20, 8, 8))], [
        _claimed_tensor("w", (2**20, 2**20, 3, 3))]),
        "shape inference failed|too large|not an ONNX model"))
    out.append((_graph_file(tmp_path, "cycle", [
        helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
        conv(["b", "w"], ["y"])], [x], [w]), "shape inference failed|cycle"))
    out.append((_graph_file(tmp_path, "no_initializer", [conv(["x", "w"], ["y"])], [x]),
                "shape inference failed|no shape for 'w'"))
    out.append((_graph_file(tmp_path, "one_input", [helper.make_node("Conv", ["x"], ["y"],
                                                                     name="c")], [x], [w]),
                "shape inference failed|needs an input X and weights W"))
    return out


def test_hostile_files_get_one_clear_error_each(tmp_path):
    import re
    import signal

    def hang(signum, frame):
        raise TimeoutError("read_onnx_layers hung")

    previous = signal.signal(signal.SIGALRM, hang)
    try:
        for path, fragment in _hostile_files(tmp_path):
            signal.alarm(20)
            try:
                with pytest.raises(OnnxImportError) as raised:
                    read_onnx_layers(path)
            finally:
                signal.alarm(0)
            message = str(raised.value)
            assert re.search(fragment, message), (path.name, message)
            assert message.startswith(str(path)) and "\n" not in message.strip(), message
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_flipped_bytes_give_a_result_or_an_import_error(tmp_path):
    """200 copies of a valid file with 1-4 random bytes changed: each reads as layers or
    gets an OnnxImportError - never another exception (a crash of the reader)."""
    model, _ = _conv_model("flip", (3, 8, 8), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]})
    payload = bytearray(model.SerializeToString())
    rng = np.random.default_rng(0)
    outcomes = {"layers": 0, "error": 0}
    for i in range(200):
        damaged = bytearray(payload)
        for at in rng.integers(0, len(damaged), int(rng.integers(1, 5))):
            damaged[at] = int(rng.integers(0, 256))
        path = tmp_path / f"flip{i}.onnx"
        path.write_bytes(bytes(damaged))
        try:
            read_onnx_layers(path)
            outcomes["layers"] += 1
        except OnnxImportError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and sum(outcomes.values()) == 200, outcomes
