"""The search spread over Dask workers (``ttile-generate --dask``).

The client (``ttile-generate``) ranks and prunes each layer's scheme space as always;
what costs the time - compiling candidates, checking them against float64 and timing
them - goes to Dask workers as tasks of a few candidates each, and the records come back
to the client, which alone writes the tuning database. So:

* **One measurement per worker core at a time.** Each task asks for one unit of the
  resource ``ttile-measure``; a worker offers one unit per core it may measure on
  (``--dask local:N`` starts N single-threaded worker processes with one unit each; a
  remote worker is started with ``dask worker ADDRESS --nthreads 1 --resources
  ttile-measure=1``, one per core). A task pins its thread to one core, chosen by the
  worker's name, so two workers of one machine never time on the same core.
* **Records keyed by the worker's CPU.** A task returns the fingerprint of the CPU it
  measured on with its records. Workers whose CPU is not the target's (the CPU whose
  microkernel table built the candidates) are **refused for measuring**: a kernel set
  is evidence about the CPU it was measured on, and the candidates were chosen for the
  target. Running ``ttile-generate --dask`` on a machine of the other CPU model searches
  that CPU's own set.
* **Nothing half-measured is recorded, and a lost worker costs only its task.** Records
  are written by the client when a task's whole result arrives; a task whose worker died
  is run again on another worker by the scheduler (Dask's retries), and a record already
  in the database is not measured again, so an interrupted search resumes.

Multi-thread variants need several cores of one machine at once; they are measured by
the client itself after the distributed single-thread search (as without ``--dask``).
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..core.kinds import Isa
from ..core.scheme import Scheme
from ..core.spec import ConvSpec
from ..tuning.records import (Protocol, RecordStatus, Strategy, TuningDatabase,
                              TuningRecord)

#: The Dask resource a measuring task holds: one unit per core that may time kernels.
MEASURE_RESOURCE = "ttile-measure"


class DaskUnavailable(RuntimeError):
    """``--dask`` cannot be served: distributed is missing, or no worker can measure."""


@dataclass(frozen=True)
class MeasureTask:
    """Candidates of one layer to build, check and time on a worker (``schemes`` empty:
    time the generic kernel)."""

    layer: str
    spec: ConvSpec
    schemes: tuple[str, ...]
    strategies: tuple[Optional[Strategy], ...]
    microkernels: tuple[str, ...]
    threads: int
    isa: Isa
    calls: int
    drop: int
    protocol: Protocol
    command: str


def connect(address: str):
    """A Dask client: ``local:N`` starts a LocalCluster of N single-threaded worker
    processes with one measuring unit each; anything else is a scheduler address."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise DaskUnavailable("--dask needs the distributed package: pip install "
                              "'ttile[dask]'") from None
    if address.startswith("local:"):
        try:
            workers = int(address.split(":", 1)[1])
        except ValueError:
            workers = 0
        if workers < 1:
            raise DaskUnavailable(f"--dask {address}: local:N needs N >= 1 workers")
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               resources={MEASURE_RESOURCE: 1}, dashboard_address=None)
        return Client(cluster)
    return Client(address)


def _worker_cpu() -> str:
    from ..core.cpuinfo import fingerprint
    return fingerprint().id


def measuring_workers(client, target_cpu: str) -> tuple[list[str], dict[str, str]]:
    """The workers allowed to measure (their CPU is ``target_cpu`` and they offer the
    measuring resource), and the refused ones with their CPU."""
    cpus = client.run(_worker_cpu)
    resources = {address: info.get("resources", {})
                 for address, info in client.scheduler_info()["workers"].items()}
    allowed, refused = [], {}
    for address, cpu in sorted(cpus.items()):
        if cpu != target_cpu:
            refused[address] = cpu
        elif resources.get(address, {}).get(MEASURE_RESOURCE, 0) >= 1:
            allowed.append(address)
        else:
            refused[address] = f"{cpu} (no {MEASURE_RESOURCE} resource)"
    return allowed, refused


def _pin_worker_core() -> None:
    """Pin this thread to the core that belongs to this worker (by its name)."""
    try:
        from distributed import get_worker
        name = get_worker().name
    except (ImportError, ValueError):
        return
    from ..core.cpuinfo import process_cpus
    allowed = process_cpus()
    index = name if isinstance(name, int) else sum(str(name).encode())
    os.sched_setaffinity(0, {allowed[index % len(allowed)]})


def run_task(task: MeasureTask) -> tuple[str, list[TuningRecord]]:
    """On a worker: build, check and time the task's candidates (or the generic kernel);
    the CPU measured on and the records."""
    from ..tuning.bench import LayerBench, build_check_time, single_threaded_blas
    from .autotune import generic_record, scheme_record
    _pin_worker_core()
    cpu = _worker_cpu()
    with single_threaded_blas():
        bench = LayerBench.make(task.spec, copy_bytes=64 << 20, max_copies=16)
    if not task.schemes:
        return cpu, [generic_record(task.layer, task.spec, task.threads, bench, cpu,
                                    task.isa, task.calls, task.drop)]
    records = []
    for measured in build_check_time(task.spec, [Scheme.parse(s) for s in task.schemes],
                                     bench, task.threads, calls=task.calls, drop=task.drop,
                                     batch_size=len(task.schemes), jobs=1,
                                     command=task.command, isa=task.isa):
        i = measured.index
        records.append(scheme_record(task.layer, task.spec, task.schemes[i],
                                     task.strategies[i], task.microkernels[i], task.threads,
                                     measured.status, measured.seconds, measured.calls,
                                     task.protocol, cpu, measured.detail))
    return cpu, records


