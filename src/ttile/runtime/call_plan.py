"""What a call's shapes and options determine, derived once per signature: one group's
problem, the output's shape, the kernel family, the useful thread count.

``call_plan`` keeps a ``CallPlan`` per exact argument signature, so a repeated call (a
network layer) costs a dictionary lookup here; the plan also remembers, per thread count
and setting, the kernel and route that serve it once they are final (see ``routes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..core.spec import ConvSpec
from .arguments import group_count, make_spec, memory_limit_bytes


class Family(Enum):
    """Which kernels can serve a call."""

    DENSE = "dense"            # groups 1: tuned, run-time tuned or generic
    DEPTHWISE = "depthwise"    # groups == channels, one output channel per group
    GROUPED = "grouped"        # any other grouping: the generic kernel, group by group


def family_of(spec: ConvSpec, groups: int) -> Family:
    """The family of ``groups`` convolutions of one group's problem ``spec``."""
    if groups == 1:
        return Family.DENSE
    return Family.DEPTHWISE if spec.c == 1 and spec.k == 1 else Family.GROUPED


#: Input and output bytes per thread of a depthwise call: 7x7 layers of 960 channels
#: (376 KB) ran in 10 us on two threads, 16 on one.
DEPTHWISE_BYTES_PER_THREAD = 128 * 1024


@dataclass(frozen=True)
class CallPlan:
    """What conv2d derives from a call's shapes and options, computed once per signature.

    ``spec`` is one group's problem; ``out_shape`` the whole output in the call's layout.
    ``choices`` remembers, per (thread count, per call?, settings generation), the
    ``routes.Selection`` that serves the call once that is final (a background tuning may
    still replace a provisional one; a change of ISA, of tuned kernels on or off, or of
    the CPU whose set serves starts a new generation, see ``settings.generation``).
    """

    spec: ConvSpec
    layout: str
    out_shape: tuple[int, int, int, int]
    max_threads: int
    groups: int = 1
    family: Family = None  # set in __post_init__
    choices: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", family_of(self.spec, self.groups))

    @property
    def channels_out(self) -> int:
        return self.spec.k * self.groups

    @property
    def nhwc_out_shape(self) -> tuple[int, int, int, int]:
        spec = self.spec
        return (spec.n, spec.ho, spec.wo, self.channels_out)

    def fit(self, threads: int) -> int:
        """The threads a call of this problem uses when ``threads`` are asked for: no
        more than its work keeps busy (see :data:`ttile.core.spec.MIN_FLOPS_PER_THREAD`)."""
        return threads if threads <= self.max_threads else self.max_threads


_plans: dict[tuple, CallPlan] = {}
_MAX_PLANS = 4096


def _exact_key(value):
    """``value`` if it is an int, str or pair of ints by exact type, else None.

    Exact types keep the plan cache from conflating 1 with True or 1.0, which must still
    be refused by the full checks.
    """
    kind = type(value)
    if kind is int or kind is str:
        return value
    if kind is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return value
    if kind is tuple and len(value) == 2 and all(_exact_key(side) is side and type(side) is
                                                 tuple for side in value):
        return value   # ((top, bottom), (left, right))
    return None


def call_plan(x_shape, w_shape, stride, padding, layout, dilation=1, groups=1) -> CallPlan:
    """The checked plan of a call with these shapes and options (raising what conv2d
    raises for them)."""
    stride_key, padding_key = _exact_key(stride), _exact_key(padding)
    dilation_key = _exact_key(dilation)
    key = None
    if stride_key is not None and padding_key is not None and dilation_key is not None \
            and type(layout) is str and type(groups) is int:
        key = (x_shape, w_shape, stride_key, padding_key, layout, dilation_key, groups)
        plan = _plans.get(key)
        if plan is not None:
            return plan
    spec = make_spec(x_shape, w_shape, stride, padding, layout, dilation, groups)
    g = group_count(groups)
    k = spec.k * g
    out_bytes = 4 * spec.n * k * spec.ho * spec.wo
    if out_bytes > memory_limit_bytes():
        raise ValueError(f"output of shape ({spec.n}, {k}, {spec.ho}, {spec.wo}) needs "
                         f"{out_bytes / 2**30:.1f} GiB, more than this machine's memory")
    out_shape = ((spec.n, k, spec.ho, spec.wo) if layout == "NCHW"
                 else (spec.n, spec.ho, spec.wo, k))
    threads = spec.useful_threads(g)
    if family_of(spec, g) is Family.DEPTHWISE:
        # depthwise: R*S FMAs per output, bound by memory rather than FMAs; a thread per
        # 4 MFLOP kept MobileNetV2's 112x112 layers (7 MFLOP) on one thread, where two
        # ran them in half the time (a thread per 128 KB of input and output instead)
        moved = 4 * g * (spec.n * spec.h * spec.w + spec.n * spec.ho * spec.wo)
        threads = max(1, moved // DEPTHWISE_BYTES_PER_THREAD)
    plan = CallPlan(spec, layout, out_shape, threads, g)
    if key is not None and len(_plans) < _MAX_PLANS:
        _plans[key] = plan
    return plan


def forget_choices() -> None:
    """Forget the kernel every known call plan settled on (after the tuning policy, the
    cache or the CPU whose verdicts serve changed), so the next call chooses again."""
    for plan in list(_plans.values()):
        plan.choices.clear()
