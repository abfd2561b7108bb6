"""The tuned kernels compiled into the extension, keyed by the problem they solve.

``kernels/gen/registry.c`` (written by :mod:`ttile.generator.emit`) lists every tuned
kernel with its exact problem; here each entry becomes a typed :class:`TunedEntry` and
the lookup key is the entry's :class:`~ttile.core.spec.ConvSpec` itself, so no caller
spells out the problem's fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from .. import _kernels
from ..core.spec import ConvSpec

_SPEC_FIELDS = ("n", "k", "c", "h", "w", "r", "s", "stride_h", "stride_w", "pad_top",
                "pad_bottom", "pad_left", "pad_right")


@dataclass(frozen=True, kw_only=True)
class TunedEntry:
    """One kernel of the registry."""

    index: int           # its position in the C registry (``_kernels.run_tuned``)
    spec: ConvSpec       # the problem it was generated for, exactly
    parallel: bool       # False: the single-thread variant; True: the multi-thread one
    panel: int           # weight panel width it reads
    layer: str
    scheme: str          # paper notation
    gflops: float        # measured when it was tuned

    @cached_property
    def microkernels(self) -> str:
        """The scheme's unrolled block in paper notation."""
        from ..core.scheme import Scheme  # the parser: only when a plan is reported
        return Scheme.parse(self.scheme).microkernel_text()


def _read() -> tuple[TunedEntry, ...]:
    return tuple(TunedEntry(index=e["index"], spec=ConvSpec(**{f: e[f] for f in _SPEC_FIELDS}),
                            parallel=e["parallel"], panel=e["panel"], layer=e["layer"],
                            scheme=e["scheme"], gflops=e["gflops"])
                 for e in _kernels.tuned_kernels())


ENTRIES: tuple[TunedEntry, ...] = _read()
_BY_SPEC: dict[ConvSpec, dict[bool, TunedEntry]] = {}
for _entry in ENTRIES:
    _BY_SPEC.setdefault(_entry.spec, {})[_entry.parallel] = _entry


def variants(spec: ConvSpec) -> dict[bool, TunedEntry]:
    """The tuned kernels for exactly ``spec``, by "multi-thread variant?"."""
    return _BY_SPEC.get(spec, {})


def lookup(spec: ConvSpec, threads: int) -> Optional[TunedEntry]:
    """The variant that serves ``spec`` on ``threads`` threads, if one was tuned."""
    return variants(spec).get(threads > 1)