class DistributedSearch:
    """Layers' measurements on the allowed workers of ``client``, recorded by the client
    into the target CPU's database (``database``)."""

    def __init__(self, client, database: TuningDatabase, workers: Sequence[str],
                 chunk: int = 4, retries: int = 3):
        self.client = client
        self.database = database
        self.workers = list(workers)
        self.chunk = chunk
        self.retries = retries
        #: records measured on another CPU and so not written (each one warned about)
        self.dropped = 0
        #: called with the futures just submitted (tests kill a worker here)
        self.on_submitted: Callable[[list], None] = lambda futures: None

    def _run(self, tasks: list[MeasureTask], deadline: Optional[float] = None) -> int:
        """Submit ``tasks`` and record each complete result; past ``deadline`` (monotonic
        seconds) the tasks not started are cancelled. Returns the records written."""
        from distributed import as_completed
        if not tasks:
            return 0
        futures = self.client.map(run_task, tasks, pure=False, workers=self.workers,
                                  allow_other_workers=False, retries=self.retries,
                                  resources={MEASURE_RESOURCE: 1})
        self.on_submitted(futures)
        written = 0
        pending = set(futures)
        for future in as_completed(futures):
            pending.discard(future)
            cpu, records = future.result()
            if cpu != self.database.cpu_id:    # a worker swapped under us: not evidence here
                self.dropped += len(records)
                warnings.warn(f"ttile-generate --dask: a worker measured on CPU {cpu}, not "
                              f"{self.database.cpu_id} (replaced after the check?): its "
                              f"{len(records)} record(s) are dropped, not written",
                              RuntimeWarning, stacklevel=2)
                continue
            for record in records:
                if record.protocol is Protocol.PAPER and \
                        record.status is RecordStatus.BUILD_ERROR:
                    continue   # built fine when screened: nothing worth a record
                if not self.database.has(record.spec, record.scheme, record.threads,
                                         record.protocol):
                    self.database.add(record)
                    written += 1
            if deadline is not None and time.monotonic() > deadline and pending:
                self.client.cancel(list(pending))
                break
        return written

    def measure_generic(self, name: str, spec: ConvSpec, threads: int, calls: int = 20,
                        drop: int = 5) -> None:
        if self.database.generic(spec, threads) is not None:
            return
        self._run([MeasureTask(name, spec, (), (), (), threads, self.database.isa, calls,
                               drop, Protocol.PAPER, "ttile-generate --dask")])

    def tune_layer(self, name: str, spec: ConvSpec, candidates, threads: int, settings,
                   command: str, deadline: Optional[float] = None) -> Optional[TuningRecord]:
        """The distributed :func:`ttile.generator.autotune.tune_layer`: candidates
        screened in chunks across the workers until ``deadline`` (default: the budget
        from now), the fastest re-timed with the paper's protocol."""
        if deadline is None:
            deadline = time.monotonic() + settings.budget_seconds
        todo = [c for c in candidates
                if not self.database.has(spec, str(c.scheme), threads, Protocol.SCREEN)]
        tasks = [self._task(name, spec, todo[i:i + self.chunk], threads,
                            settings.screen_calls, 0, Protocol.SCREEN, command)
                 for i in range(0, len(todo), self.chunk)]
        # the budget is per layer and worker: N workers measure N times as much
        self._run(tasks, deadline=deadline)
        screened = sorted(self.database.for_layer(spec, threads, Protocol.SCREEN),
                          key=lambda r: r.seconds)
        by_text = {str(c.scheme): c for c in candidates}
        finalists = [by_text[r.scheme] for r in screened if r.scheme in by_text
                     ][:settings.refine_top]
        finalists = [c for c in finalists
                     if not self.database.has(spec, str(c.scheme), threads, Protocol.PAPER)]
        self._run([self._task(name, spec, [c], threads, settings.paper_calls,
                              settings.paper_drop, Protocol.PAPER, command)
                   for c in finalists])
        return self.database.best(spec, threads)

    def _task(self, name, spec, candidates, threads, calls, drop, protocol, command):
        return MeasureTask(name, spec, tuple(str(c.scheme) for c in candidates),
                           tuple(c.strategy for c in candidates),
                           tuple(c.microkernel_text for c in candidates), threads,
                           self.database.isa, calls, drop, protocol, command)

    def close(self) -> None:
        """Close the client, and the LocalCluster it started (``local:N``)."""
        cluster = getattr(self.client, "cluster", None)
        self.client.close()
        if cluster is not None:
            cluster.close()
