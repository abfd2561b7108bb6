/* The AMX bf16 convolution: an implicit matrix product on the tile unit, with no im2col.
 *
 * A tile of A is 16 output pixels by kc input channels of one filter tap: 16 rows of the
 * packed input (ttile_bf16.h) at a fixed stride, which tileloadd reads directly. Two
 * pixel tiles and two 16-channel weight tiles (B, channel pairs interleaved) feed four
 * fp32 accumulator tiles: a 32-pixel by 32-channel block, the 2 x 2 arrangement that uses
 * all eight tile registers, four loads per four tdpbf16ps.
 * Which 16 pixels a tile holds: ttile_bf16_tiling (ttile_bf16.h).
 *
 * Work: (image, pair of pixel tiles) x (pair of 16-channel blocks), in groups of channel
 * blocks whose weights fit half the L2, each thread taking consecutive pixel tiles so it
 * reuses its input rows across the group's channel blocks. */
#include "ttile_bf16.h"
#include "ttile_runtime.h"

#if defined(TTILE_NO_AMX)
int ttile_conv_bf16_amx(const ttile_bf16_problem *p, const uint16_t *xb, const uint16_t *wb,
                        void *y, int y_bf16, int y_nchw, int nthreads,
                        const ttile_epilogue *ep)
{
    (void)p, (void)xb, (void)wb, (void)y, (void)y_bf16, (void)y_nchw, (void)nthreads, (void)ep;
    return -1;   /* built by a compiler without AMX */
}
int ttile_conv_bf16_amx_unpacked(const ttile_bf16_problem *p, const uint16_t *x,
                                 const uint16_t *wb, void *y, int y_bf16, int nthreads,
                                 const ttile_epilogue *ep)
{
    (void)p, (void)x, (void)wb, (void)y, (void)y_bf16, (void)nthreads, (void)ep;
    return -1;
}
int ttile_bf16_amx_built(void) { return 0; }
#else
#include <immintrin.h>
#include <stdlib.h>

int ttile_bf16_amx_built(void) { return 1; }

/* Stores a pixel tile's 16 x 32 accumulators (two 16 x 16 blocks in acc, 256 floats
 * apart) for output channel blocks kb and kb + 1, through the epilogue. */
static void store_tile(const ttile_bf16_problem *p, const ttile_bf16_tiling *t, int64_t n,
                       int64_t tile, int64_t kb, const float *acc, void *y, int y_bf16,
                       const ttile_epilogue *ep)
{
    int64_t oh, ow;
    ttile_bf16_pixel(p, t, tile, 0, &oh, &ow);
    const int blocks = (kb + 1) * 16 < p->k ? 2 : 1;
    for (int i = 0; i < 16; i++) {
        if (oh < p->ho && ow < p->wo) {
            const int64_t at = ((n * p->ho + oh) * p->wo + ow) * p->k;
            for (int b = 0; b < blocks; b++) {
                const int64_t k0 = (kb + b) * 16;
                ttile_bf16_store16(ep, y, y_bf16, at + k0, k0, ttile_bf16_kmask(k0, p->k),
                                   _mm512_load_ps(acc + b * 256 + i * 16));
            }
        }
        if (++ow == p->wp && t->virtual_rows) {
            ow = 0;
            oh++;
        }
    }
}

/* The epilogue on a pixel tile's 16 rows of 32 channels: y = act(acc + bias + residual),
 * row i stored at element rows[i] + k0 of y (rows[i] < 0: a row past the output, not
 * stored), fp32 or rounded to bf16 (the residual then bf16 too). acc holds the two
 * 16 x 16 blocks 256 floats apart. The common epilogues (bias, residual, ReLU or ReLU6:
 * every layer of a ResNet or MobileNet) are straight-line code with the two bias vectors
 * held; row by row through ttile_bf16_store16, branching per vector, this pass took 10 %
 * of ResNet-50's time, and 14 % with bf16 outputs. A bf16 row is rounded by one
 * vcvtne2ps2bf16 (both 16-channel halves into one 64-byte store): the integer rounding of
 * ttile_bf16_round512 took 1.07-1.24x the time on 1x1 layers of 64-256 channels (Xeon
 * model 207, 1 thread, bias + ReLU). It rounds to nearest even as that does, except that
 * it reads an fp32 denormal as zero: a result below 2^-126 in magnitude is stored as
 * zero, as OpenVINO's and oneDNN's bf16 stores do. */
