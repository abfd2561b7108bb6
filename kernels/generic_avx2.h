/* The generic convolution's vector names for AVX2 + FMA (the names generic_conv.inc and
 * generic_blocks.inc are written in, here with 256-bit vectors).
 * the CPUs without AVX-512 (AMD Zen 2/3, most Intel client parts).
 *
 * Block set: with 16 ymm registers, 3 vectors of 8 output channels by 4 outputs along w
 * (12 accumulators + 3 weight vectors + 1 broadcast = 16), 2 x 6 (15: BLIS's Haswell
 * sgemm block), or 1 x 12 when K is smaller. AVX2 has no opmask registers: K tails use
 * vmaskmovps with an integer lane mask, which, like AVX-512's masks, never touches the
 * memory of a masked-off lane; whole vectors are stored plainly (ttile_maskstore256). Compiled with -mavx2 -mfma only: nothing here executes
 * an AVX-512 instruction. */
#ifndef TTILE_GENERIC_AVX2_H
#define TTILE_GENERIC_AVX2_H
#include <immintrin.h>
#include "ttile_runtime.h"

#define G_LANES 8
#define G_VEC __m256
#define G_MASK __m256i
#define G_NAME(f) f##_avx2
#define G_ZERO() _mm256_setzero_ps()
#define G_LOAD(p) _mm256_loadu_ps(p)
#define G_SET1(v) _mm256_set1_ps(v)
#define G_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define G_ADD(a, b) _mm256_add_ps(a, b)
#define G_STREAM(p, v) _mm256_stream_ps(p, v)   /* half a line, past the caches */
#define G_MAX(a, b) _mm256_max_ps(a, b)
#define G_MIN(a, b) _mm256_min_ps(a, b)
#define G_MASKZ_LOAD(m, p) _mm256_maskload_ps(p, m)
#define G_MASK_STORE(p, m, v) ttile_maskstore256(p, m, v)   /* plain when whole */
#define G_EPILOGUE_APPLY ttile_epilogue_apply256
#define G_EPILOGUE_ROW ttile_epilogue_row256
#define G_TRANSPOSE_TILE ttile_transpose_tile_avx2
#define G_LAYOUT_ISA TTILE_LAYOUT_AVX2   /* the layout helpers' AVX2 tiles */
#define G_TAIL_MASK ttile_tail_mask256

#define MAX_KV 3
/* Direct RSCK on rows of two blocks too (a 7-pixel row: 4 + 3 pixels by 3 vectors). */
#define G_DIRECT_BLOCKS 2
#define GENERIC_KV(X) X(3, 4) X(2, 6) X(1, 12)

#endif
