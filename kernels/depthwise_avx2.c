/* Depthwise convolution on AVX2 + FMA (groups == channels, one output channel per
 * group), for CPUs without AVX-512: the counterpart of depthwise_avx512.c.
 *
 * The same design, 8 channels in the vector lanes (NHWC: the channels are contiguous in
 * the input, the (R, S, C) weights and the output, so one input load feeds FMAs with no
 * broadcast or shuffle at any stride). Without it, an AVX2 CPU ran a depthwise layer on
 * the generic kernel as C groups of one channel: one useful lane in eight.
 *
 * Two kinds of block, both a row segment of up to 8 outputs over one channel vector:
 * - dw2_block: any kernel size, stride and dilation, masked loads for a channel tail,
 *   each tap checked against the padding where the block reaches into it;
 * - dw2_fast: square 3x3 and 5x5 kernels at column stride 1 or 2 (MobileNet's and
 *   EfficientNet's), whole channel vectors. Within a kernel row each input pixel is
 *   loaded once and feeds every (output, tap) pair that reads it (up to S FMAs per load)
 *   with the row's S weight vectors in registers: 8 accumulators + 5 weights + 1 pixel =
 *   14 of the 16 ymm registers at most. The pixel loop and the kernel rows are unrolled
 *   at compile time, so which accumulator each FMA goes to is a constant.
 * A call of the fast block runs several neighbouring channel vectors one after the
 * other (`ngroups`), so the call costs nothing measurable.
 *
 * The AVX-512 kernel's input-line tricks (channel vectors that follow a misaligned
 * input's cache lines) are left out: ttile's own activations start on a line. */
#include <immintrin.h>
#include <stdlib.h>
#include "ttile_runtime.h"

#define DW2_WIDEST 8

/* The exp-based activations, out of line: inlined into each block kernel they would
 * only bloat it. */
static __attribute__((noinline)) __m256 dw2_activate_exp(int activation, __m256 v)
{
    return ttile_activate256(activation, 0.0f, v);
}

/* The epilogue and the stores of a block's nw accumulators (nw is a constant once
 * inlined): bias and residual added in registers, the activation chosen once per block
 * (a switch per vector cost C=96 112x112 s2 bias + ReLU6 1.5x the bare layer on a Zen 3),
 * then one store per vector. The exp-based activations run from the stored row, out of
 * line: no call while the accumulators are live. `whole` says every lane of m is on.
 * Every loop is unrolled: a loop over acc[j] left rolled keeps the accumulators in memory. */
static inline __attribute__((always_inline)) void
dw2_finish(const ttile_epilogue *ep, __m256 *acc, int nw, int64_t c0, const float *res,
           float *y, int64_t step, __m256i m, int whole)
{
    if (ep != NULL) {
        const __m256 bias = ep->bias == NULL ? _mm256_setzero_ps()
                            : whole ? _mm256_loadu_ps(ep->bias + c0)
                                    : _mm256_maskload_ps(ep->bias + c0, m);
        if (res != NULL) {
            _Pragma("GCC unroll 8")
            for (int j = 0; j < nw; j++)
                acc[j] = _mm256_add_ps(_mm256_add_ps(acc[j], bias),
                                       whole ? _mm256_loadu_ps(res + j * step)
                                             : _mm256_maskload_ps(res + j * step, m));
        } else {
            _Pragma("GCC unroll 8")
            for (int j = 0; j < nw; j++)
                acc[j] = _mm256_add_ps(acc[j], bias);
        }
        const __m256 zero = _mm256_setzero_ps();
        switch (ep->activation) {
        case TTILE_ACT_NONE:
            break;
        case TTILE_ACT_RELU:
            _Pragma("GCC unroll 8")
            for (int j = 0; j < nw; j++)
                acc[j] = _mm256_max_ps(acc[j], zero);
            break;
        case TTILE_ACT_RELU6: {
            const __m256 six = _mm256_set1_ps(6.0f);
            _Pragma("GCC unroll 8")
            for (int j = 0; j < nw; j++)
                acc[j] = _mm256_min_ps(_mm256_max_ps(acc[j], zero), six);
            break;
        }
        case TTILE_ACT_LEAKY_RELU:
            _Pragma("GCC unroll 8")
            for (int j = 0; j < nw; j++)
                acc[j] = ttile_leaky256(acc[j], ep->negative_slope);
            break;
        default:
            break;
        }
    }
    _Pragma("GCC unroll 8")
    for (int j = 0; j < nw; j++) {
        if (whole)
            _mm256_storeu_ps(y + j * step, acc[j]);
        else
            ttile_maskstore256(y + j * step, m, acc[j]);
    }
    if (ep != NULL && ep->activation != TTILE_ACT_NONE && ep->activation != TTILE_ACT_RELU
        && ep->activation != TTILE_ACT_RELU6 && ep->activation != TTILE_ACT_LEAKY_RELU) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < nw; j++) {
            const __m256 v = dw2_activate_exp(ep->activation,
                                              _mm256_maskload_ps(y + j * step, m));
            ttile_maskstore256(y + j * step, m, v);
        }
    }
}

