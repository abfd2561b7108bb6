"""Compile generated kernels with the system C compiler and load them.

Used by the tests, the generator and the run-time tuner to run a kernel straight from
its source. Many kernels go into one shared object per call to :func:`build` so the
compiler starts once per batch, not once per kernel.

Loading a shared object runs its code in this process, so a library is loaded only from
a folder nobody else can write, and only if this process compiled it: the default folder
is made by ``mkdtemp`` for this process alone (mode 0700, removed at exit); a folder the
caller names is used only when it is a real directory of this user that neither group nor
others may write, else a warning says why and the private one is used. A library already
in the folder under the expected name is compiled again unless this process wrote it
(a predictable name in a shared folder would let another user plant code). The disk
cache of the run-time tuner vouches for its own libraries by checksum
(:mod:`ttile.runtime.cache`).

The headers every kernel includes (``immintrin.h`` above all: 30 MB of declarations
parsed per compile) are precompiled once per folder, compiler and flags, which takes
GCC's compile of a searched kernel down by about a seventh (:func:`precompiled_header`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from .codegen import KernelSource, kernel_cflags
from .fileio import atomic_write, publish

_FLOAT_P = ctypes.POINTER(ctypes.c_float)


class EpilogueArgs(ctypes.Structure):
    """``ttile_epilogue`` (kernels/ttile_epilogue.h) for calling a kernel through ctypes."""

    _fields_ = [("bias", _FLOAT_P), ("residual", _FLOAT_P), ("activation", ctypes.c_int),
                ("negative_slope", ctypes.c_float)]

    @classmethod
    def of(cls, bias: np.ndarray | None, residual: np.ndarray | None, activation: int,
           negative_slope: float) -> "EpilogueArgs":
        def pointer(array):
            if array is None:
                return None
            if array.dtype != np.float32 or not array.flags.c_contiguous:
                raise ValueError("bias and residual must be C-contiguous float32")
            return array.ctypes.data_as(_FLOAT_P)
        return cls(pointer(bias), pointer(residual), int(activation), float(negative_slope))


class BuildError(RuntimeError):
    """The C compiler rejected a generated source; ``log`` holds its messages."""

    def __init__(self, message: str, log: str):
        super().__init__(f"{message}\n{log}")
        self.log = log


class CompileTimeout(BuildError):
    """The compiler ran past its time limit (a hung or overloaded compiler must not hang
    the ``conv2d`` call that tunes a shape: the caller falls back to the generic kernel)."""


def find_compiler() -> str | None:
    """The C compiler to use: $CC if set, else cc, gcc or clang on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for candidate in candidates:
        path = shutil.which(candidate)
        if path:
            return path
    return None


#: The header generated kernels include (``#include "ttile_epilogue.h"``): installed with
#: the package under ttile/include, or kernels/ in a source checkout.
EPILOGUE_HEADER = "ttile_epilogue.h"


def include_dir() -> Path:
    """The folder holding the headers generated kernels include."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "include", package.parent.parent / "kernels"):
        if (candidate / EPILOGUE_HEADER).is_file():
            return candidate
    raise BuildError(f"{EPILOGUE_HEADER} is missing from {package / 'include'}: "
                     f"reinstall ttile", "")


def _include_flags() -> tuple[tuple[str, ...], str]:
    """Compiler flags for the kernels' headers, and their text (part of a build's hash:
    a changed header must not reuse a library built with the old one)."""
    folder = include_dir()
    return (f"-I{folder}",), (folder / EPILOGUE_HEADER).read_text()


def compiler_version(compiler: str) -> str:
    """First line of ``compiler --version`` (the compiler itself when it says nothing)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return compiler
    return out.splitlines()[0].strip() if out else compiler


