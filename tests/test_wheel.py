"""The prebuilt-wheel path, end to end: wheels/build.sh builds and repairs a manylinux
wheel, wheels/check_wheel.py installs it into a fresh virtual environment and runs
conv2d with no compiler on PATH. A release check, left out by default (it compiles every
shipped kernel again: about six minutes on two cores); select it with -m wheel."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.wheel
def test_wheel_builds_installs_and_runs_without_a_compiler(tmp_path):
    if not (ROOT / "wheels" / "build.sh").exists():
        pytest.skip("not a source checkout")
    build = subprocess.run(["bash", str(ROOT / "wheels" / "build.sh"), str(tmp_path)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [wheel] = tmp_path.glob("ttile-*.whl")
    assert "manylinux" in wheel.name and wheel.name.endswith("_x86_64.whl")
    check = subprocess.run([sys.executable, str(ROOT / "wheels" / "check_wheel.py"), str(wheel)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert "wheel ok" in check.stdout
