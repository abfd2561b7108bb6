/* Hand-written runtime support shared by the extension and generated kernels.
 *
 * Tensor layouts are the kernels' native ones:
 *   input  x[N][H][W][C]     (NHWC)
 *   weight w[R][S][C][K]     (RSCK: k contiguous, the vectorized dimension)
 *   output y[N][Ho][Wo][K]   (NHWC)
 * All offsets are computed in int64_t so tensors larger than 2^31 elements index correctly.
 */
#ifndef TTILE_RUNTIME_H
#define TTILE_RUNTIME_H

#include <stdint.h>
#include <string.h>

#include "ttile_epilogue.h"

/* One convolution problem. With groups > 1 the input has c * groups channels and the
 * output k * groups: group g reads input channels [g*c, (g+1)*c) and writes output
 * channels [g*k, (g+1)*k) (torch's grouping), so c and k are per group. */
typedef struct {
    int64_t n, h, w, c;        /* input extents (c per group) */
    int64_t k, r, s;           /* weight extents besides c (k per group) */
    int64_t ho, wo;            /* output extents */
    int64_t stride_h, stride_w;
    int64_t pad_top, pad_left; /* bottom/right padding is implied by ho, wo */
    int64_t dil_h, dil_w;      /* dilation (1: none) */
    int64_t groups;            /* >= 1 */
} ttile_conv_shape;

/* An inverted residual block (kernels/inverted_residual_avx512.c): 1x1 expand c -> e
 * with act1, 3x3 depthwise (padding 1, stride 1 or 2) with act2, 1x1 project e -> k with
 * act3, plus the block's input when `residual` (stride 1, c == k). */
typedef struct {
    int64_t n, h, w, c;        /* input */
    int64_t e, k;              /* expanded and output channels */
    int64_t stride;            /* the depthwise stride: 1 or 2 */
    int64_t ho, wo;            /* output extents */
    int act1, act2, act3;      /* TTILE_ACT_* of the three stages */
    float slope1, slope2, slope3;
    int residual;
} ttile_ir_shape;

/* 1 when the CPU and the OS (XCR0 state) both support AVX-512F, else 0. */
int ttile_cpu_has_avx512f(void);
/* 1 when the CPU has AVX2 and FMA and the OS saves the YMM state, else 0. */
int ttile_cpu_has_avx2(void);
/* 1 when the CPU has AVX512_BF16 (with AVX-512F, BW and VL, and their state), else 0. */
int ttile_cpu_has_avx512bf16(void);
/* 1 when the CPU has AMX-BF16 and AMX-TILE and the OS enables their state, else 0. */
int ttile_cpu_has_amx_bf16(void);
/* 1 when this process may execute AMX instructions: the CPU has them and Linux granted
 * the tile data state (asked on the first call), else 0. */
int ttile_amx_request(void);
/* This core's L2 cache in bytes (cpuid leaf 0x80000006, which AMD and Intel both
 * report; 0 when unknown). */
int64_t ttile_cpu_l2_bytes(void);
/* The generic kernel's cache blocking: the bytes of a panel group (the weight panels a
 * thread keeps in L2 across an output row) and of a reduction chunk's part of a panel.
 * Half this core's L2 unless set (ttile_set_generic_cache_bytes; <= 0 restores the
 * default); both kernels of both ISAs read them. */
int64_t ttile_generic_cache_bytes(void);
void ttile_set_generic_cache_bytes(int64_t bytes);
/* The generic kernel's NHWC outputs larger than this are written past the caches
 * (non-temporal stores): those larger than the L3 a core shares (cpuid's cache topology;
 * 32 MiB when unknown), whose lines would leave it before the next layer read them. Set for
 * tests (ttile_set_generic_stream_bytes; <= 0 restores the default). */
int64_t ttile_generic_stream_bytes(void);
void ttile_set_generic_stream_bytes(int64_t bytes);

