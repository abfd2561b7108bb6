"""ttile.torch.convert: a PyTorch model's convolutions served by ttile, checked against the
model itself in float32 (and float64 where the fold is the question)."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ttile  # noqa: E402
import ttile.torch as tt  # noqa: E402


def randomize_batch_norms(model):
    gen = torch.Generator().manual_seed(5)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            n = module.num_features
            module.running_mean.copy_(torch.rand(n, generator=gen) * 2 - 1)
            module.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            module.weight.data.copy_(torch.rand(n, generator=gen) + 0.5)
            module.bias.data.copy_(torch.rand(n, generator=gen) * 2 - 1)
    return model


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise (stride 1 or 2), 1x1 project, each
    with a batch norm (ReLU6 after the first two), + the input where the shapes allow."""

    def __init__(self, c, e, k, stride):
        super().__init__()
        self.residual = stride == 1 and c == k
        self.body = nn.Sequential(
            nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
            nn.Conv2d(e, e, 3, stride, 1, groups=e, bias=False), nn.BatchNorm2d(e),
            nn.ReLU6(), nn.Conv2d(e, k, 1, bias=False), nn.BatchNorm2d(k))

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class Basic(nn.Module):
    """ResNet's basic block: conv-bn-relu, conv-bn, + identity (or a strided 1x1), relu."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def small_net():
    return randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU(),
        Basic(16, 16), Basic(16, 24, 2),
        nn.Conv2d(24, 24, 3, 1, 2, dilation=2, groups=24), nn.ReLU6(),   # depthwise, dilated
        nn.Conv2d(24, 12, 1), nn.LeakyReLU(0.1),
        nn.Conv2d(12, 10, 3, padding="same"), nn.SiLU(),
        nn.Conv2d(10, 7, 1), nn.Sigmoid())).eval()


def rel_error(got, expected):
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("channels_last", [False, True])
def test_converted_model_matches_torch_and_fuses_what_follows_each_conv(channels_last):
    model = small_net()
    converted = tt.convert(model)
    layers = tt.served_layers(converted)
    # 10 convolutions; every one served, the batch norms, adds and activations folded in
    assert len(layers) == 10
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.ReLU, nn.SiLU, nn.Sigmoid, nn.ReLU6,
                                  nn.LeakyReLU, nn.Conv2d)) for m in converted.modules())
    sources = {m.source for _, m in layers}
    assert "0+1+relu" in sources
    assert any(s.endswith("+add+relu") for s in sources)
    assert {m.activation for _, m in layers} >= {"relu", "relu6", "leaky_relu", "silu",
                                                 "sigmoid"}
    x = torch.randn(2, 3, 17, 19)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = model.double()(x.double())
        got = converted(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert rel_error(got.double(), expected) < 1e-5
    # the memory format flows through: a channels_last input stays channels_last
    assert got.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_the_original_model_is_left_alone_unless_inplace():
    model = small_net()
    tt.convert(model)
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 10


def test_a_model_that_does_not_trace_gets_its_convs_swapped():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 8, 3, padding=1)
            self.b = nn.Conv2d(8, 8, 1)

        def forward(self, x):
            y = self.a(x)
            if y.sum() > 0:   # data-dependent: fx cannot trace this
                y = torch.relu(y)
            return self.b(y)

    model = Branchy().eval()
    converted = tt.convert(model)
    assert isinstance(converted.a, tt.TTileConv2d) and isinstance(converted.b, tt.TTileConv2d)
    x = torch.randn(1, 4, 9, 9)
    with torch.no_grad():
        assert rel_error(converted(x), model(x)) < 1e-5


def test_layers_ttile_cannot_serve_stay_torchs():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
                          nn.Conv2d(4, 4, 3).double(), nn.Conv2d(4, 5, 2, padding="same")).eval()
    converted = tt.convert(model)
    assert tt.served_layers(converted) == []


def test_training_mode_and_inputs_that_require_grad_are_refused():
    model = small_net()
    with pytest.raises(RuntimeError, match="model.eval"):
        tt.convert(model.train())
    converted = tt.convert(model.eval())
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no gradients"):
        converted(x)
    converted.train()
    with pytest.raises(RuntimeError, match="training mode"):
        with torch.no_grad():
            converted(x)


def test_weights_changed_in_place_are_packed_again():
    model = nn.Sequential(nn.Conv2d(4, 6, 3)).eval()
    converted = tt.convert(model, trace=False)
    x = torch.randn(1, 4, 7, 7)
    with torch.no_grad():
        converted(x)
        layer = converted[0]
        layer.weight.mul_(2)   # e.g. load_state_dict copying new weights in
        expected = torch.nn.functional.conv2d(x, layer.weight, layer.bias)
        assert rel_error(converted(x), expected) < 1e-5


def test_a_model_converted_and_run_under_inference_mode_serves_and_follows_changes():
    """Under torch.inference_mode, convert's folded weights are inference tensors, which
    torch counts no in-place changes of: the module keeps normal copies, whose changes
    (made in inference mode too) it sees. A weight later replaced by an inference tensor
    is packed again on every call, never served stale."""
    model = small_net()
    x = torch.randn(1, 3, 9, 9)
    with torch.inference_mode():
        converted = tt.convert(model)
        assert rel_error(converted(x), model(x)) < 1e-4
        layers = [m for m in converted.modules() if isinstance(m, tt.TTileConv2d)]
        assert layers and not any(p.is_inference() for m in layers for p in m.parameters())
        layer = layers[-1]
        layer.weight.mul_(2)
        expected = torch.sigmoid(torch.nn.functional.conv2d(
            _input_of(converted, layer, x),
            layer.weight, layer.bias))
        assert rel_error(converted(x), expected) < 1e-5
        layer.weight = nn.Parameter(layer.weight.detach() * 3, requires_grad=False)
        assert layer.weight.is_inference()
        expected = torch.sigmoid(torch.nn.functional.conv2d(
            _input_of(converted, layer, x), layer.weight, layer.bias))
        assert rel_error(converted(x), expected) < 1e-5
        layer.weight.mul_(0.5)   # no version count to see it by: packed again anyway
        expected = torch.sigmoid(torch.nn.functional.conv2d(
            _input_of(converted, layer, x), layer.weight, layer.bias))
        assert rel_error(converted(x), expected) < 1e-5


def _input_of(model, layer, x):
    """What ``layer`` receives when ``model`` runs on x (a forward pre-hook's catch)."""
    seen = []
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        model(x)
    finally:
        handle.remove()
    return seen[0]


def test_custom_op_has_a_fake_kernel_so_export_sees_through_it():
    converted = tt.convert(small_net())
    x = torch.randn(1, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    first = tt.served_layers(converted)[0][1]
    torch.library.opcheck(torch.ops.ttile.conv2d.default,
                          (x, first.weight, first.bias, None,
                           first.layer_id, [1, 1], [1, 1], [1, 1], 1, "relu",
                           0.01, 1),
                          test_utils=("test_schema", "test_faketensor"))
    exported = torch.export.export(converted, (x,))
    assert any("ttile.conv2d" in str(node.target) for node in exported.graph.nodes)
    with torch.no_grad():
        assert rel_error(exported.module()(x), converted(x)) < 1e-6


def test_torch_compile_of_a_converted_model_traces_the_custom_op():
    """``torch.compile`` of a converted model captures ttile's layers as the custom op
    (dynamo and AOTAutograd run it on fake tensors through its fake kernel) and computes
    what the eager model does; the benchmark times it with inductor
    (bench_network.py --compile)."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    converted = tt.convert(small_net())
    x = torch.randn(1, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(converted, backend=aot_autograd(fw_compiler=capture),
                             fullgraph=True)
    with torch.no_grad():
        got, expected = compiled(x), converted(x)
    assert graphs and rel_error(got, expected) < 1e-6
    assert any("ttile.conv2d" in str(node.target) for gm in graphs for node in gm.graph.nodes)


def test_eager_calls_skip_the_custom_op_and_export_still_meets_it(monkeypatch):
    """Eager calls on plain tensors run the packed layers directly (the op's dispatch cost
    more than a small layer's kernel); export must still see the op, whose implementation
    is the same packed layer."""
    converted = tt.convert(small_net())
    x = torch.randn(1, 3, 12, 12)
    # a hook on a layer keeps its sequence calling the layers as modules, one by one
    for _, layer in tt.served_layers(converted):
        layer.register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad():
        expected = converted(x)
    calls = []
    real = tt._PackedLayer.run
    monkeypatch.setattr(tt._PackedLayer, "run",
                        lambda self, *a: calls.append(1) or real(self, *a))

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call on plain tensors went through the custom op")

    monkeypatch.setattr(tt.modules, "conv2d_op", refuse)   # what TTileConv2d calls
    with torch.no_grad():
        assert torch.equal(converted(x), expected)
    assert len(calls) == len(tt.served_layers(converted))
    monkeypatch.undo()
    exported = torch.export.export(converted, (x,))
    assert any("ttile.conv2d" in str(node.target) for node in exported.graph.nodes)


def test_example_input_tunes_every_layer_up_front_and_prints_what_serves_it(capsys):
    model = small_net()
    x = torch.randn(1, 3, 10, 10)
    previous = ttile.set_tuning("never")   # the table, not the tuner, is the question here
    try:
        converted = tt.convert(model, example_input=x)
    finally:
        ttile.restore_tuning(previous)
    err = capsys.readouterr().err
    assert err.count("| ttile_") == 10
    assert "bias+residual+relu" in err
    # both vector families have a depthwise kernel; the portable family runs the generic
    # kernel (groups as tasks), and the table says which
    assert ("| depthwise |" in err) == (ttile.get_isa() is not ttile.Isa.PORTABLE)
    with torch.no_grad():
        assert rel_error(converted(x), model(x)) < 1e-5


def test_import_ttile_does_not_import_torch():
    code = "import sys, ttile; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


class TwoInputs(nn.Module):
    """A run of convolutions fed from two places, with an intermediate read outside it."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 1)
        self.c3 = nn.Conv2d(8, 16, 3, padding=1)
        self.c4 = nn.Conv2d(16, 8, 1)
        self.c5 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        a = self.c1(x)
        b = torch.sigmoid(x)                 # not a ttile layer: the run stops here
        c = torch.relu(self.c2(b) + a)       # a unit with two inputs from outside
        d = self.c3(c)
        e = self.c4(d)                       # read again below: its run ends with it
        return self.c5(e) * e.mean()


@pytest.mark.parametrize("model", ["small_net", "two_inputs"])
def test_consecutive_layers_run_as_one_sequence_and_match_torch(model):
    net = small_net() if model == "small_net" else TwoInputs().eval()
    channels = 3 if model == "small_net" else 8
    converted = tt.convert(net)
    sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
    assert sequences and all(len(s.steps) >= 2 for s in sequences)
    if model == "two_inputs":
        # c2, then c1 with c2's output as its residual (the add fuses into the first
        # conv the graph meets), c3, c4: fed by sigmoid(x) and x; c5 runs alone
        assert [(len(s.steps), s.inputs) for s in sequences] == [(4, 2)]
    x = torch.randn(2, channels, 11, 10, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = net(x)
        for memory_format in (torch.channels_last, torch.contiguous_format):
            got = converted(x.contiguous(memory_format=memory_format))
            assert rel_error(got, expected) < 1e-5, memory_format


def test_a_sequence_runs_every_layer_on_its_whole_team():
    """A layer too small for the threads asked runs on fewer when called by itself, but
    in a sequence on all of them: one OpenMP team from layer to layer, not one that
    shrinks and grows again (and the sums are the same either way)."""
    if len(ttile.runtime.arguments.process_cpus()) < 2:
        pytest.skip("needs two CPUs")
    net = small_net()
    converted = tt.convert(net)
    x = torch.randn(1, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            got = converted(x)
            got_again = converted(x)
            expected = net(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, got_again) and rel_error(got, expected) < 1e-5
    in_sequence = [module for name, module in tt.served_layers(converted)
                   if any(isinstance(m, tt.TTileSequence) and module in m.modules()
                          for m in converted.modules())]
    assert in_sequence
    for module in in_sequence:
        layer = module._packed.layer("NHWC")
        teams = {key: bound.nthreads for key, bound in layer._bound.items() if key[3]}
        assert teams and set(teams.values()) == {2}, teams
        # called by itself, the same layer fits its threads to its work: one here
        shape = next(iter(teams))[0]
        alone = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        layer(alone, 2)
        fitted = {key: bound.nthreads for key, bound in layer._bound.items()
                  if key[0] == shape and not key[3]}
        assert fitted == {(shape, 2, True, False): 1}


def assert_matches_at_1_and_2_threads(net, converted, x, same_shape=False):
    """The converted model gives the model's output at 1 and 2 threads, on x in both
    memory formats (``same_shape``: also its shape, contiguous)."""
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.no_grad():
                expected = net(x)
                for memory_format in (torch.channels_last, torch.contiguous_format):
                    got = converted(x.contiguous(memory_format=memory_format))
                    if same_shape:
                        assert got.shape == expected.shape and got.is_contiguous()
                    assert rel_error(got, expected) < 1e-5, (count, memory_format)
    finally:
        torch.set_num_threads(threads)


class Pooled(nn.Module):
    """Convolutions around a max pooling and a global average pooling, as in a ResNet,
    and two poolings ttile leaves to torch (ceil mode, dilation)."""

    def __init__(self, served: bool = True):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 2, 1)
        self.pool = (nn.MaxPool2d(3, 2, 1) if served
                     else nn.MaxPool2d(3, 2, 1, ceil_mode=True))
        self.c1 = nn.Conv2d(16, 24, 3, padding=1)
        self.c2 = nn.Conv2d(24, 32, 1)
        self.other = nn.MaxPool2d(2, dilation=2 if not served else 1)
        self.c3 = nn.Conv2d(32, 32, 1)
        self.gap = nn.AdaptiveAvgPool2d(1 if served else 2)
        self.fc = nn.Linear(32 if served else 128, 10)

    def forward(self, x):
        x = self.c2(torch.relu(self.c1(self.pool(torch.relu(self.stem(x))))))
        return self.fc(torch.flatten(self.gap(self.c3(self.other(x))), 1))


@pytest.mark.parametrize("served", [True, False])
def test_a_sequence_runs_through_the_poolings_it_serves(served):
    net = Pooled(served).eval()
    converted = tt.convert(net)
    pools = [m for m in converted.modules() if isinstance(m, tt.TTilePool2d)]
    sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
    if served:   # stem, max pooling, c1, c2, max pooling, c3, average, fc: one sequence
        assert sorted(p.kind.value for p in pools) == ["global average", "max", "max"]
        assert [len(s.steps) for s in sequences] == [8]
    else:        # ceil mode, dilation and a 2x2 output stay torch's and cut the run
        assert pools == [] and [len(s.steps) for s in sequences] == [2]
    x = torch.randn(2, 3, 29, 27, generator=torch.Generator().manual_seed(5))
    assert_matches_at_1_and_2_threads(net, converted, x)


class Head(nn.Module):
    """A convolution and a classifier head in one of the forms networks write it."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.conv = nn.Conv2d(5, 24, 3, padding=1)
        self.gap = nn.AdaptiveAvgPool2d((1, 1) if form != "map" else 2)
        self.flatten = nn.Flatten()
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(24 if form != "map" else 96, 13, bias=form != "no bias")
        self.other = nn.Linear(24, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        if self.form == "functional":    # torchvision's MobileNetV2
            return self.fc(self.drop(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))
        if self.form == "method":
            return self.fc(self.gap(x).flatten(1))
        if self.form == "read twice":    # the flattened features go elsewhere too
            f = self.flatten(self.gap(x))
            return self.fc(f) + self.other(f).sum()
        return self.fc(self.drop(self.flatten(self.gap(x))))


@pytest.mark.parametrize("form", ["module", "no bias", "functional", "method", "map",
                                  "read twice"])
def test_a_classifier_after_global_pooling_is_a_1x1_layer_of_the_sequence(form):
    """After a global average pooling the map is N x C x 1 x 1, and the linear layer
    on its flattening is a 1x1 convolution: it joins the sequence (weights the linear
    layer's own), and the model still returns torch's (N, K). A 2x2 pooling or a
    flattening read by something else leaves the linear layer to torch."""
    net = Head(form).eval()
    converted = tt.convert(net)
    served = {name: m for name, m in tt.served_layers(converted)}
    fcs = [m for m in served.values() if m.source.startswith("flatten+")]
    sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
    if form in ("map", "read twice"):
        assert fcs == [] and any(isinstance(m, nn.Linear) for m in converted.modules())
    else:
        assert len(fcs) == 1 and fcs[0].weight.shape == (13, 24, 1, 1)
        assert (fcs[0].bias is None) == (form == "no bias")
        shared = tt.served_layers(tt.convert(net, inplace=True))   # no copy of the weights
        assert net.fc.weight.data_ptr() in {m.weight.data_ptr() for _, m in shared}
        assert [len(s.steps) for s in sequences] == [3]   # conv, pooling, fc
        assert not any(isinstance(m, (nn.Linear, nn.Dropout)) for m in converted.modules())
    x = torch.randn(2, 5, 9, 7, generator=torch.Generator().manual_seed(7))
    assert_matches_at_1_and_2_threads(net, converted, x, same_shape=True)


def test_a_sequence_with_hooked_layers_calls_them_one_by_one():
    """Hooks on a layer inside a sequence see its calls (the fast path steps aside), and
    the result is the same either way."""
    net = small_net()
    converted = tt.convert(net)
    x = torch.randn(1, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    layers = tt.served_layers(converted)
    seen = []
    with torch.no_grad():
        fast = converted(x)
        handle = layers[2][1].register_forward_hook(lambda m, a, out: seen.append(out.shape))
        try:
            hooked = converted(x)
        finally:
            handle.remove()
        assert len(seen) == 1
        assert torch.equal(fast, hooked)
        assert rel_error(fast, net(x)) < 1e-5


def test_sequences_can_be_turned_off():
    converted = tt.convert(small_net(), sequences=False)
    assert not any(isinstance(m, tt.TTileSequence) for m in converted.modules())


def test_a_global_module_hook_sees_the_layers_of_a_sequence():
    converted = tt.convert(small_net())
    x = torch.randn(1, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: seen.append(type(m).__name__))
    try:
        with torch.no_grad():
            converted(x)
    finally:
        handle.remove()
    assert seen.count("TTileConv2d") == len(tt.served_layers(converted))
