/* The inverted residual block in bf16 with its two 1x1 stages on the AMX tile unit: the
 * fused block of kernels/inverted_residual_avx512.c (read its header first), the same
 * bands of output rows per thread and the same ring of three expanded rows in L2, with
 *
 *     expand:    a row of x rounded to bf16 (16-bit, 32-channel steps, zero padded)
 *                times w1 in bf16 on the tile unit, fp32 sums, + b1, act1 -> ring (fp32)
 *     depthwise: the fp32 kernel's row (ttile_ir_dw_row: fp32 FMAs on the ring with the
 *                bf16-rounded taps), its output row rounded to bf16
 *     project:   that row times w3 in bf16 on the tile unit, + b3 (+ the block's input,
 *                as bf16 values), act3 -> y (fp32, or bf16 bits)
 *
 * so every product is one of bf16 values with fp32 sums, as precision="bf16" means, and
 * the expanded map never leaves the cache. The 1x1 stages are 90 % of MobileNetV2's
 * arithmetic; on the fp32 kernel's FMAs they took half the bf16 network's time (Xeon
 * model 207, 1 thread).
 *
 * A 1x1 stage of one row is a product of (pixels x cp) by (cp x kp): pixel tiles of 16
 * rows of the row's bf16 copy (a pixel every cp elements, cp the channels rounded up to
 * 32, so each reduction step is one full 32-channel tile), two 16-channel weight tiles of
 * the ttile_bf16_pack_weights layout (r = s = 1, kc = 32), two pixel tiles at once into
 * four accumulators: ttile_amx_configure at kc = 32, as kernels/bf16_amx.c. The
 * copies' pixels past the row (up to the next 16) and channels past the real ones are
 * zero; the rows they give are not stored. */
#include "ttile_bf16.h"
#include "ttile_runtime.h"

#if defined(TTILE_NO_AMX)
int ttile_inverted_residual_amx(const ttile_ir_shape *sh, const void *x, int x_bf16,
                                const uint16_t *w1, const float *b1, const float *w2,
                                const float *b2, const uint16_t *w3, const float *b3,
                                void *y, int y_bf16, void *scratch, int nthreads)
{
    (void)sh, (void)x, (void)x_bf16, (void)w1, (void)b1, (void)w2, (void)b2, (void)w3;
    (void)b3, (void)y, (void)y_bf16, (void)scratch, (void)nthreads;
    return -1;   /* built by a compiler without AMX */
}
#else
#include <immintrin.h>
#include <omp.h>

static inline int64_t ir_round(int64_t n, int64_t to)
{
    return (n + to - 1) / to * to;
}

/* The residual a 1x1 stage adds: none, fp32 rounded to bf16 here, or bf16 bits. */
enum { IR_RES_NONE, IR_RES_F32, IR_RES_BF16 };

typedef struct ir_row_out ir_row_out;

/* Pixels p0 .. p0 + rows - 1 (rows <= 16) of 16-channel block kb from acc (16 x 16
 * fp32) through the stage's epilogue into its row. */
typedef void (*ir_tile_out_fn)(const ir_row_out *o, const float *acc, int64_t p0,
                               int64_t rows, int64_t kb);

/* Where a 1x1 stage's row goes: fp32 or bf16 at `out`, pixel stride `stride`, `real`
 * channels (the lanes past them not stored), through bias, residual and activation by
 * `store`, the variant of ir_tile_body for this stage's activation, residual and output
 * type (ir_tile_out_for). */
struct ir_row_out {
    const float *bias;
    int act;
    float slope;
    void *out;
    int64_t stride, real;
    const void *res;     /* the residual row (pixel stride `stride`), where it has one */
    ir_tile_out_fn store;
};

/* The epilogue of one tile, with the activation, the residual's kind and the output type
 * known when it is compiled: a tile's 16 pixels are 16 vectors, and the same code with
 * them read at run time (a jump table for the activation, two branches a vector) took a
 * third of a block's time where the expand stage writes 96 channels of a 112x112 map
 * (MobileNetV2's second block; Xeon model 207). */
