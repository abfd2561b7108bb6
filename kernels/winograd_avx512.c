/* Winograd F(4x4, 3x3) convolution for AVX-512F: 3x3 filters, stride 1, no dilation,
 * one group, any padding, NHWC input and output, the epilogue fused into the store.
 *
 * Why: on a 3x3 layer the direct kernels (searched or generic) already run at 85-99 %
 * of the FMA peak, and so do oneDNN's and MLAS's; no blocking gets past that. F(4x4, 3x3)
 * computes each 4x4 output tile from a 6x6 input tile with 36 multiplications per
 * (input, output) channel pair where the direct method needs 144: 4x fewer FMAs, paid
 * for by three transforms that are additions and by a weight tensor 4x larger
 * (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016).
 *
 * The call runs in three phases over super-blocks of tiles (a super-block's transformed
 * input and products fit in a share of the last-level cache), the threads sharing each:
 *
 *   1. input transform, per tile and 16-channel vector: V[xi][t][c] = (B^T d B)[xi];
 *      pixels in the padding or past the image read a zero row;
 *   2. 36 matrix products, one per xi: M[xi][t][k] = sum_c V[xi][t][c] U[xi][c][k],
 *      in register blocks of NW tiles by KV vectors of 16 output channels (the generic
 *      kernel's blocks: 6 x 4, 8 x 3, 12 x 2, 24 x 1, no spills) over the whole reduction;
 *      U is the weights transformed once (ttile_winograd_weights_avx512), in panels
 *      U[xi][kc][c][P] of P = 16 KV output channels, zero-filled past K;
 *   3. output transform, per tile and 16-channel vector: Y = A^T M A, then
 *      act(Y + bias + residual) and a masked store of the rows and columns inside the
 *      output: the epilogue is the store, not a second pass.
 *
 * Rounding: the transforms scale values by up to 8 (A^T) and 5 (B^T), so the error is a
 * few times the direct method's; ttile checks it against the float64 reference with the
 * same tolerance as every kernel (tests/test_winograd.py). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include "ttile_runtime.h"

#define WG_XI 36     /* 6 x 6 transformed points */
#define WG_MAX_KV 4

/* Bytes of transformed input and products a super-block may hold (a share of the
 * last-level cache: each phase's output is the next one's input). */
#ifndef WG_BLOCK_BYTES
#define WG_BLOCK_BYTES ((int64_t)6 << 20)
#endif

static inline __mmask16 wg_mask(int64_t remaining)
{
    if (remaining >= 16)
        return (__mmask16)0xFFFF;
    if (remaining <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << remaining) - 1u);
}

/* The vectors per panel for K output channels: the count that wastes the fewest lanes
 * of the last panel, ties to more vectors (fewer broadcasts per FMA). */
int64_t ttile_winograd_panel_avx512(int64_t k)
{
    const int64_t vectors = (k + 15) / 16;
    int best = 1;
    double best_score = 0.0;
    for (int kv = 1; kv <= WG_MAX_KV && kv <= vectors; kv++) {
        const int64_t chunks = (vectors + kv - 1) / kv;
        const double score = (double)vectors / (double)(chunks * kv);
        if (score >= best_score) {
            best_score = score;
            best = kv;
        }
    }
    return 16 * (int64_t)best;
}

int64_t ttile_winograd_weight_floats_avx512(int64_t c, int64_t k)
{
    const int64_t p = ttile_winograd_panel_avx512(k);
    return WG_XI * ((k + p - 1) / p) * c * p;
}

