/* Generic AVX-512 convolution: runtime shapes, any stride and padding, K tails masked.
 *
 * The fallback for shapes with no tuned kernel. Its register block is up to 4 vectors
 * of 16 output channels by 6 outputs along w (24 accumulators + 4 weight vectors + 1
 * broadcast = 29 zmm registers, no spills); 3 x 8, 2 x 12 or 1 x 24 when K is smaller.
 * Padding is handled without
 * copying the input: an out-of-range input pixel is read from a zero row instead.
 *
 * The weights are packed once per call into panels w_p[K/P][R][S][C][P], P = 16 x the
 * block's vector count (ttile_generic_panel). In RSCK
 * the P weights of one (r, s, c) step are K floats away from the next step's; with K
 * in the hundreds that is a new page per step, and the TLB misses dominated (12 % of
 * peak on Yolo9000-18 before packing). The panel is read sequentially instead, and its
 * zero-filled tail lets the weight loads go unmasked; outputs use masked stores. */
#include <immintrin.h>
#include <stdlib.h>
#include <sys/mman.h>
#include "ttile_runtime.h"

#define MAX_KV 4
#ifndef WEIGHT_CHUNK_BYTES
#define WEIGHT_CHUNK_BYTES 524288
#endif
#ifndef L2_PANEL_BYTES
#define L2_PANEL_BYTES 524288
#endif

/* The block set, kept in one place (an X-macro, as BLIS keeps its kernel lists): for each
 * vector count KV, blocks of 1 to WIDEST outputs, WIDEST = 24 accumulators / KV (the
 * shapes the microkernel table measured best: [U6 w; U4 k], [U8 w; U3 k], [U12 w; U2 k]).
 * GENERIC_KV(X) calls X(KV, WIDEST) once per vector count; WIDTHS_<W>(X, KV) calls
 * X(NW, KV) for NW = W down to 1. The block functions, the widest-block table and the
 * dispatch switch below are all expanded from it. */
#define GENERIC_KV(X) X(4, 6) X(3, 8) X(2, 12) X(1, 24)

#define WIDTHS_6(X, KV) X(6, KV) X(5, KV) X(4, KV) X(3, KV) X(2, KV) X(1, KV)
#define WIDTHS_8(X, KV) X(8, KV) X(7, KV) WIDTHS_6(X, KV)
#define WIDTHS_12(X, KV) X(12, KV) X(11, KV) X(10, KV) X(9, KV) WIDTHS_8(X, KV)
#define WIDTHS_24(X, KV) X(24, KV) X(23, KV) X(22, KV) X(21, KV) X(20, KV) X(19, KV)      \
    X(18, KV) X(17, KV) X(16, KV) X(15, KV) X(14, KV) X(13, KV) WIDTHS_12(X, KV)

#define WIDEST_ENTRY(KV, W) [KV] = W,
static const int WIDEST[MAX_KV + 1] = { GENERIC_KV(WIDEST_ENTRY) };

/* The block's vector count for k output channels and rows of wo outputs: the one that
 * keeps the most accumulators busy on average, once the row is split into blocks of
 * nearly equal width and k into chunks of kv vectors (7-wide rows of 512 channels: 3 x 7,
 * not 4 x (4 + 3)); ties go to more vectors (fewer broadcasts per FMA). */
static int generic_vectors(int64_t k, int64_t wo)
{
    const int64_t vectors = (k + 15) / 16;
    int best = 1;
    double best_score = 0.0;
    for (int kv = 1; kv <= MAX_KV && kv <= vectors; kv++) {
        const int64_t blocks = (wo + WIDEST[kv] - 1) / WIDEST[kv];
        const int64_t chunks = (vectors + kv - 1) / kv;
        const double score = (double)kv * (double)wo / (double)blocks
                             * (double)vectors / (double)(chunks * kv);
        if (score >= best_score) {
            best_score = score;
            best = kv;
        }
    }
    return best;
}

int64_t ttile_generic_panel(int64_t k, int64_t wo)
{
    return 16 * generic_vectors(k, wo);
}

/* One reduction step of a block: KV weight vectors at step t of the panel, one
 * broadcast per pixel (xp[j][t]), NW x KV FMAs. */