/* Generic kernels: runtime shapes, any stride and padding, correct for every shape.
 * The AVX-512 one packs the weights into a scratch buffer and returns -1, writing
 * nothing, when that allocation fails; 0 on success. */
/* Every kernel takes the epilogue to fuse into its output store (NULL: none). The
 * portable one reads RSCK weights (R, S, c, k * groups). */
void ttile_conv_generic_portable(const ttile_conv_shape *shape, const float *x,
                                 const float *w, float *y, int nthreads,
                                 const ttile_epilogue *ep);
/* The vector generic kernels (generic_conv.inc), one per ISA: _avx512 (AVX-512F) and
 * _avx2 (AVX2 + FMA), with the same arguments and results. */
int ttile_conv_generic_avx512(const ttile_conv_shape *shape, const float *x,
                              const float *w, float *y, int nthreads,
                              const ttile_epilogue *ep);
int ttile_conv_generic_avx2(const ttile_conv_shape *shape, const float *x,
                            const float *w, float *y, int nthreads,
                            const ttile_epilogue *ep);
/* The panel width a generic kernel reads for k output channels and output rows of wo
 * pixels: its vector width times its register block's vector count (AVX-512: 16, 32,
 * 48 or 64; AVX2: 8, 16 or 24). */
int64_t ttile_generic_panel_avx512(int64_t k, int64_t wo);
int64_t ttile_generic_panel_avx2(int64_t k, int64_t wo);
/* The same on weights already packed by ttile_pack_weights with that panel width (what
 * a pre-packed ttile.Conv2d holds; with groups, one packed tensor per group, one after
 * the other); -1 when its small scratch allocation fails. Flags:
 * TTILE_NCHW_OUT: y is y[N][K][Ho][Wo] (torch's layout), written from the tile;
 * TTILE_RSCK_WEIGHTS: `packed` is the RSCK weights themselves; each thread packs the
 * panels it needs into a buffer of its own, group by group; TTILE_KCRS_WEIGHTS: the
 * same from KCRS weights (torch's layout, groups stacked along K). RSCK weights need
 * groups == 1 (-1 otherwise). TTILE_NCHW_IN: x is x[N][C][H][W], read as it is.
 * Two flags set the blocking where the default one was chosen for weights in the
 * caches, and a network's context verdict may find otherwise with its weights coming
 * from memory: TTILE_GROUPS_FIRST, each thread takes whole panel groups (a share of the
 * weights) even where all the panels fit in its L2 and it would take whole rows;
 * TTILE_SMALL_GROUPS, panel groups of half the cache blocking (the first group, read
 * before anything streams it in, is half as large). TTILE_QUERY_DIRECT (with
 * TTILE_RSCK_WEIGHTS): nothing is read or computed; returns 1 where the kernel would
 * read the RSCK weights in place (its direct path: no packing), else 0. */
#define TTILE_NCHW_OUT 1
#define TTILE_RSCK_WEIGHTS 2
#define TTILE_KCRS_WEIGHTS 4
#define TTILE_NCHW_IN 8
#define TTILE_GROUPS_FIRST 16
#define TTILE_SMALL_GROUPS 32
#define TTILE_QUERY_DIRECT 64
int ttile_conv_generic_packed_avx512(const ttile_conv_shape *shape, const float *x,
                                     const float *packed, float *y, int nthreads,
                                     int flags, const ttile_epilogue *ep);
int ttile_conv_generic_packed_avx2(const ttile_conv_shape *shape, const float *x,
                                   const float *packed, float *y, int nthreads,
                                   int flags, const ttile_epilogue *ep);

/* The Winograd F(4x4, 3x3) and F(2x2, 3x3) kernels (winograd_conv.inc), one per ISA:
 * 3x3, stride 1, no dilation, one group, NHWC; `tile` (4 or 2) is the output tile m.
 * _panel: output channels per panel of the transformed weights; _weight_floats: their
 * size; _weights: RSCK (or, kcrs, torch's KCRS) weights transformed into it;
 * ttile_conv_winograd_*: the convolution on them (-1 on another shape or tile, or when its
 * scratch allocation fails). The two ISAs' and the two tiles' transformed weights
 * differ. */
