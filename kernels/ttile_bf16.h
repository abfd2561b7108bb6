/* The bf16 kernels' formats: what `precision="bf16"` computes, and the packed input and
 * weights every bf16 kernel (AMX tiles, AVX512_BF16 dot products) reads.
 *
 * Semantics (OpenVINO's and torch autocast's): inputs and weights rounded to bf16
 * (round to nearest even, as ml_dtypes and torch round), products accumulated in fp32,
 * the epilogue (bias, residual, activation) applied in fp32 before the store; the output
 * is stored as fp32, or rounded to bf16 for a network that keeps its activations in bf16
 * (the AMX kernel's bf16 stores flush results below 2^-126 in magnitude to zero:
 * bf16_amx.c).
 *
 * Packed input: the images in NHWC with their zero padding written out, so that a kernel
 * reads every tap of every output with one address formula and no bounds test:
 *     xb[n][hp][wp][cp]   (bf16; channels c..cp-1 zero)
 * followed by `ttile_bf16_input_slack` zero elements that the last rows of a tile may
 * read (their results are discarded). cp is a multiple of the reduction chunk kc.
 *
 * Stride 2 with `phases` set: the padded image split into its phase planes, the pixels
 * of even and odd rows and columns apart,
 *     xb[n][a][b][hp][wp][cp]   plane (a, b) pixel (i, j) = padded pixel (2i + a, 2j + b)
 * for a < min(2, r) and b < min(2, s) (a 1x1 filter reads plane (0, 0) alone: the image
 * subsampled), hp and wp being a plane's extents. Tap (r, s) of output (oh, ow) is then
 * pixel (oh + r/2, ow + s/2) of plane (r%2, s%2): consecutive outputs are consecutive
 * pixels of a plane, even across output rows, so a tile's 16 rows are 16 outputs as at
 * stride 1 (ttile_bf16_tiling) instead of the outputs of one row, which left 9 of 16
 * rows empty on a 7x7 output and 2 of 16 on 14x14 and 28x28. With the planes, ResNet-50's
 * stride-2 layers took 0.43-0.69x the time on AMX for 1x1 filters (a quarter of the input
 * packed) and 0.58-1.03x for 3x3 (Xeon model 207, 1 thread, the same bits out).
 *
 * Packed weights: output channels in blocks of 16 (kp a multiple of 32, padded with
 * zeros), pairs of input channels interleaved, as AMX's B tiles and vdpbf16ps read them:
 *     wb[kp/16][r][s][cp/kc][kc/2][16][2]
 * element (kb, r, s, q, j, l, e) is w[k = 16 kb + l][c = q kc + 2 j + e][r][s]. */
#ifndef TTILE_BF16_H
#define TTILE_BF16_H

#include <stdint.h>
#include <string.h>

#include "ttile_epilogue.h"

typedef struct {
    int64_t n, ho, wo, k;        /* output extents; k real output channels (one group) */
    int64_t hp, wp, cp;          /* packed input: rows and columns with padding, channels */
    int64_t kc;                  /* the reduction chunk: input channels per step (even, <= 32) */
    int64_t kp;                  /* packed output channels: k rounded up to 32 */
    int64_t r, s;                /* filter */
    int64_t stride_h, stride_w, dil_h, dil_w;
    int64_t phases;              /* 1: stride 2 (both), dilation 1, in phase planes; else 0 */
    /* Grouped (0 and 0: dense): the groups taken a few at a time, as super-groups of gc
     * input channels and 32 gkq output channels, each a dense problem whose weights are
     * block diagonal (its groups' own, zeros between them). Channel pair kq reduces over
     * super-group kq / gkq's gc channels of the packed input, from channel
     * (kq / gkq) gc on; the weights hold gc channels per 16-channel block. */
    int64_t gc, gkq;
} ttile_bf16_problem;

/* Input channels one output channel reduces over: a super-group's, or all of them. */
static inline int64_t ttile_bf16_reduced(const ttile_bf16_problem *p)
{
    return p->gc ? p->gc : p->cp;
}

