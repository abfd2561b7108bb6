/* Fused epilogues: y = act(conv + bias + residual), applied where a kernel stores its
 * accumulators, never as a second pass over the output.
 *
 * One header for every kernel family: the generic kernels include it, and generated
 * kernels include it too (the build puts kernels/ on the include path, the run-time
 * compiler the copy installed with the package). The epilogue is a run-time argument
 * rather than code specialised per combination: a kernel then serves a layer with or
 * without bias, residual and any activation, and the registry ships one kernel per
 * problem instead of one per (problem, epilogue). Its cost is one well-predicted branch
 * and a switch per stored vector, once per full reduction (C*R*S FMAs per vector).
 *
 * `residual` has the output's shape and layout: the element a kernel stores at y + i
 * reads residual + i. `bias` holds the (group's) K output channels. */
#ifndef TTILE_EPILOGUE_H
#define TTILE_EPILOGUE_H

#include <math.h>
#include <stdint.h>

enum {
    TTILE_ACT_NONE = 0,
    TTILE_ACT_RELU = 1,
    TTILE_ACT_RELU6 = 2,
    TTILE_ACT_LEAKY_RELU = 3,
    TTILE_ACT_SILU = 4,
    TTILE_ACT_SIGMOID = 5,
};

typedef struct {
    const float *bias;      /* K floats, or NULL */
    const float *residual;  /* shaped and laid out as y, or NULL */
    int activation;         /* TTILE_ACT_* */
    float negative_slope;   /* leaky_relu only */
} ttile_epilogue;

/* The epilogues generated kernels apply in registers, by straight-line code of their
 * own (a run-time argument branched on once per block store, not once per vector: on a
 * layer with a short reduction, C*R*S = 27, branching per vector cost 15-20 %); the rest
 * (silu, sigmoid, no bias) go through ttile_epilogue_apply512 from memory. */
enum {
    TTILE_EPK_NONE = 0,
    TTILE_EPK_BIAS = 1,
    TTILE_EPK_BIAS_RELU = 2,
    TTILE_EPK_BIAS_RESIDUAL = 3,
    TTILE_EPK_BIAS_RESIDUAL_RELU = 4,
    TTILE_EPK_BIAS_RELU6 = 5,
    TTILE_EPK_BIAS_LEAKY_RELU = 6,
    TTILE_EPK_OTHER = 7,
};

/* True when the epilogue does nothing (NULL or all fields empty). */
static inline int ttile_epilogue_is_empty(const ttile_epilogue *ep)
{
    return ep == 0 || (ep->bias == 0 && ep->residual == 0 && ep->activation == TTILE_ACT_NONE);
}

/* Which TTILE_EPK_* an epilogue is. */
static inline int ttile_epilogue_kind(const ttile_epilogue *ep)
{
    if (ttile_epilogue_is_empty(ep))
        return TTILE_EPK_NONE;
    if (ep->bias == 0)
        return TTILE_EPK_OTHER;
    if (ep->residual)
        return ep->activation == TTILE_ACT_NONE ? TTILE_EPK_BIAS_RESIDUAL
             : ep->activation == TTILE_ACT_RELU ? TTILE_EPK_BIAS_RESIDUAL_RELU
             : TTILE_EPK_OTHER;
    switch (ep->activation) {
    case TTILE_ACT_NONE:
        return TTILE_EPK_BIAS;
    case TTILE_ACT_RELU:
        return TTILE_EPK_BIAS_RELU;
    case TTILE_ACT_RELU6:
        return TTILE_EPK_BIAS_RELU6;
    case TTILE_ACT_LEAKY_RELU:
        return TTILE_EPK_BIAS_LEAKY_RELU;
    default:
        return TTILE_EPK_OTHER;
    }
}

static inline float ttile_activate1(int activation, float slope, float v)
{
    switch (activation) {
    case TTILE_ACT_RELU:
        return v > 0.0f ? v : 0.0f;
    case TTILE_ACT_RELU6:
        return v > 0.0f ? (v < 6.0f ? v : 6.0f) : 0.0f;
    case TTILE_ACT_LEAKY_RELU:
        return v >= 0.0f ? v : v * slope;
    case TTILE_ACT_SILU:
        return v / (1.0f + expf(-v));
    case TTILE_ACT_SIGMOID:
        return 1.0f / (1.0f + expf(-v));
    default:
        return v;
    }
}