/* u[0..5] = G g for one column g[0..2] of the filter (16 output channels in the lanes). */
static inline void wg_filter_column(const __m512 g0, const __m512 g1, const __m512 g2,
                                    __m512 u[6])
{
    const __m512 sixth = _mm512_set1_ps(1.0f / 6.0f);
    const __m512 even = _mm512_add_ps(g0, g2);
    u[0] = _mm512_mul_ps(g0, _mm512_set1_ps(0.25f));
    u[1] = _mm512_mul_ps(_mm512_add_ps(even, g1), _mm512_set1_ps(-1.0f / 6.0f));
    u[2] = _mm512_mul_ps(_mm512_sub_ps(even, g1), _mm512_set1_ps(-1.0f / 6.0f));
    /* g0/24 + g2/6 and g1/12 */
    const __m512 a = _mm512_fmadd_ps(g0, _mm512_set1_ps(1.0f / 24.0f),
                                     _mm512_mul_ps(g2, sixth));
    const __m512 b = _mm512_mul_ps(g1, _mm512_set1_ps(1.0f / 12.0f));
    u[3] = _mm512_add_ps(a, b);
    u[4] = _mm512_sub_ps(a, b);
    u[5] = g2;
}

/* RSCK (or, kcrs, torch's KCRS) 3x3 weights into U[36][kchunks][c][P]: U = G g G^T for
 * every (c, k), 16 output channels at a time; the tail of the last panel is zero. */
void ttile_winograd_weights_avx512(const float *w, int64_t c, int64_t k, int kcrs,
                                   float *u, int nthreads)
{
    const int64_t p = ttile_winograd_panel_avx512(k);
    const int64_t kchunks = (k + p - 1) / p;
    const int64_t kvecs = kchunks * p / 16;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t kv = 0; kv < kvecs; kv++) {
        for (int64_t ci = 0; ci < c; ci++) {
            const int64_t k0 = 16 * kv;
            const __mmask16 m = wg_mask(k - k0);
            __m512 g[3][3];
            for (int r = 0; r < 3; r++)
                for (int s = 0; s < 3; s++) {
                    if (kcrs) {
                        float lanes[16] = {0};
                        for (int l = 0; l < 16 && k0 + l < k; l++)
                            lanes[l] = w[((k0 + l) * c + ci) * 9 + r * 3 + s];
                        g[r][s] = _mm512_loadu_ps(lanes);
                    } else {
                        g[r][s] = _mm512_maskz_loadu_ps(m, w + ((r * 3 + s) * c + ci) * k + k0);
                    }
                }
            __m512 t[6][3];   /* t = G g: rows of the transformed filter's columns */
            for (int s = 0; s < 3; s++) {
                __m512 col[6];
                wg_filter_column(g[0][s], g[1][s], g[2][s], col);
                for (int i = 0; i < 6; i++)
                    t[i][s] = col[i];
            }
            const int64_t chunk = k0 / p, lane = k0 % p;
            for (int i = 0; i < 6; i++) {
                __m512 row[6];
                wg_filter_column(t[i][0], t[i][1], t[i][2], row);
                for (int j = 0; j < 6; j++) {
                    float *dst = u + (((int64_t)(i * 6 + j) * kchunks + chunk) * c + ci) * p
                                 + lane;
                    _mm512_storeu_ps(dst, row[j]);
                }
            }
        }
    }
}

/* d[0..5] -> B^T d: one dimension of the input transform. */
static inline void wg_input_1d(const __m512 d[6], __m512 o[6])
{
    const __m512 four = _mm512_set1_ps(4.0f), five = _mm512_set1_ps(5.0f);
    const __m512 two = _mm512_set1_ps(2.0f);
    const __m512 d4_4d2 = _mm512_fnmadd_ps(four, d[2], d[4]);   /* d4 - 4 d2 */
    const __m512 d3_4d1 = _mm512_fnmadd_ps(four, d[1], d[3]);   /* d3 - 4 d1 */
    const __m512 d4_d2 = _mm512_sub_ps(d[4], d[2]);
    const __m512 d3_d1 = _mm512_sub_ps(d[3], d[1]);
    o[0] = _mm512_add_ps(_mm512_fnmadd_ps(five, d[2], _mm512_mul_ps(four, d[0])), d[4]);
    o[1] = _mm512_add_ps(d4_4d2, d3_4d1);                 /* -4d1 - 4d2 + d3 + d4 */
    o[2] = _mm512_sub_ps(d4_4d2, d3_4d1);                 /*  4d1 - 4d2 - d3 + d4 */
    o[3] = _mm512_fmadd_ps(two, d3_d1, d4_d2);            /* -2d1 - d2 + 2d3 + d4 */
    o[4] = _mm512_fnmadd_ps(two, d3_d1, d4_d2);           /*  2d1 - d2 - 2d3 + d4 */
    o[5] = _mm512_add_ps(_mm512_fnmadd_ps(five, d[3], _mm512_mul_ps(four, d[1])), d[5]);
}

