"""The tuning database: one typed record per measurement, one JSON-lines file per CPU and
vector family.

Every measurement the generator makes (a scheme screened, re-timed with the paper's
protocol, compared warm with the generic kernel, or the generic kernel itself) is
appended to ``generator/records/<cpu-id>.jsonl`` (the AVX-512F family) or
``generator/records/<cpu-id>.avx2.jsonl`` (the AVX2 family, searched with its own microkernels
and compared with its own generic kernel) as one :class:`TuningRecord`, so a search
resumes where it stopped and the kernels can be emitted again from the records without
measuring anything.

Records carry a format number. A record that cannot be read is an error naming the file
and line, never silently skipped: a renamed field must not make every committed record
vanish and the search re-measure for hours. The one exception is a last line without
its newline, which is what an interrupted append leaves; it is dropped with a warning.
Format 1 (ttile before the layered layout) is migrated on reading: its generic-kernel
records carried the scheme text "generic", and its warm comparisons were paired by
adjacency and a human-readable detail; they get :attr:`Contender.GENERIC` and comparison
ids. ``ttile-generate records migrate`` rewrites a file in the current format.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from ..core.codegen import GENERATOR_VERSION
from ..core.cpuinfo import fingerprint
from ..core.fileio import atomic_write
from ..core.kinds import Isa
from ..core.spec import ConvSpec
from ..core.vectors import family_stem
from .policy import DEFAULT_SHIP_POLICY, ShipPolicy

#: Format of the records written now.
RECORD_FORMAT = 2
#: Revision of the hand-written generic kernel: warm verdicts against an older revision
#: are not counted. It goes with the sources below: a change to them must bump the
#: revision (or, for a change that cannot alter its speed, only the digest), which
#: tests/test_records_revision.py enforces.
GENERIC_REVISION = 12
#: The first 16 hex digits of the SHA-256 of the generic kernel's sources, in this order.
GENERIC_SOURCES = ("kernels/generic_conv.inc", "kernels/generic_block.h",
                   "kernels/generic_blocks.inc", "kernels/generic_avx512.h",
                   "kernels/generic_avx512.c", "kernels/generic_avx2.h", "kernels/generic_avx2.c",
                   *(f"kernels/generic_blocks_avx512_{i}.c" for i in range(1, 5)),
                   *(f"kernels/generic_blocks_avx2_{i}.c" for i in range(1, 3)))
GENERIC_SOURCES_SHA256 = "5274330d989df61f"


class RecordError(ValueError):
    """A record that cannot be read; the message names the file and line."""


class RecordStatus(str, Enum):
    OK = "ok"
    WRONG = "wrong_answer"
    BUILD_ERROR = "build_error"
    TIMEOUT = "timeout"


class Protocol(str, Enum):
    """How a time was measured."""

    #: a few calls rotating over tensor copies (cold caches): ranks schemes quickly
    SCREEN = "screen"
    #: the paper's protocol: 20 cold calls, the 5 fastest and 5 slowest dropped, median
    PAPER = "paper"
    #: side by side with the generic kernel, warm, interleaved rounds (ship decision)
    WARM = "warm"


class Strategy(str, Enum):
    """How a scheme uses threads (paper section 5.5)."""

    SEQUENTIAL = "sequential"
    PARALLEL_OUTER_BAND = "parallel outer band"
    REDUCTIONS_INNERMOST = "reductions innermost"
    REDUCTIONS_OUTERMOST = "reductions outermost"


class Contender(str, Enum):
    """What was timed: a searched scheme, or the generic kernel it must beat."""

    SCHEME = "scheme"
    GENERIC = "generic"


@dataclass(frozen=True, kw_only=True)
class TuningRecord:
    """One measurement. ``seconds`` is the median per call (0 when not ok)."""

    layer: str
    spec: ConvSpec
    contender: Contender
    scheme: str                      # paper notation; "" for the generic kernel
    threads: int
    status: RecordStatus
    seconds: float
    gflops: float
    calls: int
    protocol: Protocol
    strategy: Optional[Strategy]     # None for the generic kernel, or unknown (format 1)
    microkernels: str
    cpu: str
    generator_version: int
    measured_on: str                 # ISO date
    detail: str = ""                 # why a kernel failed, or a note
    comparison: str = ""             # id shared by the two sides of one warm comparison
    generic_revision: int = 0        # GENERIC_REVISION of a timed generic kernel (0: unknown)

    def __post_init__(self) -> None:
        if (self.contender is Contender.GENERIC) != (self.scheme == ""):
            raise ValueError("the generic kernel's records have no scheme, and every other "
                             "record has one")

    def key(self) -> tuple:
        return (self.spec.key(), self.scheme, self.threads, self.protocol,
                self.generator_version)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": RECORD_FORMAT}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ConvSpec):
                value = value.to_json()
            elif isinstance(value, Enum):
                value = value.value
            data[f.name] = value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TuningRecord":
        """A record from its current-format JSON; ValueError says which field is wrong."""
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {RECORD_FORMAT}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"format"})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        values = {k: v for k, v in data.items() if k != "format"}
        try:
            values["spec"] = ConvSpec.from_json(values["spec"])
            for name, enum in (("contender", Contender), ("status", RecordStatus),
                               ("protocol", Protocol)):
                values[name] = enum(values[name])
            if values.get("strategy") is not None:
                values["strategy"] = Strategy(values["strategy"])
            return cls(**values)
        except KeyError as exc:
            raise ValueError(f"missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(str(exc)) from None


# -- format 1 -----------------------------------------------------------------------------
_V1_GENERIC = "generic"
_V1_AGAINST = re.compile(r"against (?P<scheme>.*) \(generic r(?P<revision>\d+)\)")


def migrate_v1(entries: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """Format-1 records (line number, JSON) as format-2 JSON.

    A v1 warm comparison was a searched record followed, in the file, by a generic record
    of the same problem and thread count whose detail read "against <scheme> (generic
    rN)"; the pair gets the id ``v1-<line of the searched record>``. Warm records of the
    searched kernel had strategy "warm"; the strategy recorded for the same scheme by the
    search, if any, replaces it.
    """
    strategies: dict[tuple, str] = {}
    for _, data in entries:
        if data.get("strategy") not in ("warm", "generic", None):
            strategies.setdefault((json.dumps(data["spec"], sort_keys=True), data["scheme"]),
                                  data["strategy"])
    out: list[tuple[int, dict]] = []
    pending: dict[tuple, tuple[int, dict]] = {}   # last warm searched record per layer
    for lineno, data in entries:
        new = dict(data)
        new["format"] = RECORD_FORMAT
        generic = data.get("scheme") == _V1_GENERIC
        new["contender"] = Contender.GENERIC.value if generic else Contender.SCHEME.value
        new["scheme"] = "" if generic else data.get("scheme")
        new["comparison"] = ""
        new["generic_revision"] = 0
        spec_text = json.dumps(data.get("spec"), sort_keys=True)
        if generic:
            new["strategy"] = None
        elif data.get("strategy") == "warm":
            new["strategy"] = strategies.get((spec_text, data.get("scheme")))
        layer_key = (spec_text, data.get("threads"))
        if data.get("protocol") == Protocol.WARM.value:
            if not generic:
                pending[layer_key] = (lineno, new)
            else:
                match = _V1_AGAINST.fullmatch(data.get("detail", ""))
                if match:
                    new["generic_revision"] = int(match["revision"])
                    new["detail"] = ""
                partner = pending.pop(layer_key, None)
                if match and partner is not None and partner[1]["scheme"] == match["scheme"]:
                    comparison = f"v1-{partner[0]}"
                    partner[1]["comparison"] = comparison
                    new["comparison"] = comparison
        out.append((lineno, new))
    return out


def read_records(path: Path) -> list[TuningRecord]:
    """Every record of a JSON-lines file, format 1 lines migrated (see the module text).

    Raises RecordError naming the file and line of the first record that cannot be read.
    """
    text = path.read_text()
    lines = text.split("\n")
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    current: list[tuple[int, dict]] = []
    old: list[tuple[int, dict]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            if lineno == last and not text.endswith("\n"):
                warnings.warn(f"{path}:{lineno}: dropped an incomplete last record (an "
                              f"interrupted write)", RuntimeWarning, stacklevel=2)
                continue
            raise RecordError(f"{path}:{lineno}: not a JSON record ({exc})") from None
        if not isinstance(data, dict):
            raise RecordError(f"{path}:{lineno}: a record is a JSON object, got "
                              f"{type(data).__name__}")
        version = data.get("format", 1)
        if version == 1:
            old.append((lineno, data))
        elif version == RECORD_FORMAT:
            current.append((lineno, data))
        else:
            raise RecordError(f"{path}:{lineno}: record format {version!r} is newer than "
                              f"this ttile reads ({RECORD_FORMAT}); upgrade ttile")
    records = []
    for lineno, data in sorted(migrate_v1(old) + current, key=lambda item: item[0]):
        try:
            records.append(TuningRecord.from_json(data))
        except ValueError as exc:
            raise RecordError(f"{path}:{lineno}: cannot read the record: {exc}") from None
    return records


class TuningDatabase:
    """Append-only store of tuning records for one CPU and one vector family."""

    def __init__(self, directory: Path, cpu_id: Optional[str] = None,
                 ship: ShipPolicy = DEFAULT_SHIP_POLICY, isa: Isa = Isa.AVX512F):
        self.cpu_id = cpu_id or fingerprint().id
        self.isa = Isa(isa)
        if not self.isa.vector:
            raise ValueError(f"no tuning records for the {self.isa.value} family")
        self.path = Path(directory) / f"{family_stem(self.cpu_id, self.isa)}.jsonl"
        self.ship = ship
        self.records: list[TuningRecord] = []
        self._keys: set[tuple] = set()
        self._by_layer: dict[tuple[str, int], list[TuningRecord]] = {}
        if self.path.exists():
            for record in read_records(self.path):
                self._remember(record)

    def _remember(self, record: TuningRecord) -> None:
        self.records.append(record)
        self._keys.add(record.key())
        self._by_layer.setdefault((record.spec.key(), record.threads), []).append(record)

    def has(self, spec: ConvSpec, scheme: str, threads: int, protocol: Protocol) -> bool:
        return (spec.key(), scheme, threads, protocol, GENERATOR_VERSION) in self._keys

    def add(self, record: TuningRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record.to_json(), sort_keys=True) + "\n")
        self._remember(record)

    def rewrite(self) -> None:
        """Write every record in the current format (``records migrate``), atomically."""
        atomic_write(self.path, "".join(json.dumps(r.to_json(), sort_keys=True) + "\n"
                                        for r in self.records))

    def for_layer(self, spec: ConvSpec, threads: int, protocol: Optional[Protocol] = None,
                  status: RecordStatus = RecordStatus.OK) -> list[TuningRecord]:
        # from the records of this problem and thread count, in the order they were
        # added: filtering every record by its spec's key took the emit step of a
        # 6 300-record database 27 s
        return [r for r in self._by_layer.get((spec.key(), threads), ())
                if r.status is status and r.generator_version == GENERATOR_VERSION
                and (protocol is None or r.protocol is protocol)]

    def layers(self) -> list[tuple[ConvSpec, str]]:
        """Every problem with a correct measurement (current generator), with its name."""
        seen: dict[str, tuple[ConvSpec, str]] = {}
        for r in self.records:
            if r.status is RecordStatus.OK and r.generator_version == GENERATOR_VERSION:
                seen.setdefault(r.spec.key(), (r.spec, r.layer))
        return sorted(seen.values(), key=lambda item: item[1])

    def generic(self, spec: ConvSpec, threads: int) -> Optional[TuningRecord]:
        """The latest cold timing of the generic kernel on this problem, if any."""
        records = [r for r in self.for_layer(spec, threads, Protocol.PAPER)
                   if r.contender is Contender.GENERIC]
        return records[-1] if records else None

    def warm_ratios(self, spec: ConvSpec, threads: int, scheme: str) -> list[float]:
        """searched/generic time of every warm comparison of ``scheme`` against the
        current revision of the generic kernel."""
        sides: dict[str, dict[Contender, TuningRecord]] = {}
        for r in self.for_layer(spec, threads, Protocol.WARM):
            if r.comparison:
                sides.setdefault(r.comparison, {})[r.contender] = r
        ratios = []
        for pair in sides.values():
            searched, generic = pair.get(Contender.SCHEME), pair.get(Contender.GENERIC)
            if searched is not None and generic is not None and searched.scheme == scheme \
                    and generic.generic_revision == GENERIC_REVISION and generic.seconds > 0:
                ratios.append(searched.seconds / generic.seconds)
        return ratios

    def ships(self, spec: ConvSpec, threads: int, best: TuningRecord) -> bool:
        """Whether ``best`` (a searched record) replaces the generic kernel: by the warm
        comparisons when there are any (one on a shared machine can be off by 2x, so the
        policy takes their median), else by the cold timing of the generic kernel; never
        without a generic timing to compare with."""
        ratios = self.warm_ratios(spec, threads, best.scheme)
        if ratios:
            return self.ship.ships(ratios)
        generic = self.generic(spec, threads)
        return generic is not None and self.ship.beats(best.seconds, generic.seconds)

    def best(self, spec: ConvSpec, threads: int) -> Optional[TuningRecord]:
        """The fastest ok record of a scheme, preferring the paper protocol; ties by text."""
        for protocol in (Protocol.PAPER, Protocol.SCREEN):
            records = [r for r in self.for_layer(spec, threads, protocol)
                       if r.contender is Contender.SCHEME]
            if records:
                return min(records, key=lambda r: (r.seconds, r.scheme))
        return None


def new_comparison_id() -> str:
    """A fresh id for the two records of one warm comparison."""
    return uuid.uuid4().hex[:12]

