"""``ttile-generate run``: the README's one-command demo serves a built-in network,
checks every layer against float64 and says what served it."""
import re

import ttile
from ttile.cli import main
from ttile.generator.networks import RESNET18
from ttile.runtime import registry


def test_run_serves_checks_and_times_every_layer(capsys, shipped_set):
    assert main(["run", "--network", "resnet18", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (ResNet18-\d+) \| (\w+).* \| ([\d.]+) \| ([\d.]+) \| (.*) \|$",
                      out, re.M)
    assert [r[0] for r in rows] == [layer.name for layer in RESNET18]
    assert all(r[4] == "ok" and float(r[2]) > 0 and float(r[3]) > 0 for r in rows), out
    for layer, row in zip(RESNET18, rows):
        entry = registry.lookup(layer.spec(), 1)
        tuned = entry is not None and entry.kind is ttile.KernelKind.TUNED
        assert (row[1] == "tuned") == tuned, row
    assert any(row[1] == "tuned" for row in rows), "no shipped kernel served: " + out
    assert "0 wrong result(s)" in out


def test_run_refuses_bad_counts(capsys):
    assert main(["run", "--threads", "0"]) == 2
    assert "--threads and --reps must be >= 1" in capsys.readouterr().err