/* m[0..5] -> A^T m: one dimension of the output transform. */
static inline void wg_output_1d(const __m512 m[6], __m512 o[4])
{
    const __m512 s12 = _mm512_add_ps(m[1], m[2]), d12 = _mm512_sub_ps(m[1], m[2]);
    const __m512 s34 = _mm512_add_ps(m[3], m[4]), d34 = _mm512_sub_ps(m[3], m[4]);
    o[0] = _mm512_add_ps(_mm512_add_ps(m[0], s12), s34);
    o[1] = _mm512_fmadd_ps(_mm512_set1_ps(2.0f), d34, d12);
    o[2] = _mm512_fmadd_ps(_mm512_set1_ps(4.0f), s34, s12);
    o[3] = _mm512_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(8.0f), d34, d12), m[5]);
}

/* Phase 1 for one tile: its 6x6 input pixels (a zero row for those outside the image),
 * every channel vector, into V[xi][t][c] (xi_stride floats between the xi). */
static void wg_input_tile(const float *x_n, const float *zeros, int64_t H, int64_t W,
                          int64_t C, int64_t ih0, int64_t iw0, float *v, int64_t xi_stride)
{
    const float *px[6][6];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 6; j++) {
            const int64_t ih = ih0 + i, iw = iw0 + j;
            px[i][j] = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? x_n + (ih * W + iw) * C
                                                                : zeros;
        }
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
        const __mmask16 m = wg_mask(C - c0);
        __m512 t[6][6];
        for (int j = 0; j < 6; j++) {   /* columns: B^T d down each column */
            __m512 d[6], o[6];
            for (int i = 0; i < 6; i++)
                d[i] = _mm512_maskz_loadu_ps(m, px[i][j] + c0);
            wg_input_1d(d, o);
            for (int i = 0; i < 6; i++)
                t[i][j] = o[i];
        }
        for (int i = 0; i < 6; i++) {   /* rows: (B^T d) B along each row */
            __m512 o[6];
            wg_input_1d(t[i], o);
            for (int j = 0; j < 6; j++)
                _mm512_mask_storeu_ps(v + (i * 6 + j) * xi_stride + c0, m, o[j]);
        }
    }
}

/* Phase 2's register block: NW tiles by KV vectors of output channels over all C. */
#define DEFINE_GEMM(NW, KV)                                                            \
static void wg_gemm_##NW##_##KV(const float *v, int64_t C, const float *u, int64_t P,  \
                                float *m, int64_t ms)                                  \
{                                                                                      \
    __m512 acc[NW][KV];                                                                \
    _Pragma("GCC unroll 32")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        _Pragma("GCC unroll 32")                                                       \
        for (int q = 0; q < KV; q++)                                                   \
            acc[j][q] = _mm512_setzero_ps();                                           \
    for (int64_t c = 0; c < C; c++) {                                                  \
        __m512 wv[KV];                                                                 \
        _Pragma("GCC unroll 32")                                                       \
        for (int q = 0; q < KV; q++)                                                   \
            wv[q] = _mm512_loadu_ps(u + c * P + 16 * q);                               \
        _Pragma("GCC unroll 32")                                                       \
        for (int j = 0; j < NW; j++) {                                                 \
            const __m512 b = _mm512_set1_ps(v[j * C + c]);                             \
            _Pragma("GCC unroll 32")                                                   \
            for (int q = 0; q < KV; q++)                                               \
                acc[j][q] = _mm512_fmadd_ps(b, wv[q], acc[j][q]);                      \
        }                                                                              \
    }                                                                                  \
    _Pragma("GCC unroll 32")                                                           \
    for (int j = 0; j < NW; j++)                                                       \
        _Pragma("GCC unroll 32")                                                       \
        for (int q = 0; q < KV; q++)                                                   \
            _mm512_storeu_ps(m + j * ms + 16 * q, acc[j][q]);                          \
}

