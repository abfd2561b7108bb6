/* Depthwise convolution on AVX-512 (groups == channels, one output channel per group):
 * the MobileNet / EfficientNet layer.
 *
 * A depthwise layer does R*S FMAs per output, so it is bound by loads, not FMAs, and the
 * dense kernels' outer product (broadcast one input, FMA into many output channels)
 * has nothing to share. In NHWC the channels are contiguous in the input, the weights
 * (R, S, C) and the output, so 16 channels go in the vector lanes: one input load per
 * FMA, no broadcast, no shuffle, at any stride. A register block covers up to 12
 * outputs along w for 16 channels (16 on the fast path below); each weight vector is
 * loaded once per (r, s) and block. Padding: the output columns whose taps reach into
 * the left or right padding are blocks of their own, which test each pixel; the blocks
 * between them read only inside the input and skip every check. The epilogue is applied
 * in the store.
 *
 * Measured on a Zen 5 core, 1 thread, caches warm (MobileNetV2's 3x3 layers): the edge
 * blocks and the fast path's plain loads on whole channel vectors took 7-25 % off the time
 * of a kernel with masked loads (C=32 112x112: 100 -> 81 us; C=960 7x7: 13.3 -> 11.6 us,
 * together with a block-column order since replaced, see the task loop). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include "ttile_runtime.h"

#define DW_WIDEST 12
#define DW_WRAP_TAPS 64

/* The exp-based activations, out of line: inlined into each of the 76 block kernels
 * they would only bloat them. */
static __attribute__((noinline)) __m512 dw_activate_exp(int activation, __m512 v)
{
    return ttile_activate512(activation, 0.0f, v);
}

/* The epilogue on one block's accumulator, in registers before its one store: bias and
 * residual added, then the activation. Applied after the store from memory, one call
 * per vector, bias + ReLU6 cost 27 % over the bare layer (MobileNetV2's C=96 s2 on a
 * Zen 4); in registers, 7 %. */
static inline __attribute__((always_inline)) __m512
dw_epilogue(const ttile_epilogue *ep, __m512 v, __m512 bias, const float *res, __mmask16 m)
{
    v = _mm512_add_ps(v, bias);
    if (res != NULL)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, res));
    switch (ep->activation) {
    case TTILE_ACT_NONE:
        return v;
    case TTILE_ACT_RELU:
    case TTILE_ACT_RELU6:
    case TTILE_ACT_LEAKY_RELU:
        return ttile_activate512(ep->activation, ep->negative_slope, v);
    default:
        return dw_activate_exp(ep->activation, v);
    }
}

#define DW_BLOCK(NW)                                                                   \
static __attribute__((noinline)) void                                                  \
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
    if (ep != NULL) {                                                                  \
        const __m512 bias = ep->bias ? _mm512_maskz_loadu_ps(m, ep->bias + c0)          \
                                     : _mm512_setzero_ps();                            \
        _Pragma("GCC unroll 16")                                                       \
        for (int j = 0; j < NW; j++)                                                   \
            acc[j] = dw_epilogue(ep, acc[j], bias, ep->residual                        \
                                 ? ep->residual + (ow0 + j) * C + c0 : NULL, m);       \
    }                                                                                  \
    _Pragma("GCC unroll 16")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        _mm512_mask_storeu_ps(y_row + (ow0 + j) * C + c0, m, acc[j]);                \
}

DW_BLOCK(12) DW_BLOCK(11) DW_BLOCK(10) DW_BLOCK(9) DW_BLOCK(8) DW_BLOCK(7)
DW_BLOCK(6) DW_BLOCK(5) DW_BLOCK(4) DW_BLOCK(3) DW_BLOCK(2) DW_BLOCK(1)

