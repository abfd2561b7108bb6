/* Portable generic convolution: plain C, any shape, stride and padding.
 *
 * It serves CPUs without AVX-512. The k loop is innermost and contiguous in both the
 * weights and the output, so the compiler vectorizes it with the baseline ISA (SSE2). */
#include <string.h>
#include "ttile_runtime.h"

void ttile_conv_generic_portable(const ttile_conv_shape *sh, const float *x,
                                 const float *w, float *y, int nthreads)
{
    const int64_t N = sh->n, H = sh->h, W = sh->w, C = sh->c, K = sh->k;
    const int64_t R = sh->r, S = sh->s, HO = sh->ho, WO = sh->wo;
    const int64_t SH = sh->stride_h, SW = sh->stride_w, PT = sh->pad_top, PL = sh->pad_left;

#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t oh = 0; oh < HO; oh++) {
            for (int64_t ow = 0; ow < WO; ow++) {
                float *restrict yp = y + ((n * HO + oh) * WO + ow) * K;
                memset(yp, 0, (size_t)K * sizeof(float));
                for (int64_t r = 0; r < R; r++) {
                    const int64_t ih = oh * SH + r - PT;
                    if (ih < 0 || ih >= H)
                        continue;
                    for (int64_t s = 0; s < S; s++) {
                        const int64_t iw = ow * SW + s - PL;
                        if (iw < 0 || iw >= W)
                            continue;
                        const float *xp = x + ((n * H + ih) * W + iw) * C;
                        const float *wp = w + (r * S + s) * C * K;
                        for (int64_t c = 0; c < C; c++) {
                            const float xv = xp[c];
                            const float *restrict wr = wp + c * K;
                            for (int64_t k = 0; k < K; k++)
                                yp[k] += xv * wr[k];
                        }
                    }
                }
            }
        }
    }
}
