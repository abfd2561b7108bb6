/* Depthwise convolution on AVX-512 in torch's layout (NCHW input and output, weights
 * (C, 1, R, S) as torch holds them): what an NCHW call of a depthwise layer runs, with
 * no conversion of its input, output or weights.
 *
 * In NCHW each channel is a plane of its own and a depthwise layer convolves each plane
 * with its own R x S weights, so the vector lanes go along w: 16 neighbouring outputs of
 * one row, each weight a broadcast scalar. At stride 1 tap s of the 16 outputs reads 16
 * neighbouring inputs (one unaligned load); at stride 2 it reads every other input of 32,
 * which two loads and one two-register permute (vpermt2ps) pick out. A register block is
 * DWN_ROWS output rows by up to two vectors along w: each input row the block reads is
 * loaded once per tap and feeds every output row of the block that uses it (a 3 x 3
 * stride-1 block of 4 rows reads 6 input rows for 12 row-taps). Padding and the row ends
 * are masked lanes of the loads (zeros, no access); a block whose loads all lie inside
 * the row runs a copy of the code with full masks (plain loads). The common kinds
 * (3 x 3 and 5 x 5, stride 1 or 2, no dilation) are compiled with their sizes as
 * constants, so the tap loops unroll and the weights of a 3 x 3 plane stay in registers;
 * other sizes, dilations and row strides run the same code with run-time sizes. Column
 * strides above 2 are not served here (the caller converts to NHWC instead). The
 * epilogue (bias, NCHW residual, activation) is applied to each stored row while it is
 * in L1. */
#include <immintrin.h>
#include "ttile_runtime.h"

#define DWN_ROWS 4   /* output rows per register block */
#define DWN_VECS 2   /* 16-output vectors per register block along w */

/* Lanes l of a 16-float load at row offset lo that lie inside [0, W). */
static inline __mmask16 dwn_range_mask(int64_t lo, int64_t W)
{
    int64_t first = lo < 0 ? -lo : 0, end = W - lo;
    if (end > 16)
        end = 16;
    if (first >= end)
        return 0;
    return (__mmask16)(((1u << end) - 1u) & ~((1u << first) - 1u));
}

/* The 16 inputs tap s of outputs ow0 .. ow0 + 15 reads from row `row`: at stride 1 one
 * load, at stride 2 the even lanes of two (masks m0, m1 from dwn_col_masks). */
static inline __attribute__((always_inline)) __m512
dwn_load(const float *row, int64_t base, const int SW, __mmask16 m0, __mmask16 m1,
         const int full)
{
    if (SW == 1)
        return full ? _mm512_loadu_ps(row + base) : _mm512_maskz_loadu_ps(m0, row + base);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16,
                                          14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 a = full ? _mm512_loadu_ps(row + base) : _mm512_maskz_loadu_ps(m0, row + base);
    const __m512 b = full ? _mm512_loadu_ps(row + base + 16)
                          : _mm512_maskz_loadu_ps(m1, row + base + 16);
    return _mm512_permutex2var_ps(a, even, b);
}

#define DWN_BLOCK dwn_block_fixed
#define DWN_PLANE dwn_plane_fixed
#define DWN_TAP_ROWS_UNROLL _Pragma("GCC unroll 16")
#define DWN_TAP_COLUMNS_UNROLL _Pragma("GCC unroll 8")
#include "depthwise_nchw_block.inc"
#undef DWN_BLOCK
#undef DWN_PLANE
#undef DWN_TAP_ROWS_UNROLL
#undef DWN_TAP_COLUMNS_UNROLL
#define DWN_BLOCK dwn_block_any
#define DWN_PLANE dwn_plane_any_sizes
#define DWN_TAP_ROWS_UNROLL _Pragma("GCC unroll 1")
#define DWN_TAP_COLUMNS_UNROLL _Pragma("GCC unroll 8")
#include "depthwise_nchw_block.inc"


/* One function per compiled kind: R x S taps, stride SH x SW, no dilation. */
#define DWN_KIND(R_, S_, ST_)                                                          \
static void dwn_plane_##R_##x##S_##_s##ST_(const float *xp, const float *wk, float *yp,\
        int64_t H, int64_t W, int64_t HO, int64_t WO, int64_t oh_lo, int64_t oh_hi,    \
        int64_t PT, int64_t PL, const ttile_epilogue *ep, const float *res_plane,      \
        int64_t channel)                                                               \
{                                                                                      \
    dwn_plane_fixed(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, R_, S_, ST_, ST_, 1, 1, PT, \
                    PL, ep, res_plane, channel);                                       \
}
DWN_KIND(3, 3, 1) DWN_KIND(3, 3, 2) DWN_KIND(5, 5, 1) DWN_KIND(5, 5, 2)

