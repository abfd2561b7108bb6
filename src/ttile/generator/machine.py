"""The memory hierarchy the model weighs data movement with: capacities and bandwidths.

Capacities come from the CPU fingerprint (sysfs); bandwidths are measured here by
reading a buffer that fits in each level (an eighth of L1 and L2, four times L2 for L3)
and one four times the last level (DRAM), on one pinned thread. A measurement is saved with the CPU
fingerprint under ``generator/machine/`` and reused.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..core.cpuinfo import CpuFingerprint, fingerprint
from ..core.fileio import atomic_write
from .data import DataKind, find_file

FORMAT = 1


@dataclass(frozen=True)
class CacheLevel:
    """A cache: capacity in bytes and the seconds per byte to fill it from the level below."""

    name: str
    capacity_bytes: int
    seconds_per_byte: float


@dataclass(frozen=True)
class Bandwidths:
    """Read bandwidth (bytes/s) of one core from each level of the hierarchy."""

    l1: float
    l2: float
    l3: float
    dram: float


@dataclass(frozen=True)
class MachineModel:
    cpu: CpuFingerprint
    bandwidths: Bandwidths

    def caches(self) -> tuple[CacheLevel, ...]:
        """L1, L2, L3, each filled from the level below at that level's bandwidth."""
        b = self.bandwidths
        return (CacheLevel("L1", self.cpu.l1d_bytes, 1.0 / b.l2),
                CacheLevel("L2", self.cpu.l2_bytes, 1.0 / b.l3),
                CacheLevel("L3", self.cpu.l3_bytes, 1.0 / b.dram))

    def to_json(self) -> dict:
        return {"format": FORMAT, "cpu": self.cpu.to_json(), "bandwidths": asdict(self.bandwidths)}

    @classmethod
    def from_json(cls, data: dict) -> "MachineModel":
        if data.get("format") != FORMAT:
            raise ValueError(f"unsupported machine model format {data.get('format')!r}")
        return cls(CpuFingerprint.from_json(data["cpu"]), Bandwidths(**data["bandwidths"]))


def _read_bandwidth(floats: int, min_seconds: float = 0.05) -> float:
    """Bytes per second reading ``floats`` floats over and over, with the widest vector
    loads this CPU has (AVX-512F, else AVX2: a CPU without AVX-512 measures its own
    model too)."""
    from .. import _kernels
    isa = _kernels.ISA_AVX512F if _kernels.cpu_has_avx512f() else _kernels.ISA_AVX2
    buffer = np.ones(floats, np.float32)
    reps = 1
    _kernels.read_seconds(buffer, 1, isa)
    while True:
        seconds = _kernels.read_seconds(buffer, reps, isa)
        if seconds >= min_seconds:
            break
        reps *= 2
    best = min(_kernels.read_seconds(buffer, reps, isa) for _ in range(3))
    return floats * 4 * reps / best


def measure(cpu: Optional[CpuFingerprint] = None) -> MachineModel:
    """Measure the four read bandwidths on one pinned CPU."""
    cpu = cpu or fingerprint()
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(previous)})
    try:
        l1, l2, l3 = (cpu.l1d_bytes or 32768), (cpu.l2_bytes or 1 << 20), (cpu.l3_bytes or 8 << 20)
        bandwidths = Bandwidths(l1=_read_bandwidth(l1 // 8),
                                l2=_read_bandwidth(l2 // 8),
                                # 4x L2 (within L3 but past L2): a VM's "L3" is shared
                                # with neighbours and half of it already behaves like DRAM
                                l3=_read_bandwidth(min(l3 // 2, 4 * l2) // 4),
                                dram=_read_bandwidth(max(4 * l3, 256 << 20) // 4, 0.2))
    finally:
        os.sched_setaffinity(0, previous)
    return MachineModel(cpu, bandwidths)


def load_or_measure(data_dir: Optional[Path] = None, remeasure: bool = False) -> MachineModel:
    """This CPU's model from ``data_dir`` or the models installed with ttile; measured
    (about a second) and saved under ``data_dir/machine`` when there is none."""
    cpu = fingerprint()
    path = find_file(DataKind.MACHINE, cpu.id, data_dir)
    if path is not None and not remeasure:
        return MachineModel.from_json(json.loads(path.read_text()))
    model = measure(cpu)
    if data_dir is not None:
        directory = Path(data_dir) / DataKind.MACHINE.value
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / f"{cpu.id}.json", json.dumps(model.to_json(), indent=1) + "\n")
    return model
