/* The generic kernel's register blocks as its driver (generic_conv.inc) and the
 * translation units that define them (generic_blocks.inc) both see them: the blocks'
 * names, their arguments, and the weight stream they advance. Included after an ISA's
 * vector names (generic_avx512.h, generic_avx2.h).
 *
 * The blocks are functions of their own, out of line, in several translation units per
 * ISA (generic_blocks_<isa>_<n>.c), called through a table by (KV, NCHW input, NW). A
 * block runs R*S*C reduction steps of NW x KV FMAs, so the call costs nothing
 * measurable; inlined into the driver at its two call sites (about 200 copies, each
 * with its epilogue variants), the AVX-512 file alone took GCC 7-8 minutes of one core
 * to compile, the slowest step of every build. */
#ifndef TTILE_GENERIC_BLOCK_H
#define TTILE_GENERIC_BLOCK_H
#include <stdint.h>
#include "ttile_runtime.h"

/* WIDTHS_<W>(X, KV) calls X(NW, KV) for NW = W down to 1; GENERIC_KV(X) (the ISA's)
 * calls X(KV, WIDEST) once per vector count. The block functions, their prototypes and
 * the driver's table of them are all expanded from them (an X-macro, as BLIS keeps its
 * kernel lists). */
#define WIDTHS_4(X, KV) X(4, KV) X(3, KV) X(2, KV) X(1, KV)
#define WIDTHS_6(X, KV) X(6, KV) X(5, KV) WIDTHS_4(X, KV)
#define WIDTHS_8(X, KV) X(8, KV) X(7, KV) WIDTHS_6(X, KV)
#define WIDTHS_12(X, KV) X(12, KV) X(11, KV) X(10, KV) X(9, KV) WIDTHS_8(X, KV)
#define WIDTHS_24_13(X, KV) X(24, KV) X(23, KV) X(22, KV) X(21, KV) X(20, KV) X(19, KV)  \
    X(18, KV) X(17, KV) X(16, KV) X(15, KV) X(14, KV) X(13, KV)
#define WIDTHS_24(X, KV) WIDTHS_24_13(X, KV) WIDTHS_12(X, KV)
/* The widest block of any ISA (the table's last index). */
#define G_MAX_NW 24

/* The next block's input, a cache line per pixel every G_PREFETCH_STEPS steps (16
 * floats: the line this block's step q0 opens, NW pixels further along the row), where
 * a block reads runs of at most G_PREFETCH_MAX_RUN floats per pixel and row: those are
 * too short for the hardware's stream prefetch to follow, and a layer whose input comes
 * from L3 or memory (its place in a network, after a layer that wrote megabytes) waited
 * on every line (MobileNetV2's 56x56 144->24 after a cache flush: 1.65x faster this
 * way). Longer runs the hardware follows by itself: prefetching them too made
 * ResNet-50's 512-2048-channel 1x1 layers 8 % slower (AVX2, Zen 3). */
#define G_PREFETCH_MAX_RUN 384
#define G_PREFETCH_STEPS 16
/* A block's steps are cut into runs of G_PREFETCH_STEPS only where a run ends with
 * something to ask for (the next block's input, the next group's weights): a loop of 16
 * steps costs its exit and the bookkeeping around it every 16 steps (a stand-alone copy
 * of the 6 x 4 block on 1x1 1024->256: 590-617 us cut, 547 us in one run; Xeon model
 * 167). Otherwise one loop runs them all: 0.85x the time on 56x56 64->64 3x3 (its border
 * blocks), 0.93-0.98x on most 1x1 and 3x3 layers of ResNet-50 at 2 threads. */