int64_t ttile_winograd_panel_avx512(int64_t k);
int64_t ttile_winograd_panel_avx2(int64_t k);
int64_t ttile_winograd_weight_floats_avx512(int64_t c, int64_t k, int tile);
int64_t ttile_winograd_weight_floats_avx2(int64_t c, int64_t k, int tile);
void ttile_winograd_weights_avx512(const float *w, int64_t c, int64_t k, int kcrs, float *u,
                                   int nthreads, int tile);
void ttile_winograd_weights_avx2(const float *w, int64_t c, int64_t k, int kcrs, float *u,
                                 int nthreads, int tile);
int ttile_conv_winograd_avx512(const ttile_conv_shape *shape, const float *x, const float *u,
                               float *y, int nthreads, const ttile_epilogue *ep, int tile);
int ttile_conv_winograd_avx2(const ttile_conv_shape *shape, const float *x, const float *u,
                             float *y, int nthreads, const ttile_epilogue *ep, int tile);

/* Depthwise convolution (groups == input channels, k = 1 output channel per group),
 * NHWC, weights (R, S, groups): channels in the vector lanes, outputs blocked along w
 * (depthwise_avx512.c). */
void ttile_conv_depthwise_avx512(const ttile_conv_shape *shape, const float *x,
                                 const float *w, float *y, int nthreads,
                                 const ttile_epilogue *ep);
/* An inverted residual block in one call (inverted_residual_avx512.c): x (n, h, w, c),
 * the packed weights its file describes, y (n, ho, wo, k); scratch holds
 * ttile_inverted_residual_scratch_floats(shape, nthreads) floats on a 64-byte line; w1
 * and b1 NULL for a block without its expand stage (e == c: the depthwise layer reads x).
 * -1 (nothing written) for a stride other than 1 or 2, a residual the shapes do not
 * allow, or no expand stage with e != c. */
int64_t ttile_inverted_residual_scratch_floats(const ttile_ir_shape *shape, int nthreads);
/* Packs a 1x1 stage's kk x n weights (row q at w + q * ldw) into out (kk x n rounded up
 * to 16 floats) as the fused kernel reads them. */
void ttile_inverted_residual_pack(const float *w, int64_t kk, int64_t n, int64_t ldw,
                                  float *out);
int ttile_inverted_residual_avx512(const ttile_ir_shape *shape, const float *x,
                                   const float *w1, const float *b1, const float *w2,
                                   const float *b2, const float *w3, const float *b3,
                                   float *y, float *scratch, int nthreads);
/* The grouped kernel (grouped_avx512.c): 2, 4, 8 or 16 channels a group in and out,
 * several groups' output channels in the vector lanes; weights (K/16, R, S, cg * 16). */
int ttile_grouped_lanes_supported(int64_t c, int64_t k, int64_t groups);
int ttile_conv_grouped_avx512(const ttile_conv_shape *shape, const float *x, const float *w,
                              float *y, int nthreads, const ttile_epilogue *ep);
/* The fused blocks' ring of three expanded rows (each w + 2 pixels of ep floats, the
 * outer two zero): the slot of input row ih of image img, or NULL above or below the map.
 * *fill says whether the slot holds another row, which the caller then computes into
 * pixels 1 .. w (its outer two pixels cleared here); `held` tracks the slots. */
