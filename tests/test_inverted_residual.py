"""The fused inverted residual block (1x1 expand -> 3x3 depthwise -> 1x1 project, + the
block's input): the kernel against the float64 reference, its refusals, and
ttile.torch.convert finding the pattern and serving it either way."""
import numpy as np
import pytest

import ttile
from ttile import _kernels
from ttile.runtime.inverted_residual import (BlockShape, BlockVerdict, InvertedResidual,
                                             modelled_verdict, reference)

needs_avx512 = pytest.mark.skipif(not ttile.has_avx512f(), reason="the fused kernel is AVX-512")


def block_weights(rng, c, e, k, biases=True):
    return (rng.standard_normal((e, c, 1, 1)).astype(np.float32) / np.sqrt(c),
            rng.standard_normal(e).astype(np.float32) if biases else None,
            rng.standard_normal((e, 1, 3, 3)).astype(np.float32) / 3,
            rng.standard_normal(e).astype(np.float32) if biases else None,
            rng.standard_normal((k, e, 1, 1)).astype(np.float32) / np.sqrt(e),
            rng.standard_normal(k).astype(np.float32) if biases else None)


# (n, h, w, c, e, k, stride, residual, activations): MobileNetV2's shapes and odd ones
# (channel counts off the vector width, widths off the 8-pixel block, batch 2, maps of
# one row or column, every activation in some stage)
CASES = [
    (1, 28, 28, 16, 96, 24, 2, False, ("relu6", "relu6", "none")),
    (1, 14, 14, 32, 192, 32, 1, True, ("relu6", "relu6", "none")),
    (2, 10, 9, 20, 40, 20, 1, True, ("relu", "leaky_relu", "none")),
    (1, 9, 11, 24, 72, 40, 2, False, ("silu", "silu", "relu")),
    (1, 7, 7, 160, 960, 320, 1, False, ("relu6", "relu6", "none")),
    (2, 1, 5, 8, 24, 8, 1, True, ("sigmoid", "relu6", "leaky_relu")),
    (1, 6, 1, 3, 17, 5, 2, False, ("relu6", "none", "sigmoid")),
]


# (n, h, w, c, k, stride, residual, activations) of blocks without an expand stage:
# MobileNetV2's first block, MobileNetV1's pairs (a project activation: no channel
# slices), channels off the vector width, a residual, maps of one row
NO_EXPAND_CASES = [
    (1, 28, 28, 32, 16, 1, False, ("none", "relu6", "none")),
    (1, 14, 13, 64, 128, 2, False, ("none", "relu", "relu")),
    (2, 5, 7, 20, 20, 1, True, ("none", "relu6", "none")),
    (1, 7, 7, 40, 24, 1, False, ("none", "silu", "none")),
    (1, 1, 9, 17, 33, 2, False, ("none", "none", "leaky_relu")),
]


@needs_avx512
@pytest.mark.parametrize("case", NO_EXPAND_CASES, ids=lambda c: "x".join(map(str, c[:6])))
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_block_without_expand_matches_the_float64_reference(case, threads):
    """The depthwise stage reads the block's input (its rows copied into the ring, only
    a thread's channels where threads split them)."""
    n, h, w, c, k, stride, residual, activations = case
    rng = np.random.default_rng(n * h * w + c + k)
    _, _, dw, dwb, pw, pwb = block_weights(rng, c, c, k, biases=(c % 2 == 0))
    weights = (None, None, dw, dwb, pw, pwb)
    block = InvertedResidual(*weights, stride=stride, activations=activations,
                             slopes=(0.1, 0.2, 0.05), residual=residual)
    assert not block.expands and block.shape_of((n, h, w, c)).weight_bytes == 4 * (
        (c + 15) // 16 * 16) * ((k + 15) // 16 * 16)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    expected = reference(x, *weights, stride=stride, activations=activations,
                         slopes=(0.1, 0.2, 0.05), residual=residual)
    y = block(x, threads)
    error = np.abs(y - expected).max() / max(np.abs(expected).max(), 1e-6)
    assert y.shape == expected.shape and error < 2e-5, error


