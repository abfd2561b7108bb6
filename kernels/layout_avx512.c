/* AVX-512 tiles for the layout conversions of layout.c: 16 x 16 floats transposed in
 * registers (ttile_transpose16_512, shared with the kernels' NCHW stores), loads and
 * stores masked at the edges. About three times the scalar loop's speed, which ran at
 * one element per cycle, far below memory bandwidth. Called only when cpuid said yes. */
#include <immintrin.h>

#include "ttile_epilogue.h"
#include "ttile_runtime.h"

/* v = the transpose of the nr x 16 block at src (rows sstride apart, columns masked by
 * cmask; rows past nr zero). */
static inline void load_transposed(const float *src, int64_t sstride, int64_t nr,
                                   __mmask16 cmask, __m512 v[16])
{
    for (int64_t i = 0; i < 16; i++)
        v[i] = i < nr ? _mm512_maskz_loadu_ps(cmask, src + i * sstride) : _mm512_setzero_ps();
    ttile_transpose16_512(v);
}

void ttile_regroup_tile_avx512(const float *src, int64_t sstride, float *dst,
                               int64_t dstride, int64_t rows, int64_t cols, int64_t first,
                               int64_t group, int64_t groups)
{
    /* The weights' (c, rs) columns reordered to (rs, c) rows: rows outermost, 16 read
     * streams along all the columns (columns outermost read 64 rows' streams at once and
     * made per-call packing of ResNet18-12's 9.4 MB 1.7x slower). */
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        const __mmask16 rmask = (__mmask16)((1u << nr) - 1u);
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            const int64_t nc = cols - c0 < 16 ? cols - c0 : 16;
            const __mmask16 cmask = (__mmask16)((1u << nc) - 1u);
            __m512 v[16];
            load_transposed(src + r0 * sstride + c0, sstride, nr, cmask, v);
            for (int64_t j = 0; j < nc; j++) {
                const int64_t c = first + c0 + j;
                const int64_t row = group == 1 ? c : (c % group) * groups + c / group;
                _mm512_mask_storeu_ps(dst + row * dstride + r0, rmask, v[j]);
            }
        }
    }
}

void ttile_transpose_tile_avx512(const float *src, int64_t sstride, float *dst,
                                 int64_t dstride, int64_t rows, int64_t cols,
                                 int64_t first, int64_t group, int64_t groups, int stream)
{
    /* dst[row(first + c) * dstride + r] = src[r * sstride + c] for r < rows, c < cols,
     * where row(x) = (x % group) * groups + x / group: the identity for group 1, and for
     * the weights' (c, rs) columns the reordering to (rs, c) (which
     * ttile_regroup_tile_avx512 does in its own order).
     *
     * Columns outermost: 16 destination rows are written along all the tile's rows
     * before the next 16 start. Rows outermost wrote one line into each of the tile's
     * destination rows per 16 source rows - an NHWC output of 64 channels into 64 NCHW
     * planes at once - and ran at 16 GB/s where this order runs at 45 (272 x 272 x 64,
     * Zen 5, 1 thread). With `stream`, whole aligned destination lines go out with
     * non-temporal stores (outputs far larger than the caches: 75 GB/s there). */
    if (group != 1) {
        ttile_regroup_tile_avx512(src, sstride, dst, dstride, rows, cols, first, group,
                                  groups);
        return;
    }
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        const int64_t nc = cols - c0 < 16 ? cols - c0 : 16;
        const __mmask16 cmask = (__mmask16)((1u << nc) - 1u);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
            const __mmask16 rmask = (__mmask16)((1u << nr) - 1u);
            __m512 v[16];
            if (nr == 16 && nc == 16) {
                /* a whole tile: constant trip counts, so v stays in registers */
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    v[i] = _mm512_loadu_ps(src + (r0 + i) * sstride + c0);
                ttile_transpose16_512(v);
                ttile_store_rows512(dst + (first + c0) * dstride + r0, dstride, v, stream);
                continue;
            }
            load_transposed(src + r0 * sstride + c0, sstride, nr, cmask, v);
            for (int64_t j = 0; j < nc; j++) {
                float *d = dst + (first + c0 + j) * dstride + r0;
                if (stream && nr == 16 && ((uintptr_t)d & 63) == 0)
                    _mm512_stream_ps(d, v[j]);
                else
                    _mm512_mask_storeu_ps(d, rmask, v[j]);
            }
        }
    }
    if (stream)
        _mm_sfence();   /* the streamed lines are in memory before anything reads them */
}

