"""Steps 3-5: scheme space, pruning, parallel variants, tuner, records, emission, and
every tuned kernel compiled into the extension checked against float64."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

import ttile
from ttile.microkernels import MicrokernelClass, MicrokernelShape
from ttile.reference import assert_conv_close
from ttile.scheme import Scheme, lower
from ttile.spec import ConvSpec
from conftest import requires_avx512

pytest.importorskip("islpy")
pytest.importorskip("scipy")

from ttile.emit import TunedKernel, emit  # noqa: E402
from ttile.iomodel import CacheLevel  # noqa: E402
from ttile.search import (MODEL_ORDER, REDUCTION_INNERMOST, Candidate,  # noqa: E402
                          SpacePoint, class_fits, completions, microkernel_choices,
                          model_loop_order, parallel_variants, prune,
                          reduction_innermost_orders, scheme_space, scheme_text)
from ttile.tune import (BUILD_ERROR, OK, WRONG, LayerBench, TuneSettings,  # noqa: E402
                        TuningDatabase, tune_layer)

CACHES = (CacheLevel("L1", 48 << 10, 1 / 50e9), CacheLevel("L2", 2 << 20, 1 / 20e9),
          CacheLevel("L3", 32 << 20, 1 / 10e9))
CLASS_8_15 = MicrokernelClass(1, 1, "h", 2, 8, 15, 90.0)


def test_lambda_seq_pairs_cover_uncooperative_sizes_like_the_paper():
    choices = microkernel_choices(34, CLASS_8_15)
    assert ((2, 11), (1, 12)) in choices          # 34 = 2 * 11 + 12
    assert ((1, 8), (1, 9)) in microkernel_choices(17, CLASS_8_15)   # 17 = 8 + 9
    assert all(34 % sum(a * b for a, b in c) == 0 for c in choices)
    assert ((1, 17),) not in choices               # 17 is outside the class


def test_every_completion_is_a_valid_scheme_covering_the_problem():
    spec = ConvSpec(1, 64, 32, 17, 17, 3, 3, 1, 1, 1, 1, 1, 1)
    from ttile.model import rank_permutations
    shape = MicrokernelShape(1, 1, "h", 2, 9)
    permutation = rank_permutations(spec, shape, CACHES, top=1)[0]
    cls = MicrokernelClass(1, 1, "h", 2, 8, 9, 90.0)
    points = completions(spec, cls, model_loop_order(permutation))
    assert points and any(p.lseq_at is not None for p in points)
    for point in points[:: max(1, len(points) // 40)]:
        scheme = Scheme.parse(scheme_text(point, cls))
        lower(scheme, spec)  # raises unless exact


def test_reduction_innermost_orders_keep_r_s_and_all_of_c_above_the_block():
    spec = ConvSpec(1, 256, 128, 28, 28, 3, 3, 1, 1, 1, 1, 1, 1)
    cls = MicrokernelClass(1, 1, "w", 4, 5, 6, 95.0)
    orders = reduction_innermost_orders(spec, cls)
    assert orders and all(o[-3:] == ("r", "s", "c") for o in orders)
    unrolled_s = MicrokernelClass(1, 3, "w", 4, 5, 6, 95.0)
    assert all(o[-2:] == ("r", "c") and "s" not in o
               for o in reduction_innermost_orders(spec, unrolled_s))
    texts = set()
    for order in orders:
        for point in completions(spec, cls, order):
            text = scheme_text(point, cls)
            texts.add(text)
            scheme = Scheme.parse(text)
            lower(scheme, spec)  # raises unless exact
            assert str(scheme).endswith("T3 r; T3 s; T128 c; U beta w; U4 k; V k]")
    # 28 = 2 x 5 + 3 x 6 under a lambda-seq, rows outermost, k panels inside
    assert "[T28 h; T4 k; Lseq w [(2,5),(3,6)]; T3 r; T3 s; T128 c; U beta w; U4 k; V k]" \
        in texts


def test_scheme_space_holds_both_loop_order_families():
    spec = ConvSpec(1, 256, 128, 28, 28, 3, 3, 1, 1, 1, 1, 1, 1)
    cls = MicrokernelClass(1, 1, "w", 4, 5, 6, 95.0)
    space = scheme_space(spec, [cls], CACHES, top=40)
    origins = [c.origin for c in space]
    assert {MODEL_ORDER, REDUCTION_INNERMOST} <= set(origins)
    # interleaved: both families among the first few the tuner measures
    assert {MODEL_ORDER, REDUCTION_INNERMOST} <= set(origins[:2])
    for c in space:
        lower(c.scheme, spec)


def test_a_capped_space_ranks_fewer_completions_and_stays_valid():
    spec = ConvSpec(1, 48, 48, 28, 28, 5, 5, 1, 1, 2, 2, 2, 2)
    wide = MicrokernelClass(1, 5, "w", 1, 4, 18, 100.0)   # 100 000+ lambda-seq completions
    capped = scheme_space(spec, [wide], CACHES, top=50, max_points=500)
    assert capped and len(capped) <= 50
    for c in capped:
        lower(c.scheme, spec)
        assert c.microkernels[0].alpha == 1 and c.microkernels[0].unroll_s == 5


def test_class_fits_needs_k_vectors_divisible_and_matching_unrolls():
    spec = ConvSpec(1, 48, 8, 10, 10, 3, 3)      # 3 vectors along k
    assert class_fits(spec, MicrokernelClass(1, 1, "h", 3, 2, 5, 90))
    assert not class_fits(spec, MicrokernelClass(1, 1, "h", 2, 2, 5, 90))
    assert class_fits(spec, MicrokernelClass(3, 3, "w", 1, 2, 5, 90))
    assert not class_fits(spec, MicrokernelClass(5, 1, "w", 1, 2, 5, 90))


def _candidate(text, reduction, cost):
    return Candidate(Scheme.parse(text), (MicrokernelShape(1, 1, "h", 1, 1),), reduction, cost)


def test_pruning_keeps_largest_reductions_then_least_data_movement():
    cands = [_candidate(f"[T{i + 1} h; T{64 // (1 << (i % 4))} c; V k]", 64 // (1 << (i % 4)),
                        float(10 - i)) for i in range(8)]
    kept = prune(cands, keep_fraction=0.4, top=2)
    assert all(c.reduction_above >= 32 for c in kept)
    assert [c.model_cost for c in kept] == sorted(c.model_cost for c in kept)
    assert len(kept) == 2


def test_pruning_applies_within_each_family_and_interleaves_them():
    model = [_candidate(f"[T{i + 1} h; T8 c; V k]", 8, float(i)) for i in range(5)]
    inner = [Candidate(Scheme.parse(f"[T{i + 1} w; T64 c; V k]"),
                       (MicrokernelShape(1, 1, "h", 1, 1),), 64, 100.0 + i,
                       origin=REDUCTION_INNERMOST) for i in range(5)]
    kept = prune(model + inner, keep_fraction=1.0, top=6)
    # the reduction-innermost family is not crowded out by its larger modelled cost
    # nor does its larger reduction crowd the model's family out
    assert [c.origin for c in kept] == [MODEL_ORDER, REDUCTION_INNERMOST] * 3
    assert [c.model_cost for c in kept] == [0.0, 100.0, 1.0, 101.0, 2.0, 102.0]


def test_three_parallel_strategies_are_expressible_and_valid():
    spec = ConvSpec(1, 64, 32, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1)
    base = _candidate("[T2 k; T3 r; T4 h; T3 s; T8 w; T32 c; U2 h; U2 k; V k]", 32, 1.0)
    variants = {v.strategy: v for v in parallel_variants(base, spec, 2)}
    assert str(variants["parallel outer band"].scheme).startswith("[PT2 k; T3 r")
    assert str(variants["reductions innermost"].scheme).startswith("[PT2 k; PT4 h; PT8 w; T3 r")
    assert str(variants["reductions outermost"].scheme).startswith("[T3 r; T3 s; T32 c; PT2 k")
    for v in variants.values():
        lower(v.scheme, spec)


def test_a_scheme_opening_with_its_lambda_seq_gets_a_parallel_variant():
    spec = ConvSpec(1, 128, 64, 136, 136, 3, 3, 1, 1, 1, 1, 1, 1)
    text = "[Lseq h [(8,13),(2,16)]; T136 w; T8 k; T3 r; T3 s; T64 c; U beta h; U1 k; V k]"
    base = Candidate(Scheme.parse(text), (MicrokernelShape(1, 1, "h", 1, 13),
                                          MicrokernelShape(1, 1, "h", 1, 16)), 64, 1.0)
    variants = parallel_variants(base, spec, 2)
    assert [str(v.scheme) for v in variants] == [
        "[PT136 w; PT8 k; Lseq h [(8,13),(2,16)]; T3 r; T3 s; T64 c; U beta h; U1 k; V k]"]
    lower(variants[0].scheme, spec)
    # nothing to hoist when the loops below the sequence run along its own axis
    along_axis = Candidate(Scheme.parse("[Lseq h [(8,13),(2,16)]; T3 r; T3 s; T64 c; "
                                        "U beta h; U1 k; V k]"), base.microkernels, 64, 1.0)
    assert parallel_variants(along_axis, ConvSpec(1, 16, 64, 136, 1, 3, 3, 1, 1, 1, 1, 1, 1),
                             2) == []


def test_database_resumes_and_skips_measured_schemes(tmp_path):
    from ttile.tune import TuningRecord
    from ttile.codegen import GENERATOR_VERSION
    spec = ConvSpec(1, 16, 4, 6, 6, 1, 1)
    db = TuningDatabase(tmp_path, cpu_id="cpu-x")
    for scheme, seconds in (("[T6 h; T6 w; T4 c; V k]", 2e-5), ("[T6 w; T6 h; T4 c; V k]", 1e-5)):
        db.add(TuningRecord("L", spec.to_json(), scheme, 1, OK, seconds, 1.0, 7, "screen",
                            "sequential", "", "cpu-x", GENERATOR_VERSION, "today"))
    with db.path.open("a") as f:
        f.write('{"cut": ')
    again = TuningDatabase(tmp_path, cpu_id="cpu-x")
    assert again.has(spec, "[T6 h; T6 w; T4 c; V k]", 1, "screen")
    assert not again.has(spec, "[T6 h; T6 w; T4 c; V k]", 2, "screen")
    assert again.best(spec, 1).scheme == "[T6 w; T6 h; T4 c; V k]"
    assert again.layers() == [(spec, "L")]


def test_a_tuned_kernel_ships_only_clearly_faster_than_the_generic_one(tmp_path):
    from ttile.codegen import GENERATOR_VERSION
    from ttile.tune import GENERIC, SHIP_MARGIN, WARM, TuningRecord, _against
    spec = ConvSpec(1, 16, 4, 6, 6, 1, 1)
    db = TuningDatabase(tmp_path, cpu_id="cpu-z")

    def compare(scheme, ratio):
        for text, seconds, detail in ((scheme, ratio * 1e-3, ""),
                                      (GENERIC, 1e-3, _against(scheme))):
            db.add(TuningRecord("L", spec.to_json(), text, 1, OK, seconds, 1.0, 15, WARM,
                                "warm", "", "cpu-z", GENERATOR_VERSION, "today", detail))

    tie, win = "[T6 h; T6 w; T4 c; V k]", "[T6 w; T6 h; T4 c; V k]"
    assert db.warm_verdict(spec, 1, tie) is None          # never compared
    compare(tie, 1.0 - SHIP_MARGIN / 2)                   # faster, but within the noise
    assert db.warm_verdict(spec, 1, tie) is False
    for ratio in (0.9, 1.5, 0.92):                        # the median decides, not one run
        compare(win, ratio)
    assert db.warm_verdict(spec, 1, win) is True


@requires_avx512
def test_tuner_records_failures_as_values(tmp_path, monkeypatch):
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    good = _candidate("[T6 h; T3 r; T3 s; T8 c; U6 w; V k]", 8, 1.0)
    broken = _candidate("[T6 w; T3 r; T3 s; T8 c; U6 h; V k]", 8, 2.0)
    db = TuningDatabase(tmp_path, cpu_id="cpu-y")
    bench = LayerBench.make(spec, copy_bytes=1 << 16)
    settings = TuneSettings(budget_seconds=30, batch_size=1, screen_calls=3, paper_calls=5,
                            paper_drop=1)
    best = tune_layer("tiny", spec, [good], 1, db, bench, settings)
    assert best is not None and best.status == OK and best.protocol == "paper"

    bench.expected = bench.expected + 1.0          # every answer now looks wrong
    tune_layer("tiny", spec, [broken], 1, db, bench, settings)
    assert [r.status for r in db.records if r.scheme == str(broken.scheme)] == [WRONG]

    import ttile.tune as tune_module
    real_generate = tune_module.generate

    def bad_generate(scheme, spec_, command):
        source = real_generate(scheme, spec_, command)
        return type(source)(source.name, source.spec, source.scheme, source.code + "\n#error x\n")

    monkeypatch.setattr(tune_module, "generate", bad_generate)
    third = _candidate("[T3 w; T6 h; T3 r; T3 s; T8 c; U2 w; V k]", 8, 3.0)
    tune_layer("tiny", spec, [third], 1, db, bench, settings)
    assert [r.status for r in db.records if r.scheme == str(third.scheme)] == [BUILD_ERROR]


def test_emission_is_deterministic_and_removes_stale_kernels(tmp_path):
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    kernels = [TunedKernel("tiny", spec, Scheme.parse("[T6 h; T3 r; T3 s; T8 c; U6 w; V k]"),
                           False, 12.5)]
    first = emit(kernels, tmp_path, "ttile-generate test")
    contents = {p.name: p.read_text() for p in first}
    stale = tmp_path / "ttile_f32_conv2d_000000000000__avx512f.c"
    stale.write_text("/* old */")
    second = emit(kernels, tmp_path, "ttile-generate test")
    assert {p.name: p.read_text() for p in second} == contents
    assert not stale.exists()
    registry = (tmp_path / "registry.c").read_text()
    assert '"tiny"' in registry and "ttile_tuned_kernel_count = 1" in registry
    kernel_file = next(p for p in first if p.name != "registry.c")
    assert "scheme:  [T6 h; T3 r; T3 s; T8 c; U6 w; V k]" in kernel_file.read_text()
    assert "command: ttile-generate test" in kernel_file.read_text()


def _registry_cases():
    return [pytest.param(e, id=f"{e['layer']}-{'par' if e['parallel'] else 'seq'}")
            for e in ttile.tuned_kernels()]


@requires_avx512
@pytest.mark.parametrize("entry", _registry_cases())
def test_every_shipped_tuned_kernel_matches_the_reference(entry):
    spec = ConvSpec(**{f: entry[f] for f in ("n", "k", "c", "h", "w", "r", "s", "stride_h",
                                             "stride_w", "pad_top", "pad_bottom", "pad_left",
                                             "pad_right")})
    rng = np.random.default_rng(entry["index"])
    x = rng.uniform(-1, 1, (spec.n, spec.h, spec.w, spec.c)).astype(np.float32)
    w = rng.uniform(-1, 1, (spec.r, spec.s, spec.c, spec.k)).astype(np.float32)
    y = np.full((spec.n, spec.ho, spec.wo, spec.k), np.nan, np.float32)
    from ttile import _kernels
    _kernels.run_tuned(entry["index"], x, _kernels.pack_weights(w, entry["panel"]), y,
                       2 if entry["parallel"] else 1)
    assert_conv_close(y, x, w, (spec.stride_h, spec.stride_w),
                      (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right))
    # and conv2d dispatches to it for the matching call
    threads = 2 if entry["parallel"] else 1
    out = ttile.conv2d(x, w, stride=(spec.stride_h, spec.stride_w),
                       padding=(spec.pad_top, spec.pad_left), layout="NHWC", threads=threads)
    np.testing.assert_array_equal(out, y)
