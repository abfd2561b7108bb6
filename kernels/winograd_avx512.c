/* The Winograd F(4x4, 3x3) kernel for AVX-512F (winograd_conv.inc, 512-bit vectors).
 *
 * Register blocks of phase 2: up to 4 vectors of 16 output channels by 6 tiles (24
 * accumulators + 4 weight vectors + 1 broadcast = 29 of the 32 zmm registers), or 3 x 8,
 * 2 x 12, 1 x 24: the generic kernel's blocks. Channel tails use the opmask registers. */
#include <immintrin.h>
#include "ttile_runtime.h"

#define W_LANES 16
#define W_VEC __m512
#define W_MASK __mmask16
#define W_NAME(f) f##_avx512
#define W_ZERO() _mm512_setzero_ps()
#define W_LOAD(p) _mm512_loadu_ps(p)
#define W_STORE(p, v) _mm512_storeu_ps(p, v)
#define W_SET1(v) _mm512_set1_ps(v)
#define W_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define W_FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define W_ADD(a, b) _mm512_add_ps(a, b)
#define W_SUB(a, b) _mm512_sub_ps(a, b)
#define W_MUL(a, b) _mm512_mul_ps(a, b)
#define W_MASKZ_LOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define W_MASK_STORE(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define W_EPILOGUE_STORE ttile_epilogue_store512

static inline __mmask16 W_TAIL_MASK(int64_t remaining)
{
    if (remaining >= 16)
        return (__mmask16)0xFFFF;
    if (remaining <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << remaining) - 1u);
}

#define WG_MAX_KV 4
/* the widest block per vector count: NW * KV accumulators + KV weights + 1 broadcast */
#define WG_BLOCKS(X) X(4, 6) X(3, 8) X(2, 12) X(1, 24)

#include "winograd_conv.inc"