static inline float *ttile_ir_ring_row(const ttile_ir_shape *sh, float *ring, int64_t ep,
                                       int64_t held[3], int64_t img, int64_t ih, int *fill)
{
    *fill = 0;
    if (ih < 0 || ih >= sh->h)
        return NULL;
    const int slot = (int)(ih % 3);
    float *e = ring + slot * (sh->w + 2) * ep;
    if (held[slot] != img * sh->h + ih) {
        memset(e, 0, (size_t)ep * sizeof(float));
        memset(e + (sh->w + 1) * ep, 0, (size_t)ep * sizeof(float));
        held[slot] = img * sh->h + ih;
        *fill = 1;
    }
    return e;
}
/* The depthwise row of the fused block (kernels/inverted_residual_avx512.c), channels
 * c0 .. c1: rows[r] are the expanded rows oh * stride - 1 + r (NULL outside the map), each
 * w + 2 pixels of ep floats; d gets wo pixels of ep floats. */
__attribute__((visibility("hidden")))
void ttile_ir_dw_row(const ttile_ir_shape *sh, int64_t ep, const float *const rows[3],
                     const float *w2, const float *b2, float *d, int64_t c0, int64_t c1);
/* The block in bf16 with its 1x1 stages on AMX (kernels/inverted_residual_amx.c): x and
 * y fp32 or bf16 bits (x_bf16, y_bf16), w1 and w3 packed by ttile_bf16_pack_weights
 * (r = s = 1, kc = 32; w1 NULL: no expand stage), b1, w2, b2 and b3 as for
 * ttile_inverted_residual_avx512; scratch of ttile_inverted_residual_amx_scratch_bytes,
 * on a 64-byte line. 0, or -1 where the CPU or the OS refuses AMX (nothing written). */
int64_t ttile_inverted_residual_amx_scratch_bytes(const ttile_ir_shape *shape, int nthreads);
int ttile_inverted_residual_amx(const ttile_ir_shape *shape, const void *x, int x_bf16,
                                const uint16_t *w1, const float *b1, const float *w2,
                                const float *b2, const uint16_t *w3, const float *b3,
                                void *y, int y_bf16, void *scratch, int nthreads);
/* The same with 8 channels in the vector lanes, for the AVX2 + FMA family
 * (depthwise_avx2.c). */
void ttile_conv_depthwise_avx2(const ttile_conv_shape *shape, const float *x,
                               const float *w, float *y, int nthreads,
                               const ttile_epilogue *ep);

/* The same in torch's layout: x[N][groups][H][W], weights [groups][1][R][S], y and the
 * residual [N][groups][Ho][Wo]; 16 outputs of a row in the vector lanes
 * (depthwise_nchw_avx512.c). It serves column strides 1 and 2 and up to 8 taps along w
 * (ttile_depthwise_nchw_supported) and returns -1, writing nothing, otherwise; 0 on
 * success. */
int ttile_depthwise_nchw_supported(const ttile_conv_shape *shape);
int ttile_conv_depthwise_nchw_avx512(const ttile_conv_shape *shape, const float *x,
                                     const float *w, float *y, int nthreads,
                                     const ttile_epilogue *ep);

/* 1x1 convolution, stride 1, no padding, one group, in torch's layout: x[N][C][H][W],
 * y and the residual [N][K][H][W], weights [K][C] (w_kc = 1: torch's (K, C, 1, 1)) or
 * [C][K] (w_kc = 0: RSCK); a matrix product per image with 16 pixels in the vector
 * lanes (pointwise_nchw_avx512.c). Returns -1, writing nothing, for any other shape
 * (ttile_pointwise_nchw_supported), 0 on success. */
int ttile_pointwise_nchw_supported(const ttile_conv_shape *shape);
int ttile_conv_pointwise_nchw_avx512(const ttile_conv_shape *shape, const float *x,
                                     const float *w, int w_kc, float *y, int nthreads,
                                     const ttile_epilogue *ep);

/* Pack RSCK weights (rsc = R*S*C rows of k floats) into panels [ceil(k/panel)][rsc][panel],
 * zero-filling the tail. */
void ttile_pack_weights(const float *w, int64_t rsc, int64_t k, int64_t panel, float *out,
                        int nthreads);