#define FMA_STEP(NW, KV, xp, wp, t)                                                    \
    do {                                                                               \
        __m512 wv[KV];                                                                 \
        _Pragma("GCC unroll 32")                                                       \
        for (int v = 0; v < KV; v++)                                                   \
            wv[v] = _mm512_loadu_ps((wp) + (t) * P + 16 * v);                          \
        _Pragma("GCC unroll 32")                                                       \
        for (int j = 0; j < NW; j++) {                                                 \
            const __m512 b = _mm512_set1_ps((xp)[j][t]);                               \
            _Pragma("GCC unroll 32")                                                   \
            for (int v = 0; v < KV; v++)                                               \
                acc[j][v] = _mm512_fmadd_ps(b, wv[v], acc[j][v]);                      \
        }                                                                              \
    } while (0)

/* The epilogue on a block's outputs just stored (nw pixels by kv vectors), from L1: one
 * function, not a copy per block (kinds other than those EPK_STORES applies in
 * registers). */
static __attribute__((noinline)) void
epilogue_from_memory(const ttile_epilogue *ep, float *y_row, int64_t ow0, int nw, int kv,
                     int64_t ys, int64_t k0, int64_t kb, const __mmask16 *mask)
{
    for (int j = 0; j < nw; j++)
        for (int v = 0; v < kv; v++)
            ttile_epilogue_apply512(ep, y_row, (ow0 + j) * ys + k0 + 16 * v, kb + 16 * v,
                                    mask[v]);
}

/* A block's stores, each of VALUE: an expression of acc_ (the accumulator), and of
 * BIASED / RESIDUAL (acc_ + its bias, its residual), for the epilogues applied in
 * registers (TTILE_EPK_*, one branch per block, not per vector). */
#define BIASED _mm512_add_ps(acc_, _mm512_maskz_loadu_ps(m_, ep->bias + k_))
#define RESIDUAL _mm512_maskz_loadu_ps(m_, ep->residual + i_)
#define EPK_STORES(NW, KV, VALUE)                                                      \
    do {                                                                               \
        _Pragma("GCC unroll 32")                                                       \
        for (int j = 0; j < NW; j++) {                                                 \
            _Pragma("GCC unroll 32")                                                   \
            for (int v = 0; v < KV; v++) {                                             \
                const __m512 acc_ = acc[j][v];                                         \
                const int64_t i_ = (ow0 + j) * YS + k0 + 16 * v;                       \
                const int64_t k_ = kb + 16 * v;                                        \
                const __mmask16 m_ = mask[v];                                          \
                (void)k_;                                                              \
                _mm512_mask_storeu_ps(y_row + i_, m_, VALUE);                          \
            }                                                                          \
        }                                                                              \
    } while (0)

/* One register block: NW output pixels along w by KV vectors of 16 output channels,
 * NW * KV accumulators + KV weight vectors + 1 broadcast <= 32 zmm (see WIDEST). Each
 * (NW, KV) gets its own function with literal array sizes: with sizes passed as
 * arguments the arrays are VLAs, which GCC keeps on the stack (2x slower). */