/* One output element: y[i] = act(acc + bias[k] + residual[i]). */
static inline float ttile_epilogue1(const ttile_epilogue *ep, float acc, int64_t i, int64_t k)
{
    if (ep == 0)
        return acc;
    if (ep->bias)
        acc += ep->bias[k];
    if (ep->residual)
        acc += ep->residual[i];
    return ttile_activate1(ep->activation, ep->negative_slope, acc);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The AVX2 + FMA counterparts of the functions below, for the AVX2 kernel family (8
 * lanes; masks are integer vectors, all ones in the lanes to touch, as vmaskmovps
 * takes them). */

/* Lanes 0 .. remaining-1 on (none when remaining <= 0, all when >= 8). */
static inline __m256i ttile_tail_mask256(int64_t remaining)
{
    const int n = remaining < 0 ? 0 : remaining > 8 ? 8 : (int)remaining;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The lanes of `mask` of v stored at p: a plain store when every lane is on. vmaskmovps
 * to memory costs about ten plain stores on AMD Zen 3 (4 ns against 0.4, measured), where
 * a kernel's stores are whole vectors but for a channel tail; the mask test is folded
 * away where the mask is a constant and hoisted where it is loop-invariant. */
static inline void ttile_maskstore256(float *p, __m256i mask, __m256 v)
{
    if (_mm256_movemask_ps(_mm256_castsi256_ps(mask)) == 0xFF)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, mask, v);
}

/* e^x on 8 lanes: the polynomial of ttile_exp512, 2^n put into the exponent bits. */
static inline __m256 ttile_exp256(__m256 x)
{
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n is in [-126, 127] here: 2^n is a normal float, built from its exponent bits */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 ttile_leaky256(__m256 v, float slope)
{
    return _mm256_blendv_ps(v, _mm256_mul_ps(v, _mm256_set1_ps(slope)),
                            _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
}

static inline __m256 ttile_activate256(int activation, float slope, __m256 v)
{
    const __m256 zero = _mm256_setzero_ps();
    const __m256 one = _mm256_set1_ps(1.0f);
    switch (activation) {
    case TTILE_ACT_RELU:
        return _mm256_max_ps(v, zero);
    case TTILE_ACT_RELU6:
        return _mm256_min_ps(_mm256_max_ps(v, zero), _mm256_set1_ps(6.0f));
    case TTILE_ACT_LEAKY_RELU:
        return ttile_leaky256(v, slope);
    case TTILE_ACT_SILU:
        return _mm256_div_ps(v, _mm256_add_ps(one, ttile_exp256(_mm256_sub_ps(zero, v))));
    case TTILE_ACT_SIGMOID:
        return _mm256_div_ps(one, _mm256_add_ps(one, ttile_exp256(_mm256_sub_ps(zero, v))));
    default:
        return v;
    }
}

/* ttile_epilogue_store512 on 8 lanes. */
static inline void ttile_epilogue_store256(const ttile_epilogue *ep, float *y, int64_t i,
                                           int64_t k, __m256i mask, __m256 v)
{
    if (ep->bias)
        v = _mm256_add_ps(v, _mm256_maskload_ps(ep->bias + k, mask));
    if (ep->residual)
        v = _mm256_add_ps(v, _mm256_maskload_ps(ep->residual + i, mask));
    v = ttile_activate256(ep->activation, ep->negative_slope, v);
    ttile_maskstore256(y + i, mask, v);
}

/* ttile_epilogue_apply512 on 8 lanes. */
static inline void ttile_epilogue_apply256(const ttile_epilogue *ep, float *y, int64_t i,
                                           int64_t k, __m256i mask)
{
    ttile_epilogue_store256(ep, y, i, k, mask, _mm256_maskload_ps(y + i, mask));
}

/* ttile_epilogue_row512 on 8 lanes. */
static inline void ttile_epilogue_row256(const ttile_epilogue *ep, float *y, int64_t i,
                                         int64_t n, int64_t k, int with_bias)
{
    const __m256 b = _mm256_set1_ps(with_bias && ep->bias ? ep->bias[k] : 0.0f);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i m = ttile_tail_mask256(n - j);
        __m256 v = _mm256_add_ps(_mm256_maskload_ps(y + i + j, m), b);
        if (ep->residual)
            v = _mm256_add_ps(v, _mm256_maskload_ps(ep->residual + i + j, m));
        v = ttile_activate256(ep->activation, ep->negative_slope, v);
        ttile_maskstore256(y + i + j, m, v);
    }
}
#endif /* __AVX2__ && __FMA__ */

#ifdef __AVX512F__
#include <immintrin.h>

/* e^x on 16 lanes, within 2 ulp on [-87, 88] (Cephes' expf polynomial; 2^n applied
 * with scalef, so no integer tricks that need AVX-512DQ). */
static inline __m512 ttile_exp512(__m512 x)
{
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 ttile_leaky512(__m512 v, float slope)
{
    return _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ), v,
                              _mm512_set1_ps(slope));
}

static inline __m512 ttile_activate512(int activation, float slope, __m512 v)
{
    const __m512 zero = _mm512_setzero_ps();
    switch (activation) {
    case TTILE_ACT_RELU:
        return _mm512_max_ps(v, zero);
    case TTILE_ACT_RELU6:
        return _mm512_min_ps(_mm512_max_ps(v, zero), _mm512_set1_ps(6.0f));
    case TTILE_ACT_LEAKY_RELU:
        return _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), v,
                                  _mm512_set1_ps(slope));
    case TTILE_ACT_SILU:
        return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                              ttile_exp512(_mm512_sub_ps(zero, v))));
    case TTILE_ACT_SIGMOID:
        return _mm512_div_ps(_mm512_set1_ps(1.0f),
                             _mm512_add_ps(_mm512_set1_ps(1.0f),
                                           ttile_exp512(_mm512_sub_ps(zero, v))));
    default:
        return v;
    }
}