static inline __attribute__((always_inline)) void ir_tile_body(
    const ir_row_out *o, const float *acc, int64_t p0, int64_t rows, int64_t kb,
    const int act, const int res, const int out_bf16)
{
    const int64_t k0 = 16 * kb;
    const __mmask16 mask = ttile_bf16_kmask(k0, o->real);
    const __m512 bias = _mm512_loadu_ps(o->bias + k0);
    for (int64_t i = 0; i < rows; i++) {
        const int64_t at = (p0 + i) * o->stride + k0;
        __m512 v = _mm512_add_ps(_mm512_load_ps(acc + 16 * i), bias);
        if (res == IR_RES_BF16)
            v = _mm512_add_ps(v, ttile_bf16_widen512(_mm256_maskz_loadu_epi16(
                                     mask, (const uint16_t *)o->res + at)));
        else if (res == IR_RES_F32)
            v = _mm512_add_ps(v, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(
                                     _mm512_maskz_loadu_ps(mask, (const float *)o->res + at))));
        v = ttile_activate512(act, o->slope, v);
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)o->out + at, mask,
                                     (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)o->out + at, mask, v);
    }
}

#define IR_TILE_OUT(NAME, ACT, RES, OUT)                                                 \
    static void NAME(const ir_row_out *o, const float *acc, int64_t p0, int64_t rows,    \
                     int64_t kb)                                                         \
    {                                                                                    \
        ir_tile_body(o, acc, p0, rows, kb, ACT, RES, OUT);                               \
    }
