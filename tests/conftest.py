import numpy as np
import pytest

import ttile

requires_avx512 = pytest.mark.skipif(not ttile.has_avx512f(),
                                     reason="this CPU (or OS) does not support AVX-512F")

#: Kernel families a test can run on this machine.
AVAILABLE_ISAS = ["portable"] + (["avx512f"] if ttile.has_avx512f() else [])


@pytest.fixture
def isa(request):
    """Run the test body with ttile dispatching to the requested kernel family."""
    previous = ttile.set_isa(request.param)
    yield request.param
    ttile.set_isa(previous)


def random_tensors(rng: np.random.Generator, x_shape, w_shape):
    x = rng.uniform(-1.0, 1.0, x_shape).astype(np.float32)
    w = rng.uniform(-1.0, 1.0, w_shape).astype(np.float32)
    return x, w
