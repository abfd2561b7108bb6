"""Checking and normalising a call's arguments: arrays, shapes, stride, padding,
dilation, groups and thread counts, into one group's :class:`ConvSpec`.

Everything a caller can get wrong about the problem itself is refused here with a
ValueError or TypeError that names it, before any pointer reaches C. ``conv2d``,
``plan`` and ``Conv2d`` all check through these functions, so a bad argument fails the
same way on every path. (The epilogue's arrays and ``out`` are checked in ``epilogue``.)
"""
from __future__ import annotations

import operator
import os
from typing import Union

import numpy as np

from ..core.cpuinfo import process_cpus
from ..core.spec import ConvSpec

IntPair = Union[int, tuple[int, int]]

#: Largest stride or padding accepted: the kernels index with 64-bit offsets but take
#: these as C ints.
MAX_EXTENT = 2**31 - 1
#: More threads than this is a mistake, not a request (OpenMP would try to start them).
MAX_THREADS = 1024

FLOAT32 = np.dtype(np.float32)


def default_threads() -> int:
    """All CPUs this process may run on (:func:`ttile.core.cpuinfo.process_cpus`)."""
    return len(process_cpus())


def memory_limit_bytes() -> int:
    """This machine's memory: no output larger than it is attempted."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def strict_int(item, message: str) -> int:
    """``item`` as an int if it is an integer (numpy ones included) and not a bool;
    otherwise TypeError(message)."""
    if isinstance(item, (bool, np.bool_)):
        raise TypeError(message)
    try:
        return operator.index(item)
    except TypeError:
        raise TypeError(message) from None


def as_pair(value, name: str, minimum: int) -> tuple[int, int]:
    """An int or a pair of ints, each in [minimum, MAX_EXTENT], as a pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
        items = tuple(value)
    else:
        items = (value, value)
    pair = []
    for item in items:
        number = strict_int(item, f"{name} must be an int or a pair of ints, got {value!r}")
        if number < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
        if number > MAX_EXTENT:
            raise ValueError(f"{name} must be <= {MAX_EXTENT}, got {value!r}")
        pair.append(number)
    return pair[0], pair[1]


def as_float32(array, name: str) -> np.ndarray:
    """A C-contiguous, aligned float32 view or copy of ``array``; refuses what is not real."""
    if type(array) is np.ndarray and array.dtype == FLOAT32:
        flags = array.flags
        if flags.c_contiguous and flags.aligned:
            return array  # the common case, kept to a few attribute reads
    if not isinstance(array, np.ndarray):
        try:
            array = np.asarray(array)
        except Exception as exc:  # e.g. ragged nested lists
            raise TypeError(f"{name} cannot be read as an array: {exc}") from None
    kind = array.dtype.kind
    if array.dtype.name == "bfloat16" and array.dtype.itemsize == 2:   # ml_dtypes: exact
        return np.require(array.astype(np.float32), requirements=("C", "A"))
    if kind == "b":
        raise TypeError(f"{name} has dtype bool; convolution needs a real numeric dtype")
    if kind == "c":
        raise TypeError(f"{name} has complex dtype {array.dtype}; only real inputs are supported")
    if kind not in "fiu":
        raise TypeError(f"{name} has dtype {array.dtype}; expected float32 (float16, bfloat16, "
                        f"float64 and integer arrays are converted to float32)")
    return np.require(array, dtype=np.float32, requirements=("C", "A"))


