/* Layout conversions at memory speed: NCHW <-> NHWC activations and KCRS weights packed
 * straight into the kernels' panels.
 *
 * The kernels run in NHWC with weights in k panels; torch's layout is NCHW with KCRS
 * weights. numpy's strided copies did the conversion on one thread and element by
 * element along the slow axis (a 3-channel 544x544 input, or 9.4 MB of ResNet18-12
 * weights, took longer than the convolution). Here each conversion is a blocked
 * transpose: tiles of TILE x TILE floats, read along one axis and written along the
 * other, so both sides touch whole cache lines, spread over threads. Compiled for the
 * baseline ISA: the work is memory-bound. */
#include "ttile_runtime.h"

#define TILE 64
/* NCHW -> NHWC tiles: 16 channel rows (one register transpose high) by 256 pixel
 * columns, and the next tile's source rows prefetched. Each row read is 1 KB
 * contiguous; with 64 x 64 tiles a 32-channel 272x272 image was read through 32
 * interleaved streams of 256 B and converted at 16 GB/s from memory; this shape ran
 * 26-30 GB/s, up to 2x faster, on the Zen 5 it was measured on (warm-cache rates
 * unchanged). */
#define ROW_TILE 16
#define COL_TILE 256
/* NHWC -> NCHW tiles: up to 1024 pixel rows by 16 channel columns, so that each task
 * writes 16 planes along up to 4 KB each; the next task (the next 16 channels of the
 * same pixels) reads the lines after the ones this task read, which the adjacent-line
 * prefetch has brought in. 16 pixels by 256 channels per tile (the tiles above,
 * transposed) wrote a line into each of 64 planes per 16 pixels and ran a 272x272x64
 * output at 16-21 GB/s; 1024 x 16 ran at 70 (with streaming stores past 8 MB), and at
 * least as fast as any other tile shape tried on 544x544x32, 17x17x28269, 56x56x256
 * and 7x7x1024 (Zen 5, 1 thread). */
#define OUT_PIXEL_TILE 1024
#define OUT_CHANNEL_TILE 16
/* Inputs of up to SMALL_CHANNELS channels go through ttile_interleave_small_avx512,
 * SMALL_PIXELS pixels per task. */
#define SMALL_CHANNELS 4
#define SMALL_PIXELS 4096

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* One tile: dst[row(first + c) * dstride + r] = src[r * sstride + c], r < rows,
 * c < cols, with row(x) = (x % group) * groups + x / group (see layout_avx512.c), in
 * plain C (the AVX2 generic kernel's NCHW stores use it too; `stream` is a hint it does
 * not take). */
void ttile_transpose_tile_portable(const float *src, int64_t sstride, float *dst,
                                   int64_t dstride, int64_t rows, int64_t cols,
                                   int64_t first, int64_t group, int64_t groups, int stream)
{
    (void)stream;
    for (int64_t c = 0; c < cols; c++) {
        const int64_t x = first + c;
        float *d = dst + ((x % group) * groups + x / group) * dstride;
        for (int64_t r = 0; r < rows; r++)
            d[r] = src[r * sstride + c];
    }
}

static void transpose_tile(const float *src, int64_t sstride, float *dst, int64_t dstride,
                           int64_t rows, int64_t cols, int64_t first, int64_t group,
                           int64_t groups, int isa, int stream)
{
    if (isa == TTILE_LAYOUT_AVX512)
        ttile_transpose_tile_avx512(src, sstride, dst, dstride, rows, cols, first, group,
                                    groups, stream);
    else if (isa == TTILE_LAYOUT_AVX2)
        ttile_transpose_tile_avx2(src, sstride, dst, dstride, rows, cols, first, group,
                                  groups, stream);
    else
        ttile_transpose_tile_portable(src, sstride, dst, dstride, rows, cols, first, group,
                                      groups, stream);
}

