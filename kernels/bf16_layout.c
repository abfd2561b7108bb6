/* The bf16 kernels' packing (formats in ttile_bf16.h): the input rounded to bf16 into
 * padded NHWC with its zeros written out, the weights into 16-channel blocks of channel
 * pairs. One pass each, in parallel over rows or blocks. AVX-512F + BW + VL. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "ttile_bf16.h"

/* Values i0 .. i1 - 1 of src rounded into dst, on the calling thread. */
static void from_f32_run(const float *src, uint16_t *dst, int64_t i0, int64_t i1)
{
    for (int64_t i = i0; i < i1; i += 16) {
        const __mmask16 m = ttile_bf16_kmask(i, i1);
        _mm256_mask_storeu_epi16(dst + i, m,
                                 ttile_bf16_round512(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

void ttile_bf16_from_f32(const float *src, uint16_t *dst, int64_t n, int nthreads)
{
    const int64_t blocks = (n + 4095) / 4096;
    if (nthreads <= 1 || n <= 65536) {
        /* no parallel region: libgomp enters and leaves even a one-thread team through a
         * futex call, which a caller converting row by row paid per row */
        from_f32_run(src, dst, 0, n);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++)
        from_f32_run(src, dst, b * 4096, (b + 1) * 4096 < n ? (b + 1) * 4096 : n);
}

void ttile_bf16_to_f32(const uint16_t *src, float *dst, int64_t n, int nthreads)
{
    const int64_t blocks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n > 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * 4096 < n ? (b + 1) * 4096 : n;
        for (int64_t i = b * 4096; i < end; i += 16) {
            const __mmask16 m = ttile_bf16_kmask(i, end);
            _mm512_mask_storeu_ps(dst + i, m,
                                  ttile_bf16_widen512(_mm256_maskz_loadu_epi16(m, src + i)));
        }
    }
}

void ttile_bf16_round_f32(const float *src, float *dst, int64_t n, int nthreads)
{
    const int64_t blocks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n > 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * 4096 < n ? (b + 1) * 4096 : n;
        for (int64_t i = b * 4096; i < end; i += 16) {
            const __mmask16 m = ttile_bf16_kmask(i, end);
            _mm512_mask_storeu_ps(dst + i, m, ttile_bf16_widen512(ttile_bf16_round512(
                                                  _mm512_maskz_loadu_ps(m, src + i))));
        }
    }
}

int ttile_bf16_same_rounded(const float *src, const uint16_t *bits, int64_t n, int nthreads)
{
    /* Whether n floats, rounded as the packing rounds them, are the n bf16 values `bits`
     * holds: a per-call bf16 conv2d's check that the weights it packed are still the
     * caller's (src/ttile/runtime/weight_cache.py). A bf16 kernel reads the rounded
     * values only, so this reads the caller's fp32 weights and half their bytes again,
     * where a copy of the fp32 bytes was as many again; a change the rounding hides
     * changes nothing the kernel computes. Chunks in one static share per thread, as
     * ttile_same_bytes does (the same thread reads the same lines every call). */
    const int64_t chunk = 16384, chunks = (n + chunk - 1) / chunk;
    int differ = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 1) \
    reduction(| : differ)
    for (int64_t b = 0; b < chunks; b++) {
        const int64_t end = (b + 1) * chunk < n ? (b + 1) * chunk : n;
        __mmask16 changed = 0;
        for (int64_t i = b * chunk; i < end; i += 16) {
            const __mmask16 m = ttile_bf16_kmask(i, end);
            changed |= _mm256_mask_cmpneq_epi16_mask(
                m, ttile_bf16_round512(_mm512_maskz_loadu_ps(m, src + i)),
                _mm256_maskz_loadu_epi16(m, bits + i));
        }
        differ |= changed != 0;
    }
    return !differ;
}

/* One packed pixel (cp channels, c..cp-1 zero) from an NHWC pixel of c channels (fp32,
 * rounded, or bf16). */
static inline void pack_pixel_nhwc(const void *pixel, int x_bf16, int64_t c, int64_t cp,
                                   uint16_t *o)
{
    for (int64_t ch = 0; ch < cp; ch += 16) {
        const __mmask16 m = ttile_bf16_kmask(ch, c);
        const __m256i v = x_bf16 ? _mm256_maskz_loadu_epi16(m, (const uint16_t *)pixel + ch)
                                 : ttile_bf16_round512(
                                       _mm512_maskz_loadu_ps(m, (const float *)pixel + ch));
        _mm256_mask_storeu_epi16(o + ch, ttile_bf16_kmask(ch, cp), v);
    }
}

/* One packed row (wp pixels of cp channels) from an NHWC row of w pixels of c channels
 * (fp32 or bf16), pad_left zero pixels before it. */
static void pack_row_nhwc(const ttile_bf16_problem *p, const void *row, int x_bf16,
                          int64_t c, int64_t w, int64_t pad_left, uint16_t *out)
{
    const int64_t cp = p->cp;
    memset(out, 0, (size_t)(pad_left * cp) * sizeof(uint16_t));
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t j = 0; j < w; j++)
        pack_pixel_nhwc((const char *)row + j * c * elem, x_bf16, c, cp,
                        out + (pad_left + j) * cp);
    const int64_t right = p->wp - pad_left - w;
    if (right > 0)
        memset(out + (pad_left + w) * cp, 0, (size_t)(right * cp) * sizeof(uint16_t));
}

