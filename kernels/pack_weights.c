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
