"""ConvSpec: the problem a kernel solves, independent of how it is scheduled.

A ConvSpec is what every later stage keys on (the code generator, the tuned-kernel
registry, the caches), so it is a frozen value with the output extents derived once.
Padding is stored per side because ``padding="same"`` with an even kernel pads
asymmetrically (as PyTorch does: the extra row goes to the bottom / right).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

#: Loop dimensions of the convolution, in the paper's naming.
#: n batch, k output channel, c input channel, h/w output row/column, r/s kernel row/column.
DIMS: tuple[str, ...] = ("n", "k", "c", "h", "w", "r", "s")
#: Dimensions summed over: they cannot be split between threads or outputs.
REDUCTION_DIMS: frozenset[str] = frozenset({"c", "r", "s"})
#: fp32 lanes in one AVX-512 vector: the default width of ``V k`` (an AVX2 kernel's is 8,
#: see :mod:`ttile.core.vectors`).
VECTOR_LANES = 16
#: Work below which another thread costs more than it brings: starting and joining an
#: OpenMP team takes microseconds, 4 MFLOP take about 16 us on one AVX-512 core. A
#: 1.2 MFLOP layer (K 24, C 12, 9x9, 5x5) ran 11x slower on 16 threads than on one.
MIN_FLOPS_PER_THREAD = 4_000_000


@dataclass(frozen=True)
class ConvSpec:
    """A 2D convolution
    y[n,oh,ow,k] = sum_{c,r,s} x[n, oh*sh + r*dh - pt, ow*sw + s*dw - pl, c] * w[r,s,c,k].

    Sizes are those of the input (h, w) and of the weights; ``ho``/``wo`` are derived.
    The dilation (dh, dw) defaults to 1 and is left out of ``key()`` and ``to_json()``
    then, so the keys of undilated problems are what they always were.

    A grouped convolution is ``groups`` of these problems side by side: ``k`` and ``c``
    are one group's, the input holds ``c * groups`` channels and the output ``k *
    groups``, group g reading channels [g c, (g+1) c) and writing [g k, (g+1) k). A call
    plan keeps one group's problem (``groups`` 1) and the group count beside it; a
    grouped problem is searched and cached as itself (``groups`` > 1, ``_g<groups>`` in
    its key), a kernel for it computing every group. Shapes, flops and packed weights
    below are the whole problem's; the iteration space a scheme tiles is one group's.
    """

    n: int
    k: int
    c: int
    h: int
    w: int
    r: int
    s: int
    stride_h: int = 1
    stride_w: int = 1
    pad_top: int = 0
    pad_bottom: int = 0
    pad_left: int = 0
    pad_right: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    groups: int = 1

    def __post_init__(self) -> None:
        for name in ("n", "k", "c", "h", "w", "r", "s", "stride_h", "stride_w",
                     "dilation_h", "dilation_w", "groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ConvSpec.{name} must be an integer >= 1, got {value!r}")
        for name in ("pad_top", "pad_bottom", "pad_left", "pad_right"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ConvSpec.{name} must be an integer >= 0, got {value!r}")
        if self.h + self.pad_top + self.pad_bottom < self.span_h:
            raise ValueError(
                f"kernel height {self.span_h} (dilated) is larger than the padded input "
                f"height {self.h + self.pad_top + self.pad_bottom}")
        if self.w + self.pad_left + self.pad_right < self.span_w:
            raise ValueError(
                f"kernel width {self.span_w} (dilated) is larger than the padded input "
                f"width {self.w + self.pad_left + self.pad_right}")

    @property
    def span_h(self) -> int:
        """Rows of input one output reads: the dilated kernel height."""
        return (self.r - 1) * self.dilation_h + 1

    @property
    def span_w(self) -> int:
        return (self.s - 1) * self.dilation_w + 1

    @property
    def dilated(self) -> bool:
        return self.dilation_h != 1 or self.dilation_w != 1

    @property
    def ho(self) -> int:
        return (self.h + self.pad_top + self.pad_bottom - self.span_h) // self.stride_h + 1

    @property
    def wo(self) -> int:
        return (self.w + self.pad_left + self.pad_right - self.span_w) // self.stride_w + 1

    def useful_threads(self, groups: int = 1) -> int:
        """The most threads a call of this problem (``groups`` of it) runs on: one per
        :data:`MIN_FLOPS_PER_THREAD` of work. A kernel searched at more threads than
        this never serves."""
        return max(1, self.flops * groups // MIN_FLOPS_PER_THREAD)

    def k_vectors(self, lanes: int = VECTOR_LANES) -> int:
        """Number of ``lanes``-wide vectors along k; the last one is masked when K is
        not a multiple of ``lanes``."""
        return -(-self.k // lanes)

    @property
    def flops(self) -> int:
        return 2 * self.n * self.k * self.c * self.r * self.s * self.ho * self.wo * self.groups

    def input_shape(self) -> tuple[int, int, int, int]:
        """Shape of the NHWC input a kernel for this problem reads."""
        return (self.n, self.h, self.w, self.c * self.groups)

    def output_shape(self) -> tuple[int, int, int, int]:
        """Shape of the NHWC output a kernel for this problem writes."""
        return (self.n, self.ho, self.wo, self.k * self.groups)

    def weight_shape(self) -> tuple[int, int, int, int]:
        """Shape of the RSCK weights ((R, S, C/groups, K) when grouped, as conv2d takes
        them)."""
        return (self.r, self.s, self.c, self.k * self.groups)

    def packed_weight_shape(self, panel: int) -> tuple[int, int, int, int, int]:
        """Shape of the weights packed in k panels of width ``panel``:
        [ceil(K / panel)][R][S][C][panel], each group's panels after the previous
        group's ([groups * ceil(K / panel)][R][S][C][panel])."""
        return (self.groups * -(-self.k // panel), self.r, self.s, self.c, panel)

    @property
    def one_group(self) -> "ConvSpec":
        """One group's problem (itself when not grouped): what a scheme tiles and the
        search's models and ranking score."""
        return self if self.groups == 1 else replace(self, groups=1)

    def iteration_extents(self, lanes: int = VECTOR_LANES) -> dict[str, int]:
        """Extent of each loop dimension of the iteration space a scheme must cover.

        k is rounded up to whole vectors of ``lanes``: the scheme tiles vectors, masks
        trim the tail.
        """
        return {"n": self.n, "k": self.k_vectors(lanes) * lanes, "c": self.c,
                "h": self.ho, "w": self.wo, "r": self.r, "s": self.s}

    def needs_row_guard(self) -> bool:
        """True when some output row reads input rows outside [0, h) (zero padding)."""
        last = (self.ho - 1) * self.stride_h + self.span_h - 1 - self.pad_top
        return self.pad_top > 0 or last > self.h - 1

    def needs_col_guard(self) -> bool:
        last = (self.wo - 1) * self.stride_w + self.span_w - 1 - self.pad_left
        return self.pad_left > 0 or last > self.w - 1

    def key(self) -> str:
        """Compact, stable text key, e.g. ``n1k64c3h224w224r7s7_s2x2_p3.3.3.3``
        (``_d2x2`` appended for a dilated problem, ``_g8`` for a grouped one)."""
        key = (f"n{self.n}k{self.k}c{self.c}h{self.h}w{self.w}r{self.r}s{self.s}"
               f"_s{self.stride_h}x{self.stride_w}"
               f"_p{self.pad_top}.{self.pad_bottom}.{self.pad_left}.{self.pad_right}")
        key += f"_d{self.dilation_h}x{self.dilation_w}" if self.dilated else ""
        return key + (f"_g{self.groups}" if self.groups > 1 else "")

    def to_json(self) -> dict[str, int]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        if not self.dilated:
            del data["dilation_h"], data["dilation_w"]
        if self.groups == 1:
            del data["groups"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, int]) -> "ConvSpec":
        return cls(**data)
