/* Pooling on NHWC arrays: the max pooling and global average pooling that sit between
 * the convolutions of ResNets and MobileNets, so that a converted network's sequence of
 * ttile layers runs through them without a torch call (torch's MaxPool2d took 0.74 ms
 * of ResNet-50's 57 at 1 thread on a Xeon model 167, its input fresh from the stem
 * convolution: a call into torch after a kernel meets cold caches).
 *
 * The max pooling runs pool_avx512.c's windows-in-registers loop where the caller says
 * AVX-512F (isa, as for the layout conversions); otherwise plain C, whose channel loops are contiguous and vectorize as
 * they are, in one clone per vector family that the loader picks for the CPU
 * (target_clones; the baseline clone's 4-lane max took 317 us on ResNet-50's
 * 112x112x64 at 1 thread, Xeon model 167). Threads split output rows (max) or channel
 * chunks (average). */
#include <stdint.h>
#include <string.h>
#include "pool_window.h"
#include "ttile_runtime.h"

#define POOL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

/* The window loop of both element types: T the element, GT(v, o) "v replaces o". */
#define MAXPOOL_BODY(T, GT)                                                              \
    POOL_FOR_EACH_WINDOW(                                                                \
        T *restrict out = y + ((b * ho + oh) * wo + ow) * c;                             \
        memcpy(out, x + ((b * h + r_lo) * w + s_lo) * c, (size_t)c * sizeof(T));         \
        for (int64_t r = r_lo; r < r_hi; r++)                                            \
            for (int64_t s = (r == r_lo ? s_lo + 1 : s_lo); s < s_hi; s++) {             \
                const T *restrict in = x + ((b * h + r) * w + s) * c;                    \
                for (int64_t k = 0; k < c; k++) {                                        \
                    const T v = in[k], o = out[k];                                       \
                    out[k] = GT(v, o) ? v : o;                                           \
                }                                                                        \
            })

/* as torch: a NaN in the window is the window's maximum */
#define F32_GT(v, o) ((v) > (o) || (v) != (v))

POOL_CLONES static void maxpool_nhwc(const float *x, float *y, int64_t n, int64_t h,
                                     int64_t w, int64_t c, int64_t kh, int64_t kw,
                                     int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                     int64_t ho, int64_t wo, int nthreads)
{
    MAXPOOL_BODY(float, F32_GT)
}

void ttile_maxpool_nhwc(const float *x, float *y, int64_t n, int64_t h, int64_t w,
                        int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                        int64_t ph, int64_t pw, int64_t ho, int64_t wo, int nthreads,
                        int isa)
{
    if (isa == TTILE_LAYOUT_AVX512) {   /* pool_avx512.c */
        ttile_maxpool_nhwc_avx512(x, y, n, h, w, c, kh, kw, sh, sw, ph, pw, ho, wo,
                                  nthreads);
        return;
    }
    maxpool_nhwc(x, y, n, h, w, c, kh, kw, sh, sw, ph, pw, ho, wo, nthreads);
}

/* The same on bf16 bits: rounding to bf16 keeps the order of values, so the maximum of
 * the rounded window is the rounded maximum, and a bf16 network's activations stay bf16
 * through the pooling (ResNet's, after its first layer: half the bytes, and the 1x1
 * layers after it read their input in place). Each pair compared as the fp32 values the
 * bits are. */
static inline float pool_widen(uint16_t bits)
{
    const uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#define BF16_GT(v, o) F32_GT(pool_widen(v), pool_widen(o))

POOL_CLONES static void maxpool_nhwc_bf16(const uint16_t *x, uint16_t *y, int64_t n,
                                          int64_t h, int64_t w, int64_t c, int64_t kh,
                                          int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                                          int64_t pw, int64_t ho, int64_t wo, int nthreads)
{
    MAXPOOL_BODY(uint16_t, BF16_GT)
}

void ttile_maxpool_nhwc_bf16(const uint16_t *x, uint16_t *y, int64_t n, int64_t h,
                             int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh,
                             int64_t sw, int64_t ph, int64_t pw, int64_t ho, int64_t wo,
                             int nthreads, int isa)
{
    if (isa == TTILE_LAYOUT_AVX512) {   /* pool_avx512.c */
        ttile_maxpool_nhwc_bf16_avx512(x, y, n, h, w, c, kh, kw, sh, sw, ph, pw, ho, wo,
                                       nthreads);
        return;
    }
    maxpool_nhwc_bf16(x, y, n, h, w, c, kh, kw, sh, sw, ph, pw, ho, wo, nthreads);
}

/* Channels summed in chunks of this many floats per task: a chunk's sums stay in
 * registers and L1 while the pixels go by. */
#define POOL_CHUNK 256

POOL_CLONES void ttile_global_avgpool_nhwc(const float *x, float *y, int64_t n,
                                           int64_t hw, int64_t c, int nthreads)
{
    const int64_t chunks = (c + POOL_CHUNK - 1) / POOL_CHUNK;
    const float scale = 1.0f / (float)hw;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < n; b++)
        for (int64_t q = 0; q < chunks; q++) {
            const int64_t k0 = q * POOL_CHUNK;
            const int64_t kn = c - k0 < POOL_CHUNK ? c - k0 : POOL_CHUNK;
            float acc[POOL_CHUNK];
            const float *restrict in = x + b * hw * c + k0;
            for (int64_t k = 0; k < kn; k++)
                acc[k] = in[k];
            for (int64_t p = 1; p < hw; p++)
                for (int64_t k = 0; k < kn; k++)
                    acc[k] += in[p * c + k];
            float *restrict out = y + b * c + k0;
            for (int64_t k = 0; k < kn; k++)
                out[k] = acc[k] * scale;
        }
}
