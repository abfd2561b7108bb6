"""Steps 3-5: scheme space, pruning, parallel variants, tuner, records, emission, and
every tuned kernel compiled into the extension checked against float64."""
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

import ttile
from ttile.generator.microkernels import MicrokernelClass, MicrokernelShape
from ttile.core.reference import assert_conv_close
from ttile.core.scheme import Scheme, lower
from ttile.core.spec import ConvSpec
from conftest import requires_avx512

pytest.importorskip("islpy")
pytest.importorskip("scipy")

from ttile.generator.emit import RegistryEntry, emit  # noqa: E402
from ttile.generator.autotune import TuneSettings, tune_layer  # noqa: E402
from ttile.generator.costmodel import CostModel  # noqa: E402
from ttile.generator.machine import CacheLevel  # noqa: E402
from ttile.generator.search import (Candidate, LoopFamily, SpacePoint,  # noqa: E402
                                    class_fits, completions, microkernel_choices,
                                    model_loop_order, parallel_variants, prune,
                                    reduction_innermost_orders, scheme_space, scheme_text)
from ttile.tuning.bench import LayerBench  # noqa: E402
from ttile.tuning.records import (Contender, Protocol, RecordStatus, Strategy,  # noqa: E402
                                  TuningDatabase, TuningRecord)

MODEL_ORDER, REDUCTION_INNERMOST = LoopFamily.MODEL_ORDER, LoopFamily.REDUCTION_INNERMOST
OK, WRONG, BUILD_ERROR = RecordStatus.OK, RecordStatus.WRONG, RecordStatus.BUILD_ERROR

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
    shape = MicrokernelShape(1, 1, "h", 2, 9)
    permutation = CostModel(spec, CACHES).rank_permutations(shape, top=1)[0]
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


def test_a_space_without_model_orders_solves_no_permutation(monkeypatch):
    """``permutations_per_class=0`` (the quick search) ranks the reduction-innermost
    orders' completions and never runs the model's permutation solve (seconds each)."""
    spec = ConvSpec(1, 256, 128, 28, 28, 3, 3, 1, 1, 1, 1, 1, 1)
    cls = MicrokernelClass(1, 1, "w", 4, 5, 6, 95.0)

    def no_solve(*args, **kwargs):
        raise AssertionError("a permutation was solved")

    monkeypatch.setattr(CostModel, "rank_permutations", no_solve)
    space = scheme_space(spec, [cls], CACHES, top=40, permutations_per_class=0)
    assert space and {c.origin for c in space} == {REDUCTION_INNERMOST}
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
    assert str(variants[Strategy.PARALLEL_OUTER_BAND].scheme).startswith("[PT2 k; T3 r")
    assert str(variants[Strategy.REDUCTIONS_INNERMOST].scheme).startswith(
        "[PT2 k; PT4 h; PT8 w; T3 r")
    assert str(variants[Strategy.REDUCTIONS_OUTERMOST].scheme).startswith(
        "[T3 r; T3 s; T32 c; PT2 k")
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


def _record(spec, scheme, seconds, protocol=Protocol.SCREEN, threads=1, cpu="cpu-x",
            **extra):
    from ttile.core.codegen import GENERATOR_VERSION
    generic = scheme == ""
    fields = dict(layer="L", spec=spec, threads=threads, status=OK, seconds=seconds,
                  gflops=1.0, calls=7, protocol=protocol,
                  contender=Contender.GENERIC if generic else Contender.SCHEME,
                  scheme=scheme, strategy=None if generic else Strategy.SEQUENTIAL,
                  microkernels="", cpu=cpu, generator_version=GENERATOR_VERSION,
                  measured_on="today")
    fields.update(extra)
    return TuningRecord(**fields)


def test_database_resumes_and_skips_measured_schemes(tmp_path):
    spec = ConvSpec(1, 16, 4, 6, 6, 1, 1)
    db = TuningDatabase(tmp_path, cpu_id="cpu-x")
    for scheme, seconds in (("[T6 h; T6 w; T4 c; V k]", 2e-5), ("[T6 w; T6 h; T4 c; V k]", 1e-5)):
        db.add(_record(spec, scheme, seconds))
    with db.path.open("a") as f:
        f.write('{"cut": ')                       # an append cut by an interruption
    with pytest.warns(RuntimeWarning, match=r"cpu-x.jsonl:3: dropped an incomplete"):
        again = TuningDatabase(tmp_path, cpu_id="cpu-x")
    assert again.has(spec, "[T6 h; T6 w; T4 c; V k]", 1, Protocol.SCREEN)
    assert not again.has(spec, "[T6 h; T6 w; T4 c; V k]", 2, Protocol.SCREEN)
    assert again.best(spec, 1).scheme == "[T6 w; T6 h; T4 c; V k]"
    assert again.layers() == [(spec, "L")]