#define WG_W4(X, KV) X(4, KV) X(3, KV) X(2, KV) X(1, KV)
#define WG_W6(X, KV) X(6, KV) X(5, KV) WG_W4(X, KV)
#define WG_W8(X, KV) X(8, KV) X(7, KV) WG_W6(X, KV)
#define WG_W12(X, KV) X(12, KV) X(11, KV) X(10, KV) X(9, KV) WG_W8(X, KV)
#define WG_W24(X, KV) X(24, KV) X(23, KV) X(22, KV) X(21, KV) X(20, KV) X(19, KV)       \
    X(18, KV) X(17, KV) X(16, KV) X(15, KV) X(14, KV) X(13, KV) WG_W12(X, KV)
/* the widest block per vector count: NW * KV accumulators + KV weights + 1 broadcast */
#define WG_BLOCKS(X) X(4, 6) X(3, 8) X(2, 12) X(1, 24)

#define WG_DEFINE_OF(KV, W) WG_W##W(DEFINE_GEMM, KV)
WG_BLOCKS(WG_DEFINE_OF)

#define WG_WIDEST_ENTRY(KV, W) [KV] = W,
static const int WG_WIDEST[WG_MAX_KV + 1] = { WG_BLOCKS(WG_WIDEST_ENTRY) };

#define WG_CASE(NW, KV) case NW: wg_gemm_##NW##_##KV(v, C, u, P, m, ms); break;
#define WG_CASE_KV(KV, W) case KV: switch (nw) { WG_W##W(WG_CASE, KV) } break;

static void wg_gemm(int kv, int nw, const float *v, int64_t C, const float *u, int64_t P,
                    float *m, int64_t ms)
{
    switch (kv) {
    WG_BLOCKS(WG_CASE_KV)
    }
}

/* Phase 3's store of one output vector: act(value + bias + residual), masked. */
static inline void wg_store(const ttile_epilogue *ep, float *y, int64_t i, int64_t k,
                            __mmask16 m, __m512 value)
{
    if (ep != NULL)
        ttile_epilogue_store512(ep, y, i, k, m, value);
    else
        _mm512_mask_storeu_ps(y + i, m, value);
}

