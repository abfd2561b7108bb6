"""Random small CNNs through ``ttile.torch.convert``, against the same model run by torch in
float64: convolutions of every stride, padding form, dilation and grouping, batch norms,
each activation, residual adds, channels_last and NCHW inputs, batch 1 and more.

``TTILE_FUZZ_MODELS`` sets how many models the slow test draws (1000 by default); CI runs
a fixed subset of the seeds.
"""
import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ttile  # noqa: E402
import ttile.torch as tt  # noqa: E402

#: Seeds run in CI (about 5 s); the slow test draws further ones.
CI_MODELS = 200
ACTIVATIONS = [None, lambda rng: nn.ReLU(), lambda rng: nn.ReLU6(),
               lambda rng: nn.LeakyReLU(float(rng.choice([0.01, 0.2]))),
               lambda rng: nn.SiLU(), lambda rng: nn.Sigmoid(), lambda rng: nn.Hardtanh(0.0, 6.0)]


class Block(nn.Module):
    """conv, then optionally a batch norm, a residual add of the block's input, an
    activation: the chain ``convert`` fuses into one ttile call when the graph traces."""

    def __init__(self, conv, bn, residual, act):
        super().__init__()
        self.conv, self.bn, self.act, self.residual = conv, bn, act, residual

    def forward(self, x):
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.residual:
            y = y + x
        if self.act is not None:
            y = self.act(y)
        return y


def _out(size, pad_total, dilation, kernel, stride):
    return (size + pad_total - dilation * (kernel - 1) - 1) // stride + 1


def random_model(seed: int):
    """A model and an input for it, both drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    c = int(rng.integers(1, 7))
    h, w = int(rng.integers(4, 13)), int(rng.integers(4, 13))
    c0, h0, w0 = c, h, w
    blocks = []
    for _ in range(int(rng.integers(1, 5))):
        r, s = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        if rng.random() < 0.5:
            s = r
        stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        mode = rng.choice(["int", "pair", "same", "same", "valid", "zero"])
        if mode == "same" and stride != (1, 1):
            mode = "int"
        padding = {"int": int(rng.integers(0, 3)),
                   "pair": (int(rng.integers(0, 3)), int(rng.integers(0, 3))),
                   "same": "same", "valid": "valid", "zero": 0}[mode]
        grouping = rng.choice(["dense", "grouped", "depthwise"])
        if grouping == "depthwise":
            groups, k = c, c * int(rng.integers(1, 3))
        elif grouping == "grouped" and c % 2 == 0:
            groups, k = 2, 2 * int(rng.integers(1, 5))
        else:
            # as many outputs as inputs a third of the time: residual adds need it
            groups, k = 1, (c if rng.random() < 0.35 else int(rng.integers(1, 13)))
        pads = ((dilation[0] * (r - 1), dilation[1] * (s - 1)) if padding == "same" else
                (0, 0) if padding == "valid" else
                (2 * padding, 2 * padding) if isinstance(padding, int) else
                (2 * padding[0], 2 * padding[1]))
        ho = _out(h, pads[0], dilation[0], r, stride[0])
        wo = _out(w, pads[1], dilation[1], s, stride[1])
        if ho < 1 or wo < 1:
            continue
        conv = nn.Conv2d(c, k, (r, s), stride, padding, dilation, groups,
                         bias=bool(rng.random() < 0.6),
                         padding_mode="reflect" if rng.random() < 0.05 and padding != "valid"
                         and isinstance(padding, int) and padding < min(h, w) else "zeros")
        bn = None
        if rng.random() < 0.5:
            bn = nn.BatchNorm2d(k)
            bn.running_mean.copy_(torch.rand(k) * 2 - 1)
            bn.running_var.copy_(torch.rand(k) + 0.5)
            bn.weight.data.copy_(torch.rand(k) + 0.5)
            bn.bias.data.copy_(torch.rand(k) * 2 - 1)
        residual = (k, ho, wo) == (c, h, w) and rng.random() < 0.6
        make = ACTIVATIONS[int(rng.integers(len(ACTIVATIONS)))]
        blocks.append(Block(conv, bn, residual, None if make is None else make(rng)))
        c, h, w = k, ho, wo
    if not blocks:
        blocks.append(Block(nn.Conv2d(c, 3, 1), None, False, None))
    model = nn.Sequential(*blocks).eval()
    n = int(rng.choice([1, 1, 2, 3]))
    x = torch.randn(n, c0, h0, w0)
    if rng.random() < 0.5:
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x


def check_model(seed: int):
    model, x = random_model(seed)
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x.double())
        fast = tt.convert(model)
        got = fast(x)
    assert got.shape == expected.shape, seed
    scale = float(expected.abs().max()) or 1.0
    error = float((got.double() - expected).abs().max()) / scale
    assert error < 2e-4, f"seed {seed}: relative error {error:.2e}\n{model}"
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        assert got.is_contiguous(memory_format=torch.channels_last) or got.shape[1] == 1 \
            or tt.served_layers(fast) == [], seed


@pytest.fixture(autouse=True)
def _no_tuning():
    previous = ttile.set_tuning(mode="never")
    yield
    ttile.restore_tuning(previous)


@pytest.mark.parametrize("seed", range(CI_MODELS))
def test_random_models_match_torch_float64(seed):
    check_model(seed)


@pytest.mark.slow
def test_many_random_models_match_torch_float64():
    for seed in range(CI_MODELS, CI_MODELS + int(os.environ.get("TTILE_FUZZ_MODELS", "1000"))):
        check_model(seed)


def test_the_fuzzer_covers_what_it_claims():
    """Over the CI seeds: every grouping, both layouts, batches over 1, residual adds,
    batch norms and each activation are drawn (so the subset is not vacuous)."""
    seen = set()
    for seed in range(CI_MODELS):
        model, x = random_model(seed)
        seen.add("channels_last" if not x.is_contiguous() else "nchw")
        seen.add("batch>1" if x.shape[0] > 1 else "batch1")
        for block in model:
            conv = block.conv
            seen.add("depthwise" if conv.groups == conv.in_channels > 1 else
                     "grouped" if conv.groups > 1 else "dense")
            seen.add(f"stride{max(conv.stride)}")
            seen.add(f"dilation{max(conv.dilation)}")
            seen.add("bn" if block.bn is not None else "no-bn")
            seen.add("residual" if block.residual else "plain")
            seen.add(type(block.act).__name__)
    assert seen >= {"channels_last", "nchw", "batch>1", "batch1", "depthwise", "grouped",
                    "dense", "stride2", "dilation2", "bn", "residual", "ReLU", "ReLU6",
                    "LeakyReLU", "SiLU", "Sigmoid", "Hardtanh"}, seen