/* The fast path for the common kernels (square, S = 3 or 5 taps, stride 1 or 2 along w,
 * no dilation along w): within one kernel row, each input pixel the block needs is loaded
 * once and feeds every (output, tap) pair that reads it (up to S FMAs per load, against
 * one in dw_block), with the S weight vectors of the row held in registers. The pixel
 * loop and the S kernel rows are unrolled at compile time (NW, S = R and the stride are
 * constants), so which accumulator each FMA goes to is decided by the compiler; a pixel
 * in the padding is loaded with an empty mask (zeros, no access). Whole channel vectors
 * only (plain loads: a masked load cost 10 % here); the last, partial vector of a layer
 * whose channels are not a multiple of 16 goes to dw_block. 16 accumulators + 5 weights
 * + 1 pixel: 22 zmm registers at most with one channel vector, 16 + 10 + 1 = 27 with
 * two. Feeding each output's S taps from S folded loads (one load per FMA, no
 * accumulator shuffling) measured slower on every MobileNetV2 layer.
 *
 * The block kernels are functions of their own, not inlined into the row loop: inlined,
 * the ~170 of them made one function that took GCC 3.7 minutes to compile (the row
 * loop's register allocation); apart, 30 s. Each call runs all the channel vectors of a
 * part (below), so the calls cost nothing measurable; with the rows unrolled (a runtime
 * kernel height cost 9 % in a stand-alone loop) the layers ran 0-19 % faster than the
 * inlined kernels with a runtime height (Zen 4, 1 thread, caches warm, best of 300:
 * C=96 112x112 s2 141 -> 130 us, C=192 28x28 44.8 -> 36.4, C=960 7x7 10.2 -> 9.7). */
/* The FMAs input pixel q of the block feeds in channel vector cb: tap s of output j when
 * q = j * SW + s (all constants once unrolled). */
#define DW_FAST_TAPS(NW, S, SW, q, v, cb)                                              \
    do {                                                                               \
        _Pragma("GCC unroll 8")                                                        \
        for (int s = 0; s < S; s++) {                                                  \
            const int j = ((q) - s) / SW;                                              \
            if ((q) >= s && ((q) - s) % SW == 0 && j < NW)                             \
                acc[cb][j] = _mm512_fmadd_ps(v, wv[cb][s], acc[cb][j]);                \
        }                                                                              \
    } while (0)

/* CB (1 or 2) neighbouring channel vectors at once: with two, each pixel is read as 128
 * contiguous bytes and a block of NW <= 8 outputs still has 2 * NW independent
 * accumulators. Rows of 7 outputs (7 accumulators with one vector: FMA latency showed)
 * ran 20-25 % faster with two. */
/* The kernel rows of one group of CB vectors of a fast-path block: with CHECK 0, every
 * tap of the block reads inside the input and nothing is tested. Testing the columns
 * inside the unrolled rows, GCC moved registers around the two paths of each row:
 * 1.16-1.2x the time of the same loop without the tests in a stand-alone copy (C=32
 * 114x114, Zen 4), and the weights of vector 0 read through a pointer of their own
 * (the wrapped vector once did) made it worse. */
#define DW_FAST_ROWS(NW, S, SW, CB, CHECK)                                             \
    _Pragma("GCC unroll 5")                                                          \
    for (int r = 0; r < S; r++) {   /* R == S: square kernels only */                  \
        const int64_t ih = oh * sh->stride_h + r * sh->dil_h - sh->pad_top;            \
        if ((CHECK) && (ih < 0 || ih >= H))                                            \
            continue;                                                                  \
        const float *row = x_n + ih * W * C + c0;                                      \
        __m512 wv[CB][S];                                                              \
        _Pragma("GCC unroll 2")                                                        \
        for (int cb = 0; cb < CB; cb++)                                                \
            _Pragma("GCC unroll 8")                                                    \
            for (int s = 0; s < S; s++)                                                \
                wv[cb][s] = _mm512_loadu_ps(wb + (r * S + s) * wstep + 16 * cb);       \
        /* A running pointer, and a step the compiler cannot see through: otherwise   \
         * it hoists one offset (and mask) per pixel out of the r loop, 2 * NW + S      \
         * live values, and spills them. */                                            \
        int64_t step = C;                                                              \
        __asm__("" : "+r"(step));                                                      \
        const float *p = row + iw0 * step;                                             \
        if (!(CHECK) || inside) {                                                      \
            _Pragma("GCC unroll 64")                                                   \
            for (int q = 0; q < (NW - 1) * SW + S; q++) {                              \
                _Pragma("GCC unroll 2")                                                \
                for (int cb = 0; cb < CB; cb++) {                                      \
                    __m512 v = _mm512_loadu_ps(p + 16 * cb);                           \
                    __asm__("" : "+v"(v));   /* one load, not one folded per FMA */   \
                    DW_FAST_TAPS(NW, S, SW, q, v, cb);                                 \
                }                                                                      \
                p += step;                                                             \
            }                                                                          \
        } else {                                                                       \
            int64_t iw = iw0;                                                          \
            __asm__("" : "+r"(iw));                                                    \
            _Pragma("GCC unroll 64")                                                   \
            for (int q = 0; q < (NW - 1) * SW + S; q++) {                              \
                const int ok = (uint64_t)iw < (uint64_t)W;                             \
                _Pragma("GCC unroll 2")                                                \
                for (int cb = 0; cb < CB; cb++) {                                      \
                    __m512 v = _mm512_maskz_loadu_ps(                                  \
                        ok ? (__mmask16)0xFFFF : (__mmask16)0, ok ? p + 16 * cb : row); \
                    __asm__("" : "+v"(v));                                             \
                    DW_FAST_TAPS(NW, S, SW, q, v, cb);                                 \
                }                                                                      \
                p += step;                                                             \
                iw++;                                                                  \
            }                                                                          \
        }                                                                              \
    }

