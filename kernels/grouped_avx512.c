/* Grouped convolutions with few channels per group (ResNeXt's 3x3 layers: 32 groups of
 * 4, 8 or 16 channels), NHWC, AVX-512F.
 *
 * The generic kernel puts one group's output channels in the vector lanes: with 4 of
 * them, 12 of 16 lanes idle, and the group loop's overhead on top (ResNeXt-50's first
 * grouped layer ran at 3 GFLOP/s on a Xeon model 207 core, torch's at 8). Here the 16
 * lanes hold 16 consecutive output channels of 16 / cg groups at once, every lane useful:
 * each group's cg input channels lie in the same 16-channel block of the input pixel
 * (cg == kg), so reduction step j is one load of that block and one vpermps putting
 * input channel j of each lane's group in the lane, then one FMA with weight j of each
 * output channel. With 16 channels per group (one group a vector) the permutation is a
 * broadcast, loaded straight from memory.
 *
 * Weights: (K/16, R, S, cg * 16), each block of 16 output channels' taps and steps
 * contiguous (runtime/packing.py's grouped_weights), a step's 16 weights one vector. A
 * pixel block of up to 8 outputs along a row (6 with 8 channels a group) shares each
 * weight vector: its accumulators, inputs, the permutation indices and one weight
 * vector fit the 32 registers, with no spill. */
#include <immintrin.h>
#include <stdint.h>

#include "ttile_runtime.h"

int ttile_grouped_lanes_supported(int64_t c, int64_t k, int64_t groups)
{
    return c == k && (c == 2 || c == 4 || c == 8 || c == 16) && (c * groups) % 16 == 0;
}

static const float zeros16[16] __attribute__((aligned(64)));

/* np output pixels (ow0 ..) of row oh, channel block b (16 output channels), cg
 * channels per group: the accumulation over every tap and step, then the epilogue.
 * EDGE: some of the pixels' taps fall in the left or right padding (each input pixel's
 * address checked, the padding read from a zero vector); else the np inputs of a tap
 * are np pixel strides apart, with no check. */
