"""ttile: convolution kernels for x86 CPUs generated from TTile optimization schemes.

``ttile.conv2d`` is the entry point; ``ttile.Conv2d`` packs fixed weights once;
``ttile.plan`` says which kernel serves a call (a per-call ``conv2d`` given the same
weight array again runs on the weights it packed before, checked unchanged, as a
``Conv2d`` would: ``ttile.set_weight_cache``); ``ttile.set_tuning`` chooses how shapes
without a tuned kernel are handled (tuned on first call and cached on disk, tuned in the
background, or never). Importing ttile loads numpy and the compiled extension only; the
scheme language, code generator and search are imported on demand.

The package is layered, each layer importing only those before it:

* ``ttile.core``: problem, scheme, code generator, compiler driver, float64 reference;
* ``ttile.tuning``: build -> check -> time, the ship policy, the tuning records;
* ``ttile.generator``: the offline TTile search (``ttile-generate``);
* ``ttile.runtime``: ``conv2d``, ``Conv2d``, dispatch, the kernel cache, run-time tuning.
"""
from ._version import __version__
from .core.kinds import Isa, KernelKind, Precision, SetMatch
from .core.spec import ConvSpec
from .runtime.api import KernelPlan, conv2d, plan, tuned_kernels
from .runtime.packing import set_weight_cache
from .runtime.routes import Route
from .runtime.settings import get_isa, has_avx2, has_avx512f, set_isa, use_tuned_kernels, \
    use_winograd
from .runtime.conv_layer import Conv2d
from .runtime.dispatch import TuningPolicy, restore_tuning, set_tuning, tuning_policy
from .tuning.policy import ShipPolicy


def cache_clear() -> int:
    """Delete every kernel tuned at run time from the disk cache and forget this
    process's choices; returns the number of files removed."""
    from .runtime import call_plan, dispatch, settings
    from .runtime.cache import KernelCache
    removed = KernelCache(dispatch.tuning_policy().cache_dir).clear()
    dispatch.forget_choices()
    call_plan.forget_choices()
    settings.invalidate_choices()   # what was bound from the forgotten choices, too
    return removed


__all__ = ["conv2d", "Conv2d", "plan", "KernelPlan", "ConvSpec", "has_avx512f", "has_avx2",
           "get_isa", "set_isa", "tuned_kernels", "use_tuned_kernels", "use_winograd",
           "set_tuning", "restore_tuning", "tuning_policy", "TuningPolicy", "ShipPolicy", "KernelKind",
           "Isa", "Precision", "Route", "SetMatch", "cache_clear", "set_weight_cache", "__version__"]
