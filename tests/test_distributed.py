"""``ttile-generate --dask``: the search's measurements on a LocalCluster of two Dask
workers, records written by the client as whole tasks complete, a killed worker's tasks
run elsewhere, workers of another CPU refused for measuring."""
import json
import os
import signal
from pathlib import Path

import pytest

from conftest import requires_avx512
from ttile.core.cpuinfo import fingerprint

pytest.importorskip("distributed")
pytest.importorskip("islpy")

from ttile.cli import build_parser, main  # noqa: E402
from ttile.generator import distributed as dist  # noqa: E402
from ttile.tuning.records import Protocol, TuningDatabase  # noqa: E402
from test_generate_command import LAYERS_TOML, _generator_dir  # noqa: E402

pytestmark = requires_avx512


def test_help_documents_dask():
    text = " ".join(build_parser().format_help().split())   # argparse wraps lines
    assert "--dask" in text and "local:N" in text and "refused for measuring" in text


def test_network_search_on_a_local_cluster(tmp_path, capsys):
    generator = _generator_dir(tmp_path / "generator")
    layers = tmp_path / "layers.toml"
    layers.write_text(LAYERS_TOML)
    kernels = tmp_path / "gen"
    assert main(["--layers-file", str(layers), "--data-dir", str(generator),
                 "--kernels-dir", str(kernels), "--threads", "1", "--budget", "4",
                 "--top", "8", "--dask", "local:2"]) == 0
    err = capsys.readouterr().err
    assert "measuring on 2 Dask worker(s) at local:2" in err
    [path] = (generator / "records").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    cpu = fingerprint().id
    assert {r["cpu"] for r in records} == {cpu}
    for name in ("small-3x3", "tiny-1x1"):
        mine = [r for r in records if r["layer"] == name]
        assert any(r["protocol"] == "screen" and r["status"] == "ok" for r in mine)
        assert any(r["protocol"] == "paper" and r["contender"] == "generic" for r in mine)
        keys = [(r["scheme"], r["threads"], r["protocol"]) for r in mine]
        assert len(keys) == len(set(keys))            # nothing measured twice
    assert (kernels / "registry.c").exists()


def test_a_killed_worker_loses_nothing(tmp_path):
    """One of two workers dies as the tasks are submitted: its tasks run on the other,
    every candidate gets exactly one record, and no record is half written."""
    from ttile.core.spec import ConvSpec
    from ttile.generator.autotune import TuneSettings
    from ttile.generator.microkernels import MicrokernelShape
    from ttile.generator.search import Candidate
    from ttile.core.scheme import Scheme
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    texts = ["[T6 h; T3 r; T3 s; T8 c; U6 w; V k]", "[T6 w; T3 r; T3 s; T8 c; U6 h; V k]",
             "[T3 h; T6 w; T3 r; T3 s; T8 c; U2 h; V k]", "[T2 w; T6 h; T3 r; T3 s; T8 c; U3 w; V k]",
             "[T6 h; T2 w; T3 r; T3 s; T8 c; U3 w; V k]", "[T3 w; T6 h; T3 r; T3 s; T8 c; U2 w; V k]"]
    candidates = [Candidate(Scheme.parse(t), (MicrokernelShape(1, 1, "w", 1, 6),), 8, 0.0)
                  for t in texts]
    database = TuningDatabase(tmp_path / "records")
    client = dist.connect("local:2")
    try:
        allowed, refused = dist.measuring_workers(client, database.cpu_id)
        assert len(allowed) == 2 and not refused
        search = dist.DistributedSearch(client, database, allowed, chunk=1)
        victim = client.run(os.getpid, workers=[allowed[0]])[allowed[0]]

        killed = []

        def kill(futures):          # the worker process dies, as a machine would
            if not killed:
                os.kill(victim, signal.SIGKILL)
                killed.append(len(futures))

        search.on_submitted = kill
        search.tune_layer("killed", spec, candidates, 1,
                          TuneSettings(budget_seconds=120, refine_top=2), "test")
    finally:
        search.close()
    assert killed == [len(candidates)]      # while all six screening tasks were out
    screened = database.for_layer(spec, 1, Protocol.SCREEN)
    assert sorted(r.scheme for r in screened) == sorted(str(c.scheme) for c in candidates)
    assert len(database.for_layer(spec, 1, Protocol.PAPER)) == 2
    lines = database.path.read_text().splitlines()
    assert all(json.loads(line)["cpu"] == database.cpu_id for line in lines)


def test_workers_of_another_cpu_are_refused(tmp_path):
    client = dist.connect("local:1")
    try:
        allowed, refused = dist.measuring_workers(client, "another-cpu-0-0-00000000")
        assert allowed == [] and list(refused.values()) == [fingerprint().id]
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


def test_records_measured_on_another_cpu_are_dropped_with_a_warning(tmp_path):
    """A worker that passed the CPU check but measured on another CPU (replaced between
    the check and the task): its records are not evidence for this CPU's set, so they
    are dropped - and the user is told, not left with a silently thinner search."""
    from ttile.core.spec import ConvSpec
    spec = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
    database = TuningDatabase(tmp_path / "records", cpu_id="another-cpu-0-0-00000000")
    client = dist.connect("local:1")
    try:
        allowed, _ = dist.measuring_workers(client, fingerprint().id)
        search = dist.DistributedSearch(client, database, allowed)
        with pytest.warns(RuntimeWarning, match="record\\(s\\) are dropped"):
            search.measure_generic("g", spec, 1, calls=3, drop=1)
    finally:
        search.close()
    assert search.dropped == 1
    assert not database.path.exists() or database.path.read_text() == ""
