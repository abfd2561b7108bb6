"""CPU fingerprint: what makes measurements on one machine valid on another.

Microkernel tables, tuning records and cached kernels are keyed by it. Two machines
share a fingerprint when they report the same vendor, model, ISA extensions relevant to
the kernels and cache sizes; frequency and core count are left out on purpose (they
change with the VM size or power settings without changing which schedule is best).
Linux only (reads /proc/cpuinfo and sysfs); elsewhere fields read "unknown".

What a hypervisor reports beyond the core itself (the L3 size of a VM's slice, the model
name) changes the fingerprint but not the core: a Xeon family 6 model 167 reported 105
MiB of L3 in one VM and 480 MiB in another. So data measured on one machine also serves
another of the same :func:`microarchitecture` (vendor, family, model) where none was
measured on that machine itself; the vector family is checked separately (a kernel runs
only where its instructions do).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

#: ISA flags (as /proc/cpuinfo spells them) that change which kernels run or how fast.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                  "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")


@dataclass(frozen=True)
class CpuFingerprint:
    vendor: str
    model_name: str
    family: str
    model: str
    flags: tuple[str, ...]
    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int

    @property
    def id(self) -> str:
        """Short stable identifier, e.g. ``genuineintel-6-167-3f2a9c81``."""
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"{self.vendor.lower()}-{self.family}-{self.model}-{digest[:8]}"

    def to_json(self) -> dict:
        data = asdict(self)
        data["flags"] = list(self.flags)
        data["id"] = self.id
        return data

    @classmethod
    def from_json(cls, data: dict) -> "CpuFingerprint":
        fields = {k: v for k, v in data.items() if k != "id"}
        fields["flags"] = tuple(fields["flags"])
        return cls(**fields)


def microarchitecture(cpu_id: str) -> str:
    """The ``vendor-family-model`` part of a fingerprint id (``genuineintel-6-167``): the
    core a measurement is evidence about, whatever the VM reports for its caches."""
    return cpu_id.rsplit("-", 1)[0]


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text) if text.isdigit() else 0


def _cache_sizes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, int]:
    sizes = {"l1d": 0, "l2": 0, "l3": 0}
    for index in sorted(cpu_dir.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except OSError:
            continue
        if level == "1" and kind in ("Data", "Unified"):
            sizes["l1d"] = size
        elif level == "2":
            sizes["l2"] = size
        elif level == "3":
            sizes["l3"] = size
    return sizes


@lru_cache(maxsize=1)
def fingerprint() -> CpuFingerprint:
    """The fingerprint of the CPU this process runs on (read once)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    caches = _cache_sizes()
    return CpuFingerprint(
        vendor=info.get("vendor_id", "unknown"),
        model_name=info.get("model name", "unknown"),
        family=info.get("cpu family", "unknown"),
        model=info.get("model", "unknown"),
        flags=tuple(f for f in RELEVANT_FLAGS if f in flags),
        l1d_bytes=caches["l1d"], l2_bytes=caches["l2"], l3_bytes=caches["l3"])


@lru_cache(maxsize=None)
def _openmp_places() -> tuple[int, ...]:
    """OpenMP's place list is fixed when the runtime loads: read once."""
    from .. import _kernels
    return tuple(_kernels.openmp_place_cpus())


def process_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on.

    With OMP_PROC_BIND or OMP_PLACES set, an OpenMP runtime (ttile's, or torch's loaded
    first) binds the importing thread to one CPU when it loads, so the affinity read after
    ``import ttile`` says one CPU while the process may use them all: a default taken from
    it ran every call on one thread. The runtime's place list keeps the CPUs it started
    with, and is read instead whenever it is in force."""
    places = _openmp_places()
    if places:
        return places
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))