/* Pixels j0 .. j0 + 15 (lanes past the row's end zero) of channels c0 .. c0 + 15 (those
 * past c zero) of an NCHW image's row y, into packed pixels at `out` (cp bf16 apart):
 * 16 rows loaded (`cols` picks the columns), transposed in registers, rounded and stored
 * one pixel's 16 channels at a time. A channel at a time with a store per element took
 * half of a 1x1 NCHW layer's time (C128 K64 136x136, Xeon model 207). */
static inline void pack_block_nchw(const float *image, int64_t c, int64_t h, int64_t w,
                                   int64_t y, int64_t c0, int64_t cp, int64_t j0, int step2,
                                   __m512i cols, __mmask16 valid, int64_t pixels,
                                   uint16_t *out)
{
    __m512 v[16];
    if (!step2 && c0 + 16 <= c && pixels == 16) {
        /* a whole tile: constant trip counts, so v stays in registers */
        const float *row = image + (c0 * h + y) * w + j0;
        const int64_t plane = h * w;
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            v[i] = _mm512_loadu_ps(row + i * plane);
        ttile_transpose16_512(v);
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            _mm256_storeu_si256((__m256i *)(out + j * cp + c0), ttile_bf16_round512(v[j]));
        return;
    }
    for (int64_t i = 0; i < 16; i++) {
        const float *row = image + ((c0 + i) * h + y) * w;
        v[i] = c0 + i >= c ? _mm512_setzero_ps()
               : step2     ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, cols, row, 4)
                           : _mm512_maskz_loadu_ps(valid, row + j0);
    }
    ttile_transpose16_512(v);
    const __mmask16 m = ttile_bf16_kmask(c0, c);
    for (int64_t j = 0; j < pixels; j++)
        _mm256_mask_storeu_epi16(out + j * cp + c0, m, ttile_bf16_round512(v[j]));
}

/* The w pixels of an NCHW image's row y (fp32, c channel planes of h x w), rounded, to
 * out, pixel j at out + j cp (its channels c..cp-1 untouched): 16 channels' rows read
 * along the whole row at a time, 16 read streams (all c rows at once, 64 bytes each,
 * ran at a third of the speed). */
static void pack_pixels_nchw(const float *image, int64_t c, int64_t h, int64_t w,
                             int64_t y, int64_t cp, uint16_t *out)
{
    for (int64_t c0 = 0; c0 < c; c0 += 16)
        for (int64_t j0 = 0; j0 < w; j0 += 16)
            pack_block_nchw(image, c, h, w, y, c0, cp, j0, 0, _mm512_setzero_si512(),
                            ttile_bf16_kmask(j0, w), w - j0 < 16 ? w - j0 : 16,
                            out + j0 * cp);
}

/* One packed row from an NCHW image (fp32): channel planes of h x w, row `y`. */
static void pack_row_nchw(const ttile_bf16_problem *p, const float *image, int64_t c,
                          int64_t h, int64_t w, int64_t y, int64_t pad_left, uint16_t *out)
{
    memset(out, 0, (size_t)(p->wp * p->cp) * sizeof(uint16_t));
    pack_pixels_nchw(image, c, h, w, y, p->cp, out + pad_left * p->cp);
}

