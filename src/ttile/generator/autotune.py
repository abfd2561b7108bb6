"""Step 5 of the TTile search: autotuning a layer's pruned scheme space into records.

Candidates are screened in order within a time budget (a few cold calls each), the
fastest few are re-timed with the paper's protocol, and the generic kernel is timed the
same way as the bar to beat; with ``--warm-check`` the best scheme is then compared with
the generic kernel warm, side by side. Everything goes through the tuning layer's one
runner (:mod:`ttile.tuning.bench`) and is appended to the tuning database, so a search
resumes where it stopped and emitting needs no measurement. Failures (build error, wrong
answer, time-out) are recorded as values; they never stop the search.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterator, Optional, Sequence

from ..core.cbuild import build
from ..core.codegen import GENERATOR_VERSION, generate
from ..core.kinds import Isa
from ..core.scheme import Scheme
from ..core.spec import ConvSpec
from ..tuning.bench import (LayerBench, build_check_time, check_and_time,
                            generic_packed_copies, head_to_head, middle_median,
                            run_and_check, time_generic)
from ..tuning.records import (GENERIC_REVISION, Contender, Protocol, RecordStatus, Strategy,
                              TuningDatabase, TuningRecord, new_comparison_id)
from .search import Candidate


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


class Phase(Enum):
    """Where a layer's measurement time goes (``ttile-generate --verbose`` prints it)."""
    GENERIC = "generic kernel timed"
    BUILD = "built"
    CHECK = "checked and timed"
    REFINE = "re-timed"


#: The part of a layer's budget that the generic kernel's reference timings take (shared
#: by its thread counts): the bar every candidate is held to, timed with as many calls as
#: that holds.
GENERIC_SHARE = 0.15

#: Compile seconds per candidate and compiler assumed before a layer has built any (a
#: scheme's kernel takes GCC 1-3 s at -O3).
FIRST_BUILD_SECONDS = 1.5


@dataclass
class LayerClock:
    """A layer's measurement budget as wall time, and where the time went.

    ``--budget`` is what it says: the seconds one layer's measurement takes, the generic
    kernel's reference timing, the candidates' compiles, checks and timings and the
    finalists' re-timing all included. The screening compiles no more candidates at once
    than the time left allows (at the compile rate seen so far), and stops when it is
    spent; at least one candidate is always measured, so a layer ends with a result. The
    work before it (the scheme space: the model and the pruning; the inputs and their
    float64 reference) is fixed per layer and reported apart (``fixed_seconds``), and so
    is the floor no budget goes below: the first candidate's compile and check
    (``first_seconds``: a compile alone took GCC 1.5-5 s on a Xeon model 207). Every
    timing makes as many calls as the time left holds (the paper's twenty at most, a
    quarter of them at least). What a spent budget still runs: one candidate's compile,
    check and screening (three calls), and the fastest one's re-timing (five calls)."""
    budget_seconds: float
    started: float = field(default_factory=time.monotonic)
    fixed_seconds: float = 0.0
    first_seconds: Optional[float] = None   # to the first candidate's result
    seconds: dict = field(default_factory=lambda: {phase: 0.0 for phase in Phase})
    counts: dict = field(default_factory=lambda: {phase: 0 for phase in Phase})
    build_rate: float = FIRST_BUILD_SECONDS   # wall seconds per candidate and compiler

    @property
    def deadline(self) -> float:
        return self.started + self.budget_seconds

    def remaining(self, deadline: Optional[float] = None) -> float:
        return (self.deadline if deadline is None else deadline) - time.monotonic()

    def share(self, fraction: float) -> float:
        """A deadline ``fraction`` of the time left from now (a thread count's part)."""
        return time.monotonic() + max(0.0, self.remaining()) * fraction

    @contextlib.contextmanager
    def timing(self, phase: Phase, count: int = 1) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(phase, time.monotonic() - started, count)

    def add(self, phase: Phase, seconds: float, count: int = 1) -> None:
        self.seconds[phase] += seconds
        self.counts[phase] += count

    def summary(self) -> str:
        spent = time.monotonic() - self.started
        parts = [f"{self.counts[phase]} {phase.value} {self.seconds[phase]:.1f} s"
                 for phase in Phase if self.counts[phase]]
        first = ("" if self.first_seconds is None else
                 f", the first candidate's compile and check {self.first_seconds:.1f} s of it")
        return (f"{spent:.1f} s of a {self.budget_seconds:g} s budget ("
                + "; ".join(parts) + f"){first}; scheme space, inputs and reference "
                f"{self.fixed_seconds:.1f} s before it")


def _today() -> str:
    return datetime.date.today().isoformat()