/* dst[b][c][r] = src[b][r][c] for `batch` matrices of rows x cols, in tiles of
 * row_tile x col_tile (one per task); `pixels_in_cols`: the columns are the pixels (NCHW
 * -> NHWC), else the rows are. Tasks run pixel tiles outermost, so that a thread's tasks
 * cover a range of pixels, whole: split by channel tiles, 2 threads wrote the two 64-byte
 * halves of each 128-byte NHWC pixel row of a 32-channel input, lines the adjacent-line
 * prefetch pairs, and converted Yolo9000-2's 9.5 MB input in 1.09 ms against 0.47 on one
 * thread (Zen 5). `prefetch`: the next task's source rows are prefetched a line at a time
 * (the NCHW -> NHWC direction, whose tiles are few rows long); `stream`: a destination
 * past TTILE_STREAM_BYTES is stored past the caches (the NCHW output a call returns, not
 * the NHWC input a kernel reads next). */
static void transpose_batched(const float *src, float *dst, int64_t batch, int64_t rows,
                              int64_t cols, int64_t row_tile, int64_t col_tile,
                              int pixels_in_cols, int prefetch, int stream, int nthreads,
                              int isa)
{
    const int64_t rtiles = (rows + row_tile - 1) / row_tile;
    const int64_t ctiles = (cols + col_tile - 1) / col_tile;
    const int64_t tiles = rtiles * ctiles;
    stream = stream && 4 * batch * rows * cols > TTILE_STREAM_BYTES;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t rt = pixels_in_cols ? t % rtiles : t / ctiles;
            const int64_t ct = pixels_in_cols ? t / rtiles : t % ctiles;
            const int64_t r0 = rt * row_tile, c0 = ct * col_tile;
            const int64_t nr = min64(row_tile, rows - r0);
            const float *s = src + b * rows * cols + r0 * cols + c0;
            if (prefetch && t + 1 < tiles) {   /* the next task's rows */
                const int64_t rn = (pixels_in_cols ? (t + 1) % rtiles : (t + 1) / ctiles)
                                   * row_tile;
                const int64_t cn = (pixels_in_cols ? (t + 1) / rtiles : (t + 1) % ctiles)
                                   * col_tile;
                const float *next = src + b * rows * cols + rn * cols + cn;
                for (int64_t r = 0; r < min64(row_tile, rows - rn); r++)
                    for (int64_t q = 0; q < min64(col_tile, cols - cn); q += 16)
                        __builtin_prefetch(next + r * cols + q, 0, 2);
            }
            transpose_tile(s, cols, dst + b * rows * cols + c0 * rows + r0, rows,
                           nr, min64(col_tile, cols - c0), 0, 1, 1, isa, stream);
        }
    }
}

/* isa: a TTILE_LAYOUT_* code (the caller checked the CPU). */
void ttile_nchw_to_nhwc(const float *src, float *dst, int64_t n, int64_t c, int64_t hw,
                        int nthreads, int isa)
{
    /* an RGB image: interleaved by AVX-512 permutes (the AVX2 family transposes it) */
    if (isa == TTILE_LAYOUT_AVX512 && c <= SMALL_CHANNELS) {
        const int64_t blocks = (hw + SMALL_PIXELS - 1) / SMALL_PIXELS;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t b = 0; b < n; b++)
            for (int64_t q = 0; q < blocks; q++)
                ttile_interleave_small_avx512(src + b * c * hw, dst + b * hw * c, c, hw,
                                              q * SMALL_PIXELS,
                                              min64((q + 1) * SMALL_PIXELS, hw));
        return;
    }
    transpose_batched(src, dst, n, c, hw, ROW_TILE, COL_TILE, 1, 1, 0, nthreads, isa);
}

void ttile_nhwc_to_nchw(const float *src, float *dst, int64_t n, int64_t hw, int64_t c,
                        int nthreads, int isa)
{
    transpose_batched(src, dst, n, hw, c, OUT_PIXEL_TILE, OUT_CHANNEL_TILE, 0, 0, 1,
                      nthreads, isa);
}