@dataclass(frozen=True)
class BuiltLibrary:
    """A loaded shared object holding compiled kernels, callable on numpy arrays."""

    path: Path
    handle: ctypes.CDLL

    def run(self, kernel: KernelSource, x: np.ndarray, w: np.ndarray, y: np.ndarray,
            nthreads: int = 1, epilogue: EpilogueArgs | None = None,
            nchw: bool = False) -> None:
        """Run ``kernel`` on x (NHWC), RSCK weights (packed here) and y, checking shapes;
        ``epilogue`` (its residual shaped as y) is fused into the store. With ``nchw``,
        its NCHW entry point reads x as (N, C, H, W) and writes y as (N, K, Ho, Wo)."""
        if nchw and kernel.nchw_name is None:
            raise ValueError(f"{kernel.name} has no NCHW entry point")
        self._check(kernel, x, w, y, nchw)
        w = packed_weights(kernel, w)
        fn = getattr(self.handle, kernel.nchw_name if nchw else kernel.name)
        fn.restype = None
        fn.argtypes = [_FLOAT_P, _FLOAT_P, _FLOAT_P, ctypes.c_int, ctypes.c_void_p]
        fn(x.ctypes.data_as(_FLOAT_P), w.ctypes.data_as(_FLOAT_P), y.ctypes.data_as(_FLOAT_P),
           int(nthreads), None if epilogue is None else ctypes.addressof(epilogue))

    def time(self, kernel: KernelSource, x: np.ndarray, w: np.ndarray, y: np.ndarray,
             reps: int, nthreads: int = 1) -> float:
        """Seconds for ``reps`` back-to-back calls, timed in C (library built with timers)."""
        self._check(kernel, x, w, y)
        w = packed_weights(kernel, w)
        fn = getattr(self.handle, timer_name(kernel))
        fn.restype = ctypes.c_double
        fn.argtypes = [_FLOAT_P, _FLOAT_P, _FLOAT_P, ctypes.c_long, ctypes.c_int]
        return fn(x.ctypes.data_as(_FLOAT_P), w.ctypes.data_as(_FLOAT_P),
                  y.ctypes.data_as(_FLOAT_P), int(reps), int(nthreads))

    def time_each(self, kernel: KernelSource, copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  calls: int, nthreads: int = 1) -> list[float]:
        """Per-call seconds of ``calls`` calls rotating over the (x, w, y) ``copies``."""
        for x, w, y in copies:
            self._check(kernel, x, w, y)
        copies = [(x, packed_weights(kernel, w), y) for x, w, y in copies]  # before timing
        n = len(copies)
        arrays = [(ctypes.POINTER(ctypes.c_float) * n)(*[c[i].ctypes.data_as(_FLOAT_P)
                                                          for c in copies]) for i in range(3)]
        out = (ctypes.c_double * calls)()
        fn = getattr(self.handle, each_timer_name(kernel))
        fn.restype = None
        fn(arrays[0], arrays[1], arrays[2], ctypes.c_int(n), ctypes.c_int(calls),
           ctypes.c_int(nthreads), out)
        return list(out)

    @staticmethod
    def _check(kernel: KernelSource, x: np.ndarray, w: np.ndarray, y: np.ndarray,
               nchw: bool = False) -> None:
        spec = kernel.spec
        nhwc_x, nhwc_y = spec.input_shape(), spec.output_shape()
        expected = {"x": (spec.n, nhwc_x[3], spec.h, spec.w) if nchw else nhwc_x,
                    "w": spec.weight_shape(),
                    "y": (spec.n, nhwc_y[3], spec.ho, spec.wo) if nchw else nhwc_y}
        for label, array in (("x", x), ("w", w), ("y", y)):
            if array.dtype != np.float32 or not array.flags.c_contiguous:
                raise ValueError(f"{label} must be a C-contiguous float32 array")
            if array.shape != expected[label]:
                raise ValueError(f"{label} has shape {array.shape}, kernel expects "
                                 f"{expected[label]}")
        if not y.flags.writeable:
            raise ValueError("y must be writeable")


def symbol_address(handle: ctypes.CDLL, name: str) -> int:
    """The address of function ``name`` in a loaded library (for ``_kernels.run_compiled``,
    which calls it without ctypes; AttributeError when the library has no such symbol)."""
    return ctypes.cast(getattr(handle, name), ctypes.c_void_p).value


def packed_weights(kernel: KernelSource, w: np.ndarray) -> np.ndarray:
    """The kernel's weight panels from RSCK weights (``weights.pack_panels``)."""
    from .weights import pack_panels
    return pack_panels(w, kernel.spec, kernel.panel)


def timer_name(kernel: KernelSource) -> str:
    return f"{kernel.name}_time"


def each_timer_name(kernel: KernelSource) -> str:
    return f"{kernel.name}_time_each"


