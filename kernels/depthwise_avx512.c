/* Depthwise convolution on AVX-512 (groups == channels, one output channel per group):
 * the MobileNet / EfficientNet layer.
 *
 * A depthwise layer does R*S FMAs per output, so it is bound by loads, not FMAs, and the
 * dense kernels' outer product (broadcast one input, FMA into many output channels)
 * has nothing to share. In NHWC the channels are contiguous in the input, the weights
 * (R, S, C) and the output, so 16 channels go in the vector lanes: one input load per
 * FMA, no broadcast, no shuffle, at any stride. A register block covers up to 12
 * outputs along w for 16 channels; each weight vector is loaded once per (r, s) and
 * block. Padding: blocks that read
 * only inside the input skip every check; the others test each pixel (one compare per
 * (s, pixel)). The epilogue is applied in the store. */
#include <immintrin.h>
#include "ttile_runtime.h"

#define DW_WIDEST 12

#define DW_BLOCK(NW)                                                                   \
static inline __attribute__((always_inline)) void                                      \
dw_block_##NW(const ttile_conv_shape *sh, const float *x_n, const float *w,            \
              float *y_row, int64_t oh, int64_t ow0, int64_t c0, __mmask16 m,          \
              const ttile_epilogue *ep)                            \
{                                                                                      \
    const int64_t H = sh->h, W = sh->w, C = sh->groups, R = sh->r, S = sh->s;          \
    const int64_t SW = sh->stride_w, DW = sh->dil_w, PL = sh->pad_left;                \
    __m512 acc[NW];                                                                    \
    _Pragma("GCC unroll 16")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        acc[j] = _mm512_setzero_ps();                                                  \
    const int64_t iw_lo = ow0 * SW - PL;                                               \
    const int64_t iw_hi = (ow0 + NW - 1) * SW - PL + (S - 1) * DW;                     \
    const int inside = iw_lo >= 0 && iw_hi < W;                                        \
    for (int64_t r = 0; r < R; r++) {                                                  \
        const int64_t ih = oh * sh->stride_h + r * sh->dil_h - sh->pad_top;            \
        if (ih < 0 || ih >= H)                                                         \
            continue;                                                                  \
        const float *x_row = x_n + ih * W * C + c0;                                    \
        for (int64_t s = 0; s < S; s++) {                                              \
            const __m512 wv = _mm512_maskz_loadu_ps(m, w + (r * S + s) * C + c0);      \
            const int64_t iw0 = ow0 * SW + s * DW - PL;                                \
            if (inside) {                                                              \
                _Pragma("GCC unroll 16")                                               \
                for (int j = 0; j < NW; j++)                                           \
                    acc[j] = _mm512_fmadd_ps(                                          \
                        _mm512_maskz_loadu_ps(m, x_row + (iw0 + j * SW) * C), wv, acc[j]);\
            } else {                                                                   \
                _Pragma("GCC unroll 16")                                               \
                for (int j = 0; j < NW; j++) {                                         \
                    const int64_t iw = iw0 + j * SW;                                   \
                    if (iw >= 0 && iw < W)                                             \
                        acc[j] = _mm512_fmadd_ps(                                      \
                            _mm512_maskz_loadu_ps(m, x_row + iw * C), wv, acc[j]);     \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    _Pragma("GCC unroll 16")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        _mm512_mask_storeu_ps(y_row + (ow0 + j) * C + c0, m, acc[j]);                \
    if (ep != NULL) {   /* 12 accumulators: room to spare, but one way for all kernels */ \
        __asm__ volatile("" ::: "memory");                                             \
        for (int j = 0; j < NW; j++)                                                   \
            ttile_epilogue_apply512(ep, y_row, (ow0 + j) * C + c0, c0, m);             \
    }                                                                                  \
}

DW_BLOCK(12) DW_BLOCK(11) DW_BLOCK(10) DW_BLOCK(9) DW_BLOCK(8) DW_BLOCK(7)
DW_BLOCK(6) DW_BLOCK(5) DW_BLOCK(4) DW_BLOCK(3) DW_BLOCK(2) DW_BLOCK(1)

/* The fast path for the common kernels (S = 3 or 5 taps along w, stride 1 or 2, no
 * dilation along w): within one kernel row, each input pixel the block needs is loaded
 * once and feeds every (output, tap) pair that reads it (up to S FMAs per load, against
 * one in dw_block), with the S weight vectors of the row held in registers. The pixel
 * loop is unrolled at compile time (NW, S and the stride are constants), so which
 * accumulator each FMA goes to is decided by the compiler; a pixel in the padding is
 * loaded with an empty mask (zeros, no access). 16 accumulators + 5 weights + 1 pixel:
 * 22 zmm registers at most. */
/* The FMAs input pixel q of the block feeds: tap s of output j when q = j * SW + s
 * (all constants once unrolled). */
#define DW_FAST_TAPS(NW, S, SW, q, v)                                                  \
    do {                                                                               \
        _Pragma("GCC unroll 8")                                                        \
        for (int s = 0; s < S; s++) {                                                  \
            const int j = ((q) - s) / SW;                                              \
            if ((q) >= s && ((q) - s) % SW == 0 && j < NW)                             \
                acc[j] = _mm512_fmadd_ps(v, wv[s], acc[j]);                            \
        }                                                                              \
    } while (0)

#define DW_FAST(NW, S, SW)                                                             \
static inline __attribute__((always_inline)) void                                      \
dw_fast_##NW##_##S##_##SW(const ttile_conv_shape *sh, const float *x_n, const float *w,\
                          float *y_row, int64_t oh, int64_t ow0, int64_t c0,           \
                          __mmask16 m, const ttile_epilogue *ep)                       \
{                                                                                      \
    const int64_t H = sh->h, W = sh->w, C = sh->groups, R = sh->r;                     \
    const int64_t iw0 = ow0 * SW - sh->pad_left;                                       \
    const int inside = iw0 >= 0 && iw0 + (NW - 1) * SW + S - 1 < W;                    \
    __m512 acc[NW];                                                                    \
    _Pragma("GCC unroll 64")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        acc[j] = _mm512_setzero_ps();                                                  \
    for (int64_t r = 0; r < R; r++) {                                                  \
        const int64_t ih = oh * sh->stride_h + r * sh->dil_h - sh->pad_top;            \
        if (ih < 0 || ih >= H)                                                         \
            continue;                                                                  \
        const float *row = x_n + ih * W * C + c0;                                      \
        __m512 wv[S];                                                                  \
        _Pragma("GCC unroll 8")                                                        \
        for (int s = 0; s < S; s++)                                                    \
            wv[s] = _mm512_maskz_loadu_ps(m, w + (r * S + s) * C + c0);                \
        /* A running pointer, and a step the compiler cannot see through: otherwise   \
         * it hoists one offset (and mask) per pixel out of the r loop, 2 * NW + S      \
         * live values, and spills them. */                                            \
        int64_t step = C;                                                              \
        __asm__("" : "+r"(step));                                                      \
        const float *p = row + iw0 * step;                                             \
        if (inside) {                                                                  \
            _Pragma("GCC unroll 64")                                                   \
            for (int q = 0; q < (NW - 1) * SW + S; q++) {                              \
                const __m512 v = _mm512_maskz_loadu_ps(m, p);                          \
                p += step;                                                             \
                DW_FAST_TAPS(NW, S, SW, q, v);                                         \
            }                                                                          \
        } else {                                                                       \
            int64_t iw = iw0;                                                          \
            __asm__("" : "+r"(iw));                                                    \
            _Pragma("GCC unroll 64")                                                   \
            for (int q = 0; q < (NW - 1) * SW + S; q++) {                              \
                const int ok = (uint64_t)iw < (uint64_t)W;                             \
                const __m512 v = _mm512_maskz_loadu_ps(ok ? m : (__mmask16)0,          \
                                                       ok ? p : row);                  \
                p += step;                                                             \
                iw++;                                                                  \
                DW_FAST_TAPS(NW, S, SW, q, v);                                         \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    _Pragma("GCC unroll 64")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        _mm512_mask_storeu_ps(y_row + (ow0 + j) * C + c0, m, acc[j]);                \
    if (ep != NULL) {                                                                  \
        __asm__ volatile("" ::: "memory");                                             \
        for (int j = 0; j < NW; j++)                                                   \
            ttile_epilogue_apply512(ep, y_row, (ow0 + j) * C + c0, c0, m);             \
    }                                                                                  \
}

#define DW_FAST_WIDTHS(X, S, SW) X(16, S, SW) X(15, S, SW) X(14, S, SW) X(13, S, SW)    \
    X(12, S, SW) X(11, S, SW) X(10, S, SW) X(9, S, SW) X(8, S, SW) X(7, S, SW)          \
    X(6, S, SW) X(5, S, SW) X(4, S, SW) X(3, S, SW) X(2, S, SW) X(1, S, SW)
#define DW_FAST_KINDS(X) X(3, 1) X(3, 2) X(5, 1) X(5, 2)
#define DW_FAST_DEFINE(S, SW) DW_FAST_WIDTHS(DW_FAST, S, SW)
DW_FAST_KINDS(DW_FAST_DEFINE)
#define DW_FAST_WIDEST 16

#define DW_FAST_CASE(NW, S, SW)                                                        \
    case NW:                                                                           \
        dw_fast_##NW##_##S##_##SW(sh, x_n, w, y_row, oh, ow0, c0, m, row_ep);          \
        break;
#define DW_FAST_KIND_CASE(S, SW)                                                       \
    case S * 16 + SW:                                                                  \
        switch (nw) { DW_FAST_WIDTHS(DW_FAST_CASE, S, SW) }                            \
        break;

#define DW_CASE(NW)                                                                    \
    case NW:                                                                           \
        dw_block_##NW(sh, x_n, w, y_row, oh, ow0, c0, m, row_ep);                      \
        break;

void ttile_conv_depthwise_avx512(const ttile_conv_shape *sh, const float *x,
                                 const float *w, float *y, int nthreads,
                                 const ttile_epilogue *ep)
{
    const int64_t N = sh->n, C = sh->groups, HO = sh->ho, WO = sh->wo;
    const int64_t cvecs = (C + 15) / 16;
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    /* The fast path's kind (S * 16 + stride), or 0 for the general blocks. */
    const int fast = (sh->dil_w == 1 && (sh->s == 3 || sh->s == 5)
                      && (sh->stride_w == 1 || sh->stride_w == 2))
                     ? (int)(sh->s * 16 + sh->stride_w) : 0;
    /* Blocks of nearly equal width (17 -> 9 + 8), as in the generic kernel. */
    const int64_t widest = fast ? DW_FAST_WIDEST : DW_WIDEST;
    const int64_t nblocks = (WO + widest - 1) / widest;
    const int64_t base = WO / nblocks, wider = WO % nblocks;

    /* Tasks are (image, output row, run of blocks), the runs cut only when there are
     * fewer rows than threads; a block runs every channel vector before the next block,
     * so the input is read pixel after pixel, whole (a 96-channel pixel is 6 lines),
     * where a channel vector per task read one line in six, and ran at half the speed
     * on inputs cold in the caches (MobileNetV2's 112x112 layers). */
    int64_t segments = 1;
    if (N * HO < nthreads)
        segments = (nthreads + N * HO - 1) / (N * HO);
#pragma omp parallel for collapse(3) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t oh = 0; oh < HO; oh++) {
            for (int64_t segment = 0; segment < segments; segment++) {
                const float *x_n = x + n * sh->h * sh->w * C;
                const int64_t row_offset = (n * HO + oh) * WO * C;
                float *y_row = y + row_offset;
                ttile_epilogue shifted;
                const ttile_epilogue *row_ep = NULL;
                if (ep != NULL) {
                    shifted = *ep;
                    if (ep->residual)
                        shifted.residual = ep->residual + row_offset;
                    row_ep = &shifted;
                }
                const int64_t b_lo = nblocks * segment / segments;
                const int64_t b_hi = nblocks * (segment + 1) / segments;
                for (int64_t b = b_lo; b < b_hi; b++) {
                    const int nw = (int)(base + (b < wider ? 1 : 0));
                    const int64_t ow0 = b * base + (b < wider ? b : wider);
                    for (int64_t cv = 0; cv < cvecs; cv++) {
                        const int64_t c0 = cv * 16;
                        const __mmask16 m = C - c0 >= 16 ? (__mmask16)0xFFFF
                                                         : (__mmask16)((1u << (C - c0)) - 1u);
                        if (fast) {
                            switch (fast) { DW_FAST_KINDS(DW_FAST_KIND_CASE) }
                            continue;
                        }
                        switch (nw) {
                        DW_CASE(12) DW_CASE(11) DW_CASE(10) DW_CASE(9) DW_CASE(8) DW_CASE(7)
                        DW_CASE(6) DW_CASE(5) DW_CASE(4) DW_CASE(3) DW_CASE(2) DW_CASE(1)
                        }
                    }
                }
            }
        }
    }
}
