"""A layer's alternatives, pinned in place of the default (``Conv2d.pin``), and a
network's context verdict (``TTileSequence.settle``) that times them in place and keeps
the faster: every alternative computes the same convolution, a pin holds only while the
default it replaced does, and the verdict follows the times it measured."""
import time

import numpy as np
import pytest

import ttile
from conftest import forget_choices
from ttile import KernelKind
from ttile.core.reference import conv_mismatch
from ttile.runtime import execute


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel choice each call ran, in order."""
    ran = []
    for route, runner in list(execute.RUNNERS.items()):
        def recorder(plan, choice, *args, _runner=runner):
            ran.append(choice)
            return _runner(plan, choice, *args)
        monkeypatch.setitem(execute.RUNNERS, route, recorder)
    forget_choices()
    yield ran
    forget_choices()


def winograd_layer():
    rng = np.random.default_rng(21)
    w = rng.uniform(-1, 1, (3, 3, 32, 48)).astype(np.float32)
    x = rng.uniform(-1, 1, (1, 16, 16, 32)).astype(np.float32)
    return ttile.Conv2d(w, padding=1, layout="NHWC"), x, w


@pytest.mark.parametrize("threads", [1, 2])
def test_each_alternative_of_a_winograd_layer_computes_the_convolution(kernel_calls,
                                                                        threads):
    if not ttile.get_isa().vector:
        pytest.skip("the Winograd kernel needs a vector family")
    layer, x, w = winograd_layer()
    alternatives = layer.alternatives(x.shape, threads)
    # 16x16: F(4x4) by default; F(2x2) and the direct kernel are the others
    described = [(a.choice.kind, a.choice.tile) for a in alternatives]
    assert described[0] == (KernelKind.WINOGRAD, 4)
    assert (KernelKind.WINOGRAD, 2) in described
    assert any(kind is not KernelKind.WINOGRAD for kind, _ in described)
    for alternative in alternatives:
        layer.pin(x.shape, threads, alternative)
        assert layer.pinned(x.shape, threads) == alternative
        for _ in range(2):   # the full path, then the bound one
            kernel_calls.clear()
            y = layer(x, threads, whole_team=True)
            assert kernel_calls == [alternative.choice]
            assert conv_mismatch(y, x, w, (1, 1), (1, 1, 1, 1)) is None
    layer.pin(x.shape, threads, None)
    kernel_calls.clear()
    layer(x, threads, whole_team=True)
    assert kernel_calls == [alternatives[0].choice]
    assert layer.pinned(x.shape, threads) is None


def test_a_pin_takes_only_an_alternative_and_lapses_with_the_settings_it_was_made_under(
        kernel_calls):
    if not ttile.get_isa().vector:
        pytest.skip("the Winograd kernel needs a vector family")
    layer, x, w = winograd_layer()
    other = ttile.Conv2d(np.ones((1, 1, 32, 8), np.float32), layout="NHWC")
    with pytest.raises(ValueError, match="alternatives"):
        layer.pin(x.shape, 1, other.alternatives(x.shape, 1)[0])
    f2 = next(a for a in layer.alternatives(x.shape, 1) if a.choice.tile == 2)
    layer.pin(x.shape, 1, f2)
    layer(x, 1, whole_team=True)
    ttile.use_winograd(False)
    try:
        assert layer.pinned(x.shape, 1) is None
        kernel_calls.clear()
        y = layer(x, 1, whole_team=True)
        assert kernel_calls and kernel_calls[0].kind is not KernelKind.WINOGRAD
        assert conv_mismatch(y, x, w, (1, 1), (1, 1, 1, 1)) is None
    finally:
        ttile.use_winograd(True)


def test_the_generic_blockings_are_the_kernels_flags():
    from ttile import _kernels
    from ttile.core.kinds import GenericBlocking
    assert GenericBlocking.GROUPS_FIRST == _kernels.GENERIC_GROUPS_FIRST
    assert GenericBlocking.SMALL_GROUPS == _kernels.GENERIC_SMALL_GROUPS


@pytest.mark.parametrize("threads", [1, 2])
def test_a_generic_layer_offers_the_blockings_that_change_its_split(kernel_calls, threads):
    """Eight panels in groups of four (a 32 KB cache blocking): half groups are another
    split at any thread count, whole groups per thread one at two threads (where the
    panels fit in the L2 and threads would take whole rows); each computes the same."""
    from ttile import _kernels
    from ttile.core.kinds import GenericBlocking
    if ttile.get_isa() is not ttile.Isa.AVX512F or _kernels.cpu_l2_bytes() < (256 << 10):
        pytest.skip("the AVX-512F generic kernel's 64-wide panels, a known L2")
    rng = np.random.default_rng(5)
    w = rng.uniform(-1, 1, (1, 1, 32, 512)).astype(np.float32)
    x = rng.uniform(-1, 1, (1, 12, 12, 32)).astype(np.float32)
    previous = _kernels.set_generic_cache_bytes(32 << 10)
    tuned, policy = ttile.use_tuned_kernels(False), ttile.set_tuning("never")
    try:
        layer = ttile.Conv2d(w, layout="NHWC")
        alternatives = layer.alternatives(x.shape, threads)
        assert alternatives[0].choice.kind is KernelKind.GENERIC
        assert alternatives[0].choice.panel == 64   # 8 panels of 8 KB
        blockings = [a.choice.blocking for a in alternatives]
        both = GenericBlocking.GROUPS_FIRST | GenericBlocking.SMALL_GROUPS
        expected = ([GenericBlocking.DEFAULT, GenericBlocking.GROUPS_FIRST,
                     GenericBlocking.SMALL_GROUPS, both] if threads > 1 else
                    [GenericBlocking.DEFAULT, GenericBlocking.SMALL_GROUPS])
        assert blockings == expected
        outputs = []
        for alternative in alternatives:
            layer.pin(x.shape, threads, alternative if alternative.choice.blocking else None)
            kernel_calls.clear()
            outputs.append(layer(x, threads, whole_team=True))
            assert kernel_calls == [alternative.choice]
            assert conv_mismatch(outputs[-1], x, w) is None
        for y in outputs[1:]:   # every block sums its channels in one order
            np.testing.assert_array_equal(y, outputs[0])
    finally:
        _kernels.set_generic_cache_bytes(previous)
        ttile.use_tuned_kernels(tuned)
        ttile.restore_tuning(policy)


torch = pytest.importorskip("torch")
tt = pytest.importorskip("ttile.torch")


class ThreeByThrees(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.b = torch.nn.Conv2d(32, 32, 3, padding=1)
        self.c = torch.nn.Conv2d(32, 16, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_the_context_verdict_keeps_the_alternative_that_ran_faster_in_place():
    """Layer a is made slow on its default kernel and b on every other: the verdict
    pins an alternative for a, keeps b's default, and the network still matches torch."""
    if not ttile.get_isa().vector:
        pytest.skip("the Winograd kernel needs a vector family")
    torch.manual_seed(4)
    model = ThreeByThrees().eval()
    x = torch.randn(1, 16, 16, 16).contiguous(memory_format=torch.channels_last)
    converted = tt.convert(model, example_input=x, progress=False, settle=False)
    sequence = next(m for m in converted.modules() if isinstance(m, tt.TTileSequence))
    units = {name: getattr(sequence, name) for name, _ in sequence.steps}
    slow_a = next(u for n, u in units.items() if n.endswith("a"))
    slow_b = next(u for n, u in units.items() if n.endswith("b"))
    threads = torch.get_num_threads()

    def slowed(unit, when_pinned):
        run = unit.run_nhwc

        def run_nhwc(x_np, residual, t):
            layer = unit._packed.layer("NHWC")
            if (layer.pinned(x_np.shape, unit.threads or t) is not None) == when_pinned:
                time.sleep(0.002)
            return run(x_np, residual, t)
        unit.run_nhwc = run_nhwc
    slowed(slow_a, when_pinned=False)
    slowed(slow_b, when_pinned=True)
    verdicts = {v.layer: v for v in sequence.settle(x, rounds=3)}
    for name, unit, expect_default in ((n, u, u is slow_b) for n, u in units.items()
                                       if u in (slow_a, slow_b)):
        verdict = verdicts[name]
        assert len(verdict.alternatives) == len(verdict.medians_us) >= 2
        assert (verdict.chosen == 0) == expect_default, verdict.describe()
        layer = unit._packed.layer("NHWC")
        pinned = layer.pinned((1, 16, 16, verdict.input_shape[3]), verdict.threads)
        assert (pinned is None) == expect_default
        assert verdict.threads == (unit.threads or threads)
    del slow_a.run_nhwc, slow_b.run_nhwc
    with torch.no_grad():
        expected = model(x)
        got = converted(x)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5


