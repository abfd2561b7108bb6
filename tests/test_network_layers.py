"""bench_network's per-layer breakdown (benchmarks/network_layers.py) matches each engine's
profiled convolution nodes to ttile's layers: by the module path in OpenVINO's node names
and by output and weight sizes in onnxruntime's profile. A wrong match puts another
layer's time beside a layer, so the matching rules are checked here."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.skipif(not (BENCH / "network_layers.py").is_file(),
                                reason="not a source checkout")


@pytest.fixture(scope="module")
def nl():
    sys.path.insert(0, str(BENCH))
    try:
        import network_layers
        yield network_layers
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("node, path", [
    ("/4/conv1/Conv/WithoutBiases", "4.conv1"),
    ("/4/downsample/downsample.0/Conv/WithoutBiases", "4.downsample.0"),
    ("/0/Conv/WithoutBiases", "0"),
    ("/features/features.1/conv/conv.0/conv.0.0/Conv", "features.1.conv.0.0"),
])
def test_openvino_node_names_give_the_module_path(nl, node, path):
    assert nl._module_path(node) == path


def test_onnxruntime_runs_are_split_at_their_closing_event(nl):
    def node(name, out, w, dur):
        return {"cat": "Node", "name": name + "_kernel_time", "dur": dur,
                "args": {"op_name": "Conv", "output_type_shape": [{"float": out}],
                         "input_type_shape": [{"float": [1, 3, 8, 8]}, {"float": w}]}}
    run = {"cat": "Session", "name": "model_run"}
    events = [node("a", [1, 4, 8, 8], [4, 3, 3, 3], 10), node("b", [1, 4, 4, 4], [4, 4, 1, 1], 5),
              run, node("a", [1, 4, 8, 8], [4, 3, 3, 3], 12), run,
              node("a", [1, 4, 8, 8], [4, 3, 3, 3], 99)]   # an unfinished run: left out
    runs = nl._runs_by_closing_event(events)
    assert [len(r) for r in runs] == [2, 1]
    assert runs[0][0] == ("a", "Conv", 10, ("size", 256, 108))
    assert runs[0][1][3] == ("size", 64, 16)
    assert runs[1][0][2] == 12


def test_the_fast_path_times_every_unit_of_a_sequence(nl):
    """The breakdown's fast-path column: every unit of a converted model's sequence (a
    fused block among them) gets one positive time per round, keyed by its module, and
    each round's whole inference is timed."""
    torch = pytest.importorskip("torch")
    from torch import nn

    import ttile.torch as tt

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Sequential(
                nn.Conv2d(16, 64, 1), nn.ReLU6(), nn.Conv2d(64, 64, 3, 1, 1, groups=64),
                nn.ReLU6(), nn.Conv2d(64, 16, 1))

        def forward(self, x):
            return x + self.conv(x)

    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), Block(),
                          nn.Conv2d(16, 32, 1)).eval()
    x = torch.rand(1, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    converted = tt.convert(model, example_input=x, progress=False)
    sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
    assert len(sequences) == 1
    units = [unit for unit, _, _ in sequences[0]._plan]
    assert any(isinstance(u, tt.TTileInvertedResidual) for u in units)
    times, walls = nl._fast_path_times(converted, x, torch.get_num_threads(), reps=3)
    assert set(times) == {id(u) for u in units}
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert len(walls) == 3 and min(walls) > 0
