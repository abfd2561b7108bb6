"""Build -> check -> time: the one runner every measurement of a kernel goes through.

* :class:`LayerBench` makes a problem's inputs, its float64 reference output and the
  tolerance once, with enough tensor copies that rotating over them leaves the caches
  cold (the paper's protocol).
* :func:`build_check_time` compiles candidate schemes in batches (two compilers at a
  time), runs each once and checks it against the reference, and times only the correct
  ones. A wrong kernel is reported as such, never timed and never dropped silently.
* :func:`time_generic` times the hand-written generic kernel the way ``conv2d`` runs it
  (weights packed beforehand), and :func:`head_to_head` times kernels side by side with
  it, warm, in interleaved rounds, which is what the ship decision rests on.
* A timing given a time limit makes as many calls as fit it, judged by its first call
  (:func:`calls_within`), down to a few: a 2 s budget cannot hold twenty 0.2 s calls;
  every record says how many calls it rests on.

The offline generator and the run-time tuner both measure through these functions.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from .. import _kernels
from ..core.cbuild import BuildError, BuiltLibrary, build_batches, symbol_address
from ..core.codegen import KernelSource, generate
from ..core.kinds import Isa
from ..core.reference import conv2d_nhwc_f64
from ..core.scheme import Scheme
from ..core.spec import ConvSpec
from ..core.vectors import extension_code
from ..core.weights import grouped_blocks, pack_panels
from .records import RecordStatus

Copies = list[tuple[np.ndarray, np.ndarray, np.ndarray]]


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """numpy's BLAS on one thread while the float64 reference is computed.

    A multi-threaded BLAS call leaves its worker threads spinning for a while after it
    returns; a two-thread kernel timed next shared the two cores with them and ran at
    one-thread speed, both contenders alike, so warm verdicts came out as ties or worse
    (Yolo9000-12 at 2 threads: 24.0 ms against 12.4 in a fresh process). With one BLAS
    thread no worker is woken. Uses threadpoolctl (the ``jit``/``generate`` extras);
    without it, nothing changes (set OPENBLAS_NUM_THREADS=1 instead).
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@dataclass
class LayerBench:
    """Inputs, reference output and tolerance of one layer, made once and reused."""

    spec: ConvSpec
    copies: Copies
    expected: np.ndarray
    tolerance: np.ndarray

    @classmethod
    def make(cls, spec: ConvSpec, copy_bytes: int = 256 << 20, max_copies: int = 64,
             seed: int = 0) -> "LayerBench":
        rng = np.random.default_rng(seed)
        x = rng.uniform(-1, 1, spec.input_shape()).astype(np.float32)
        w = rng.uniform(-1, 1, spec.weight_shape()).astype(np.float32)
        pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
        stride = (spec.stride_h, spec.stride_w)
        dilation = (spec.dilation_h, spec.dilation_w)
        with single_threaded_blas():
            expected = conv2d_nhwc_f64(x, w, stride, pads, dilation, spec.groups)
            magnitude = conv2d_nhwc_f64(np.abs(x), np.abs(w), stride, pads, dilation,
                                        spec.groups)
        terms = spec.c * spec.r * spec.s
        tolerance = 8 * np.sqrt(terms) * np.finfo(np.float32).eps * magnitude + 1e-30
        per_copy = 4 * (x.size + w.size + expected.size)
        count = int(min(max_copies, max(2, -(-copy_bytes // per_copy))))
        # outputs on a line, as every output ttile allocates (the generic kernel streams a
        # large one only there), and written once: the first kernel timed would otherwise
        # pay for mapping their pages (Yolo9000-0's first generic calls: 2x slower)
        copies = []
        for i in range(count):
            y = _kernels.empty_aligned(expected.shape)
            y.fill(0.0)
            copies.append((x, w, y) if i == 0 else (x.copy(), w.copy(), y))
        return cls(spec, copies, expected, tolerance)

    def check(self, y: np.ndarray) -> Optional[str]:
        """None when ``y`` matches the reference within tolerance, else what is off."""
        bad = ~(np.abs(y.astype(np.float64) - self.expected) <= self.tolerance)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            return f"{int(bad.sum())} outputs off, first at {idx}"
        return None


def calls_within(first_seconds: float, seconds: Optional[float], most: int) -> int:
    """How many timed calls (the first, of ``first_seconds``, included) fit in
    ``seconds``: ``most`` when there is no limit, else as many as fit, but no fewer than
    a quarter of ``most`` and three, so that a median of the middle calls still means
    something."""
    if seconds is None:
        return most
    fewest = min(most, max(3, most // 4))
    fit = int(seconds / max(first_seconds, 1e-9))
    return max(fewest, min(most, fit))


def middle_median(times: Sequence[float], drop: int, most: int) -> float:
    """The median of ``times`` after dropping the fastest and slowest: ``drop`` of each
    for ``most`` calls, in proportion for fewer (the paper's 5 of 20, 1 of 5)."""
    times = sorted(times)
    drop = drop * len(times) // most if most else 0
    return statistics.median(times[drop:len(times) - drop] if len(times) > 2 * drop
                             else times)


@dataclass(frozen=True)
class Timing:
    """A kernel checked and, when right, timed: its status, median seconds per call (0
    unless ok), what is off, and how many calls were timed."""
    status: RecordStatus
    seconds: float
    detail: str
    calls: int


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What :func:`build_check_time` found for one candidate."""

    index: int                      # position in the candidate list
    kernel: KernelSource
    library: Optional[BuiltLibrary]  # None when the build failed
    status: RecordStatus
    seconds: float                  # median per call; 0 unless ok
    detail: str = ""
    calls: int = 0                  # timed calls the median rests on
    build_seconds: float = 0.0      # its share of its group's compile (wall time)
    check_seconds: float = 0.0      # checking it against the reference and timing it


def run_and_check(library: BuiltLibrary, kernel: KernelSource, bench: LayerBench,
                  threads: int) -> Optional[str]:
    """Run ``kernel`` once on the bench's first tensors: None if its output matches the
    float64 reference, else what is off. A kernel with an NCHW entry point is run there
    too, on the same input in NCHW: it must give the same sums, bit for bit, in NCHW."""
    x, w, y = bench.copies[0]
    y.fill(np.nan)
    library.run(kernel, x, w, y, threads)
    problem = bench.check(y)
    if problem or kernel.nchw_name is None:
        return problem
    expected = y.transpose(0, 3, 1, 2)
    y_nchw = np.full(expected.shape, np.nan, np.float32)
    library.run(kernel, np.ascontiguousarray(x.transpose(0, 3, 1, 2)), w, y_nchw, threads,
                nchw=True)
    if not np.array_equal(y_nchw, expected):
        bad = int(np.count_nonzero(~(y_nchw == expected)))
        return f"its NCHW entry point differs from its NHWC kernel in {bad} outputs"
    return None


def check_and_time(library: BuiltLibrary, kernel: KernelSource, bench: LayerBench,
                   threads: int, calls: int, drop: int = 0,
                   seconds: Optional[float] = None) -> Timing:
    """Run ``kernel`` once and check it; if right, time ``calls`` cold calls (the library
    must be built with timers), or as many as fit in ``seconds`` (:func:`calls_within`),
    and take the median after dropping the fastest and slowest (:func:`middle_median`)."""
    problem = run_and_check(library, kernel, bench, threads)
    if problem:
        return Timing(RecordStatus.WRONG, 0.0, problem, 0)
    times = library.time_each(kernel, bench.copies, 1, threads)
    count = calls_within(times[0], seconds, calls)
    if count > 1:   # the next copies first: the first call's is in the caches
        rotated = bench.copies[1:] + bench.copies[:1]
        times += library.time_each(kernel, rotated, count - 1, threads)
    return Timing(RecordStatus.OK, middle_median(times, drop, calls), "", count)


def build_check_time(spec: ConvSpec, schemes: Sequence[Scheme], bench: LayerBench,
                     threads: int, *, calls: int, drop: int = 0, batch_size: int = 6,
                     jobs: int = 2, command: str = "ttile",
                     compile_timeout: Optional[float] = None,
                     slow_seconds: Optional[float] = None,
                     next_group: Callable[[int], bool] = lambda attempted: True,
                     next_kernel: Callable[[int], bool] = lambda timed: True,
                     isa: Isa = Isa.AVX512F,
                     weight_prefetch: bool = False,
                     group_size: Optional[Callable[[], int]] = None,
                     seconds: Optional[Callable[[], Optional[float]]] = None
                     ) -> Iterator[Measured]:
    """Build, check and time ``schemes`` (generated in the vector family ``isa``, with
    ``weight_prefetch`` as :func:`~ttile.core.codegen.generate` takes it) in order; yields
    one :class:`Measured` each.

    Groups of ``batch_size * jobs`` schemes are compiled at once, split into at least as
    many batches as there are compilers (``jobs`` in parallel: the quick search's 6
    candidates in one batch kept one core idle); ``group_size()``, where given, says how
    many of them the next group may hold (a time budget: no more than it leaves time to
    compile). Before each group ``next_group(attempted so far)`` and before each kernel
    ``next_kernel(correct kernels timed so far)`` may stop the run (a time budget), and
    ``seconds()``, where given, says how long the next kernel's timing may take (fewer
    calls than ``calls`` where they do not fit: :func:`check_and_time`). A kernel slower
    than ``slow_seconds`` per call is a time-out.
    """
    attempted = timed = 0
    start = 0
    while start < len(schemes):
        if not next_group(attempted):
            return
        step = batch_size * jobs
        if group_size is not None:
            step = max(1, min(step, group_size()))
        group = list(enumerate(schemes))[start:start + step]
        start += step
        parts = max(-(-len(group) // batch_size), min(jobs, len(group)))
        batches = [group[len(group) * i // parts:len(group) * (i + 1) // parts]
                   for i in range(parts)]
        sources = [[generate(scheme, spec, command, isa, weight_prefetch)
                    for _, scheme in batch]
                   for batch in batches]
        compile_started = time.monotonic()
        libraries = build_batches(sources, jobs=jobs, timers=True, timeout=compile_timeout)
        build_share = (time.monotonic() - compile_started) / len(group)
        for batch, kernels, library in zip(batches, sources, libraries):
            for (index, _), kernel in zip(batch, kernels):
                if not next_kernel(timed):
                    return
                attempted += 1
                if isinstance(library, BuildError):
                    yield Measured(index=index, kernel=kernel, library=None,
                                   status=RecordStatus.BUILD_ERROR, seconds=0.0,
                                   detail=library.log[-1500:] or str(library),
                                   build_seconds=build_share)
                    continue
                check_started = time.monotonic()
                timing = check_and_time(library, kernel, bench, threads, calls, drop,
                                        None if seconds is None else seconds())
                check_seconds = time.monotonic() - check_started
                status, detail = timing.status, timing.detail
                if status is RecordStatus.OK and slow_seconds is not None \
                        and timing.seconds > slow_seconds:
                    status, detail = RecordStatus.TIMEOUT, f"{timing.seconds:.2f} s per call"
                timed += status is RecordStatus.OK
                yield Measured(index=index, kernel=kernel, library=library, status=status,
                               seconds=timing.seconds if status is RecordStatus.OK else 0.0,
                               detail=detail, build_seconds=build_share,
                               check_seconds=check_seconds, calls=timing.calls)


def _grouped_lanes(spec: ConvSpec, isa: Isa) -> bool:
    """Whether a grouped problem's bar is the grouped kernel (several groups in the
    lanes, ``kernels/grouped_avx512.c``) rather than the generic kernel group by group:
    whichever serves its calls when no searched kernel does."""
    return isa is Isa.AVX512F and _kernels.grouped_lanes_supported(spec.c, spec.k,
                                                                  spec.groups)


def generic_packed_copies(spec: ConvSpec, copies: Copies, isa: Isa = Isa.AVX512F) -> Copies:
    """``copies`` with the weights packed for the generic kernel of family ``isa`` (as
    ``conv2d`` does); for a grouped problem, for the kernel that serves it otherwise (the
    grouped kernel's blocks, or KCRS for the generic kernel's groups)."""
    if spec.groups > 1:
        if _grouped_lanes(spec, isa):
            return [(x, grouped_blocks(w), y) for x, w, y in copies]
        return [(x, np.ascontiguousarray(w.transpose(3, 2, 0, 1)), y) for x, w, y in copies]
    panel = _kernels.generic_panel(spec.k, spec.wo, extension_code(isa))
    return [(x, _kernels.pack_weights(w, panel), y) for x, w, y in copies]


def _run_generic(spec: ConvSpec, threads: int, isa: Isa = Isa.AVX512F
                 ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    code = extension_code(isa)
    if spec.groups > 1 and _grouped_lanes(spec, isa):
        def run(x: np.ndarray, packed: np.ndarray, y: np.ndarray) -> None:
            _kernels.conv2d_grouped(x, packed, y, spec.stride_h, spec.stride_w, spec.pad_top,
                                    spec.pad_left, threads, groups=spec.groups,
                                    dil_h=spec.dilation_h, dil_w=spec.dilation_w)
        return run

    def run(x: np.ndarray, packed: np.ndarray, y: np.ndarray) -> None:
        _kernels.conv2d_generic_packed(x, packed, y, spec.stride_h, spec.stride_w,
                                       spec.pad_top, spec.pad_left, threads, False,
                                       spec.groups > 1, dil_h=spec.dilation_h,
                                       dil_w=spec.dilation_w, groups=spec.groups, isa=code)
    return run


def time_generic(spec: ConvSpec, copies: Copies, threads: int, calls: int,
                 isa: Isa = Isa.AVX512F, seconds: Optional[float] = None) -> list[float]:
    """Seconds of each of ``calls`` calls of the generic kernel of family ``isa``, or of
    as many as fit in ``seconds`` (judged by the first: :func:`calls_within`), rotating
    over ``copies`` (weights already packed: :func:`generic_packed_copies`); one untimed
    call warms up first."""
    run = _run_generic(spec, threads, isa)
    run(*copies[0])

    def timed(i: int) -> float:
        x, packed, y = copies[i % len(copies)]
        t0 = time.perf_counter()
        run(x, packed, y)
        return time.perf_counter() - t0

    times = [timed(1)]
    times += [timed(i) for i in range(2, 1 + calls_within(times[0], seconds, calls))]
    return times


def head_to_head(spec: ConvSpec, bench: LayerBench,
                 finalists: Sequence[tuple[KernelSource, BuiltLibrary]], threads: int,
                 rounds: int, isa: Isa = Isa.AVX512F) -> tuple[float, list[float]]:
    """Median seconds of the generic kernel of family ``isa`` and of each finalist,
    timed in interleaved rounds the way ``conv2d`` runs them (through the extension,
    weights packed before), so that the machine's drift hits every contender alike."""
    x, w, y = bench.copies[0]
    ((_, generic_w, _),) = generic_packed_copies(spec, [(x, w, y)], isa)
    generic = _run_generic(spec, threads, isa)
    runs = [lambda: generic(x, generic_w, y)]
    for kernel, library in finalists:
        address = symbol_address(library.handle, kernel.name)
        packed = pack_panels(w, spec, kernel.panel)
        expected_w = spec.packed_weight_shape(kernel.panel)
        runs.append(lambda a=address, p=packed, e=expected_w: _kernels.run_compiled(
            a, x, p, y, threads, spec.input_shape(), e, spec.output_shape(),
            isa=extension_code(isa), groups=spec.groups))
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(rounds + 1):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            if round_:  # round 0 warms up
                times[i].append(time.perf_counter() - t0)
    medians = [statistics.median(t) for t in times]
    return medians[0], medians[1:]