def test_a_block_without_expand_refuses_an_expand_bias_or_activation():
    rng = np.random.default_rng(0)
    _, _, dw, dwb, pw, pwb = block_weights(rng, 8, 8, 8)
    with pytest.raises(ValueError, match="no expand bias or activation"):
        InvertedResidual(None, np.ones(8, np.float32), dw, dwb, pw, pwb, stride=1,
                         activations=("none", "relu", "none"))
    with pytest.raises(ValueError, match="no expand bias or activation"):
        InvertedResidual(None, None, dw, dwb, pw, pwb, stride=1,
                         activations=("relu", "relu", "none"))
    if ttile.has_avx512f():
        x = np.zeros((1, 4, 4, 8), np.float32)
        with pytest.raises(ValueError, match="must equal C"):
            _kernels.inverted_residual(x, None, None, np.zeros((9, 16), np.float32),
                                       np.zeros(16, np.float32), np.zeros((16, 16), np.float32),
                                       np.zeros(16, np.float32), np.zeros((1, 4, 4, 8),
                                                                          np.float32),
                                       _kernels.empty_aligned((1 << 16,)), 16, 1, (0, 0, 0),
                                       (0.0, 0.0, 0.0), False, 1)


@needs_avx512
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])))
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_fused_block_matches_the_float64_reference(case, threads):
    """At 2 threads and more the small maps split the expanded channels between threads
    (partial project sums added after a barrier), the larger ones their rows."""
    n, h, w, c, e, k, stride, residual, activations = case
    rng = np.random.default_rng(n * h * w + c + e + k)
    weights = block_weights(rng, c, e, k, biases=(c % 2 == 0))
    slopes = (0.1, 0.2, 0.05)
    block = InvertedResidual(*weights, stride=stride, activations=activations,
                             slopes=slopes, residual=residual)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    y = block(x, threads)
    expected = reference(x, *weights, stride=stride, activations=activations,
                         slopes=slopes, residual=residual)
    assert y.shape == expected.shape == (n, (h - 1) // stride + 1, (w - 1) // stride + 1, k)
    assert y.dtype == np.float32
    error = np.abs(y - expected).max() / max(np.abs(expected).max(), 1e-6)
    assert error < 2e-5, error


@needs_avx512
def test_a_wrong_weight_in_any_stage_shows_in_the_output():
    """The comparison above can fail: one changed weight per stage moves the result."""
    rng = np.random.default_rng(3)
    weights = list(block_weights(rng, 16, 48, 16))
    x = rng.standard_normal((1, 8, 8, 16)).astype(np.float32)
    args = dict(stride=1, activations=("relu6", "relu6", "none"), residual=True)
    expected = reference(x, *weights, **args)
    for index in (0, 2, 4):
        changed = [a.copy() if a is not None else None for a in weights]
        changed[index].reshape(-1)[7] += 1.0
        y = InvertedResidual(*changed, **args)(x, 2)
        assert np.abs(y - expected).max() > 1e-3


@needs_avx512
def test_the_output_buffer_is_written_in_place():
    rng = np.random.default_rng(4)
    weights = block_weights(rng, 8, 32, 8)
    block = InvertedResidual(*weights, stride=1, activations=("relu6", "relu6", "none"))
    x = rng.standard_normal((1, 5, 5, 8)).astype(np.float32)
    out = np.full((1, 5, 5, 8), np.nan, dtype=np.float32)
    assert block(x, 2, out=out) is out
    assert np.isfinite(out).all()


def test_bad_blocks_are_refused_with_reasons():
    rng = np.random.default_rng(5)
    w1, b1, w2, b2, w3, b3 = block_weights(rng, 8, 32, 16)
    acts = ("relu6", "relu6", "none")
    with pytest.raises(ValueError, match="stride"):
        InvertedResidual(w1, b1, w2, b2, w3, b3, stride=3, activations=acts)
    with pytest.raises(ValueError, match="residual"):
        InvertedResidual(w1, b1, w2, b2, w3, b3, stride=1, activations=acts, residual=True)
    with pytest.raises(ValueError, match="depthwise"):
        InvertedResidual(w1, b1, w2[:, :, :2], b2, w3, b3, stride=1, activations=acts)
    with pytest.raises(ValueError, match="project"):
        InvertedResidual(w1, b1, w2, b2, w3[:, :5], b3, stride=1, activations=acts)
    with pytest.raises(ValueError, match="bias"):
        InvertedResidual(w1, b1[:3], w2, b2, w3, b3, stride=1, activations=acts)
    with pytest.raises(ValueError):
        InvertedResidual(w1, b1, w2, b2, w3, b3, stride=1, activations=("relu6", "gelu",
                                                                         "none"))
    if ttile.has_avx512f():
        block = InvertedResidual(w1, b1, w2, b2, w3, b3, stride=1, activations=acts)
        with pytest.raises(ValueError, match="x must be"):
            block(np.zeros((1, 4, 4, 9), np.float32), 1)
        scratch = _kernels.empty_aligned((16,))
        y = np.zeros((1, 4, 4, 16), np.float32)
        with pytest.raises(ValueError, match="scratch"):
            _kernels.inverted_residual(np.zeros((1, 4, 4, 8), np.float32), block._w1,
                                       block._b1, block._w2, block._b2, block._w3,
                                       block._b3, y, scratch, 32, 1, (2, 2, 0),
                                       (0.0, 0.0, 0.0), False, 1)


def test_the_modelled_verdict_keeps_blocks_with_heavy_weights_as_layers():
    l2 = _kernels.cpu_l2_bytes() or (1 << 20)
    light = BlockShape(1, 56, 56, 24, 144, 24, 1, True)
    heavy = BlockShape(1, 7, 7, 160, l2 // 1280 + 64, 160, 1, True)   # 1280 B per e
    assert light.weight_bytes < l2 < heavy.weight_bytes
    assert modelled_verdict(light) is BlockVerdict.FUSED
    assert modelled_verdict(heavy) is BlockVerdict.LAYERS


# --- ttile.torch --------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def inverted_residual_net():
    torch = _torch()
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            e = cin * expand
            self.use_res = stride == 1 and cin == cout
            self.conv = nn.Sequential(
                nn.Conv2d(cin, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
                nn.Conv2d(e, e, 3, stride, 1, groups=e, bias=False), nn.BatchNorm2d(e),
                nn.ReLU6(),
                nn.Conv2d(e, cout, 1, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return x + self.conv(x) if self.use_res else self.conv(x)

    class Branchy(nn.Module):
        """An expand whose output is used twice: not a block."""

        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(24, 48, 1)
            self.b = nn.Conv2d(48, 48, 3, 1, 1, groups=48)
            self.c = nn.Conv2d(48, 24, 1)

        def forward(self, x):
            t = torch.relu(self.a(x))
            return self.c(self.b(t)) + t[:, :24]

    gen = torch.Generator().manual_seed(7)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU6(),
                          Block(16, 24, 2, 6), Block(24, 24, 1, 6), Block(24, 24, 1, 4),
                          Branchy(), Block(24, 40, 1, 3))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=gen) - 0.5)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=gen) + 0.5)
            m.bias.data.copy_(torch.rand(n, generator=gen) - 0.5)
    return model.eval()