/* One row of a phase plane (ttile_bf16.h): wp pixels, pixel j from column 2 j + first
 * of the input row (zero outside 0..w-1); NHWC (fp32 or bf16) or, with `nchw`, the
 * input's row `y` of an NCHW image. */
static void pack_row_phase(const ttile_bf16_problem *p, const void *src, int x_bf16,
                           int nchw, int64_t c, int64_t h, int64_t w, int64_t y,
                           int64_t first, uint16_t *out)
{
    const int64_t cp = p->cp;
    if (nchw) {   /* 16 pixels at a time: columns first + 2 j gathered, transposed */
        memset(out, 0, (size_t)(p->wp * cp) * sizeof(uint16_t));
        const __m512i lanes = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                                24, 26, 28, 30);
        for (int64_t c0 = 0; c0 < c; c0 += 16)
            for (int64_t j0 = 0; j0 < p->wp; j0 += 16) {
                const __m512i cols = _mm512_add_epi32(
                    lanes, _mm512_set1_epi32((int)(2 * j0 + first)));
                const __mmask16 valid =
                    _mm512_cmpge_epi32_mask(cols, _mm512_setzero_si512())
                    & _mm512_cmplt_epi32_mask(cols, _mm512_set1_epi32((int)w));
                pack_block_nchw((const float *)src, c, h, w, y, c0, cp, 0, 1, cols, valid,
                                p->wp - j0 < 16 ? p->wp - j0 : 16, out + j0 * cp);
            }
        return;
    }
    for (int64_t j = 0; j < p->wp; j++) {
        uint16_t *o = out + j * cp;
        const int64_t col = 2 * j + first;
        if (col < 0 || col >= w) {
            memset(o, 0, (size_t)cp * sizeof(uint16_t));
            continue;
        }
        pack_pixel_nhwc((const char *)src + col * c * (x_bf16 ? sizeof(uint16_t) : sizeof(float)),
                        x_bf16, c, cp, o);
    }
}

/* The phase planes of a stride-2 problem (p->phases): plane (a, b) row i is the padded
 * image's row 2 i + a, its pixels the columns b, b + 2, ... */
static void pack_input_phases(const ttile_bf16_problem *p, const void *x, int x_bf16,
                              int nchw, int64_t c, int64_t h, int64_t w, int64_t pad_top,
                              int64_t pad_left, uint16_t *xb, int nthreads)
{
    const int64_t row = p->wp * p->cp, pr = ttile_bf16_plane_rows(p);
    const int64_t pc = ttile_bf16_plane_cols(p), rows = p->n * pr * pc * p->hp;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = i / (pr * pc * p->hp), plane = i / p->hp % (pr * pc);
        const int64_t a = plane / pc, b = plane % pc;
        const int64_t y = 2 * (i % p->hp) + a - pad_top;
        uint16_t *out = xb + i * row;
        if (y < 0 || y >= h)
            memset(out, 0, (size_t)row * sizeof(uint16_t));
        else if (nchw)
            pack_row_phase(p, (const float *)x + n * c * h * w, 0, 1, c, h, w, y,
                           b - pad_left, out);
        else
            pack_row_phase(p, (const char *)x + ((n * h + y) * w * c) * elem, x_bf16, 0, c,
                           h, w, y, b - pad_left, out);
    }
    memset(xb + rows * row, 0, (size_t)ttile_bf16_input_slack(p) * sizeof(uint16_t));
}

void ttile_bf16_pack_input(const ttile_bf16_problem *p, const void *x, int x_bf16, int nchw,
                           int64_t c, int64_t h, int64_t w, int64_t pad_top,
                           int64_t pad_left, uint16_t *xb, int nthreads)
{
    if (p->phases) {
        pack_input_phases(p, x, x_bf16, nchw, c, h, w, pad_top, pad_left, xb, nthreads);
        return;
    }
    const int64_t row = p->wp * p->cp, rows = p->n * p->hp;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = i / p->hp, y = i % p->hp - pad_top;
        uint16_t *out = xb + i * row;
        if (y < 0 || y >= h)
            memset(out, 0, (size_t)row * sizeof(uint16_t));
        else if (nchw)
            pack_row_nchw(p, (const float *)x + n * c * h * w, c, h, w, y, pad_left, out);
        else
            pack_row_nhwc(p, (const char *)x + ((n * h + y) * w * c) * elem, x_bf16, c, w,
                          pad_left, out);
    }
    memset(xb + rows * row, 0, (size_t)ttile_bf16_input_slack(p) * sizeof(uint16_t));
}

