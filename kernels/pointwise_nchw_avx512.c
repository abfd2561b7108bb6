/* 1x1 convolution (stride 1, no padding, one group) on AVX-512 in torch's layout.
 *
 * In NCHW a pointwise layer is a matrix product per image, Y[K][P] = W[K][C] X[C][P]
 * with P = H*W pixels: every channel of the input and of the output is one contiguous
 * row. So nothing needs converting: 16 neighbouring pixels go in the vector lanes, each
 * weight is a broadcast scalar, and a register block of 6 output channels by 4 vectors
 * (64 pixels, 24 accumulators) runs the whole reduction over C before its rows are stored
 * once, through the epilogue in registers (bias, NCHW residual, activation). The searched
 * kernels' NCHW entry points and the conversions around the NHWC kernels read such an
 * input channel by channel a plane apart (C streams of a few lines each) and measured
 * 1.5-2.7x slower than this layout's own NHWC call on a Zen 4 (Yolo9000-5: 136x136
 * pixels, 128 channels: 8.9 and 7.9 ms against 3.4).
 *
 * Order: a thread takes a range of 64-pixel columns; for each column, every block of
 * output channels in turn reads the column's C x 64 inputs (L1 or L2 after the first
 * block), and the first block prefetches the next column's, so the input streams from
 * memory once, row segment after row segment. The weights are read as given: torch's
 * (K, C) rows (a per-call conv2d) or the transposed (C, K) a Conv2d keeps, through the
 * strides of one element along k and c. The last column is masked; output-channel counts
 * that are not multiples of 6 end with a smaller block. */
#include <immintrin.h>
#include "ttile_runtime.h"

#define PW_ROWS 6    /* output channels per register block */
#define PW_VECS 4    /* 16-pixel vectors per register block */
#define PW_COLUMN (16 * PW_VECS)
#ifndef PW_PREFETCH
#define PW_PREFETCH 2
#endif

static inline __attribute__((always_inline)) void
pw_block(const float *x, const float *w, int64_t ks, int64_t cs, float *y, int64_t C,
         int64_t P, int64_t k0, int64_t p0, const int rows, const int full,
         const __mmask16 m[PW_VECS], const int prefetch, const ttile_epilogue *ep,
         const float *res)
{
    __m512 acc[PW_ROWS][PW_VECS];
    _Pragma("GCC unroll 6")
    for (int i = 0; i < PW_ROWS; i++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < PW_VECS; j++)
            acc[i][j] = _mm512_setzero_ps();
    const float *xc = x + p0;
    const float *wk = w + k0 * ks;
    for (int64_t c = 0; c < C; c++, xc += P, wk += cs) {
        __m512 v[PW_VECS];
        _Pragma("GCC unroll 4")
        for (int j = 0; j < PW_VECS; j++)
            v[j] = full ? _mm512_loadu_ps(xc + 16 * j) : _mm512_maskz_loadu_ps(m[j], xc + 16 * j);
        if (prefetch) {
            _Pragma("GCC unroll 4")
            for (int j = 0; j < PW_VECS; j++)
                _mm_prefetch((const char *)(xc + PW_PREFETCH * PW_COLUMN + 16 * j), _MM_HINT_T0);
        }
        _Pragma("GCC unroll 6")
        for (int i = 0; i < rows; i++) {
            const __m512 b = _mm512_set1_ps(wk[i * ks]);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < PW_VECS; j++)
                acc[i][j] = _mm512_fmadd_ps(v[j], b, acc[i][j]);
        }
    }
    _Pragma("GCC unroll 6")
    for (int i = 0; i < rows; i++) {
        const int64_t k = k0 + i;
        float *yk = y + k * P + p0;
        const __m512 bias = _mm512_set1_ps(ep != NULL && ep->bias ? ep->bias[k] : 0.0f);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < PW_VECS; j++) {
            __m512 o = acc[i][j];
            if (ep != NULL) {
                o = _mm512_add_ps(o, bias);
                if (res != NULL)
                    o = _mm512_add_ps(o, full ? _mm512_loadu_ps(res + k * P + p0 + 16 * j)
                                              : _mm512_maskz_loadu_ps(m[j], res + k * P + p0 + 16 * j));
                o = ttile_activate512(ep->activation, ep->negative_slope, o);
            }
            if (full)
                _mm512_storeu_ps(yk + 16 * j, o);
            else
                _mm512_mask_storeu_ps(yk + 16 * j, m[j], o);
        }
    }
}