/* The packed weights of the panel group a thread works on next, prefetched into L2 a
 * few lines every G_PREFETCH_STEPS steps while it computes the current group from L2.
 * A layer whose weights are larger than the L2 (ResNet18-10/12's 9.4 MB, ResNet-50's
 * last stages) otherwise reads each group from memory in a burst when it reaches it, and
 * in a network, where the layers in between evicted every layer's weights, that burst
 * is not hidden: 7x7 512->512 3x3 took 1.45 ms with its weights in L3 and 1.83-1.97 ms
 * from memory (Xeon model 167, 1 thread), 0.45 ms that the computation could cover.
 *
 * Packed weights only (a Conv2d's, or reused by a per-call call). A per-call call's
 * RSCK group is a short run in each of rsc rows K floats apart: those fall in a few L2
 * sets (2 KB apart: 1 set in 32) and evict each other, and prefetching them made
 * ResNet18-10/12 per call 1.1-1.2x slower; packing them into a second buffer a few rows
 * per G_PREFETCH_STEPS steps instead (each row prefetched 8 rows ahead) made them
 * 1.2-1.3x slower, and Yolo9000-19 1.1x (Xeon model 167, 1 thread). */
/* The stream is a run of bytes, or (direct RSCK) runs of `run` bytes `stride` apart in
 * groups of `per_group`, the groups `group_stride` apart: a panel's columns of a slab of
 * RSCK rows, one group per (r, s). */
typedef struct {
    const char *group;      /* the current group's first run */
    const char *ptr;        /* the current run, from its first line */
    int64_t col, run;       /* bytes [col, run) of the current run are still to come */
    int64_t stride, group_stride;
    int64_t per_group, runs_left, groups_left;   /* in the current group; after it */
    int64_t last_runs;      /* runs of the last group */
    int per_steps;          /* lines per G_PREFETCH_STEPS steps; 0: no stream */
} g_wstream;

/* What every block of one (task, panel, channel chunk) shares; the block's own argument
 * is its first output pixel along the row (ow0). */
typedef struct {
    const ttile_conv_shape *sh;
    const float *x_n;       /* this image's input (this group's channels) */
    const float *panel;     /* the weight panel: step t's P floats at panel + t * P */
    float *y_row;           /* the output row (or the NCHW output's row buffer) */
    int64_t oh;             /* the output row */
    int64_t P;              /* the step stride of the panel, in floats */
    int64_t k0;             /* the block's first channel in y_row */
    const G_MASK *mask;     /* the lanes of each of the block's KV vectors */
    const float *zeros;     /* the row that stands in for input pixels in the padding */
    int64_t c0, c1;         /* the channel chunk reduced: [c0, c1); c0 > 0 accumulates */
    int64_t YS;             /* y_row's pixel stride, in floats */
    const ttile_epilogue *ep;
    int epk;                /* the epilogue kind to apply (TTILE_EPK_NONE but on the last
                               chunk) */
    int64_t kb;             /* the block's first channel in the epilogue's bias */
    g_wstream *ws;          /* the weight stream the block advances */
    int stream;             /* store past the caches (whole lines, no epilogue read) */
    int wmask;              /* the weight loads need the lanes' masks (direct path) */
} g_block_args;

typedef void g_block_fn(const g_block_args *args, int64_t ow0);

#define G_BLOCK_NAME(NW, KV) G_NAME(ttile_generic_block_##NW##_##KV)
#define G_BLOCK_NAME_NCHW(NW, KV) G_NAME(ttile_generic_block_nchw_##NW##_##KV)
/* Each block twice: on an NHWC input, and on an NCHW one (TTILE_NCHW_IN); hidden: they
 * are the extension's own, not its exports. */
#define G_BLOCK_DECLARE(NW, KV)                                                        \
    __attribute__((visibility("hidden"))) g_block_fn G_BLOCK_NAME(NW, KV);             \
    __attribute__((visibility("hidden"))) g_block_fn G_BLOCK_NAME_NCHW(NW, KV);
#define G_BLOCK_DECLARE_KV(KV, W) WIDTHS_##W(G_BLOCK_DECLARE, KV)
GENERIC_KV(G_BLOCK_DECLARE_KV)

#endif