/* ttile_epilogue_store512: the 16 outputs `v` (lanes of `mask`) for y + i, output channels
 * k..k+15, stored through the epilogue, y = act(v + bias + residual), by a kernel whose
 * values are still in registers with few others live (the Winograd output transform).
 * ttile_epilogue_apply512: the same in place on the 16 outputs at y + i that
 * a kernel has just stored (they are in L1): y = act(y + bias + residual). Kernels store
 * their accumulators first and then run this from memory, with a compiler barrier
 * between: applied on the accumulators themselves, the epilogue's temporaries (exp's
 * constants, bias and residual vectors) came on top of 30 live accumulators and spilled. */
static inline void ttile_epilogue_store512(const ttile_epilogue *ep, float *y, int64_t i,
                                           int64_t k, __mmask16 mask, __m512 v)
{
    if (ep->bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, ep->bias + k));
    if (ep->residual)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, ep->residual + i));
    v = ttile_activate512(ep->activation, ep->negative_slope, v);
    _mm512_mask_storeu_ps(y + i, mask, v);
}

static inline void ttile_epilogue_apply512(const ttile_epilogue *ep, float *y, int64_t i,
                                           int64_t k, __mmask16 mask)
{
    ttile_epilogue_store512(ep, y, i, k, mask, _mm512_maskz_loadu_ps(mask, y + i));
}

/* In place on n contiguous floats of one output channel k (an NCHW row): the epilogue's
 * residual and activation, and the bias when `with_bias`. */
static inline void ttile_epilogue_row512(const ttile_epilogue *ep, float *y, int64_t i,
                                         int64_t n, int64_t k, int with_bias)
{
    const __m512 b = _mm512_set1_ps(with_bias && ep->bias ? ep->bias[k] : 0.0f);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF
                                        : (__mmask16)((1u << (n - j)) - 1u);
        __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i + j), b);
        if (ep->residual)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, ep->residual + i + j));
        v = ttile_activate512(ep->activation, ep->negative_slope, v);
        _mm512_mask_storeu_ps(y + i + j, m, v);
    }
}
/* 16 x 16 floats transposed in registers: unpack, 64-bit unpack, then two 128-bit lane
 * shuffles (the layout conversions and the generated kernels' NCHW stores). */
static inline void ttile_transpose16_512(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Rows v[0..15] of a transposed tile to d, d + stride, ..., d + 15 stride: with
 * `stream` and every row on a line, past the caches (non-temporal). */
static inline void ttile_store_rows512(float *d, int64_t stride, const __m512 v[16],
                                       int stream)
{
    if (stream && ((uintptr_t)d & 63) == 0 && ((stride * 4) & 63) == 0) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            _mm512_stream_ps(d + j * stride, v[j]);
    } else {
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            _mm512_storeu_ps(d + j * stride, v[j]);
    }
}