/* Output channels [k_lo, k_hi) of one 64-pixel column (full, or masked by m). */
static inline __attribute__((always_inline)) void
pw_column(const float *x, const float *w, int64_t ks, int64_t cs, float *y, int64_t C,
          int64_t P, int64_t k_lo, int64_t k_hi, int64_t p0, const int full,
          const __mmask16 m[PW_VECS], const int prefetch, const ttile_epilogue *ep,
          const float *res)
{
    int64_t k0 = k_lo;
    /* the first block prefetches the next column */
    for (; k0 + PW_ROWS <= k_hi; k0 += PW_ROWS) {
        if (prefetch && k0 == k_lo)
            pw_block(x, w, ks, cs, y, C, P, k0, p0, PW_ROWS, full, m, 1, ep, res);
        else
            pw_block(x, w, ks, cs, y, C, P, k0, p0, PW_ROWS, full, m, 0, ep, res);
    }
    switch (k_hi - k0) {
    case 5: pw_block(x, w, ks, cs, y, C, P, k0, p0, 5, full, m, 0, ep, res); break;
    case 4: pw_block(x, w, ks, cs, y, C, P, k0, p0, 4, full, m, 0, ep, res); break;
    case 3: pw_block(x, w, ks, cs, y, C, P, k0, p0, 3, full, m, 0, ep, res); break;
    case 2: pw_block(x, w, ks, cs, y, C, P, k0, p0, 2, full, m, 0, ep, res); break;
    case 1: pw_block(x, w, ks, cs, y, C, P, k0, p0, 1, full, m, 0, ep, res); break;
    default: break;
    }
}

/* The longest a thread works (in 16-pixel vectors times blocks of output channels) when
 * the (image, column range, channel range) tasks of a split go to nthreads threads as
 * OpenMP's static schedule hands them out: contiguous runs, the first tasks % nthreads
 * threads one task more. */
static int64_t pw_split_load(int64_t N, int64_t P, int64_t columns, int64_t kblocks,
                             int nthreads, int64_t cparts, int64_t kparts)
{
    const int64_t tasks = N * cparts * kparts;
    const int64_t each = tasks / nthreads, extra = tasks % nthreads;
    int64_t worst = 0, task = 0;
    for (int t = 0; t < nthreads; t++) {
        int64_t load = 0;
        for (int64_t i = 0; i < each + (t < extra); i++, task++) {
            const int64_t cp = task / kparts % cparts, kp = task % kparts;
            const int64_t col_lo = columns * cp / cparts, col_hi = columns * (cp + 1) / cparts;
            const int64_t px_hi = col_hi * PW_COLUMN < P ? col_hi * PW_COLUMN : P;
            const int64_t vecs = (px_hi + 15) / 16 - col_lo * PW_VECS;
            load += vecs * (kblocks * (kp + 1) / kparts - kblocks * kp / kparts);
        }
        worst = load > worst ? load : worst;
    }
    return worst;
}

/* How to cut the work into tasks: by columns alone (4 per thread) where there are many
 * columns; where there are few, the split among a handful that keeps the busiest thread
 * shortest: columns as they come, or ranges of output channels times columns (each
 * range re-reads the columns' input from L2 or L3, for K / parts channels of FMAs:
 * charged 1 % a part). A 17x17 image has 4 full columns and one of 33 pixels, which 2
 * threads split by columns as 8 and 11 vectors (2 x 4 tasks) and by channels evenly
 * (Yolo9000-19, Zen 5, 2 threads: 0.82 -> 0.71 ms). */
