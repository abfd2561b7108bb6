"""Step 1: microkernel enumeration, measurement, selection, the saved table, no spills."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from ttile.core.cbuild import assembly, find_compiler
from ttile.core.codegen import generate
from ttile.core.cpuinfo import fingerprint
from ttile.generator.microkernels import (Measurement, MicrokernelShape, MicrokernelTable, TimingProtocol,
                                enumerate_shapes, explore, load_table, select_classes)
from ttile.core.scheme import lower
from ttile.tuning.records import RecordStatus
from conftest import requires_avx512

REPO = Path(__file__).resolve().parents[1]
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler on PATH")


def test_enumeration_covers_every_block_that_fits_32_registers():
    shapes = enumerate_shapes()
    families = {s.family for s in shapes}
    assert families == {(1, 1)} | {f for n in (3, 5, 7) for f in ((1, n), (n, 1), (n, n))}
    per_family_axis = [s for s in shapes if s.family == (3, 3) and s.axis == "h"]
    assert len(per_family_axis) == 82
    assert all(s.registers <= 32 for s in shapes)
    assert MicrokernelShape(1, 1, "h", 2, 14) in shapes      # 28 + 2 + 1 = 31
    assert MicrokernelShape(1, 1, "h", 15, 1) in shapes      # 15 + 15 + 1 = 31
    assert MicrokernelShape(1, 1, "h", 2, 15) not in shapes  # 30 + 2 + 1 = 33
    assert MicrokernelShape(1, 1, "h", 16, 1) not in shapes  # 16 + 16 + 1 = 33


@pytest.mark.parametrize("shape", [MicrokernelShape(1, 1, "h", 2, 14),
                                   MicrokernelShape(3, 3, "w", 4, 6),
                                   MicrokernelShape(7, 1, "h", 1, 30)], ids=lambda s: s.key)
def test_microkernel_scheme_is_the_papers_and_covers_its_problem(shape):
    scheme = shape.scheme()
    text = str(scheme)
    assert text.startswith("[T512 c; ") and text.endswith(f"U{shape.alpha} k; V k]")
    assert f"U{shape.beta} {shape.axis}" in text
    lower(scheme, shape.spec())  # raises unless covered exactly
    assert shape.spec().ho * shape.spec().wo == shape.beta


def _m(family, axis, alpha, beta, gflops):
    return Measurement(MicrokernelShape(*family, axis, alpha, beta), RecordStatus.OK, gflops=gflops,
                       percent_of_peak=gflops)


def test_selection_keeps_better_axis_and_groups_beta_intervals():
    ms = [_m((1, 1), "h", 2, b, g) for b, g in [(6, 70), (7, 90), (8, 96), (9, 100), (10, 95),
                                                 (11, 80), (12, 88)]]
    ms += [_m((1, 1), "w", 2, 11, 90)]            # w beats h at beta = 11
    ms += [_m((1, 1), "h", 1, b, 86) for b in (3, 4)]
    ms += [_m((3, 3), "h", 1, 5, 40), _m((3, 3), "h", 1, 6, 36), _m((3, 3), "h", 1, 7, 30)]
    ms += [Measurement(MicrokernelShape(1, 1, "h", 3, 3), RecordStatus.WRONG, detail="x")]
    classes = select_classes(ms, threshold=0.85)
    got = {(c.unroll_r, c.unroll_s, c.axis, c.alpha, c.beta_min, c.beta_max) for c in classes}
    assert got == {(1, 1, "h", 2, 7, 10), (1, 1, "w", 2, 11, 11), (1, 1, "h", 2, 12, 12),
                   (1, 1, "h", 1, 3, 4), (3, 3, "h", 1, 5, 6)}
    assert "8 <= beta <= 10" not in "".join(c.describe() for c in classes)


@requires_avx512
@needs_compiler
def test_explore_measures_checks_saves_and_resumes(tmp_path):
    shapes = [MicrokernelShape(1, 1, "h", 2, b) for b in (4, 5, 6)]
    fast = TimingProtocol(sample_seconds=0.0005, samples=3, max_rounds=1)
    first = explore(tmp_path, shapes=shapes[:2], reduction=64, protocol=fast)
    assert all(m.status is RecordStatus.OK and m.gflops > 0 for m in first.measurements)
    saved = json.loads((tmp_path / "microkernels" / f"{fingerprint().id}.json").read_text())
    assert MicrokernelTable.from_json(saved) == first
    assert load_table(tmp_path) == first

    # An interrupted run leaves its partial log; the next run measures only the rest.
    partial = tmp_path / "microkernels" / f"{fingerprint().id}.partial.jsonl"
    partial.write_text("\n".join(json.dumps(m.to_json()) for m in first.measurements)
                       + "\n{\"cut\": ")
    seen = []
    second = explore(tmp_path, shapes=shapes, reduction=64, protocol=fast,
                     progress=lambda done, total, what: seen.append(done))
    assert seen[0] == 2 and seen[-1] == 3
    # Not measured again: the same samples (the first beta has no lower neighbour, so the
    # second look at suspicious kernels cannot replace it either).
    assert second.measurements[0].samples_s == first.measurements[0].samples_s
    assert not partial.exists()


def test_load_table_without_one_says_how_to_make_it(tmp_path):
    import dataclasses
    unknown = dataclasses.replace(fingerprint(), model="no-such-model")  # no table anywhere
    with pytest.raises(FileNotFoundError, match="ttile-generate microkernels"):
        load_table(tmp_path, cpu=unknown)


_ZMM_STACK_STORE = re.compile(r"vmov\w*\s+%zmm\d+,\s*-?\d*\(%r[sb]p\)")


def test_spill_pattern_recognizes_a_stack_store():
    assert _ZMM_STACK_STORE.search("\tvmovups\t%zmm3, 128(%rsp)")
    assert _ZMM_STACK_STORE.search("\tvmovaps\t%zmm17, -192(%rbp)")
    assert not _ZMM_STACK_STORE.search("\tvmovups\t%zmm3, (%rax,%rdx,4)")


def _largest_blocks():
    """Per family, the shapes with the most live registers (the ones that could spill)."""
    chosen = {}
    for shape in enumerate_shapes((1, 3)):
        best = chosen.get((shape.family, shape.axis))
        if best is None or (shape.registers, shape.beta) > (best.registers, best.beta):
            chosen[(shape.family, shape.axis)] = shape
    return sorted(chosen.values())


@needs_compiler
@pytest.mark.parametrize("shape", _largest_blocks() + [MicrokernelShape(7, 7, "h", 4, 6)],
                         ids=lambda s: s.key)
def test_microkernel_inner_loop_never_spills_vector_registers(shape):
    asm = assembly(generate(shape.scheme(), shape.spec()))
    spills = _ZMM_STACK_STORE.findall(asm)
    assert not spills, f"{shape.key} stores vector registers to the stack: {spills[:4]}"


COMMITTED_TABLES = sorted(p for p in (REPO / "generator" / "microkernels").glob("*.json")
                          if not p.name.endswith(".partial.json"))


@pytest.mark.parametrize("path", COMMITTED_TABLES, ids=lambda p: p.stem)
def test_every_committed_table_is_consistent(path):
    """Each CPU's committed table (not only this CPU's: a table is data, consistent or not
    wherever it is read)."""
    table = MicrokernelTable.from_json(json.loads(path.read_text()))
    assert path.stem.split(".")[0] == table.cpu.id
    assert table.classes, "a table without selected microkernels"
    ok = [m for m in table.measurements if m.status is RecordStatus.OK]
    assert len(ok) == len(table.measurements), "some microkernels failed to build or check"
    assert select_classes(table.measurements, table.threshold) == list(table.classes)
    best = table.best_per_family()
    for c in table.classes:
        for shape in c.shapes():
            m = next(m for m in table.measurements if m.shape == shape)
            assert m.gflops >= table.threshold * best[shape.family].gflops


def test_plot_draws_a_png(tmp_path):
    # matplotlib is in the test extra: a missing one fails here rather than skipping
    from ttile.generator.plot import plot_microkernels
    ms = tuple(_m((1, 1), "h", a, b, 50 + a + b) for a in (1, 2) for b in range(1, 10))
    table = MicrokernelTable(cpu=fingerprint(), peak_gflops=100.0, threshold=0.85,
                             reduction=512, compiler="cc", cflags=(), measured_on="today",
                             measurements=ms, classes=tuple(select_classes(ms)))
    path = plot_microkernels(table, tmp_path / "fig7.png")
    from matplotlib.image import imread
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 200
    # a heatmap, not a blank canvas: many distinct colours
    assert len(np.unique(pixels.reshape(-1, pixels.shape[2]).round(2), axis=0)) > 20


def test_cli_parses_the_microkernels_command():
    from pathlib import Path
    from ttile.cli import _cmd_microkernels, build_parser
    args = build_parser().parse_args(["--data-dir", "elsewhere", "microkernels", "--plot",
                                      "fig.png", "--threshold", "0.9", "--kernel-sizes", "3"])
    assert not args.quick
    assert build_parser().parse_args(["microkernels", "--quick"]).quick
    assert args.run is _cmd_microkernels and args.plot == Path("fig.png")
    assert args.threshold == 0.9 and args.kernel_sizes == [3]
    assert args.data_dir == Path("elsewhere")
    legacy = build_parser().parse_args(["--generator-dir", "old", "microkernels"])
    assert legacy.data_dir == Path("old")       # the flag's former name still works


@pytest.mark.parametrize("isa", ["avx512f", "avx2"])
def test_a_quick_table_covers_every_built_in_layer(isa):
    """Every dense layer of the built-in networks has a candidate from the shapes step 1's
    quick mode measures (taken as all selected, as the search's last fallback does): the
    quick search on a new CPU once found none for ResNet-18's 7x7 layers."""
    from ttile.core.kinds import Isa
    from ttile.core.vectors import vector_isa
    from ttile.generator import networks
    from ttile.generator.microkernels import MicrokernelClass, quick_shapes
    from ttile.generator.search import class_fits, microkernel_choices
    family = Isa(isa)
    shapes = quick_shapes(family, cpu_id="someone-1-1-00000000")
    if not shapes:
        pytest.skip(f"no {isa} table shipped to take the quick shapes from")
    classes = [MicrokernelClass(s.unroll_r, s.unroll_s, s.axis, s.alpha, s.beta, s.beta,
                                100.0) for s in shapes]
    lanes = vector_isa(family).lanes
    for name in ("resnet18", "yolo9000", "mobilenet_v2"):
        for layer in networks.NETWORKS[name]:
            if layer.groups > 1:
                continue
            spec = layer.spec()
            covered = any(microkernel_choices(spec.ho if c.axis == "h" else spec.wo, c)
                          for c in classes if class_fits(spec, c, lanes))
            # or a pair of one block's betas (the search's lambda-seq)
            betas = {}
            for c in classes:
                if class_fits(spec, c, lanes):
                    betas.setdefault((c.unroll_r, c.unroll_s, c.axis, c.alpha), set()).add(c.beta_min)
            for (_, _, axis, _), found in betas.items():
                extent = spec.ho if axis == "h" else spec.wo
                covered = covered or any(
                    extent % (m * b1 + n * b2) == 0
                    for b1 in found for b2 in found if b1 < b2
                    for m in range(1, extent // b1 + 1)
                    for n in range(1, (extent - m * b1) // b2 + 1))
            assert covered, f"{layer.name}: no quick-mode microkernel covers it"


def test_quick_shapes_are_what_other_cpus_selected(tmp_path):
    """Step 1's quick mode measures the union of the classes other CPUs' tables of the
    family selected, with their blocks' smaller betas: a fraction of every shape, never
    this CPU's own table's, never a quick table's (a subset of the tables it came
    from)."""
    from ttile.core.kinds import Isa
    from ttile.generator.microkernels import quick_shapes
    every = set(enumerate_shapes())
    stranger = quick_shapes(Isa.AVX512F, tmp_path, cpu_id="someone-1-1-00000000")
    assert stranger and set(stranger) <= every
    assert 50 <= len(stranger) <= len(every) // 2
    tables = [MicrokernelTable.from_json(json.loads(p.read_text()))
              for p in sorted((REPO / "generator" / "microkernels").glob("*.json"))]
    avx512 = [t for t in tables if t.isa is Isa.AVX512F]
    def completed(selected):
        lowest = {}
        for s in selected:
            key = (s.unroll_r, s.unroll_s, s.axis, s.alpha)
            lowest[key] = min(lowest.get(key, s.beta), s.beta)
        return selected | {MicrokernelShape(*key, beta) for key, low in lowest.items()
                           for beta in range(2, low)}

    union = {s for t in avx512 for c in t.classes for s in c.shapes()}
    assert set(stranger) == completed(union) and union < set(stranger)
    own = avx512[0].cpu.id
    without_own = completed({s for t in avx512 if t.cpu.id != own
                             for c in t.classes for s in c.shapes()})
    assert set(quick_shapes(Isa.AVX512F, tmp_path, cpu_id=own)) == without_own
    # a quick table in the data directory adds nothing
    quick_table = MicrokernelTable(**{**avx512[0].__dict__, "quick": True,
                                      "cpu": type(avx512[0].cpu)(**{**avx512[0].cpu.__dict__,
                                                                    "model": "4242"})})
    quick_table.save(tmp_path / "microkernels")
    assert MicrokernelTable.from_json(quick_table.to_json()).quick
    assert set(quick_shapes(Isa.AVX512F, tmp_path, cpu_id=own)) == without_own


def test_network_search_without_a_table_runs_the_quick_step_1(tmp_path, monkeypatch):
    """``ttile-generate --network`` on a CPU with no table measures one itself (quick)
    instead of stopping; with a table it measures nothing."""
    from ttile import cli
    from ttile.core.kinds import Isa
    from ttile.generator import microkernels
    calls = []

    def missing(*args, **kwargs):
        raise FileNotFoundError("no table")

    def fake_explore(data_dir, **kwargs):
        calls.append(kwargs)
        return MicrokernelTable.from_json(json.loads(sorted(
            (REPO / "generator" / "microkernels").glob("*.json"))[0].read_text()))

    monkeypatch.setattr(microkernels, "load_table", missing)
    monkeypatch.setattr(microkernels, "explore", fake_explore)
    args = cli.build_parser().parse_args(["--data-dir", str(tmp_path), "--network",
                                          "resnet18"])
    got = cli._table_or_quick_step1(args, Isa.AVX512F)
    assert calls and calls[0]["quick"] is True and calls[0]["isa"] is Isa.AVX512F
    assert got.classes
    calls.clear()
    monkeypatch.setattr(microkernels, "load_table", lambda *a, **k: got)
    assert cli._table_or_quick_step1(args, Isa.AVX512F) is got and not calls


def test_step_1_for_a_network_keeps_the_shapes_its_layers_can_use():
    """A network's quick step 1 measures the shapes some layer of it can use: ResNet-18
    (1x1, 3x3, 7x7; 64-512 channels) never a 5-wide unroll or 3 vectors of k, and every
    shape it keeps fits one of its layers as the search's class test has it."""
    from ttile.core.kinds import Isa
    from ttile.core.vectors import vector_isa
    from ttile.generator import networks
    from ttile.generator.microkernels import MicrokernelClass, quick_shapes, shapes_for
    from ttile.generator.search import class_fits
    lanes = vector_isa(Isa.AVX512F).lanes
    every = quick_shapes(Isa.AVX512F, cpu_id="someone-1-1-00000000") or enumerate_shapes()
    specs = [layer.spec() for layer in networks.NETWORKS["resnet18"]]
    kept = shapes_for(every, specs, lanes)
    assert 0 < len(kept) < len(every)
    assert not any(5 in (s.unroll_r, s.unroll_s) or s.alpha in (3, 5, 6) for s in kept)
    as_class = lambda s: MicrokernelClass(s.unroll_r, s.unroll_s, s.axis, s.alpha, s.beta,
                                          s.beta, 100.0)
    for s in every:
        fits = any(class_fits(spec, as_class(s), lanes) for spec in specs)
        assert (s in kept) == fits, s
    assert kept == [s for s in every if s in set(kept)]   # the order is kept


def test_a_quick_table_grows_by_the_shapes_a_new_network_needs(tmp_path, monkeypatch):
    """``ttile-generate --network`` on a CPU whose table is a quick one measures the
    shapes the new layers can use that it lacks, keeping the table's measurements (the
    table is passed as ``base``); a table that has them all, or a full one, is used as
    it is."""
    from ttile import cli
    from ttile.core.kinds import Isa
    from ttile.core.vectors import vector_isa
    from ttile.generator import microkernels, networks
    full = MicrokernelTable.from_json(json.loads(sorted(
        (REPO / "generator" / "microkernels").glob("*.json"))[0].read_text()))
    specs = [layer.spec() for layer in networks.NETWORKS["resnet18"]]
    needed = microkernels.shapes_for(
        microkernels.quick_shapes(Isa.AVX512F, tmp_path, fingerprint().id), specs,
        vector_isa(Isa.AVX512F).lanes)
    assert needed
    half = MicrokernelTable(**{**full.__dict__, "quick": True, "measurements": tuple(
        Measurement(s, RecordStatus.OK, gflops=1.0) for s in needed[: len(needed) // 2])})
    calls = []

    def fake_explore(data_dir, **kwargs):
        calls.append(kwargs)
        return full

    monkeypatch.setattr(microkernels, "explore", fake_explore)
    args = cli.build_parser().parse_args(["--data-dir", str(tmp_path), "--network",
                                          "resnet18"])
    for table, grows in ((half, True), (full, False),
                         (MicrokernelTable(**{**half.__dict__, "measurements": tuple(
                             Measurement(s, RecordStatus.OK, gflops=1.0)
                             for s in needed)}), False)):
        calls.clear()
        monkeypatch.setattr(microkernels, "load_table", lambda *a, table=table, **k: table)
        got = cli._table_or_quick_step1(args, Isa.AVX512F, specs)
        assert bool(calls) is grows
        if grows:
            assert calls[0]["base"] is half and calls[0]["layers"] == specs
            assert calls[0]["quick"] is True and got is full
        else:
            assert got is table


@needs_compiler
@requires_avx512
def test_explore_keeps_a_base_tables_measurements(tmp_path):
    """Step 1 with ``base`` measures only the shapes the base table lacks and keeps the
    base's measurements as they were (a quick table grown for another network)."""
    fast = TimingProtocol(sample_seconds=0.0005, samples=3, max_rounds=1)
    shapes = [MicrokernelShape(1, 1, "w", 1, b) for b in (2, 3, 4)]
    first = explore(tmp_path, shapes=shapes[:2], reduction=64, protocol=fast, quick=True)
    grown = explore(tmp_path, shapes=shapes, reduction=64, protocol=fast, base=first)
    assert [m.shape for m in grown.measurements] == shapes
    # not measured again (the first beta has no lower neighbour to be found suspect by)
    assert grown.measurements[0].samples_s == first.measurements[0].samples_s
    assert grown.quick