/* The NCHW store of a tile of outputs (the AVX-512F generated kernels' NCHW entry
 * points): the tile was computed in NHWC order into a buffer on the stack, t[n][h][w][k]
 * with extents en, eh, ew, ek (ek whole vectors: channels at or past K are dropped), and
 * is written to y[N][K][Ho][Wo] at origin (n0, h0, w0, k0) through the epilogue (bias,
 * an NCHW residual, activation) while it is in L1/L2 - instead of the whole NHWC output
 * going to memory and coming back for a second, transposing pass. 16 x 16 tiles are
 * transposed in registers: 16 pixels' 16 channels in, 16 channel rows of 16 pixels out,
 * each through the epilogue in registers and one masked store. Channel tiles outermost: 16 output planes
 * are written at a time, not all ek of them - planes of a size that is a multiple of 4 KB
 * land in the same cache sets, and 32 interleaved planes of Yolo9000-0 took 3x the time
 * of 16. With `stream` (outputs far larger than the caches, where the line would be
 * evicted before it is read), whole aligned lines go out with non-temporal stores: no
 * read-for-ownership of lines the store overwrites entirely. */
static inline void ttile_store_nchw512(const float *t, int en, int eh, int ew, int ek,
                                       float *y, int64_t n0, int64_t h0, int64_t w0,
                                       int64_t k0, int64_t K, int64_t Ho, int64_t Wo,
                                       const ttile_epilogue *ep, int stream)
{
    const int64_t plane = Ho * Wo;
    const int64_t kn = K - k0 < ek ? K - k0 : ek;
    const int epilogue = !ttile_epilogue_is_empty(ep);
    for (int n = 0; n < en; n++)
        for (int h = 0; h < eh; h++) {
            const float *src = t + ((int64_t)n * eh + h) * ew * ek;
            const int64_t base = ((n0 + n) * K + k0) * plane + (h0 + h) * Wo + w0;
            for (int64_t k = 0; k < kn; k += 16) {
                const int nk = kn - k < 16 ? (int)(kn - k) : 16;
                for (int w = 0; w < ew; w += 16) {
                    const int nw = ew - w < 16 ? ew - w : 16;
                    if (nw == 16 && nk == 16 && !epilogue) {
                        /* a whole tile and no epilogue: constant trip counts, the rows
                         * loaded as they are and the stores' kind chosen once */
                        __m512 r[16];
#pragma GCC unroll 16
                        for (int i = 0; i < 16; i++)
                            r[i] = _mm512_loadu_ps(src + (int64_t)(w + i) * ek + k);
                        ttile_transpose16_512(r);
                        ttile_store_rows512(y + base + k * plane + w, plane, r, stream);
                        continue;
                    }
                    const __mmask16 wm = (__mmask16)((1u << nw) - 1u);
                    /* rows past nw repeat the last one (their lanes are never
                     * stored): no select, and the tile stays in registers */
                    __m512 r[16];
                    for (int i = 0; i < 16; i++)
                        r[i] = _mm512_loadu_ps(src + (int64_t)(w + (i < nw ? i : nw - 1)) * ek + k);
                    ttile_transpose16_512(r);
                    /* unrolled: r[j] at constant indices stays in registers */
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++) {
                        if (j >= nk)
                            break;
                        const int64_t i = base + (k + j) * plane + w;
                        __m512 v = r[j];
                        if (epilogue) {
                            if (ep->bias)
                                v = _mm512_add_ps(v, _mm512_set1_ps(ep->bias[k0 + k + j]));
                            if (ep->residual)
                                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(wm, ep->residual + i));
                            v = ttile_activate512(ep->activation, ep->negative_slope, v);
                        }
                        if (stream && nw == 16 && ((uintptr_t)(y + i) & 63) == 0)
                            _mm512_stream_ps(y + i, v);
                        else
                            _mm512_mask_storeu_ps(y + i, wm, v);
                    }
                }
            }
        }
    if (stream)
        _mm_sfence();   /* the streamed lines reach memory before anything reads them */
}
#endif /* __AVX512F__ */

#endif
