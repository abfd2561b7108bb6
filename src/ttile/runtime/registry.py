"""The offline search's verdicts compiled into the extension, keyed by the problem, the
CPU, the vector family and the thread count they were measured on.

``kernels/gen/registry.c`` (written by :mod:`ttile.generator.emit` from every CPU's
tuning records) lists, per CPU fingerprint, vector family and thread count, each
layer's verdict: a searched kernel, or the generic kernel. A verdict is evidence about
that CPU, family and thread count only, so :func:`lookup` serves an entry only when all
match the call (an AVX2 verdict serves calls held to the AVX2 family, see
``ttile.set_isa``); a call elsewhere goes to the run-time tuner or the generic kernel.
"That CPU" is its core, not the VM around it: where no set was measured on this exact
fingerprint, the set of a CPU with the same vendor, family and model serves
(:func:`serving_set`, ``SetMatch.MICROARCHITECTURE``), whatever cache sizes, core count
or model name the hypervisor reports.
Each entry becomes a typed :class:`TunedEntry`, and the key is the entry's
:class:`~ttile.core.spec.ConvSpec` itself, so no caller spells out the problem's fields.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Optional

from .. import _kernels
from ..core.cpuinfo import microarchitecture
from ..core.kinds import Isa, KernelKind, SetMatch
from ..core.spec import ConvSpec
from . import settings

_SPEC_FIELDS = ("n", "k", "c", "h", "w", "r", "s", "stride_h", "stride_w", "pad_top",
                "pad_bottom", "pad_left", "pad_right", "dilation_h", "dilation_w", "groups")
#: The extension's family numbers (ttile_registry.h) as enums.
_ISAS = {_kernels.ISA_AVX512F: Isa.AVX512F, _kernels.ISA_AVX2: Isa.AVX2}


@dataclass(frozen=True, kw_only=True)
class TunedEntry:
    """One verdict of the registry."""

    index: int           # its position in the C registry (``_kernels.run_tuned``)
    spec: ConvSpec       # the problem it was generated for, exactly
    cpu: str             # CpuFingerprint.id of the CPU it was measured on
    threads: int         # the thread count it was measured at
    isa: Isa             # the vector family it was searched in (and its kernel is)
    kind: KernelKind     # TUNED: a searched kernel; GENERIC: the generic kernel won
    panel: int           # weight panel width the kernel reads (0 for GENERIC)
    layer: str
    scheme: str          # paper notation ("" for GENERIC)
    gflops: float        # measured when it was tuned (cold protocol)
    warm_gflops: float   # the kernel beside the generic kernel, warm (0: never compared)
    generic_gflops: float  # the generic kernel there, warm when compared (0: unknown)
    nchw: bool = False   # the kernel has an NCHW-output entry point (run_tuned nchw_out)
    #: The kernel is in this build: a build compiles its own CPU's sets (CMake's
    #: TTILE_KERNEL_SETS), the other sets' searched verdicts are here without their code.
    compiled: bool = True

    @cached_property
    def microkernels(self) -> str:
        """The scheme's unrolled block in paper notation ("" for GENERIC)."""
        if not self.scheme:
            return ""
        from ..core.scheme import Scheme  # the parser: only when a plan is reported
        return Scheme.parse(self.scheme).microkernel_text()

    def to_dict(self) -> dict:
        """The public form of ``ttile.tuned_kernels()``."""
        return {"index": self.index, **self.spec.to_json(), "cpu": self.cpu,
                "threads": self.threads, "isa": self.isa.value, "kind": self.kind.value,
                "parallel": self.threads > 1, "panel": self.panel, "layer": self.layer,
                "scheme": self.scheme, "gflops": self.gflops}


def _read() -> tuple[TunedEntry, ...]:
    # a verdict for a searched kernel names its scheme; the generic kernel's names none
    return tuple(TunedEntry(index=e["index"], spec=ConvSpec(**{f: e[f] for f in _SPEC_FIELDS}),
                            cpu=e["cpu"], threads=e["threads"], isa=_ISAS[e["isa"]],
                            kind=KernelKind.TUNED if e["scheme"] else KernelKind.GENERIC,
                            panel=e["panel"], layer=e["layer"], scheme=e["scheme"],
                            gflops=e["gflops"], warm_gflops=e["warm_gflops"],
                            generic_gflops=e["generic_gflops"], nchw=e["has_nchw"],
                            compiled=e["has_kernel"] or not e["scheme"])
                 for e in _kernels.registry_entries())


