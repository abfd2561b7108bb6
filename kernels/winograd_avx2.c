/* The Winograd F(4x4, 3x3) kernel for AVX2 + FMA (winograd_conv.inc, 256-bit vectors),
 * for the CPUs without AVX-512 (AMD Zen 2/3, most Intel client parts).
 *
 * Register blocks of phase 2, within 16 ymm registers: 3 vectors of 8 output channels by
 * 4 tiles (12 accumulators + 3 weight vectors + 1 broadcast = 16), 2 x 6 or 1 x 12: the
 * AVX2 generic kernel's blocks. Channel tails use vmaskmovps with an integer lane mask;
 * whole vectors are stored plainly (ttile_maskstore256: a masked store costs about ten
 * plain ones on AMD Zen 3).
 * Compiled with -mavx2 -mfma only: nothing here executes an AVX-512 instruction. */
#include <immintrin.h>
#include "ttile_runtime.h"

#define W_LANES 8
#define W_VEC __m256
#define W_MASK __m256i
#define W_NAME(f) f##_avx2
#define W_ZERO() _mm256_setzero_ps()
#define W_LOAD(p) _mm256_loadu_ps(p)
#define W_STORE(p, v) _mm256_storeu_ps(p, v)
#define W_SET1(v) _mm256_set1_ps(v)
#define W_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define W_FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define W_ADD(a, b) _mm256_add_ps(a, b)
#define W_SUB(a, b) _mm256_sub_ps(a, b)
#define W_MUL(a, b) _mm256_mul_ps(a, b)
#define W_MASKZ_LOAD(m, p) _mm256_maskload_ps(p, m)
#define W_MASK_STORE(p, m, v) ttile_maskstore256(p, m, v)   /* plain when whole */
#define W_EPILOGUE_STORE ttile_epilogue_store256
#define W_TAIL_MASK ttile_tail_mask256

#define WG_MAX_KV 3
/* the widest block per vector count: NW * KV accumulators + KV weights + 1 broadcast */
#define WG_BLOCKS(X) X(3, 4) X(2, 6) X(1, 12)

#include "winograd_conv.inc"
