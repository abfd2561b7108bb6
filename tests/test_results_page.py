"""benchmarks/README.md is generated from the result files in benchmarks/records: the page
must be what they give, and every result file must say what its numbers need."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
REQUIRED = ("table", "title", "cpu", "cpu_model", "kernel_set", "threads", "peers", "commit",
            "date", "command", "lines")

pytestmark = pytest.mark.skipif(not (BENCH / "make_results.py").is_file(),
                                reason="not a source checkout")


def test_the_results_page_is_what_the_result_files_give():
    proc = subprocess.run([sys.executable, str(BENCH / "make_results.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted((BENCH / "records").glob("*.json")),
                         ids=lambda p: p.stem)
def test_each_result_file_names_cpu_set_threads_peers_and_commit(path):
    data = json.loads(path.read_text())
    missing = [k for k in REQUIRED if not data.get(k) and k != "peers"]
    assert not missing, (path.name, missing)
    assert path.stem == f"{data['table']}--{data['cpu']}"
    assert data["commit"] != "unknown" and data["command"].startswith("python benchmarks/")
    assert any(line.startswith("|") for line in data["lines"])