#define DW_FAST(NW, S, SW, CB)                                                         \
static __attribute__((noinline)) void                                                  \
dw_fast_##NW##_##S##_##SW##_##CB(const ttile_conv_shape *sh, const float *x_n,         \
                                 const float *w, float *y_row, int64_t oh, int64_t ow0,\
                                 int64_t c0, const ttile_epilogue *ep, __mmask16 m0,   \
                                 int64_t ngroups)                                      \
{                                                                                      \
    const int64_t H = sh->h, W = sh->w, C = sh->groups;                                \
    const int64_t iw0 = ow0 * SW - sh->pad_left;                                       \
    const int inside = iw0 >= 0 && iw0 + (NW - 1) * SW + S - 1 < W;                    \
    const int64_t ih0 = oh * sh->stride_h - sh->pad_top;                               \
    const int rows_inside = ih0 >= 0 && ih0 + (S - 1) * sh->dil_h < H;                 \
    for (int64_t g = 0; g < ngroups; g++) {                                            \
    __m512 acc[CB][NW];                                                                \
    _Pragma("GCC unroll 2")                                                            \
    for (int cb = 0; cb < CB; cb++)                                                    \
        _Pragma("GCC unroll 64")                                                       \
        for (int j = 0; j < NW; j++)                                                   \
            acc[cb][j] = _mm512_setzero_ps();                                          \
    /* the weights' step hidden too (their 2S addresses were computed up front) */     \
    int64_t wstep = C;                                                                 \
    __asm__("" : "+r"(wstep));                                                         \
    const float *wb = w + c0;                                                          \
    if (inside && rows_inside)                                                         \
        DW_FAST_ROWS(NW, S, SW, CB, 0)                                                 \
    else                                                                               \
        DW_FAST_ROWS(NW, S, SW, CB, 1)                                                 \
    /* Running pointers with a step the compiler cannot see through, as for the loads: \
     * with (ow0 + j) * C it computed all NW output (and residual) addresses before the  \
     * first FMA and kept them on the stack, ~170 instructions a call: the pair kernel  \
     * on C=32 112x112 took 1.35x the time of the same loop without them (Zen 4). */    \
    int64_t ystep = C;                                                                 \
    __asm__("" : "+r"(ystep));                                                         \
    _Pragma("GCC unroll 2")                                                            \
    for (int cb = 0; cb < CB; cb++) {                                                  \
        if (ep != NULL) {                                                              \
            const __m512 bias = ep->bias ? _mm512_loadu_ps(ep->bias + c0 + 16 * cb)    \
                                         : _mm512_setzero_ps();                        \
            const float *res = ep->residual ? ep->residual + ow0 * C + c0 + 16 * cb    \
                                            : NULL;                                    \
            _Pragma("GCC unroll 64")                                                   \
            for (int j = 0; j < NW; j++) {                                             \
                acc[cb][j] = dw_epilogue(ep, acc[cb][j], bias, res, (__mmask16)0xFFFF);\
                if (res != NULL)                                                       \
                    res += ystep;                                                      \
            }                                                                          \
        }                                                                              \
        float *yp = y_row + ow0 * C + c0 + 16 * cb;                                    \
        _Pragma("GCC unroll 64")                                                       \
        for (int j = 0; j < NW; j++) {                                                 \
            if (j == 0 && cb == 0 && m0 != (__mmask16)0xFFFF)                          \
                _mm512_mask_storeu_ps(yp, m0, acc[0][0]);                              \
            else                                                                       \
                _mm512_storeu_ps(yp, acc[cb][j]);                                      \
            yp += ystep;                                                               \
        }                                                                              \
    }                                                                                  \
    c0 += 16 * CB;   /* the next group of CB vectors */                               \
    m0 = (__mmask16)0xFFFF;                                                            \
    }                                                                                  \
}

#define DW_FAST_NARROW(X, S, SW, CB) X(8, S, SW, CB) X(7, S, SW, CB) X(6, S, SW, CB)      \
    X(5, S, SW, CB) X(4, S, SW, CB) X(3, S, SW, CB) X(2, S, SW, CB) X(1, S, SW, CB)
