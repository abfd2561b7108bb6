# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled kernels of ttile: CPU detection, the generic convolution, the FMA benchmark.

Every entry point re-checks dtype, contiguity and shapes at C level before it touches a
pointer, so a caller that bypasses ``ttile.conv2d`` gets an exception, never a misread.
"""
from libc.stdint cimport int64_t
cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "ttile_epilogue.h" nogil:
    ctypedef struct ttile_epilogue:
        const float *bias
        const float *residual
        int activation
        float negative_slope

cdef extern from "ttile_runtime.h" nogil:
    ctypedef struct ttile_conv_shape:
        int64_t n, h, w, c
        int64_t k, r, s
        int64_t ho, wo
        int64_t stride_h, stride_w
        int64_t pad_top, pad_left
        int64_t dil_h, dil_w
        int64_t groups
    int ttile_cpu_has_avx512f()
    int ttile_cpu_has_avx2()
    int64_t ttile_cpu_l2_bytes()
    int64_t ttile_generic_cache_bytes()
    void ttile_set_generic_cache_bytes(int64_t bytes)
    int64_t ttile_generic_stream_bytes()
    void ttile_set_generic_stream_bytes(int64_t bytes)
    void ttile_conv_generic_portable(const ttile_conv_shape *shape, const float *x,
                                     const float *w, float *y, int nthreads,
                                     const ttile_epilogue *ep)
    int ttile_conv_generic_avx512(const ttile_conv_shape *shape, const float *x,
                                  const float *w, float *y, int nthreads,
                                  const ttile_epilogue *ep)
    int ttile_conv_generic_avx2(const ttile_conv_shape *shape, const float *x,
                                const float *w, float *y, int nthreads,
                                const ttile_epilogue *ep)
    int64_t ttile_generic_panel_avx512(int64_t k, int64_t wo)
    int64_t ttile_generic_panel_avx2(int64_t k, int64_t wo)
    int ttile_conv_generic_packed_avx512(const ttile_conv_shape *shape, const float *x,
                                         const float *packed, float *y, int nthreads,
                                         int flags, const ttile_epilogue *ep)
    int ttile_conv_generic_packed_avx2(const ttile_conv_shape *shape, const float *x,
                                       const float *packed, float *y, int nthreads,
                                       int flags, const ttile_epilogue *ep)
    void ttile_conv_depthwise_avx512(const ttile_conv_shape *shape, const float *x,
                                     const float *w, float *y, int nthreads,
                                     const ttile_epilogue *ep)
    int ttile_grouped_lanes_supported(int64_t c, int64_t k, int64_t groups)
    int ttile_conv_grouped_avx512(const ttile_conv_shape *shape, const float *x,
                                  const float *w, float *y, int nthreads,
                                  const ttile_epilogue *ep)
    void ttile_conv_depthwise_avx2(const ttile_conv_shape *shape, const float *x,
                                   const float *w, float *y, int nthreads,
                                   const ttile_epilogue *ep)
    ctypedef struct ttile_ir_shape:
        int64_t n, h, w, c
        int64_t e, k
        int64_t stride
        int64_t ho, wo
        int act1, act2, act3
        float slope1, slope2, slope3
        int residual
    int64_t ttile_inverted_residual_scratch_floats(const ttile_ir_shape *shape, int nthreads)
    void ttile_inverted_residual_pack(const float *w, int64_t kk, int64_t n, int64_t ldw,
                                      float *out)
    int ttile_inverted_residual_avx512(const ttile_ir_shape *shape, const float *x,
                                       const float *w1, const float *b1, const float *w2,
                                       const float *b2, const float *w3, const float *b3,
                                       float *y, float *scratch, int nthreads)
    int64_t ttile_inverted_residual_amx_scratch_bytes(const ttile_ir_shape *shape,
                                                      int nthreads)
    int ttile_inverted_residual_amx(const ttile_ir_shape *shape, const void *x, int x_bf16,
                                    const unsigned short *w1, const float *b1,
                                    const float *w2, const float *b2,
                                    const unsigned short *w3, const float *b3, void *y,
                                    int y_bf16, void *scratch, int nthreads)
    int ttile_depthwise_nchw_supported(const ttile_conv_shape *shape)
    int ttile_pointwise_nchw_supported(const ttile_conv_shape *shape)
    int ttile_conv_pointwise_nchw_avx512(const ttile_conv_shape *shape, const float *x,
                                         const float *w, int w_kc, float *y, int nthreads,
                                         const ttile_epilogue *ep)
    int ttile_conv_depthwise_nchw_avx512(const ttile_conv_shape *shape, const float *x,
                                         const float *w, float *y, int nthreads,
                                         const ttile_epilogue *ep)
    int64_t ttile_winograd_panel_avx512(int64_t k)
    int64_t ttile_winograd_weight_floats_avx512(int64_t c, int64_t k, int tile)
    void ttile_winograd_weights_avx512(const float *w, int64_t c, int64_t k, int kcrs,
                                       float *u, int nthreads, int tile)
    int ttile_conv_winograd_avx512(const ttile_conv_shape *shape, const float *x,
                                   const float *u, float *y, int nthreads,
                                   const ttile_epilogue *ep, int tile)
    int64_t ttile_winograd_panel_avx2(int64_t k)
    int64_t ttile_winograd_weight_floats_avx2(int64_t c, int64_t k, int tile)
    void ttile_winograd_weights_avx2(const float *w, int64_t c, int64_t k, int kcrs,
                                     float *u, int nthreads, int tile)
    int ttile_conv_winograd_avx2(const ttile_conv_shape *shape, const float *x,
                                 const float *u, float *y, int nthreads,
                                 const ttile_epilogue *ep, int tile)
    double ttile_fma_peak_avx512(int64_t iterations)
    double ttile_read_seconds_avx512(const float *buffer, int64_t floats, int64_t reps)
    double ttile_fma_peak_avx2(int64_t iterations)
    double ttile_read_seconds_avx2(const float *buffer, int64_t floats, int64_t reps)
    void ttile_pack_weights(const float *w, int64_t rsc, int64_t k, int64_t panel, float *out,
                            int nthreads)
    int ttile_same_bytes(const void *a, const void *b, int64_t nbytes, int nthreads)
    void ttile_maxpool_nhwc(const float *x, float *y, int64_t n, int64_t h, int64_t w,
                            int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                            int64_t ph, int64_t pw, int64_t ho, int64_t wo, int nthreads,
                            int isa)
    void ttile_maxpool_nhwc_bf16(const unsigned short *x, unsigned short *y, int64_t n,
                                 int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
                                 int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                 int64_t ho, int64_t wo, int nthreads, int isa)
    void ttile_global_avgpool_nhwc(const float *x, float *y, int64_t n, int64_t hw,
                                   int64_t c, int nthreads)
    int ttile_packed_matches(const void *w, int64_t rsc, int64_t k, int64_t panel,
                             const void *packed, int nthreads, int isa)
    void ttile_nchw_to_nhwc(const float *src, float *dst, int64_t n, int64_t c, int64_t hw,
                            int nthreads, int isa)
    void ttile_nhwc_to_nchw(const float *src, float *dst, int64_t n, int64_t hw, int64_t c,
                            int nthreads, int isa)
    void ttile_pack_weights_kcrs(const float *w, int64_t k, int64_t c, int64_t rs,
                                 int64_t panel, float *out, int nthreads, int isa)
    void ttile_subsample_nchw(const float *src, float *dst, int64_t planes, int64_t h,
                              int64_t w, int64_t sh, int64_t sw, int64_t ho, int64_t wo,
                              int nthreads, int isa)

cdef extern from "ttile_registry.h" nogil:
    ctypedef void (*ttile_kernel_fn)(const float *x, const float *w, float *y, int nthreads,
                                     const ttile_epilogue *ep)
    ctypedef struct ttile_tuned_kernel:
        const char *cpu
        int threads
        int n, k, c, h, w, r, s
        int stride_h, stride_w
        int pad_top, pad_bottom, pad_left, pad_right
        int dilation_h, dilation_w
        int groups
        int isa
        int panel
        ttile_kernel_fn fn
        ttile_kernel_fn fn_nchw
        const char *layer
        const char *scheme
        double gflops
        double warm_gflops
        double generic_gflops
    const ttile_tuned_kernel ttile_tuned_kernels[]
    const int ttile_tuned_kernel_count

cdef enum:
    _ISA_PORTABLE = 0
    _ISA_AVX512F = 1
    _ISA_AVX2 = 2

ISA_PORTABLE = _ISA_PORTABLE
ISA_AVX512F = _ISA_AVX512F
ISA_AVX2 = _ISA_AVX2


cdef int _require_isa(int isa) except -1:
    """Refuse a vector kernel the CPU cannot run (it would fault, not fail)."""
    if isa == ISA_AVX512F:
        if ttile_cpu_has_avx512f() != 1:
            raise RuntimeError("AVX-512F kernel requested on a CPU without AVX-512F")
    elif isa == ISA_AVX2:
        if ttile_cpu_has_avx2() != 1:
            raise RuntimeError("AVX2 kernel requested on a CPU without AVX2 and FMA")
    else:
        raise ValueError(f"unknown vector isa {isa}")
    return 0


cdef int64_t _generic_panel(int64_t k, int64_t wo, int isa) nogil:
    return ttile_generic_panel_avx2(k, wo) if isa == _ISA_AVX2 \
        else ttile_generic_panel_avx512(k, wo)


cdef const ttile_epilogue *_epilogue(ttile_epilogue *ep, object bias, object residual,
                                     int activation, float slope, cnp.ndarray y,
                                     int64_t channels) except? NULL:
    """Fill ``ep`` from the keyword arguments, checked against the output y (residual:
    y's shape) and its ``channels`` (bias); NULL when there is nothing to fuse."""
    cdef cnp.ndarray b, r
    ep.bias = NULL
    ep.residual = NULL
    ep.activation = activation
    ep.negative_slope = slope
    if activation < 0 or activation > 5:
        raise ValueError(f"unknown activation code {activation}")
    if bias is not None:
        b = bias
        if cnp.PyArray_TYPE(b) != cnp.NPY_FLOAT32 or cnp.PyArray_NDIM(b) != 1 \
                or not cnp.PyArray_IS_C_CONTIGUOUS(b) or cnp.PyArray_DIMS(b)[0] != channels:
            raise ValueError(f"bias must be a contiguous float32 vector of {channels}")
        ep.bias = <const float *>cnp.PyArray_DATA(b)
    if residual is not None:
        r = residual
        if cnp.PyArray_TYPE(r) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(r) \
                or (<object>r).shape != (<object>y).shape:
            raise ValueError(f"residual must be a C-contiguous float32 array of the "
                             f"output's shape {(<object>y).shape}")
        ep.residual = <const float *>cnp.PyArray_DATA(r)
    if ep.bias == NULL and ep.residual == NULL and activation == 0:
        return NULL
    return ep


def cpu_has_avx512f():
    """True when both the CPU and the OS support AVX-512F."""
    return ttile_cpu_has_avx512f() == 1


def cpu_has_avx2():
    """True when the CPU has AVX2 and FMA and the OS saves the YMM registers."""
    return ttile_cpu_has_avx2() == 1


cdef extern from "omp.h" nogil:
    int omp_get_num_places()
    int omp_get_place_num_procs(int place_num)
    void omp_get_place_proc_ids(int place_num, int *ids)


def openmp_place_cpus():
    """The CPUs in the OpenMP runtime's place list, sorted; empty when no place list is in
    force (neither OMP_PROC_BIND nor OMP_PLACES set).

    With a place list in force, loading the runtime binds the importing thread to the first
    place, so the process's affinity read afterwards says one CPU: the place list still
    holds every CPU the runtime started with."""
    cdef int places = omp_get_num_places()
    cdef int place, i, count
    cdef int ids[4096]
    found = set()
    for place in range(places):
        count = omp_get_place_num_procs(place)
        if 0 < count <= 4096:
            omp_get_place_proc_ids(place, ids)
            for i in range(count):
                found.add(ids[i])
    return sorted(found)


def cpu_l2_bytes():
    """This core's L2 cache in bytes, as cpuid reports it (0 when unknown)."""
    return ttile_cpu_l2_bytes()


def generic_cache_bytes():
    """The generic kernel's cache blocking in bytes: the weight panels a thread keeps in
    L2 across an output row, and a reduction chunk's part of a panel (half this core's
    L2 unless set)."""
    return ttile_generic_cache_bytes()


def set_generic_cache_bytes(int64_t nbytes):
    """Set the generic kernel's cache blocking (``generic_cache_bytes``) for this
    process; 0 restores half this core's L2. Returns the previous value."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    previous = ttile_generic_cache_bytes()
    ttile_set_generic_cache_bytes(nbytes)
    return previous


def generic_stream_bytes():
    """The size past which the generic kernel stores an NHWC output past the caches
    (non-temporal stores): the last-level cache, or 32 MiB when unknown."""
    return ttile_generic_stream_bytes()


def set_generic_stream_bytes(int64_t nbytes):
    """Set ``generic_stream_bytes`` for this process (tests); 0 restores the default.
    Returns the previous value."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    previous = ttile_generic_stream_bytes()
    ttile_set_generic_stream_bytes(nbytes)
    return previous


cdef int _check_f32_c4(cnp.ndarray a, str name) except -1:
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if cnp.PyArray_NDIM(a) != 4:
        raise ValueError(f"{name} must have 4 dimensions, got {cnp.PyArray_NDIM(a)}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return 0


cdef int _check_f32_contiguous(cnp.ndarray a, str name) except -1:
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return 0


cdef int _check_dims(cnp.ndarray a, str name, int nd, int64_t d0, int64_t d1, int64_t d2,
                     int64_t d3) except -1:
    """float32, C-contiguous, aligned, with nd dimensions of the sizes given."""
    _check_f32_contiguous(a, name)
    cdef int64_t want[4]
    want[0], want[1], want[2], want[3] = d0, d1, d2, d3
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(a)
    cdef int i
    cdef bint ok = cnp.PyArray_NDIM(a) == nd
    if ok:
        for i in range(nd):
            ok = ok and dims[i] == want[i]
    if not ok:
        raise ValueError(f"{name} must be {tuple(want[i] for i in range(nd))}, got "
                         f"{(<object>a).shape}")
    return 0


cdef int _fill_shape(ttile_conv_shape *shape, cnp.ndarray x, cnp.ndarray y,
                     int64_t r, int64_t s, int64_t wc, int64_t k,
                     int64_t stride_h, int64_t stride_w, int64_t pad_top, int64_t pad_left,
                     int nthreads, bint nchw_out=False, int64_t dil_h=1, int64_t dil_w=1,
                     int64_t groups=1, bint nchw_in=False) except -1:
    """Fill ``shape`` from x (N,H,W,C), or (N,C,H,W) with ``nchw_in``, y (N,Ho,Wo,K), or
    (N,K,Ho,Wo) with ``nchw_out``, and the weights' extents (``wc`` input channels per
    group, ``k`` output channels in all), refusing any combination under which a kernel
    could index outside the arrays."""
    _check_f32_c4(x, "x")
    _check_f32_c4(y, "y")
    if not cnp.PyArray_ISWRITEABLE(y):
        raise ValueError("y must be writeable")
    cdef cnp.npy_intp *xd = cnp.PyArray_DIMS(x)
    cdef cnp.npy_intp xs[4]
    xs[0] = xd[0]
    xs[1] = xd[2] if nchw_in else xd[1]
    xs[2] = xd[3] if nchw_in else xd[2]
    xs[3] = xd[1] if nchw_in else xd[3]
    cdef cnp.npy_intp *ys = cnp.PyArray_DIMS(y)
    if groups < 1 or dil_h < 1 or dil_w < 1:
        raise ValueError("groups and dilation must be >= 1")
    shape.n = xs[0]; shape.h = xs[1]; shape.w = xs[2]; shape.c = xs[3] // groups
    shape.r = r; shape.s = s; shape.k = k // groups
    shape.ho = ys[2] if nchw_out else ys[1]
    shape.wo = ys[3] if nchw_out else ys[2]
    shape.stride_h = stride_h; shape.stride_w = stride_w
    shape.pad_top = pad_top; shape.pad_left = pad_left
    shape.dil_h = dil_h; shape.dil_w = dil_w; shape.groups = groups
    if xs[3] % groups or k % groups:
        raise ValueError(f"{xs[3]} input and {k} output channels are not divisible by "
                         f"{groups} groups")
    if wc != shape.c:
        raise ValueError(f"weights have {wc} input channels per group, input has "
                         f"{shape.c}")
    if ys[0] != shape.n or (ys[1] if nchw_out else ys[3]) != k:
        raise ValueError("output shape does not match input batch and weight channels")
    if stride_h < 1 or stride_w < 1 or pad_top < 0 or pad_left < 0 or nthreads < 1:
        raise ValueError("strides and thread count must be >= 1, padding >= 0")
    if shape.n * shape.h * shape.w * shape.c * shape.k * shape.r * shape.s == 0:
        raise ValueError("zero-size dimension")
    cdef int64_t span_h = (shape.r - 1) * dil_h + 1, span_w = (shape.s - 1) * dil_w + 1
    if (shape.ho - 1) * stride_h - pad_top + span_h > shape.h + pad_top + span_h \
            or (shape.wo - 1) * stride_w - pad_left + span_w > shape.w + pad_left + span_w:
        raise ValueError("output extent too large for the input and padding")
    if shape.ho < 1 or shape.wo < 1:
        raise ValueError("empty output")
    return 0


def conv2d_generic_nhwc(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y,
                        int64_t stride_h, int64_t stride_w,
                        int64_t pad_top, int64_t pad_left, int nthreads, int isa, *,
                        int64_t dil_h=1, int64_t dil_w=1, int64_t groups=1,
                        bias=None, residual=None, int activation=0, float slope=0.01):
    """Run the generic kernel on x (N,H,W,C), w (R,S,C/groups,K) into y (N,Ho,Wo,K),
    with the epilogue y = act(conv + bias + residual) fused.

    ``isa`` is ISA_PORTABLE, ISA_AVX512F or ISA_AVX2 (those two: groups 1 only);
    asking for an ISA the CPU lacks raises instead of faulting.
    """
    _check_f32_c4(w, "w")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef ttile_conv_shape shape
    _fill_shape(&shape, x, y, ws[0], ws[1], ws[2], ws[3], stride_h, stride_w, pad_top,
                pad_left, nthreads, False, dil_h, dil_w, groups)
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, ws[3])
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    cdef int status = 0
    if isa == ISA_AVX512F or isa == ISA_AVX2:
        _require_isa(isa)
        if groups != 1:
            raise ValueError("the vector generic kernels take grouped weights packed")
        with nogil:
            if isa == _ISA_AVX2:
                status = ttile_conv_generic_avx2(&shape, xp, wp, yp, nthreads, ep)
            else:
                status = ttile_conv_generic_avx512(&shape, xp, wp, yp, nthreads, ep)
        if status != 0:
            raise MemoryError("not enough memory to pack the weights for the generic kernel")
    elif isa == ISA_PORTABLE:
        with nogil:
            ttile_conv_generic_portable(&shape, xp, wp, yp, nthreads, ep)
    else:
        raise ValueError(f"unknown isa {isa}")


def conv2d_depthwise(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y,
                     int64_t stride_h, int64_t stride_w, int64_t pad_top, int64_t pad_left,
                     int nthreads, *, int64_t dil_h=1, int64_t dil_w=1,
                     bias=None, residual=None, int activation=0, float slope=0.01,
                     int isa=_ISA_AVX512F):
    """The depthwise kernel of ``isa`` (ISA_AVX512F or ISA_AVX2): x (N,H,W,C), weights
    (R,S,1,C) (channels_last depthwise weights, one output channel per input channel),
    y (N,Ho,Wo,C)."""
    _require_isa(isa)
    _check_f32_c4(w, "w")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    if ws[2] != 1 or ws[3] != xs[3]:
        raise ValueError(f"depthwise weights must be (R, S, 1, {xs[3]}), got "
                         f"{(<object>w).shape}")
    cdef ttile_conv_shape shape
    _fill_shape(&shape, x, y, ws[0], ws[1], 1, ws[3], stride_h, stride_w, pad_top,
                pad_left, nthreads, False, dil_h, dil_w, xs[3])
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, ws[3])
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    with nogil:
        if isa == _ISA_AVX2:
            ttile_conv_depthwise_avx2(&shape, xp, wp, yp, nthreads, ep)
        else:
            ttile_conv_depthwise_avx512(&shape, xp, wp, yp, nthreads, ep)


