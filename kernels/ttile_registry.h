/* The registry of tuned kernels compiled into the extension (kernels/gen/registry.c,
 * written by `ttile-generate --network ...`). A call is served by an entry only when every
 * problem field matches exactly. */
#ifndef TTILE_REGISTRY_H
#define TTILE_REGISTRY_H

typedef void (*ttile_kernel_fn)(const float *x, const float *w, float *y, int nthreads);

typedef struct {
    int n, k, c, h, w, r, s;
    int stride_h, stride_w;
    int pad_top, pad_bottom, pad_left, pad_right;
    int parallel;            /* 0: single-thread variant, 1: multi-thread variant */
    int panel;               /* weights are packed in panels of this many k (pack_weights) */
    ttile_kernel_fn fn;
    const char *layer;
    const char *scheme;
    double gflops;           /* measured when tuned */
} ttile_tuned_kernel;

extern const ttile_tuned_kernel ttile_tuned_kernels[];
extern const int ttile_tuned_kernel_count;

#endif