def test_a_record_that_cannot_be_read_is_an_error_naming_file_and_line(tmp_path):
    from ttile.tuning.records import RecordError
    spec = ConvSpec(1, 16, 4, 6, 6, 1, 1)
    db = TuningDatabase(tmp_path, cpu_id="cpu-e")
    db.add(_record(spec, "[T6 h; T6 w; T4 c; V k]", 1e-5, cpu="cpu-e"))
    good = db.path.read_text()
    renamed = good.replace('"seconds"', '"time_s"')       # a renamed field
    db.path.write_text(good + renamed)
    with pytest.raises(RecordError, match=r"cpu-e.jsonl:2: .*unknown field\(s\) time_s"):
        TuningDatabase(tmp_path, cpu_id="cpu-e")
    db.path.write_text(good.replace('"ok"', '"fine"'))    # a value no enum has
    with pytest.raises(RecordError, match=r"cpu-e.jsonl:1: .*'fine'"):
        TuningDatabase(tmp_path, cpu_id="cpu-e")
    db.path.write_text('not json\n' + good)              # garbage that is not a cut append
    with pytest.raises(RecordError, match=r"cpu-e.jsonl:1: not a JSON record"):
        TuningDatabase(tmp_path, cpu_id="cpu-e")


def test_format_1_records_are_migrated_with_their_warm_pairs(tmp_path):
    from ttile.tuning.records import GENERIC_REVISION
    spec = ConvSpec(1, 16, 4, 6, 6, 1, 1)
    scheme = "[T6 h; T6 w; T4 c; V k]"
    common = {"calls": 15, "cpu": "cpu-m", "generator_version": 3, "gflops": 1.0,
              "layer": "L", "measured_on": "2026-11-22", "microkernels": "",
              "spec": spec.to_json(), "status": "ok", "threads": 1}
    v1 = [dict(common, protocol="screen", scheme=scheme, seconds=2e-3, strategy="sequential",
               detail=""),
          dict(common, protocol="paper", scheme="generic", seconds=1e-3, strategy="generic",
               detail=""),
          dict(common, protocol="warm", scheme=scheme, seconds=0.9e-3, strategy="warm",
               detail=""),
          dict(common, protocol="warm", scheme="generic", seconds=1e-3, strategy="warm",
               detail=f"against {scheme} (generic r{GENERIC_REVISION})")]
    path = tmp_path / "cpu-m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in v1))
    db = TuningDatabase(tmp_path, cpu_id="cpu-m")
    generic = [r for r in db.records if r.contender is Contender.GENERIC]
    assert [(r.protocol, r.scheme) for r in generic] == [(Protocol.PAPER, ""), (Protocol.WARM, "")]
    warm = [r for r in db.records if r.protocol is Protocol.WARM]
    assert warm[0].comparison == warm[1].comparison == "v1-3"
    assert warm[0].strategy is Strategy.SEQUENTIAL
    assert warm[1].generic_revision == GENERIC_REVISION
    assert db.warm_ratios(spec, 1, scheme) == [pytest.approx(0.9)]
    db.rewrite()                                           # records migrate
    assert all(json.loads(line)["format"] == 2 for line in path.read_text().splitlines())
    assert TuningDatabase(tmp_path, cpu_id="cpu-m").records == db.records


