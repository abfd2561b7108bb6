/* The registry of the offline search's verdicts compiled into the extension
 * (kernels/gen/registry.c, written by `ttile-generate --network ...` from every CPU's
 * tuning records in generator/records). An entry serves a call only on the CPU it was
 * measured on (its fingerprint id), at the thread count it was measured at, and when
 * every problem field matches exactly, for the vector family it was searched in. An entry without a kernel (fn NULL) records that
 * the generic kernel won there: such a layer is not tuned again at run time. */
#ifndef TTILE_REGISTRY_H
#define TTILE_REGISTRY_H

#include "ttile_epilogue.h"

/* The kernel families, numbered as the extension's entry points take them. */
enum { TTILE_ISA_PORTABLE = 0, TTILE_ISA_AVX512F = 1, TTILE_ISA_AVX2 = 2 };

/* A generated kernel: NHWC x, packed weights, NHWC y, threads, the epilogue fused into
 * its output store (NULL: none). */
typedef void (*ttile_kernel_fn)(const float *x, const float *w, float *y, int nthreads,
                                const ttile_epilogue *ep);

typedef struct {
    const char *cpu;         /* CpuFingerprint.id of the CPU it was measured on */
    int threads;             /* the thread count it was measured at */
    int n, k, c, h, w, r, s;
    int stride_h, stride_w;
    int pad_top, pad_bottom, pad_left, pad_right;
    int dilation_h, dilation_w;
    int groups;              /* that many of the problem side by side (ConvSpec.groups): its
                                input has c * groups channels, its output k * groups */
    int isa;                 /* the vector family of fn and of panel: TTILE_ISA_AVX512F or
                                TTILE_ISA_AVX2; a generic-kernel verdict
                                is about that family's generic kernel */
    int panel;               /* weights are packed in panels of this many k (pack_weights) */
    ttile_kernel_fn fn;      /* NULL: the generic kernel serves (it won the search) */
    ttile_kernel_fn fn_nchw; /* the same kernel writing an NCHW output (y[N][K][Ho][Wo]) tile
                                by tile; NULL when its scheme has no such entry point */
    const char *layer;
    const char *scheme;      /* "" for the generic kernel */
    double gflops;           /* measured when tuned (cold protocol) */
    double warm_gflops;      /* the kernel's rate side by side with the generic kernel, warm
                                (0: not compared) */
    double generic_gflops;   /* the generic kernel's rate on that CPU and thread count,
                                warm when compared (0: unknown) */
} ttile_tuned_kernel;

extern const ttile_tuned_kernel ttile_tuned_kernels[];
extern const int ttile_tuned_kernel_count;

#endif
