/* The AVX512_BF16 convolution: register blocks of vdpbf16ps on the packed formats of
 * ttile_bf16.h, for CPUs with AVX512_BF16 and no AMX (Zen 4, Zen 5, Cooper Lake) and
 * for layers whose few input channels would leave AMX tiles mostly empty.
 *
 * vdpbf16ps adds to each of 16 fp32 lanes the products of a pair of bf16 values: with the
 * weights packed 16 output channels by a pair of input channels, and the input's pair of
 * channels broadcast (one 32-bit load), one instruction does 32 multiply-adds, twice an
 * fp32 FMA's on Zen 4 (235 against 117 GFLOP/s a core). Not so on a Xeon model 207:
 * vdpbf16ps ran at 65-75 GFLOP/s a core against 145-170 for fp32 FMA (12 independent
 * chains in registers), and this kernel at 55-78 on the Fig. 8 layers, the instruction's
 * rate; there AMX serves. A block holds NW pixels by NV 16-channel blocks of accumulators:
 * 6 x 4 (24 accumulators, 4 weight vectors, a broadcast: 29 of the 32 registers), or
 * 6 x 2 for the last 32 channels of kp. Pixels come in blocks of 6 over the virtual rows
 * of ttile_bf16_tiling: no pixel tail (past the output, a block reads the packed slack
 * and its extra pixels are not stored). */
#include <immintrin.h>
#include <stdlib.h>
#include <time.h>

#include "ttile_bf16.h"
#include "ttile_runtime.h"

#define NW 6

typedef int32_t __attribute__((may_alias, aligned(2))) pair_t;

/* acc[NW][nv] += x(pixels of the block) * w over all taps and channel pairs. */
#define DP_BLOCK(NAME, NV)                                                                    \
    static void NAME(const uint16_t *a, int64_t pstride, const int64_t *off, int64_t taps,    \
                     int64_t cp, const uint16_t *wk, int64_t block, float *out)               \
    {                                                                                         \
        __m512 acc[NW][NV];                                                                   \
        for (int i = 0; i < NW; i++)                                                          \
            for (int v = 0; v < NV; v++)                                                      \
                acc[i][v] = _mm512_setzero_ps();                                              \
        for (int64_t tap = 0; tap < taps; tap++) {                                            \
            const uint16_t *x = a + off[tap];                                                 \
            const uint16_t *w = wk + tap * cp * 16;                                           \
            for (int64_t c2 = 0; c2 < cp / 2; c2++) {                                         \
                __m512bh wv[NV];                                                              \
                for (int v = 0; v < NV; v++)                                                  \
                    wv[v] = (__m512bh)_mm512_loadu_si512(w + v * block + c2 * 32);            \
                for (int i = 0; i < NW; i++) {                                                \
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32(                          \
                        *(const pair_t *)(x + i * pstride + 2 * c2));                         \
                    for (int v = 0; v < NV; v++)                                              \
                        acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xv, wv[v]);                   \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < NW; i++)                                                          \
            for (int v = 0; v < NV; v++)                                                      \
                _mm512_storeu_ps(out + (i * 4 + v) * 16, acc[i][v]);                          \
    }

DP_BLOCK(block_6x4, 4)
DP_BLOCK(block_6x2, 2)

int ttile_conv_bf16_avx512(const ttile_bf16_problem *p, const uint16_t *xb,
                           const uint16_t *wb, void *y, int y_bf16, int nthreads,
                           const ttile_epilogue *ep)
{
    if (!ttile_cpu_has_avx512bf16())
        return -1;
    const ttile_epilogue none = {0, 0, TTILE_ACT_NONE, 0.0f};
    if (ep == 0)
        ep = &none;
    const ttile_bf16_tiling t = ttile_bf16_tiling_of(p, NW);
    const int64_t taps = p->r * p->s;
    const int64_t reduced = ttile_bf16_reduced(p);   /* channels an output reduces over */
    const int64_t block = taps * reduced * 16;   /* weight elements of 16 output channels */
    int64_t *off = malloc((size_t)taps * sizeof(int64_t));
    if (off == 0)
        return -1;
    ttile_bf16_tap_offsets(p, off);
    const int64_t image = ttile_bf16_image_elems(p);
    /* blocks of 64 channels, the last maybe 32; grouped, blocks of 32 (a super-group's
     * channels are 32 gkq) */
    const int64_t width = p->gc ? 32 : 64, kquads = (p->kp + width - 1) / width;
    const int64_t quad_bytes = block * (width / 16) * (int64_t)sizeof(uint16_t);
    int64_t group = ttile_generic_cache_bytes() / quad_bytes;
    if (group < 1)
        group = 1;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float acc[NW * 4 * 16] __attribute__((aligned(64)));
        for (int64_t g0 = 0; g0 < kquads; g0 += group) {
            const int64_t g1 = g0 + group < kquads ? g0 + group : kquads;
#pragma omp for collapse(2) schedule(static)
            for (int64_t mi = 0; mi < p->n * t.blocks; mi++)
                for (int64_t kq = g0; kq < g1; kq++) {
                    const int64_t n = mi / t.blocks, b = mi % t.blocks;
                    const uint16_t *a = xb + n * image + ttile_bf16_block_base(p, &t, b);
                    if (p->gc)   /* the super-group's channels */
                        a += kq / p->gkq * p->gc;
                    const uint16_t *wk = wb + (width / 16) * kq * block;
                    const int nv = width == 64 && p->kp - kq * 64 >= 64 ? 4 : 2;
                    if (nv == 4)
                        block_6x4(a, t.pixel_stride, off, taps, reduced, wk, block, acc);
                    else
                        block_6x2(a, t.pixel_stride, off, taps, reduced, wk, block, acc);
                    for (int i = 0; i < NW; i++) {
                        int64_t oh, ow;
                        if (!ttile_bf16_pixel(p, &t, b, i, &oh, &ow))
                            continue;
                        const int64_t at = ((n * p->ho + oh) * p->wo + ow) * p->k;
                        for (int v = 0; v < nv; v++) {
                            const int64_t k0 = kq * width + v * 16;
                            if (k0 >= p->k)
                                break;
                            ttile_bf16_store16(ep, y, y_bf16, at + k0, k0,
                                               ttile_bf16_kmask(k0, p->k),
                                               _mm512_load_ps(acc + (i * 4 + v) * 16));
                        }
                    }
                }
        }
    }
    free(off);
    return 0;
}

/* Seconds for `iterations` rounds of 24 independent vdpbf16ps chains (64 flops each):
 * the instruction's rate on this core, against which ttile_fma_peak_avx512 decides
 * whether the dot-product kernel is worth serving (see bf16.kernel_kind). As in
 * fma_peak_avx512.c, an empty asm reading a few chains keeps the loop alive without
 * constraining the register allocation. */
double ttile_dot_bf16_peak_seconds(int64_t iterations)
{
    __m512 acc[24];
    for (int i = 0; i < 24; i++)
        acc[i] = _mm512_set1_ps((float)i * 1e-3f);
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);   /* 1.0 */
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);   /* 2^-24 */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : : "v"(acc[0]), "v"(acc[1]), "v"(acc[2]), "v"(acc[3]));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m512 sum = acc[0];
    for (int i = 1; i < 24; i++)
        sum = _mm512_add_ps(sum, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
