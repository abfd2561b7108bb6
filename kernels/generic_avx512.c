/* Generic AVX-512 convolution: runtime shapes, any stride and padding, K tails masked.
 *
 * The fallback for shapes with no tuned kernel. It uses one fixed register block of
 * WB outputs along w by 2 vectors of 16 along k (12 x 2 accumulators + 2 weight
 * vectors + 1 broadcast = 27 zmm registers, no spills). Padding is handled without
 * copying the input: an out-of-range input pixel is read from a zero row instead.
 *
 * The weights are packed once per call into panels w_p[K/32][R][S][C][32]. In RSCK
 * the 32 weights of one (r, s, c) step are K floats away from the next step's; with K
 * in the hundreds that is a new page per step, and the TLB misses dominated (12 % of
 * peak on Yolo9000-18 before packing). The panel is read sequentially instead, and its
 * zero-filled tail lets the weight loads go unmasked; outputs use masked stores. */
#include <immintrin.h>
#include <stdlib.h>
#include "ttile_runtime.h"

#define WB 12
#define L1_PANEL_BYTES 24576
#define L2_PANEL_BYTES 524288

static inline __attribute__((always_inline)) void
conv_block(const ttile_conv_shape *sh, const float *x_n, const float *panel, float *y_row,
           int64_t oh, int64_t ow0, const int nw, const int kv, int64_t k0,
           __mmask16 m0, __mmask16 m1, const float *zeros, int64_t c0, int64_t c1)
{
    const int64_t H = sh->h, W = sh->w, C = sh->c, K = sh->k, S = sh->s;
    const int64_t R = sh->r;
    __m512 acc0[WB], acc1[WB];
    for (int j = 0; j < nw; j++) {
        if (c0 == 0) {
            acc0[j] = _mm512_setzero_ps();
            acc1[j] = _mm512_setzero_ps();
        } else {  /* later channel chunks add to what the earlier ones stored */
            const float *yp = y_row + (ow0 + j) * K + k0;
            acc0[j] = _mm512_maskz_loadu_ps(m0, yp);
            acc1[j] = kv > 1 ? _mm512_maskz_loadu_ps(m1, yp + 16) : _mm512_setzero_ps();
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t ih = oh * sh->stride_h + r - sh->pad_top;
        if (ih < 0 || ih >= H)
            continue;
        const float *x_row = x_n + ih * W * C;
        for (int64_t s = 0; s < S; s++) {
            const float *xp[WB];
            for (int j = 0; j < nw; j++) {
                const int64_t iw = (ow0 + j) * sh->stride_w + s - sh->pad_left;
                xp[j] = (iw >= 0 && iw < W) ? x_row + iw * C : zeros;
            }
            const float *wp = panel + (r * S + s) * C * 32;
            for (int64_t c = c0; c < c1; c++) {
                const __m512 w0 = _mm512_loadu_ps(wp + c * 32);
                const __m512 w1 = kv > 1 ? _mm512_loadu_ps(wp + c * 32 + 16)
                                         : _mm512_setzero_ps();
                for (int j = 0; j < nw; j++) {
                    const __m512 b = _mm512_set1_ps(xp[j][c]);
                    acc0[j] = _mm512_fmadd_ps(b, w0, acc0[j]);
                    if (kv > 1)
                        acc1[j] = _mm512_fmadd_ps(b, w1, acc1[j]);
                }
            }
        }
    }
    for (int j = 0; j < nw; j++) {
        float *yp = y_row + (ow0 + j) * K + k0;
        _mm512_mask_storeu_ps(yp, m0, acc0[j]);
        if (kv > 1)
            _mm512_mask_storeu_ps(yp + 16, m1, acc1[j]);
    }
}

static inline __mmask16 tail_mask(int64_t remaining)
{
    if (remaining >= 16)
        return (__mmask16)0xFFFF;
    if (remaining <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << remaining) - 1u);
}

/* One call per (width, vector count) pair so that every block is fully unrolled. */
#define BLOCK_CASE(NW)                                                                 \
    case NW:                                                                           \
        if (kv == 2)                                                                   \
            conv_block(sh, x_n, panel, y_row, oh, ow0, NW, 2, k0, m0, m1, zeros, c0, c1);          \
        else                                                                           \
            conv_block(sh, x_n, panel, y_row, oh, ow0, NW, 1, k0, m0, m1, zeros, c0, c1);          \
        break;

