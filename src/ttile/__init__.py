"""ttile: convolution kernels for x86 CPUs generated from TTile optimization schemes.

``ttile.conv2d`` is the entry point; ``ttile.Conv2d`` packs fixed weights once;
``ttile.plan`` says which kernel serves a call; ``ttile.set_tuning`` chooses how shapes
without a tuned kernel are handled (tuned on first call and cached on disk, tuned in the
background, or never). Importing ttile loads numpy and the compiled extension only; the
scheme language, code generator and search are imported on demand.
"""
__version__ = "0.1.0"

from .api import (KernelPlan, conv2d, get_isa, has_avx512f, plan, set_isa, tuned_kernels,
                  use_tuned_kernels)
from .conv_layer import Conv2d
from .dispatch import TuningPolicy, restore_tuning, set_tuning, tuning_policy
from .spec import ConvSpec


def cache_clear() -> int:
    """Delete every kernel tuned at run time from the disk cache and forget this
    process's choices; returns the number of files removed."""
    from . import api, dispatch
    from .cache import KernelCache
    removed = KernelCache(dispatch.tuning_policy().cache_dir).clear()
    dispatch.forget_choices()
    for call_plan in list(api._plans.values()):
        call_plan.choices.clear()
    return removed


__all__ = ["conv2d", "Conv2d", "plan", "KernelPlan", "ConvSpec", "has_avx512f", "get_isa",
           "set_isa", "tuned_kernels", "use_tuned_kernels", "set_tuning", "restore_tuning",
           "tuning_policy", "TuningPolicy", "cache_clear", "__version__"]