#define GROUPED_BLOCK(NAME, CG, NP, EDGE)                                                \
    static inline __attribute__((always_inline)) void NAME(                              \
        const ttile_conv_shape *sh, const float *x, const float *w, float *y,          \
        const ttile_epilogue *ep, int64_t n, int64_t oh, int64_t ow0, int64_t b,          \
        const __m512i *idx)                                                              \
    {                                                                                     \
        const int64_t C = sh->c * sh->groups, K = sh->k * sh->groups;                   \
        const int64_t pstride = sh->stride_w * C;                                         \
        __m512 acc[NP];                                                                   \
        _Pragma("GCC unroll 8") for (int p = 0; p < NP; p++)                            \
            acc[p] = _mm512_setzero_ps();                                                 \
        for (int64_t r = 0; r < sh->r; r++) {                                             \
            const int64_t ih = oh * sh->stride_h + r * sh->dil_h - sh->pad_top;          \
            if (ih < 0 || ih >= sh->h)                                                    \
                continue;                                                                 \
            const float *xrow = x + ((n * sh->h + ih) * sh->w) * C + 16 * b;            \
            for (int64_t s = 0; s < sh->s; s++) {                                         \
                const int64_t iw0 = ow0 * sh->stride_w + s * sh->dil_w - sh->pad_left;   \
                const float *x0 = xrow + iw0 * C;                                         \
                const float *src[NP];                                                     \
                _Pragma("GCC unroll 8") for (int p = 0; p < NP; p++) {                  \
                    const int64_t iw = iw0 + p * sh->stride_w;                            \
                    src[p] = !EDGE || (iw >= 0 && iw < sh->w) ? x0 + p * pstride        \
                                                               : zeros16;                 \
                }                                                                         \
                const float *wv = w + ((b * sh->r + r) * sh->s + s) * CG * 16;            \
                if (CG == 16) {                                                           \
                    _Pragma("GCC unroll 2") for (int j = 0; j < CG; j++) {              \
                        const __m512 wj = _mm512_loadu_ps(wv + j * 16);                    \
                        _Pragma("GCC unroll 8") for (int p = 0; p < NP; p++)          \
                            acc[p] = _mm512_fmadd_ps(_mm512_set1_ps(src[p][j]), wj,       \
                                                     acc[p]);                             \
                    }                                                                     \
                } else {                                                                  \
                    __m512 xv[NP];                                                        \
                    _Pragma("GCC unroll 8") for (int p = 0; p < NP; p++)              \
                        xv[p] = _mm512_loadu_ps(src[p]);                                  \
                    _Pragma("GCC unroll 16") for (int j = 0; j < CG; j++) {             \
                        const __m512 wj = _mm512_loadu_ps(wv + j * 16);                    \
                        _Pragma("GCC unroll 8") for (int p = 0; p < NP; p++)          \
                            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx[j], xv[p]), \
                                                     wj, acc[p]);                         \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        _Pragma("GCC unroll 8") for (int p = 0; p < NP; p++) {                          \
            const int64_t at = ((n * sh->ho + oh) * sh->wo + ow0 + p) * K + 16 * b;      \
            ttile_epilogue_store512(ep, y, at, 16 * b, (__mmask16)0xFFFF, acc[p]);        \
        }                                                                                 \
    }

/* A row of outputs in blocks of MAIN pixels, then 4, 2 and 1 (MAIN: 8, or 6 with 8
 * channels a group, whose 8 permutation indices take 8 more registers), each block
 * unchecked where none of its taps reads the padding. */
#define GROUPED_FAMILY(CG, MAIN)                                                         \
    GROUPED_BLOCK(block##CG##_main, CG, MAIN, 0)                                          \
    GROUPED_BLOCK(block##CG##_main_edge, CG, MAIN, 1)                                     \
    GROUPED_BLOCK(block##CG##_4, CG, 4, 1)                                                \
    GROUPED_BLOCK(block##CG##_2, CG, 2, 1)                                                \
    GROUPED_BLOCK(block##CG##_1, CG, 1, 1)                                                \
    static void row##CG(const ttile_conv_shape *sh, const float *x, const float *w,       \
                        float *y, const ttile_epilogue *ep, int64_t n, int64_t oh,        \
                        int64_t b, const __m512i *idx)                                    \
    {                                                                                     \
        int64_t ow = 0;                                                                   \
        for (; ow + MAIN <= sh->wo; ow += MAIN) {                                         \
            const int64_t first = ow * sh->stride_w - sh->pad_left;                      \
            const int64_t last = (ow + MAIN - 1) * sh->stride_w + (sh->s - 1) * sh->dil_w \
                               - sh->pad_left;                                            \
            if (first >= 0 && last < sh->w)                                               \
                block##CG##_main(sh, x, w, y, ep, n, oh, ow, b, idx);                     \
            else                                                                          \
                block##CG##_main_edge(sh, x, w, y, ep, n, oh, ow, b, idx);                \
        }                                                                                 \
        if (ow + 4 <= sh->wo) {                                                           \
            block##CG##_4(sh, x, w, y, ep, n, oh, ow, b, idx);                            \
            ow += 4;                                                                      \
        }                                                                                 \
        if (ow + 2 <= sh->wo) {                                                           \
            block##CG##_2(sh, x, w, y, ep, n, oh, ow, b, idx);                            \
            ow += 2;                                                                      \
        }                                                                                 \
        if (ow < sh->wo)                                                                  \
            block##CG##_1(sh, x, w, y, ep, n, oh, ow, b, idx);                            \
    }

GROUPED_FAMILY(2, 8)
GROUPED_FAMILY(4, 8)
GROUPED_FAMILY(8, 6)
GROUPED_FAMILY(16, 8)

typedef void (*grouped_row_fn)(const ttile_conv_shape *, const float *, const float *,
                               float *, const ttile_epilogue *, int64_t, int64_t, int64_t,
                               const __m512i *);

int ttile_conv_grouped_avx512(const ttile_conv_shape *sh, const float *x, const float *w,
                              float *y, int nthreads, const ttile_epilogue *ep)
{
    if (!ttile_grouped_lanes_supported(sh->c, sh->k, sh->groups))
        return -1;
    const ttile_epilogue none = {0, 0, TTILE_ACT_NONE, 0.0f};
    if (ep == 0)
        ep = &none;
    const int64_t cg = sh->c;
    const grouped_row_fn row = cg == 2 ? row2 : cg == 4 ? row4 : cg == 8 ? row8 : row16;
    /* lane l of step j reads input channel j of its group: (l / cg) * cg + j */
    __m512i idx[16];
    for (int64_t j = 0; j < cg && cg < 16; j++) {
        int32_t lanes[16];
        for (int l = 0; l < 16; l++)
            lanes[l] = (int32_t)((l / cg) * cg + j);
        idx[j] = _mm512_loadu_si512(lanes);
    }
    const int64_t blocks = sh->k * sh->groups / 16, rows = sh->n * sh->ho;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) \
    if (nthreads > 1)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t b = 0; b < blocks; b++)
            row(sh, x, w, y, ep, i / sh->ho, i % sh->ho, b, idx);
    return 0;
}