/* Any other size, row stride and dilation (column stride 1 or 2; at most 8 taps along
 * w, the masks' room). */
static void dwn_plane_any(const float *xp, const float *wk, float *yp, int64_t H,
                          int64_t W, int64_t HO, int64_t WO, int64_t oh_lo, int64_t oh_hi,
                          int R, int S, int SH, int SW, int DH, int DW, int64_t PT,
                          int64_t PL, const ttile_epilogue *ep, const float *res_plane,
                          int64_t channel)
{
    if (SW == 1)
        dwn_plane_any_sizes(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, R, S, SH, 1, DH, DW, PT,
                            PL, ep, res_plane, channel);
    else
        dwn_plane_any_sizes(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, R, S, SH, 2, DH, DW, PT,
                            PL, ep, res_plane, channel);
}

int ttile_depthwise_nchw_supported(const ttile_conv_shape *sh)
{
    return (sh->stride_w == 1 || sh->stride_w == 2) && sh->s <= 8 && sh->c == 1
           && sh->k == 1;
}

int ttile_conv_depthwise_nchw_avx512(const ttile_conv_shape *sh, const float *x,
                                     const float *w, float *y, int nthreads,
                                     const ttile_epilogue *ep)
{
    if (!ttile_depthwise_nchw_supported(sh))
        return -1;
    const int64_t N = sh->n, C = sh->groups, H = sh->h, W = sh->w;
    const int64_t HO = sh->ho, WO = sh->wo, R = sh->r, S = sh->s;
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    const int kind = (sh->dil_h == 1 && sh->dil_w == 1 && R == S
                      && sh->stride_h == sh->stride_w && (R == 3 || R == 5))
                     ? (int)(R * 16 + sh->stride_w) : 0;
    /* Tasks: (image, channel, band of output rows); bands only when there are too few
     * planes to give every thread several. */
    const int64_t planes = N * C;
    int64_t bands = (4 * (int64_t)nthreads + planes - 1) / planes;
    const int64_t max_bands = (HO + DWN_ROWS - 1) / DWN_ROWS;
    if (nthreads == 1 || bands < 1)
        bands = 1;
    if (bands > max_bands)
        bands = max_bands;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t task = 0; task < planes * bands; task++) {
        const int64_t plane = task / bands, band = task % bands;
        const int64_t channel = plane % C;
        /* band edges on multiples of DWN_ROWS, so blocks stay whole */
        const int64_t blocks = max_bands;
        const int64_t oh_lo = blocks * band / bands * DWN_ROWS;
        int64_t oh_hi = blocks * (band + 1) / bands * DWN_ROWS;
        if (oh_hi > HO)
            oh_hi = HO;
        const float *xp = x + plane * H * W;
        const float *wk = w + channel * R * S;
        float *yp = y + plane * HO * WO;
        const float *res_plane = ep != NULL && ep->residual ? ep->residual + plane * HO * WO
                                                            : NULL;
        switch (kind) {
        case 3 * 16 + 1:
            dwn_plane_3x3_s1(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, sh->pad_top,
                             sh->pad_left, ep, res_plane, channel);
            break;
        case 3 * 16 + 2:
            dwn_plane_3x3_s2(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, sh->pad_top,
                             sh->pad_left, ep, res_plane, channel);
            break;
        case 5 * 16 + 1:
            dwn_plane_5x5_s1(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, sh->pad_top,
                             sh->pad_left, ep, res_plane, channel);
            break;
        case 5 * 16 + 2:
            dwn_plane_5x5_s2(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, sh->pad_top,
                             sh->pad_left, ep, res_plane, channel);
            break;
        default:
            dwn_plane_any(xp, wk, yp, H, W, HO, WO, oh_lo, oh_hi, (int)R, (int)S,
                          (int)sh->stride_h, (int)sh->stride_w, (int)sh->dil_h,
                          (int)sh->dil_w, sh->pad_top, sh->pad_left, ep, res_plane, channel);
        }
    }
    return 0;
}