@pytest.mark.parametrize("mode", ["now", "never"])
def test_convert_serves_inverted_residual_blocks_and_matches_torch(mode):
    torch = _torch()
    import ttile.torch as tt
    model = inverted_residual_net()
    x = torch.randn(1, 3, 32, 30, generator=torch.Generator().manual_seed(1))
    previous = ttile.set_tuning(mode)
    try:
        converted = tt.convert(model)
        blocks = [m for m in converted.modules() if isinstance(m, tt.TTileInvertedResidual)]
        assert len(blocks) == 4      # the branchy expand is not one, nor are its other two
        assert [b.project.residual for b in blocks] == [False, True, True, False]
        with torch.no_grad():
            expected = model(x)
            for memory_format in (torch.channels_last, torch.contiguous_format):
                got = converted(x.contiguous(memory_format=memory_format))
                error = ((got - expected).abs().max() / expected.abs().max()).item()
                assert error < 1e-5, (memory_format, error)
                assert got.is_contiguous(memory_format=memory_format)
    finally:
        ttile.restore_tuning(previous)
    verdicts = [p.verdict for b in blocks for p in b.plans.values()]
    if ttile.has_avx512f():
        assert len(verdicts) == 4          # channels_last calls only
        if mode == "now":
            assert all(p.fused_us and p.layers_us for b in blocks for p in b.plans.values())
    else:
        assert verdicts == []


