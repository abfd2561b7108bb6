/* The inverted residual block (MobileNetV2; EfficientNet's MBConv without its
 * squeeze-excitation) as one kernel on AVX-512, NHWC:
 *
 *     e = act1(x * W1 + b1)             1x1 expand, c -> e channels (or e = x: none)
 *     d = act2(dw3x3/stride(e) + b2)    3x3 depthwise, padding 1, stride 1 or 2
 *     y = act3(d * W3 + b3 (+ x))       1x1 project, e -> k channels (+ the block's input)
 *
 * Why one kernel: the block's expanded map is its largest tensor (MobileNetV2's 56x56x144
 * is 1.8 MB, its 112x112x96 4.8 MB), and three separate layers write it, read it back,
 * write the depthwise result and read that back, through L3 or memory, while their own
 * arithmetic is small (a 1x1 layer with 24 input channels does 24 FMAs per output
 * value). Here a thread owns a band of output rows. It keeps the three expanded rows
 * the next output row reads in a ring of its own, each computed once per band (a band
 * recomputes one or two halo rows at its top), and the depthwise row in a buffer of its
 * own: the intermediates never leave L2, and the block costs one parallel region and
 * one call instead of three. Maps with too few rows for a band per thread split the
 * expanded channels between threads as well (ir_split_for).
 *
 * Buffers and weights (packed by the caller, ttile/runtime/inverted_residual.py):
 *   w1: c x ep, b1[ep]     ep = e rounded up to 16; the padded columns are zero
 *   w2[9][ep], b2[ep]      (r, s) major
 *   w3: ep x kp, b3[kp]    kp = k rounded up to 16; padded rows and columns zero
 * w1 and w3 in panels of output-channel groups (ttile_inverted_residual_pack).
 * The expanded rows hold w + 2 pixels, the outer two zero (the depthwise padding), so
 * the depthwise loop reads no pixel outside its row; a row above or below the map is
 * skipped. The padded channels of e and d hold act(0), finite, and meet zero weights.
 *
 * The two 1x1 stages are one register-blocked GEMM (ir_gemm_row): P pixels x V vectors
 * of 16 channels, P <= 8, V <= 3 (24 accumulators, 3 weight vectors and a broadcast:
 * no spill). A row's pixels are cut into equal blocks of at most 8 (56 = 7 x 8, 14 =
 * 2 x 7, 7 = 7, 10 = 2 x 5) and its channel vectors into equal groups of at most 3, so no
 * block is a remainder of a wider one. The depthwise stage keeps a channel vector's 9
 * taps in registers and reads each input vector once per block of up to 8 outputs. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include "ttile_runtime.h"

#define IR_MAX_P 8
#define IR_MAX_V 3
#define IR_DW_B 8
/* How many reduction steps ahead a GEMM block asks for its weight lines. The panel
 * streams from L2 through an L1 that also holds the block's inputs; without the
 * prefetch MobileNetV2's 7x7 blocks ran 1.2x slower (266 -> 223 us at 1 thread, Xeon
 * model 167; 4, 8 and 16 steps measured alike, each block alone). In a network the
 * first pass over a block's weights finds them in L3 or memory, which 8 steps (about
 * 80 cycles) do not cover: the whole MobileNetV2 ran 0.5-2.0 % faster with 32 than
 * with 8, at 1 and 2 threads on a Zen 5 (interleaved in one process). */
#define IR_PREFETCH 32

/* SiLU and sigmoid, out of line: inlined into each of the 40 block functions they only
 * bloat them. */
static __attribute__((noinline)) __m512 ir_activate_exp(int act, __m512 v)
{
    return ttile_activate512(act, 0.0f, v);
}

static inline __attribute__((always_inline)) __m512
ir_activate(int act, float slope, __m512 v)
{
    const __m512 zero = _mm512_setzero_ps();
    switch (act) {
    case TTILE_ACT_NONE:
        return v;
    case TTILE_ACT_RELU:
        return _mm512_max_ps(v, zero);
    case TTILE_ACT_RELU6:
        return _mm512_min_ps(_mm512_max_ps(v, zero), _mm512_set1_ps(6.0f));
    case TTILE_ACT_LEAKY_RELU:
        return ttile_activate512(act, slope, v);
    default:
        return ir_activate_exp(act, v);
    }
}

