"""A Program runs bound kernel calls with its intermediates in buffers it keeps: the buffer
assignment never lets a step write over a value still to be read, the last output is new
on every run, and a converted network's sequence runs through one only while every
weight, packed copy and kernel choice it was bound from still holds."""
import threading

import numpy as np
import pytest

from ttile.runtime.program import Program, Step, assign_buffers


def _live_ranges(inputs, steps):
    """value -> (step that makes it, last step that reads it)."""
    last = {}
    for i, step in enumerate(steps):
        for v in (step.source, step.residual):
            if v >= 0:
                last[v] = i
    return {inputs + i: (i, last.get(inputs + i, i)) for i in range(len(steps))}


def _random_steps(rng, inputs, count):
    steps = []
    for i in range(count):
        source = int(rng.integers(0, inputs + i))
        residual = int(rng.integers(-1, inputs + i)) if rng.random() < 0.4 else -1
        steps.append(Step(None, source, residual, (1, 2, 2, 3)))
    return steps


@pytest.mark.parametrize("seed", range(20))
def test_no_buffer_is_written_while_its_value_is_still_to_be_read(seed):
    rng = np.random.default_rng(seed)
    inputs = int(rng.integers(1, 3))
    steps = _random_steps(rng, inputs, int(rng.integers(1, 12)))
    assigned = assign_buffers(inputs, steps)
    assert assigned[-1] is None   # the caller's output is its own
    live = _live_ranges(inputs, steps)
    for a, ba in enumerate(assigned):
        for b, bb in enumerate(assigned):
            if a < b and ba is not None and ba == bb:
                # value a's buffer is reused by step b: a must be dead by then
                assert live[inputs + a][1] < b, (a, b, assigned)


def test_a_chain_ping_pongs_between_two_buffers_taking_the_one_just_read():
    steps = [Step(None, i, -1, (4,)) for i in range(6)]
    assigned = assign_buffers(1, steps)
    assert assigned == [0, 1, 0, 1, 0, None]


def test_a_residual_keeps_its_value_alive_until_it_is_added():
    # x -> a -> b -> c = b + x... with a's value read again at the end
    steps = [Step(None, 0, -1, (4,)), Step(None, 1, -1, (4,)), Step(None, 2, -1, (4,)),
             Step(None, 3, 1, (4,))]
    assigned = assign_buffers(1, steps)
    assert assigned[0] not in (assigned[1], assigned[2])


def _affine(scale, shift):
    def call(x, y, residual):
        np.multiply(x, scale, out=y)
        y += shift
        if residual is not None:
            y += residual
    return call


def _program_and_reference(rng, inputs=1, count=8):
    raw = _random_steps(rng, inputs, count)
    params = [(float(rng.uniform(-2, 2)), float(rng.uniform(-1, 1))) for _ in raw]
    steps = [Step(_affine(a, b), s.source, s.residual, s.out_shape)
             for s, (a, b) in zip(raw, params)]

    def reference(xs):
        values = [x.astype(np.float64) for x in xs]
        for s, (a, b) in zip(raw, params):
            y = values[s.source] * a + b
            if s.residual >= 0:
                y = y + values[s.residual]
            values.append(y)
        return values[-1]
    return Program(inputs, steps), reference


@pytest.mark.parametrize("seed", range(10))
def test_a_program_computes_what_its_steps_compute_one_by_one(seed):
    rng = np.random.default_rng(seed)
    program, reference = _program_and_reference(rng, inputs=2)
    for _ in range(3):   # buffers reused across runs
        xs = [rng.standard_normal((1, 2, 2, 3)).astype(np.float32) for _ in range(2)]
        np.testing.assert_allclose(program.run(xs), reference(xs), rtol=1e-5, atol=1e-5)


def test_each_run_returns_a_new_array_and_keeps_no_view_of_it():
    rng = np.random.default_rng(0)
    program, reference = _program_and_reference(rng)
    x1 = rng.standard_normal((1, 2, 2, 3)).astype(np.float32)
    y1 = program.run([x1])
    kept = y1.copy()
    y2 = program.run([rng.standard_normal((1, 2, 2, 3)).astype(np.float32)])
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, kept)