@pytest.mark.parametrize("mode", ["now", "never"])
def test_depthwise_pointwise_pairs_become_blocks_without_expand(mode):
    """MobileNetV2's first block (stem -> depthwise -> 1x1) and MobileNetV1's pairs (a
    1x1 with its own activation after each depthwise layer)."""
    torch = _torch()
    from torch import nn
    import ttile.torch as tt

    def dw(c, stride):
        return [nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False), nn.BatchNorm2d(c),
                nn.ReLU6()]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU6(),
                          *dw(32, 1), nn.Conv2d(32, 16, 1, bias=False), nn.BatchNorm2d(16),
                          *dw(16, 2), nn.Conv2d(16, 40, 1), nn.ReLU(),
                          *dw(40, 1), nn.Conv2d(40, 24, 1), nn.ReLU()).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(1, 3, 30, 34)
    previous = ttile.set_tuning(mode)
    try:
        converted = tt.convert(model)
        blocks = [m for m in converted.modules() if isinstance(m, tt.TTileInvertedResidual)]
        assert len(blocks) == 3 and all(b.expand is None for b in blocks)
        assert [b.project.activation for b in blocks] == [None, "relu", "relu"]
        with torch.no_grad():
            expected = model(x)
            for memory_format in (torch.channels_last, torch.contiguous_format,
                                  torch.channels_last):
                got = converted(x.contiguous(memory_format=memory_format))
                error = ((got - expected).abs().max() / expected.abs().max()).item()
                assert error < 1e-5, (memory_format, error)
    finally:
        ttile.restore_tuning(previous)
    if ttile.has_avx512f():
        assert all(len(b.plans) == 1 for b in blocks)
        assert "|" in next(iter(blocks[0].plans.values())).epilogue


@needs_avx512
@pytest.mark.parametrize("verdict", list(BlockVerdict))
def test_either_verdict_serves_the_block_and_follows_weight_changes(verdict):
    torch = _torch()
    import ttile.torch as tt
    from ttile.runtime.inverted_residual import BlockPlan
    model = inverted_residual_net()
    converted = tt.convert(model)
    x = torch.randn(1, 3, 32, 30, generator=torch.Generator().manual_seed(2)) \
        .contiguous(memory_format=torch.channels_last)
    blocks = [m for m in converted.modules() if isinstance(m, tt.TTileInvertedResidual)]
    with torch.no_grad():
        converted(x)
        for block in blocks:
            for key in list(block.plans):
                block.plans[key] = BlockPlan(verdict, key[1], "forced by the test")
        error = ((converted(x) - model(x)).abs().max() / model(x).abs().max()).item()
        assert error < 1e-5
        # an in-place change torch counts is seen by the fused weights too
        blocks[1].project.weight.mul_(2.0)
        changed = converted(x)
        blocks[1].project.weight.div_(2.0)
        assert ((changed - model(x)).abs().max() / model(x).abs().max()).item() > 1e-3
        # a write through .data is seen after repack
        blocks[1].depthwise.weight.data.mul_(0.0)
        tt.repack(converted)
        zeroed = converted(x)
        assert ((zeroed - model(x)).abs().max() / model(x).abs().max()).item() > 1e-3


def test_tuning_a_converted_model_lists_its_fused_blocks(capsys):
    torch = _torch()
    import ttile.torch as tt
    model = inverted_residual_net()
    x = torch.randn(1, 3, 32, 30).contiguous(memory_format=torch.channels_last)
    tt.convert(model, example_input=x, progress=True)
    table = capsys.readouterr().err
    if ttile.has_avx512f():
        assert "inverted residual" in table
        assert "bias+relu6 | bias+relu6 | bias+residual" in table


def test_fusion_can_be_turned_off():
    _torch()
    import ttile.torch as tt
    converted = tt.convert(inverted_residual_net(), fuse_blocks=False)
    assert not any(isinstance(m, tt.TTileInvertedResidual) for m in converted.modules())
    assert len(tt.served_layers(converted)) == 1 + 4 * 3 + 3