/* out[p][v*16 ..] = act(bias + sum_q a[p][q] * b[q][v*16 ..] (+ res[p][..])) for P pixels
 * (a: lda floats apart, out: ldo, res: ldr) and V vectors (b: ldb floats a row; the last
 * vector stored and its residual read through `last`). */
static inline __attribute__((always_inline)) void
ir_block(const int P, const int V, const float *a, int64_t lda, int64_t kk,
         const float *b, int64_t ldb, const float *bias, float *out, int64_t ldo,
         const float *res, int64_t ldr, __mmask16 last, int act, float slope)
{
    __m512 acc[IR_MAX_P][IR_MAX_V];
#pragma GCC unroll 3
    for (int v = 0; v < V; v++) {
        const __m512 bv = bias != NULL ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int p = 0; p < P; p++)
            acc[p][v] = bv;
    }
    for (int64_t q = 0; q < kk; q++) {
        __m512 wv[IR_MAX_V];
#pragma GCC unroll 3
        for (int v = 0; v < V; v++)
            _mm_prefetch((const char *)(b + (q + IR_PREFETCH) * ldb + 16 * v), _MM_HINT_T0);
#pragma GCC unroll 3
        for (int v = 0; v < V; v++)
            wv[v] = _mm512_loadu_ps(b + q * ldb + 16 * v);
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            const __m512 s = _mm512_set1_ps(a[p * lda + q]);
#pragma GCC unroll 3
            for (int v = 0; v < V; v++)
                acc[p][v] = _mm512_fmadd_ps(s, wv[v], acc[p][v]);
        }
    }
    /* The exp-based activations (SiLU, sigmoid) need a dozen constants and temporaries:
     * applied in registers on top of 24 accumulators they spilled, so those blocks store
     * first and apply them from L1 (a compiler barrier keeps the two loops apart). */
    const int in_registers = act == TTILE_ACT_NONE || act == TTILE_ACT_RELU
                             || act == TTILE_ACT_RELU6 || act == TTILE_ACT_LEAKY_RELU;
#pragma GCC unroll 8
    for (int p = 0; p < P; p++) {
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) {
            const __mmask16 m = v == V - 1 ? last : (__mmask16)0xFFFF;
            __m512 r = acc[p][v];
            if (res != NULL)
                r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, res + p * ldr + 16 * v));
            if (in_registers)
                r = ir_activate(act, slope, r);
            _mm512_mask_storeu_ps(out + p * ldo + 16 * v, m, r);
        }
    }
    if (in_registers)
        return;
    __asm__ volatile("" ::: "memory");
    for (int p = 0; p < P; p++)
        for (int v = 0; v < V; v++) {
            const __mmask16 m = v == V - 1 ? last : (__mmask16)0xFFFF;
            float *o = out + p * ldo + 16 * v;
            _mm512_mask_storeu_ps(o, m, ir_activate_exp(act, _mm512_maskz_loadu_ps(m, o)));
        }
}

typedef void (*ir_block_fn)(const float *, int64_t, int64_t, const float *, int64_t,
                            const float *, float *, int64_t, const float *, int64_t,
                            __mmask16, int, float);

#define IR_BLOCK(P, V)                                                                   \
static __attribute__((noinline)) void                                                    \
ir_block_##P##_##V(const float *a, int64_t lda, int64_t kk, const float *b, int64_t ldb, \
                   const float *bias, float *out, int64_t ldo, const float *res,         \
                   int64_t ldr, __mmask16 last, int act, float slope)                    \
{                                                                                        \
    ir_block(P, V, a, lda, kk, b, ldb, bias, out, ldo, res, ldr, last, act, slope);      \
}
#define IR_BLOCKS(P) IR_BLOCK(P, 1) IR_BLOCK(P, 2) IR_BLOCK(P, 3)
IR_BLOCKS(1) IR_BLOCKS(2) IR_BLOCKS(3) IR_BLOCKS(4)
IR_BLOCKS(5) IR_BLOCKS(6) IR_BLOCKS(7) IR_BLOCKS(8)

