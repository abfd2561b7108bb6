/* AVX2 tiles for the layout conversions of layout.c and the weight check of
 * pack_weights.c, for the CPUs without AVX-512: 8 x 8 floats transposed in registers,
 * the tile's ragged edges in plain C. The scalar loop moves about one float per cycle,
 * far below memory bandwidth, and an NCHW call on such a CPU converts its input (and a
 * searched kernel's output) this way. Compiled with -mavx2 -mfma only; called only when
 * cpuid said yes (isa code 2). */
#include <immintrin.h>
#include <stdint.h>

#include "ttile_runtime.h"

/* v[i] = column i of the 8 x 8 block whose rows are v[0..7]. */
static inline void transpose8(__m256 v[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

void ttile_transpose_tile_avx2(const float *src, int64_t sstride, float *dst,
                               int64_t dstride, int64_t rows, int64_t cols, int64_t first,
                               int64_t group, int64_t groups, int stream)
{
    /* dst[row(first + c) * dstride + r] = src[r * sstride + c] for r < rows, c < cols,
     * row(x) = (x % group) * groups + x / group (ttile_transpose_tile_portable's
     * contract). Columns outermost, as the AVX-512 tiles: 8 destination rows are written
     * along all the tile's rows before the next 8 start. With `stream`, whole aligned
     * destination vectors go out with non-temporal stores. */
    const int64_t whole_rows = rows & ~(int64_t)7, whole_cols = cols & ~(int64_t)7;
    for (int64_t c0 = 0; c0 < whole_cols; c0 += 8) {
        float *d[8];
        for (int j = 0; j < 8; j++) {
            const int64_t x = first + c0 + j;
            d[j] = dst + (group == 1 ? x : (x % group) * groups + x / group) * dstride;
        }
        for (int64_t r0 = 0; r0 < whole_rows; r0 += 8) {
            __m256 v[8];
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                v[i] = _mm256_loadu_ps(src + (r0 + i) * sstride + c0);
            transpose8(v);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                if (stream && ((uintptr_t)(d[j] + r0) & 31) == 0)
                    _mm256_stream_ps(d[j] + r0, v[j]);
                else
                    _mm256_storeu_ps(d[j] + r0, v[j]);
            }
        }
        for (int64_t r = whole_rows; r < rows; r++)
            for (int j = 0; j < 8; j++)
                d[j][r] = src[r * sstride + c0 + j];
    }
    if (whole_cols < cols)
        ttile_transpose_tile_portable(src + whole_cols, sstride, dst, dstride, rows,
                                      cols - whole_cols, first + whole_cols, group, groups, 0);
    if (stream)
        _mm_sfence();   /* the streamed lines are in memory before anything reads them */
}

int ttile_packed_rows_differ_avx2(const float *w, int64_t k, int64_t panel, int64_t p,
                                  int64_t i0, int64_t i1, const float *out)
{
    /* Rows [i0, i1) of panel p (out points at the panel) against the RSCK rows they were
     * packed from, as 32-bit words, 8 at a time (ttile_packed_matches). */
    const int64_t valid = k - p * panel < panel ? k - p * panel : panel;
    const int64_t whole = valid & ~(int64_t)7;
    __m256i acc = _mm256_setzero_si256();
    uint32_t rest = 0;
    for (int64_t i = i0; i < i1; i++) {
        const float *a = w + i * k + p * panel, *q = out + i * panel;
        for (int64_t j = 0; j < whole; j += 8)
            acc = _mm256_or_si256(acc, _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(a + j)),
                _mm256_loadu_si256((const __m256i *)(q + j))));
        for (int64_t j = whole; j < valid; j++)
            rest |= ((const uint32_t *)a)[j] ^ ((const uint32_t *)q)[j];
    }
    return !_mm256_testz_si256(acc, acc) || rest != 0;
}
