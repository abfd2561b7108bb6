"""Step 5 of the TTile search: autotuning, split as builder / runner / database.

* Builder: candidates are generated and compiled in batches, two compilers at a time,
  one build per distinct source (the tuning database also never re-measures a scheme).
* Runner: each kernel is checked against the float64 reference (computed once per
  layer) before it is timed; timing follows the paper: calls rotate over enough tensor
  copies that the last-level cache is cold, the extremes are dropped, the median kept.
* Database: one JSON line per measurement under ``generator/records/<cpu-id>.jsonl``
  with the CPU fingerprint, so a search resumes where it stopped and regenerating the
  kernels from the records needs no measurement.

Failures (build error, wrong answer, time-out) are recorded as values; they never stop
the search.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from .cbuild import BuildError, BuiltLibrary, build_batches
from .codegen import GENERATOR_VERSION, KernelSource, generate
from .cpuinfo import fingerprint
from .reference import conv2d_nhwc_f64
from .search import Candidate
from .spec import ConvSpec

OK, WRONG, BUILD_ERROR, TIMEOUT = "ok", "wrong_answer", "build_error", "timeout"
#: Protocol of the final warm head-to-head between a layer's best scheme and the generic
#: kernel (interleaved rounds, same tensors, weights packed beforehand, as conv2d runs).
WARM = "warm"
#: Revision of the hand-written generic kernel: warm verdicts against an older revision
#: are not counted (bump when kernels/generic_avx512.c changes how fast it runs).
GENERIC_REVISION = 5
#: Scheme text of the records that time the generic kernel, the bar a tuned kernel must
#: clear to be shipped.
GENERIC = "generic"
#: How much faster than the generic kernel, in the median of its warm head-to-heads, a
#: tuned kernel must be to ship. Most searched kernels of large layers tie the generic
#: kernel within a few percent (both run near the FMA peak), and there a single verdict is
#: a coin flip: Yolo9000-2's two-thread kernel shipped on a 0.984 ratio and then ran 7 %
#: slower than the generic kernel in the benchmark. A tie keeps the generic kernel.
SHIP_MARGIN = 0.03


@dataclass(frozen=True)
class TuningRecord:
    """One measured scheme. ``seconds`` is the median per call (0 when not ok)."""

    layer: str
    spec: dict
    scheme: str
    threads: int
    status: str
    seconds: float
    gflops: float
    calls: int
    protocol: str            # "screen" (few calls) or "paper" (20 calls, drop 5 + 5)
    strategy: str
    microkernels: str
    cpu: str
    generator_version: int
    measured_on: str
    detail: str = ""

    def key(self) -> tuple:
        return (ConvSpec.from_json(self.spec).key(), self.scheme, self.threads, self.protocol,
                self.generator_version)


class TuningDatabase:
    """Append-only JSON-lines store of tuning records for one CPU."""

    def __init__(self, directory: Path, cpu_id: Optional[str] = None):
        self.cpu_id = cpu_id or fingerprint().id
        self.path = directory / f"{self.cpu_id}.jsonl"
        self.records: list[TuningRecord] = []
        self._keys: set[tuple] = set()
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = TuningRecord(**json.loads(line))
                except (TypeError, ValueError):
                    continue  # a line cut by an interruption
                self._remember(record)

    def _remember(self, record: TuningRecord) -> None:
        self.records.append(record)
        self._keys.add(record.key())

    def has(self, spec: ConvSpec, scheme: str, threads: int, protocol: str) -> bool:
        return (spec.key(), scheme, threads, protocol, GENERATOR_VERSION) in self._keys

    def add(self, record: TuningRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(record), sort_keys=True) + "\n")
        self._remember(record)

    def for_layer(self, spec: ConvSpec, threads: int, protocol: Optional[str] = None,
                  status: str = OK) -> list[TuningRecord]:
        key = spec.key()
        return [r for r in self.records
                if ConvSpec.from_json(r.spec).key() == key and r.threads == threads
                and r.status == status and r.generator_version == GENERATOR_VERSION
                and (protocol is None or r.protocol == protocol)]

    def layers(self) -> list[tuple[ConvSpec, str]]:
        """Every problem with a correct measurement (current generator), with its name."""
        seen: dict[str, tuple[ConvSpec, str]] = {}
        for r in self.records:
            if r.status == OK and r.generator_version == GENERATOR_VERSION:
                spec = ConvSpec.from_json(r.spec)
                seen.setdefault(spec.key(), (spec, r.layer))
        return sorted(seen.values(), key=lambda item: item[1])

    def generic(self, spec: ConvSpec, threads: int) -> Optional[TuningRecord]:
        """The latest timing of the generic kernel on this problem, if any."""
        records = [r for r in self.for_layer(spec, threads, "paper") if r.scheme == GENERIC]
        return records[-1] if records else None

    def warm_verdict(self, spec: ConvSpec, threads: int, scheme: str) -> Optional[bool]:
        """Whether ``scheme`` beat the generic kernel by ``SHIP_MARGIN`` in the warm
        head-to-heads (the median of their time ratios, over every comparison recorded: one
        comparison on a shared machine can be off by 2x); None when never compared."""
        warm = self.for_layer(spec, threads, WARM)
        ratios = []
        for tuned, generic in zip(warm, warm[1:]):
            if tuned.scheme == scheme and generic.scheme == GENERIC \
                    and generic.detail == _against(scheme):
                ratios.append(tuned.seconds / generic.seconds)
        if not ratios:
            return None
        return statistics.median(ratios) < 1.0 - SHIP_MARGIN

    def best(self, spec: ConvSpec, threads: int) -> Optional[TuningRecord]:
        """The fastest ok record of a scheme, preferring the paper protocol; ties by text."""
        for protocol in ("paper", "screen"):
            records = [r for r in self.for_layer(spec, threads, protocol) if r.scheme != GENERIC]
            if records:
                return min(records, key=lambda r: (r.seconds, r.scheme))
        return None


@dataclass
class LayerBench:
    """Inputs, reference output and tolerance of one layer, made once and reused."""

    spec: ConvSpec
    copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    expected: np.ndarray
    tolerance: np.ndarray

    @classmethod
    def make(cls, spec: ConvSpec, copy_bytes: int = 256 << 20, max_copies: int = 64,
             seed: int = 0) -> "LayerBench":
        rng = np.random.default_rng(seed)
        x = rng.uniform(-1, 1, (spec.n, spec.h, spec.w, spec.c)).astype(np.float32)
        w = rng.uniform(-1, 1, (spec.r, spec.s, spec.c, spec.k)).astype(np.float32)
        pads = (spec.pad_top, spec.pad_bottom, spec.pad_left, spec.pad_right)
        stride = (spec.stride_h, spec.stride_w)
        expected = conv2d_nhwc_f64(x, w, stride, pads)
        magnitude = conv2d_nhwc_f64(np.abs(x), np.abs(w), stride, pads)
        terms = spec.c * spec.r * spec.s
        tolerance = 8 * np.sqrt(terms) * np.finfo(np.float32).eps * magnitude + 1e-30
        per_copy = 4 * (x.size + w.size + expected.size)
        count = int(min(max_copies, max(2, -(-copy_bytes // per_copy))))
        copies = [(x, w, np.empty(expected.shape, np.float32))]
        for _ in range(count - 1):
            copies.append((x.copy(), w.copy(), np.empty(expected.shape, np.float32)))
        return cls(spec, copies, expected, tolerance)

    def check(self, y: np.ndarray) -> Optional[str]:
        bad = ~(np.abs(y.astype(np.float64) - self.expected) <= self.tolerance)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            return f"{int(bad.sum())} outputs off, first at {idx}"
        return None


def _run(library: BuiltLibrary, kernel: KernelSource, bench: LayerBench, threads: int,
         calls: int, drop: int) -> tuple[str, float, str]:
    x, w, y = bench.copies[0]
    y.fill(np.nan)
    library.run(kernel, x, w, y, threads)
    problem = bench.check(y)
    if problem:
        return WRONG, 0.0, problem
    times = sorted(library.time_each(kernel, bench.copies, calls, threads))
    kept = times[drop:len(times) - drop] if len(times) > 2 * drop else times
    return OK, statistics.median(kept), ""


def measure_generic(name: str, spec: ConvSpec, threads: int, database: TuningDatabase,
                    bench: LayerBench, calls: int = 20, drop: int = 5) -> TuningRecord:
    """Time the extension's generic kernel with the same cold-cache protocol and record it.

    Its weights are packed before timing, as every tuned candidate's are (``time_each``):
    timed through the per-call entry point, the generic kernel also paid for packing, and
    a small layer's generic time came out 4x too slow (Yolo9000-5: 24 GFLOP/s cold, 101
    warm), which made the cold verdict favour tuned kernels."""
    from . import _kernels
    panel = _kernels.generic_panel(spec.k, spec.wo)
    copies = [(x, _kernels.pack_weights(w, panel), y) for x, w, y in bench.copies]

    def call(x, packed, y):
        _kernels.conv2d_generic_packed(x, packed, y, spec.stride_h, spec.stride_w,
                                       spec.pad_top, spec.pad_left, threads)

    call(*copies[0])
    problem = bench.check(copies[0][2])
    times = []
    for i in range(calls):
        x, packed, y = copies[i % len(copies)]
        t0 = time.perf_counter()
        call(x, packed, y)
        times.append(time.perf_counter() - t0)
    times.sort()
    seconds = statistics.median(times[drop:len(times) - drop])
    record = TuningRecord(name, spec.to_json(), GENERIC, threads, WRONG if problem else OK,
                          seconds, spec.flops / seconds / 1e9, calls, "paper", "generic", "",
                          database.cpu_id, GENERATOR_VERSION, datetime.date.today().isoformat(),
                          problem or "")
    database.add(record)
    return record


@dataclass(frozen=True)
class TuneSettings:
    budget_seconds: float = 150.0        # per layer and thread count
    batch_size: int = 6
    jobs: int = 2
    screen_calls: int = 7
    paper_calls: int = 20                # drop the 5 best and 5 worst, median of 10
    paper_drop: int = 5
    refine_top: int = 4
    call_timeout_seconds: float = 2.0    # a screened call slower than this is a time-out


def tune_layer(name: str, spec: ConvSpec, candidates: Sequence[Candidate], threads: int,
               database: TuningDatabase, bench: LayerBench, settings: TuneSettings = TuneSettings(),
               progress: Callable[[str], None] = lambda message: None,
               command: str = "ttile-generate") -> Optional[TuningRecord]:
    """Screen candidates in order within the budget, then re-time the best with the
    paper's protocol. Returns the best record (None if nothing ran correctly)."""
    started = time.monotonic()
    cpu = database.cpu_id
    today = datetime.date.today().isoformat()

    def record(candidate: Candidate, status: str, seconds: float, calls: int, protocol: str,
               detail: str = "") -> TuningRecord:
        gflops = spec.flops / seconds / 1e9 if seconds > 0 else 0.0
        rec = TuningRecord(name, spec.to_json(), str(candidate.scheme), threads, status, seconds,
                           gflops, calls, protocol, candidate.strategy,
                           candidate.microkernel_text, cpu, GENERATOR_VERSION, today, detail)
        database.add(rec)
        return rec

    todo = [c for c in candidates if not database.has(spec, str(c.scheme), threads, "screen")]
    slow_limit = settings.call_timeout_seconds
    for start in range(0, len(todo), settings.batch_size * settings.jobs):
        if time.monotonic() - started > settings.budget_seconds:
            break
        group = todo[start:start + settings.batch_size * settings.jobs]
        batches = [group[i:i + settings.batch_size] for i in range(0, len(group), settings.batch_size)]
        kernels = [[generate(c.scheme, spec, command) for c in batch] for batch in batches]
        libraries = build_batches(kernels, jobs=settings.jobs, timers=True)
        for batch, batch_kernels, library in zip(batches, kernels, libraries):
            for candidate, kernel in zip(batch, batch_kernels):
                if isinstance(library, BuildError):
                    record(candidate, BUILD_ERROR, 0.0, 0, "screen", library.log[-1500:])
                    continue
                t0 = time.monotonic()
                status, seconds, detail = _run(library, kernel, bench, threads,
                                               settings.screen_calls, 0)
                if status == OK and seconds > slow_limit:
                    status, detail = TIMEOUT, f"{seconds:.2f} s per call"
                record(candidate, status, seconds if status == OK else 0.0,
                       settings.screen_calls, "screen", detail)
                progress(f"{name} t{threads}: {status} {seconds * 1e3:.2f} ms "
                         f"({time.monotonic() - t0:.1f} s) {candidate.scheme}")

    # Re-time the fastest screened schemes with the paper's protocol.
    screened = sorted(database.for_layer(spec, threads, "screen"), key=lambda r: r.seconds)
    by_text = {str(c.scheme): c for c in candidates}
    finalists = [r for r in screened if r.scheme in by_text][:settings.refine_top]
    todo = [by_text[r.scheme] for r in finalists
            if not database.has(spec, r.scheme, threads, "paper")]
    if todo:
        kernels = [generate(c.scheme, spec, command) for c in todo]
        library = build_batches([kernels], jobs=1, timers=True)[0]
        if isinstance(library, BuiltLibrary):
            for candidate, kernel in zip(todo, kernels):
                status, seconds, detail = _run(library, kernel, bench, threads,
                                               settings.paper_calls, settings.paper_drop)
                record(candidate, status, seconds, settings.paper_calls, "paper", detail)
    return database.best(spec, threads)