def grouped_lanes_supported(int64_t c, int64_t k, int64_t groups):
    """Whether the grouped kernel serves ``groups`` groups of ``c`` input and ``k``
    output channels each (c == k in 2, 4, 8, 16; 16-channel blocks in all)."""
    return ttile_grouped_lanes_supported(c, k, groups) == 1


def conv2d_grouped(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y,
                   int64_t stride_h, int64_t stride_w, int64_t pad_top, int64_t pad_left,
                   int nthreads, *, int64_t groups, int64_t dil_h=1, int64_t dil_w=1,
                   bias=None, residual=None, int activation=0, float slope=0.01):
    """The AVX-512F grouped kernel (kernels/grouped_avx512.c: output channels of several
    groups in the vector lanes): x (N,H,W,C), weights (K/16, R, S, cg * 16) (blocks of 16
    output channels, ``packing.grouped_weights``), y (N,Ho,Wo,K), cg = C/groups = K/groups
    in 2, 4, 8, 16."""
    _check_avx512_arrays(x, w, y)
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    if groups < 1 or xs[3] % groups:
        raise ValueError(f"{groups} groups do not divide {xs[3]} input channels")
    cdef int64_t cg = xs[3] // groups
    if ws[3] != cg * 16 or ws[0] * 16 != cg * groups:
        raise ValueError(f"grouped weights must be ({cg * groups // 16}, R, S, {cg * 16}) "
                         f"for {groups} groups of {cg} channels, got {(<object>w).shape}")
    if not ttile_grouped_lanes_supported(cg, cg, groups):
        raise ValueError(f"the grouped kernel does not serve {groups} groups of {cg} "
                         f"channels")
    cdef ttile_conv_shape shape
    _fill_shape(&shape, x, y, ws[1], ws[2], cg, cg * groups, stride_h, stride_w, pad_top,
                pad_left, nthreads, False, dil_h, dil_w, groups)
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, cg * groups)
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    cdef int status
    with nogil:
        status = ttile_conv_grouped_avx512(&shape, xp, wp, yp, nthreads, ep)
    if status != 0:
        raise ValueError("the grouped kernel refused the problem")


cdef int _ir_shape(ttile_ir_shape *sh, cnp.ndarray x, int64_t e, int64_t k, int64_t stride,
                   tuple activations, tuple slopes, bint residual) except -1:
    if cnp.PyArray_NDIM(x) != 4:
        raise ValueError(f"x must be 4-D (N, H, W, C), got {(<object>x).shape}")
    if stride not in (1, 2):
        raise ValueError(f"the depthwise stride must be 1 or 2, got {stride}")
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    sh.n, sh.h, sh.w, sh.c = xs[0], xs[1], xs[2], xs[3]
    sh.e, sh.k, sh.stride = e, k, stride
    sh.ho, sh.wo = (sh.h - 1) // stride + 1, (sh.w - 1) // stride + 1
    sh.act1, sh.act2, sh.act3 = activations
    sh.slope1, sh.slope2, sh.slope3 = slopes
    sh.residual = residual
    if residual and (stride != 1 or sh.c != k):
        raise ValueError("a residual needs stride 1 and as many output channels as input "
                         f"channels (stride {stride}, {sh.c} -> {k})")
    if min(sh.n, sh.h, sh.w, sh.c, e, k) < 1:
        raise ValueError(f"empty inverted residual block: x {(<object>x).shape}, e {e}, k {k}")
    return 0


cdef bint _ir_expands(object w1, object b1, int64_t e, int64_t c) except -1:
    """Whether a block call has an expand stage: w1 and b1 both arrays, or both None
    (then e must equal C: the depthwise layer reads x)."""
    if w1 is not None and b1 is not None:
        return True
    if w1 is not None or b1 is not None:
        raise ValueError("w1 and b1 are both arrays or both None (no expand stage)")
    if e != c:
        raise ValueError(f"without an expand stage e must equal C ({e} != {c})")
    return False


