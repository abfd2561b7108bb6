/* The generic convolution's vector names for AVX-512F (the names generic_conv.inc and
 * generic_blocks.inc are written in, here with 512-bit vectors).
 *
 * Block set: up to 4 vectors of 16 output channels by 6 outputs along w (24
 * accumulators + 4 weight vectors + 1 broadcast = 29 of the 32 zmm registers), or 3 x 8,
 * 2 x 12, 1 x 24 when K is smaller: the shapes the microkernel table measured best
 * ([U6 w; U4 k], [U8 w; U3 k], [U12 w; U2 k]). K tails use the opmask registers. */
#ifndef TTILE_GENERIC_AVX512_H
#define TTILE_GENERIC_AVX512_H
#include <immintrin.h>
#include "ttile_runtime.h"

#define G_LANES 16
#define G_VEC __m512
#define G_MASK __mmask16
#define G_NAME(f) f##_avx512
#define G_ZERO() _mm512_setzero_ps()
#define G_LOAD(p) _mm512_loadu_ps(p)
#define G_SET1(v) _mm512_set1_ps(v)
#define G_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define G_ADD(a, b) _mm512_add_ps(a, b)
#define G_STREAM(p, v) _mm512_stream_ps(p, v)   /* a whole line, past the caches */
#define G_MAX(a, b) _mm512_max_ps(a, b)
#define G_MIN(a, b) _mm512_min_ps(a, b)
#define G_MASKZ_LOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define G_MASK_STORE(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define G_EPILOGUE_APPLY ttile_epilogue_apply512
#define G_EPILOGUE_ROW ttile_epilogue_row512
#define G_TRANSPOSE_TILE ttile_transpose_tile_avx512
#define G_LAYOUT_ISA TTILE_LAYOUT_AVX512   /* the layout helpers may use AVX-512 */

static inline __mmask16 G_TAIL_MASK(int64_t remaining)
{
    if (remaining >= 16)
        return (__mmask16)0xFFFF;
    if (remaining <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << remaining) - 1u);
}

#define MAX_KV 4
#define GENERIC_KV(X) X(4, 6) X(3, 8) X(2, 12) X(1, 24)

#endif
