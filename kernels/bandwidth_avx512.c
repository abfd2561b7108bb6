/* Read-bandwidth microbenchmark: the model weighs data moved into each cache level by
 * the measured cost of bringing it from the level below. Sums a buffer with 8 independent
 * AVX-512 accumulators so the loop is bound by loads, not by the add latency. */
#include <immintrin.h>
#include <time.h>
#include "ttile_runtime.h"

double ttile_read_seconds_avx512(const float *buffer, int64_t floats, int64_t reps)
{
    __m512 acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = _mm512_setzero_ps();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t rep = 0; rep < reps; rep++) {
        for (int64_t i = 0; i + 128 <= floats; i += 128) {
            for (int j = 0; j < 8; j++)
                acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(buffer + i + 16 * j));
        }
        __asm__ volatile("" : : "v"(acc[0]), "v"(acc[1]) : "memory");
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m512 sum = acc[0];
    for (int i = 1; i < 8; i++)
        sum = _mm512_add_ps(sum, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