def test_a_program_another_thread_is_running_answers_none():
    started, release = threading.Event(), threading.Event()

    def blocking(x, y, residual):
        started.set()
        release.wait(10)
        y[...] = x
    program = Program(1, [Step(blocking, 0, -1, (2,)), Step(_affine(1.0, 0.0), 1, -1, (2,))])
    x = np.ones(2, np.float32)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("y", program.run([x])))
    t.start()
    assert started.wait(10)
    assert program.run([x]) is None
    release.set()
    t.join(10)
    np.testing.assert_array_equal(result["y"], x)


def test_steps_that_read_values_not_made_yet_are_refused():
    with pytest.raises(ValueError, match="not made before"):
        Program(1, [Step(None, 1, -1, (2,))])
    with pytest.raises(ValueError, match="at least one step"):
        Program(1, [])


# --- a converted network's sequence ----------------------------------------------------

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ttile  # noqa: E402
import ttile.torch as tt  # noqa: E402
from ttile.runtime.inverted_residual import InvertedResidual  # noqa: E402


def _mobile_net():
    """A stem, two inverted residual blocks (one with a residual), a max pooling, a 1x1
    layer with a residual from the block before it, and a global average pooling."""
    torch.manual_seed(0)

    from test_torch_convert import InvertedResidual as Block

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU())
            self.b1 = Block(16, 48, 24, 2)
            self.b2 = Block(24, 72, 24, 1)
            self.pool = nn.MaxPool2d(3, 2, 1)
            self.head = nn.Conv2d(24, 24, 1)
            self.avg = nn.AdaptiveAvgPool2d(1)

        def forward(self, x):
            y = self.pool(self.b2(self.b1(self.stem(x))))
            return self.avg(torch.relu(self.head(y) + y))
    for m in Net().modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return Net().eval()


def _sequences(model):
    return [m for m in model.modules() if isinstance(m, tt.TTileSequence)]


def _bound(model):
    return [type(p).__name__ for s in _sequences(model) for p in s._programs.values()]


def _check(fast, reference, x):
    with torch.no_grad():
        got = fast(x)
        expected = reference(x)
    assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
    return got