#define IR_TILE_OUTS(A, ACT)                                                             \
    IR_TILE_OUT(ir_out_##A##_n_f, ACT, IR_RES_NONE, 0)                                   \
    IR_TILE_OUT(ir_out_##A##_n_b, ACT, IR_RES_NONE, 1)                                   \
    IR_TILE_OUT(ir_out_##A##_f_f, ACT, IR_RES_F32, 0)                                    \
    IR_TILE_OUT(ir_out_##A##_f_b, ACT, IR_RES_F32, 1)                                    \
    IR_TILE_OUT(ir_out_##A##_b_f, ACT, IR_RES_BF16, 0)                                   \
    IR_TILE_OUT(ir_out_##A##_b_b, ACT, IR_RES_BF16, 1)
IR_TILE_OUTS(none, TTILE_ACT_NONE)
IR_TILE_OUTS(relu, TTILE_ACT_RELU)
IR_TILE_OUTS(relu6, TTILE_ACT_RELU6)
IR_TILE_OUTS(any, o->act)   /* the other activations, read at run time */
#define IR_TILE_ROW(A)                                                                   \
    {{ir_out_##A##_n_f, ir_out_##A##_n_b}, {ir_out_##A##_f_f, ir_out_##A##_f_b},         \
     {ir_out_##A##_b_f, ir_out_##A##_b_b}}

static ir_tile_out_fn ir_tile_out_for(int act, int res, int out_bf16)
{
    static const ir_tile_out_fn table[4][3][2] = {
        IR_TILE_ROW(none), IR_TILE_ROW(relu), IR_TILE_ROW(relu6), IR_TILE_ROW(any)};
    const int a = act == TTILE_ACT_NONE ? 0 : act == TTILE_ACT_RELU ? 1
                : act == TTILE_ACT_RELU6 ? 2 : 3;
    return table[a][res][out_bf16 != 0];
}

/* One row's 1x1 stage: a (m pixels, pixel stride cp bf16) times the packed weights wb
 * (cp input channels, `blocks` 16-channel blocks stored; wb holds an even number) into
 * o. Channel pairs outer, so a pair's weight tiles serve the whole row from L1. */
static void ir_gemm_row_amx(const uint16_t *a, int64_t cp, int64_t m, const uint16_t *wb,
                            int64_t blocks, float *acc, const ir_row_out *o)
{
    const int64_t tiles = (m + 15) / 16, steps = cp / 32, block = cp * 16;
    const int64_t a_stride = cp * (int64_t)sizeof(uint16_t);
    for (int64_t kb = 0; kb < blocks; kb += 2) {
        const uint16_t *w0 = wb + kb * block, *w1 = w0 + block;
        for (int64_t t = 0; t < tiles; t += 2) {
            const uint16_t *a0 = a + t * 16 * cp;
            _tile_zero(0);
            _tile_zero(1);
            if (t + 1 < tiles) {
                const uint16_t *a1 = a0 + 16 * cp;
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t q = 0; q < steps; q++) {
                    _tile_loadd(4, a0 + 32 * q, a_stride);
                    _tile_loadd(6, w0 + 512 * q, 64);
                    _tile_loadd(7, w1 + 512 * q, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, a1 + 32 * q, a_stride);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(2, acc + 512, 64);
                _tile_stored(3, acc + 768, 64);
            } else {
                for (int64_t q = 0; q < steps; q++) {
                    _tile_loadd(4, a0 + 32 * q, a_stride);
                    _tile_loadd(6, w0 + 512 * q, 64);
                    _tile_loadd(7, w1 + 512 * q, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
            }
            _tile_stored(0, acc, 64);
            _tile_stored(1, acc + 256, 64);
            for (int64_t u = 0; u < 2 && t + u < tiles; u++) {
                const int64_t p0 = 16 * (t + u), rows = m - p0 < 16 ? m - p0 : 16;
                o->store(o, acc + 512 * u, p0, rows, kb);
                if (kb + 1 < blocks)
                    o->store(o, acc + 512 * u + 256, p0, rows, kb + 1);
            }
        }
    }
}

/* A row of w pixels of c channels (fp32, or bf16 bits) as bf16 at pixel stride cp; the
 * channels past c are left as they are (zero). */
static void ir_row_to_bf16(const void *x, int x_bf16, int64_t c, int64_t w, uint16_t *out,
                           int64_t cp)
{
    for (int64_t p = 0; p < w; p++)
        for (int64_t c0 = 0; c0 < c; c0 += 16) {
            const __mmask16 m = ttile_bf16_kmask(c0, c);
            __m256i v;
            if (x_bf16)
                v = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + p * c + c0);
            else
                v = (__m256i)_mm512_cvtneps_pbh(
                        _mm512_maskz_loadu_ps(m, (const float *)x + p * c + c0));
            _mm256_mask_storeu_epi16(out + p * cp + c0, m, v);
        }
}

/* Without an expand stage the depthwise stage reads the block's input: a row of it,
 * rounded to bf16 and widened back, into a ring row of ep floats a pixel (the channels
 * past c zero). */
static void ir_row_rounded(const void *x, int x_bf16, int64_t c, int64_t w, int64_t ep,
                           float *out)
{
    for (int64_t p = 0; p < w; p++)
        for (int64_t c0 = 0; c0 < ep; c0 += 16) {
            const __mmask16 m = ttile_bf16_kmask(c0, c);
            __m512 v;
            if (x_bf16)
                v = ttile_bf16_widen512(
                        _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + p * c + c0));
            else
                v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(
                        _mm512_maskz_loadu_ps(m, (const float *)x + p * c + c0)));
            _mm512_store_ps(out + p * ep + c0, v);
        }
}

/* One thread's scratch, in bytes, each part on its own lines. */
typedef struct {
    int64_t ring, d, xa, da, acc, total;
} ir_amx_parts;

static ir_amx_parts ir_amx_parts_of(const ttile_ir_shape *sh)
{
    const int64_t ep = ir_round(sh->e, 16), cp1 = ir_round(sh->c, 32);
    const int64_t cp3 = ir_round(sh->e, 32);
    ir_amx_parts s;
    s.ring = 0;
    s.d = s.ring + ir_round(3 * (sh->w + 2) * ep * 4, 64);
    s.xa = s.d + ir_round(sh->wo * ep * 4, 64);
    s.da = s.xa + ir_round(ir_round(sh->w, 16) * cp1 * 2, 64);
    s.acc = s.da + ir_round(ir_round(sh->wo, 16) * cp3 * 2, 64);
    s.total = s.acc + 4 * 256 * 4;
    return s;
}

static int64_t ir_amx_team(const ttile_ir_shape *sh, int nthreads)
{
    const int64_t rows = sh->n * sh->ho;
    return nthreads < 1 ? 1 : nthreads < rows ? nthreads : rows;
}

int64_t ttile_inverted_residual_amx_scratch_bytes(const ttile_ir_shape *sh, int nthreads)
{
    return ir_amx_team(sh, nthreads) * ir_amx_parts_of(sh).total;
}

int ttile_inverted_residual_amx(const ttile_ir_shape *sh, const void *x, int x_bf16,
                                const uint16_t *w1, const float *b1, const float *w2,
                                const float *b2, const uint16_t *w3, const float *b3,
                                void *y, int y_bf16, void *scratch, int nthreads)
{
    if (sh->stride != 1 && sh->stride != 2)
        return -1;
    if (sh->residual && (sh->stride != 1 || sh->c != sh->k))
        return -1;
    if (w1 == NULL && sh->e != sh->c)
        return -1;
    if (((uintptr_t)scratch & 63) != 0 || !ttile_amx_request())
        return -1;
    const int64_t ep = ir_round(sh->e, 16), cp1 = ir_round(sh->c, 32);
    const int64_t cp3 = ir_round(sh->e, 32);
    const int64_t total = sh->n * sh->ho;
    const int team = (int)ir_amx_team(sh, nthreads);
    const ir_amx_parts parts = ir_amx_parts_of(sh);
    const int64_t in_elem = x_bf16 ? 2 : 4, out_elem = y_bf16 ? 2 : 4;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        const int t = omp_get_thread_num();
        const int64_t lo = total * t / team, hi = total * (t + 1) / team;
        char *mine = (char *)scratch + t * parts.total;
        float *ring = (float *)(mine + parts.ring), *d = (float *)(mine + parts.d);
        uint16_t *xa = (uint16_t *)(mine + parts.xa), *da = (uint16_t *)(mine + parts.da);
        float *acc = (float *)(mine + parts.acc);
        memset(xa, 0, (size_t)(parts.acc - parts.xa));   /* the copies' padding: zero */
        ttile_amx_configure(32);
        ir_row_out expand = {b1, sh->act1, sh->slope1, NULL, ep, ep, NULL,
                             ir_tile_out_for(sh->act1, IR_RES_NONE, 0)};
        ir_row_out project = {b3, sh->act3, sh->slope3, NULL, sh->k, sh->k, NULL,
                              ir_tile_out_for(sh->act3, !sh->residual ? IR_RES_NONE
                                              : x_bf16 ? IR_RES_BF16 : IR_RES_F32, y_bf16)};
        int64_t held[3] = {-1, -1, -1};   /* image * h + row in each ring slot */
        for (int64_t g = lo; g < hi; g++) {
            const int64_t img = g / sh->ho, oh = g % sh->ho;
            const float *rows[3];
            for (int r = 0; r < 3; r++) {
                const int64_t ih = oh * sh->stride - 1 + r;
                int fill;
                float *e = ttile_ir_ring_row(sh, ring, ep, held, img, ih, &fill);
                if (fill) {
                    const char *x_row = (const char *)x
                                        + (img * sh->h + ih) * sh->w * sh->c * in_elem;
                    if (w1 != NULL) {
                        ir_row_to_bf16(x_row, x_bf16, sh->c, sh->w, xa, cp1);
                        expand.out = e + ep;
                        ir_gemm_row_amx(xa, cp1, sh->w, w1, ep / 16, acc, &expand);
                    } else {
                        ir_row_rounded(x_row, x_bf16, sh->c, sh->w, ep, e + ep);
                    }
                }
                rows[r] = e;
            }
            ttile_ir_dw_row(sh, ep, rows, w2, b2, d, 0, ep);
            for (int64_t p = 0; p < sh->wo; p++)
                for (int64_t c0 = 0; c0 < ep; c0 += 16)
                    _mm256_store_si256((__m256i *)(da + p * cp3 + c0),
                                       (__m256i)_mm512_cvtneps_pbh(
                                           _mm512_load_ps(d + p * ep + c0)));
            project.out = (char *)y + g * sh->wo * sh->k * out_elem;
            project.res = sh->residual
                ? (const char *)x + (img * sh->h + oh) * sh->w * sh->c * in_elem : NULL;
            ir_gemm_row_amx(da, cp3, sh->wo, w3, ir_round(sh->k, 16) / 16, acc, &project);
        }
        _tile_release();
    }
    return 0;
}
#endif
