"""A converted module owns its packed weights: copies, pickles, saved and reloaded models,
new state dicts, in-place edits, moved tensors and mode toggles all compute with the
module's current weights (or refuse clearly), and the packed memory goes with the module."""
import copy
import gc
import io
import pickle
import subprocess
import sys
import warnings
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ttile.torch as tt  # noqa: E402


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 6, 1)).eval()


def _torch_result(model, x):
    """What the converted model must compute: its own (folded) parameters through torch."""
    layers = tt.served_layers(model)
    y = x
    with torch.no_grad():
        for _, m in layers:
            y = F.conv2d(y, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)
            if m.activation == "relu":
                y = torch.relu(y)
    return y


def _assert_current(model, x):
    with torch.no_grad():
        got = model(x)
    expected = _torch_result(model, x)
    assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max()), \
        "the converted model computed with weights it no longer has"


def _doubled(state):
    return {k: v * 2 if v.is_floating_point() else v for k, v in state.items()}


@pytest.fixture(params=["NCHW", "NHWC"])
def x(request):
    x = torch.randn(1, 4, 9, 9)
    return x.contiguous(memory_format=torch.channels_last) if request.param == "NHWC" else x


def test_a_deep_copy_with_new_weights_computes_with_them(x):
    fast = tt.convert(_net())
    _assert_current(fast, x)                       # packs the original weights
    c = copy.deepcopy(fast)
    c.load_state_dict(_doubled(fast.state_dict()))
    _assert_current(c, x)
    _assert_current(fast, x)                       # the original keeps its own
    ids = {m.layer_id for _, m in tt.served_layers(fast)}
    assert ids.isdisjoint(m.layer_id for _, m in tt.served_layers(c))


def test_load_state_dict_in_place_and_by_assignment(x):
    fast = tt.convert(_net())
    _assert_current(fast, x)
    fast.load_state_dict(_doubled(fast.state_dict()))
    _assert_current(fast, x)
    fast.load_state_dict(_doubled(fast.state_dict()), assign=True)
    _assert_current(fast, x)


def test_in_place_edits_and_new_tensors_are_seen(x):
    fast = tt.convert(_net())
    _assert_current(fast, x)
    _, first = tt.served_layers(fast)[0]
    with torch.no_grad():
        first.weight.mul_(-1.5)
        _assert_current(fast, x)
        first.bias.add_(3.0)
        _assert_current(fast, x)
        first.weight[0, 0, 0, 0] = 7.0
        _assert_current(fast, x)
    first.weight = nn.Parameter(torch.randn_like(first.weight), requires_grad=False)
    _assert_current(fast, x)


def test_writes_through_data_need_repack(x):
    """torch does not count writes through ``.data``; ``repack`` is the documented way."""
    fast = tt.convert(_net())
    _assert_current(fast, x)
    for _, m in tt.served_layers(fast):
        m.weight.data.mul_(3)
    tt.repack(fast)
    _assert_current(fast, x)


def test_memory_format_and_mode_toggles(x):
    fast = tt.convert(_net())
    _assert_current(fast, x)
    fast = fast.to(memory_format=torch.channels_last)
    _assert_current(fast, x)
    fast.train()
    with pytest.raises(RuntimeError, match="training mode"):
        with torch.no_grad():
            fast(x)
    fast.eval()
    _assert_current(fast, x)


def test_pickle_round_trip_packs_its_own_weights(x):
    fast = tt.convert(_net())
    _assert_current(fast, x)
    clone = pickle.loads(pickle.dumps(fast))
    _assert_current(clone, x)
    clone.load_state_dict(_doubled(clone.state_dict()))
    _assert_current(clone, x)
    _assert_current(fast, x)


def test_torch_save_and_load_in_another_process(tmp_path):
    fast = tt.convert(_net())
    x = torch.randn(1, 4, 9, 9)
    with torch.no_grad():
        expected = fast(x)
    torch.save(fast, tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    script = f"""
import torch, ttile
ttile.set_tuning(mode="never")
model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)
x = torch.load({str(tmp_path / 'x.pt')!r})
with torch.no_grad():
    torch.save(model(x), {str(tmp_path / 'y.pt')!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    got = torch.load(tmp_path / "y.pt")
    assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


def test_packed_memory_is_released_with_the_module(x):
    fast = tt.convert(_net())
    _assert_current(fast, x)
    states = [weakref.ref(m._packed) for _, m in tt.served_layers(fast)]
    ids = [m.layer_id for _, m in tt.served_layers(fast)]
    assert all(s() is not None for s in states) and all(i in tt._LAYERS for i in ids)
    del fast
    gc.collect()
    assert all(s() is None for s in states)
    assert not any(i in tt._LAYERS for i in ids)


def test_a_graph_whose_module_is_gone_says_so():
    with pytest.raises(RuntimeError, match="no longer exists"):
        tt._packed_state(-1)


def test_a_model_that_does_not_trace_warns_and_the_table_says_what_was_lost(capsys):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 8, 3, padding=1)
            self.relu = nn.ReLU()

        def forward(self, x):
            y = self.a(x)
            if y.sum() > 0:   # data-dependent: fx cannot trace this
                y = self.relu(y)
            return y

    import ttile
    previous = ttile.set_tuning(mode="never")
    try:
        with pytest.warns(RuntimeWarning, match="could not trace the model"):
            fast = tt.convert(Branchy().eval(), example_input=torch.randn(1, 4, 6, 6))
    finally:
        ttile.restore_tuning(previous)
    [(_, layer)] = tt.served_layers(fast)
    assert "could not trace" in layer.not_fused
    assert "not fused: torch.fx could not trace" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swapped = tt.convert(Branchy().eval(), trace=False)   # asked for: no warning
    assert tt.served_layers(swapped)[0][1].not_fused == "trace=False"


def test_a_replaced_tensor_is_seen_even_at_the_same_version(x):
    """A new Parameter starts at version 0, as the one it replaces may still be: the
    version counter alone cannot tell them apart."""
    fast = tt.convert(_net())
    _assert_current(fast, x)
    _, first = tt.served_layers(fast)[0]
    assert first.weight._version == 0
    first.weight = nn.Parameter(torch.randn_like(first.weight), requires_grad=False)
    _assert_current(fast, x)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v
             for k, v in fast.state_dict().items()}
    fast.load_state_dict(state, assign=True)
    _assert_current(fast, x)