@pytest.fixture
def converted():
    if InvertedResidual.unsupported() is not None:
        pytest.skip("the fused blocks need AVX-512")
    model = _mobile_net()
    x = torch.randn(1, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    fast = tt.convert(model, example_input=x, progress=False)
    assert _sequences(fast), "the network converts into a sequence"
    return model, fast, x


def test_a_sequence_runs_through_its_program_and_matches_torch(converted):
    model, fast, x = converted
    for _ in range(3):
        _check(fast, model, x)
    assert _bound(fast) == ["_BoundSequence"]
    seq = _sequences(fast)[0]
    bound = next(iter(seq._programs.values()))
    blocks = [m for m in seq.modules() if isinstance(m, tt.TTileInvertedResidual)]
    assert bound.holds() and blocks
    assert all(p.verdict.value == "fused" for b in blocks for p in b.plans.values()) \
        or len(bound.program.steps) > len(seq._plan), "each block is bound, fused or not"
    # new inputs of the same shape, and outputs kept by the caller stay as they were
    y1 = _check(fast, model, x)
    kept = y1.clone()
    _check(fast, model, torch.randn_like(x))
    assert torch.equal(y1, kept)


def test_an_nchw_input_runs_the_program_and_gets_an_nchw_output():
    """torch's default layout: the sequence converts the input to channels_last once,
    runs its program (the same values, bit for bit, as on a channels_last input) and
    gives the output back contiguous NCHW, as torch's own layers would."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 32, 1),
                        nn.ReLU(), nn.Conv2d(32, 16, 3, 1, 1)).eval()
    x = torch.randn(1, 3, 20, 20)
    assert not x.is_contiguous(memory_format=torch.channels_last)
    fast = tt.convert(net, example_input=x, progress=False)
    assert len(_sequences(fast)) == 1
    for _ in range(3):
        y = _check(fast, net, x)
    assert _bound(fast) == ["_BoundSequence"]
    assert y.is_contiguous() and not y.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y_cl = fast(x.contiguous(memory_format=torch.channels_last))
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, y_cl)


def test_weight_edits_repacks_and_setting_changes_rebind_the_program(converted):
    model, fast, x = converted
    for _ in range(2):
        _check(fast, model, x)
    seq = _sequences(fast)[0]
    units = [m for m in seq.modules() if isinstance(m, tt.TTileConv2d)]
    block = next(m for m in seq.modules() if isinstance(m, tt.TTileInvertedResidual))

    def current(x):
        """What the converted model must compute now: an NCHW input goes through its
        modules one by one, each packing its current weights for that layout."""
        return fast(x.contiguous())

    edits = [
        lambda: units[0].weight.mul_(-1.5),                     # counted in-place edit
        lambda: block.project.bias.add_(0.25),                  # a fused block's bias
        lambda: setattr(units[-1], "weight",                    # a new tensor
                        nn.Parameter(torch.randn_like(units[-1].weight),
                                     requires_grad=False)),
    ]
    with torch.no_grad():
        for edit in edits:
            old = bound = next(iter(seq._programs.values()))
            edit()
            assert not bound.holds()
            expected = current(x)
            got = fast(x)
            assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
            fast(x)
            assert next(iter(seq._programs.values())) is not old   # bound anew
        # writes torch does not count, then repack: the documented way
        units[1].weight.data.mul_(0.5)
        block.expand.weight.data.mul_(2.0)
        tt.repack(fast)
        assert not next(iter(seq._programs.values())).holds()
        expected = current(x)
        for _ in range(2):
            got = fast(x)
            assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
        # a setting that changes kernel choices
        previous = ttile.use_tuned_kernels(False)
        try:
            assert not next(iter(seq._programs.values())).holds()
            for _ in range(2):
                got = fast(x)
                assert float((got - expected).abs().max()) <= \
                    1e-4 * float(expected.abs().max())
            assert next(iter(seq._programs.values())).holds()
        finally:
            ttile.use_tuned_kernels(previous)


def test_threads_sharing_a_converted_model_each_get_their_own_result(converted):
    model, fast, x = converted
    inputs = [torch.randn_like(x) for _ in range(4)]
    with torch.no_grad():
        expected = [model(i) for i in inputs]
        fast(x)
        fast(x)
    errors = []

    def worker(k):
        with torch.no_grad():
            for _ in range(20):
                got = fast(inputs[k])
                if float((got - expected[k]).abs().max()) > \
                        1e-4 * float(expected[k].abs().max()):
                    errors.append(k)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_converted_model_with_a_bound_program_pickles_and_copies(converted):
    import copy
    import pickle
    model, fast, x = converted
    for _ in range(2):
        _check(fast, model, x)
    for clone in (pickle.loads(pickle.dumps(fast)), copy.deepcopy(fast)):
        for _ in range(2):
            _check(clone, model, x)
        assert _bound(clone) == ["_BoundSequence"]


def test_a_sequence_keeps_few_programs_and_bounded_memory(converted):
    model, fast, x = converted
    seq = _sequences(fast)[0]
    seq.MAX_PROGRAMS = 3
    shapes = [(1, 3, 32 + 2 * i, 32) for i in range(5)]
    with torch.no_grad():
        for shape in shapes:
            xi = torch.randn(shape).contiguous(memory_format=torch.channels_last)
            for _ in range(3):   # first calls: verdicts on tensors, then bound
                _check(fast, model, xi)
    kept = [k for k, v in seq._programs.items() if type(v).__name__ == "_BoundSequence"]
    assert len(seq._programs) <= 3 and kept
    assert kept[-1][0][0] == (1, 32 + 2 * 4, 32, 3)   # the newest signature stays
    seq.MAX_PROGRAM_BYTES = 0   # only the newest program is kept
    with torch.no_grad():
        xi = torch.randn(shapes[0]).contiguous(memory_format=torch.channels_last)
        for _ in range(3):
            _check(fast, model, xi)
    assert [type(v).__name__ for v in seq._programs.values()] == ["_BoundSequence"]
