/* Weight packing shared by the generic kernel and the generated ones.
 *
 * RSCK weights put consecutive (r, s, c) steps of one k block K floats apart, a new page
 * every few steps once K is in the hundreds; the kernels instead read panels
 * out[K/P][R][S][C][P] in which a block's weights are contiguous. The tail panel is
 * zero-filled so weight loads need no mask. Compiled for the baseline ISA. */
#include "ttile_runtime.h"

void ttile_pack_weights(const float *w, int64_t rsc, int64_t k, int64_t panel, float *out,
                        int nthreads)
{
    const int64_t panels = (k + panel - 1) / panel;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t i = 0; i < rsc; i++) {
        for (int64_t p = 0; p < panels; p++) {
            float *dst = out + (p * rsc + i) * panel;
            const float *src = w + i * k + p * panel;
            const int64_t valid = k - p * panel < panel ? k - p * panel : panel;
            for (int64_t j = 0; j < valid; j++)
                dst[j] = src[j];
            for (int64_t j = valid; j < panel; j++)
                dst[j] = 0.0f;
        }
    }
}
