"""Float64 reference convolution: the oracle every kernel is checked against.

Used by the tests and by the generator, which verifies every kernel it builds before
timing it. numpy only, so the runtime could use it too without new dependencies.
"""
from __future__ import annotations

import numpy as np


def conv2d_nhwc_f64(x: np.ndarray, w: np.ndarray, stride=(1, 1),
                    pads=(0, 0, 0, 0), dilation=(1, 1), groups: int = 1) -> np.ndarray:
    """y[n,oh,ow,k] = sum x[n, oh*sh+r*dh-pt, ow*sw+s*dw-pl, c] * w[r,s,c,k], in float64;
    with ``groups``, w is (R, S, C/groups, K) and group g maps input channels
    [g*C/G, (g+1)*C/G) to outputs [g*K/G, (g+1)*K/G), as in torch.

    ``pads`` is (top, bottom, left, right). Computed as R*S matrix products over a
    zero-padded float64 copy, so it is simple enough to trust and fast enough for the
    largest Fig. 8 layers.
    """
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    sh, sw = stride
    dh, dw = dilation
    pt, pb, pl, pr = pads
    n, h, wd, c = x.shape
    r, s, cg, k = w.shape
    kg = k // groups
    xp = np.zeros((n, h + pt + pb, wd + pl + pr, c))
    xp[:, pt:pt + h, pl:pl + wd, :] = x
    ho = (h + pt + pb - (r - 1) * dh - 1) // sh + 1
    wo = (wd + pl + pr - (s - 1) * dw - 1) // sw + 1
    y = np.zeros((n, ho, wo, k))
    for i in range(r):
        for j in range(s):
            patch = xp[:, i * dh:i * dh + (ho - 1) * sh + 1:sh,
                       j * dw:j * dw + (wo - 1) * sw + 1:sw, :]
            for g in range(groups):
                y[..., g * kg:(g + 1) * kg] += (
                    patch[..., g * cg:(g + 1) * cg].reshape(-1, cg)
                    .dot(w[i, j, :, g * kg:(g + 1) * kg]).reshape(n, ho, wo, kg))
    return y


def conv_mismatch(actual: np.ndarray, x: np.ndarray, w: np.ndarray, stride=(1, 1),
                  pads=(0, 0, 0, 0), layout: str = "NHWC", dilation=(1, 1),
                  groups: int = 1) -> str | None:
    """None if a float32 result matches the float64 reference elementwise, else why not.

    The tolerance scales with the magnitude of the terms summed (conv of |x| and |w|)
    and with sqrt(C*R*S), the random-walk growth of float32 rounding error, so it is
    tight enough to catch one missing or misplaced term of a large reduction.
    """
    if layout == "NCHW":
        x = np.transpose(x, (0, 2, 3, 1))
        w = np.transpose(w, (2, 3, 1, 0))
        actual = np.transpose(actual, (0, 2, 3, 1))
    expected = conv2d_nhwc_f64(x, w, stride, pads, dilation, groups)
    if actual.shape != expected.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    if actual.dtype != np.float32:
        return f"dtype {actual.dtype}, expected float32"
    magnitude = conv2d_nhwc_f64(np.abs(x), np.abs(w), stride, pads, dilation, groups)
    terms = w.shape[0] * w.shape[1] * w.shape[2]
    tolerance = 8 * np.sqrt(terms) * np.finfo(np.float32).eps * magnitude + 1e-30
    error = np.abs(actual.astype(np.float64) - expected)
    bad = ~(error <= tolerance)  # NaN counts as wrong
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        return (f"{int(bad.sum())} of {bad.size} outputs off; first at {idx}: got "
                f"{actual[idx]}, expected {expected[idx]} (tolerance {tolerance[idx]:.3g})")
    return None


def assert_conv_close(actual: np.ndarray, x: np.ndarray, w: np.ndarray, stride=(1, 1),
                      pads=(0, 0, 0, 0), layout: str = "NHWC") -> None:
    """Raise AssertionError with the first mismatch (see :func:`conv_mismatch`)."""
    problem = conv_mismatch(actual, x, w, stride, pads, layout)
    if problem is not None:
        raise AssertionError(problem)


def activate_f64(values: np.ndarray, activation, negative_slope: float = 0.01) -> np.ndarray:
    """A fused activation (``ttile.core.kinds.Activation`` or its name; None for none)
    applied in float64."""
    from .kinds import Activation
    name = Activation(activation or "none")
    v = np.asarray(values, dtype=np.float64)
    if name is Activation.NONE:
        return v
    if name is Activation.RELU:
        return np.maximum(v, 0.0)
    if name is Activation.RELU6:
        return np.clip(v, 0.0, 6.0)
    if name is Activation.LEAKY_RELU:
        return np.where(v < 0, v * negative_slope, v)
    if name is Activation.SILU:
        return v / (1.0 + np.exp(-v))
    return 1.0 / (1.0 + np.exp(-v))