#define DW_FAST_WIDTHS(X, S, SW, CB) X(16, S, SW, CB) X(15, S, SW, CB) X(14, S, SW, CB)  \
    X(13, S, SW, CB) X(12, S, SW, CB) X(11, S, SW, CB) X(10, S, SW, CB) X(9, S, SW, CB) \
    DW_FAST_NARROW(X, S, SW, CB)
#define DW_FAST_KINDS(X) X(3, 1) X(3, 2) X(5, 1) X(5, 2)
#define DW_FAST_DEFINE(S, SW) DW_FAST_WIDTHS(DW_FAST, S, SW, 1) DW_FAST_NARROW(DW_FAST, S, SW, 2)
DW_FAST_KINDS(DW_FAST_DEFINE)
#define DW_FAST_WIDEST 16
#define DW_FAST_PAIR_WIDEST 8

/* An input whose lines are not on channel 0 (numpy's own arrays start 16 bytes into a
 * line; NHWC with C a multiple of 16 keeps that offset at every pixel) makes every fast-
 * path load straddle two lines: 1.20-1.28x the time of the same layer on a line-aligned
 * input (MobileNetV2's C=32, C=144 s1 and C=96 s2 on a Zen 4). The fix without a copy:
 * the channel vectors follow the input's lines instead of channel 0. With the input
 * `off` floats into its line, vector k >= 1 of a pixel covers channels 16k - off ..
 * 16k - off + 15 (inside the pixel: the fast path above with c0 = 16k - off, only its
 * stores and the weights now straddle), and vector 0 (dw_fast0 below) covers the
 * pixel's last `off` channels in its low lanes and channels 0 .. 15 - off in its high
 * lanes: the line that starts `off` floats before the pixel. Its low lanes belong to the
 * pixel one to the left, so for output j they are tap t - 1 of the shifted pixel that is
 * tap t for the high lanes: taps 0 .. S with weights u[t] = (low: w[t - 1], high: w[t]),
 * tap 0 on the high lanes only and tap S on the low lanes only (masked FMAs: a lane of
 * a pixel outside the window is never multiplied, so an inf or NaN there stays out).
 * The result vector holds channels C - off .. C - 1 (low) and 0 .. 15 - off (high) of
 * one output pixel: two masked stores. With stride 1 along w, vector 0 can wrap instead,
 * at no extra tap: the line `off` floats before output pixel o holds output o - 1's
 * last channels and o's first ones, and the lines `off` floats before the input pixels
 * are that pair's inputs tap by tap, so dw_fast with c0 = -off and the weights and bias
 * rotated by `off` lanes computes it, stored as one vector (the block loop masks the
 * low lanes of a block's first output where the block before did not wrap, and does
 * the last channels of the last output of a row's run of wrapped blocks apart).
 * dw_fast0 took C=32 112x112 from 1.20x to 1.28x the time of an aligned input (half its
 * vectors have 4 taps of 3 and two stores); wrapping took it to 1.10x, C=144 56x56 from
 * 1.23x to 1.01x, and dw_fast0 alone C=96 112x112 s2 from 1.26x to 1.05x (Zen 4).
 * Each lane sums the same products in the same order as on an aligned input, so the
 * results are bit-identical. */
#define DW_FAST0_TAPS(NW, S, SW, q, v)                                                 \
    do {                                                                               \
        _Pragma("GCC unroll 8")                                                        \
        for (int t = 0; t <= S; t++) {                                                 \
            const int j = ((q) - t) / SW;                                              \
            if ((q) >= t && ((q) - t) % SW == 0 && j < NW) {                           \
                if (t == 0)                                                            \
                    acc[j] = _mm512_mask3_fmadd_ps(v, u[t], acc[j], hi);               \
                else if (t == S)                                                       \
                    acc[j] = _mm512_mask3_fmadd_ps(v, u[t], acc[j], lo);               \
                else                                                                   \
                    acc[j] = _mm512_fmadd_ps(v, u[t], acc[j]);                         \
            }                                                                          \
        }                                                                              \
    } while (0)