void ttile_subsample_plane2_avx512(const float *src, float *dst, int64_t w, int64_t sh,
                                   int64_t ho, int64_t wo)
{
    /* dst[oh][i] = src[oh sh][2 i], i < wo, for a plane of ho output rows: 32 floats in,
     * the even ones out (vpermt2ps); the loads are masked to the 2 wo - 1 floats a row
     * holds from its start. A plane per call: a call per row cost more than the row
     * (ResNet18-5's 1792 rows of 28: 11 us gathered that way). */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                           26, 28, 30);
    for (int64_t oh = 0; oh < ho; oh++) {
        const float *s = src + oh * sh * w;
        float *d = dst + oh * wo;
        for (int64_t o = 0; o < wo; o += 16) {
            const int64_t n = wo - o < 16 ? wo - o : 16;
            const int64_t span = 2 * n - 1;   /* floats read: s[2 o] .. s[2 (o + n - 1)] */
            const __mmask16 ma = (__mmask16)(span >= 16 ? 0xFFFFu : (1u << span) - 1u);
            const __mmask16 mb = (__mmask16)(span > 16 ? (1u << (span - 16)) - 1u : 0u);
            const __m512 a = _mm512_maskz_loadu_ps(ma, s + 2 * o);
            const __m512 b = _mm512_maskz_loadu_ps(mb, s + 2 * o + 16);
            _mm512_mask_storeu_ps(d + o, (__mmask16)((1u << n) - 1u),
                                  _mm512_permutex2var_ps(a, even, b));
        }
    }
}

void ttile_interleave_small_avx512(const float *src, float *dst, int64_t c, int64_t hw,
                                   int64_t p0, int64_t p1)
{
    /* dst[p][ch] = src[ch][p] for p in [p0, p1), c <= 4 channels: 16 pixels of each
     * channel in a vector, then c output vectors of 16 (pixel, channel) pairs, each
     * gathered from the channel vectors by masked permutes (lane i of output vector o is
     * pixel (16 o + i) / c, channel (16 o + i) % c); full-vector stores. A 16 x 16 tile
     * per 16 pixels had 3 useful rows of 16 and 16 stores of 12 bytes for an RGB image
     * (ResNet18-1's 224x224: 60 us). */
    __m512i idx[4];
    __mmask16 take[4][4];
    for (int o = 0; o < c; o++) {
        int lanes[16];
        unsigned bits[4] = {0, 0, 0, 0};
        for (int i = 0; i < 16; i++) {
            lanes[i] = (16 * o + i) / (int)c;
            bits[(16 * o + i) % c] |= 1u << i;
        }
        idx[o] = _mm512_loadu_si512(lanes);
        for (int ch = 0; ch < c; ch++)
            take[o][ch] = (__mmask16)bits[ch];
    }
    for (int64_t p = p0; p < p1; p += 16) {
        const int64_t n = p1 - p < 16 ? p1 - p : 16;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        __m512 in[4];
        for (int ch = 0; ch < c; ch++)
            in[ch] = _mm512_maskz_loadu_ps(valid, src + ch * hw + p);
        float *d = dst + p * c;
        const int64_t floats = n * c;
        for (int o = 0; o < c && 16 * o < floats; o++) {
            __m512 v = _mm512_setzero_ps();
            for (int ch = 0; ch < c; ch++)
                v = _mm512_mask_permutexvar_ps(v, take[o][ch], idx[o], in[ch]);
            const int64_t left = floats - 16 * o;
            _mm512_mask_storeu_ps(d + 16 * o,
                                  (__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u), v);
        }
    }
}

int ttile_packed_rows_differ_avx512(const float *w, int64_t k, int64_t panel, int64_t p,
                                    int64_t i0, int64_t i1, const float *out)
{
    /* Rows [i0, i1) of panel p (out points at the panel) against the RSCK rows they were
     * packed from, as 32-bit words, 16 at a time (ttile_packed_matches). */
    const int64_t valid = k - p * panel < panel ? k - p * panel : panel;
    const int64_t whole = valid & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (valid - whole)) - 1u);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = i0; i < i1; i++) {
        const float *a = w + i * k + p * panel, *q = out + i * panel;
        for (int64_t j = 0; j < whole; j += 16)
            acc = _mm512_or_si512(acc, _mm512_xor_si512(_mm512_loadu_si512(a + j),
                                                         _mm512_loadu_si512(q + j)));
        if (tail)
            acc = _mm512_or_si512(acc, _mm512_xor_si512(
                _mm512_maskz_loadu_epi32(tail, a + whole),
                _mm512_maskz_loadu_epi32(tail, q + whole)));
    }
    return _mm512_test_epi32_mask(acc, acc) != 0;
}