def padding_sides(padding, r: int, s: int, stride: tuple[int, int],
                  dilation: tuple[int, int] = (1, 1)) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) for torch's padding argument."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding == "same":
            if stride != (1, 1):
                raise ValueError("padding='same' is not supported for strided convolutions "
                                 "(as in torch); pass explicit padding instead")
            total_h, total_w = (r - 1) * dilation[0], (s - 1) * dilation[1]
            top, left = total_h // 2, total_w // 2
            return top, total_h - top, left, total_w - left
        raise ValueError(f"padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
    if isinstance(padding, (tuple, list)) and len(padding) == 2 \
            and all(isinstance(side, (tuple, list)) for side in padding):
        # ((top, bottom), (left, right)): the asymmetric padding an ONNX model may carry
        # (auto_pad SAME_* with a stride, explicit pads); torch needs F.pad for it.
        top, bottom = as_pair(padding[0], "padding", 0)
        left, right = as_pair(padding[1], "padding", 0)
        return top, bottom, left, right
    ph, pw = as_pair(padding, "padding", 0)
    return ph, ph, pw, pw


def thread_count(threads) -> int:
    """``threads`` checked (None: all CPUs this process may use)."""
    if threads is None:
        return default_threads()
    count = strict_int(threads, f"threads must be a positive int or None, got {threads!r}")
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    if count > MAX_THREADS:
        raise ValueError(f"threads must be <= {MAX_THREADS}, got {count}")
    return count


def group_count(groups) -> int:
    count = strict_int(groups, f"groups must be a positive int, got {groups!r}")
    if count < 1:
        raise ValueError(f"groups must be >= 1, got {count}")
    return count


def shape_tuple(shape, name: str) -> tuple[int, ...]:
    """A shape given to ``plan`` as a tuple of non-negative ints."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}")
    dims = []
    for item in shape:
        value = strict_int(item, f"{name} must hold ints, got {shape!r}")
        if value < 0:
            raise ValueError(f"{name} has a negative size: {shape!r}")
        dims.append(value)
    return tuple(dims)


def make_spec(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: IntPair = 1,
              padding: Union[IntPair, str] = 0, layout: str = "NCHW",
              dilation: IntPair = 1, groups: int = 1) -> ConvSpec:
    """The ConvSpec of a conv2d call - of one group's convolution when ``groups`` > 1 -
    checking ranks, channels and sizes."""
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    if len(x_shape) != 4:
        raise ValueError(f"input must have 4 dimensions ({layout}), got {len(x_shape)}: "
                         f"shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        expected = "(K, C, R, S)" if layout == "NCHW" else "(R, S, C, K)"
        raise ValueError(f"weights must have 4 dimensions {expected}, got {len(w_shape)}: "
                         f"shape {tuple(w_shape)}")
    if layout == "NCHW":
        n, c, h, w = x_shape
        k, wc, r, s = w_shape
    else:
        n, h, w, c = x_shape
        r, s, wc, k = w_shape
    if 0 in x_shape or 0 in w_shape:
        raise ValueError(f"zero-size dimension: input {tuple(x_shape)}, weights {tuple(w_shape)}")
    g = group_count(groups)
    if c % g:
        raise ValueError(f"input channels ({c}) are not divisible by groups ({g})")
    if k % g:
        raise ValueError(f"output channels ({k}) are not divisible by groups ({g})")
    if wc * g != c:
        if g == 1:
            raise ValueError(f"channel mismatch: input has {c} channels, weights expect {wc}")
        raise ValueError(f"channel mismatch: input has {c} channels, {g} groups of weights "
                         f"with {wc} each expect {wc * g}")
    sh, sw = as_pair(stride, "stride", 1)
    dh, dw = as_pair(dilation, "dilation", 1)
    pt, pb, pl, pr = padding_sides(padding, r, s, (sh, sw), (dh, dw))
    span_h, span_w = (r - 1) * dh + 1, (s - 1) * dw + 1
    if h + pt + pb < span_h or w + pl + pr < span_w:
        raise ValueError(f"kernel {span_h}x{span_w} (dilated) is larger than the padded input "
                         f"{h + pt + pb}x{w + pl + pr}")
    return ConvSpec(n=n, k=k // g, c=wc, h=h, w=w, r=r, s=s, stride_h=sh, stride_w=sw,
                    pad_top=pt, pad_bottom=pb, pad_left=pl, pad_right=pr,
                    dilation_h=dh, dilation_w=dw)