/* The phase planes a packed image holds, along rows and along columns (1 without phases). */
static inline int64_t ttile_bf16_plane_rows(const ttile_bf16_problem *p)
{
    return p->phases ? (p->r < 2 ? p->r : 2) : 1;
}

static inline int64_t ttile_bf16_plane_cols(const ttile_bf16_problem *p)
{
    return p->phases ? (p->s < 2 ? p->s : 2) : 1;
}

/* Elements of one packed image (all its planes). */
static inline int64_t ttile_bf16_image_elems(const ttile_bf16_problem *p)
{
    return ttile_bf16_plane_rows(p) * ttile_bf16_plane_cols(p) * p->hp * p->wp * p->cp;
}

/* Round to nearest even, NaN kept quiet (the bit pattern ml_dtypes gives). */
static inline uint16_t ttile_bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ttile_bf16_widen(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The zero elements after the packed images that a kernel's tiles may read past the last
 * row: a tile's rows beyond the output (up to 16 pixels at the column stride) plus the
 * widest tap offset. */
static inline int64_t ttile_bf16_input_slack(const ttile_bf16_problem *p)
{
    return (32 * p->stride_w + p->s * p->dil_w + 32) * p->cp + 64;
}

static inline int64_t ttile_bf16_input_elems(const ttile_bf16_problem *p)
{
    return p->n * ttile_bf16_image_elems(p) + ttile_bf16_input_slack(p);
}

static inline int64_t ttile_bf16_weight_elems(const ttile_bf16_problem *p)
{
    return p->kp * p->r * p->s * ttile_bf16_reduced(p);
}

/* Which output pixels a kernel's block of `width` pixels computes (AMX tiles: 16; the
 * AVX512_BF16 kernel's register blocks: fewer):
 *  - stride 1: the output taken over the packed width wp (a "virtual" row of wp pixels,
 *    of which the first wo are real), so that consecutive pixels are consecutive packed
 *    pixels even across rows: blocks run over the whole image and only wp / wo of the
 *    work is thrown away (7x7 maps: 9/7, where blocks per row of 16 would throw away 16/7);
 *  - other strides: blocks run along one output row, at the column stride.
 * Pixels of a block past the output read the slack after the packed input; their results
 * are never stored (an output pixel's sums read its own input rows only). */
typedef struct {
    int virtual_rows;         /* stride 1: blocks over the packed width */
    int64_t width;            /* pixels per block */
    int64_t blocks;           /* blocks per image */
    int64_t blocks_per_row;   /* strided: blocks along an output row */
    int64_t pixel_stride;     /* elements between a block's consecutive pixels */
} ttile_bf16_tiling;

static inline ttile_bf16_tiling ttile_bf16_tiling_of(const ttile_bf16_problem *p, int64_t width)
{
    ttile_bf16_tiling t;
    t.virtual_rows = (p->stride_h == 1 && p->stride_w == 1) || p->phases;
    t.width = width;
    t.blocks_per_row = (p->wo + width - 1) / width;
    t.blocks = t.virtual_rows ? ((p->ho - 1) * p->wp + p->wo + width - 1) / width
                              : p->ho * t.blocks_per_row;
    t.pixel_stride = (p->phases ? 1 : p->stride_w) * p->cp;
    return t;
}

/* Element offset, in an image's packed input, of block b's first pixel at tap (0, 0). */
static inline int64_t ttile_bf16_block_base(const ttile_bf16_problem *p,
                                            const ttile_bf16_tiling *t, int64_t b)
{
    if (t->virtual_rows)
        return b * t->width * p->cp;
    const int64_t oh = b / t->blocks_per_row, ow0 = (b % t->blocks_per_row) * t->width;
    return (oh * p->stride_h * p->wp + ow0 * p->stride_w) * p->cp;
}

/* The output pixel of block b's i-th row, and whether it is one (else: discarded). */
static inline int ttile_bf16_pixel(const ttile_bf16_problem *p, const ttile_bf16_tiling *t,
                                   int64_t b, int64_t i, int64_t *oh, int64_t *ow)
{
    if (t->virtual_rows) {
        const int64_t px = b * t->width + i;
        *oh = px / p->wp;
        *ow = px % p->wp;
    } else {
        *oh = b / t->blocks_per_row;
        *ow = (b % t->blocks_per_row) * t->width + i;
    }
    return *oh < p->ho && *ow < p->wo;
}

/* The tap offsets of the packed input, r-major: (r dil_h wp + s dil_w) cp, or with
 * phases, plane (r%2, s%2)'s start plus (r/2 wp + s/2) cp. */
static inline void ttile_bf16_tap_offsets(const ttile_bf16_problem *p, int64_t *off)
{
    const int64_t plane = p->hp * p->wp * p->cp, cols = ttile_bf16_plane_cols(p);
    for (int64_t r = 0; r < p->r; r++)
        for (int64_t s = 0; s < p->s; s++)
            off[r * p->s + s] = p->phases
                ? ((r % 2) * cols + s % 2) * plane + ((r / 2) * p->wp + s / 2) * p->cp
                : (r * p->dil_h * p->wp + s * p->dil_w) * p->cp;
}

/* Packing (kernels/bf16_layout.c, AVX-512F). The input: x NHWC (or NCHW when `nchw`),
 * fp32 or, with `x_bf16`, bf16 bits (NHWC only), of c channels, h x w, with pad_top rows
 * and pad_left columns of zeros before it. The weights: fp32 RSCK (k contiguous), c input
 * channels (one group). */
void ttile_bf16_pack_input(const ttile_bf16_problem *p, const void *x, int x_bf16, int nchw,
                           int64_t c, int64_t h, int64_t w, int64_t pad_top,
                           int64_t pad_left, uint16_t *xb, int nthreads);
/* The input of a layer with few channels folded: the filter's s columns of c channels
 * side by side, as the channels of one pixel per output column (cp >= s c), so that an
 * r x s filter on c channels becomes an r x 1 filter on s c channels at column stride 1
 * and the reduction chunks are full (3 channels of a 7x7 filter: 21 of 32 lanes busy, not
 * 3). `p` is the folded problem (s 1, stride_w 1, dil_w 1, wp = wo); `s`, `stride_w`
 * and `dil_w` are the layer's. Its weights are the layer's reshaped (RSCK: R, 1, S C, K). */
int ttile_bf16_pack_input_folded(const ttile_bf16_problem *p, const void *x, int x_bf16,
                                 int nchw, int64_t c, int64_t h, int64_t w, int64_t pad_top,
                                 int64_t pad_left, int64_t s, int64_t stride_w,
                                 int64_t dil_w, uint16_t *xb, int nthreads);
void ttile_bf16_pack_weights(const ttile_bf16_problem *p, const float *w, int64_t c,
                             uint16_t *wb, int nthreads);
/* fp32 -> bf16 (round to nearest even) and back, n elements. */
void ttile_bf16_from_f32(const float *src, uint16_t *dst, int64_t n, int nthreads);
void ttile_bf16_to_f32(const uint16_t *src, float *dst, int64_t n, int nthreads);
/* Whether src's n floats round to the n bf16 values of `bits` (1) or not (0). */
int ttile_bf16_same_rounded(const float *src, const uint16_t *bits, int64_t n, int nthreads);
/* fp32 -> fp32 holding the bf16-rounded values (what an fp32 kernel multiplies to compute
 * precision="bf16"), n elements; dst may be src. */
void ttile_bf16_round_f32(const float *src, float *dst, int64_t n, int nthreads);

/* The kernels: y NHWC (n, ho, wo, k), fp32 or, with `y_bf16`, bf16 (the residual then
 * bf16 too). Return 0, or -1 when the CPU (or, for AMX, the OS) refuses them: nothing
 * is written then. The AMX kernel writes, with `y_nchw`, an fp32 y (and reads an fp32
 * residual) in NCHW (n, k, ho, wo) instead: no pass of its own to convert the output. */
int ttile_conv_bf16_amx(const ttile_bf16_problem *p, const uint16_t *xb, const uint16_t *wb,
                        void *y, int y_bf16, int y_nchw, int nthreads,
                        const ttile_epilogue *ep);
/* The same on an unpacked bf16 NHWC input x (a 1x1, stride-1, unpadded layer whose c is
 * cp): read in place, nothing packed; -1 for any other layer. */
int ttile_conv_bf16_amx_unpacked(const ttile_bf16_problem *p, const uint16_t *x,
                                 const uint16_t *wb, void *y, int y_bf16, int nthreads,
                                 const ttile_epilogue *ep);
/* Seconds for `iterations` rounds of 24 independent vdpbf16ps (64 flops each) on this
 * thread (bf16_avx512.c; AVX512_BF16 CPUs only). */
double ttile_dot_bf16_peak_seconds(int64_t iterations);
/* 1 when this build has the AMX kernel (its compiler knew AMX), else 0. */
int ttile_bf16_amx_built(void);
int ttile_conv_bf16_avx512(const ttile_bf16_problem *p, const uint16_t *xb,
                           const uint16_t *wb, void *y, int y_bf16, int nthreads,
                           const ttile_epilogue *ep);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* 16 floats rounded to bf16 as ttile_bf16_round does (AVX-512F integer arithmetic: no
 * AVX512_BF16 instruction, whose conversion flushes denormals), each in the low half of
 * its 32-bit lane. */
static inline __m512i ttile_bf16_round_lanes512(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_srli_epi32(r, 16);
}

/* The same, packed into 16 bf16 values. */
static inline __m256i ttile_bf16_round512(__m512 v)
{
    return _mm512_cvtepi32_epi16(ttile_bf16_round_lanes512(v));
}

static inline __m512 ttile_bf16_widen512(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The lanes of 16 output channels from k on, of kreal (none past kreal: the packing's
 * padded blocks load zeros). */
static inline __mmask16 ttile_bf16_kmask(int64_t k, int64_t kreal)
{
    const int64_t left = kreal - k;
    return left >= 16 ? (__mmask16)0xFFFF
                      : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* 16 accumulated outputs stored through the epilogue, at element i of y (fp32 or bf16;
 * the residual has y's type), output channels k..k+15 in `mask`. */
static inline void ttile_bf16_store16(const ttile_epilogue *ep, void *y, int y_bf16,
                                      int64_t i, int64_t k, __mmask16 mask, __m512 v)
{
    if (ep->bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, ep->bias + k));
    if (ep->residual)
        v = _mm512_add_ps(v, y_bf16 ? ttile_bf16_widen512(_mm256_maskz_loadu_epi16(
                                          mask, (const uint16_t *)ep->residual + i))
                                    : _mm512_maskz_loadu_ps(mask, ep->residual + i));
    v = ttile_activate512(ep->activation, ep->negative_slope, v);
    if (y_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)y + i, mask, ttile_bf16_round512(v));
    else
        _mm512_mask_storeu_ps((float *)y + i, mask, v);
}

#if defined(__AMX_TILE__)
/* The tile configuration of the AMX kernels (bf16_amx.c, inverted_residual_amx.c): tiles
 * 0-3 accumulators (16 x 16 fp32); 4, 5 input (16 pixels x kc bf16); 6, 7 weights (kc/2
 * channel pairs x 16 output channels x 2). Loaded on the calling thread. */
static inline void ttile_amx_configure(int64_t kc)
{
    struct {
        uint8_t palette, start_row;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t < 6 ? 16 : (uint8_t)(kc / 2);
        cfg.colsb[t] = t < 4 || t >= 6 ? 64 : (uint16_t)(kc * 2);
    }
    _tile_loadconfig(&cfg);
}
#endif
#endif

#endif