def inverted_residual_scratch_floats(tuple x_shape, int64_t e, int64_t k, int64_t stride,
                                     int nthreads, int act3=0):
    """Floats of scratch :func:`inverted_residual` needs at ``nthreads`` (``act3``: the
    project stage's activation code, which decides whether threads may split channels)."""
    cdef ttile_ir_shape sh
    sh.n, sh.h, sh.w, sh.c = x_shape
    sh.e, sh.k, sh.stride = e, k, stride
    sh.ho, sh.wo = (sh.h - 1) // stride + 1, (sh.w - 1) // stride + 1
    sh.act3 = act3
    return ttile_inverted_residual_scratch_floats(&sh, nthreads)


def inverted_residual_pack(cnp.ndarray w, cnp.ndarray out):
    """A 1x1 stage's (kk, n) float32 weights (the input channel major) into ``out``
    (kk, n rounded up to 16), in the fused kernel's panels."""
    _check_f32_contiguous(w, "w")
    _check_f32_contiguous(out, "out")
    if cnp.PyArray_NDIM(w) != 2 or cnp.PyArray_NDIM(out) != 2:
        raise ValueError("w and out must be 2-D")
    cdef int64_t kk = w.shape[0], n = w.shape[1]
    if (<object>out).shape != (kk, (n + 15) // 16 * 16):
        raise ValueError(f"out must be {(kk, (n + 15) // 16 * 16)}, got {(<object>out).shape}")
    with nogil:
        ttile_inverted_residual_pack(<const float *>cnp.PyArray_DATA(w), kk, n, n,
                                     <float *>cnp.PyArray_DATA(out))


def inverted_residual(cnp.ndarray x, object w1, object b1, cnp.ndarray w2,
                      cnp.ndarray b2, cnp.ndarray w3, cnp.ndarray b3, cnp.ndarray y,
                      cnp.ndarray scratch, int64_t e, int64_t stride, tuple activations,
                      tuple slopes, bint residual, int nthreads):
    """The AVX-512 inverted residual block (kernels/inverted_residual_avx512.c): x
    (N, H, W, C); w1 (C, EP), b1 (EP,), w2 (9, EP), b2 (EP,), w3 (EP, KP), b3 (KP,) packed
    as that file says (EP, KP: e and k rounded up to 16, zero padded); y (N, Ho, Wo, K);
    scratch of inverted_residual_scratch_floats floats; ``activations`` and
    ``slopes`` the three stages' TTILE_ACT_* codes and leaky slopes. w1 and b1 None: no
    expand stage (e == C, the depthwise layer reads x; the first activation unused)."""
    _require_isa(_ISA_AVX512F)
    cdef ttile_ir_shape sh
    _ir_shape(&sh, x, e, 0 if cnp.PyArray_NDIM(y) != 4 else cnp.PyArray_DIMS(y)[3], stride,
              activations, slopes, residual)
    cdef int64_t ep = (e + 15) // 16 * 16, kp = (sh.k + 15) // 16 * 16
    # C-level checks: this runs once per block call, and tuples of shapes cost microseconds
    _check_dims(x, "x", 4, sh.n, sh.h, sh.w, sh.c)
    _check_dims(y, "y", 4, sh.n, sh.ho, sh.wo, sh.k)
    cdef const float *w1p = NULL
    cdef const float *b1p = NULL
    if _ir_expands(w1, b1, e, sh.c):
        _check_dims(w1, "w1", 2, sh.c, ep, 0, 0)
        _check_dims(b1, "b1", 1, ep, 0, 0, 0)
        w1p = <const float *>cnp.PyArray_DATA(w1)
        b1p = <const float *>cnp.PyArray_DATA(b1)
    _check_dims(w2, "w2", 2, 9, ep, 0, 0)
    _check_dims(b2, "b2", 1, ep, 0, 0, 0)
    _check_dims(w3, "w3", 2, ep, kp, 0, 0)
    _check_dims(b3, "b3", 1, kp, 0, 0, 0)
    _check_f32_contiguous(scratch, "scratch")
    if nthreads < 1:
        raise ValueError(f"nthreads must be >= 1, got {nthreads}")
    if scratch.size < ttile_inverted_residual_scratch_floats(&sh, nthreads):
        raise ValueError("scratch too small for the block at this thread count")
    if (<size_t>cnp.PyArray_DATA(scratch)) % 64:
        raise ValueError("scratch must start on a 64-byte line")
    if not cnp.PyArray_ISWRITEABLE(y):
        raise ValueError("y is read-only")
    cdef int rc
    with nogil:
        rc = ttile_inverted_residual_avx512(
            &sh, <const float *>cnp.PyArray_DATA(x), w1p, b1p,
            <const float *>cnp.PyArray_DATA(w2),
            <const float *>cnp.PyArray_DATA(b2), <const float *>cnp.PyArray_DATA(w3),
            <const float *>cnp.PyArray_DATA(b3), <float *>cnp.PyArray_DATA(y),
            <float *>cnp.PyArray_DATA(scratch), nthreads)
    if rc != 0:
        raise ValueError("the inverted residual kernel refused the block")


cdef int _check_avx512_arrays(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y) except -1:
    """What every AVX-512F entry point on 4-D arrays checks first: the CPU runs it, the
    arrays are C-contiguous aligned float32 and y is writeable."""
    if ttile_cpu_has_avx512f() != 1:
        raise RuntimeError("AVX-512F kernel requested on a CPU without AVX-512F")
    _check_f32_c4(x, "x")
    _check_f32_c4(y, "y")
    _check_f32_c4(w, "w")
    if not cnp.PyArray_ISWRITEABLE(y):
        raise ValueError("y must be writeable")
    return 0


cdef int64_t _winograd_weight_floats(int64_t c, int64_t k, int isa, int tile) nogil:
    return ttile_winograd_weight_floats_avx2(c, k, tile) if isa == _ISA_AVX2 \
        else ttile_winograd_weight_floats_avx512(c, k, tile)


cdef _check_winograd_tile(int tile):
    if tile != 2 and tile != 4:
        raise ValueError(f"the Winograd output tile is 2 or 4, got {tile}")


def winograd_weight_floats(int64_t c, int64_t k, int isa=_ISA_AVX512F, int tile=4):
    """Floats of the Winograd F(tile x tile, 3x3) kernel's transformed weights for c input
    and k output channels ((tile + 2)^2 panels of c x P per ``winograd_panel(k, isa)``
    outputs: 36 for F(4x4), 16 for F(2x2)), for the kernel of ``isa`` (ISA_AVX512F or
    ISA_AVX2: their panels differ)."""
    if c < 1 or k < 1:
        raise ValueError("channel counts must be >= 1")
    if isa != ISA_AVX512F and isa != ISA_AVX2:
        raise ValueError(f"no Winograd kernel for isa {isa}")
    _check_winograd_tile(tile)
    return _winograd_weight_floats(c, k, isa, tile)


def winograd_panel(int64_t k, int isa=_ISA_AVX512F):
    """Output channels per panel of the Winograd kernel's transformed weights (``isa``:
    ISA_AVX512F or ISA_AVX2)."""
    if k < 1:
        raise ValueError("k must be >= 1")
    if isa != ISA_AVX512F and isa != ISA_AVX2:
        raise ValueError(f"no Winograd kernel for isa {isa}")
    return ttile_winograd_panel_avx2(k) if isa == _ISA_AVX2 \
        else ttile_winograd_panel_avx512(k)


def winograd_weights(cnp.ndarray w, bint kcrs, int nthreads, out=None,
                     int isa=_ISA_AVX512F, int tile=4):
    """3x3 weights, RSCK (3, 3, C, K) or (``kcrs``) torch's (K, C, 3, 3), transformed for
    the Winograd F(tile x tile, 3x3) kernel of ``isa``: U = G g G^T per (c, k), in the 1-D
    layout ``conv2d_winograd`` of the same ``isa`` and ``tile`` reads (into ``out`` when given, of
    ``winograd_weight_floats`` floats; else into a new array on a 64-byte line, so that
    no vector load of the products spans two lines)."""
    _require_isa(isa)
    _check_f32_c4(w, "w")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef int64_t c, k
    if kcrs:
        k, c = ws[0], ws[1]
        if ws[2] != 3 or ws[3] != 3:
            raise ValueError(f"KCRS weights must be (K, C, 3, 3), got {(<object>w).shape}")
    else:
        c, k = ws[2], ws[3]
        if ws[0] != 3 or ws[1] != 3:
            raise ValueError(f"RSCK weights must be (3, 3, C, K), got {(<object>w).shape}")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    _check_winograd_tile(tile)
    cdef int64_t floats = _winograd_weight_floats(c, k, isa, tile)
    if out is None:
        out = empty_aligned((floats,))
    cdef cnp.ndarray u = out
    if cnp.PyArray_TYPE(u) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(u) \
            or cnp.PyArray_SIZE(u) != floats or not cnp.PyArray_ISWRITEABLE(u):
        raise ValueError(f"out must be a writeable contiguous float32 array of {floats}")
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *up = <float *>cnp.PyArray_DATA(u)
    with nogil:
        if isa == _ISA_AVX2:
            ttile_winograd_weights_avx2(wp, c, k, kcrs, up, nthreads, tile)
        else:
            ttile_winograd_weights_avx512(wp, c, k, kcrs, up, nthreads, tile)
    return out


def conv2d_winograd(cnp.ndarray x, cnp.ndarray u, cnp.ndarray y, int64_t pad_top,
                    int64_t pad_left, int nthreads, *, bias=None, residual=None,
                    int activation=0, float slope=0.01, int isa=_ISA_AVX512F, int tile=4):
    """The Winograd F(tile x tile, 3x3) kernel of ``isa`` (ISA_AVX512F or ISA_AVX2):
    x (N,H,W,C), weights transformed by ``winograd_weights`` for the same ``isa`` and
    ``tile`` (4 or 2), y (N,Ho,Wo,K); 3x3, stride 1, no dilation, one group."""
    _require_isa(isa)
    _check_winograd_tile(tile)
    _check_f32_c4(x, "x")
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    cdef cnp.npy_intp *ys = cnp.PyArray_DIMS(y)
    if cnp.PyArray_TYPE(u) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(u) \
            or cnp.PyArray_NDIM(u) != 1:
        raise ValueError("u must be a contiguous 1-D float32 array")
    cdef int64_t k = ys[3]
    if k < 1 or cnp.PyArray_SIZE(u) != _winograd_weight_floats(xs[3], k, isa, tile):
        raise ValueError(f"u does not hold the transformed weights of {xs[3]} -> {k} "
                         f"channels")
    cdef ttile_conv_shape shape
    _fill_shape(&shape, x, y, 3, 3, xs[3], k, 1, 1, pad_top, pad_left, nthreads)
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, k)
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *up = <const float *>cnp.PyArray_DATA(u)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    cdef int status
    with nogil:
        if isa == _ISA_AVX2:
            status = ttile_conv_winograd_avx2(&shape, xp, up, yp, nthreads, ep, tile)
        else:
            status = ttile_conv_winograd_avx512(&shape, xp, up, yp, nthreads, ep, tile)
    if status != 0:
        raise MemoryError("the Winograd kernel could not allocate its scratch buffers")


def depthwise_nchw_supported(int64_t s, int64_t stride_w):
    """True when the NCHW depthwise kernel serves kernels ``s`` taps wide at column stride
    ``stride_w`` (others are converted to NHWC for the NHWC kernel)."""
    cdef ttile_conv_shape shape
    shape.s = s; shape.stride_w = stride_w; shape.c = 1; shape.k = 1
    return ttile_depthwise_nchw_supported(&shape) == 1