/* Rows [i0, i1) of panel p alone (out points at the panel): what ttile_pack_weights does
 * per task, and what the generic kernel's threads do for the panels they use. */
void ttile_pack_panel_rows(const float *w, int64_t k, int64_t panel, int64_t p, int64_t i0,
                           int64_t i1, float *out);

/* 1 when the nbytes at a and b are equal, else 0 (parallel memcmp; pack_weights.c). */
int ttile_same_bytes(const void *a, const void *b, int64_t nbytes, int nthreads);
/* Max pooling (kh x kw window, stride, top/left padding <= half the window; the output
 * ho x wo given) and global average pooling (over hw pixels) of NHWC arrays
 * (pool_nhwc.c). */
void ttile_maxpool_nhwc(const float *x, float *y, int64_t n, int64_t h, int64_t w,
                        int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                        int64_t ph, int64_t pw, int64_t ho, int64_t wo, int nthreads,
                        int isa);
/* The same max pooling on bf16 bits (exact: the maximum of rounded values is the
 * rounded maximum). isa: TTILE_LAYOUT_AVX512 for pool_avx512.c's loop (on a CPU that
 * has it), else the plain C one. */
void ttile_maxpool_nhwc_bf16(const uint16_t *x, uint16_t *y, int64_t n, int64_t h,
                             int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t sh,
                             int64_t sw, int64_t ph, int64_t pw, int64_t ho, int64_t wo,
                             int nthreads, int isa);
void ttile_global_avgpool_nhwc(const float *x, float *y, int64_t n, int64_t hw,
                               int64_t c, int nthreads);
/* The two max poolings with AVX-512F (pool_avx512.c), which those call on such CPUs. */
void ttile_maxpool_nhwc_avx512(const float *x, float *y, int64_t n, int64_t h, int64_t w,
                               int64_t c, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                               int64_t ph, int64_t pw, int64_t ho, int64_t wo, int nthreads);
void ttile_maxpool_nhwc_bf16_avx512(const uint16_t *x, uint16_t *y, int64_t n, int64_t h,
                                    int64_t w, int64_t c, int64_t kh, int64_t kw,
                                    int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                    int64_t ho, int64_t wo, int nthreads);
/* 1 when RSCK weights hold bit for bit what their panels packed by ttile_pack_weights
 * hold, else 0 (parallel, reading only; isa as for the layout conversions below;
 * pack_weights.c). */
int ttile_packed_matches(const void *w, int64_t rsc, int64_t k, int64_t panel,
                         const void *packed, int nthreads, int isa);
/* Its rows [i0, i1) of panel p with AVX-512 (layout_avx512.c) or AVX2 (layout_avx2.c):
 * nonzero if any differ. */
int ttile_packed_rows_differ_avx512(const float *w, int64_t k, int64_t panel, int64_t p,
                                    int64_t i0, int64_t i1, const float *out);
int ttile_packed_rows_differ_avx2(const float *w, int64_t k, int64_t panel, int64_t p,
                                  int64_t i0, int64_t i1, const float *out);

/* The `isa` codes of the layout conversions and weight packers: their vector tiles, the
 * caller having checked the CPU (the extension's ISA_* numbers). */
#define TTILE_LAYOUT_PORTABLE 0
#define TTILE_LAYOUT_AVX512 1
#define TTILE_LAYOUT_AVX2 2

/* Activations between torch's layout and the kernels': src[n][c][hw] -> dst[n][hw][c]
 * and back (layout.c, blocked and parallel). isa: a TTILE_LAYOUT_* code (AVX-512 tiles,
 * AVX2 tiles or portable C). */
void ttile_nchw_to_nhwc(const float *src, float *dst, int64_t n, int64_t c, int64_t hw,
                        int nthreads, int isa);
void ttile_nhwc_to_nchw(const float *src, float *dst, int64_t n, int64_t hw, int64_t c,
                        int nthreads, int isa);
