"""ttile: convolution kernels for x86 CPUs generated from TTile optimization schemes.

``ttile.conv2d`` is the entry point. Importing ttile loads numpy and the compiled
extension only; the scheme language and code generator (:mod:`ttile.scheme`,
:mod:`ttile.codegen`) are imported on demand by the tools that use them.
"""
from .api import conv2d, get_isa, has_avx512f, set_isa, tuned_kernels, use_tuned_kernels
from .spec import ConvSpec

__version__ = "0.1.0"

__all__ = ["conv2d", "ConvSpec", "has_avx512f", "get_isa", "set_isa", "tuned_kernels",
           "use_tuned_kernels", "__version__"]