def compare_warm(name: str, spec: ConvSpec, threads: int, scheme_text: str,
                 database: TuningDatabase, rounds: int = 15) -> tuple[TuningRecord, TuningRecord]:
    """Time ``scheme_text`` and the generic kernel side by side, warm, and record both.

    The cold-cache screening ranks schemes fairly among themselves, but a kernel serves
    warm calls too and the generic kernel improves between searches: whether a tuned
    kernel ships is decided by this comparison when it exists.
    """
    from .cbuild import build
    from .jit import head_to_head
    from .scheme import Scheme
    kernel = generate(Scheme.parse(scheme_text), spec, "ttile-generate (warm check)")
    library = build([kernel])
    bench = LayerBench.make(spec, copy_bytes=0, max_copies=1, seed=2)
    x, w, y = bench.copies[0]
    library.run(kernel, x, w, y, threads)
    problem = bench.check(y)
    generic_seconds, (tuned_seconds,) = head_to_head(spec, bench, [(kernel, library)],
                                                      threads, rounds)
    today = datetime.date.today().isoformat()
    records = []
    for scheme, seconds, status, detail in (
            (scheme_text, tuned_seconds, WRONG if problem else OK, problem or ""),
            (GENERIC, generic_seconds, OK, _against(scheme_text))):
        record = TuningRecord(name, spec.to_json(), scheme, threads, status, seconds,
                              spec.flops / seconds / 1e9, rounds, WARM, "warm", "",
                              database.cpu_id, GENERATOR_VERSION, today, detail)
        database.add(record)
        records.append(record)
    return records[0], records[1]


def _against(scheme: str) -> str:
    """The detail of a warm generic record: which scheme and generic revision it met."""
    return f"against {scheme} (generic r{GENERIC_REVISION})"