#define IR_ROW(P) {ir_block_##P##_1, ir_block_##P##_2, ir_block_##P##_3}
static const ir_block_fn ir_blocks[IR_MAX_P][IR_MAX_V] = {
    IR_ROW(1), IR_ROW(2), IR_ROW(3), IR_ROW(4), IR_ROW(5), IR_ROW(6), IR_ROW(7), IR_ROW(8)};

/* Cuts n into ceil(n / most) parts of equal size (the first n % parts one larger). */
static inline int64_t ir_part(int64_t n, int64_t parts, int64_t i)
{
    return n / parts + (i < n % parts ? 1 : 0);
}

/* The 1x1 weights as the GEMM reads them: the n output channels cut into the groups of
 * at most IR_MAX_V vectors that ir_gemm_row uses, each group's kk x 16V floats one
 * contiguous panel, so a block's weight reads are one sequential stream (read across
 * rows of the kk x n matrix, each q was a 4 KB jump: 30 % slower on 7x7 blocks). */
void ttile_inverted_residual_pack(const float *w, int64_t kk, int64_t n, int64_t ldw,
                                  float *out)
{
    const int64_t vectors = (n + 15) / 16;
    const int64_t groups = (vectors + IR_MAX_V - 1) / IR_MAX_V;
    int64_t v0 = 0;
    for (int64_t j = 0; j < groups; j++) {
        const int64_t V = ir_part(vectors, groups, j);
        float *panel = out + kk * 16 * v0;
        for (int64_t q = 0; q < kk; q++)
            for (int64_t i = 0; i < 16 * V; i++)
                panel[q * 16 * V + i] = 16 * v0 + i < n ? w[q * ldw + 16 * v0 + i] : 0.0f;
        v0 += V;
    }
}

/* One row of a 1x1 stage: m pixels, the reduction's rows k0 .. k0 + kk of panels that
 * hold ldk rows, and the output channel groups g0 .. g1 of n channels (stored n wide:
 * the last vector masked when n is not a multiple of 16), weights packed by
 * ttile_inverted_residual_pack; bias may be NULL (a partial sum). Channel groups outer:
 * a group's panel is read from L2 once per pixel block while the row's inputs stay in
 * L1. */
static void ir_gemm_row(const float *a, int64_t lda, int64_t m, int64_t k0, int64_t kk,
                        int64_t ldk, const float *b, int64_t g0, int64_t g1, int64_t n,
                        const float *bias, float *out, int64_t ldo, const float *res,
                        int64_t ldr, int act, float slope)
{
    const int64_t vectors = (n + 15) / 16;
    const int64_t pixel_blocks = (m + IR_MAX_P - 1) / IR_MAX_P;
    const int64_t groups = (vectors + IR_MAX_V - 1) / IR_MAX_V;
    int64_t v0 = 0;
    for (int64_t j = 0; j < g1; j++) {
        const int64_t V = ir_part(vectors, groups, j);
        if (j < g0) {
            v0 += V;
            continue;
        }
        const int64_t end = 16 * (v0 + V);
        const __mmask16 last = end <= n ? (__mmask16)0xFFFF
                                        : (__mmask16)((1u << (16 - (end - n))) - 1u);
        const float *panel = b + ldk * 16 * v0 + k0 * 16 * V;
        int64_t p0 = 0;
        for (int64_t i = 0; i < pixel_blocks; i++) {
            const int64_t P = ir_part(m, pixel_blocks, i);
            ir_blocks[P - 1][V - 1](a + p0 * lda + k0, lda, kk, panel, 16 * V,
                                    bias == NULL ? NULL : bias + 16 * v0,
                                    out + p0 * ldo + 16 * v0, ldo,
                                    res == NULL ? NULL : res + p0 * ldr + 16 * v0, ldr,
                                    last, act, slope);
            p0 += P;
        }
        v0 += V;
    }
}

/* The first vector of channel group j when n channels are cut as ir_gemm_row cuts
 * them. */