int ttile_conv_generic_avx512(const ttile_conv_shape *sh, const float *x, const float *w,
                              float *y, int nthreads)
{
    const int64_t kchunks = (sh->k + 31) / 32;
    const int64_t rsc = sh->r * sh->s * sh->c;
    float *packed = aligned_alloc(64, (size_t)(kchunks * rsc * 32) * sizeof(float));
    if (packed == NULL)
        return -1;
    ttile_pack_weights(w, rsc, sh->k, 32, packed, nthreads);
    const int status = ttile_conv_generic_avx512_packed(sh, x, packed, y, nthreads);
    free(packed);
    return status;
}

int ttile_conv_generic_avx512_packed(const ttile_conv_shape *sh, const float *x,
                                     const float *packed, float *y, int nthreads)
{
    const int64_t N = sh->n, K = sh->k, HO = sh->ho, WO = sh->wo;
    const int64_t kchunks = (K + 31) / 32;
    const int64_t rsc = sh->r * sh->s * sh->c;
    /* Channels per chunk: the chunk's part of a panel (R*S*cchunk steps of 128 bytes)
     * fits in half of a 48 KiB L1 and is reused by every block of an output row. */
    int64_t cchunk = L1_PANEL_BYTES / (sh->r * sh->s * 128);
    cchunk = cchunk < 8 ? 8 : cchunk;
    /* A row of zeros stands in for input pixels in the padding. */
    float *zeros = calloc((size_t)sh->c + 16, sizeof(float));
    if (zeros == NULL)
        return -1;

    /* Panels are visited in groups that fit in L2, each group for every output row, so
     * a weight tensor larger than the caches is read from memory once rather than once
     * per output row (Yolo9000-23 has 115 MB of weights and 17 rows). */
    const int64_t panel_bytes = rsc * 32 * (int64_t)sizeof(float);
    const int64_t group = L2_PANEL_BYTES / panel_bytes > 1 ? L2_PANEL_BYTES / panel_bytes : 1;
    const int64_t ngroups = (kchunks + group - 1) / group;

#pragma omp parallel for collapse(3) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < ngroups; g++) {
            for (int64_t oh = 0; oh < HO; oh++) {
              const int64_t kc_end = (g + 1) * group < kchunks ? (g + 1) * group : kchunks;
              for (int64_t kc = g * group; kc < kc_end; kc++) {
                const float *x_n = x + n * sh->h * sh->w * sh->c;
                float *y_row = y + (n * HO + oh) * WO * K;
                const int64_t k0 = kc * 32;
                const float *panel = packed + kc * rsc * 32;
                const int kv = K - k0 > 16 ? 2 : 1;
                const __mmask16 m0 = tail_mask(K - k0), m1 = tail_mask(K - k0 - 16);
                /* Split the row into blocks of nearly equal width (17 -> 9 + 8, not
                 * 12 + 5) so that no block is left with too few accumulators. */
                const int64_t nblocks = (WO + WB - 1) / WB;
                const int64_t base = WO / nblocks, wider = WO % nblocks;
                for (int64_t c0 = 0; c0 < sh->c; c0 += cchunk) {
                    const int64_t c1 = c0 + cchunk < sh->c ? c0 + cchunk : sh->c;
                    int64_t ow0 = 0;
                    for (int64_t b = 0; b < nblocks; b++) {
                        const int nw = (int)(base + (b < wider ? 1 : 0));
                        switch (nw) {
                            BLOCK_CASE(12) BLOCK_CASE(11) BLOCK_CASE(10) BLOCK_CASE(9)
                            BLOCK_CASE(8) BLOCK_CASE(7) BLOCK_CASE(6) BLOCK_CASE(5)
                            BLOCK_CASE(4) BLOCK_CASE(3) BLOCK_CASE(2) BLOCK_CASE(1)
                        }
                        ow0 += nw;
                    }
                }
              }
            }
        }
    }
    free(zeros);
    return 0;
}