#define DEFINE_BLOCK(NW, KV)                                                           \
static inline __attribute__((always_inline)) void                                      \
conv_block_##NW##_##KV(const ttile_conv_shape *sh, const float *x_n, const float *panel,\
                       float *y_row, int64_t oh, int64_t ow0, const int64_t P,         \
                       int64_t k0, const __mmask16 *mask, const float *zeros,          \
                       int64_t c0, int64_t c1, const int64_t YS,                       \
                       const ttile_epilogue *ep, int epk, int64_t kb)                  \
{                                                                                      \
    const int64_t H = sh->h, W = sh->w, S = sh->s;                                     \
    const int64_t C = sh->c, R = sh->r, XS = C * sh->groups;                           \
    const int64_t DH = sh->dil_h, DW = sh->dil_w;                                      \
    __m512 acc[NW][KV];                                                                \
    _Pragma("GCC unroll 32")                                                           \
    for (int j = 0; j < NW; j++) {                                                     \
        _Pragma("GCC unroll 32")                                                       \
        for (int v = 0; v < KV; v++)                                                   \
            acc[j][v] = c0 == 0 ? _mm512_setzero_ps()                                  \
                : _mm512_maskz_loadu_ps(mask[v], y_row + (ow0 + j) * YS + k0 + 16 * v);\
    }                                                                                  \
    /* Interior blocks over all channels read, for one r, S*C contiguous floats per    \
     * pixel (NHWC) against S*C contiguous panel steps: one loop of S*C steps instead  \
     * of S loops of C (7x7 on 3 channels: 21 steps, not 7 x 3).                       \
     */                                                                                \
    const int64_t iw_lo = ow0 * sh->stride_w - sh->pad_left;                           \
    const int64_t iw_hi = (ow0 + NW - 1) * sh->stride_w - sh->pad_left + (S - 1) * DW;  \
    const int fused = c0 == 0 && c1 == C && iw_lo >= 0 && iw_hi < W && XS == C        \
                      && DW == 1;                                                      \
    for (int64_t r = 0; r < R; r++) {                                                  \
        const int64_t ih = oh * sh->stride_h + r * DH - sh->pad_top;                   \
        if (ih < 0 || ih >= H)                                                         \
            continue;                                                                  \
        const float *x_row = x_n + ih * W * XS;                                        \
        if (fused) {                                                                   \
            const float *xp[NW];                                                       \
            _Pragma("GCC unroll 32")                                                   \
            for (int j = 0; j < NW; j++)                                               \
                xp[j] = x_row + ((ow0 + j) * sh->stride_w - sh->pad_left) * C;         \
            const float *wp = panel + r * S * C * P;                                   \
            for (int64_t q = 0; q < S * C; q++)                                        \
                FMA_STEP(NW, KV, xp, wp, q);                                           \
            continue;                                                                  \
        }                                                                              \
        for (int64_t s = 0; s < S; s++) {                                              \
            const float *xp[NW];                                                       \
            _Pragma("GCC unroll 32")                                                   \
            for (int j = 0; j < NW; j++) {                                             \
                const int64_t iw = (ow0 + j) * sh->stride_w + s * DW - sh->pad_left;   \
                xp[j] = (iw >= 0 && iw < W) ? x_row + iw * XS : zeros;                 \
            }                                                                          \
            const float *wp = panel + (r * S + s) * C * P;                             \
            for (int64_t c = c0; c < c1; c++)                                          \
                FMA_STEP(NW, KV, xp, wp, c);                                           \
        }                                                                              \
    }                                                                                  \
    /* the epilogue (epk: TTILE_EPK_NONE but on the last channel chunk): conv + bias   \
     * + relu, and with the ResNet shortcut, in registers; the others on the outputs   \
     * just stored, from L1 (each kind in registers is another copy of the stores of   \
     * all 50 block functions: six made this file 4x slower to build) */               \
    if (epk == TTILE_EPK_BIAS_RELU) {                                                  \
        EPK_STORES(NW, KV, _mm512_max_ps(BIASED, _mm512_setzero_ps()));                \
    } else if (epk == TTILE_EPK_BIAS_RESIDUAL_RELU) {                                  \
        EPK_STORES(NW, KV, _mm512_max_ps(_mm512_add_ps(BIASED, RESIDUAL),              \
                                         _mm512_setzero_ps()));                        \
    } else {                                                                           \
        EPK_STORES(NW, KV, acc_);                                                      \
        if (epk != TTILE_EPK_NONE)                                                     \
            epilogue_from_memory(ep, y_row, ow0, NW, KV, YS, k0, kb, mask);            \
    }                                                                                  \
}

#define DEFINE_BLOCKS_OF(KV, W) WIDTHS_##W(DEFINE_BLOCK, KV)
GENERIC_KV(DEFINE_BLOCKS_OF)

static inline __mmask16 tail_mask(int64_t remaining)
{
    if (remaining >= 16)
        return (__mmask16)0xFFFF;
    if (remaining <= 0)
        return (__mmask16)0;
    return (__mmask16)((1u << remaining) - 1u);
}

#define CASE(NW, KV)                                                                   \
    case NW:                                                                           \
        conv_block_##NW##_##KV(sh, x_n, panel, y_row, oh, ow0, pw, k_out, mask, zeros, \
                               c0, c1, ys, block_ep, c1 == sh->c ? block_epk : 0, k0); \
        break;