static int64_t ir_group_start(int64_t n, int64_t j)
{
    const int64_t vectors = (n + 15) / 16;
    const int64_t groups = (vectors + IR_MAX_V - 1) / IR_MAX_V;
    int64_t v0 = 0;
    for (int64_t i = 0; i < j && i < groups; i++)
        v0 += ir_part(vectors, groups, i);
    return v0;
}

/* B outputs (B <= 8) of one channel vector of the depthwise row, stride ST: each input
 * vector loaded once and added into every output whose taps cover it. */
static inline __attribute__((always_inline)) void
ir_dw_block(const int B, const int ST, const float *const rows[3], int64_t col0,
            int64_t ep, const __m512 taps[9], __m512 bias, float *d, int act, float slope)
{
    __m512 acc[IR_DW_B];
#pragma GCC unroll 8
    for (int o = 0; o < B; o++)
        acc[o] = bias;
#pragma GCC unroll 3
    for (int r = 0; r < 3; r++) {
        if (rows[r] == NULL)
            continue;
        const float *src = rows[r] + col0 * ep;
#pragma GCC unroll 17
        for (int col = 0; col < (B - 1) * ST + 3; col++) {
            const __m512 in = _mm512_load_ps(src + col * ep);
#pragma GCC unroll 8
            for (int o = 0; o < B; o++) {
                const int s = col - o * ST;
                if (s >= 0 && s < 3)
                    acc[o] = _mm512_fmadd_ps(in, taps[3 * r + s], acc[o]);
            }
        }
    }
#pragma GCC unroll 8
    for (int o = 0; o < B; o++)
        _mm512_store_ps(d + o * ep, ir_activate(act, slope, acc[o]));
}

typedef void (*ir_dw_fn)(const float *const rows[3], int64_t col0, int64_t ep,
                         const __m512 taps[9], __m512 bias, float *d, int act, float slope);

#define IR_DW(B, ST)                                                                     \
static __attribute__((noinline)) void                                                    \
ir_dw_##B##_##ST(const float *const rows[3], int64_t col0, int64_t ep,                   \
                 const __m512 taps[9], __m512 bias, float *d, int act, float slope)      \
{                                                                                        \
    ir_dw_block(B, ST, rows, col0, ep, taps, bias, d, act, slope);                       \
}
#define IR_DWS(ST) IR_DW(1, ST) IR_DW(2, ST) IR_DW(3, ST) IR_DW(4, ST) IR_DW(5, ST)      \
                   IR_DW(6, ST) IR_DW(7, ST) IR_DW(8, ST)
IR_DWS(1) IR_DWS(2)
static const ir_dw_fn ir_dws[2][IR_DW_B] = {
    {ir_dw_1_1, ir_dw_2_1, ir_dw_3_1, ir_dw_4_1, ir_dw_5_1, ir_dw_6_1, ir_dw_7_1, ir_dw_8_1},
    {ir_dw_1_2, ir_dw_2_2, ir_dw_3_2, ir_dw_4_2, ir_dw_5_2, ir_dw_6_2, ir_dw_7_2, ir_dw_8_2}};

/* The depthwise row, channels c0 .. c1: rows[r] are the expanded rows oh*stride - 1 + r
 * (NULL above or below the map), each w + 2 pixels of ep floats; d gets wo pixels of ep
 * floats. */
void ttile_ir_dw_row(const ttile_ir_shape *sh, int64_t ep, const float *const rows[3],
                     const float *w2, const float *b2, float *d, int64_t c0, int64_t c1)
{
    const int64_t blocks = (sh->wo + IR_DW_B - 1) / IR_DW_B;
    const ir_dw_fn *fns = ir_dws[sh->stride == 2];
    for (int64_t cv = c0; cv < c1; cv += 16) {
        __m512 taps[9];
        for (int t = 0; t < 9; t++)
            taps[t] = _mm512_loadu_ps(w2 + t * ep + cv);
        const __m512 bias = _mm512_loadu_ps(b2 + cv);
        const float *const shifted[3] = {rows[0] ? rows[0] + cv : NULL,
                                         rows[1] ? rows[1] + cv : NULL,
                                         rows[2] ? rows[2] + cv : NULL};
        int64_t o0 = 0;
        for (int64_t i = 0; i < blocks; i++) {
            const int64_t B = ir_part(sh->wo, blocks, i);
            fns[B - 1](shifted, o0 * sh->stride, ep, taps, bias, d + o0 * ep + cv,
                       sh->act2, sh->slope2);
            o0 += B;
        }
    }
}

