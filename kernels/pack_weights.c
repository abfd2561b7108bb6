/* Weight packing shared by the generic kernel and the generated ones.
 *
 * RSCK weights put consecutive (r, s, c) steps of one k block K floats apart, a new page
 * every few steps once K is in the hundreds; the kernels instead read panels
 * out[K/P][R][S][C][P] in which a block's weights are contiguous. The tail panel is
 * zero-filled so weight loads need no mask. Compiled for the baseline ISA. */
#include <string.h>

#include "ttile_runtime.h"

void ttile_pack_panel_rows(const float *w, int64_t k, int64_t panel, int64_t p, int64_t i0,
                           int64_t i1, float *out)
{
    const int64_t valid = k - p * panel < panel ? k - p * panel : panel;
    /* memcpy: the C library picks the widest copy the CPU has, where a loop here would
     * be compiled for the baseline ISA (the generic kernel's threads call this too) */
    for (int64_t i = i0; i < i1; i++) {
        float *dst = out + i * panel;
        memcpy(dst, w + i * k + p * panel, (size_t)valid * sizeof(float));
        if (valid < panel)
            memset(dst + valid, 0, (size_t)(panel - valid) * sizeof(float));
    }
}

void ttile_pack_weights(const float *w, int64_t rsc, int64_t k, int64_t panel, float *out,
                        int nthreads)
{
    /* blocks of 16 rows, one per task, each through every panel: a block's rows are read
     * once from memory and stay in cache while the panels take their columns */
    const int64_t panels = (k + panel - 1) / panel, blocks = (rsc + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < panels; p++)
            ttile_pack_panel_rows(w, k, panel, p, b * 16, b * 16 + 16 < rsc ? b * 16 + 16 : rsc,
                                  out + p * rsc * panel);
}

int ttile_same_bytes(const void *a, const void *b, int64_t nbytes, int nthreads)
{
    /* Whether a per-call conv2d's weights still hold the bytes its packed copy was made
     * from (src/ttile/runtime/weight_cache.py). Chunks of 64 KB in one static share per
     * thread: the same thread compares the same bytes every call, so on many cores both
     * arrays stay in the caches of the threads that read them, shared, never written
     * (packing them again instead writes lines that other cores' kernel threads read,
     * and each call moves them back: 0.33 ms for 9.4 MB at 16 threads on a Xeon). */
    const int64_t chunk = (int64_t)1 << 16, chunks = (nbytes + chunk - 1) / chunk;
    int differ = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 1) \
    reduction(| : differ)
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t offset = i * chunk;
        const int64_t length = nbytes - offset < chunk ? nbytes - offset : chunk;
        differ |= memcmp((const char *)a + offset, (const char *)b + offset,
                         (size_t)length) != 0;
    }
    return !differ;
}
