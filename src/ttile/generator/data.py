"""Where the generator's data lives, for reading and for writing.

Measured data (microkernel tables, machine models, tuning records, the learned ranking)
is written to a *data directory*: ``./generator`` of a source checkout by default (the
generator's inputs beside its code's name), or ``--data-dir``. The
wheel also installs the tables and machine models under ``ttile/data``, so a table is
looked up in the data directory first and then among the installed ones: a command run
outside the checkout (``ttile-generate model``) and the run-time tuner find the tables
the package carries.
"""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Iterable, Optional

#: The data directory of a source checkout, relative to where commands run.
DEFAULT_DATA_DIR = Path("generator")


class DataKind(str, Enum):
    """The kinds of measured data, each in a sub-directory of its own."""

    MICROKERNELS = "microkernels"   # step 1 tables, <cpu-id>.json
    MACHINE = "machine"             # cache bandwidths, <cpu-id>.json
    RECORDS = "records"             # tuning records, <cpu-id>.jsonl
    RANKER = "ranker"               # the learned ranking of schemes, ranker.json


def installed_directory(kind: DataKind) -> Optional[Path]:
    """The copy of ``kind`` installed with the package, if any.

    A wheel carries it as ``ttile/data``. An editable install (``pip install -e .``)
    imports the package from ``src/ttile``, beside which nothing is installed, so there
    the checkout's own ``generator/`` is the copy the package was built from."""
    package = Path(__file__).resolve().parent.parent
    here = package / "data" / kind.value
    if here.is_dir():
        return here
    if package.parent.name == "src":
        checkout = package.parent.parent / "generator" / kind.value
        if checkout.is_dir():
            return checkout
    return None


def search_path(kind: DataKind, *directories: Optional[Path]) -> list[Path]:
    """Existing directories holding ``kind``, in the order to read them: each of
    ``directories``' ``kind`` sub-directory, then the installed copy."""
    out: list[Path] = []
    for directory in directories:
        if directory is not None:
            out.append(Path(directory) / kind.value)
    installed = installed_directory(kind)
    if installed is not None:
        out.append(installed)
    seen, unique = set(), []
    for d in out:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            unique.append(d)
    return unique


def find_file(kind: DataKind, cpu_id: str, *directories: Optional[Path]) -> Optional[Path]:
    """``<cpu_id>.json`` of ``kind`` in the first directory of :func:`search_path`."""
    for directory in search_path(kind, *directories):
        path = directory / f"{cpu_id}.json"
        if path.exists():
            return path
    return None


def find_cpu_file(kind: DataKind, stem: str, *directories: Optional[Path]) -> Optional[Path]:
    """A CPU's file of ``kind`` (``stem``: its family stem, see
    :func:`ttile.core.vectors.family_stem`): its own, else the first measured on the same
    microarchitecture in the same vector family (the same core in another VM: only the
    caches the hypervisor reports differ, see :mod:`ttile.core.cpuinfo`)."""
    from ..core.cpuinfo import microarchitecture
    from ..core.vectors import parse_family_stem
    path = find_file(kind, stem, *directories)
    if path is not None:
        return path
    cpu_id, isa = parse_family_stem(stem)
    core = microarchitecture(cpu_id)
    for directory in search_path(kind, *directories):
        for candidate in sorted(directory.glob("*.json")):
            other, other_isa = parse_family_stem(candidate.stem)
            if other_isa is isa and microarchitecture(other) == core:
                return candidate
    return None


def all_files(kind: DataKind, *directories: Optional[Path]) -> Iterable[Path]:
    """Every table of ``kind`` on the search path (for a CPU without one of its own)."""
    for directory in search_path(kind, *directories):
        yield from sorted(directory.glob("*.json"))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


#: Why the last :func:`load_ranker` found no ranking ("" : it found one).
_ranker_problem = ""
_ranker_warned: set[str] = set()


def ranker_problem() -> str:
    """Why no learned ranking was loaded ("" when one was)."""
    return _ranker_problem


def load_ranker(*directories: Optional[Path]):
    """The learned ranking of schemes (``ranker/ranker.json``) from ``directories`` or
    shipped with ttile; None if there is none or it cannot be read. Callers then rank
    with the IOOpt model alone: the run-time tuner's search then takes about ten times
    as long and the offline search measures in a slower order, so that is said once per
    cause with a warning (and :func:`ranker_problem` keeps the reason)."""
    global _ranker_problem
    from ..tuning.ranker import Ranker
    path = find_file(DataKind.RANKER, "ranker", *directories)
    if path is None:
        places = [str(d) for d in search_path(DataKind.RANKER, *directories)] or [
            "no ranker directory"]
        problem = f"no ranker.json in {', '.join(places)}"
    else:
        try:
            ranker = Ranker.load(path)
            _ranker_problem = ""
            return ranker
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"{path} cannot be read ({type(exc).__name__}: {exc})"
    _ranker_problem = problem
    if problem not in _ranker_warned:
        _ranker_warned.add(problem)
        import warnings
        warnings.warn(f"ttile: no learned ranking of schemes: {problem}; schemes are "
                      f"ranked by the IOOpt model alone, which makes run-time tuning "
                      f"about 10x slower and the offline search measure in a slower "
                      f"order (ttile-generate train-ranker makes one)", RuntimeWarning,
                      stacklevel=2)
    return None