int ttile_conv_winograd_avx512(const ttile_conv_shape *sh, const float *x, const float *u,
                               float *y, int nthreads, const ttile_epilogue *ep)
{
    if (sh->r != 3 || sh->s != 3 || sh->stride_h != 1 || sh->stride_w != 1
        || sh->dil_h != 1 || sh->dil_w != 1 || sh->groups != 1)
        return -1;
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    const int64_t N = sh->n, H = sh->h, W = sh->w, C = sh->c, K = sh->k;
    const int64_t HO = sh->ho, WO = sh->wo;
    const int64_t P = ttile_winograd_panel_avx512(K);
    const int kv = (int)(P / 16);
    const int64_t kchunks = (K + P - 1) / P, KP = kchunks * P;
    const int64_t th = (HO + 3) / 4, tw = (WO + 3) / 4, tiles = N * th * tw;
    /* super-blocks of whole tile counts whose V and M fit WG_BLOCK_BYTES, split evenly */
    int64_t per_block = WG_BLOCK_BYTES / (WG_XI * (C + KP) * (int64_t)sizeof(float));
    per_block = per_block < 24 ? 24 : per_block;
    const int64_t nblocks = (tiles + per_block - 1) / per_block;
    const int64_t ts = (tiles + nblocks - 1) / nblocks;
    float *v = aligned_alloc(64, (size_t)(WG_XI * ts * C + 16) * sizeof(float));
    float *m = aligned_alloc(64, (size_t)(WG_XI * ts * KP) * sizeof(float));
    float *zeros = calloc((size_t)C + 16, sizeof(float));
    if (v == NULL || m == NULL || zeros == NULL) {
        free(v);
        free(m);
        free(zeros);
        return -1;
    }
    const int widest = WG_WIDEST[kv];
    /* phase 2's tasks: (xi, panel, run of tiles); runs of whole register blocks */
    const int64_t run = 4 * widest;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t t0 = b * ts;
        const int64_t nt = tiles - t0 < ts ? tiles - t0 : ts;
        const int64_t runs = (nt + run - 1) / run;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nt; t++) {
            const int64_t g = t0 + t, n = g / (th * tw), rest = g % (th * tw);
            const int64_t ih0 = (rest / tw) * 4 - sh->pad_top;
            const int64_t iw0 = (rest % tw) * 4 - sh->pad_left;
            wg_input_tile(x + n * H * W * C, zeros, H, W, C, ih0, iw0, v + t * C, ts * C);
        }
#pragma omp for collapse(3) schedule(static)
        for (int64_t xi = 0; xi < WG_XI; xi++)
            for (int64_t kc = 0; kc < kchunks; kc++)
                for (int64_t rr = 0; rr < runs; rr++) {
                    const float *uxi = u + (xi * kchunks + kc) * C * P;
                    const int64_t lo = rr * run, hi = lo + run < nt ? lo + run : nt;
                    /* nearly equal blocks: 17 tiles as 6 + 6 + 5, not 6 + 6 + 5 */
                    const int64_t count = hi - lo;
                    const int64_t nb = (count + widest - 1) / widest;
                    const int64_t base = count / nb, wider = count % nb;
                    int64_t j0 = lo;
                    for (int64_t q = 0; q < nb; q++) {
                        const int nw = (int)(base + (q < wider ? 1 : 0));
                        wg_gemm(kv, nw, v + (xi * ts + j0) * C, C, uxi, P,
                                m + (xi * ts + j0) * KP + kc * P, KP);
                        j0 += nw;
                    }
                }
#pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < nt; t++)
            for (int64_t k0 = 0; k0 < K; k0 += 16) {
                const int64_t g = t0 + t, n = g / (th * tw), rest = g % (th * tw);
                const int64_t oh0 = (rest / tw) * 4, ow0 = (rest % tw) * 4;
                const __mmask16 mk = wg_mask(K - k0);
                __m512 tmp[4][6];
                for (int j = 0; j < 6; j++) {   /* A^T M down each column */
                    __m512 col[6], o[4];
                    for (int i = 0; i < 6; i++)
                        col[i] = _mm512_loadu_ps(m + ((i * 6 + j) * ts + t) * KP + k0);
                    wg_output_1d(col, o);
                    for (int i = 0; i < 4; i++)
                        tmp[i][j] = o[i];
                }
                for (int i = 0; i < 4 && oh0 + i < HO; i++) {   /* (A^T M) A along rows */
                    __m512 o[4];
                    wg_output_1d(tmp[i], o);
                    for (int j = 0; j < 4 && ow0 + j < WO; j++)
                        wg_store(ep, y, ((n * HO + oh0 + i) * WO + ow0 + j) * K + k0, k0,
                                 mk, o[j]);
                }
            }
    }
    free(v);
    free(m);
    free(zeros);
    return 0;
}