def test_an_interrupted_verdict_leaves_every_layer_on_its_default():
    if not ttile.get_isa().vector:
        pytest.skip("the Winograd kernel needs a vector family")
    model = ThreeByThrees().eval()
    x = torch.randn(1, 16, 16, 16).contiguous(memory_format=torch.channels_last)
    converted = tt.convert(model, example_input=x, progress=False, settle=False)
    sequence = next(m for m in converted.modules() if isinstance(m, tt.TTileSequence))
    unit = getattr(sequence, sequence.steps[1][0])
    run, calls = unit.run_nhwc, []

    def run_nhwc(x_np, residual, t):
        calls.append(1)
        if len(calls) == 4:   # mid-rotation, with pins set
            raise KeyboardInterrupt
        return run(x_np, residual, t)
    unit.run_nhwc = run_nhwc
    with pytest.raises(KeyboardInterrupt):
        sequence.settle(x)
    del unit.run_nhwc
    assert len(calls) == 4
    for name, _ in sequence.steps:
        conv = getattr(sequence, name)
        layer = conv._packed.layer("NHWC")
        assert not any(layer.pinned(shape, t) for shape, t in layer._pinned)
    with torch.no_grad():
        assert float((converted(x) - model(x)).abs().max() / model(x).abs().max()) < 1e-5


def test_convert_settles_by_default_and_says_what_it_changed(capsys):
    model = ThreeByThrees().eval()
    x = torch.randn(1, 16, 16, 16).contiguous(memory_format=torch.channels_last)
    converted = tt.convert(model, example_input=x)
    sequence = next(m for m in converted.modules() if isinstance(m, tt.TTileSequence))
    err = capsys.readouterr().err
    if ttile.get_isa().vector:   # the 3x3 layers have alternatives
        assert len(sequence.verdicts) >= 2
        assert "layers with alternatives" in err
    for verdict in sequence.verdicts:
        assert 0 <= verdict.chosen < len(verdict.alternatives)
        assert all(us > 0 for us in verdict.medians_us)
    with torch.no_grad():
        assert float((converted(x) - model(x)).abs().max() / model(x).abs().max()) < 1e-5
    # an NCHW example input takes no fast path: nothing to settle
    converted = tt.convert(model, example_input=x.contiguous(), progress=False)
    sequence = next(m for m in converted.modules() if isinstance(m, tt.TTileSequence))
    assert sequence.verdicts == []