def test_a_tuned_kernel_ships_only_clearly_faster_than_the_generic_one(tmp_path):
    from ttile.tuning.policy import ShipPolicy
    from ttile.tuning.records import GENERIC_REVISION, new_comparison_id
    spec = ConvSpec(1, 16, 4, 6, 6, 1, 1)
    db = TuningDatabase(tmp_path, cpu_id="cpu-z")

    def compare(scheme, ratio, revision=GENERIC_REVISION):
        pair = new_comparison_id()
        db.add(_record(spec, scheme, ratio * 1e-3, Protocol.WARM, cpu="cpu-z", comparison=pair))
        db.add(_record(spec, "", 1e-3, Protocol.WARM, cpu="cpu-z", comparison=pair,
                       generic_revision=revision))

    tie, win = "[T6 h; T6 w; T4 c; V k]", "[T6 w; T6 h; T4 c; V k]"
    best_tie = _record(spec, tie, 1e-3)
    assert not db.ships(spec, 1, best_tie)                # never compared, no generic timing
    compare(tie, 0.985)                                   # faster, but within the noise
    assert db.warm_ratios(spec, 1, tie) == [pytest.approx(0.985)]
    assert not db.ships(spec, 1, best_tie)
    for ratio in (0.9, 1.5, 0.92):                        # the median decides, not one run
        compare(win, ratio)
    assert db.ships(spec, 1, _record(spec, win, 1e-3))
    compare(tie, 0.5, revision=GENERIC_REVISION - 1)      # against an older generic kernel
    assert db.warm_ratios(spec, 1, tie) == [pytest.approx(0.985)]
    # the cold path asks for the same margin, and a generic timing to compare with
    spec2 = ConvSpec(1, 16, 4, 7, 7, 1, 1)
    assert not db.ships(spec2, 1, _record(spec2, tie, 0.99e-3))
    db.add(_record(spec2, "", 1e-3, Protocol.PAPER))
    assert not db.ships(spec2, 1, _record(spec2, tie, 0.99e-3, Protocol.PAPER))
    assert db.ships(spec2, 1, _record(spec2, tie, 0.9e-3, Protocol.PAPER))
    # one policy value decides everywhere, and it is a parameter, not a module global
    lenient = TuningDatabase(tmp_path, cpu_id="cpu-z", ship=ShipPolicy(max_time_ratio=1.0))
    assert lenient.ships(spec, 1, best_tie)
    assert not ShipPolicy().ships([]) and ShipPolicy().ships([0.96])
    assert not ShipPolicy().ships([0.97]) and ShipPolicy(2.0).beats(1.5, 1.0)


@requires_avx512
def test_a_kernel_whose_nchw_entry_point_is_wrong_is_wrong():
    """The search's check runs both entry points: a kernel right in NHWC and wrong in
    NCHW is never timed or shipped."""
    from ttile.core.cbuild import build
    from ttile.core.codegen import generate
    from ttile.tuning.bench import run_and_check
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    kernel = generate(Scheme.parse("[T6 h; T3 r; T3 s; T8 c; U6 w; V k]"), spec)
    assert kernel.nchw_name is not None
    bench = LayerBench.make(spec, copy_bytes=1 << 16)
    assert run_and_check(build([kernel]), kernel, bench, 1) is None
    store = "bo_k, 16, 6, 6, ep, 0);"
    assert kernel.code.count(store) == 1
    broken = dataclasses.replace(kernel, code=kernel.code.replace(store, store + " y[7] = 0.5f;"))
    problem = run_and_check(build([broken]), broken, bench, 1)
    assert problem is not None and "NCHW entry point" in problem


@requires_avx512
def test_tuner_compiles_each_candidate_once_on_every_compiler(tmp_path, monkeypatch):
    """The screened candidates are compiled in as many batches as there are compilers,
    and the finalists re-timed with the paper's protocol run in the libraries they were
    screened in: no candidate is compiled twice."""
    import ttile.tuning.bench as bench_module
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    candidates = [_candidate(text, 8, float(i)) for i, text in enumerate(
        ("[T6 h; T3 r; T3 s; T8 c; U6 w; V k]", "[T3 w; T6 h; T3 r; T3 s; T8 c; U2 w; V k]",
         "[T6 w; T3 r; T3 s; T8 c; U6 h; V k]"))]
    batches = []
    real_build = bench_module.build_batches

    def counting_build(sources, **kwargs):
        batches.extend([k.name for k in batch] for batch in sources)
        return real_build(sources, **kwargs)

    monkeypatch.setattr(bench_module, "build_batches", counting_build)
    db = TuningDatabase(tmp_path, cpu_id="cpu-z")
    bench = LayerBench.make(spec, copy_bytes=1 << 16)
    settings = TuneSettings(budget_seconds=30, batch_size=6, jobs=2, screen_calls=3,
                            paper_calls=5, paper_drop=1, refine_top=2)
    best = tune_layer("tiny", spec, candidates, 1, db, bench, settings)
    assert best is not None and best.protocol is Protocol.PAPER
    assert len(batches) == 2 and sorted(map(len, batches)) == [1, 2]
    names = [name for batch in batches for name in batch]
    assert len(names) == len(set(names)) == 3
    assert len([r for r in db.records if r.protocol is Protocol.PAPER]) == 2