/* The pixels a strided 1x1 layer reads: dst[p][oh][ow] = src[p][oh sh][ow sw] for
 * `planes` planes (layout.c, parallel; isa as above), ho rows of a plane at column
 * stride 2 with AVX-512 (layout_avx512.c). */
void ttile_subsample_nchw(const float *src, float *dst, int64_t planes, int64_t h,
                          int64_t w, int64_t sh, int64_t sw, int64_t ho, int64_t wo,
                          int nthreads, int isa);
void ttile_subsample_plane2_avx512(const float *src, float *dst, int64_t w, int64_t sh,
                                   int64_t ho, int64_t wo);
/* NCHW -> NHWC pixels [p0, p1) of one image of c <= 4 channels, by permutes
 * (layout_avx512.c). */
void ttile_interleave_small_avx512(const float *src, float *dst, int64_t c, int64_t hw,
                                   int64_t p0, int64_t p1);
/* One tile of those conversions with AVX-512 (layout_avx512.c), AVX2 (layout_avx2.c),
 * and in plain C; with `stream`, whole aligned destination lines are stored past the
 * caches (the portable loop ignores it). */
void ttile_transpose_tile_avx2(const float *src, int64_t sstride, float *dst,
                               int64_t dstride, int64_t rows, int64_t cols,
                               int64_t first, int64_t group, int64_t groups, int stream);
void ttile_transpose_tile_avx512(const float *src, int64_t sstride, float *dst,
                                 int64_t dstride, int64_t rows, int64_t cols,
                                 int64_t first, int64_t group, int64_t groups, int stream);
void ttile_transpose_tile_portable(const float *src, int64_t sstride, float *dst,
                                   int64_t dstride, int64_t rows, int64_t cols,
                                   int64_t first, int64_t group, int64_t groups, int stream);
/* The same transpose rows outermost, for the weights packed into panels (KCRS rows:
 * 16 read streams at a time; layout_avx512.c). */
void ttile_regroup_tile_avx512(const float *src, int64_t sstride, float *dst,
                               int64_t dstride, int64_t rows, int64_t cols, int64_t first,
                               int64_t group, int64_t groups);
/* Destinations larger than this are written with non-temporal stores: their lines would
 * leave the caches before anything read them (as the generated kernels' NCHW stores,
 * ttile.core.codegen.NCHW_STREAM_BYTES). */
#define TTILE_STREAM_BYTES ((int64_t)8 << 20)
/* Columns [col0, col1) (x = ci * rs + t) of panel p of KCRS weights (out points at the
 * panel): what ttile_pack_weights_kcrs does per task, and the generic kernel's threads
 * for the panels they use. */
void ttile_pack_kcrs_columns(const float *w, int64_t k, int64_t c, int64_t rs,
                             int64_t panel, int64_t p, int64_t col0, int64_t col1,
                             float *out, int isa);
/* KCRS weights (rs = R*S) straight into panels [ceil(k/panel)][rs][c][panel], the tail
 * zero-filled; panel = k gives RSCK. */
void ttile_pack_weights_kcrs(const float *w, int64_t k, int64_t c, int64_t rs,
                             int64_t panel, float *out, int nthreads, int isa);

/* FMA-throughput microbenchmark: runs `iterations` rounds of 24 independent 16-lane
 * FMA chains on the calling thread and returns the seconds taken. */
double ttile_fma_peak_avx512(int64_t iterations);

/* Read bandwidth: seconds to sum `floats` floats of `buffer` `reps` times (AVX-512F). */
double ttile_read_seconds_avx512(const float *buffer, int64_t floats, int64_t reps);

/* The same two on AVX2 + FMA (12 chains of 8-lane FMAs: 192 flops a round; 8-lane loads). */
double ttile_fma_peak_avx2(int64_t iterations);
double ttile_read_seconds_avx2(const float *buffer, int64_t floats, int64_t reps);

#endif