static void pw_split(int64_t N, int64_t P, int64_t columns, int64_t kblocks, int nthreads,
                     int64_t *cparts, int64_t *kparts)
{
    const int64_t many = 4 * (int64_t)nthreads;
    *kparts = 1;
    *cparts = columns < many ? columns : many;
    if (N * columns >= many)
        return;
    int64_t best = -1;
    /* channel parts: powers of two and nthreads; column parts: the columns, or enough for
     * nthreads, 2 nthreads or 4 nthreads tasks (a few dozen splits at 64 threads) */
    for (int64_t g = 1; g <= nthreads && g <= kblocks; g = g * 2 > nthreads && g < nthreads
                                                           ? nthreads : g * 2) {
        const int64_t tries[4] = {columns, (nthreads + N * g - 1) / (N * g),
                                  (2 * nthreads + N * g - 1) / (N * g),
                                  (4 * nthreads + N * g - 1) / (N * g)};
        for (int i = 0; i < 4; i++) {
            const int64_t cp = tries[i] < columns ? tries[i] : columns;
            if (N * g * cp > many)
                continue;
            const int64_t load = pw_split_load(N, P, columns, kblocks, nthreads, cp, g)
                                 * (100 + (g - 1));
            if (best < 0 || load < best) {
                best = load;
                *cparts = cp;
                *kparts = g;
            }
        }
    }
}

int ttile_pointwise_nchw_supported(const ttile_conv_shape *sh)
{
    return sh->r == 1 && sh->s == 1 && sh->stride_h == 1 && sh->stride_w == 1
           && sh->pad_top == 0 && sh->pad_left == 0 && sh->groups == 1
           && sh->ho == sh->h && sh->wo == sh->w;
}

int ttile_conv_pointwise_nchw_avx512(const ttile_conv_shape *sh, const float *x,
                                     const float *w, int w_kc, float *y, int nthreads,
                                     const ttile_epilogue *ep)
{
    if (!ttile_pointwise_nchw_supported(sh))
        return -1;
    const int64_t N = sh->n, C = sh->c, K = sh->k, P = sh->h * sh->w;
    const int64_t ks = w_kc ? C : 1, cs = w_kc ? 1 : K;
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    const int64_t columns = (P + PW_COLUMN - 1) / PW_COLUMN;
    /* Tasks: (image, range of columns, range of output channels); see pw_split. */
    const int64_t kblocks = (K + PW_ROWS - 1) / PW_ROWS;
    int64_t cparts = 1, kparts = 1;
    if (nthreads > 1)
        pw_split(N, P, columns, kblocks, nthreads, &cparts, &kparts);
#pragma omp parallel for collapse(3) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t cp = 0; cp < cparts; cp++)
            for (int64_t kp = 0; kp < kparts; kp++) {
                const float *xn = x + n * C * P;
                float *yn = y + n * K * P;
                const float *rn = ep != NULL && ep->residual ? ep->residual + n * K * P : NULL;
                const int64_t k_lo = kblocks * kp / kparts * PW_ROWS;
                int64_t k_hi = kblocks * (kp + 1) / kparts * PW_ROWS;
                if (k_hi > K)
                    k_hi = K;
                const int64_t col_lo = columns * cp / cparts, col_hi = columns * (cp + 1) / cparts;
                for (int64_t col = col_lo; col < col_hi; col++) {
                    const int64_t p0 = col * PW_COLUMN;
                    if (p0 + PW_COLUMN <= P) {
                        const __mmask16 m[PW_VECS] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
                        pw_column(xn, w, ks, cs, yn, C, P, k_lo, k_hi, p0, 1, m,
                                  col + 1 < col_hi, ep, rn);
                    } else {
                        __mmask16 m[PW_VECS];
                        for (int j = 0; j < PW_VECS; j++) {
                            const int64_t left = P - p0 - 16 * j;
                            m[j] = left >= 16 ? (__mmask16)0xFFFF
                                 : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
                        }
                        pw_column(xn, w, ks, cs, yn, C, P, k_lo, k_hi, p0, 0, m, 0, ep, rn);
                    }
                }
            }
    return 0;
}