/* Without an expand stage (w1 NULL: a depthwise layer feeding a 1x1, MobileNetV2's
 * first block, MobileNetV1's pairs) the depthwise layer reads the block's input itself:
 * channels c0 .. c1 of a row of w pixels of c floats, copied into a ring row of ep floats
 * a pixel (the channels past c zero), where the depthwise loop finds its zero padding
 * around it. */
static void ir_copy_row(const float *x_row, int64_t c, int64_t w, int64_t ep, int64_t c0,
                        int64_t c1, float *out)
{
    const int64_t hi = c1 < c ? c1 : c;
    if (c == ep && c0 == 0 && c1 >= c) {
        memcpy(out, x_row, (size_t)(w * c) * sizeof(float));
        return;
    }
    for (int64_t p = 0; p < w; p++) {
        if (hi > c0)
            memcpy(out + p * ep + c0, x_row + p * c + c0, (size_t)(hi - c0) * sizeof(float));
        if (c1 > hi)
            memset(out + p * ep + hi, 0, (size_t)(c1 - hi) * sizeof(float));
    }
}

/* How the threads share a block: bands of output rows times slices of the expanded
 * channels. Bands alone recompute each band's halo rows and leave threads idle when
 * there are fewer rows than threads (a 7x7 block at 16 threads runs on 7); slices of
 * the expanded channels need no halo, and each reads only its part of both 1x1 layers'
 * weights, but their project outputs are partial sums, added after a barrier. Bands of
 * at least IR_MIN_BAND rows first, then slices (at most one per channel group), and
 * none when the project stage has an activation, which partial sums cannot take. */
#define IR_MIN_BAND 4

typedef struct {
    int64_t bands, slices;
} ir_split;

static ir_split ir_split_for(const ttile_ir_shape *sh, int nthreads)
{
    const int64_t total = sh->n * sh->ho;
    const int64_t groups = ((sh->e + 15) / 16 + IR_MAX_V - 1) / IR_MAX_V;
    ir_split sp = {nthreads < total ? nthreads : total, 1};
    if (nthreads <= 1 || sh->act3 != TTILE_ACT_NONE || total >= IR_MIN_BAND * nthreads)
        return sp;
    sp.bands = total / IR_MIN_BAND > 1 ? total / IR_MIN_BAND : 1;
    sp.slices = nthreads / sp.bands;
    if (sp.slices > groups)
        sp.slices = groups;
    if (sp.slices < 1)
        sp.slices = 1;
    return sp;
}

int64_t ttile_inverted_residual_scratch_floats(const ttile_ir_shape *sh, int nthreads)
{
    const int64_t ep = (sh->e + 15) / 16 * 16;
    const int64_t floats = (3 * (sh->w + 2) * ep + sh->wo * ep + 15) / 16 * 16;
    const ir_split sp = ir_split_for(sh, nthreads < 1 ? 1 : nthreads);
    const int64_t outputs = (sh->n * sh->ho * sh->wo * sh->k + 15) / 16 * 16;
    return sp.bands * sp.slices * floats + (sp.slices - 1) * outputs;
}