def generic_record(name: str, spec: ConvSpec, threads: int, bench: LayerBench, cpu: str,
                   isa: Isa, calls: int = 20, drop: int = 5,
                   seconds: Optional[float] = None) -> TuningRecord:
    """Time the generic kernel of the family ``isa`` with the paper's cold-cache
    protocol (fewer calls where ``calls`` do not fit in ``seconds``): its record,
    measured on ``cpu``.

    Its weights are packed before timing, as every candidate's are: timed through the
    per-call entry point, it also paid for packing, and a small layer's generic time came
    out 4x too slow (Yolo9000-5: 24 GFLOP/s cold, 101 warm)."""
    # the copies the calls can rotate over, no more: packing is not free
    copies = generic_packed_copies(spec, bench.copies[:calls + 1], isa)
    times = time_generic(spec, copies, threads, calls, isa, seconds)
    problem = bench.check(copies[0][2])
    seconds = middle_median(times, drop, calls)
    return TuningRecord(
        layer=name, spec=spec, contender=Contender.GENERIC, scheme="", threads=threads,
        status=RecordStatus.WRONG if problem else RecordStatus.OK, seconds=seconds,
        gflops=spec.flops / seconds / 1e9, calls=len(times), protocol=Protocol.PAPER,
        strategy=None, microkernels="", cpu=cpu,
        generator_version=GENERATOR_VERSION, measured_on=_today(), detail=problem or "",
        generic_revision=GENERIC_REVISION)


def scheme_record(name: str, spec: ConvSpec, scheme: str, strategy: Optional[Strategy],
                  microkernels: str, threads: int, status: RecordStatus, seconds: float,
                  calls: int, protocol: Protocol, cpu: str, detail: str = "") -> TuningRecord:
    """The record of one searched scheme's measurement on ``cpu``."""
    return TuningRecord(
        layer=name, spec=spec, contender=Contender.SCHEME, scheme=scheme, threads=threads,
        status=status, seconds=seconds,
        gflops=spec.flops / seconds / 1e9 if seconds > 0 else 0.0, calls=calls,
        protocol=protocol, strategy=strategy, microkernels=microkernels, cpu=cpu,
        generator_version=GENERATOR_VERSION, measured_on=_today(), detail=detail)


def measure_generic(name: str, spec: ConvSpec, threads: int, database: TuningDatabase,
                    bench: LayerBench, calls: int = 20, drop: int = 5,
                    seconds: Optional[float] = None) -> TuningRecord:
    """Time the generic kernel (of the database's vector family) with the paper's
    cold-cache protocol, within ``seconds`` where given, and record it (see
    :func:`generic_record`)."""
    record = generic_record(name, spec, threads, bench, database.cpu_id, database.isa,
                            calls, drop, seconds)
    database.add(record)
    return record


