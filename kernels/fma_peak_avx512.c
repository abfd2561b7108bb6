/* FMA-throughput microbenchmark used to state results as a percentage of peak.
 *
 * 24 independent accumulator chains hide the FMA latency (4 cycles) on two FMA ports
 * with room to spare, so the loop is bound by FMA throughput alone. Compiled with
 * -mavx512f and called only after the run-time check. */
#include <immintrin.h>
#include <time.h>
#include "ttile_runtime.h"

#define CHAINS 24

double ttile_fma_peak_avx512(int64_t iterations)
{
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++)
        acc[i] = _mm512_set1_ps((float)i * 1e-3f);
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 24
        for (int i = 0; i < CHAINS; i++)
            acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        /* An empty asm that reads some chains keeps the loop from being folded away
         * while leaving the register allocation alone (in/out constraints on all 24
         * chains made GCC serialize the loop and measured a third of the peak). */
        __asm__ volatile("" : : "v"(acc[0]), "v"(acc[1]), "v"(acc[2]), "v"(acc[3]));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m512 sum = acc[0];
    for (int i = 1; i < CHAINS; i++)
        sum = _mm512_add_ps(sum, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