def timing_harness(kernel: KernelSource) -> str:
    """C function timing ``reps`` calls of ``kernel`` without leaving C between calls.

    The empty asm with a memory clobber after each call keeps the compiler from merging
    or dropping repeated calls once it inlines the kernel.
    """
    return f"""
double {timer_name(kernel)}(const float *restrict x, const float *restrict w,
        float *restrict y, long reps, int nthreads)
{{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < reps; i++) {{
        {kernel.name}(x, w, y, nthreads, 0);
        __asm__ volatile("" : : "r"(y) : "memory");
    }}
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}}

/* One time per call, rotating over `copies` tensor sets so that a call does not find
 * its data left in the caches by the previous one (the paper's cold-cache protocol). */
void {each_timer_name(kernel)}(const float *const *xs, const float *const *ws,
        float *const *ys, int copies, int calls, int nthreads, double *seconds)
{{
    for (int i = 0; i < calls; i++) {{
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        {kernel.name}(xs[i % copies], ws[i % copies], ys[i % copies], nthreads, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        seconds[i] = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }}
}}
"""


#: The headers a generated kernel and its timers include, in this order.
KERNEL_HEADERS = ("time.h", "immintrin.h", "stdint.h", "string.h")

#: Precompiled headers this process made: (folder, compiler, flags) -> the flags that
#: include it, () where none could be made.
_headers: dict[tuple[Path, str, tuple[str, ...]], tuple[str, ...]] = {}
_headers_lock = threading.Lock()


def precompiled_header(compiler: str, flags: tuple[str, ...], workdir: Path
                       ) -> tuple[str, ...]:
    """The flags (``-include <header>``) that give a compile in ``workdir`` with
    ``compiler`` and ``flags`` the kernels' headers precompiled, made on first use; ()
    with clang or where making it failed (the compile then parses the headers itself).

    A searched kernel's compile spent 0.5-1 s of its 2-4 s parsing ``immintrin.h``
    (GCC 12 on a Xeon model 207); with the headers precompiled, Yolo9000's 11 best
    kernels compiled in 86 % of the time. GCC uses a ``.gch`` only when it was made
    with the same options and ignores it otherwise, reading the header itself, so a
    stale or foreign one costs time, never correctness; like the libraries, it is
    made by this process in a private folder."""
    key = (workdir, compiler, flags)
    with _headers_lock:
        if key in _headers:
            return _headers[key]
        if "clang" in compiler_version(compiler).lower():
            _headers[key] = ()
            return ()
        _, epilogue = _include_flags()
        text = "".join(f"#include <{h}>\n" for h in KERNEL_HEADERS) \
            + f'#include "{EPILOGUE_HEADER}"\n'
        digest = hashlib.sha1("|".join((compiler, *flags, text, epilogue)).encode()
                              ).hexdigest()[:16]
        header = workdir / f"headers_{digest}.h"
        atomic_write(header, text)
        tmp_path = workdir / f".{header.name}.{os.getpid()}.gch"
        try:
            proc = subprocess.run([compiler, *flags, "-x", "c-header", str(header), "-o",
                                   str(tmp_path)], capture_output=True, timeout=120)
            made = proc.returncode == 0
        except (OSError, subprocess.SubprocessError):
            made = False
        if made:
            publish(tmp_path, header.with_name(header.name + ".gch"))
        else:
            tmp_path.unlink(missing_ok=True)
        _headers[key] = ("-include", str(header)) if made else ()
        return _headers[key]


