"""When a searched kernel replaces the generic one: :class:`ShipPolicy`, the one rule
used by the offline generator (what ``kernels/gen`` ships) and the run-time tuner (what
the cache serves)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class ShipPolicy:
    """A searched kernel ships when the median of its time ratios to the generic kernel
    (each ratio from one side-by-side comparison) is below ``max_time_ratio``.

    The default, 0.97, asks for 3 % less time. Most searched kernels of large layers tie
    the generic kernel within a few percent (both run near the FMA peak), and there one
    comparison is a coin flip: Yolo9000-2's two-thread kernel shipped on a 0.984 ratio and
    then ran 7 % slower than the generic kernel in the benchmark. A tie keeps the generic
    kernel. Pass ``math.inf`` to ship whatever ran correctly (tests of the machinery).
    """

    max_time_ratio: float = 0.97

    def __post_init__(self) -> None:
        if not (isinstance(self.max_time_ratio, (int, float)) and self.max_time_ratio > 0):
            raise ValueError(f"max_time_ratio must be a positive number, got "
                             f"{self.max_time_ratio!r}")

    @property
    def margin(self) -> float:
        """The time saved that is asked for, as a fraction (0.03 for the default)."""
        return 1.0 - self.max_time_ratio if math.isfinite(self.max_time_ratio) else -math.inf

    def ships(self, ratios: Iterable[float]) -> bool:
        """Whether a kernel with these searched/generic time ratios ships (False when
        there is no ratio: never compared, never shipped)."""
        values = [r for r in ratios if r > 0 and math.isfinite(r)]
        return bool(values) and statistics.median(values) < self.max_time_ratio

    def beats(self, searched_seconds: float, generic_seconds: float) -> bool:
        """One comparison: :meth:`ships` of the single ratio."""
        if not generic_seconds > 0:
            return False
        return self.ships([searched_seconds / generic_seconds])


#: The rule of ttile's releases.
DEFAULT_SHIP_POLICY = ShipPolicy()
