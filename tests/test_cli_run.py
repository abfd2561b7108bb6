"""``ttile-generate run``: the README's one-command demo serves a built-in network,
checks every layer against float64 and says what served it."""
import re

import pytest

import ttile
from ttile.cli import main
from ttile.generator.networks import RESNET18
from ttile.runtime import registry, winograd


def test_run_serves_checks_and_times_every_layer(capsys, shipped_set):
    assert main(["run", "--network", "resnet18", "--reps", "1", "--no-peers"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (ResNet18-\d+) \| (\w+).* \| ([\d.]+) \| ([\d.]+) \| (.*) \|$",
                      out, re.M)
    assert [r[0] for r in rows] == [layer.name for layer in RESNET18]
    assert all(r[4] == "ok" and float(r[2]) > 0 and float(r[3]) > 0 for r in rows), out
    for layer, row in zip(RESNET18, rows):
        if ttile.has_avx512f() and winograd.serves(layer.spec(), ttile.Isa.AVX512F):
            assert row[1] == "winograd", row
            continue
        entry = registry.lookup(layer.spec(), 1)
        tuned = entry is not None and entry.kind is ttile.KernelKind.TUNED
        assert (row[1] == "tuned") == tuned, row
    assert any(row[1] == "tuned" for row in rows), "no shipped kernel served: " + out
    assert "0 wrong result(s)" in out


def test_run_refuses_bad_counts(capsys):
    assert main(["run", "--threads", "0"]) == 2
    assert "--threads and --reps must be >= 1" in capsys.readouterr().err


def test_run_times_the_installed_peers_beside_ttile(capsys):
    """torch is in the test extra: its column is there, each layer has a time and the
    best peer / ttile ratio, and the header says which set served and whether tuning ran."""
    pytest.importorskip("torch")
    from ttile import peers
    assert main(["run", "--network", "resnet18", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    columns = [f"{p.value} ms" for p in peers.available()]
    header = next(line for line in out.splitlines() if line.startswith("| layer |"))
    assert all(c in header for c in columns) and "best peer / ttile" in header, header
    rows = [line for line in out.splitlines() if line.startswith("| ResNet18-")]
    assert len(rows) == len(RESNET18)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        numbers = cells[2:3 + len(columns) + 2]
        assert all(float(c) > 0 for c in numbers[:1] + numbers[2:]), row
        assert cells[-1] == "ok", row
    assert "kernel set:" in out and "run-time tuning: off" in out
    assert "torch: " in out and "x as fast" in out


def test_a_new_cpus_search_is_quick_unless_asked_for_the_full_one():
    """--search auto is the quick search on a new CPU (its microkernel table step 1's quick
    one, or borrowed from another VM of the same microarchitecture) or with a --budget
    below the quick search's, the full search otherwise; quick measures fewer of each layer's candidates on fewer classes, and an
    explicit --search wins."""
    import argparse
    from types import SimpleNamespace
    from ttile.cli import EFFORTS, SearchDepth, _search_depth
    here = SimpleNamespace(id="genuineintel-6-167-65bde4ef")
    quick_table = SimpleNamespace(quick=True, cpu=here)
    full_table = SimpleNamespace(quick=False, cpu=here)
    borrowed = SimpleNamespace(quick=False, cpu=SimpleNamespace(id="genuineintel-6-167-513608a3"))
    auto = argparse.Namespace(search="auto")
    assert _search_depth(auto, quick_table, here.id) is SearchDepth.QUICK
    assert _search_depth(auto, full_table, here.id) is SearchDepth.FULL
    assert _search_depth(auto, borrowed, here.id) is SearchDepth.QUICK
    assert _search_depth(argparse.Namespace(search="full"), borrowed, here.id) \
        is SearchDepth.FULL
    assert _search_depth(auto, quick_table) is SearchDepth.QUICK
    assert _search_depth(auto, full_table) is SearchDepth.FULL
    assert _search_depth(auto, None) is SearchDepth.FULL     # from records: nothing measured
    assert _search_depth(argparse.Namespace(search="full"), quick_table) is SearchDepth.FULL
    assert _search_depth(argparse.Namespace(search="quick"), full_table) is SearchDepth.QUICK
    # a budget too short for the full search's picks: its scheme space would be wasted
    assert _search_depth(argparse.Namespace(search="auto", budget=2.0), full_table, here.id) \
        is SearchDepth.QUICK
    assert _search_depth(argparse.Namespace(search="auto", budget=90.0), full_table, here.id) \
        is SearchDepth.FULL
    assert _search_depth(argparse.Namespace(search="full", budget=2.0), full_table, here.id) \
        is SearchDepth.FULL
    quick, full = EFFORTS[SearchDepth.QUICK], EFFORTS[SearchDepth.FULL]
    assert quick.rank_measure < full.rank_measure and quick.budget_seconds < full.budget_seconds
    assert quick.classes is not None and full.classes is None
    assert quick.max_points < full.max_points
