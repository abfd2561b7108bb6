"""Install a built ttile wheel into a fresh virtual environment and prove it runs with
no C compiler on PATH: tuned, generic and (degraded) run-time-tuning paths all give
results that match a float64 reference computed here with numpy alone.

    python wheels/check_wheel.py wheelhouse/ttile-*.whl

Exit status 0 on success. The wheel's dependencies come from the package index.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

# Runs inside the fresh environment with PATH reduced to its bin/ directory.
PROBE = r'''
import shutil, warnings, numpy as np
assert shutil.which("cc") is None and shutil.which("gcc") is None, "a compiler is on PATH"
import ttile
assert "/site-packages/ttile/" in ttile.__file__, ttile.__file__

def reference(x, w, stride, pad):
    """float64 NHWC convolution, numpy only."""
    n, h, wd, c = x.shape
    r, s, _, k = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    ho = (h + 2 * pad - r) // stride + 1
    wo = (wd + 2 * pad - s) // stride + 1
    y = np.zeros((n, ho, wo, k))
    for i in range(r):
        for j in range(s):
            patch = xp[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
            y += patch @ w[i, j].astype(np.float64)
    return y

def check(x, w, stride, pad, **kw):
    y = ttile.conv2d(x, w, stride=stride, padding=pad, layout="NHWC", **kw)
    ref = reference(x, w, stride, pad)
    err = np.abs(y - ref).max() / max(1.0, np.abs(ref).max())
    assert err < 1e-5, err
    return ttile.plan(x.shape, w.shape, stride=stride, padding=pad, layout="NHWC",
                      threads=kw.get("threads"))

rng = np.random.default_rng(0)
if ttile.has_avx512f():   # the Winograd kernel serves a 3x3 stride-1 layer
    x = rng.uniform(-1, 1, (1, 23, 23, 24)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 24, 40)).astype(np.float32)
    plan = check(x, w, 1, 1, threads=2)
    assert plan.kind == "winograd", plan
ttile.use_winograd(False)   # the direct kernels from here on
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = rng.uniform(-1, 1, (1, 23, 23, 24)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 24, 40)).astype(np.float32)
    plan = check(x, w, 1, 1, threads=1)
assert plan.kind == "generic", plan
assert any("no C compiler" in str(c.message) for c in caught), [str(c.message) for c in caught]

from ttile.runtime import registry
missing = [e.index for e in registry.ENTRIES if not e.compiled]
assert not missing, f"a distributed wheel carries every CPU's set; left out: {missing}"
tuned = ttile.tuned_kernels()
runs = {"avx512f": ttile.has_avx512f(), "avx2": ttile.has_avx2()}
for family in ("avx512f", "avx2"):   # each family's searched kernels, where the CPU runs it
    mine = [e for e in tuned if e["isa"] == family]
    if not (runs[family] and mine):
        continue
    e = min(mine, key=lambda e: e["k"] * e["c"] * e["h"] * e["w"])
    x = rng.uniform(-1, 1, (e["n"], e["h"], e["w"], e["c"])).astype(np.float32)
    w = rng.uniform(-1, 1, (e["r"], e["s"], e["c"], e["k"])).astype(np.float32)
    previous = ttile.set_isa(family)
    with registry.pretend_cpu(e["cpu"]):   # a kernel serves only on the CPU it was tuned on
        plan = check(x, w, e["stride_h"], e["pad_top"], threads=e["threads"])
        assert plan.kind == "tuned" and plan.tuned_cpu == e["cpu"] and plan.isa == family, plan
        layer = ttile.Conv2d(w, stride=e["stride_h"], padding=e["pad_top"], layout="NHWC")
        assert np.array_equal(layer(x, threads=e["threads"]),
                              ttile.conv2d(x, w, stride=e["stride_h"], padding=e["pad_top"], layout="NHWC",
                                           threads=e["threads"]))
    ttile.set_isa(previous)
for family in ["portable"] + (["avx2"] if ttile.has_avx2() else []):   # every family the CPU runs
    previous = ttile.set_isa(family)
    plan = check(rng.uniform(-1, 1, (2, 9, 7, 3)).astype(np.float32),
                 rng.uniform(-1, 1, (3, 3, 3, 17)).astype(np.float32), 2, 1, threads=2)
    assert plan.isa == family, plan
    ttile.set_isa(previous)
print(f"wheel ok: isa {ttile.get_isa()}, {len(ttile.tuned_kernels())} tuned kernels")
'''


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".whl"):
        print(__doc__, file=sys.stderr)
        return 2
    wheel = Path(argv[0]).resolve()
    with tempfile.TemporaryDirectory(prefix="ttile-wheel-check-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        python = env_dir / "bin" / "python"
        subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", str(wheel)], check=True)
        env = {"PATH": str(env_dir / "bin"), "HOME": tmp, "TTILE_CACHE_DIR": str(Path(tmp) / "cache"),
               "LANG": "C.UTF-8"}
        proc = subprocess.run([str(python), "-c", PROBE], env=env, cwd=tmp,
                              capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