#define STORE_RUN(NAME, RESIDUAL, ACT, BF16)                                                \
    static void NAME(const float *acc, const int64_t *rows, int64_t k0, void *y,          \
                     const ttile_epilogue *ep, int stream)                               \
    {                                                                                     \
        const __m512 zero = _mm512_setzero_ps(), six = _mm512_set1_ps(6.0f);              \
        const __m512 b0 = ep->bias ? _mm512_loadu_ps(ep->bias + k0) : zero;               \
        const __m512 b1 = ep->bias ? _mm512_loadu_ps(ep->bias + k0 + 16) : zero;          \
        for (int i = 0; i < 16; i++) {                                                    \
            if (rows[i] < 0)                                                              \
                continue;                                                                 \
            const int64_t o = rows[i] + k0;                                               \
            __m512 v0 = _mm512_add_ps(_mm512_load_ps(acc + i * 16), b0);                  \
            __m512 v1 = _mm512_add_ps(_mm512_load_ps(acc + 256 + i * 16), b1);            \
            if (RESIDUAL) {                                                               \
                if (BF16) {                                                               \
                    const uint16_t *res = (const uint16_t *)ep->residual + o;            \
                    v0 = _mm512_add_ps(v0, ttile_bf16_widen512(                           \
                                               _mm256_loadu_si256((const __m256i *)res))); \
                    v1 = _mm512_add_ps(v1, ttile_bf16_widen512(                           \
                                               _mm256_loadu_si256((const __m256i *)(res + 16)))); \
                } else {                                                                  \
                    v0 = _mm512_add_ps(v0, _mm512_loadu_ps(ep->residual + o));            \
                    v1 = _mm512_add_ps(v1, _mm512_loadu_ps(ep->residual + o + 16));       \
                }                                                                         \
            }                                                                             \
            if (ACT != TTILE_ACT_NONE) {                                                  \
                v0 = _mm512_max_ps(v0, zero);                                             \
                v1 = _mm512_max_ps(v1, zero);                                             \
            }                                                                             \
            if (ACT == TTILE_ACT_RELU6) {                                                 \
                v0 = _mm512_min_ps(v0, six);                                              \
                v1 = _mm512_min_ps(v1, six);                                              \
            }                                                                             \
            if (BF16) {                                                                   \
                const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);                   \
                if (stream)                                                               \
                    _mm512_stream_si512((__m512i *)((uint16_t *)y + o), b);               \
                else                                                                      \
                    _mm512_storeu_si512((uint16_t *)y + o, b);                            \
            } else {                                                                      \
                if (stream) {                                                             \
                    _mm512_stream_ps((float *)y + o, v0);                                 \
                    _mm512_stream_ps((float *)y + o + 16, v1);                            \
                } else {                                                                  \
                    _mm512_storeu_ps((float *)y + o, v0);                                 \
                    _mm512_storeu_ps((float *)y + o + 16, v1);                            \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
    }

STORE_RUN(run_f32, 0, TTILE_ACT_NONE, 0)
STORE_RUN(run_f32_relu, 0, TTILE_ACT_RELU, 0)
STORE_RUN(run_f32_relu6, 0, TTILE_ACT_RELU6, 0)
STORE_RUN(run_f32_res, 1, TTILE_ACT_NONE, 0)
STORE_RUN(run_f32_res_relu, 1, TTILE_ACT_RELU, 0)
STORE_RUN(run_f32_res_relu6, 1, TTILE_ACT_RELU6, 0)
STORE_RUN(run_bf16, 0, TTILE_ACT_NONE, 1)
STORE_RUN(run_bf16_relu, 0, TTILE_ACT_RELU, 1)
STORE_RUN(run_bf16_relu6, 0, TTILE_ACT_RELU6, 1)
STORE_RUN(run_bf16_res, 1, TTILE_ACT_NONE, 1)
STORE_RUN(run_bf16_res_relu, 1, TTILE_ACT_RELU, 1)
STORE_RUN(run_bf16_res_relu6, 1, TTILE_ACT_RELU6, 1)

typedef void (*store_run_fn)(const float *, const int64_t *, int64_t, void *,
                             const ttile_epilogue *, int);

/* The straight-line store of an epilogue, or NULL for the others (silu, sigmoid, leaky
 * ReLU: row by row). */
static store_run_fn store_run_for(const ttile_epilogue *ep, int y_bf16)
{
    static const store_run_fn table[2][2][3] = {
        {{run_f32, run_f32_relu, run_f32_relu6}, {run_f32_res, run_f32_res_relu,
                                                   run_f32_res_relu6}},
        {{run_bf16, run_bf16_relu, run_bf16_relu6}, {run_bf16_res, run_bf16_res_relu,
                                                      run_bf16_res_relu6}}};
    const int act = ep->activation == TTILE_ACT_NONE ? 0 : ep->activation == TTILE_ACT_RELU ? 1
                  : ep->activation == TTILE_ACT_RELU6 ? 2 : -1;
    return act < 0 ? 0 : table[y_bf16 != 0][ep->residual != 0][act];
}

/* What a call shares with its threads. */
typedef struct {
    const ttile_bf16_problem *p;
    ttile_bf16_tiling t;
    const ttile_epilogue *ep;
    store_run_fn store_run;
    int empty, y_bf16;
    void *y;
    int y_nchw;          /* fp32 y and residual in NCHW (store_nchw) */
    int stream;          /* NHWC y stored past the caches (non-temporal) */
    int64_t a_stride, taps, nq, kc, chunk, block, image, pairs;
    int64_t gc, gkq;     /* grouped: a super-group's channels and channel pairs (0: dense) */
    const int64_t *off;
    /* An unpacked input's last tile, whose rows run past the input's end: its rows in a
     * zero-padded copy (NULL: the input is packed, with slack after it). */
    const uint16_t *tail;
    int64_t tail_n, tail_tile;
} amx_call;

/* The first rows (tap 0) of pixel-tile pair mi's two tiles, and the second tile's index
 * (the first's again past an image's last tile: a pair of one tile). */
static inline void pair_rows(const amx_call *c, const uint16_t *xb, int64_t mi,
                             const uint16_t **a0, const uint16_t **a1, int64_t *n,
                             int64_t *t0, int64_t *t1)
{
    *n = mi / c->pairs;
    *t0 = (mi % c->pairs) * 2;
    *t1 = *t0 + 1 < c->t.blocks ? *t0 + 1 : *t0;
    *a0 = xb + *n * c->image + ttile_bf16_block_base(c->p, &c->t, *t0);
    *a1 = xb + *n * c->image + ttile_bf16_block_base(c->p, &c->t, *t1);
    if (c->tail && *n == c->tail_n) {
        if (*t0 == c->tail_tile)
            *a0 = c->tail;
        if (*t1 == c->tail_tile)
            *a1 = c->tail;
    }
}

/* Reduction steps q0..q1 of every tap into the four accumulator tiles. */
static inline void reduce(const amx_call *c, const uint16_t *a0, const uint16_t *a1,
                          const uint16_t *b0, const uint16_t *b1, int64_t q0, int64_t q1)
{
    const int64_t kc = c->kc, chunk = c->chunk, a_stride = c->a_stride;
    for (int64_t tap = 0; tap < c->taps; tap++) {
        const uint16_t *x0 = a0 + c->off[tap], *x1 = a1 + c->off[tap];
        const uint16_t *w0 = b0 + tap * c->nq * chunk, *w1 = b1 + tap * c->nq * chunk;
        for (int64_t q = q0; q < q1; q++) {
            _tile_loadd(4, x0 + q * kc, a_stride);
            _tile_loadd(6, w0 + q * chunk, 64);
            _tile_loadd(7, w1 + q * chunk, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, x1 + q * kc, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* The same for one pixel tile (an image's odd last one) into accumulators 0 and 1: no
 * product computed twice (a 14x14 map's 13 tiles ran as 7 pairs, 14 tiles' work): 1x1
 * layers on 14x14 maps 1.03-1.05x faster, 3x3 ones as fast (Xeon model 207, 1 thread). */
static inline void reduce_one(const amx_call *c, const uint16_t *a0, const uint16_t *b0,
                              const uint16_t *b1)
{
    const int64_t kc = c->kc, chunk = c->chunk, a_stride = c->a_stride;
    for (int64_t tap = 0; tap < c->taps; tap++) {
        const uint16_t *x0 = a0 + c->off[tap];
        const uint16_t *w0 = b0 + tap * c->nq * chunk, *w1 = b1 + tap * c->nq * chunk;
        for (int64_t q = 0; q < c->nq; q++) {
            _tile_loadd(4, x0 + q * kc, a_stride);
            _tile_loadd(6, w0 + q * chunk, 64);
            _tile_loadd(7, w1 + q * chunk, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
}

/* The element of y where each of pixel tile `tile`'s rows goes (-1: past the output), and
 * whether they are 16 consecutive outputs; with `places`, also each row's element in
 * channel 0's plane of an NCHW y (-1: past the output). */
static int tile_rows(const ttile_bf16_problem *p, const ttile_bf16_tiling *t, int64_t n,
                     int64_t tile, int64_t *rows, int64_t *places)
{
    int64_t oh, ow;
    ttile_bf16_pixel(p, t, tile, 0, &oh, &ow);
    const int64_t image = n * p->k * p->ho * p->wo;
    if (oh < p->ho && ow + 15 < p->wo) {   /* 16 pixels inside one output row */
        const int64_t row0 = ((n * p->ho + oh) * p->wo + ow) * p->k;
        for (int i = 0; i < 16; i++)
            rows[i] = row0 + i * p->k;
        if (places)
            for (int i = 0; i < 16; i++)
                places[i] = image + oh * p->wo + ow + i;
        return 1;
    }
    int consecutive = 1;
    for (int i = 0; i < 16; i++) {
        const int inside = oh < p->ho && ow < p->wo;
        rows[i] = inside ? ((n * p->ho + oh) * p->wo + ow) * p->k : -1;
        if (places)
            places[i] = inside ? image + oh * p->wo + ow : -1;
        if (rows[i] < 0 || (i > 0 && rows[i] != rows[i - 1] + p->k))
            consecutive = 0;
        if (++ow == p->wp && t->virtual_rows) {
            ow = 0;
            oh++;
        }
    }
    return consecutive;
}

/* A tile's pixels as runs of consecutive places in their NCHW planes. */
typedef struct {
    int count;                 /* runs */
    int64_t at[16];            /* a run's first element in channel 0's plane */
    __mmask16 lanes[16];       /* its lanes */
    __mmask16 first[16];       /* as many first lanes */
} nchw_runs;

/* The runs of a tile's places (tile_rows'), once per pair of tiles as the rows are (from
 * the rows by division, 32 a pair of tiles, this took a fifth of a 32-channel layer's
 * time). */
static void nchw_runs_of(const int64_t *at, nchw_runs *r)
{
    r->count = 0;
    for (int i = 0; i < 16;) {
        if (at[i] < 0) {
            i++;
            continue;
        }
        int j = i + 1;
        while (j < 16 && at[j] == at[i] + (j - i))
            j++;
        r->at[r->count] = at[i];
        r->lanes[r->count] = (__mmask16)(((1u << j) - 1u) & ~((1u << i) - 1u));
        r->first[r->count] = (__mmask16)((1u << (j - i)) - 1u);
        r->count++;
        i = j;
    }
}

/* A pixel tile's 16 x 32 accumulators (acc: two 16 x 16 blocks 256 floats apart) for
 * output channels k0 .. k0 + 31 (those below k) to an fp32 NCHW y through the epilogue:
 * each 16 x 16 block transposed in registers, so that a vector is one channel's 16
 * pixels. A tile's pixels are one run of consecutive places in their planes, or, where
 * the tile crosses output rows (virtual rows skip the padded columns) or images, a few:
 * each run is compressed to the vector's first lanes and stored (its residual loaded and
 * expanded back) with a mask. */
static void store_nchw(const amx_call *c, const nchw_runs *runs, int64_t k0, const float *acc)
{
    const ttile_bf16_problem *p = c->p;
    const int64_t hw = p->ho * p->wo, k = p->k;
    const ttile_epilogue *ep = c->ep;
    float *y = (float *)c->y;
    const int whole = runs->count == 1 && runs->first[0] == (__mmask16)0xFFFF;
    for (int b = 0; b < 2 && k0 + 16 * b < k; b++) {
        const int64_t kb = k0 + 16 * b;
        const int nk = k - kb < 16 ? (int)(k - kb) : 16;
        __m512 v[16];
        for (int i = 0; i < 16; i++)
            v[i] = _mm512_load_ps(acc + b * 256 + i * 16);
        ttile_transpose16_512(v);
        for (int j = 0; j < nk; j++) {
            const int64_t plane = (kb + j) * hw;
            __m512 t = v[j];
            if (ep->bias)
                t = _mm512_add_ps(t, _mm512_set1_ps(ep->bias[kb + j]));
            if (ep->residual) {
                __m512 r = _mm512_setzero_ps();
                if (whole)
                    r = _mm512_loadu_ps(ep->residual + plane + runs->at[0]);
                else
                    for (int u = 0; u < runs->count; u++)
                        r = _mm512_mask_expand_ps(r, runs->lanes[u], _mm512_maskz_loadu_ps(
                                                      runs->first[u],
                                                      ep->residual + plane + runs->at[u]));
                t = _mm512_add_ps(t, r);
            }
            t = ttile_activate512(ep->activation, ep->negative_slope, t);
            if (whole)
                _mm512_storeu_ps(y + plane + runs->at[0], t);
            else
                for (int u = 0; u < runs->count; u++)
                    _mm512_mask_storeu_ps(y + plane + runs->at[u], runs->first[u],
                                          _mm512_maskz_compress_ps(runs->lanes[u], t));
        }
    }
}

/* One pixel tile's two accumulator tiles (first, first + 1) for channel pair kq to the
 * output: straight to an fp32 y where its rows are 16 consecutive outputs, all 32
 * channels real and no epilogue; else through acc, by the straight-line epilogue where
 * the 32 channels are real, row by row for the last channels of k (store_tile). */
#define FINISH_TILE(FIRST, SECOND, ACC, WHICH)                                              \
    do {                                                                                  \
        const int64_t *rows = out->rows[WHICH];                                           \
        const int consecutive = out->consecutive[WHICH];                                  \
        if (c->y_nchw) {                                                                  \
            _tile_stored(FIRST, ACC, 64);                                                 \
            _tile_stored(SECOND, ACC + 256, 64);                                          \
            store_nchw(c, &out->runs[WHICH], 32 * kq, ACC);                               \
        } else if (full && consecutive && !c->y_bf16 && c->empty && !c->stream) {         \
            _tile_stored(FIRST, yf + rows[0] + 32 * kq, ystride);                         \
            _tile_stored(SECOND, yf + rows[0] + 32 * kq + 16, ystride);                   \
        } else {                                                                          \
            _tile_stored(FIRST, ACC, 64);                                                 \
            _tile_stored(SECOND, ACC + 256, 64);                                          \
            if (full && c->store_run)                                                     \
                c->store_run(ACC, rows, 32 * kq, c->y, c->ep, c->stream);                 \
            else                                                                          \
                store_tile(p, &c->t, n, tile, 2 * kq, ACC, c->y, c->y_bf16, c->ep);       \
        }                                                                                 \
    } while (0)

/* A thread's output rows of its current pair of pixel tiles: consecutive work items
 * share their pixel tiles (the channel pairs vary fastest), so the rows are computed
 * once per pair of tiles, not once per channel pair: 1.11-1.18x faster on 1x1 layers of
 * 64 and 128 channels (Xeon model 207, 1 thread, bf16 output, bias + ReLU). */
typedef struct {
    int64_t n, t0, t1;
    int consecutive[2];
    int64_t rows[2][16];
    nchw_runs runs[2];   /* with an NCHW output */
} pair_outputs;

static inline void finish(const amx_call *c, int64_t n, int64_t t0, int64_t t1, int64_t kq,
                          float *acc, pair_outputs *out)
{
    const ttile_bf16_problem *p = c->p;
    const int full = (2 * kq + 2) * 16 <= p->k;
    const int64_t ystride = p->k * (int64_t)sizeof(float);
    float *yf = (float *)c->y;
    if (out->n != n || out->t0 != t0 || out->t1 != t1) {
        out->n = n;
        out->t0 = t0;
        out->t1 = t1;
        int64_t places[2][16];
        out->consecutive[0] = tile_rows(p, &c->t, n, t0, out->rows[0],
                                        c->y_nchw ? places[0] : 0);
        out->consecutive[1] = tile_rows(p, &c->t, n, t1, out->rows[1],
                                        c->y_nchw ? places[1] : 0);
        if (c->y_nchw) {
            nchw_runs_of(places[0], &out->runs[0]);
            nchw_runs_of(places[1], &out->runs[1]);
        }
    }
    int64_t tile = t0;
    FINISH_TILE(0, 1, acc, 0);
    if (t1 != t0) {
        tile = t1;
        FINISH_TILE(2, 3, acc + 512, 1);
    }
}

/* One work item: pixel-tile pair mi, channel pair kq. */
static inline void amx_item(const amx_call *c, const uint16_t *xb, const uint16_t *wb,
                            int64_t mi, int64_t kq, float *acc, pair_outputs *out)
{
    const uint16_t *a0, *a1;
    int64_t n, t0, t1;
    pair_rows(c, xb, mi, &a0, &a1, &n, &t0, &t1);
    if (c->gc) {   /* the super-group's channels */
        a0 += kq / c->gkq * c->gc;
        a1 += kq / c->gkq * c->gc;
    }
    const uint16_t *b0 = wb + 2 * kq * c->block;
    _tile_zero(0);
    _tile_zero(1);
    if (t1 == t0) {
        reduce_one(c, a0, b0, b0 + c->block);
    } else {
        _tile_zero(2);
        _tile_zero(3);
        reduce(c, a0, a1, b0, b0 + c->block, 0, c->nq);
    }
    finish(c, n, t0, t1, kq, acc, out);
}

static int amx_run(const ttile_bf16_problem *p, const uint16_t *xb, const uint16_t *wb,
                   void *y, int y_bf16, int y_nchw, int nthreads, const ttile_epilogue *ep,
                   const uint16_t *tail, int64_t tail_n, int64_t tail_tile)
{
    if (!ttile_amx_request())
        return -1;
    const ttile_epilogue none = {0, 0, TTILE_ACT_NONE, 0.0f};
    if (ep == 0)
        ep = &none;
    amx_call c;
    c.p = p;
    c.t = ttile_bf16_tiling_of(p, 16);
    c.ep = ep;
    c.empty = ttile_epilogue_is_empty(ep);
    c.store_run = store_run_for(ep, y_bf16);
    if (y_nchw && y_bf16)
        return -1;   /* NCHW outputs are fp32 */
    c.y = y;
    c.y_bf16 = y_bf16;
    c.y_nchw = y_nchw;
    /* An NHWC output larger than the L2 goes out with non-temporal stores, its lines not
     * read for ownership first (each store a whole line: 16 fp32 or 32 bf16 channels):
     * fp32, 1.19-1.62x faster with outputs of 3.2-19 MB (with and without an epilogue),
     * as fast at 1.6 MB, 0.93x at 0.8 MB; bf16, 1.06-1.30x with 2.4-19 MB (1 thread,
     * Xeon model 207, 2 MB L2, interleaved). */
    const int64_t l2 = ttile_cpu_l2_bytes();
    const int64_t element = y_bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float);
    c.stream = !y_nchw && p->k % (64 / element) == 0 && ((uintptr_t)y & 63) == 0
               && p->n * p->ho * p->wo * p->k * element > (l2 > 0 ? l2 : (int64_t)2 << 20);
    c.a_stride = c.t.pixel_stride * (int64_t)sizeof(uint16_t);
    c.taps = p->r * p->s;
    c.nq = ttile_bf16_reduced(p) / p->kc;
    c.kc = p->kc;
    c.chunk = p->kc * 16;
    c.block = c.taps * ttile_bf16_reduced(p) * 16;   /* weight elements of 16 channels */
    c.gc = p->gc;
    c.gkq = p->gkq;
    c.image = ttile_bf16_image_elems(p);
    c.pairs = (c.t.blocks + 1) / 2;
    c.tail = tail;
    c.tail_n = tail_n;
    c.tail_tile = tail_tile;
    int64_t *off = malloc((size_t)c.taps * sizeof(int64_t));
    if (off == 0)
        return -1;
    ttile_bf16_tap_offsets(p, off);
    c.off = off;
    const int64_t kpairs = p->kp / 32, mpairs = p->n * c.pairs;
    /* Channel pairs in groups whose weights fit the cache blocking, pixel pairs split
     * over the threads. (Blocking the reduction too, so that a channel pair's weights
     * for a block of steps stayed in L1 across 16 pixel pairs whose partial sums waited
     * in L2, was no faster on any Fig. 8 layer of a Xeon model 207 and 2x slower on
     * Yolo9000-13 and -18.) */
    const int64_t pair_bytes = c.block * 2 * (int64_t)sizeof(uint16_t);
    int64_t group = ttile_generic_cache_bytes() / pair_bytes;
    if (group < 1)
        group = 1;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float acc[4 * 256] __attribute__((aligned(64)));
        pair_outputs out = {-1, -1, -1, {0, 0}, {{0}}};
        ttile_amx_configure(c.kc);
        for (int64_t g0 = 0; g0 < kpairs; g0 += group) {
            const int64_t g1 = g0 + group < kpairs ? g0 + group : kpairs;
#pragma omp for collapse(2) schedule(static)
            for (int64_t mi = 0; mi < mpairs; mi++)
                for (int64_t kq = g0; kq < g1; kq++)
                    amx_item(&c, xb, wb, mi, kq, acc, &out);
        }
        if (c.stream)
            _mm_sfence();   /* this thread's streamed lines before anyone reads them */
        _tile_release();
    }
    free(off);
    return 0;
}
int ttile_conv_bf16_amx(const ttile_bf16_problem *p, const uint16_t *xb, const uint16_t *wb,
                        void *y, int y_bf16, int y_nchw, int nthreads,
                        const ttile_epilogue *ep)
{
    return amx_run(p, xb, wb, y, y_bf16, y_nchw, nthreads, ep, 0, 0, 0);
}

/* A 1x1, stride-1, unpadded layer on its bf16 NHWC input as it is (c == cp): the packed
 * input would be a copy of it (a pass over 1.6 MB for a 56x56x256 input, 136 us of a
 * 1x1 layer's 450 on a Xeon model 207). The tiles read the input in place; only the last
 * image's last tile, whose rows would run past the input's end, reads a zero-padded copy
 * of its rows. */
int ttile_conv_bf16_amx_unpacked(const ttile_bf16_problem *p, const uint16_t *x,
                                 const uint16_t *wb, void *y, int y_bf16, int nthreads,
                                 const ttile_epilogue *ep)
{
    if (p->r != 1 || p->s != 1 || p->stride_h != 1 || p->stride_w != 1 || p->hp != p->ho
        || p->wp != p->wo)
        return -1;
    const ttile_bf16_tiling t = ttile_bf16_tiling_of(p, 16);
    const int64_t pixels = p->ho * p->wo, last = t.blocks - 1;
    if (t.blocks * 16 == pixels)
        return amx_run(p, x, wb, y, y_bf16, 0, nthreads, ep, 0, 0, 0);
    const int64_t rows = pixels - last * 16;
    uint16_t *tail = aligned_alloc(64, (size_t)(16 * p->cp * sizeof(uint16_t) + 63) / 64 * 64);
    if (tail == 0)
        return -1;
    memset(tail, 0, (size_t)16 * p->cp * sizeof(uint16_t));
    memcpy(tail, x + ((p->n - 1) * pixels + last * 16) * p->cp,
           (size_t)(rows * p->cp) * sizeof(uint16_t));
    const int status = amx_run(p, x, wb, y, y_bf16, 0, nthreads, ep, tail, p->n - 1, last);
    free(tail);
    return status;
}
#endif
