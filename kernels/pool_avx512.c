/* Max pooling on NHWC arrays with AVX-512F (pool_nhwc.c calls these where the caller's
 * ISA family is AVX-512F): each output pixel's window reduced in registers, up to 8
 * vectors of 16 channels at a time (POOL_BLOCK), the first window pixel loaded and the
 * others compared in, one store per vector. The plain C loop (pool_nhwc.c) keeps the
 * running maximum in the output, a load, compare and store per window pixel, and on
 * bf16 values did not vectorize: ResNet-50's pooling (112x112x64, 3x3 stride 2) took
 * 188-325 us in fp32 and 378 in bf16 at 1 thread on a Xeon model 207; here 158 alone in
 * fp32 (its 3.2 MB input read from beyond the L2) and 148 in bf16 inside the network.
 *
 * As torch: a NaN in the window is the window's maximum (v replaces the maximum when
 * it is greater or NaN). bf16 values are compared as the fp32 values their bits are,
 * and the maximum, one of them, is stored back as its bits. */
#include <immintrin.h>
#include <stdint.h>
#include "pool_window.h"
#include "ttile_runtime.h"

static inline __m512 pool_select(__m512 acc, __m512 v)
{
    const __mmask16 take = _mm512_cmp_ps_mask(v, acc, _CMP_GT_OQ)
                           | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(acc, take, v);
}

/* 16 bf16 values (all 16, or the first `m` lanes, the rest zero) widened to fp32: an
 * even tail as a masked load of pairs (AVX-512F has no 16-bit masked load), an odd one
 * through a copy (a pair's load could reach past the array). */
static inline __m512 pool_widen16(const uint16_t *p, int64_t m)
{
    __m256i bits;
    if (m >= 16) {
        bits = _mm256_loadu_si256((const __m256i *)p);
    } else if (!(m & 1)) {
        bits = _mm512_castsi512_si256(
            _mm512_maskz_loadu_epi32((__mmask16)((1u << (m / 2)) - 1), p));
    } else {
        uint16_t tmp[16] = {0};
        for (int64_t i = 0; i < m; i++)
            tmp[i] = p[i];
        bits = _mm256_loadu_si256((const __m256i *)tmp);
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline void pool_narrow16(uint16_t *p, __m512 v, int64_t m)
{
    const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
    if (m >= 16)
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(high));
    else
        _mm512_mask_cvtepi32_storeu_epi16(p, (__mmask16)((1u << m) - 1), high);
}

/* One output pixel's channels [k, k + 16 NB) (the last vector's first `m` lanes
 * real): NB vectors of running maxima, so that NB compare-and-select chains interleave
 * (one chain's latency per window pixel made the loop latency-bound). The window: nr
 * rows of ns pixels from `first`, rows `row` elements apart. */
#define POOL_BLOCK(NAME, T, LOAD, STORE, NB)                                             \
    static inline void NAME(const T *first, T *out, int64_t k, int64_t m, int64_t nr,   \
                            int64_t ns, int64_t row, int64_t c)                          \
    {                                                                                    \
        __m512 acc[NB];                                                                  \
        for (int j = 0; j < NB; j++)                                                     \
            acc[j] = LOAD(first + k + 16 * j, j == NB - 1 ? m : 16);                     \
        for (int64_t r = 0; r < nr; r++)                                                 \
            for (int64_t s = (r == 0); s < ns; s++) {                                    \
                const T *in = first + r * row + s * c + k;                               \
                for (int j = 0; j < NB; j++)                                             \
                    acc[j] = pool_select(acc[j], LOAD(in + 16 * j, j == NB - 1 ? m : 16)); \
            }                                                                            \
        for (int j = 0; j < NB; j++)                                                     \
            STORE(out + k + 16 * j, acc[j], j == NB - 1 ? m : 16);                       \
    }

/* The window loop of both element types: BLOCK the POOL_BLOCK functions' common name. */
#define MAXPOOL_AVX512(T, BLOCK)                                                         \
    POOL_FOR_EACH_WINDOW(                                                                \
        T *out = y + ((b * ho + oh) * wo + ow) * c;                                      \
        const T *first = x + ((b * h + r_lo) * w + s_lo) * c;                            \
        for (int64_t k = 0; k < c;) {                                                    \
            const int64_t vectors = (c - k + 15) / 16;                                   \
            const int nb = vectors >= 8 ? 8 : vectors >= 4 ? 4 : vectors >= 2 ? 2 : 1;   \
            const int64_t m = nb == vectors ? c - k - 16 * (nb - 1) : 16;                \
            if (nb == 8)                                                                 \
                BLOCK##8(first, out, k, m, r_hi - r_lo, s_hi - s_lo, w * c, c);          \
            else if (nb == 4)                                                            \
                BLOCK##4(first, out, k, m, r_hi - r_lo, s_hi - s_lo, w * c, c);          \
            else if (nb == 2)                                                            \
                BLOCK##2(first, out, k, m, r_hi - r_lo, s_hi - s_lo, w * c, c);          \
            else                                                                         \
                BLOCK##1(first, out, k, m, r_hi - r_lo, s_hi - s_lo, w * c, c);          \
            k += 16 * nb;                                                                \
        })

static inline __m512 load_f32(const float *p, int64_t m)
{
    return m >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), p);
}

static inline void store_f32(float *p, __m512 v, int64_t m)
{
    if (m >= 16)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, (__mmask16)((1u << m) - 1), v);
}

POOL_BLOCK(f32_block8, float, load_f32, store_f32, 8)
POOL_BLOCK(f32_block4, float, load_f32, store_f32, 4)
POOL_BLOCK(f32_block2, float, load_f32, store_f32, 2)
POOL_BLOCK(f32_block1, float, load_f32, store_f32, 1)
POOL_BLOCK(bf16_block8, uint16_t, pool_widen16, pool_narrow16, 8)
POOL_BLOCK(bf16_block4, uint16_t, pool_widen16, pool_narrow16, 4)
POOL_BLOCK(bf16_block2, uint16_t, pool_widen16, pool_narrow16, 2)
POOL_BLOCK(bf16_block1, uint16_t, pool_widen16, pool_narrow16, 1)

void ttile_maxpool_nhwc_avx512(const float *x, float *y, int64_t n, int64_t h, int64_t w,
                               int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                               int64_t ph, int64_t pw, int64_t ho, int64_t wo, int nthreads)
{
    MAXPOOL_AVX512(float, f32_block)
}

void ttile_maxpool_nhwc_bf16_avx512(const uint16_t *x, uint16_t *y, int64_t n, int64_t h,
                                    int64_t w, int64_t c, int64_t kh, int64_t kw,
                                    int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                    int64_t ho, int64_t wo, int nthreads)
{
    MAXPOOL_AVX512(uint16_t, bf16_block)
}