@requires_avx512
def test_tuner_budget_is_wall_time_with_compiles_and_checks(tmp_path, monkeypatch):
    """--budget is a bound on a layer's wall time: with the budget spent, the tuner
    compiles one candidate (a layer ends with a result) and re-times only it, and the
    clock says where the time went; with time for about two compiles it compiles no more
    than that at once, not a batch of twelve."""
    import ttile.tuning.bench as bench_module
    from ttile.generator.autotune import LayerClock, Phase
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    texts = ("[T6 h; T3 r; T3 s; T8 c; U6 w; V k]", "[T3 w; T6 h; T3 r; T3 s; T8 c; U2 w; V k]",
             "[T6 w; T3 r; T3 s; T8 c; U6 h; V k]", "[T2 w; T6 h; T3 r; T3 s; T8 c; U3 w; V k]")
    candidates = [_candidate(text, 8, float(i)) for i, text in enumerate(texts)]
    groups = []
    real_build = bench_module.build_batches

    def counting_build(sources, **kwargs):
        groups.append(sum(map(len, sources)))
        return real_build(sources, **kwargs)

    monkeypatch.setattr(bench_module, "build_batches", counting_build)
    settings = TuneSettings(budget_seconds=1000, batch_size=6, jobs=2, screen_calls=3,
                            paper_calls=5, paper_drop=1, refine_top=2)
    bench = LayerBench.make(spec, copy_bytes=1 << 16)

    spent = LayerClock(0.0)
    db = TuningDatabase(tmp_path / "spent", cpu_id="cpu-b")
    best = tune_layer("tiny", spec, candidates, 1, db, bench, settings, clock=spent)
    assert groups == [1]
    assert best is not None and best.protocol is Protocol.PAPER
    assert [r.protocol for r in db.records] == [Protocol.SCREEN, Protocol.PAPER]
    # with no time left each timing makes its fewest calls, and the records say so
    assert [r.calls for r in db.records] == [3, 3]
    assert spent.first_seconds is not None and spent.first_seconds > 0
    assert spent.counts[Phase.BUILD] == 1 and spent.counts[Phase.CHECK] == 1
    assert spent.counts[Phase.REFINE] == 1 and spent.seconds[Phase.BUILD] > 0
    assert "of a 0 s budget" in spent.summary() and "1 built" in spent.summary()

    groups.clear()
    two = LayerClock(60.0)
    two.build_rate = 60.0   # a compile per compiler takes the whole budget: two at once
    roomy = TuningDatabase(tmp_path / "two", cpu_id="cpu-b")
    tune_layer("tiny", spec, candidates, 1, roomy, bench, settings, clock=two)
    assert groups and groups[0] <= 2
    # with time to spare, every timing makes its full count
    assert {(r.protocol, r.calls) for r in roomy.records} == {(Protocol.SCREEN, 3),
                                                             (Protocol.PAPER, 5)}


def test_a_timing_makes_as_many_calls_as_its_time_holds():
    """A limit of s seconds holds s / (first call's seconds) calls, never more than asked
    and never fewer than a quarter of them (three at least); the middle median drops the
    fastest and slowest in proportion."""
    from ttile.tuning.bench import calls_within, middle_median
    assert calls_within(0.2, None, 20) == 20
    assert calls_within(0.2, 100.0, 20) == 20
    assert calls_within(0.2, 2.0, 20) == 10
    assert calls_within(0.2, 0.0, 20) == 5
    assert calls_within(0.2, 0.0, 7) == 3
    assert calls_within(0.2, 0.0, 2) == 2
    assert middle_median([9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0] * 2, 5, 20) \
        == 5.5
    # 5 of 20 dropped is 1 of 5: the outliers go
    assert middle_median([100.0, 1.0, 2.0, 3.0, 0.0], 5, 20) == 2.0
    assert middle_median([3.0, 1.0], 5, 20) == 2.0


@requires_avx512
def test_the_generic_timing_fits_its_share_of_the_budget():
    """The generic kernel's reference timing makes the paper's twenty calls when
    unbounded and its fewest (five) when given no time; its record says how many."""
    from ttile.core.kinds import Isa
    from ttile.generator.autotune import generic_record
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    bench = LayerBench.make(spec, copy_bytes=1 << 16)
    full = generic_record("tiny", spec, 1, bench, "cpu-g", Isa.AVX512F)
    short = generic_record("tiny", spec, 1, bench, "cpu-g", Isa.AVX512F, seconds=0.0)
    assert (full.calls, short.calls) == (20, 5)
    assert full.status is OK and short.status is OK and short.seconds > 0


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
    assert best is not None and best.status is OK and best.protocol is Protocol.PAPER

    bench.expected = bench.expected + 1.0          # every answer now looks wrong
    tune_layer("tiny", spec, [broken], 1, db, bench, settings)
    assert [r.status for r in db.records if r.scheme == str(broken.scheme)] == [WRONG]

    import ttile.tuning.bench as bench_module
    real_generate = bench_module.generate

    def bad_generate(scheme, spec_, command, isa, weight_prefetch=False):
        source = real_generate(scheme, spec_, command, isa, weight_prefetch)
        return dataclasses.replace(source, code=source.code + "\n#error x\n")

    monkeypatch.setattr(bench_module, "generate", bad_generate)
    third = _candidate("[T3 w; T6 h; T3 r; T3 s; T8 c; U2 w; V k]", 8, 3.0)
    tune_layer("tiny", spec, [third], 1, db, bench, settings)
    assert [r.status for r in db.records if r.scheme == str(third.scheme)] == [BUILD_ERROR]