def conv2d_depthwise_nchw(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y,
                          int64_t stride_h, int64_t stride_w, int64_t pad_top,
                          int64_t pad_left, int nthreads, *, int64_t dil_h=1, int64_t dil_w=1,
                          bias=None, residual=None, int activation=0, float slope=0.01):
    """The AVX-512F depthwise kernel in torch's layout: x (N,C,H,W), weights (C,1,R,S) as
    torch holds them, y (N,C,Ho,Wo) (the residual too), nothing converted. Column
    strides 1 and 2 and kernels up to 8 taps wide (``depthwise_nchw_supported``)."""
    _check_avx512_arrays(x, w, y)
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    cdef cnp.npy_intp *ys = cnp.PyArray_DIMS(y)
    if ws[0] != xs[1] or ws[1] != 1:
        raise ValueError(f"depthwise weights must be ({xs[1]}, 1, R, S), got "
                         f"{(<object>w).shape}")
    if ys[0] != xs[0] or ys[1] != xs[1]:
        raise ValueError(f"output {(<object>y).shape} does not match input "
                         f"{(<object>x).shape}")
    if stride_h < 1 or stride_w < 1 or pad_top < 0 or pad_left < 0 or nthreads < 1 \
            or dil_h < 1 or dil_w < 1:
        raise ValueError("strides, dilation and thread count must be >= 1, padding >= 0")
    cdef ttile_conv_shape shape
    shape.n = xs[0]; shape.c = 1; shape.h = xs[2]; shape.w = xs[3]
    shape.k = 1; shape.r = ws[2]; shape.s = ws[3]; shape.ho = ys[2]; shape.wo = ys[3]
    shape.stride_h = stride_h; shape.stride_w = stride_w
    shape.pad_top = pad_top; shape.pad_left = pad_left
    shape.dil_h = dil_h; shape.dil_w = dil_w; shape.groups = xs[1]
    if shape.n * shape.groups * shape.h * shape.w * shape.r * shape.s == 0 \
            or shape.ho < 1 or shape.wo < 1:
        raise ValueError("zero-size dimension")
    # no bound on the output's extent: the kernel checks every input row it reads and
    # masks every column, so outputs whose taps all lie in the padding (torch allows
    # any padding) read nothing and get the epilogue of zero
    if ttile_depthwise_nchw_supported(&shape) != 1:
        raise ValueError(f"the NCHW depthwise kernel takes column strides 1 and 2 and up to "
                         f"8 taps along w, not stride {stride_w} with {shape.s} taps")
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, xs[1])
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    with nogil:
        ttile_conv_depthwise_nchw_avx512(&shape, xp, wp, yp, nthreads, ep)


def conv2d_pointwise_nchw(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y, int nthreads, *,
                          bias=None, residual=None, int activation=0, float slope=0.01):
    """The AVX-512F 1x1 kernel in torch's layout (stride 1, no padding, one group): x
    (N,C,H,W), y and the residual (N,K,H,W), weights as torch holds them (K,C,1,1) or
    transposed (1,1,C,K) (RSCK, what a Conv2d keeps), nothing converted."""
    _check_avx512_arrays(x, w, y)
    if nthreads < 1:
        raise ValueError("thread count must be >= 1")
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    cdef cnp.npy_intp *ys = cnp.PyArray_DIMS(y)
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef int w_kc
    if ws[0] == ys[1] and ws[1] == xs[1] and ws[2] == 1 and ws[3] == 1:
        w_kc = 1
    elif ws[0] == 1 and ws[1] == 1 and ws[2] == xs[1] and ws[3] == ys[1]:
        w_kc = 0
    else:
        raise ValueError(f"1x1 weights must be ({ys[1]}, {xs[1]}, 1, 1) or "
                         f"(1, 1, {xs[1]}, {ys[1]}), got {(<object>w).shape}")
    if ys[0] != xs[0] or ys[2] != xs[2] or ys[3] != xs[3]:
        raise ValueError(f"output {(<object>y).shape} does not match input "
                         f"{(<object>x).shape} (1x1, stride 1, no padding)")
    cdef ttile_conv_shape shape
    shape.n = xs[0]; shape.c = xs[1]; shape.h = xs[2]; shape.w = xs[3]
    shape.k = ys[1]; shape.r = 1; shape.s = 1; shape.ho = ys[2]; shape.wo = ys[3]
    shape.stride_h = 1; shape.stride_w = 1; shape.pad_top = 0; shape.pad_left = 0
    shape.dil_h = 1; shape.dil_w = 1; shape.groups = 1
    if shape.n * shape.c * shape.h * shape.w * shape.k == 0:
        raise ValueError("zero-size dimension")
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, ys[1])
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    with nogil:
        ttile_conv_pointwise_nchw_avx512(&shape, xp, wp, w_kc, yp, nthreads, ep)


