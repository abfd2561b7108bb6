"""The epilogue fused into a kernel's output store (``act(conv + bias + residual)``)
and the output array: checked once, for ``conv2d``, ``Conv2d`` and ``plan`` alike.

The shape rules live in ``check_bias_shape`` / ``check_residual_shape``: ``plan`` applies
them to shapes, a call to its arrays. Nothing is written to a caller's ``out`` before
every check here has passed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..core.kinds import Activation
from .arguments import FLOAT32, as_float32
from .call_plan import CallPlan


@dataclass(frozen=True)
class Fused:
    """The epilogue of one call, checked: what the kernels fuse into their store."""

    bias: Optional[np.ndarray] = None      # float32, (K,)
    residual: Optional[np.ndarray] = None  # float32, the output's shape and layout
    activation: Activation = Activation.NONE
    negative_slope: float = 0.01

    def kwargs(self, residual: Optional[np.ndarray] = None) -> dict:
        """Keyword arguments of the _kernels entry points (``residual`` replaces the
        call's, when the kernel writes another layout)."""
        return {"bias": self.bias,
                "residual": self.residual if residual is None else residual,
                "activation": self.activation.code, "slope": self.negative_slope}

    def describe(self) -> str:
        """What is fused, as ``plan`` reports it (see :func:`describe`)."""
        return describe(self.bias is not None, self.residual is not None, self.activation)


BARE = Fused()


def describe(bias: bool, residual: bool, activation: Activation) -> str:
    """An epilogue's name: "" for nothing fused, else e.g. "bias+residual+relu"."""
    parts = [name for name, given in (("bias", bias), ("residual", residual)) if given]
    if activation is not Activation.NONE:
        parts.append(activation.value)
    return "+".join(parts)


def activation_of(activation) -> Activation:
    if activation is None:
        return Activation.NONE
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        try:
            return Activation(activation)
        except ValueError:
            pass
    names = ", ".join(repr(a.value) for a in Activation if a is not Activation.NONE)
    raise ValueError(f"unknown activation {activation!r}; expected None or one of {names}")


def slope_of(negative_slope) -> float:
    if isinstance(negative_slope, (bool, np.bool_)) or not isinstance(
            negative_slope, (int, float, np.integer, np.floating)):
        raise TypeError(f"negative_slope must be a real number, got {negative_slope!r}")
    value = float(negative_slope)
    if not np.isfinite(value):
        raise ValueError(f"negative_slope must be finite, got {negative_slope!r}")
    return value


def check_bias_shape(plan: CallPlan, shape: tuple) -> None:
    if shape != (plan.channels_out,):
        raise ValueError(f"bias must have shape ({plan.channels_out},) (one value per output "
                         f"channel), got {shape}")


def check_residual_shape(plan: CallPlan, shape: tuple) -> None:
    if shape != plan.out_shape:
        raise ValueError(f"residual must have the output's shape {plan.out_shape} "
                         f"({plan.layout}), got {shape}")


def fused(plan: CallPlan, bias, residual, activation, negative_slope) -> Fused:
    """The call's epilogue, its arrays converted and checked against ``plan``."""
    if bias is None and residual is None and activation is None:
        return BARE
    bias_array = residual_array = None
    if residual is not None:
        residual_array = as_float32(residual, "residual")
        check_residual_shape(plan, residual_array.shape)
    if bias is not None:
        bias_array = as_float32(bias, "bias")
        check_bias_shape(plan, bias_array.shape)
    return Fused(bias_array, residual_array, activation_of(activation),
                 slope_of(negative_slope))


def checked_out(out, plan: CallPlan, *inputs) -> Optional[np.ndarray]:
    """The caller's ``out`` checked (None: allocate); refused when it overlaps an input."""
    if out is None:
        return None
    if type(out) is not np.ndarray:
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != FLOAT32:
        raise TypeError(f"out must be float32, got {out.dtype}")
    if out.shape != plan.out_shape:
        raise ValueError(f"out must have the output's shape {plan.out_shape} ({plan.layout}), "
                         f"got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.aligned:
        raise ValueError("out must be C-contiguous and aligned")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    for name, array in inputs:
        if array is not None and np.may_share_memory(out, array):
            raise ValueError(f"out overlaps the {name}: the kernels would read what they "
                             f"have already written")
    return out
