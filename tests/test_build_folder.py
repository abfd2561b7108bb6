"""Kernels are compiled and loaded only from a folder nobody else can write, and a
library found there is loaded only if this process compiled it: a planted library under
the name a build would choose is never run."""
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import ttile
from ttile.core import cbuild
from ttile.core.codegen import generate
from ttile.core.kinds import Isa
from ttile.core.reference import assert_conv_close
from ttile.core.scheme import Scheme
from ttile.core.spec import ConvSpec
from conftest import random_tensors

pytestmark = [pytest.mark.skipif(cbuild.find_compiler() is None, reason="no C compiler"),
              pytest.mark.skipif(not ttile.has_avx2(), reason="no vector family to build")]

SPEC = ConvSpec(1, 16, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1)
#: A scheme covering SPEC's 16 output channels in each family: one 16-lane vector, or two
#: 8-lane ones.
SCHEMES = {Isa.AVX512F: "[T6 h; T6 w; T3 r; T3 s; T8 c; V k]",
           Isa.AVX2: "[T6 h; T6 w; T3 r; T3 s; T8 c; U2 k; V k]"}
PLANTED_VALUE = 42.0


def _kernel():
    isa = Isa.AVX512F if ttile.has_avx512f() else Isa.AVX2
    return generate(Scheme.parse(SCHEMES[isa]), SPEC, isa=isa)


def _plant(folder: Path, name: str, symbol: str) -> Path:
    """A library named like the build's, whose kernel writes PLANTED_VALUE everywhere."""
    source = folder / "planted.c"
    source.write_text(f"void {symbol}(const float *x, const float *w, float *y, int t, "
                      f"void *e) {{ for (int i = 0; i < {SPEC.ho * SPEC.wo * SPEC.k}; i++) "
                      f"y[i] = {PLANTED_VALUE}f; }}\n")
    target = folder / name
    subprocess.run([cbuild.find_compiler(), "-shared", "-fPIC", "-o", str(target),
                    str(source)], check=True)
    return target


def _run_and_check(library, kernel):
    x, w = random_tensors(np.random.default_rng(3), SPEC.input_shape(), SPEC.weight_shape())
    y = np.zeros((1, SPEC.ho, SPEC.wo, SPEC.k), np.float32)
    library.run(kernel, x, w, y)
    assert not np.any(y == PLANTED_VALUE), "the planted library ran"
    assert_conv_close(y, x, w, (1, 1), (1, 1, 1, 1))


def _expected_name(kernel) -> str:
    return cbuild.build([kernel]).path.name


def test_a_world_writable_folder_is_refused_with_a_warning(tmp_path):
    kernel = _kernel()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _plant(shared, _expected_name(kernel), kernel.name)
    with pytest.warns(RuntimeWarning, match="others may write it"):
        library = cbuild.build([kernel], workdir=shared)
    assert library.path.parent != shared
    _run_and_check(library, kernel)


def test_the_old_predictable_folder_is_never_used(tmp_path):
    """``<tmp>/ttile-build-<uid>``, created world-writable by someone else first, with a
    library under the name the build would choose: the default build does not go there."""
    kernel = _kernel()
    name = _expected_name(kernel)
    old = Path(tempfile.gettempdir()) / f"ttile-build-{os.getuid()}"
    created = not old.exists()
    old.mkdir(exist_ok=True)
    try:
        os.chmod(old, 0o777)
        planted = _plant(old, name, kernel.name)
        cbuild._built.discard(planted)
        library = cbuild.build([kernel])
        assert library.path.parent != old
        assert cbuild.private_directory_problem(library.path.parent) is None
        _run_and_check(library, kernel)
    finally:
        if created:
            shutil.rmtree(old, ignore_errors=True)


def test_a_library_this_process_did_not_build_is_compiled_again(tmp_path):
    """Even in a private folder of this user, a library left by someone (another process,
    an earlier run) is not trusted: it is compiled over."""
    kernel = _kernel()
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    planted = _plant(mine, _expected_name(kernel), kernel.name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library = cbuild.build([kernel], workdir=mine)
    assert library.path == planted
    _run_and_check(library, kernel)
    again = cbuild.build([kernel], workdir=mine)     # built by this process now: reused
    assert again.path == planted and planted.stat().st_mtime == library.path.stat().st_mtime


def test_the_default_folder_is_private_to_this_process():
    folder = cbuild.build_directory()
    info = folder.lstat()
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700
    assert folder.name.startswith("ttile-build-") and folder.name != f"ttile-build-{os.getuid()}"


@pytest.mark.parametrize("case", ["symlink", "group_writable", "file", "other_owner"])
def test_what_makes_a_folder_unfit(tmp_path, case, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if case == "symlink":
        path, expected = tmp_path / "link", "symbolic link"
        path.symlink_to(real)
    elif case == "group_writable":
        path, expected = real, "others may write it (mode 0770)"
        os.chmod(real, 0o770)
    elif case == "file":
        path, expected = tmp_path / "file", "not a directory"
        path.write_text("")
    else:
        path, expected = real, "belongs to user id"
        monkeypatch.setattr(os, "getuid", lambda: os.stat(real).st_uid + 1)
    assert expected in cbuild.private_directory_problem(path)


def test_a_private_folder_is_fit(tmp_path):
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    assert cbuild.private_directory_problem(folder) is None
    assert cbuild.build_directory(folder) == folder


def test_the_kernels_headers_are_precompiled_once_per_folder(tmp_path, monkeypatch):
    """A build in a folder precompiles the headers every kernel includes, and its kernel
    is right; where the headers cannot be precompiled (a missing one here), the build
    still compiles and runs the kernel, parsing them itself."""
    if "clang" in cbuild.compiler_version(cbuild.find_compiler()).lower():
        pytest.skip("clang: the headers are not precompiled")
    kernel = _kernel()
    folder = tmp_path / "pch"
    _run_and_check(cbuild.build([kernel], workdir=folder), kernel)
    assert len(list(folder.glob("headers_*.h.gch"))) == 1

    monkeypatch.setattr(cbuild, "KERNEL_HEADERS", (*cbuild.KERNEL_HEADERS, "no_such.h"))
    other = tmp_path / "without"
    _run_and_check(cbuild.build([kernel], workdir=other), kernel)
    assert not list(other.glob("headers_*.h.gch"))