/* NW outputs from ow0 of output row oh, channels c0 .. c0 + 7 (lanes of m). */
#define DW2_BLOCK(NW)                                                                  \
static __attribute__((noinline)) void                                                  \
dw2_block_##NW(const ttile_conv_shape *sh, const float *x_n, const float *w,           \
               float *y_row, int64_t oh, int64_t ow0, int64_t c0, __m256i m,           \
               const ttile_epilogue *ep)                                               \
{                                                                                      \
    const int64_t H = sh->h, W = sh->w, C = sh->groups, R = sh->r, S = sh->s;          \
    const int64_t SW = sh->stride_w, DW = sh->dil_w, PL = sh->pad_left;                \
    __m256 acc[NW];                                                                    \
    _Pragma("GCC unroll 8")                                                            \
    for (int j = 0; j < NW; j++)                                                       \
        acc[j] = _mm256_setzero_ps();                                                  \
    const int64_t iw_lo = ow0 * SW - PL;                                               \
    const int64_t iw_hi = (ow0 + NW - 1) * SW - PL + (S - 1) * DW;                     \
    const int inside = iw_lo >= 0 && iw_hi < W;                                        \
    for (int64_t r = 0; r < R; r++) {                                                  \
        const int64_t ih = oh * sh->stride_h + r * sh->dil_h - sh->pad_top;            \
        if (ih < 0 || ih >= H)                                                         \
            continue;                                                                  \
        const float *x_row = x_n + ih * W * C + c0;                                    \
        for (int64_t s = 0; s < S; s++) {                                              \
            const __m256 wv = _mm256_maskload_ps(w + (r * S + s) * C + c0, m);         \
            const int64_t iw0 = ow0 * SW + s * DW - PL;                                \
            if (inside) {                                                              \
                _Pragma("GCC unroll 8")                                                \
                for (int j = 0; j < NW; j++)                                           \
                    acc[j] = _mm256_fmadd_ps(                                          \
                        _mm256_maskload_ps(x_row + (iw0 + j * SW) * C, m), wv, acc[j]);\
            } else {                                                                   \
                _Pragma("GCC unroll 8")                                                \
                for (int j = 0; j < NW; j++) {                                         \
                    const int64_t iw = iw0 + j * SW;                                   \
                    if (iw >= 0 && iw < W)                                             \
                        acc[j] = _mm256_fmadd_ps(                                      \
                            _mm256_maskload_ps(x_row + iw * C, m), wv, acc[j]);        \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    dw2_finish(ep, acc, NW, c0, ep != NULL && ep->residual                             \
               ? ep->residual + ow0 * C + c0 : NULL, y_row + ow0 * C + c0, C, m, 0);   \
}

DW2_BLOCK(8) DW2_BLOCK(7) DW2_BLOCK(6) DW2_BLOCK(5)
DW2_BLOCK(4) DW2_BLOCK(3) DW2_BLOCK(2) DW2_BLOCK(1)

/* The FMAs input pixel q of a fast block feeds: tap s of output j when q = j * SW + s
 * (all constants once unrolled). */
#define DW2_FAST_TAPS(NW, S, SW, q, v)                                                 \
    do {                                                                               \
        _Pragma("GCC unroll 8")                                                        \
        for (int s = 0; s < S; s++) {                                                  \
            const int j = ((q) - s) / SW;                                              \
            if ((q) >= s && ((q) - s) % SW == 0 && j < NW)                             \
                acc[j] = _mm256_fmadd_ps(v, wv[s], acc[j]);                            \
        }                                                                              \
    } while (0)

/* The kernel rows of a fast block. With CHECK 0 every tap reads inside the input and
 * nothing is tested; otherwise rows outside the input are skipped and a pixel in the
 * left or right padding is a zero vector (a load with an empty mask: no access). A
 * running pointer with a step the compiler cannot see through keeps it from hoisting
 * one address per pixel out of the row loop (NW + S live values, which spilled in the
 * AVX-512 kernel). */
#define DW2_FAST_ROWS(NW, S, SW, CHECK)                                                \
    _Pragma("GCC unroll 5")                                                            \
    for (int r = 0; r < S; r++) {   /* R == S: square kernels only */                  \
        const int64_t ih = ih0 + r * sh->dil_h;                                        \
        if ((CHECK) && (ih < 0 || ih >= H))                                            \
            continue;                                                                  \
        const float *row = x_n + ih * W * C + c0;                                      \
        __m256 wv[S];                                                                  \
        _Pragma("GCC unroll 8")                                                        \
        for (int s = 0; s < S; s++)                                                    \
            wv[s] = _mm256_loadu_ps(wb + (r * S + s) * wstep);                         \
        int64_t step = C;                                                              \
        __asm__("" : "+r"(step));                                                      \
        const float *p = row + iw0 * step;                                             \
        if (!(CHECK) || inside) {                                                      \
            _Pragma("GCC unroll 64")                                                   \
            for (int q = 0; q < (NW - 1) * SW + S; q++) {                              \
                __m256 v = _mm256_loadu_ps(p);                                         \
                __asm__("" : "+x"(v));   /* one load, not one folded per FMA */       \
                DW2_FAST_TAPS(NW, S, SW, q, v);                                        \
                p += step;                                                             \
            }                                                                          \
        } else {                                                                       \
            int64_t iw = iw0;                                                          \
            __asm__("" : "+r"(iw));                                                    \
            _Pragma("GCC unroll 64")                                                   \
            for (int q = 0; q < (NW - 1) * SW + S; q++) {                              \
                const int ok = (uint64_t)iw < (uint64_t)W;                             \
                __m256 v = _mm256_maskload_ps(ok ? p : row,                            \
                                              _mm256_set1_epi32(ok ? -1 : 0));         \
                __asm__("" : "+x"(v));                                                 \
                DW2_FAST_TAPS(NW, S, SW, q, v);                                        \
                p += step;                                                             \
                iw++;                                                                  \
            }                                                                          \
        }                                                                              \
    }

/* NW outputs from ow0 of output row oh over `ngroups` whole channel vectors from c0. */
#define DW2_FAST(NW, S, SW)                                                            \
static __attribute__((noinline)) void                                                  \
dw2_fast_##NW##_##S##_##SW(const ttile_conv_shape *sh, const float *x_n,               \
                           const float *w, float *y_row, int64_t oh, int64_t ow0,      \
                           int64_t c0, const ttile_epilogue *ep, int64_t ngroups)      \
{                                                                                      \
    const int64_t H = sh->h, W = sh->w, C = sh->groups;                                \
    const int64_t iw0 = ow0 * SW - sh->pad_left;                                       \
    const int inside = iw0 >= 0 && iw0 + (NW - 1) * SW + S - 1 < W;                    \
    const int64_t ih0 = oh * sh->stride_h - sh->pad_top;                               \
    const int rows_inside = ih0 >= 0 && ih0 + (S - 1) * sh->dil_h < H;                 \
    for (int64_t g = 0; g < ngroups; g++, c0 += 8) {                                   \
        __m256 acc[NW];                                                                \
        _Pragma("GCC unroll 64")                                                       \
        for (int j = 0; j < NW; j++)                                                   \
            acc[j] = _mm256_setzero_ps();                                              \
        int64_t wstep = C;                                                             \
        __asm__("" : "+r"(wstep));                                                     \
        const float *wb = w + c0;                                                      \
        if (inside && rows_inside)                                                     \
            DW2_FAST_ROWS(NW, S, SW, 0)                                                \
        else                                                                           \
            DW2_FAST_ROWS(NW, S, SW, 1)                                                \
        dw2_finish(ep, acc, NW, c0, ep != NULL && ep->residual                         \
                   ? ep->residual + ow0 * C + c0 : NULL, y_row + ow0 * C + c0, C,      \
                   _mm256_set1_epi32(-1), 1);                                          \
    }                                                                                  \
}

#define DW2_FAST_WIDTHS(X, S, SW) X(8, S, SW) X(7, S, SW) X(6, S, SW) X(5, S, SW)       \
    X(4, S, SW) X(3, S, SW) X(2, S, SW) X(1, S, SW)
#define DW2_FAST_KINDS(X) X(3, 1) X(3, 2) X(5, 1) X(5, 2)
#define DW2_FAST_DEFINE(S, SW) DW2_FAST_WIDTHS(DW2_FAST, S, SW)
DW2_FAST_KINDS(DW2_FAST_DEFINE)

#define DW2_FAST_CASE(NW, S, SW)                                                       \
    case NW:                                                                           \
        dw2_fast_##NW##_##S##_##SW(sh, x_n, w, y_row, oh, ow0, c0, row_ep, whole);     \
        break;
#define DW2_FAST_KIND_CASE(S, SW)                                                      \
    case S * 16 + SW:                                                                  \
        switch (nw) { DW2_FAST_WIDTHS(DW2_FAST_CASE, S, SW) }                          \
        break;
#define DW2_CASE(NW)                                                                   \
    case NW:                                                                           \
        dw2_block_##NW(sh, x_n, w, y_row, oh, ow0, c0, m, row_ep);                     \
        break;

void ttile_conv_depthwise_avx2(const ttile_conv_shape *sh, const float *x,
                               const float *w, float *y, int nthreads,
                               const ttile_epilogue *ep)
{
    const int64_t N = sh->n, C = sh->groups, HO = sh->ho, WO = sh->wo;
    const int64_t cvecs = (C + 7) / 8;
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    /* The fast path's kind (S * 16 + stride), or 0 for the general blocks. */
    const int fast = (sh->dil_w == 1 && sh->r == sh->s && (sh->s == 3 || sh->s == 5)
                      && (sh->stride_w == 1 || sh->stride_w == 2))
                     ? (int)(sh->s * 16 + sh->stride_w) : 0;
    /* Each output row in blocks of nearly equal width (13 -> 7 + 6): every block tests
     * whether its taps reach into the padding (only the first and last of a row do),
     * and only those test each tap. */
    const int64_t nblocks = (WO + DW2_WIDEST - 1) / DW2_WIDEST;
    const int64_t base = WO / nblocks, wider = WO % nblocks;
    const int64_t whole_vecs = C / 8;   /* channel vectors without a tail */

    /* Tasks: (image, band of output rows, range of channel vectors), one band per
     * thread, the channels split only when there are fewer image-bands than threads.
     * Within a task each output row runs its blocks along w in order, each over the
     * task's channel vectors: the input rows and the output row are walked from end to
     * end, and the next output row finds the input rows it shares with this one in
     * L1/L2 (the AVX-512 kernel's measurements: 1.5-1.9x faster inside MobileNetV2
     * than running block columns down the image). */
    int64_t bands = nthreads == 1 ? 1 : ((int64_t)nthreads + N - 1) / N;
    if (bands > HO)
        bands = HO;
    int64_t cparts = 1;
    if (N * bands < (int64_t)nthreads) {
        cparts = ((int64_t)nthreads + N * bands - 1) / (N * bands);
        if (cparts > cvecs)
            cparts = cvecs;
    }
#pragma omp parallel for collapse(3) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t band = 0; band < bands; band++) {
            for (int64_t cp = 0; cp < cparts; cp++) {
                const float *x_n = x + n * sh->h * sh->w * C;
                const int64_t cv_lo = cvecs * cp / cparts, cv_hi = cvecs * (cp + 1) / cparts;
                const int64_t oh_lo = HO * band / bands, oh_hi = HO * (band + 1) / bands;
                for (int64_t oh = oh_lo; oh < oh_hi; oh++) {
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
                    for (int64_t b = 0; b < nblocks; b++) {
                        const int nw = (int)(base + (b < wider ? 1 : 0));
                        const int64_t ow0 = b * base + (b < wider ? b : wider);
                        int64_t cv = cv_lo;
                        const int64_t whole_hi = cv_hi < whole_vecs ? cv_hi : whole_vecs;
                        if (fast && whole_hi > cv) {
                            /* every whole channel vector of the task in one call */
                            const int64_t c0 = cv * 8, whole = whole_hi - cv;
                            switch (fast) { DW2_FAST_KINDS(DW2_FAST_KIND_CASE) }
                            cv = whole_hi;
                        }
                        for (; cv < cv_hi; cv++) {
                            const int64_t c0 = cv * 8;
                            const __m256i m = ttile_tail_mask256(C - c0);
                            switch (nw) {
                            DW2_CASE(8) DW2_CASE(7) DW2_CASE(6) DW2_CASE(5)
                            DW2_CASE(4) DW2_CASE(3) DW2_CASE(2) DW2_CASE(1)
                            }
                        }
                    }
                }
            }
        }
    }
}