#define DW_FAST0(NW, S, SW, CB_UNUSED)                                                 \
static __attribute__((noinline)) void                                                  \
dw_fast0_##NW##_##S##_##SW(const ttile_conv_shape *sh, const float *x_n,               \
                           const float *w, float *y_row, int64_t oh, int64_t ow0,      \
                           int off, const ttile_epilogue *ep)                          \
{                                                                                      \
    const int64_t C = sh->groups;                                                      \
    const __mmask16 hi = (__mmask16)(0xFFFFu << off), lo = (__mmask16)~hi;             \
    const int64_t iw0 = ow0 * SW - sh->pad_left;                                       \
    __m512 acc[NW];                                                                    \
    _Pragma("GCC unroll 64")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        acc[j] = _mm512_setzero_ps();                                                  \
    _Pragma("GCC unroll 5")                                                          \
    for (int r = 0; r < S; r++) {   /* R == S: square kernels only */                  \
        const int64_t ih = oh * sh->stride_h + r * sh->dil_h - sh->pad_top;            \
        if (ih < 0 || ih >= sh->h)                                                     \
            continue;                                                                  \
        const float *wr = w + r * S * C;                                               \
        __m512 u[S + 1];                                                               \
        u[0] = _mm512_maskz_loadu_ps(hi, wr - off);                                    \
        _Pragma("GCC unroll 8")                                                        \
        for (int t = 1; t < S; t++)   /* (R, S, C): tap t - 1's last channels first */ \
            u[t] = _mm512_loadu_ps(wr + t * C - off);                                  \
        u[S] = _mm512_maskz_loadu_ps(lo, wr + S * C - off);                            \
        int64_t step = C;                                                              \
        __asm__("" : "+r"(step));                                                      \
        const float *p = x_n + ih * sh->w * C + iw0 * step - off;                      \
        _Pragma("GCC unroll 64")                                                       \
        for (int q = 0; q <= (NW - 1) * SW + S; q++) {                                 \
            __m512 v = q == 0 ? _mm512_maskz_loadu_ps(hi, p)                           \
                     : q == (NW - 1) * SW + S ? _mm512_maskz_loadu_ps(lo, p)           \
                     : _mm512_loadu_ps(p);                                             \
            __asm__("" : "+v"(v));                                                     \
            DW_FAST0_TAPS(NW, S, SW, q, v);                                            \
            p += step;                                                                 \
        }                                                                              \
    }                                                                                  \
    if (ep != NULL) {                                                                  \
        __m512 bias = _mm512_setzero_ps();                                             \
        if (ep->bias)                                                                  \
            bias = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(hi, ep->bias - off), lo, \
                                        ep->bias + C - off);                           \
        _Pragma("GCC unroll 64")                                                       \
        for (int j = 0; j < NW; j++) {                                                 \
            __m512 v = _mm512_add_ps(acc[j], bias);                                    \
            if (ep->residual) {                                                        \
                const float *res = ep->residual + (ow0 + j) * C - off;                 \
                v = _mm512_add_ps(v, _mm512_mask_loadu_ps(                             \
                        _mm512_maskz_loadu_ps(hi, res), lo, res + C));                 \
            }                                                                          \
            acc[j] = dw_epilogue(ep, v, _mm512_setzero_ps(), NULL, 0);                 \
        }                                                                              \
    }                                                                                  \
    _Pragma("GCC unroll 64")                                                           \
    for (int j = 0; j < NW; j++) {                                                     \
        _mm512_mask_storeu_ps(y_row + (ow0 + j) * C - off, hi, acc[j]);                \
        _mm512_mask_storeu_ps(y_row + (ow0 + j) * C + C - off, lo, acc[j]);            \
    }                                                                                  \
}

#define DW_FAST0_DEFINE(S, SW) DW_FAST_WIDTHS(DW_FAST0, S, SW, 0)
DW_FAST_KINDS(DW_FAST0_DEFINE)

#define DW_FAST_CASE(NW, S, SW, CB)                                                    \
    case NW:                                                                           \
        dw_fast_##NW##_##S##_##SW##_##CB(sh, x_n, wf, y_row, oh, ow0_f, c0, fast_ep,   \
                                         o == 0 ? m0 : full, groups);                  \
        break;
/* One block of nw_f outputs from ow0_f over one channel vector, or two with pair. */
#define DW_FAST_KIND_CASE(S, SW)                                                       \
    case S * 16 + SW:                                                                  \
        if (pair) {                                                                    \
            switch (nw_f) { DW_FAST_NARROW(DW_FAST_CASE, S, SW, 2) }                   \
        } else {                                                                       \
            switch (nw_f) { DW_FAST_WIDTHS(DW_FAST_CASE, S, SW, 1) }                   \
        }                                                                              \
        break;

#define DW_FAST0_CASE(NW, S, SW, CB_UNUSED)                                            \
    case NW:                                                                           \
        dw_fast0_##NW##_##S##_##SW(sh, x_n, w, y_row, oh, ow0, off, row_ep);           \
        break;
