"""The learned ranking of schemes: its numpy trees, its features, its evaluation on
held-out layers, the train-ranker command and the run-time tuner's ranked first call."""
import json
from pathlib import Path

import numpy as np
import pytest

import ttile
from ttile.core.kinds import Isa
from ttile.core.scheme import Scheme
from ttile.core.spec import ConvSpec
from ttile.tuning import ranker

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = ranker.CpuContext(48 * 1024, 1 << 20, {"r1s1_h_a2b6": 90.0})


def test_boosted_trees_learn_and_survive_json():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (3000, 4))
    y = np.where(x[:, 0] > 0.5, 1.0, -1.0) + 0.5 * x[:, 1] + rng.normal(0, 0.05, 3000)
    trees = ranker.fit_trees(x[:2000], y[:2000], rounds=60, depth=3)
    error = np.abs(trees.predict(x[2000:]) - y[2000:])
    assert np.median(error) < 0.15           # learned the step and the slope
    again = ranker.BoostedTrees.from_json(json.loads(json.dumps(trees.to_json())))
    np.testing.assert_array_equal(again.predict(x[:50]), trees.predict(x[:50]))


def test_features_of_a_scheme_per_family():
    spec = ConvSpec(1, 32, 16, 12, 12, 3, 3, 1, 1, 1, 1, 1, 1)
    text = "[T2 h; T12 w; T3 r; T3 s; T16 c; U6 h; U2 k; V k]"
    wide = ranker.features(spec, text, 1, Isa.AVX512F, CONTEXT)
    assert wide is not None and len(wide) == len(ranker.FEATURES)
    named = dict(zip(ranker.FEATURES, wide))
    assert named["lanes"] == 16 and named["alpha"] == 2 and named["beta"] == 6
    assert named["whole_reduction_inside"] == 1.0 and named["microkernel_percent"] == 90.0
    # K = 32 is one 16-lane vector per U2 k too many for this scheme in AVX2 (2 x 8 < 32)
    assert ranker.features(spec, text, 1, Isa.AVX2, CONTEXT) is None
    avx2 = ranker.features(spec, "[T2 k; T2 h; T12 w; T3 r; T3 s; T16 c; U6 h; U2 k; V k]",
                           1, Isa.AVX2, CONTEXT)
    assert dict(zip(ranker.FEATURES, avx2))["lanes"] == 8


def _synthetic_groups():
    """Groups whose speed is a known function of the block: the evaluation must find it."""
    groups = []
    texts = [f"[T{12 // b} h; T12 w; T3 r; T3 s; T16 c; U{b} h; U2 k; V k]"
             for b in (1, 2, 3, 4, 6)] + \
            [f"[T{12 // b} h; T12 w; T3 r; T3 s; T16 c; U{b} h; V k]" for b in (1, 2, 3, 4, 6)]
    for k in (32, 64, 96, 128):
        for c in (16, 32):
            spec = ConvSpec(1, k, c, 12, 12, 3, 3, 1, 1, 1, 1, 1, 1)
            rows, rates, kept = [], [], []
            for text in texts:
                text = text.replace("[", f"[T{k // (32 if 'U2 k' in text else 16)} k; ")
                text = text.replace("T16 c", f"T{c} c")
                row = ranker.features(spec, text, 1, Isa.AVX512F, CONTEXT)
                named = dict(zip(ranker.FEATURES, row))
                rates.append(10 + named["alpha"] * named["beta"])   # bigger blocks win
                rows.append(row)
                kept.append(text)
            groups.append(ranker.Group("cpu", Isa.AVX512F, spec, 1, tuple(kept),
                                       np.array(rates, float), np.stack(rows)))
    return groups


def test_evaluation_holds_problems_out_and_finds_the_pattern():
    results = ranker.evaluate(_synthetic_groups(), folds=4, rounds=40, depth=3, min_leaf=2)
    assert len(results) == 8
    summary = ranker.summary(results)
    assert summary["model_top1"] > 0.95 and summary["spearman_median"] > 0.8
    report = ranker.evaluation_report(results, summary, ranker.train(
        _synthetic_groups(), rounds=5, depth=2, min_leaf=2), 4)
    assert "| first |" in report and report.count("\n| cpu |") == 8


def test_ranker_file_refuses_another_feature_set(tmp_path):
    model = ranker.train(_synthetic_groups(), rounds=3, depth=2, min_leaf=2)
    path = model.save(tmp_path / "ranker.json")
    assert ranker.Ranker.load(path).trees.feature.shape == model.trees.feature.shape
    data = json.loads(path.read_text())
    data["features"] = data["features"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="train-ranker"):
        ranker.Ranker.load(path)


@pytest.mark.skipif(not (ROOT / "generator" / "records").is_dir(), reason="not a source checkout")
def test_train_ranker_command_on_the_records(tmp_path):
    """The command reads the committed records and tables, evaluates on held-out layers
    and writes the model and its evaluation."""
    import shutil
    from ttile.cli import main
    data = tmp_path / "data"
    shutil.copytree(ROOT / "generator" / "microkernels", data / "microkernels")
    (data / "records").mkdir()
    shutil.copy(ROOT / "generator" / "records" / "authenticamd-25-17-b17bf99a.jsonl",
                data / "records")
    assert main(["--data-dir", str(data), "train-ranker", "--folds", "3", "--rounds",
                 "10"]) == 0
    model = ranker.Ranker.load(data / "ranker" / "ranker.json")
    assert model.trained_on["cpus"] == ["authenticamd-25-17-b17bf99a"]
    assert model.trained_on["held_out"]["groups"] >= 20
    assert "held-out" in (data / "ranker" / "evaluation.md").read_text()


def test_shipped_ranker_loads_and_scores():
    from ttile.runtime import jit
    model = jit._load_ranker(None)
    assert model is not None, "the wheel ships generator/ranker/ranker.json"
    spec = ConvSpec(1, 32, 16, 12, 12, 3, 3, 1, 1, 1, 1, 1, 1)
    rows = np.stack([ranker.features(spec, f"[T2 k; T{12 // b} h; T12 w; T3 r; T3 s; T16 c; "
                                           f"U{b} h; V k]", 1, Isa.AVX512F, CONTEXT)
                     for b in (1, 6)])
    assert np.all(np.isfinite(model.scores(rows)))


@pytest.mark.skipif(not ttile.has_avx512f(), reason="searches AVX-512F kernels")
def test_offline_search_screens_only_the_rankings_first_picks(tmp_path, capsys):
    pytest.importorskip("islpy")
    import shutil
    from ttile.cli import main
    from ttile.runtime import jit
    from test_generate_command import LAYERS_TOML, _generator_dir
    generator = _generator_dir(tmp_path / "generator")
    (generator / "ranker").mkdir()
    shipped = jit._load_ranker(None)
    shipped.save(generator / "ranker" / "ranker.json")
    layers = tmp_path / "layers.toml"
    layers.write_text(LAYERS_TOML)
    assert main(["--layers-file", str(layers), "--data-dir", str(generator), "--kernels-dir",
                 str(tmp_path / "gen"), "--threads", "1", "--budget", "30",
                 "--rank-measure", "3"]) == 0
    [path] = (generator / "records").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for name in ("small-3x3", "tiny-1x1"):
        screened = [r for r in records if r["layer"] == name and r["protocol"] == "screen"]
        assert 1 <= len(screened) <= 3