cdef int _check_packed(cnp.ndarray w, int64_t k, int64_t panel, int64_t groups=1) except -1:
    if cnp.PyArray_TYPE(w) != cnp.NPY_FLOAT32 or cnp.PyArray_NDIM(w) != 5 \
            or not cnp.PyArray_IS_C_CONTIGUOUS(w) or not cnp.PyArray_ISALIGNED(w):
        raise ValueError("w must be packed weights: C-contiguous float32 (K/P, R, S, C, P)")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    if ws[4] != panel or ws[0] != groups * ((k + panel - 1) // panel):
        raise ValueError(f"packed weights {(<object>w).shape} do not hold {k} output channels "
                         f"in panels of {panel}")
    return 0


def generic_panel(int64_t k, int64_t wo, int isa=ISA_AVX512F):
    """Panel width the generic kernel of ``isa`` (ISA_AVX512F or ISA_AVX2) reads for
    ``k`` output channels and output rows ``wo`` pixels wide."""
    if k < 1 or wo < 1:
        raise ValueError("k and wo must be >= 1")
    if isa != ISA_AVX512F and isa != ISA_AVX2:
        raise ValueError(f"no vector generic kernel for isa {isa}")
    return _generic_panel(k, wo, isa)


def generic_reads_in_place(int64_t n, int64_t h, int64_t w, int64_t c, int64_t k,
                           int64_t r, int64_t s, int64_t ho, int64_t wo, int64_t stride_h,
                           int64_t stride_w, int64_t pad_top, int64_t pad_left,
                           int64_t dil_h, int64_t dil_w, int nthreads,
                           int isa=ISA_AVX512F):
    """Whether the vector generic kernel of ``isa`` reads RSCK weights of this NHWC
    convolution (one group) in place at ``nthreads`` threads - its direct path, which
    packs nothing - rather than packing them as its threads go: the kernel's own rule,
    asked without running it."""
    _require_isa(isa)
    if min(n, h, w, c, k, r, s, ho, wo, stride_h, stride_w, dil_h, dil_w, nthreads) < 1:
        raise ValueError("extents, strides, dilations and threads must be >= 1")
    cdef ttile_conv_shape shape
    shape.n = n; shape.h = h; shape.w = w; shape.c = c; shape.k = k; shape.r = r
    shape.s = s; shape.ho = ho; shape.wo = wo; shape.stride_h = stride_h
    shape.stride_w = stride_w; shape.pad_top = pad_top; shape.pad_left = pad_left
    shape.dil_h = dil_h; shape.dil_w = dil_w; shape.groups = 1
    cdef int flags = 2 | 64   # TTILE_RSCK_WEIGHTS | TTILE_QUERY_DIRECT
    cdef int answer
    if isa == _ISA_AVX2:
        answer = ttile_conv_generic_packed_avx2(&shape, NULL, NULL, NULL, nthreads, flags,
                                                NULL)
    else:
        answer = ttile_conv_generic_packed_avx512(&shape, NULL, NULL, NULL, nthreads,
                                                  flags, NULL)
    if answer < 0:
        raise MemoryError("not enough memory for the generic kernel's zero row")
    return answer == 1


#: The generic kernel's blocking flags (``conv2d_generic_packed``'s ``blocking``): each
#: thread takes whole panel groups even where it would take whole rows; panel groups of
#: half the cache blocking.
GENERIC_GROUPS_FIRST = 16
GENERIC_SMALL_GROUPS = 32


def conv2d_generic_packed(cnp.ndarray x, cnp.ndarray w, cnp.ndarray y,
                          int64_t stride_h, int64_t stride_w,
                          int64_t pad_top, int64_t pad_left, int nthreads,
                          bint nchw_out=False, bint kcrs=False, *,
                          int64_t dil_h=1, int64_t dil_w=1, int64_t groups=1,
                          bias=None, residual=None, int activation=0, float slope=0.01,
                          int isa=ISA_AVX512F, bint nchw_in=False, int blocking=0):
    """The vector generic kernel of ``isa`` (ISA_AVX512F, or ISA_AVX2) on weights packed by
    ``pack_weights(w, generic_panel(K, Wo, isa))`` (with groups: each group's packed weights,
    concatenated along the first axis), or on RSCK weights (R,S,C,K) - KCRS
    (K,C/groups,R,S), torch's layout, with ``kcrs`` - which the kernel's threads then
    pack panel group by panel group into buffers of their own; with ``nchw_out``, y is
    (N,K,Ho,Wo) and written in that layout from the tiles; with ``nchw_in``, x is
    (N,C,H,W), read in that layout. The epilogue
    y = act(conv + bias + residual) is fused (residual in y's layout). ``blocking``:
    GENERIC_GROUPS_FIRST and GENERIC_SMALL_GROUPS or'ed (see ttile_runtime.h), 0 for
    the default blocking."""
    _require_isa(isa)
    if blocking & ~(GENERIC_GROUPS_FIRST | GENERIC_SMALL_GROUPS):
        raise ValueError(f"blocking must be GENERIC_GROUPS_FIRST and GENERIC_SMALL_GROUPS "
                         f"or'ed, got {blocking}")
    _check_f32_c4(y, "y")
    if groups < 1:
        raise ValueError("groups must be >= 1")
    cdef cnp.npy_intp *yd = cnp.PyArray_DIMS(y)
    cdef int64_t k = yd[1] if nchw_out else yd[3]
    cdef bint rsck = cnp.PyArray_NDIM(w) == 4
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef int64_t r, s, wc, panel
    if kcrs and not rsck:
        raise ValueError("kcrs weights are (K, C, R, S): 4 dimensions")
    if k % groups:
        raise ValueError(f"{k} output channels are not divisible by {groups} groups")
    if rsck:
        _check_f32_c4(w, "w")
        if groups != 1 and not kcrs:
            raise ValueError("grouped weights must be packed or KCRS")
        if (ws[0] if kcrs else ws[3]) != k:
            raise ValueError(f"the weights have {ws[0] if kcrs else ws[3]} output channels, "
                             f"the output {k}")
        if kcrs:
            wc, r, s = ws[1], ws[2], ws[3]
        else:
            r, s, wc = ws[0], ws[1], ws[2]
    else:
        panel = _generic_panel(k // groups, yd[3] if nchw_out else yd[2], isa)
        _check_packed(w, k // groups, panel, groups)
        r, s, wc = ws[1], ws[2], ws[3]
    cdef ttile_conv_shape shape
    _fill_shape(&shape, x, y, r, s, wc, k, stride_h, stride_w, pad_top, pad_left,
                nthreads, nchw_out, dil_h, dil_w, groups, nchw_in)
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, k)
    cdef int out_flag = (1 if nchw_out else 0) | (2 if rsck and not kcrs else 0) \
        | (4 if kcrs else 0) | (8 if nchw_in else 0) | blocking
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    cdef int status
    with nogil:
        if isa == _ISA_AVX2:
            status = ttile_conv_generic_packed_avx2(&shape, xp, wp, yp, nthreads, out_flag, ep)
        else:
            status = ttile_conv_generic_packed_avx512(&shape, xp, wp, yp, nthreads, out_flag,
                                                      ep)
    if status != 0:
        raise MemoryError("not enough memory for the generic kernel's scratch row")


def fma_peak_seconds(int64_t iterations, int isa=_ISA_AVX512F):
    """Seconds for ``iterations`` rounds of independent FMA chains on this thread.

    A round is ``fma_peak_flops(isa)`` floating-point operations: 24 chains of 16-lane
    FMAs (768) in AVX-512F, 12 chains of 8-lane FMAs (192) in AVX2.
    """
    _require_isa(isa)
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    cdef double t
    with nogil:
        if isa == _ISA_AVX2:
            t = ttile_fma_peak_avx2(iterations)
        else:
            t = ttile_fma_peak_avx512(iterations)
    return t


def fma_peak_flops(int isa=_ISA_AVX512F):
    """Floating-point operations in one round of :func:`fma_peak_seconds`."""
    return 192 if isa == _ISA_AVX2 else 768


cdef extern from "<immintrin.h>" nogil:
    void _mm_clflush(const void *p)
    void _mm_mfence()


def evict(cnp.ndarray array):
    """Write back and drop every cache line of ``array`` (C-contiguous) from every cache
    level: the next read comes from memory, as a layer's weights do inside a network whose
    weights outgrow the caches, while its input stays warm from the layer before."""
    if not cnp.PyArray_IS_C_CONTIGUOUS(array):
        raise ValueError("array must be C-contiguous")
    cdef const char *p = <const char *>cnp.PyArray_DATA(array)
    cdef Py_ssize_t nbytes = cnp.PyArray_NBYTES(array)
    cdef Py_ssize_t i
    with nogil:
        i = -(<Py_ssize_t>p & 63)
        while i < nbytes:
            _mm_clflush(p + i)
            i += 64
        _mm_mfence()


def read_seconds(cnp.ndarray buffer, int64_t reps, int isa=_ISA_AVX512F):
    """Seconds to read all of a float32 ``buffer`` ``reps`` times (vector loads of
    ``isa``: AVX-512F or AVX2)."""
    _require_isa(isa)
    if cnp.PyArray_TYPE(buffer) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(buffer):
        raise ValueError("buffer must be a C-contiguous float32 array")
    if reps < 1:
        raise ValueError("reps must be >= 1")
    cdef const float *data = <const float *>cnp.PyArray_DATA(buffer)
    cdef int64_t n = cnp.PyArray_SIZE(buffer)
    cdef double t
    with nogil:
        if isa == _ISA_AVX2:
            t = ttile_read_seconds_avx2(data, n, reps)
        else:
            t = ttile_read_seconds_avx512(data, n, reps)
    return t


def registry_entries():
    """The registry: one dict per entry compiled into this extension, kernels and
    generic-kernel verdicts alike (``has_kernel``: its kernel is in this build; a searched
    verdict names its ``scheme``)."""
    out = []
    cdef int i
    for i in range(ttile_tuned_kernel_count):
        e = ttile_tuned_kernels[i]
        out.append({"index": i, "cpu": e.cpu.decode(), "threads": e.threads,
                    "n": e.n, "k": e.k, "c": e.c, "h": e.h, "w": e.w, "r": e.r,
                    "s": e.s, "stride_h": e.stride_h, "stride_w": e.stride_w,
                    "pad_top": e.pad_top, "pad_bottom": e.pad_bottom, "pad_left": e.pad_left,
                    "pad_right": e.pad_right, "dilation_h": e.dilation_h,
                    "dilation_w": e.dilation_w, "groups": e.groups, "isa": e.isa,
                    "panel": e.panel, "has_kernel": e.fn != NULL,
                    "has_nchw": e.fn_nchw != NULL,
                    "layer": e.layer.decode(), "scheme": e.scheme.decode(),
                    "gflops": e.gflops, "warm_gflops": e.warm_gflops,
                    "generic_gflops": e.generic_gflops})
    return out


#: Outputs from this size on come from memory that earlier outputs of ttile gave back:
#: glibc maps each allocation past 32 MiB anew and unmaps it on free, so every call paid
#: for the kernel zeroing fresh pages (Yolo9000-0's 38 MB output: 4.8 ms per NHWC call,
#: 3.0 with `out=`; Zen 5, 1 thread). Smaller ones glibc already reuses.
RECYCLE_MIN_BYTES = 32 << 20
#: At most this much memory is kept for reuse once its outputs are gone.
RECYCLE_KEEP_BYTES = 256 << 20
cdef list _recycled = []   # 1-D float32 buffers whose outputs are gone, oldest first


cdef class _RecycledBuffer:
    """The owner of a large output's memory, which the output views through the buffer
    protocol: when the last array viewing it goes, the memory is kept for a later output
    (up to RECYCLE_KEEP_BYTES) instead of going back to the OS. Nothing else holds it, so
    a buffer is reused only once no array can see it."""
    cdef cnp.ndarray data
    cdef Py_ssize_t extent[1]
    cdef Py_ssize_t stride[1]

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = cnp.PyArray_DATA(self.data)
        view.obj = self
        view.len = self.extent[0] * 4
        view.itemsize = 4
        view.readonly = 0
        view.ndim = 1
        view.format = "f"
        view.shape = self.extent
        view.strides = self.stride
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __dealloc__(self):
        if self.data is None or _recycled is None:   # (None: interpreter shutdown)
            return
        kept = sum(b.nbytes for b in _recycled)
        while _recycled and kept + self.data.nbytes > RECYCLE_KEEP_BYTES:
            kept -= _recycled.pop(0).nbytes   # the oldest make room
        if kept + self.data.nbytes <= RECYCLE_KEEP_BYTES:
            _recycled.append(self.data)


cdef cnp.ndarray _large_buffer(Py_ssize_t size):
    """A 1-D float32 array of at least ``size`` floats owned by a _RecycledBuffer: a kept
    one of up to 1.25x the size, else a new one."""
    cdef Py_ssize_t i, best = -1
    for i in range(len(_recycled)):
        n = (<cnp.ndarray>_recycled[i]).shape[0]
        if size <= n <= size + size // 4 and (best < 0 or n < _recycled[best].shape[0]):
            best = i
    cdef _RecycledBuffer owner = _RecycledBuffer()
    owner.data = _recycled.pop(best) if best >= 0 else np.empty(size, np.float32)
    owner.extent[0] = owner.data.shape[0]
    owner.stride[0] = 4
    return np.frombuffer(owner, np.float32)


def recycled_bytes():
    """Bytes of memory kept for later large outputs (tests, diagnostics)."""
    return sum(b.nbytes for b in _recycled)


def release_recycled():
    """Give the memory kept for later large outputs back (``scratch.release``)."""
    del _recycled[:]


def empty_aligned(tuple shape, cnp.ndarray line_of=None):
    """A new float32 array of ``shape`` starting on a 64-byte cache line. numpy puts large
    arrays 16 bytes past a line, so every 64-byte vector store of a kernel into them
    spans two lines (the NHWC depthwise kernel on a Zen 4: up to 1.5x slower with its
    output off the line); a view into a buffer 64 bytes longer costs 0.7 us here,
    against about two with the address read through ``ndarray.ctypes``.

    With ``line_of``, the array starts as far into a line as that array does instead:
    the NHWC depthwise kernel runs its channel vectors along its input's lines (see
    kernels/depthwise_avx512.c), so an output placed like the input takes whole-line
    stores too (C=32 112x112 with the input 16 bytes into a line: 117 -> 110 us, the
    input on a line 104; Zen 4)."""
    cdef Py_ssize_t size = 1
    for extent in shape:
        size *= <Py_ssize_t>extent
    if size < 0:
        raise ValueError(f"negative extent in {shape}")
    cdef Py_ssize_t offset = 0
    if line_of is not None:
        offset = ((<Py_ssize_t>cnp.PyArray_DATA(line_of)) & 63) >> 2
    cdef cnp.ndarray buffer = (_large_buffer(size + 32) if 4 * size >= RECYCLE_MIN_BYTES
                               else np.empty(size + 32, np.float32))
    cdef Py_ssize_t start = (((-<Py_ssize_t>cnp.PyArray_DATA(buffer)) & 63) >> 2) + offset
    return buffer[start:start + size].reshape(shape)


def empty_aligned_bits(tuple shape):
    """A new uint16 array (bf16 bits) of ``shape`` starting on a 64-byte cache line: the
    AMX kernel's tiles load 64-byte rows of its packed input and weights, and numpy's
    own arrays, 16 bytes into a line, made every row span two lines (a 1x1 layer of 1024
    channels on a 14x14 map took 1.5x the time with its packed input, weights and
    output so placed; Xeon model 207, interleaved)."""
    cdef Py_ssize_t size = 1
    for extent in shape:
        size *= <Py_ssize_t>extent
    if size < 0:
        raise ValueError(f"negative extent in {shape}")
    return empty_aligned(((size + 1) // 2,)).view(np.uint16)[:size].reshape(shape)


cdef cnp.ndarray _output(object out, tuple shape, str name):
    """``out`` checked to be a writeable C-contiguous float32 array of ``shape``, or a new
    line-aligned one (callers pass reused scratch buffers)."""
    if out is None:
        return empty_aligned(shape)
    cdef cnp.ndarray arr = out
    if cnp.PyArray_TYPE(arr) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(arr) \
            or not cnp.PyArray_ISWRITEABLE(arr) or not cnp.PyArray_ISALIGNED(arr):
        raise ValueError(f"{name} must be a writeable, aligned, C-contiguous float32 array")
    if (<object>arr).shape != shape:
        raise ValueError(f"{name} has shape {(<object>arr).shape}, expected {shape}")
    return arr


def pack_weights(cnp.ndarray w, int64_t panel, int nthreads=1, out=None):
    """RSCK weights (R,S,C,K) -> panels (ceil(K/panel), R, S, C, panel), tail zero-filled.

    When K is the panel width, RSCK already is that single panel: the result is then a
    read-only view of ``w``, not a copy (conv2d packs per call; Yolo9000-2, ResNet18-1 and
    every other 64-filter layer would copy their weights for nothing). ``out``, when
    given, receives the panels otherwise."""
    _check_f32_c4(w, "w")
    if panel < 1 or nthreads < 1:
        raise ValueError("panel and nthreads must be >= 1")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef int64_t k = ws[3]
    if k == panel:
        view = (<object>w).reshape((1,) + (<object>w).shape)
        view.flags.writeable = False
        return view
    cdef int64_t rsc = ws[0] * ws[1] * ws[2]
    result = _output(out, ((k + panel - 1) // panel, ws[0], ws[1], ws[2], panel), "out")
    cdef const float *src = <const float *>cnp.PyArray_DATA(w)
    cdef float *dst = <float *>cnp.PyArray_DATA(result)
    with nogil:
        ttile_pack_weights(src, rsc, k, panel, dst, nthreads)
    return result


def maxpool_nhwc(cnp.ndarray x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                 int64_t ph, int64_t pw, int nthreads=1, out=None, isa=None):
    """``torch.nn.functional.max_pool2d(x, (kh, kw), (sh, sw), (ph, pw))`` of an NHWC
    float32 array, or of bf16 bits (uint16: the maximum of the bf16 values, exactly), no
    dilation, floor rounding, into a new NHWC array of x's type on a cache line (or
    ``out``, which must not overlap x); a NaN in a window is its maximum, as in torch.
    ``isa`` as for the layout conversions: AVX-512F (the default where the CPU has it)
    runs the windows in registers, any other the plain C loop."""
    cdef bint bits = cnp.PyArray_TYPE(x) == cnp.NPY_UINT16
    if bits:
        if cnp.PyArray_NDIM(x) != 4 or not cnp.PyArray_IS_C_CONTIGUOUS(x) \
                or not cnp.PyArray_ISALIGNED(x):
            raise ValueError("x must be a C-contiguous, aligned 4-D array")
    else:
        _check_f32_c4(x, "x")
    if kh < 1 or kw < 1 or sh < 1 or sw < 1 or nthreads < 1:
        raise ValueError("kernel, stride and nthreads must be >= 1")
    if ph < 0 or pw < 0 or 2 * ph > kh or 2 * pw > kw:
        raise ValueError(f"padding ({ph}, {pw}) must be >= 0 and at most half the kernel "
                         f"({kh}, {kw})")
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    cdef int64_t ho = (xs[1] + 2 * ph - kh) // sh + 1
    cdef int64_t wo = (xs[2] + 2 * pw - kw) // sw + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"a {kh}x{kw} window does not fit a {xs[1]}x{xs[2]} input "
                         f"padded by ({ph}, {pw})")
    cdef int64_t n = xs[0], h = xs[1], w = xs[2], c = xs[3]
    cdef int flag = _layout_isa(isa)
    cdef cnp.ndarray y
    cdef tuple shape = (xs[0], ho, wo, xs[3])
    if bits:
        if out is None:
            y = empty_aligned_bits(shape)
        else:
            y = out
            _check_bf16_array(y, "out", n * ho * wo * c, 0)
            if not cnp.PyArray_ISWRITEABLE(y) or (<object>y).shape != shape:
                raise ValueError(f"out must be writeable, of shape {shape}")
        if np.may_share_memory(x, y):
            raise ValueError("out overlaps x")
        with nogil:
            ttile_maxpool_nhwc_bf16(<const unsigned short *>cnp.PyArray_DATA(x),
                                    <unsigned short *>cnp.PyArray_DATA(y), n, h, w, c, kh,
                                    kw, sh, sw, ph, pw, ho, wo, nthreads, flag)
        return y
    y = _output(out, shape, "out")
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    with nogil:
        ttile_maxpool_nhwc(xp, yp, n, h, w, c, kh, kw, sh, sw, ph, pw, ho, wo, nthreads, flag)
    return y


def global_avgpool_nhwc(cnp.ndarray x, int nthreads=1, out=None):
    """The mean of each image's pixels, channel by channel, of an NHWC float32 array:
    a new (N, 1, 1, C) array on a cache line, or ``out``, which must not overlap x
    (``adaptive_avg_pool2d(x, 1)``)."""
    _check_f32_c4(x, "x")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    cdef int64_t n = xs[0], hw = xs[1] * xs[2], c = xs[3]
    if hw == 0:
        raise ValueError(f"no pixels to average in an input of shape {(<object>x).shape}")
    cdef cnp.ndarray y = _output(out, (n, 1, 1, c), "out")
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    with nogil:
        ttile_global_avgpool_nhwc(xp, yp, n, hw, c, nthreads)
    return y


def same_bytes(cnp.ndarray a, cnp.ndarray b, int nthreads=1) -> bool:
    """Whether two C-contiguous arrays hold the same bytes (their dtypes and shapes aside:
    the caller compares those), compared in parallel without the GIL. Bitwise, so a NaN
    equals the same NaN and -0.0 differs from 0.0: what matters to a packed copy."""
    if not (cnp.PyArray_IS_C_CONTIGUOUS(a) and cnp.PyArray_IS_C_CONTIGUOUS(b)):
        raise ValueError("same_bytes needs C-contiguous arrays")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    cdef int64_t nbytes = cnp.PyArray_NBYTES(a)
    if nbytes != cnp.PyArray_NBYTES(b):
        return False
    cdef const void *pa = cnp.PyArray_DATA(a)
    cdef const void *pb = cnp.PyArray_DATA(b)
    cdef int equal
    with nogil:
        equal = ttile_same_bytes(pa, pb, nbytes, nthreads)
    return equal == 1


def packed_matches(cnp.ndarray w, cnp.ndarray packed, int nthreads=1, isa=None) -> bool:
    """Whether RSCK weights ``w`` (R, S, C, K) hold, bit for bit, what ``packed`` holds
    (panels (ceil(K/P), R, S, C, P) as ``pack_weights`` writes them; its tail zero fill
    is not compared), read in parallel without the GIL and without a copy. ``isa`` as
    for the layout conversions (None: AVX-512 where the CPU has it)."""
    _check_f32_c4(w, "w")
    if cnp.PyArray_NDIM(packed) != 5 or not cnp.PyArray_IS_C_CONTIGUOUS(packed) \
            or packed.dtype != np.float32:
        raise ValueError("packed must be C-contiguous float32 panels (P, R, S, C, width)")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef cnp.npy_intp *ps = cnp.PyArray_DIMS(packed)
    cdef int64_t k = ws[3], panel = ps[4], rsc = ws[0] * ws[1] * ws[2]
    if panel < 1 or ps[0] != (k + panel - 1) // panel or ps[1] != ws[0] or ps[2] != ws[1] \
            or ps[3] != ws[2]:
        raise ValueError(f"packed {(<object>packed).shape} are not panels of weights "
                         f"{(<object>w).shape}")
    cdef const void *pw = cnp.PyArray_DATA(w)
    cdef const void *pp = cnp.PyArray_DATA(packed)
    cdef int flag = _layout_isa(isa)
    cdef int equal
    with nogil:
        equal = ttile_packed_matches(pw, rsc, k, panel, pp, nthreads, flag)
    return equal == 1


cdef int _layout_isa(isa) except -1:
    """The ISA code of the layout conversions and weight packers (the C side's
    TTILE_LAYOUT_*, equal to ISA_*): None for the widest tiles this CPU runs (AVX-512,
    else AVX2, else the portable loop), or the one asked for, never one the CPU lacks."""
    if isa is None:
        return _ISA_AVX512F if ttile_cpu_has_avx512f() == 1 \
            else _ISA_AVX2 if ttile_cpu_has_avx2() == 1 else _ISA_PORTABLE
    if isa == ISA_PORTABLE:
        return _ISA_PORTABLE
    if isa == ISA_AVX512F:
        if ttile_cpu_has_avx512f() != 1:
            raise RuntimeError("this CPU does not support AVX-512F")
        return _ISA_AVX512F
    if isa == ISA_AVX2:
        if ttile_cpu_has_avx2() != 1:
            raise RuntimeError("this CPU does not support AVX2 with FMA")
        return _ISA_AVX2
    raise ValueError(f"unknown isa {isa!r}")


def pack_weights_kcrs(cnp.ndarray w, int64_t panel, int nthreads=1, out=None, isa=None):
    """KCRS weights (K,C,R,S), torch's layout, straight into panels (ceil(K/panel), R, S,
    C, panel), tail zero-filled; ``panel`` 0 gives RSCK (R,S,C,K) for the portable kernel.
    One parallel pass, no intermediate RSCK copy."""
    _check_f32_c4(w, "w")
    if panel < 0 or nthreads < 1:
        raise ValueError("panel must be >= 0 and nthreads >= 1")
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef int64_t k = ws[0], c = ws[1], r = ws[2], s = ws[3]
    cdef int64_t width = panel if panel else k
    shape = ((k + width - 1) // width, r, s, c, width)
    result = _output(out, (r, s, c, k) if panel == 0 else shape, "out")
    cdef const float *src = <const float *>cnp.PyArray_DATA(w)
    cdef float *dst = <float *>cnp.PyArray_DATA(result)
    cdef int flag = _layout_isa(isa)
    with nogil:
        ttile_pack_weights_kcrs(src, k, c, r * s, width, dst, nthreads, flag)
    return result


cdef object _convert_activations(cnp.ndarray a, int nthreads, object out, object isa,
                                 bint to_nhwc):
    """(N,C,H,W) -> (N,H,W,C) with ``to_nhwc``, else (N,H,W,C) -> (N,C,H,W)."""
    _check_f32_c4(a, "x" if to_nhwc else "y")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    shape = (<object>a).shape
    n, c, h, w = shape if to_nhwc else (shape[0], shape[3], shape[1], shape[2])
    result = _output(out, (n, h, w, c) if to_nhwc else (n, c, h, w), "out")
    cdef const float *src = <const float *>cnp.PyArray_DATA(a)
    cdef float *dst = <float *>cnp.PyArray_DATA(result)
    cdef int64_t nn = n, cc = c, hw = h * w
    cdef int flag = _layout_isa(isa)
    with nogil:
        if to_nhwc:
            ttile_nchw_to_nhwc(src, dst, nn, cc, hw, nthreads, flag)
        else:
            ttile_nhwc_to_nchw(src, dst, nn, hw, cc, nthreads, flag)
    return result


def nchw_to_nhwc(cnp.ndarray x, int nthreads=1, out=None, isa=None):
    """(N,C,H,W) -> (N,H,W,C), blocked and parallel."""
    return _convert_activations(x, nthreads, out, isa, True)


def nhwc_to_nchw(cnp.ndarray y, int nthreads=1, out=None, isa=None):
    """(N,H,W,C) -> (N,C,H,W), blocked and parallel."""
    return _convert_activations(y, nthreads, out, isa, False)


def subsample_nchw(cnp.ndarray x, int stride_h, int stride_w, int nthreads=1, out=None,
                   isa=None):
    """(N,C,H,W) -> (N,C,Ho,Wo), the pixels an unpadded 1x1 layer at these strides reads:
    x[:, :, ::stride_h, ::stride_w], parallel, stride-2 rows in AVX-512 registers."""
    _check_f32_c4(x, "x")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    if stride_h < 1 or stride_w < 1:
        raise ValueError("strides must be >= 1")
    n, c, h, w = (<object>x).shape
    ho, wo = (h - 1) // stride_h + 1, (w - 1) // stride_w + 1
    result = _output(out, (n, c, ho, wo), "out")
    cdef const float *src = <const float *>cnp.PyArray_DATA(x)
    cdef float *dst = <float *>cnp.PyArray_DATA(result)
    cdef int64_t planes = n * c, hh = h, ww = w, sh = stride_h, sw = stride_w
    cdef int64_t oho = ho, owo = wo
    cdef int flag = _layout_isa(isa)
    if planes * h * w == 0:
        return result
    with nogil:
        ttile_subsample_nchw(src, dst, planes, hh, ww, sh, sw, oho, owo, nthreads, flag)
    return result


cdef int _check_run(cnp.ndarray x, cnp.ndarray y, int nthreads, int isa) except -1:
    """What every generated kernel needs: a CPU that runs its vector family ``isa``
    (ISA_AVX512F or ISA_AVX2), float32 C-contiguous 4-D x and writeable y, a positive
    thread count."""
    _require_isa(isa)
    _check_f32_c4(x, "x")
    _check_f32_c4(y, "y")
    if not cnp.PyArray_ISWRITEABLE(y):
        raise ValueError("y must be writeable")
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    return 0


def run_tuned(int index, cnp.ndarray x, cnp.ndarray w, cnp.ndarray y, int nthreads,
              bias=None, residual=None, int activation=0, float slope=0.01,
              bint nchw_out=False):
    """Run registry entry ``index`` on x (N,H,W,C), weights packed in panels
    (ceil(K/P), R, S, C, P) as ``pack_weights`` makes them, into y (N,Ho,Wo,K), or with
    ``nchw_out`` from x (N,C,H,W) into y (N,K,Ho,Wo) through the kernel's NCHW entry
    point (the residual then NCHW too). A grouped entry's x has C * groups channels, y
    K * groups, and its weights each group's panels in turn.

    Shapes are checked against the entry; the kernel's own sizes are compile-time
    constants, so a mismatch would otherwise read out of bounds.
    """
    if index < 0 or index >= ttile_tuned_kernel_count:
        raise IndexError(f"no tuned kernel {index}")
    cdef const ttile_tuned_kernel *e = &ttile_tuned_kernels[index]
    _check_run(x, y, nthreads, e.isa)
    if e.fn == NULL:
        raise ValueError(f"registry entry {index} has no kernel in this build: a "
                         "generic-kernel verdict, or a set this build left out "
                         "(CMake's TTILE_KERNEL_SETS)")
    if nchw_out and e.fn_nchw == NULL:
        raise ValueError(f"registry entry {index} has no NCHW entry point")
    _check_packed(w, e.k, e.panel, e.groups)
    cdef int c = e.c * e.groups, k = e.k * e.groups
    cdef cnp.npy_intp *xs = cnp.PyArray_DIMS(x)
    cdef cnp.npy_intp *ws = cnp.PyArray_DIMS(w)
    cdef cnp.npy_intp *ys = cnp.PyArray_DIMS(y)
    cdef int ho = (e.h + e.pad_top + e.pad_bottom - (e.r - 1) * e.dilation_h - 1) \
        // e.stride_h + 1
    cdef int wo = (e.w + e.pad_left + e.pad_right - (e.s - 1) * e.dilation_w - 1) \
        // e.stride_w + 1
    if (xs[0], xs[1], xs[2], xs[3]) != (<object>((e.n, c, e.h, e.w)) if nchw_out
                                        else <object>((e.n, e.h, e.w, c))) or \
            (ws[0], ws[1], ws[2], ws[3], ws[4]) != (e.groups * ((e.k + e.panel - 1) // e.panel),
                                                    e.r, e.s, e.c, e.panel) or \
            (ys[0], ys[1], ys[2], ys[3]) != (<object>((e.n, k, ho, wo)) if nchw_out
                                             else <object>((e.n, ho, wo, k))):
        raise ValueError("arrays do not match the tuned kernel's problem")
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, k)
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    cdef ttile_kernel_fn fn = e.fn_nchw if nchw_out else e.fn
    with nogil:
        fn(xp, wp, yp, nthreads, ep)



def run_compiled(size_t address, cnp.ndarray x, cnp.ndarray w, cnp.ndarray y, int nthreads,
                 tuple x_shape, tuple w_shape, tuple y_shape, bias=None, residual=None,
                 int activation=0, float slope=0.01, bint nchw_out=False, *, int isa,
                 int64_t groups=1):
    """Call a kernel compiled at run time (its address from the loaded library) for the
    vector family ``isa`` (ISA_AVX512F or ISA_AVX2: what it was compiled for, which this
    CPU must run) on x, packed weights w and y, after checking them against the shapes
    it was built for (a grouped problem's: ``groups`` groups' panels, one after the
    other).

    The kernel's extents are compile-time constants: these checks are what stands
    between a caller's arrays and an out-of-bounds access.
    """
    if address == 0:
        raise ValueError("null kernel address")
    _check_run(x, y, nthreads, isa)
    if len(w_shape) != 5:
        raise ValueError("w_shape must have 5 entries")
    cdef int64_t k = cnp.PyArray_DIMS(y)[1 if nchw_out else 3]
    if groups < 1 or k % groups:
        raise ValueError(f"{k} output channels do not split into {groups} groups")
    _check_packed(w, k // groups, w_shape[4], groups)
    if (<object>x).shape != x_shape or (<object>w).shape != w_shape or (<object>y).shape != y_shape:
        raise ValueError("arrays do not match the compiled kernel's problem")
    cdef ttile_kernel_fn fn = <ttile_kernel_fn>address
    cdef ttile_epilogue epilogue
    cdef const ttile_epilogue *ep = _epilogue(&epilogue, bias, residual, activation, slope,
                                              y, y_shape[1 if nchw_out else 3])
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
    cdef float *yp = <float *>cnp.PyArray_DATA(y)
    with nogil:
        fn(xp, wp, yp, nthreads, ep)


# ---------------------------------------------------------------------------------------
# bf16 (kernels/ttile_bf16.h): rounding, packing, the AMX and AVX512_BF16 kernels.

cdef extern from "ttile_bf16.h" nogil:
    ctypedef struct ttile_bf16_problem:
        int64_t n, ho, wo, k
        int64_t hp, wp, cp
        int64_t kc, kp
        int64_t r, s
        int64_t stride_h, stride_w, dil_h, dil_w
        int64_t phases
        int64_t gc, gkq
    int64_t ttile_bf16_input_elems(const ttile_bf16_problem *p)
    int64_t ttile_bf16_weight_elems(const ttile_bf16_problem *p)
    void ttile_bf16_pack_input(const ttile_bf16_problem *p, const void *x, int x_bf16,
                               int nchw, int64_t c, int64_t h, int64_t w, int64_t pad_top,
                               int64_t pad_left, unsigned short *xb, int nthreads)
    int ttile_bf16_pack_input_folded(const ttile_bf16_problem *p, const void *x, int x_bf16,
                                      int nchw, int64_t c, int64_t h, int64_t w,
                                      int64_t pad_top, int64_t pad_left, int64_t s,
                                      int64_t stride_w, int64_t dil_w, unsigned short *xb,
                                      int nthreads)
    void ttile_bf16_pack_weights(const ttile_bf16_problem *p, const float *w, int64_t c,
                                 unsigned short *wb, int nthreads)
    void ttile_bf16_from_f32(const float *src, unsigned short *dst, int64_t n, int nthreads)
    void ttile_bf16_to_f32(const unsigned short *src, float *dst, int64_t n, int nthreads)
    void ttile_bf16_round_f32(const float *src, float *dst, int64_t n, int nthreads)
    int ttile_bf16_same_rounded(const float *src, const unsigned short *bits, int64_t n,
                                int nthreads)
    int ttile_conv_bf16_amx(const ttile_bf16_problem *p, const unsigned short *xb,
                            const unsigned short *wb, void *y, int y_bf16, int y_nchw,
                            int nthreads, const ttile_epilogue *ep)
    int ttile_conv_bf16_amx_unpacked(const ttile_bf16_problem *p, const unsigned short *x,
                                     const unsigned short *wb, void *y, int y_bf16,
                                     int nthreads, const ttile_epilogue *ep)
    int ttile_conv_bf16_avx512(const ttile_bf16_problem *p, const unsigned short *xb,
                               const unsigned short *wb, void *y, int y_bf16, int nthreads,
                               const ttile_epilogue *ep)
    int ttile_bf16_amx_built()
    double ttile_dot_bf16_peak_seconds(int64_t iterations)

cdef extern from "ttile_runtime.h" nogil:
    int ttile_cpu_has_avx512bf16()
    int ttile_cpu_has_amx_bf16()
    int ttile_amx_request()

cdef enum:
    _BF16_KERNEL_AMX = 0
    _BF16_KERNEL_AVX512 = 1

BF16_KERNEL_AMX = _BF16_KERNEL_AMX
BF16_KERNEL_AVX512 = _BF16_KERNEL_AVX512


def cpu_has_avx512bf16():
    """True when the CPU has AVX512_BF16 (with AVX-512F, BW and VL) and the OS saves it."""
    return ttile_cpu_has_avx512bf16() == 1


def cpu_has_amx_bf16():
    """True when the CPU has AMX-BF16 and AMX-TILE and the OS enables the tile state."""
    return ttile_cpu_has_amx_bf16() == 1


def dot_bf16_peak_seconds(int64_t iterations):
    """Seconds for ``iterations`` rounds of 24 independent vdpbf16ps chains on this thread
    (a round is 24 x 64 = 1536 floating-point operations)."""
    if ttile_cpu_has_avx512bf16() != 1:
        raise RuntimeError("vdpbf16ps needs a CPU with AVX512_BF16")
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    cdef double t
    with nogil:
        t = ttile_dot_bf16_peak_seconds(iterations)
    return t


def amx_usable():
    """True when this process may run the AMX kernel: the CPU has it, this build has it,
    and Linux granted the tile data state (asked once, on the first call)."""
    return ttile_bf16_amx_built() == 1 and ttile_amx_request() == 1


cdef int _bf16_problem(ttile_bf16_problem *p, tuple fields) except -1:
    """Fill and check a packed problem from (n, ho, wo, k, hp, wp, cp, kc, kp, r, s,
    stride_h, stride_w, dil_h, dil_w, phases), and (gc, gkq) after them for a grouped one
    (ttile_bf16.h)."""
    if len(fields) not in (16, 18):
        raise ValueError("a bf16 problem has 16 fields, or 18 grouped")
    (p.n, p.ho, p.wo, p.k, p.hp, p.wp, p.cp, p.kc, p.kp, p.r, p.s, p.stride_h, p.stride_w,
     p.dil_h, p.dil_w, p.phases) = fields[:16]
    p.gc, p.gkq = fields[16:] if len(fields) == 18 else (0, 0)
    if (p.gc or p.gkq) and (p.gc < p.kc or p.gc % p.kc or p.cp % p.gc or p.gkq < 1
                            or (p.cp // p.gc) * 32 * p.gkq != p.kp):
        raise ValueError(f"bad grouped bf16 problem {fields}: super-groups of gc channels "
                         f"(a multiple of kc dividing cp) and 32 gkq output channels, as "
                         f"many as cp / gc")
    if min(p.n, p.ho, p.wo, p.k, p.r, p.s, p.stride_h, p.stride_w, p.dil_h, p.dil_w) < 1:
        raise ValueError(f"bad bf16 problem {fields}")
    if p.kc < 2 or p.kc > 32 or p.kc % 2 or p.cp < p.kc or p.cp % p.kc \
            or p.kp < p.k or p.kp % 32:
        raise ValueError(f"bad bf16 packing {fields}: kc even <= 32 dividing cp, "
                         f"kp a multiple of 32 >= k")
    if p.phases not in (0, 1) or (p.phases and (p.stride_h != 2 or p.stride_w != 2
                                                or p.dil_h != 1 or p.dil_w != 1)):
        raise ValueError(f"bad bf16 problem {fields}: phase planes are for stride 2 "
                         f"without dilation")
    if p.phases:   # hp, wp: a phase plane's extents
        if p.hp < p.ho + (p.r - 1) // 2 or p.wp < p.wo + (p.s - 1) // 2:
            raise ValueError(f"bf16 problem {fields}: the phase planes are too small for "
                             f"the output")
    elif p.hp < (p.ho - 1) * p.stride_h + (p.r - 1) * p.dil_h + 1 \
            or p.wp < (p.wo - 1) * p.stride_w + (p.s - 1) * p.dil_w + 1:
        raise ValueError(f"bf16 problem {fields}: the packed input is too small for the "
                         f"output")
    return 0


cdef int _check_bf16_array(cnp.ndarray a, str name, int64_t size, int allow_f32) except -1:
    cdef int t = cnp.PyArray_TYPE(a)
    if t != cnp.NPY_UINT16 and not (allow_f32 and t == cnp.NPY_FLOAT32):
        raise TypeError(f"{name} must be bf16 bits (uint16)"
                        + (" or float32" if allow_f32 else "") + f", got {a.dtype}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    if cnp.PyArray_SIZE(a) != size:
        raise ValueError(f"{name} has {cnp.PyArray_SIZE(a)} elements, expected {size}")
    return 0


def bf16_round(cnp.ndarray src, int nthreads=1, out=None):
    """float32 -> bf16 bits (uint16, same shape), rounded to nearest even (``out``: a
    uint16 array of src's size to write; None: a new one)."""
    _check_f32_contiguous(src, "src")
    if ttile_cpu_has_avx512f() != 1:
        raise RuntimeError("the bf16 conversions need AVX-512F")
    cdef cnp.ndarray dst
    if out is None:
        dst = empty_aligned_bits((<object>src).shape)
    else:
        dst = out
        _check_bf16_array(dst, "out", cnp.PyArray_SIZE(src), 0)
        if not cnp.PyArray_ISWRITEABLE(dst):
            raise ValueError("out is read-only")
    with nogil:
        ttile_bf16_from_f32(<const float *>cnp.PyArray_DATA(src),
                            <unsigned short *>cnp.PyArray_DATA(dst), cnp.PyArray_SIZE(src),
                            nthreads)
    return dst


def bf16_same_rounded(cnp.ndarray src, cnp.ndarray bits, int nthreads=1) -> bool:
    """Whether float32 ``src``, rounded to bf16 (nearest even), holds the values of the bf16
    bits ``bits`` (uint16 of src's size), compared bit for bit in parallel without the GIL:
    a bf16 kernel's packed weights are still those of the caller's fp32 array."""
    _check_f32_contiguous(src, "src")
    _check_bf16_array(bits, "bits", cnp.PyArray_SIZE(src), 0)
    if nthreads < 1:
        raise ValueError("nthreads must be >= 1")
    if ttile_cpu_has_avx512f() != 1:
        raise RuntimeError("the bf16 conversions need AVX-512F")
    cdef int same
    with nogil:
        same = ttile_bf16_same_rounded(<const float *>cnp.PyArray_DATA(src),
                                       <const unsigned short *>cnp.PyArray_DATA(bits),
                                       cnp.PyArray_SIZE(src), nthreads)
    return same == 1


def bf16_round_f32(cnp.ndarray src, int nthreads=1, out=None):
    """float32 -> float32 holding the values rounded to bf16 (``out``: a float32 array of
    src's size to write, which may be src itself; None: a new one)."""
    _check_f32_contiguous(src, "src")
    if ttile_cpu_has_avx512f() != 1:
        raise RuntimeError("the bf16 conversions need AVX-512F")
    cdef cnp.ndarray dst = np.empty((<object>src).shape, dtype=np.float32) if out is None \
        else out
    _check_f32_contiguous(dst, "out")
    if cnp.PyArray_SIZE(dst) != cnp.PyArray_SIZE(src):
        raise ValueError("out must have src's size")
    if not cnp.PyArray_ISWRITEABLE(dst):
        raise ValueError("out is read-only")
    with nogil:
        ttile_bf16_round_f32(<const float *>cnp.PyArray_DATA(src),
                             <float *>cnp.PyArray_DATA(dst), cnp.PyArray_SIZE(src), nthreads)
    return dst


def bf16_widen(cnp.ndarray src, int nthreads=1):
    """bf16 bits (uint16) -> float32, exactly."""
    _check_bf16_array(src, "src", cnp.PyArray_SIZE(src), 0)
    if ttile_cpu_has_avx512f() != 1:
        raise RuntimeError("the bf16 conversions need AVX-512F")
    cdef cnp.ndarray dst = np.empty((<object>src).shape, dtype=np.float32)
    with nogil:
        ttile_bf16_to_f32(<const unsigned short *>cnp.PyArray_DATA(src),
                          <float *>cnp.PyArray_DATA(dst), cnp.PyArray_SIZE(src), nthreads)
    return dst


def bf16_input_elems(tuple problem):
    """The bf16 elements of ``problem``'s packed input (with its slack)."""
    cdef ttile_bf16_problem p
    _bf16_problem(&p, problem)
    return ttile_bf16_input_elems(&p)


def bf16_pack_weights(cnp.ndarray w, tuple problem, int nthreads=1):
    """fp32 weights, RSCK (R, S, C, K), of one group -> the bf16 kernels' packed weights
    (ttile_bf16.h) for ``problem``."""
    cdef ttile_bf16_problem p
    _bf16_problem(&p, problem)
    _check_f32_c4(w, "w")
    if ttile_cpu_has_avx512f() != 1:
        raise RuntimeError("the bf16 packing needs AVX-512F")
    shape = (<object>w).shape
    r, s, c, k = shape
    if k != p.k or r != p.r or s != p.s or c > p.cp:
        raise ValueError(f"weights {shape} do not match the bf16 problem {problem}")
    if p.gc:
        raise ValueError("a grouped problem's weights are packed super-group by super-group "
                         "(each a dense problem of gc channels)")
    cdef cnp.ndarray wb = empty_aligned_bits((ttile_bf16_weight_elems(&p),))
    cdef int64_t channels = c
    with nogil:
        ttile_bf16_pack_weights(&p, <const float *>cnp.PyArray_DATA(w), channels,
                                <unsigned short *>cnp.PyArray_DATA(wb), nthreads)
    return wb


def inverted_residual_amx_scratch_bytes(tuple x_shape, int64_t e, int64_t k,
                                        int64_t stride, int nthreads):
    """Bytes of scratch :func:`inverted_residual_amx` needs at ``nthreads``."""
    cdef ttile_ir_shape sh
    sh.n, sh.h, sh.w, sh.c = x_shape
    sh.e, sh.k, sh.stride = e, k, stride
    sh.ho, sh.wo = (sh.h - 1) // stride + 1, (sh.w - 1) // stride + 1
    return ttile_inverted_residual_amx_scratch_bytes(&sh, nthreads)


def inverted_residual_amx(cnp.ndarray x, object w1, object b1, cnp.ndarray w2,
                          cnp.ndarray b2, cnp.ndarray w3, cnp.ndarray b3, cnp.ndarray y,
                          cnp.ndarray scratch, int64_t e, int64_t stride, tuple activations,
                          tuple slopes, bint residual, int nthreads):
    """The bf16 inverted residual block with its 1x1 stages on AMX
    (kernels/inverted_residual_amx.c): x (N, H, W, C) float32 or bf16 bits (uint16); w1
    and w3 the 1x1 stages' weights from :func:`bf16_pack_weights` (a (1, 1, C, E) and a
    (1, 1, E, K) problem with kc 32 and cp the channels rounded up to 32), b1, w2, b2, b3
    as for :func:`inverted_residual`; y (N, Ho, Wo, K) float32 or bf16 bits; scratch of
    :func:`inverted_residual_amx_scratch_bytes` bytes (uint8) on a 64-byte line. False
    where the CPU or Linux refuses AMX (nothing written)."""
    cdef ttile_ir_shape sh
    _ir_shape(&sh, x, e, 0 if cnp.PyArray_NDIM(y) != 4 else cnp.PyArray_DIMS(y)[3], stride,
              activations, slopes, residual)
    cdef int64_t ep = (e + 15) // 16 * 16, kp = (sh.k + 15) // 16 * 16
    cdef int64_t cp1 = (sh.c + 31) // 32 * 32, cp3 = (e + 31) // 32 * 32
    cdef int64_t ep32 = (e + 31) // 32 * 32, kp32 = (sh.k + 31) // 32 * 32
    cdef int xt = cnp.PyArray_TYPE(x), yt = cnp.PyArray_TYPE(y)
    if xt not in (cnp.NPY_FLOAT32, cnp.NPY_UINT16) or yt not in (cnp.NPY_FLOAT32,
                                                                 cnp.NPY_UINT16):
        raise TypeError("x and y must be float32 or bf16 bits (uint16)")
    for a, name in ((x, "x"), (y, "y")):
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a):
            raise ValueError(f"{name} must be C-contiguous and aligned")
    if (<object>y).shape != (sh.n, sh.ho, sh.wo, sh.k):
        raise ValueError(f"y must be {(sh.n, sh.ho, sh.wo, sh.k)}, got {(<object>y).shape}")
    cdef const unsigned short *w1p = NULL
    cdef const float *b1p = NULL
    if _ir_expands(w1, b1, e, sh.c):
        _check_bf16_array(w1, "w1", ep32 * cp1, 0)
        _check_dims(b1, "b1", 1, ep, 0, 0, 0)
        w1p = <const unsigned short *>cnp.PyArray_DATA(w1)
        b1p = <const float *>cnp.PyArray_DATA(b1)
    _check_dims(w2, "w2", 2, 9, ep, 0, 0)
    _check_dims(b2, "b2", 1, ep, 0, 0, 0)
    _check_bf16_array(w3, "w3", kp32 * cp3, 0)
    _check_dims(b3, "b3", 1, kp, 0, 0, 0)
    if nthreads < 1:
        raise ValueError(f"nthreads must be >= 1, got {nthreads}")
    if cnp.PyArray_NBYTES(scratch) < ttile_inverted_residual_amx_scratch_bytes(&sh, nthreads):
        raise ValueError("scratch too small for the block at this thread count")
    if not cnp.PyArray_IS_C_CONTIGUOUS(scratch) or (<size_t>cnp.PyArray_DATA(scratch)) % 64:
        raise ValueError("scratch must be C-contiguous and start on a 64-byte line")
    if not cnp.PyArray_ISWRITEABLE(y) or not cnp.PyArray_ISWRITEABLE(scratch):
        raise ValueError("y and scratch must be writeable")
    cdef int rc
    cdef int x_bf16 = xt == cnp.NPY_UINT16, y_bf16 = yt == cnp.NPY_UINT16
    with nogil:
        rc = ttile_inverted_residual_amx(
            &sh, cnp.PyArray_DATA(x), x_bf16, w1p, b1p,
            <const float *>cnp.PyArray_DATA(w2), <const float *>cnp.PyArray_DATA(b2),
            <const unsigned short *>cnp.PyArray_DATA(w3),
            <const float *>cnp.PyArray_DATA(b3), cnp.PyArray_DATA(y), y_bf16,
            cnp.PyArray_DATA(scratch), nthreads)
    return rc == 0


def conv2d_bf16(cnp.ndarray x, bint nchw, cnp.ndarray wb, cnp.ndarray y, tuple problem,
                int64_t c, int64_t h, int64_t w, int64_t pad_top, int64_t pad_left,
                int kernel, int nthreads, *, bias=None, residual=None, int activation=0,
                float slope=0.01, tuple folded=None, cnp.ndarray xb=None,
                bint y_nchw=False):
    """A bf16 convolution: x (fp32 NHWC or NCHW, or bf16 bits NHWC) of c channels, h x w,
    packed with pad_top/pad_left zeros, convolved with the packed weights ``wb`` by
    ``kernel`` (BF16_KERNEL_AMX or BF16_KERNEL_AVX512) into y (N, Ho, Wo, K), fp32 or bf16
    bits, the epilogue fused (a residual has y's type and shape). With ``y_nchw`` (the
    AMX kernel, an fp32 y), y and the residual are (N, K, Ho, Wo) instead.

    ``folded``: None, or the layer's (s, stride_w, dil_w) when ``problem`` is its folded
    form (ttile_bf16_pack_input_folded: the columns of the filter as channels). ``xb``:
    a uint16 buffer of ``bf16_input_elems(problem)`` for the packed input (None: one is
    allocated)."""
    cdef ttile_bf16_problem p
    _bf16_problem(&p, problem)
    cdef int64_t fs = 0, fstride = 1, fdil = 1
    if folded is not None:
        fs, fstride, fdil = folded
        if p.gc or p.s != 1 or p.stride_w != 1 or p.dil_w != 1 or fs < 1 or fstride < 1 or fdil < 1 \
                or fs * c > p.cp or p.wp != p.wo or p.phases:
            raise ValueError(f"bad folded bf16 problem {problem} for {folded}")
    # (phase planes hold the padded rows and columns the taps read, whatever the input's
    # extent: the packing tests each one)
    if c < 1 or (folded is None and c > p.cp) or h < 1 or w < 1 or pad_top < 0 \
            or pad_left < 0 or (not p.phases and pad_top + h > p.hp) \
            or (folded is None and not p.phases and pad_left + w > p.wp) or nthreads < 1:
        raise ValueError(f"input ({c}, {h}, {w}) padded ({pad_top}, {pad_left}) does not "
                         f"fit the bf16 problem {problem}")
    _check_bf16_array(x, "x", p.n * c * h * w, 1)
    cdef int x_bf16 = cnp.PyArray_TYPE(x) == cnp.NPY_UINT16
    if x_bf16 and nchw:
        raise ValueError("bf16 inputs are taken in NHWC only")
    _check_bf16_array(wb, "wb", ttile_bf16_weight_elems(&p), 0)
    _check_bf16_array(y, "y", p.n * p.ho * p.wo * p.k, 1)
    cdef int y_bf16 = cnp.PyArray_TYPE(y) == cnp.NPY_UINT16
    if y_nchw and (y_bf16 or kernel != BF16_KERNEL_AMX):
        raise ValueError("an NCHW output is the AMX kernel's, and fp32")
    cdef ttile_epilogue ep
    _epilogue(&ep, bias, None, activation, slope, y, p.k)   # bias and activation checked
    cdef cnp.ndarray res
    if residual is not None:   # of y's type, fp32 or bf16 bits
        res = residual
        if cnp.PyArray_TYPE(res) != cnp.PyArray_TYPE(y):
            raise TypeError("the residual must have the output's type")
        _check_bf16_array(res, "residual", p.n * p.ho * p.wo * p.k, 1)
        ep.residual = <const float *>cnp.PyArray_DATA(res)
    if kernel == BF16_KERNEL_AMX:
        if not amx_usable():
            raise RuntimeError("the AMX kernel needs AMX-BF16 and the tile state granted")
    elif kernel == BF16_KERNEL_AVX512:
        if ttile_cpu_has_avx512bf16() != 1:
            raise RuntimeError("the AVX512_BF16 kernel needs a CPU with AVX512_BF16")
    else:
        raise ValueError(f"unknown bf16 kernel {kernel}")
    # a 1x1, stride-1, unpadded AMX layer on bf16 NHWC input whose channels need no
    # padding reads that input in place (ttile_conv_bf16_amx_unpacked): no packed copy
    cdef bint unpacked = (x_bf16 and not nchw and not y_nchw and folded is None
                          and kernel == BF16_KERNEL_AMX and p.r == 1 and p.s == 1
                          and p.stride_h == 1 and p.stride_w == 1 and pad_top == 0
                          and pad_left == 0 and p.hp == h and p.wp == w and p.ho == h
                          and p.wo == w and c == p.cp)
    if unpacked:
        xb = None
    elif xb is None:
        xb = empty_aligned_bits((ttile_bf16_input_elems(&p),))
    else:
        _check_bf16_array(xb, "xb", ttile_bf16_input_elems(&p), 0)
        if not cnp.PyArray_ISWRITEABLE(xb):
            raise ValueError("xb must be writeable")
        if np.may_share_memory(xb, x) or np.may_share_memory(xb, y) \
                or np.may_share_memory(xb, wb):
            raise ValueError("xb overlaps another argument")
    cdef unsigned short *xbp = NULL if unpacked else <unsigned short *>cnp.PyArray_DATA(xb)
    cdef const unsigned short *wbp = <const unsigned short *>cnp.PyArray_DATA(wb)
    cdef const void *xp = cnp.PyArray_DATA(x)
    cdef void *yp = cnp.PyArray_DATA(y)
    cdef int status = 0
    with nogil:
        if unpacked:
            status = ttile_conv_bf16_amx_unpacked(&p, <const unsigned short *>xp, wbp, yp,
                                                  y_bf16, nthreads, &ep)
        elif fs:
            status = ttile_bf16_pack_input_folded(&p, xp, x_bf16, nchw, c, h, w, pad_top,
                                                  pad_left, fs, fstride, fdil, xbp, nthreads)
        else:
            ttile_bf16_pack_input(&p, xp, x_bf16, nchw, c, h, w, pad_top, pad_left, xbp,
                                  nthreads)
        if status != 0 or unpacked:
            pass
        elif kernel == _BF16_KERNEL_AMX:
            status = ttile_conv_bf16_amx(&p, xbp, wbp, yp, y_bf16, y_nchw, nthreads, &ep)
        else:
            status = ttile_conv_bf16_avx512(&p, xbp, wbp, yp, y_bf16, nthreads, &ep)
    if status != 0:
        raise MemoryError("the bf16 kernel could not start (memory or CPU state)")