/* Vector 0 of a block of nw <= DW_FAST_WIDEST outputs on an input off its lines. */
#define DW_FAST0_KIND_CASE(S, SW)                                                      \
    case S * 16 + SW:                                                                  \
        switch (nw) { DW_FAST_WIDTHS(DW_FAST0_CASE, S, SW, 0) }                        \
        break;

#define DW_CASE(NW)                                                                    \
    case NW:                                                                           \
        dw_block_##NW(sh, x_n, w, y_row, oh, ow0_, c0, m, row_ep);                     \
        break;
#define DW_BLOCK_CALL(nw_, ow0_value)                                                  \
    do {                                                                               \
        const int64_t ow0_ = (ow0_value);                                              \
        switch (nw_) {                                                                 \
        DW_CASE(12) DW_CASE(11) DW_CASE(10) DW_CASE(9) DW_CASE(8) DW_CASE(7)           \
        DW_CASE(6) DW_CASE(5) DW_CASE(4) DW_CASE(3) DW_CASE(2) DW_CASE(1)              \
        }                                                                              \
    } while (0)

void ttile_conv_depthwise_avx512(const ttile_conv_shape *sh, const float *x,
                                 const float *w, float *y, int nthreads,
                                 const ttile_epilogue *ep)
{
    const int64_t N = sh->n, C = sh->groups, HO = sh->ho, WO = sh->wo;
    const int64_t cvecs = (C + 15) / 16;
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    /* The fast path's kind (S * 16 + stride), or 0 for the general blocks. */
    const int fast = (sh->dil_w == 1 && sh->r == sh->s && (sh->s == 3 || sh->s == 5)
                      && (sh->stride_w == 1 || sh->stride_w == 2))
                     ? (int)(sh->s * 16 + sh->stride_w) : 0;
    /* How far the input's lines are from channel 0, in floats: the same at every pixel
     * when C is a multiple of 16 (see dw_fast0). Rows of one fast-path block keep the
     * plain channel vectors (their block checks each pixel against the padding): split
     * into edges and an inner block that follows the lines, C=384 14x14 took 1.34x and
     * C=960 7x7 1.55x the time of the aligned input, against 1.15x and 1.10x as they are. */
    const int off = (int)(((uintptr_t)x % 64) / sizeof(float));
    const int lines = fast && off != 0 && C % 16 == 0 && WO > DW_FAST_WIDEST;
    /* Columns along w: the left and right edges (outputs whose taps reach into the
     * padding) in chunks of up to DW_WIDEST, run by the checked code; between them, the
     * outputs whose taps all read inside the input, in blocks of nearly equal width
     * (17 -> 9 + 8) that skip the checks. A row no wider than one fast-path block stays
     * one block with checks. */
    const int64_t SW = sh->stride_w, PL = sh->pad_left, reach = (sh->s - 1) * sh->dil_w;
    int64_t left = (PL + SW - 1) / SW;
    if (left > WO)
        left = WO;
    if (fast && WO <= DW_FAST_WIDEST && !lines)
        left = 0;   /* one block with checks beats three small ones */
    int64_t last = sh->w - 1 + PL - reach;   /* last inside column is last / SW */
    last = last < 0 ? -1 : last / SW;
    if (last > WO - 1 || (fast && WO <= DW_FAST_WIDEST && !lines))
        last = WO - 1;
    const int64_t inner = last >= left ? last - left + 1 : 0;
    const int64_t right = WO - left - inner;
    const int64_t widest = fast ? DW_FAST_WIDEST : DW_WIDEST;
    const int64_t lchunks = (left + DW_WIDEST - 1) / DW_WIDEST;
    const int64_t rchunks = (right + DW_WIDEST - 1) / DW_WIDEST;
    const int64_t iblocks = (inner + widest - 1) / widest;
    const int64_t nblocks = lchunks + iblocks + rchunks;
    const int64_t base = iblocks ? inner / iblocks : 0, wider = iblocks ? inner % iblocks : 0;

    /* Row by row: tasks are (image, band of output rows, range of channel vectors), one
     * band per thread (so each thread's rows are contiguous), the channels split only
     * when there are fewer image-bands than threads. Within a task, each output row runs
     * its blocks along w in order, each over the task's channel vectors: the input rows it
     * reads and the output row it writes are walked from end to end, streams the
     * hardware prefetchers follow, and the next output row finds the input rows it shares
     * with this one in L1/L2. Measured on a Zen 4 core inside MobileNetV2 (the input just
     * written by the layer before, mostly not in L2): 1.5-1.9x faster than running each
     * block column down the whole image (which read short row segments a row apart), and
     * the same with the caches warm. */
    int64_t bands = nthreads == 1 ? 1 : ((int64_t)nthreads + N - 1) / N;
    if (bands > HO)
        bands = HO;
    int64_t cparts = 1;
    if (N * bands < (int64_t)nthreads) {
        cparts = ((int64_t)nthreads + N * bands - 1) / (N * bands);
        if (cparts > cvecs)
            cparts = cvecs;
    }
    /* Stride 1 along w: vector 0 of a pixel wraps instead (see the block loop), with the
     * weights and bias rotated by off lanes, here once per call: ws[t * C + i] is tap t's
     * weight of channel i - off (mod C), and the wrapped blocks read all their vectors
     * from ws + off (vector k >= 1 from channel 16k - off: the weights as they are).
     * Without the memory, vector 0 runs dw_fast0 everywhere. */
    float *ws = NULL;
    if (lines && sh->stride_w == 1)
        ws = malloc((size_t)(sh->r * sh->s + 1) * (size_t)C * sizeof(float));
    const int wraps = ws != NULL;
    float *bs = ws != NULL ? ws + sh->r * sh->s * C : NULL;
    if (wraps) {   /* each row rotated by two copies (no division per weight) */
        for (int64_t t = 0; t < sh->r * sh->s; t++) {
            memcpy(ws + t * C, w + t * C + C - off, (size_t)off * sizeof(float));
            memcpy(ws + t * C + off, w + t * C, (size_t)(C - off) * sizeof(float));
        }
        if (ep != NULL && ep->bias != NULL) {
            memcpy(bs, ep->bias + C - off, (size_t)off * sizeof(float));
            memcpy(bs + off, ep->bias, (size_t)(C - off) * sizeof(float));
        }
    }
    const __mmask16 full = (__mmask16)0xFFFF;
    /* Prefetching the next row (see the row loop) pays only for an image that does not
     * sit in L2 already; for the small ones it adds one instruction per line to the load
     * ports (C=960 7x7: 840 per row against 1620 loads) and gains nothing. */
    const int prefetch = cparts == 1 && sh->h * sh->w * C * 4 > ((int64_t)1 << 20);
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
                    /* The input rows the next output row of the task reads and this one
                     * does not, prefetched into L2 in even shares before each block
                     * (below). Without it, an input that does not fit in L2 came from
                     * L3 or memory at the pace of the block loads: each channel pass
                     * reads one or two vectors of every pixel, a stride of 4C bytes
                     * that the hardware prefetchers do not follow. The next output
                     * row's lines are prefetched too (into L1, before the stores that
                     * would each wait for their line). Only for inputs over 1 MiB (see
                     * prefetch). Measured in the benchmark's shuffled rounds on a Zen 4
                     * core (MobileNetV2, 1 thread, prefetching / not): 0.82-0.87 with
                     * the caches cold (C=32 112x112, C=96 112x112 s2, C=144 56x56),
                     * 0.94-1.00 warm. (Rotating rounds, the variant always right after
                     * the base, measured 0.39-0.62: an artefact of the order.) */
                    const char *pf = NULL;
                    int64_t pf_lines = 0;
                    if (prefetch && oh + 1 < oh_hi) {
                        const int64_t reach_h = (sh->r - 1) * sh->dil_h;
                        const int64_t first_next = (oh + 1) * sh->stride_h - sh->pad_top;
                        const int64_t last_this = first_next - sh->stride_h + reach_h;
                        int64_t lo = last_this + 1 > first_next ? last_this + 1 : first_next;
                        int64_t hi = first_next + reach_h + 1;   /* exclusive */
                        lo = lo < 0 ? 0 : lo;
                        hi = hi > sh->h ? sh->h : hi;
                        if (hi > lo) {
                            pf = (const char *)(x_n + lo * sh->w * C);
                            pf_lines = ((hi - lo) * sh->w * C * 4 + 63) / 64;
                        }
                    }
                    const char *pfy = (const char *)(y_row + WO * C);
                    const int64_t pfy_lines = prefetch && oh + 1 < oh_hi ? (WO * C * 4 + 63) / 64 : 0;
                    ttile_epilogue wrap_copy;   /* row_ep with the rotated bias */
                    const ttile_epilogue *wrap_ep = NULL;
                    if (row_ep != NULL) {
                        wrap_copy = shifted;
                        if (wraps && ep->bias != NULL)
                            wrap_copy.bias = bs + off;
                        wrap_ep = &wrap_copy;
                    }
                    /* The first block wraps too unless its vector 0 would reach before
                     * the input (image 0's row 0) or the residual. */
                    const int wrap_first = n > 0 || oh * sh->stride_h - sh->pad_top >= 1;
                    for (int64_t b = 0; b < nblocks; b++) {
                        for (int64_t l = pf_lines * b / nblocks; l < pf_lines * (b + 1) / nblocks; l++)
                            _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
                        for (int64_t l = pfy_lines * b / nblocks; l < pfy_lines * (b + 1) / nblocks; l++)
                            _mm_prefetch(pfy + 64 * l, _MM_HINT_T0);
                        int nw;
                        int64_t ow0;
                        if (b < lchunks) {
                            ow0 = b * DW_WIDEST;
                            nw = (int)(left - ow0 < DW_WIDEST ? left - ow0 : DW_WIDEST);
                        } else if (b < lchunks + iblocks) {
                            const int64_t i = b - lchunks;
                            nw = (int)(base + (i < wider ? 1 : 0));
                            ow0 = left + i * base + (i < wider ? i : wider);
                        } else {
                            const int64_t i = b - lchunks - iblocks;
                            ow0 = left + inner + i * DW_WIDEST;
                            nw = (int)(WO - ow0 < DW_WIDEST ? WO - ow0 : DW_WIDEST);
                        }
                        /* The blocks between the edges follow the input's lines (see
                         * dw_fast0 and dw_wrap): vector k >= 1 of each pixel from channel
                         * 16k - off; vector 0 by dw_fast0 in the first block and, with
                         * stride 1, by the wrapped vector in the others (the first of
                         * them leaves the low lanes of its first output to dw_fast0, the
                         * last has the last channels of its last output done apart). */
                        const int64_t ib = b - lchunks;
                        const int shift = lines && ib >= 0 && ib < iblocks ? off : 0;
                        const int wrap = shift && wraps && (ib > 0 || wrap_first);
                        const float *wf = wrap ? ws + off : w;
                        const ttile_epilogue *fast_ep = wrap ? wrap_ep : row_ep;
                        for (int64_t cv = cv_lo; cv < cv_hi; cv++) {
                            const int64_t c0 = cv * 16 - shift;
                            if (shift && cv == 0 && !wrap) {
                                switch (fast) { DW_FAST_KINDS(DW_FAST0_KIND_CASE) }
                                continue;
                            }
                            const __mmask16 m = C - c0 >= 16 ? full
                                                             : (__mmask16)((1u << (C - c0)) - 1u);
                            if (fast && m == full) {
                                const int wrapped = wrap && cv == 0;
                                const __mmask16 m0 = wrapped && ib == (wrap_first ? 0 : 1)
                                                     ? (__mmask16)(0xFFFFu << off) : full;
                                /* two vectors at once while two whole ones are left,
                                 * the block in parts of up to 8 outputs; one call runs
                                 * all the pairs of a part (a call per pair cost C=960
                                 * 7x7 7 %) */
                                int64_t whole = (C - c0) / 16;
                                whole = whole < cv_hi - cv ? whole : cv_hi - cv;
                                const int pair = whole >= 2;
                                const int64_t groups = pair ? whole / 2 : 1;
                                const int widest = pair ? DW_FAST_PAIR_WIDEST : DW_FAST_WIDEST;
                                for (int o = 0; o < nw; o += widest) {
                                    const int nw_f = nw - o < widest ? nw - o : widest;
                                    const int64_t ow0_f = ow0 + o;
                                    switch (fast) { DW_FAST_KINDS(DW_FAST_KIND_CASE) }
                                }
                                if (wrapped && ib == iblocks - 1)
                                    dw_block_1(sh, x_n, w, y_row, oh, ow0 + nw - 1, C - 16,
                                               (__mmask16)(0xFFFFu << (16 - off)), row_ep);
                                cv += pair ? 2 * groups - 1 : 0;
                                continue;
                            }
                            /* dw_block is at most DW_WIDEST wide; a fast-path block
                             * (up to 16) on a partial channel vector runs as two. */
                            for (int64_t o = 0; o < nw; o += DW_WIDEST) {
                                const int part = (int)(nw - o < DW_WIDEST ? nw - o : DW_WIDEST);
                                const int64_t ow0_part = ow0 + o;
                                DW_BLOCK_CALL(part, ow0_part);
                            }
                        }
                    }
                }
            }
        }
    }
    free(ws);
}