#define CASE_KV(KV, W)                                                                 \
    case KV: switch (nw) { WIDTHS_##W(CASE, KV) } break;

#define RUN_BLOCK()                                                                    \
    do {                                                                               \
        switch (kv) {                                                                  \
        GENERIC_KV(CASE_KV)                                                            \
        }                                                                              \
    } while (0)

/* A scratch buffer for weights packed per call. Large ones are 2 MiB-aligned and asked
 * for transparent huge pages: a weight panel read from L2 over and over on 4 KiB pages
 * maps to a few L2 sets by chance, and a 1.2 MB panel (Yolo9000-18) then ran at half
 * speed in some runs and not in others (numpy asks for huge pages for its large arrays,
 * so ttile.Conv2d's packed weights never showed it). */
static float *alloc_packed(size_t bytes)
{
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge)
        return aligned_alloc(64, (bytes + 63) / 64 * 64);
    bytes = (bytes + huge - 1) / huge * huge;
    float *buffer = aligned_alloc(huge, bytes);
#ifdef MADV_HUGEPAGE
    if (buffer != NULL)
        madvise(buffer, bytes, MADV_HUGEPAGE); /* advice only: failure changes nothing */
#endif
    return buffer;
}

int ttile_conv_generic_avx512(const ttile_conv_shape *sh, const float *x, const float *w,
                              float *y, int nthreads, const ttile_epilogue *ep)
{
    if (sh->groups != 1)
        return -1;
    const int64_t P = ttile_generic_panel(sh->k, sh->wo);
    const int64_t kchunks = (sh->k + P - 1) / P;
    const int64_t rsc = sh->r * sh->s * sh->c;
    float *packed = alloc_packed((size_t)(kchunks * rsc * P) * sizeof(float));
    if (packed == NULL)
        return -1;
    ttile_pack_weights(w, rsc, sh->k, P, packed, nthreads);
    const int status = ttile_conv_generic_avx512_packed(sh, x, packed, y, nthreads, 0, ep);
    free(packed);
    return status;
}

/* A 1x1 convolution with stride 1 and no padding reads and writes every image as one
 * row of H*W pixels (NHWC keeps them contiguous). Split into register blocks as one row,
 * 17 x 17 pixels make 49 blocks of 5-6 pixels instead of 17 rows of 6 + 6 + 5. */
static ttile_conv_shape as_one_row_if_pointwise(const ttile_conv_shape *sh)
{
    ttile_conv_shape flat = *sh;
    if (sh->r == 1 && sh->s == 1 && sh->stride_h == 1 && sh->stride_w == 1
        && sh->pad_top == 0 && sh->pad_left == 0 && sh->ho == sh->h && sh->wo == sh->w) {
        flat.h = flat.ho = 1;
        flat.w = flat.wo = sh->h * sh->w;
    }
    return flat;
}