ENTRIES: tuple[TunedEntry, ...] = _read()
#: The searched kernels this build carries (the verdicts whose kernel is compiled in),
#: AVX-512F's first (the family a CPU that has it serves by default), then AVX2's.
KERNELS: tuple[TunedEntry, ...] = tuple(sorted(
    (e for e in ENTRIES if e.kind is KernelKind.TUNED and e.compiled),
    key=lambda e: (e.isa is not Isa.AVX512F, e.index)))
_BY_KEY: dict[tuple[ConvSpec, str, int, Isa], TunedEntry] = {
    (e.spec, e.cpu, e.threads, e.isa): e for e in ENTRIES}
_serving_cpu: Optional[str] = None


@dataclass(frozen=True)
class KernelSet:
    """The shipped set that serves this CPU in one vector family: its CPU id (None when
    no set matches) and how it matched."""

    cpu: Optional[str]
    match: SetMatch

    def describe(self) -> str:
        """The set in words, for reports: whose it is and how it matched."""
        if self.cpu is None:
            return "none shipped for this CPU"
        if self.match is SetMatch.EXACT:
            return f"{self.cpu} (shipped for this CPU)"
        return f"{self.cpu} (shipped for the same microarchitecture in another VM)"


def serving_cpu() -> str:
    """The CPU calls are served for: this one (its fingerprint id), or the one a test
    pretends to be."""
    if _serving_cpu is not None:
        return _serving_cpu
    from ..core.cpuinfo import fingerprint  # reads /proc/cpuinfo once, on first lookup
    return fingerprint().id


def match_set(cpu_id: str, isa: Isa,
              entries: tuple[TunedEntry, ...] = ENTRIES) -> KernelSet:
    """The set of ``entries`` that serves CPU ``cpu_id`` in the vector family ``isa``:
    its own, else one measured on the same microarchitecture (the one with the most
    verdicts, then the first id: deterministic), else none."""
    counts: dict[str, int] = {}
    for entry in entries:
        if entry.isa is isa:
            counts[entry.cpu] = counts.get(entry.cpu, 0) + 1
    if cpu_id in counts:
        return KernelSet(cpu_id, SetMatch.EXACT)
    core = microarchitecture(cpu_id)
    same = sorted((-count, cpu) for cpu, count in counts.items()
                  if microarchitecture(cpu) == core)
    if same:
        return KernelSet(same[0][1], SetMatch.MICROARCHITECTURE)
    return KernelSet(None, SetMatch.NONE)


_sets: dict[tuple[str, Isa], KernelSet] = {}


def serving_set(isa: Isa = Isa.AVX512F) -> KernelSet:
    """The set serving this CPU's calls in the vector family ``isa`` (see
    :func:`match_set`), resolved once per CPU and family."""
    cpu = serving_cpu()
    found = _sets.get((cpu, isa))
    if found is None:
        found = _sets[(cpu, isa)] = match_set(cpu, isa)
    return found


@contextlib.contextmanager
def pretend_cpu(cpu_id: str) -> Iterator[None]:
    """Serve another CPU's verdicts for a while: for tests of the dispatch itself (a
    kernel measured elsewhere is still correct here, only its speed is unknown)."""
    global _serving_cpu
    previous, _serving_cpu = _serving_cpu, cpu_id
    settings.invalidate_choices()
    try:
        yield
    finally:
        _serving_cpu = previous
        settings.invalidate_choices()


def lookup(spec: ConvSpec, threads: int, cpu: Optional[str] = None,
           isa: Isa = Isa.AVX512F) -> Optional[TunedEntry]:
    """The verdict for ``spec`` at exactly ``threads`` threads on ``cpu`` (default: the
    set serving this CPU, :func:`serving_set`) in the vector family ``isa``, if the
    offline search made one."""
    if cpu is None:
        cpu = serving_set(isa).cpu
        if cpu is None:
            return None
    entry = _BY_KEY.get((spec, cpu, threads, isa))
    # a searched verdict whose kernel this build left out (another CPU's set) decides
    # nothing here: the call is served as if the set had no verdict for it
    return entry if entry is None or entry.compiled else None


def cpus() -> list[str]:
    """The CPUs the registry holds verdicts for."""
    return sorted({e.cpu for e in ENTRIES})
