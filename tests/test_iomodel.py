"""Step 2: IOOpt footprints (ISL + Barvinok), cost model, Algorithm 1, TileOpt, and the
TTile permutation ranking, checked against the numbers the papers publish."""
import math

import numpy as np
import pytest

pytest.importorskip("islpy")
sympy = pytest.importorskip("sympy")
pytest.importorskip("scipy")

from ttile.generator.iomodel import (best_levels, conv_lower_bound,  # noqa: E402
                                    divisor_splits, generate_permutations, loop_symbol,
                                    nest_volumes, numeric_footprints, reuse_sets, round_tile,
                                    symbolic_cost, tile_symbol, tileopt)
from ttile.generator.machine import CacheLevel  # noqa: E402
from ttile.generator.microkernels import MicrokernelShape  # noqa: E402
from ttile.generator.costmodel import CostModel, microkernel_tile  # noqa: E402
from ttile.generator.networks import layer  # noqa: E402
from ttile.generator.polyhedral import (conv1d_computation, conv2d_computation, extent_symbol,  # noqa: E402
                              footprints, matmul_computation)

Ni, Nj, Nk, S = 2000, 1500, 1500, 1024


def _matmul_objective(cost):
    def objective(tile, counts):
        fps, ios = cost.evaluate(tile, counts)
        return best_levels(fps, ios, S)[0]
    return objective


def test_matmul_io_and_footprint_constraint_match_ioopt():
    cost = symbolic_cost(matmul_computation(), ("i", "j", "k"))
    Ti, Tj, NI, NJ, NK = sympy.symbols("T_i T_j N_i N_j N_k", positive=True)
    subs = {tile_symbol("i"): Ti, tile_symbol("j"): Tj, tile_symbol("k"): 1,
            loop_symbol(0): NI / Ti, loop_symbol(1): NJ / Tj, loop_symbol(2): NK}
    io = sum(cost.level_cost(a, 1).io for a in ("C", "A", "B")).subs(subs)
    assert sympy.simplify(io - NI * NJ * NK * (1 / Ti + 1 / Tj + 1 / NK)) == 0
    footprint = sum(cost.level_cost(a, 1).footprint for a in ("C", "A", "B")).subs(subs)
    assert sympy.expand(footprint - (Ti * Tj + Ti + Tj)) == 0


def test_matmul_tileopt_optimum_is_31_by_31_with_the_published_bound():
    cost = symbolic_cost(matmul_computation(), ("i", "j", "k"))
    sizes = {"i": Ni, "j": Nj, "k": Nk}
    objective = _matmul_objective(cost)
    continuous = tileopt(cost, sizes, {"k": 1}, objective, free_tile=("i", "j"),
                         tile_capacity=S, starts=4)
    assert continuous.tile["i"] == pytest.approx(math.sqrt(S + 1) - 1, rel=2e-3)
    assert continuous.tile["j"] == pytest.approx(math.sqrt(S + 1) - 1, rel=2e-3)
    integer = round_tile(cost, sizes, continuous, ("i", "j"), objective, tile_capacity=S)
    assert (integer.tile["i"], integer.tile["j"]) == (31, 31)
    upper_bound = integer.value + Ni * Nj  # loads, plus each output stored once
    assert int(upper_bound) == 296322580


def test_conv1d_io_per_array_matches_ioopt_section_4():
    cost = symbolic_cost(conv1d_computation(), ("w", "c", "f", "x"))
    Nc, Nf, Nx, Nw, Tc, Tf = sympy.symbols("N_c N_f N_x N_w T_c T_f", positive=True)
    subs = {tile_symbol("w"): Nw, tile_symbol("c"): Tc, tile_symbol("f"): Tf,
            tile_symbol("x"): 1, loop_symbol(0): 1, loop_symbol(1): Nc / Tc,
            loop_symbol(2): Nf / Tf, loop_symbol(3): Nx}
    expected = {("Image", 1): Nc * Nf * (Nx + Nw - 1) / Tf, ("Out", 1): Nc * Nf * Nx / Tc,
                ("Filter", 2): Nc * Nf * Nw}
    for (array, level), formula in expected.items():
        assert sympy.simplify(cost.level_cost(array, level).io.subs(subs) - formula) == 0
    image_1 = cost.level_cost("Image", 1)
    assert sympy.simplify(image_1.footprint.subs(subs) - Nw * Tc) == 0
    assert sympy.simplify(image_1.reuse.subs(subs) - Tc * (Nw - 1)) == 0