int ttile_conv_generic_avx512_packed(const ttile_conv_shape *shape, const float *x,
                                     const float *packed, float *y, int nthreads,
                                     int flags, const ttile_epilogue *ep)
{
    if (ttile_epilogue_is_empty(ep))
        ep = NULL;
    const int nchw_out = (flags & TTILE_NCHW_OUT) != 0;
    /* RSCK weights, packed inside the kernel: each thread packs the panels of the group
     * it works on into a buffer of its own (at most L2_PANEL_BYTES, or one panel) when
     * it moves to that group, and reads them from there. A per-call conv2d then reads
     * its weights once: packed beforehand, they were read, written to memory and read
     * back (on a 9.4 MB layer, as long as the convolution when the caches were cold). */
    const int kcrs = (flags & TTILE_KCRS_WEIGHTS) != 0;
    const int rsck = (flags & TTILE_RSCK_WEIGHTS) != 0 || kcrs;
    if ((flags & TTILE_RSCK_WEIGHTS) && shape->groups != 1)
        return -1;
    /* The panel width follows the shape as given (the caller packed for it). */
    const int64_t P = ttile_generic_panel(shape->k, shape->wo);
    const ttile_conv_shape flat = as_one_row_if_pointwise(shape);
    const ttile_conv_shape *sh = &flat;
    const int64_t N = sh->n, K = sh->k, HO = sh->ho, WO = sh->wo, G = sh->groups;
    const int64_t KT = K * G;   /* output channels of all groups: NHWC's pixel stride */
    const int64_t kchunks = (K + P - 1) / P;
    const int64_t rsc = sh->r * sh->s * sh->c;
    /* Channels per chunk: the chunk's part of a panel (R*S*cchunk steps of 4P bytes) is
     * read by every block of an output row from L2. Chunks as long as that allows: a
     * block's (r, s) bookkeeping (padding checks, pointers) and its accumulators' reload
     * are paid once per chunk, and with L1-sized chunks (10 channels of a 3x3 layer) they
     * cost ~20 % (measured: 70 -> 85-100 GFLOP/s on the large Yolo9000 layers). */
    int64_t cchunk = WEIGHT_CHUNK_BYTES / (sh->r * sh->s * 4 * P);
    cchunk = cchunk < 8 ? 8 : cchunk;
    /* A row of zeros stands in for input pixels in the padding. */
    float *zeros = calloc((size_t)sh->c + 16, sizeof(float));
    if (zeros == NULL)
        return -1;

    /* Panels are visited in groups that fit in L2, each group for every output row, so
     * a weight tensor larger than the caches is read from memory once rather than once
     * per output row (Yolo9000-23 has 115 MB of weights and 17 rows). */
    const int64_t panel_bytes = rsc * P * (int64_t)sizeof(float);
    const int64_t group = L2_PANEL_BYTES / panel_bytes > 1 ? L2_PANEL_BYTES / panel_bytes : 1;
    const int64_t ngroups = (kchunks + group - 1) / group;
    /* Each row's blocks are run in `segments` runs of consecutive blocks: one per row,
     * except for a flattened 1x1 layer, whose single row is cut into as many runs as the
     * image had rows, so that threads still have that many pieces to share; and more
     * when there are fewer (image, panel group, row) tasks than threads (a 7x7 layer on
     * 16 threads: 7 rows, each cut in 3). A run may end up empty; it costs nothing. */
    int64_t segments = HO == shape->ho ? 1 : shape->ho;
    const int64_t tasks = N * G * ngroups * HO * segments;
    if (tasks < nthreads)
        segments *= (nthreads + tasks - 1) / tasks;

    /* An NCHW output (y[n][k][oh][ow], torch's layout) is written through a row buffer
     * of the task's pixels by the group's channels, in NHWC order as the blocks store
     * it, then transposed into place while it is still in L1/L2: no second pass over
     * the whole output. */
    const int64_t group_width = (group < kchunks ? group : kchunks) * P;
    const size_t rowbuf_bytes = (size_t)(WO * group_width) * sizeof(float);
    int failed = 0;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
    float *rowbuf = nchw_out ? alloc_packed(rowbuf_bytes) : NULL;
    float *wbuf = rsck ? alloc_packed((size_t)(group_width * rsc) * sizeof(float)) : NULL;
    int64_t wbuf_group = -1;   /* the group whose panels wbuf holds */
    if ((nchw_out && rowbuf == NULL) || (rsck && wbuf == NULL)) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for collapse(4) schedule(static)
    for (int64_t n = 0; n < N; n++) {
      for (int64_t cg = 0; cg < G; cg++) {   /* convolution group */
        for (int64_t g = 0; g < ngroups; g++) {   /* panel group */
            for (int64_t row = 0; row < HO * segments; row++) {
              if ((nchw_out && rowbuf == NULL) || (rsck && wbuf == NULL))
                  continue;
              const int64_t oh = row / segments, segment = row % segments;
              const float *x_n = x + n * sh->h * sh->w * sh->c * G + cg * sh->c;
              const int64_t kc_end = (g + 1) * group < kchunks ? (g + 1) * group : kchunks;
              const int64_t kg0 = g * group * P;
              /* NHWC: the output row itself; NCHW: the row buffer, channels from kg0 */
              const int64_t row_offset = (n * HO + oh) * WO * KT + cg * K;
              float *y_row = nchw_out ? rowbuf : y + row_offset;
              const int64_t ys = nchw_out ? group_width : KT;
              /* The epilogue as the blocks apply it: bias from this group's channels;
               * the residual aligned with y_row (NHWC), or added after the transpose
               * together with the activation (NCHW, in ttile_epilogue_row512). */
              ttile_epilogue row_ep;
              const ttile_epilogue *block_ep = NULL;
              if (ep != NULL) {
                  row_ep = *ep;
                  row_ep.bias = ep->bias ? ep->bias + cg * K : NULL;
                  if (nchw_out) {
                      row_ep.residual = NULL;
                      if (ep->residual)
                          row_ep.activation = TTILE_ACT_NONE;
                  } else if (ep->residual) {
                      row_ep.residual = ep->residual + row_offset;
                  }
                  block_ep = &row_ep;
              }
              const int block_epk = ttile_epilogue_kind(block_ep);
              const int64_t wkey = cg * ngroups + g;   /* which panels wbuf holds */
              if (rsck && wbuf_group != wkey) {
                  for (int64_t kc = g * group; kc < kc_end; kc++) {
                      float *out = wbuf + (kc - g * group) * rsc * P;
                      if (kcrs)
                          ttile_pack_kcrs_columns(packed + cg * K * rsc, K, sh->c,
                                                  sh->r * sh->s, P, kc, 0, rsc, out, 1);
                      else
                          ttile_pack_panel_rows(packed, K, P, kc, 0, rsc, out);
                  }
                  wbuf_group = wkey;
              }
              for (int64_t kc = g * group; kc < kc_end; kc++) {
                const int64_t k0 = kc * P, pw = P;
                const int64_t k_out = nchw_out ? k0 - kg0 : k0;
                const float *panel = rsck ? wbuf + (kc - g * group) * rsc * P
                                          : packed + (cg * kchunks + kc) * rsc * P;
                int kv = (int)((K - k0 + 15) / 16);
                kv = kv < (int)(P / 16) ? kv : (int)(P / 16);
                __mmask16 mask[MAX_KV];
                for (int v = 0; v < MAX_KV; v++)
                    mask[v] = tail_mask(K - k0 - 16 * v);
                /* Split the row into blocks of nearly equal width (17 -> 9 + 8, not
                 * 12 + 5) so that no block is left with too few accumulators. */
                const int64_t widest = WIDEST[kv];
                const int64_t nblocks = (WO + widest - 1) / widest;
                const int64_t base = WO / nblocks, wider = WO % nblocks;
                const int64_t b_lo = nblocks * segment / segments;
                const int64_t b_hi = nblocks * (segment + 1) / segments;
                /* the pixels this panel's blocks cover (they depend on kv: panels of one
                 * segment can cover different pixels) */
                const int64_t px_lo = b_lo * base + (b_lo < wider ? b_lo : wider);
                int64_t px_hi = px_lo;
                for (int64_t c0 = 0; c0 < sh->c; c0 += cchunk) {
                    const int64_t c1 = c0 + cchunk < sh->c ? c0 + cchunk : sh->c;
                    int64_t ow0 = px_lo;
                    for (int64_t b = b_lo; b < b_hi; b++) {
                        const int nw = (int)(base + (b < wider ? 1 : 0));
                        RUN_BLOCK();
                        ow0 += nw;
                    }
                    px_hi = ow0;
                }
                if (nchw_out && px_hi > px_lo) {  /* this panel's channels, into place */
                    const int64_t kw = K - k0 < P ? K - k0 : P;
                    const int64_t first = (n * KT + cg * K + k0) * HO * WO + oh * WO + px_lo;
                    ttile_transpose_tile_avx512(rowbuf + px_lo * group_width + k_out,
                                                group_width, y + first,
                                                HO * WO, px_hi - px_lo, kw, 0, 1, 1);
                    if (ep != NULL && ep->residual)   /* still in L1: residual, activation */
                        for (int64_t kk = 0; kk < kw; kk++)
                            ttile_epilogue_row512(ep, y, first + kk * HO * WO,
                                                  px_hi - px_lo, 0, 0);
                }
              }
            }
        }
      }
    }
    free(rowbuf);
    free(wbuf);
    }
    if (failed) {
        free(zeros);
        return -1;
    }
    free(zeros);
    return 0;
}