void ttile_bf16_pack_weights(const ttile_bf16_problem *p, const float *w, int64_t c,
                             uint16_t *wb, int nthreads)
{
    const int64_t kc = p->kc, k = p->k, taps = p->r * p->s, pairs = p->cp / 2;
    const int64_t block = taps * p->cp * 16;   /* one block of 16 output channels */
    (void)kc;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t kb = 0; kb < p->kp / 16; kb++)
        for (int64_t tap = 0; tap < taps; tap++) {
            const __mmask16 m = ttile_bf16_kmask(kb * 16, k);
            /* the pairs of a tap are consecutive: (q, j) with c = q kc + 2 j = 2 pair */
            uint32_t *out = (uint32_t *)(wb + kb * block + tap * p->cp * 16);
            for (int64_t pr = 0; pr < pairs; pr++) {
                const int64_t c0 = 2 * pr, c1 = 2 * pr + 1;
                const float *row = w + tap * c * k + kb * 16;
                const __m512 v0 = c0 < c ? _mm512_maskz_loadu_ps(m, row + c0 * k)
                                         : _mm512_setzero_ps();
                const __m512 v1 = c1 < c ? _mm512_maskz_loadu_ps(m, row + c1 * k)
                                         : _mm512_setzero_ps();
                _mm512_storeu_si512(out + pr * 16, _mm512_or_si512(
                    ttile_bf16_round_lanes512(v0), _mm512_slli_epi32(ttile_bf16_round_lanes512(v1), 16)));
            }
        }
}

/* Sixteen folded pixels at stride 1 along w, as cp / 2 vectors of 32 lanes: lane l of
 * vector v is lane j = (32 v + l) % cp of pixel q = (32 v + l) / cp, the padded row's value
 * q stride c + j (j < s c) or zero (the pixel's padding lanes). Each vector's values lie
 * within 64 lanes of its first pixel's, so it is one two-source permutation of two loads
 * from there, with the padding lanes masked to zero, and one full store: against a masked
 * load and store per pixel (20 or 44 bytes, every few a store across two lines). One
 * thread, C harness, interleaved, Xeon model 207: Yolo9000-0's packing (3 channels of a
 * 3x3 filter, cp 10) 2.5 -> 1.0 ms, ResNet's first layer (7x7 stride 2, cp 22) 1.24x,
 * cp 24-48 1.16-1.48x; at cp 112 (15 channels of a 7x7 filter) 0.91-1.00, so pixel by
 * pixel from cp 66 on. */
#define FOLDED_GROUP_VECTORS 32

/* The first n of 32 16-bit lanes (none for n <= 0, all for n >= 32). */
static inline __mmask32 lanes32(int64_t n)
{
    return n >= 32 ? 0xFFFFFFFFu : n <= 0 ? 0u : (__mmask32)((1u << n) - 1u);
}

typedef struct {
    int count;                 /* vectors: cp / 2 */
    int64_t from[FOLDED_GROUP_VECTORS];   /* each vector's first value, from the group's */
    __m512i index[FOLDED_GROUP_VECTORS];
    __mmask32 keep[FOLDED_GROUP_VECTORS];
} folded_groups;

static int folded_groups_make(folded_groups *g, int64_t c, int64_t s, int64_t stride,
                              int64_t cp)
{
    if (cp % 2 != 0 || cp / 2 > FOLDED_GROUP_VECTORS)
        return 0;
    g->count = (int)(cp / 2);
    for (int v = 0; v < g->count; v++) {
        uint16_t index[32];
        __mmask32 keep = 0;
        g->from[v] = (32 * (int64_t)v / cp) * stride * c;
        for (int l = 0; l < 32; l++) {
            const int64_t lane = 32 * (int64_t)v + l, q = lane / cp, j = lane % cp;
            const int64_t at = q * stride * c + j - g->from[v];
            index[l] = 0;
            if (j >= s * c)
                continue;
            if (at >= 64)
                return 0;   /* a window wider than two vectors: pixel by pixel */
            index[l] = (uint16_t)at;
            keep |= (__mmask32)1u << l;
        }
        g->index[v] = _mm512_loadu_si512(index);
        g->keep[v] = keep;
    }
    return 1;
}