def test_strided_footprint_comes_from_barvinok_not_a_formula():
    fp = footprints(conv2d_computation(2, 2))
    x = fp.footprint["x"]
    values = {extent_symbol(d): 1 for d in "nkcws"}
    values.update({extent_symbol("h"): 5, extent_symbol("r"): 3})
    assert x.subs(values) == 2 * (5 - 1) + 3       # rows 0..10 of the input
    values[extent_symbol("r")] = 1
    assert x.subs(values) == 5                     # stride 2, one kernel row: no overlap


def test_numeric_path_equals_symbolic_path_on_a_strided_conv_nest():
    comp = conv2d_computation(2, 2)
    perm = ("k", "h", "w", "h", "c", "s", "r", "w", "c")
    tile = {"k": 32, "h": 7, "w": 1, "r": 1, "s": 1, "c": 1, "n": 1}
    counts = [4, 2, 7, 1, 4, 3, 3, 2, 64]
    symbolic = symbolic_cost(comp, perm).evaluate(tile, counts)
    numeric = nest_volumes(numeric_footprints(comp), perm, tile, counts)
    np.testing.assert_allclose(symbolic[0], numeric[0])
    np.testing.assert_allclose(symbolic[1], numeric[1])


def test_algorithm1_prunes_permutations_without_maximal_reuse():
    comp = conv1d_computation()
    reuse = reuse_sets(comp, small={"w": 3})
    assert reuse["w"] == {"Image", "Out"} and reuse["c"] == {"Out"}
    perms = generate_permutations(comp.dims, reuse)
    assert len(perms) == 5 < math.factorial(4)
    innermost = {p[-1] for p in perms}
    assert innermost == {"w", "x"}  # c and f carry strictly less reuse than w
    conv = conv2d_computation()
    perms2d = generate_permutations(["k", "c", "h", "w", "r", "s"],
                                    reuse_sets(conv, small={"r": 3, "s": 3, "n": 1}))
    assert len(perms2d) < math.factorial(6) / 20


def test_divisor_splits_are_exact_and_ordered():
    assert sorted(divisor_splits(12, 2)) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert all(math.prod(s) == 34 for s in divisor_splits(34, 3))


CACHES = (CacheLevel("L1", 48 << 10, 1 / 50e9), CacheLevel("L2", 2 << 20, 1 / 20e9),
          CacheLevel("L3", 32 << 20, 1 / 10e9))


@pytest.mark.parametrize("name", ["ResNet18-11", "Yolo9000-13"])
def test_ranked_permutations_cover_the_problem_and_respect_the_lower_bound(name):
    spec = layer(name).spec()
    shape = MicrokernelShape(1, 1, "w", 2, 7)
    ranked = CostModel(spec, CACHES).rank_permutations(shape, top=3)
    assert ranked and ranked == sorted(ranked, key=lambda r: r.estimate.cost)
    tile = microkernel_tile(spec, shape)
    extents = spec.iteration_extents()
    best = ranked[0]
    assert best.bands[-1][-1] == "c", "the loop right above the microkernel is over c"
    for d in extents:
        covered = tile[d] * math.prod(c for dim, c in zip(best.permutation, best.flat_counts)
                                      if dim == d)
        assert covered == pytest.approx(extents[d])
    assert best.notation().startswith("[[") and best.notation().count("[") == 5
    for report in CostModel(spec, CACHES).lower_bounds(best):
        assert report.volume >= report.lower_bound * 0.999, report


def test_lower_bound_names_its_dominant_term():
    spec = layer("Yolo9000-12").spec()
    value, term = conv_lower_bound(1, spec.k, spec.c, spec.ho, spec.wo, 3, 3, 48 << 8)
    assert value > 0 and "sqrt(HW)" in term


def test_model_is_not_imported_by_ttile():
    import subprocess
    import sys
    code = "import sys, ttile; print(sorted({'ttile.generator.iomodel', 'ttile.generator.costmodel', 'islpy', 'sympy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_machine_model_round_trips_and_orders_caches(tmp_path):
    from ttile.core.cpuinfo import fingerprint
    from ttile.generator.machine import Bandwidths, MachineModel
    model = MachineModel(fingerprint(), Bandwidths(l1=100e9, l2=50e9, l3=20e9, dram=10e9))
    assert MachineModel.from_json(model.to_json()) == model
    names = [c.name for c in model.caches()]
    assert names == ["L1", "L2", "L3"]
    assert model.caches()[0].seconds_per_byte < model.caches()[2].seconds_per_byte


def test_cli_model_prints_the_papers_notation(capsys, tmp_path):
    from ttile.cli import main
    assert main(["--data-dir", str(tmp_path), "model", "--layer", "ResNet18-11",
                 "--microkernel", "1", "1", "w", "2", "7", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "1. [[" in out and "lower" in out and "dominant term" in out
