/* The AVX2 + FMA counterparts of fma_peak_avx512.c and bandwidth_avx512.c: the peak the
 * AVX2 family's microkernels are stated against, and the read bandwidths the model
 * weighs data movement by, on CPUs without AVX-512 (and for the AVX2 family anywhere).
 * Compiled with -mavx2 -mfma only; called only after the run-time check. */
#include <immintrin.h>
#include <time.h>
#include "ttile_runtime.h"

/* 12 independent chains: 2 FMA pipes x 4-5 cycles of latency need 8-10, and 12 chains
 * plus the two constants fit the 16 ymm registers. */
#define CHAINS 12

static double elapsed(struct timespec t0, struct timespec t1)
{
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

static float horizontal_sum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

double ttile_fma_peak_avx2(int64_t iterations)
{
    __m256 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++)
        acc[i] = _mm256_set1_ps((float)i * 1e-3f);
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++)
            acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        __asm__ volatile("" : : "x"(acc[0]), "x"(acc[1]), "x"(acc[2]), "x"(acc[3]));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m256 sum = acc[0];
    for (int i = 1; i < CHAINS; i++)
        sum = _mm256_add_ps(sum, acc[i]);
    volatile float sink = horizontal_sum(sum);
    (void)sink;
    return elapsed(t0, t1);
}

double ttile_read_seconds_avx2(const float *buffer, int64_t floats, int64_t reps)
{
    __m256 acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = _mm256_setzero_ps();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t rep = 0; rep < reps; rep++) {
        for (int64_t i = 0; i + 64 <= floats; i += 64) {
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps(buffer + i + 8 * j));
        }
        __asm__ volatile("" : : "x"(acc[0]), "x"(acc[1]) : "memory");
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m256 sum = acc[0];
    for (int i = 1; i < 8; i++)
        sum = _mm256_add_ps(sum, acc[i]);
    volatile float sink = horizontal_sum(sum);
    (void)sink;
    return elapsed(t0, t1);
}
