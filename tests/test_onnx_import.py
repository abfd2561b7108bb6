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