def tune_layer(name: str, spec: ConvSpec, candidates: Sequence[Candidate], threads: int,
               database: TuningDatabase, bench: LayerBench,
               settings: TuneSettings = TuneSettings(),
               progress: Callable[[str], None] = lambda message: None,
               command: str = "ttile-generate", clock: Optional[LayerClock] = None,
               deadline: Optional[float] = None) -> Optional[TuningRecord]:
    """Screen candidates in order until the deadline (``clock``'s, or ``deadline`` when
    given, or ``settings.budget_seconds`` from now), compiling no more at once than the
    time left allows, then re-time the fastest with the paper's protocol while time is
    left, generating them in the database's vector family; the time spent is added to
    ``clock``. Returns the best record (None if nothing ran correctly)."""
    if clock is None:
        clock = LayerClock(settings.budget_seconds)
    if deadline is None:
        deadline = clock.deadline

    def group_size() -> int:   # as many as the time left compiles, at least one
        return max(1, int(clock.remaining(deadline) * settings.jobs / clock.build_rate))

    def next_group(attempted: int) -> bool:
        return attempted == 0 or clock.remaining(deadline) > 0

    def time_left() -> float:   # a timing's share: fewer calls where they do not fit
        return max(0.0, clock.remaining(deadline))

    def record(candidate: Candidate, status: RecordStatus, seconds: float, calls: int,
               protocol: Protocol, detail: str = "") -> TuningRecord:
        rec = scheme_record(name, spec, str(candidate.scheme), candidate.strategy,
                            candidate.microkernel_text, threads, status, seconds, calls,
                            protocol, database.cpu_id, detail)
        database.add(rec)
        return rec

    todo = [c for c in candidates
            if not database.has(spec, str(c.scheme), threads, Protocol.SCREEN)]
    started = time.monotonic()
    built = {}   # scheme text: (kernel, library) screened here, re-timed without a rebuild
    last = time.monotonic()
    for measured in build_check_time(
            spec, [c.scheme for c in todo], bench, threads, calls=settings.screen_calls,
            batch_size=settings.batch_size, jobs=settings.jobs, command=command,
            slow_seconds=settings.call_timeout_seconds, next_group=next_group,
            group_size=group_size, isa=database.isa, seconds=time_left):
        candidate = todo[measured.index]
        if clock.first_seconds is None:
            clock.first_seconds = time.monotonic() - started
        clock.add(Phase.BUILD, measured.build_seconds)
        clock.add(Phase.CHECK, measured.check_seconds, int(measured.library is not None))
        clock.build_rate = max(0.1, measured.build_seconds * settings.jobs)
        record(candidate, measured.status, measured.seconds, measured.calls,
               Protocol.SCREEN, measured.detail)
        if measured.library is not None:
            built[str(candidate.scheme)] = (measured.kernel, measured.library)
        now = time.monotonic()
        progress(f"{name} t{threads}: {measured.status.value} {measured.seconds * 1e3:.2f} ms "
                 f"({now - last:.1f} s) {candidate.scheme}")
        last = now

    # Re-time the fastest screened schemes with the paper's protocol.
    screened = sorted(database.for_layer(spec, threads, Protocol.SCREEN),
                      key=lambda r: r.seconds)
    by_text = {str(c.scheme): c for c in candidates}
    finalists = [r for r in screened if r.scheme in by_text][:settings.refine_top]
    todo = [by_text[r.scheme] for r in finalists
            if not database.has(spec, r.scheme, threads, Protocol.PAPER)]
    # The finalists screened in this call are timed in the libraries they were screened
    # in: compiling them again cost a quick ResNet-18 search a quarter of its time.
    # The fastest always (a kernel already built: twenty calls, or as many as the time
    # left holds, five at least), the others only while time is left: without a paper
    # timing, the screening's stands.
    for rank, candidate in enumerate([c for c in todo if str(c.scheme) in built]):
        if rank and clock.remaining(deadline) <= 0:
            break
        kernel, library = built[str(candidate.scheme)]
        with clock.timing(Phase.REFINE):
            timing = check_and_time(library, kernel, bench, threads, settings.paper_calls,
                                    settings.paper_drop, time_left())
        record(candidate, timing.status, timing.seconds, timing.calls, Protocol.PAPER,
               timing.detail)
    todo = [c for c in todo if str(c.scheme) not in built]
    if todo and clock.remaining(deadline) > 0:
        for measured in build_check_time(
                spec, [c.scheme for c in todo], bench, threads, calls=settings.paper_calls,
                drop=settings.paper_drop, batch_size=len(todo), jobs=1, command=command,
                isa=database.isa, seconds=time_left):
            clock.add(Phase.BUILD, measured.build_seconds)
            clock.add(Phase.REFINE, measured.check_seconds)
            if measured.status is RecordStatus.BUILD_ERROR:
                continue  # built fine when screened: nothing worth a record
            record(todo[measured.index], measured.status, measured.seconds,
                   measured.calls, Protocol.PAPER, measured.detail)
    return database.best(spec, threads)


def compare_warm(name: str, spec: ConvSpec, threads: int, best: TuningRecord,
                 database: TuningDatabase, rounds: int = 15
                 ) -> tuple[TuningRecord, TuningRecord]:
    """Time ``best``'s scheme and the generic kernel side by side, warm, and record both
    under one comparison id.

    The cold-cache screening ranks schemes fairly among themselves, but a kernel serves
    warm calls too and the generic kernel improves between searches: whether a searched
    kernel ships is decided by these comparisons when there are any.
    """
    kernel = generate(Scheme.parse(best.scheme), spec, "ttile-generate (warm check)",
                      database.isa)
    library = build([kernel])
    bench = LayerBench.make(spec, copy_bytes=0, max_copies=1, seed=2)
    problem = run_and_check(library, kernel, bench, threads) or ""
    status = RecordStatus.WRONG if problem else RecordStatus.OK
    generic_seconds, (searched_seconds,) = head_to_head(spec, bench, [(kernel, library)],
                                                        threads, rounds, database.isa)
    comparison = new_comparison_id()
    common = dict(layer=name, spec=spec, threads=threads, calls=rounds,
                  protocol=Protocol.WARM, cpu=database.cpu_id,
                  generator_version=GENERATOR_VERSION, measured_on=_today(),
                  comparison=comparison)
    searched = TuningRecord(contender=Contender.SCHEME, scheme=best.scheme, status=status,
                            seconds=searched_seconds,
                            gflops=spec.flops / searched_seconds / 1e9,
                            strategy=best.strategy, microkernels=best.microkernels,
                            detail=problem, **common)
    generic = TuningRecord(contender=Contender.GENERIC, scheme="", status=RecordStatus.OK,
                           seconds=generic_seconds, gflops=spec.flops / generic_seconds / 1e9,
                           strategy=None, microkernels="", generic_revision=GENERIC_REVISION,
                           **common)
    database.add(searched)
    database.add(generic)
    return searched, generic
