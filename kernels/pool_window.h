/* The windows of a max pooling over NHWC arrays (pool_nhwc.c, pool_avx512.c): for every
 * output pixel (b, oh, ow), the rows [r_lo, r_hi) and columns [s_lo, s_hi) of x its
 * window covers inside the input, then BODY. Threads split images and output rows. The
 * window holds at least one pixel: padding is at most half the kernel. */
#ifndef TTILE_POOL_WINDOW_H
#define TTILE_POOL_WINDOW_H

#define POOL_FOR_EACH_WINDOW(...)                                                        \
    _Pragma("omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)") \
    for (int64_t b = 0; b < n; b++)                                                      \
        for (int64_t oh = 0; oh < ho; oh++) {                                            \
            const int64_t r0 = oh * sh - ph;                                             \
            const int64_t r_lo = r0 < 0 ? 0 : r0, r_hi = r0 + kh > h ? h : r0 + kh;      \
            for (int64_t ow = 0; ow < wo; ow++) {                                        \
                const int64_t s0 = ow * sw - pw;                                         \
                const int64_t s_lo = s0 < 0 ? 0 : s0, s_hi = s0 + kw > w ? w : s0 + kw;  \
                __VA_ARGS__                                                              \
            }                                                                            \
        }

#endif