@needs_avx512
@pytest.mark.parametrize("side", ["start", "end"])
@pytest.mark.parametrize("case", [(2, 5, 9, 24, 40, 24, 1, True), (1, 9, 7, 20, 24, 13, 2, False)],
                         ids=lambda c: "x".join(map(str, c[:7])))
def test_the_fused_block_stays_in_bounds(case, side):
    """Input (the residual too) and output against guard pages: the masked last output
    vector (13 and 24 channels), the masked residual reads, the rows above and below."""
    from guarded import guarded_copy
    n, h, w, c, e, k, stride, residual = case
    rng = np.random.default_rng(9)
    weights = block_weights(rng, c, e, k)
    acts = ("relu6", "relu6", "none")
    block = InvertedResidual(*weights, stride=stride, activations=acts, residual=residual)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    expected = reference(x, *weights, stride=stride, activations=acts, residual=residual)
    for threads in (1, 2, 5):
        gx = guarded_copy(x, side)
        gy = guarded_copy(np.zeros(expected.shape, np.float32), side)
        block(gx.array, threads, out=gy.array)
        assert gx.canary_intact() and gy.canary_intact()
        np.testing.assert_allclose(gy.array, expected, rtol=2e-5, atol=2e-5)


def test_export_and_compile_of_a_model_with_fused_blocks_go_through_the_layers():
    """Tracing meets the blocks' layers (the custom op), never the fused kernel."""
    torch = _torch()
    import ttile.torch as tt
    model = inverted_residual_net()
    converted = tt.convert(model)
    x = torch.randn(1, 3, 32, 30).contiguous(memory_format=torch.channels_last)
    exported = torch.export.export(converted, (x,))
    convs = [n for n in exported.graph.nodes if "ttile.conv2d" in str(n.target)]
    assert len(convs) == len(tt.served_layers(converted))
    with torch.no_grad():
        got = exported.module()(x)
        assert ((got - model(x)).abs().max() / model(x).abs().max()).item() < 1e-5


@pytest.mark.skipif(not ttile.has_avx2(), reason="needs the AVX2 family")
def test_calls_held_to_avx2_serve_blocks_by_their_layers():
    torch = _torch()
    import ttile.torch as tt
    model = inverted_residual_net()
    x = torch.randn(1, 3, 32, 30).contiguous(memory_format=torch.channels_last)
    previous = ttile.set_isa("avx2")
    try:
        converted = tt.convert(model)
        with torch.no_grad():
            for _ in range(2):    # the first call and the sequence's fast path
                got = converted(x)
                assert ((got - model(x)).abs().max() / model(x).abs().max()).item() < 1e-5
        assert "avx2" in InvertedResidual.unsupported()
    finally:
        ttile.set_isa(previous)
    blocks = [m for m in converted.modules() if isinstance(m, tt.TTileInvertedResidual)]
    assert blocks and all(not b.plans for b in blocks)


def test_copies_of_a_converted_model_with_blocks_pack_their_own_weights():
    """deepcopy and pickle carry the blocks' weights, never their packed state or
    verdicts; a copy's block follows its own weights, not the original's."""
    torch = _torch()
    import copy
    import pickle
    import ttile.torch as tt
    model = inverted_residual_net()
    converted = tt.convert(model)
    x = torch.randn(1, 3, 32, 30).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = converted(x)
        for clone in (copy.deepcopy(converted), pickle.loads(pickle.dumps(converted))):
            blocks = [m for m in clone.modules() if isinstance(m, tt.TTileInvertedResidual)]
            assert blocks and all(not b.plans and b._fused is None for b in blocks)
            assert torch.allclose(clone(x), expected, rtol=1e-5, atol=1e-6)
            # the second call takes the sequence's fast path
            assert torch.allclose(clone(x), expected, rtol=1e-5, atol=1e-6)
            blocks[0].project.weight.mul_(3.0)
            assert not torch.allclose(clone(x), expected, rtol=1e-3, atol=1e-3)
            assert torch.allclose(converted(x), expected, rtol=1e-5, atol=1e-6)