int ttile_inverted_residual_avx512(const ttile_ir_shape *sh, const float *x,
                                   const float *w1, const float *b1, const float *w2,
                                   const float *b2, const float *w3, const float *b3,
                                   float *y, float *scratch, int nthreads)
{
    if (sh->stride != 1 && sh->stride != 2)
        return -1;
    if (sh->residual && (sh->stride != 1 || sh->c != sh->k))
        return -1;
    if (w1 == NULL && sh->e != sh->c)   /* no expand stage: the input is depthwise's */
        return -1;
    if (nthreads < 1)
        nthreads = 1;
    const int64_t ep = (sh->e + 15) / 16 * 16;
    const int64_t row_floats = (sh->w + 2) * ep;
    const int64_t per_thread = (3 * row_floats + sh->wo * ep + 15) / 16 * 16;
    const int64_t total = sh->n * sh->ho;
    const ir_split sp = ir_split_for(sh, nthreads);
    const int team = (int)(sp.bands * sp.slices);
    const int64_t e_groups = ((sh->e + 15) / 16 + IR_MAX_V - 1) / IR_MAX_V;
    const int64_t k_groups = ((sh->k + 15) / 16 + IR_MAX_V - 1) / IR_MAX_V;
    const int64_t outputs = (sh->n * sh->ho * sh->wo * sh->k + 15) / 16 * 16;
    float *partials = scratch + team * per_thread;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        const int t = omp_get_thread_num();
        const int64_t band = t / sp.slices, slice = t % sp.slices;
        const int64_t lo = total * band / sp.bands, hi = total * (band + 1) / sp.bands;
        /* this slice's expanded channel groups, and their first and last channel */
        const int64_t g0 = e_groups * slice / sp.slices;
        const int64_t g1 = e_groups * (slice + 1) / sp.slices;
        const int64_t c0 = 16 * ir_group_start(sh->e, g0);
        const int64_t c1 = 16 * ir_group_start(sh->e, g1);
        const int64_t e1 = c1 < sh->e ? c1 : sh->e;
        float *out = slice == 0 ? y : partials + (slice - 1) * outputs;
        float *ring = scratch + t * per_thread;
        float *d = ring + 3 * row_floats;
        int64_t held[3] = {-1, -1, -1};   /* image * h + row in each ring slot */
        for (int64_t g = lo; g < hi && g0 < g1; g++) {
            const int64_t img = g / sh->ho, oh = g % sh->ho;
            const float *rows[3];
            for (int r = 0; r < 3; r++) {
                const int64_t ih = oh * sh->stride - 1 + r;
                int fill;
                float *e = ttile_ir_ring_row(sh, ring, ep, held, img, ih, &fill);
                if (fill) {
                    const float *x_row = x + (img * sh->h + ih) * sh->w * sh->c;
                    if (w1 != NULL)
                        ir_gemm_row(x_row, sh->c, sh->w, 0, sh->c, sh->c, w1, g0, g1, ep,
                                    b1, e + ep, ep, NULL, 0, sh->act1, sh->slope1);
                    else
                        ir_copy_row(x_row, sh->c, sh->w, ep, c0, c1, e + ep);
                }
                rows[r] = e;
            }
            ttile_ir_dw_row(sh, ep, rows, w2, b2, d, c0, c1);
            ir_gemm_row(d, ep, sh->wo, c0, e1 - c0, ep, w3, 0, k_groups, sh->k,
                        slice == 0 ? b3 : NULL, out + g * sh->wo * sh->k, sh->k,
                        slice == 0 && sh->residual
                            ? x + (img * sh->h + oh) * sh->w * sh->c : NULL,
                        sh->c, sh->act3, sh->slope3);
        }
        if (sp.slices > 1) {
            /* the partial sums of slices 1.. added into y, each thread a share of it
             * (a slice without channel groups wrote nothing: its share stays zero) */
#pragma omp barrier
            const int64_t size = sh->n * sh->ho * sh->wo * sh->k;
            const int64_t v_lo = (size / 16) * t / team * 16;
            const int64_t v_hi = t == team - 1 ? size : (size / 16) * (t + 1) / team * 16;
            for (int64_t i = v_lo; i < v_hi; i += 16) {
                const __mmask16 m = i + 16 <= v_hi ? (__mmask16)0xFFFF
                                                   : (__mmask16)((1u << (v_hi - i)) - 1u);
                __m512 acc = _mm512_maskz_loadu_ps(m, y + i);
                for (int64_t s = 1; s < sp.slices; s++)
                    acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, partials + (s - 1) * outputs + i));
                _mm512_mask_storeu_ps(y + i, m, acc);
            }
        }
    }
    return 0;
}