def test_emission_is_deterministic_and_removes_stale_kernels(tmp_path):
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    scheme = Scheme.parse("[T6 h; T3 r; T3 s; T8 c; U6 w; V k]")
    entries = [RegistryEntry(layer="tiny", spec=spec, cpu="cpu-a", threads=1, scheme=scheme,
                             gflops=12.5),
               # a second CPU that chose the same scheme shares the kernel's source
               RegistryEntry(layer="tiny", spec=spec, cpu="cpu-b", threads=1, scheme=scheme,
                             gflops=13.0),
               RegistryEntry(layer="tiny", spec=spec, cpu="cpu-b", threads=2, scheme=None,
                             gflops=20.0)]
    first = emit(entries, tmp_path, "ttile-generate test")
    contents = {p.name: p.read_text() for p in first}
    stale = tmp_path / "ttile_f32_conv2d_000000000000__avx512f.c"
    stale.write_text("/* old */")
    second = emit(entries, tmp_path, "ttile-generate test")
    assert {p.name: p.read_text() for p in second} == contents
    assert not stale.exists()
    assert len(list(tmp_path.glob("ttile_f32_conv2d_*.c"))) == 1
    registry = (tmp_path / "registry.c").read_text()
    assert registry.count('"tiny"') == 3 and "ttile_tuned_kernel_count = 3" in registry
    assert '{"cpu-b", 2, 1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, TTILE_ISA_AVX512F, 0, NULL,' in registry
    kernel_file = next(p for p in first if p.name != "registry.c")
    assert "scheme:  [T6 h; T3 r; T3 s; T8 c; U6 w; V k]" in kernel_file.read_text()
    assert "command: ttile-generate test" in kernel_file.read_text()


def test_registry_entries_are_the_records_verdicts(tmp_path):
    from ttile.generator.emit import registry_entries
    from ttile.tuning.records import new_comparison_id
    spec = ConvSpec(1, 16, 64, 64, 64, 1, 1)   # 8.4 MFLOP: calls use two threads
    win, lose = "[T64 w; T64 h; T64 c; V k]", "[T64 h; T64 w; T64 c; V k]"
    db = TuningDatabase(tmp_path, cpu_id="cpu-v")
    for threads, scheme, ratio in ((1, win, 0.8), (2, lose, 0.99)):
        pair = new_comparison_id()
        db.add(_record(spec, scheme, ratio * 1e-3, Protocol.PAPER, threads, cpu="cpu-v"))
        db.add(_record(spec, "", 1e-3, Protocol.PAPER, threads, cpu="cpu-v"))
        db.add(_record(spec, scheme, ratio * 1e-3, Protocol.WARM, threads, cpu="cpu-v",
                       comparison=pair))
        db.add(_record(spec, "", 1e-3, Protocol.WARM, threads, cpu="cpu-v", comparison=pair,
                       generic_revision=5))
    verdicts = {e.threads: e for e in registry_entries([db])}
    assert str(verdicts[1].scheme) == win and verdicts[1].cpu == "cpu-v"
    assert verdicts[2].scheme is None                 # the generic kernel won at 2 threads


@requires_avx512
def test_warm_comparison_records_both_sides_under_one_id(tmp_path):
    from ttile.generator.autotune import compare_warm
    from ttile.tuning.records import GENERIC_REVISION
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    db = TuningDatabase(tmp_path, cpu_id="cpu-w")
    best = _record(spec, "[T6 h; T3 r; T3 s; T8 c; U6 w; V k]", 1e-5, Protocol.PAPER,
                   cpu="cpu-w")
    searched, generic = compare_warm("tiny", spec, 1, best, db, rounds=3)
    assert searched.comparison == generic.comparison != ""
    assert searched.status is OK and searched.scheme == best.scheme and searched.seconds > 0
    assert generic.contender is Contender.GENERIC and generic.generic_revision == GENERIC_REVISION
    assert TuningDatabase(tmp_path, cpu_id="cpu-w").warm_ratios(spec, 1, best.scheme) == [
        pytest.approx(searched.seconds / generic.seconds)]