def build(kernels: list[KernelSource], workdir: Path | None = None,
          extra_flags: tuple[str, ...] = (), timers: bool = False,
          timeout: float | None = None) -> BuiltLibrary:
    """Compile ``kernels`` into one shared object and load it.

    With ``timers``, each kernel also gets a ``<name>_time`` function (see
    :meth:`BuiltLibrary.time`). The object is named by the hash of its sources and
    flags, so rebuilding the same kernels reuses it. ``timeout`` (seconds) limits the
    compiler: past it, :class:`CompileTimeout`. The kernels of one build are of one
    vector family, compiled with that family's flags (:func:`kernel_cflags`).
    """
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found (set CC or put cc/gcc/clang on PATH)", "")
    families = {kernel.isa for kernel in kernels}
    if len(families) > 1:
        raise ValueError(f"one build compiles one vector family, got "
                         f"{', '.join(sorted(f.value for f in families))}")
    isa = families.pop() if families else None
    # $TTILE_JIT_CFLAGS adds flags to every kernel compiled at run time (e.g. the
    # sanitizers, when the extension itself was built with TTILE_SANITIZE).
    extra_flags = (*extra_flags, *os.environ.get("TTILE_JIT_CFLAGS", "").split())
    parts = ["#include <time.h>"] if timers else []
    for kernel in kernels:
        parts.append(kernel.code)
        if timers:
            parts.append(timing_harness(kernel))
    source = "\n".join(parts)
    includes, header = _include_flags()
    flags = (*(kernel_cflags(isa) if isa else kernel_cflags()), *extra_flags, *includes)
    digest = hashlib.sha1((compiler + "|" + " ".join(flags) + "|" + header + "|"
                           + source).encode()).hexdigest()
    workdir = build_directory(workdir)
    lib_path = workdir / f"kernels_{digest[:16]}.so"
    with _built_lock:
        built_here = lib_path in _built
    if not built_here:
        c_path = workdir / f"kernels_{digest[:16]}.c"
        atomic_write(c_path, source)
        tmp_path = workdir / f".{lib_path.name}.{os.getpid()}.tmp"
        try:
            headers = precompiled_header(compiler, flags, workdir)
            proc = subprocess.run([compiler, *flags, *headers, "-shared", "-o",
                                   str(tmp_path), str(c_path)], capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            tmp_path.unlink(missing_ok=True)
            raise CompileTimeout(f"compiling {c_path} took more than {timeout:g} s", "") \
                from None
        if proc.returncode != 0:
            raise BuildError(f"compiling {c_path} failed", proc.stderr)
        publish(tmp_path, lib_path)  # a concurrent builder sees all or nothing
        with _built_lock:
            _built.add(lib_path)
    return BuiltLibrary(lib_path, ctypes.CDLL(str(lib_path)))


#: Libraries this process compiled (the only ones :func:`build` loads without compiling).
_built: set[Path] = set()
_built_lock = threading.Lock()
_private_dir: Path | None = None


def private_directory_problem(path: Path) -> str | None:
    """Why ``path`` is not a folder to load code from (None: a real directory of this
    user that neither group nor others may write)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, not {os.getuid()}"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write it (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _process_directory() -> Path:
    """This process's own build folder (``mkdtemp``: 0700, a fresh name), removed at exit."""
    global _private_dir
    with _built_lock:
        if _private_dir is None or not _private_dir.is_dir():
            import atexit
            _private_dir = Path(tempfile.mkdtemp(prefix="ttile-build-"))
            atexit.register(shutil.rmtree, _private_dir, True)
        return _private_dir


def build_directory(requested: Path | None = None) -> Path:
    """The folder :func:`build` compiles into: ``requested`` when it is private (created
    with mode 0700 if missing), else, with a warning, this process's own folder."""
    if requested is None:
        return _process_directory()
    requested = Path(requested)
    try:
        requested.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass   # the check below says what is wrong with it
    problem = private_directory_problem(requested)
    if problem is None:
        return requested
    private = _process_directory()
    warnings.warn(f"ttile: not building kernels in {requested}: {problem}; building in "
                  f"the private folder {private} instead", RuntimeWarning, stacklevel=3)
    return private


def build_batches(batches: list[list[KernelSource]], jobs: int = 2, timers: bool = False,
                  workdir: Path | None = None, extra_flags: tuple[str, ...] = (),
                  timeout: float | None = None) -> list[Union[BuiltLibrary, BuildError]]:
    """Build several batches concurrently; a failed batch is returned as its BuildError."""

    def one(batch: list[KernelSource]) -> Union[BuiltLibrary, BuildError]:
        try:
            return build(batch, workdir=workdir, extra_flags=extra_flags, timers=timers,
                         timeout=timeout)
        except BuildError as error:
            return error

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, batches))


def assembly(kernel: KernelSource, extra_flags: tuple[str, ...] = ()) -> str:
    """The compiler's assembly for ``kernel`` (to inspect register use): compiled with
    ``TTILE_CHECK_SPILLS``, which moves the NCHW entry point's tile buffer off the stack,
    so that any vector store to the stack is a spill."""
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found", "")
    includes, _ = _include_flags()
    proc = subprocess.run([compiler, *kernel_cflags(kernel.isa), "-DTTILE_CHECK_SPILLS",
                           *extra_flags, *includes,
                           "-S", "-o", "-",
                           "-x", "c", "-"],
                          input=kernel.code, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError("compiling to assembly failed", proc.stderr)
    return proc.stdout