static inline void folded_group(const folded_groups *g, const uint16_t *from, uint16_t *out)
{
    for (int v = 0; v < g->count; v++) {
        const __m512i a = _mm512_loadu_si512(from + g->from[v]);
        const __m512i b = _mm512_loadu_si512(from + g->from[v] + 32);
        _mm512_storeu_si512(out + 32 * v,
                            _mm512_maskz_permutex2var_epi16(g->keep[v], a, g->index[v], b));
    }
}

int ttile_bf16_pack_input_folded(const ttile_bf16_problem *p, const void *x, int x_bf16,
                                 int nchw, int64_t c, int64_t h, int64_t w, int64_t pad_top,
                                 int64_t pad_left, int64_t s, int64_t stride_w,
                                 int64_t dil_w, uint16_t *xb, int nthreads)
{
    int failed = 0;
    const int64_t cp = p->cp, row = p->wp * cp, rows = p->n * p->hp;
    /* the padded input row, rounded: the columns every output column reads */
    const int64_t span = (p->wo - 1) * stride_w + (s - 1) * dil_w + 1;
    const int64_t cols = span > pad_left + w ? span : pad_left + w;
    folded_groups groups;
    const int by_groups = dil_w == 1 && folded_groups_make(&groups, c, s, stride_w, cp);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        /* 64 lanes of slack: a group's last loads may reach past the row's values */
        uint16_t *padded = calloc((size_t)(cols * c + 64), sizeof(uint16_t));
        if (padded == 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            const int64_t n = i / p->hp, y = i % p->hp - pad_top;
            uint16_t *out = xb + i * row;
            if (y < 0 || y >= h || padded == 0) {
                memset(out, 0, (size_t)row * sizeof(uint16_t));
                continue;
            }
            uint16_t *in = padded + pad_left * c;
            if (x_bf16)
                memcpy(in, (const uint16_t *)x + (n * h + y) * w * c,
                       (size_t)(w * c) * sizeof(uint16_t));
            else if (nchw)   /* pixels of c channels */
                pack_pixels_nchw((const float *)x + n * c * h * w, c, h, w, y, c, in);
            else
                ttile_bf16_from_f32((const float *)x + (n * h + y) * w * c, in, w * c, 1);
            int64_t ow = 0;
            if (by_groups)
                for (; ow + 16 <= p->wo; ow += 16)
                    folded_group(&groups, padded + ow * stride_w * c, out + ow * cp);
            for (; ow < p->wo; ow++) {
                if (dil_w == 1) {
                    /* s c contiguous values and the pixel's padding lanes up to cp as
                     * zeros, in 32-lane pieces (a first layer's 9 or 21 of 10 or 22:
                     * one masked load and store; a memcpy call per pixel was most of
                     * Yolo9000-0's time, and clearing each row first, 3 % of it) */
                    const uint16_t *from = padded + ow * stride_w * c;
                    for (int64_t e = 0; e < cp; e += 32) {
                        const __mmask32 m = lanes32(s * c - e);
                        _mm512_mask_storeu_epi16(out + ow * cp + e, lanes32(cp - e),
                                                 _mm512_maskz_loadu_epi16(m, from + e));
                    }
                } else {
                    for (int64_t ss = 0; ss < s; ss++)
                        memcpy(out + ow * cp + ss * c,
                               padded + (ow * stride_w + ss * dil_w) * c,
                               (size_t)c * sizeof(uint16_t));
                    memset(out + ow * cp + s * c, 0, (size_t)(cp - s * c) * sizeof(uint16_t));
                }
            }
            if (p->wp > p->wo)   /* columns past the output, if the row has any */
                memset(out + p->wo * cp, 0, (size_t)((p->wp - p->wo) * cp) * sizeof(uint16_t));
        }
        free(padded);
    }
    memset(xb + rows * row, 0, (size_t)ttile_bf16_input_slack(p) * sizeof(uint16_t));
    return failed ? -1 : 0;
}