/* dst[p][oh][ow] = src[p][oh * sh][ow * sw] for `planes` planes of h x w: the pixels a
 * strided 1x1 layer reads, gathered so that the NCHW pointwise kernel runs it as a
 * stride-1 layer (ResNet18-5, 64 -> 128 channels at 56x56, stride 2: 0.105 ms through
 * the NHWC kernel and two conversions, 0.069 gathered with numpy and through the
 * pointwise kernel, which the NHWC call takes 0.057; Zen 5, 1 thread). A plane per task,
 * or a row where there are fewer planes than threads; stride-2 planes with AVX-512 (isa
 * 1), others in plain C. */
void ttile_subsample_nchw(const float *src, float *dst, int64_t planes, int64_t h,
                          int64_t w, int64_t sh, int64_t sw, int64_t ho, int64_t wo,
                          int nthreads, int isa)
{
    const int64_t rows_per_task = planes >= nthreads ? ho : 1;
    const int64_t tasks = planes * (ho / rows_per_task);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t p = t / (ho / rows_per_task);
        const int64_t oh0 = t % (ho / rows_per_task) * rows_per_task;
        const float *s = src + (p * h + oh0 * sh) * w;
        float *d = dst + (p * ho + oh0) * wo;
        if (isa == TTILE_LAYOUT_AVX512 && sw == 2) {
            ttile_subsample_plane2_avx512(s, d, w, sh, rows_per_task, wo);
        } else {
            for (int64_t oh = 0; oh < rows_per_task; oh++)
                for (int64_t ow = 0; ow < wo; ow++)
                    d[oh * wo + ow] = s[oh * sh * w + ow * sw];
        }
    }
}

void ttile_pack_kcrs_columns(const float *w, int64_t k, int64_t c, int64_t rs,
                             int64_t panel, int64_t p, int64_t col0, int64_t col1,
                             float *out, int isa)
{
    /* out[t][ci][j] = w[p * panel + j][ci][t] for the columns x = ci * rs + t in
     * [col0, col1) of the panel's [panel rows][c * rs columns] block of w, column (ci, t)
     * landing on row (t, ci); zero past k. */
    const int64_t cols = c * rs;
    const int64_t valid = min64(panel, k - p * panel);
    for (int64_t j0 = 0; j0 < valid; j0 += TILE) {
        const float *src = w + (p * panel + j0) * cols + col0;
        const int64_t rows = min64(TILE, valid - j0);
        if (isa == TTILE_LAYOUT_AVX512)
            ttile_regroup_tile_avx512(src, cols, out + j0, panel, rows, col1 - col0, col0,
                                      rs, c);
        else if (isa == TTILE_LAYOUT_AVX2)
            ttile_transpose_tile_avx2(src, cols, out + j0, panel, rows, col1 - col0, col0,
                                      rs, c, 0);
        else
            ttile_transpose_tile_portable(src, cols, out + j0, panel, rows, col1 - col0,
                                          col0, rs, c, 0);
    }
    for (int64_t col = col0; col < col1; col++) {
        float *d = out + ((col % rs) * c + col / rs) * panel;
        for (int64_t j = valid; j < panel; j++)
            d[j] = 0.0f;
    }
}

void ttile_pack_weights_kcrs(const float *w, int64_t k, int64_t c, int64_t rs,
                             int64_t panel, float *out, int nthreads, int isa)
{
    /* One (panel, column tile) per task. */
    const int64_t panels = (k + panel - 1) / panel;
    const int64_t cols = c * rs;
    const int64_t ctiles = (cols + TILE - 1) / TILE;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t ct = 0; ct < ctiles; ct++)
            ttile_pack_kcrs_columns(w, k, c, rs, panel, p, ct * TILE,
                                    min64(ct * TILE + TILE, cols), out + p * cols * panel, isa);
}
