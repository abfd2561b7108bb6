/* Portable generic convolution: plain C, any shape, stride, padding, dilation, groups
 * and epilogue.
 *
 * It serves CPUs without AVX-512. The k loop is innermost and contiguous in both the
 * weights and the output, so the compiler vectorizes it with the baseline ISA (SSE2). */
#include <string.h>
#include "ttile_runtime.h"

void ttile_conv_generic_portable(const ttile_conv_shape *sh, const float *x,
                                 const float *w, float *y, int nthreads,
                                 const ttile_epilogue *ep)
{
    const int64_t N = sh->n, H = sh->h, W = sh->w, C = sh->c, K = sh->k, G = sh->groups;
    const int64_t R = sh->r, S = sh->s, HO = sh->ho, WO = sh->wo;
    const int64_t SH = sh->stride_h, SW = sh->stride_w, PT = sh->pad_top, PL = sh->pad_left;
    const int64_t DH = sh->dil_h, DW = sh->dil_w;
    const int64_t XS = C * G, YS = K * G;   /* floats between pixels */
    const int fuse = !ttile_epilogue_is_empty(ep);

#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t oh = 0; oh < HO; oh++) {
            for (int64_t ow = 0; ow < WO; ow++) {
                const int64_t pixel = ((n * HO + oh) * WO + ow) * YS;
                float *restrict yp = y + pixel;
                memset(yp, 0, (size_t)YS * sizeof(float));
                for (int64_t g = 0; g < G; g++) {
                    for (int64_t r = 0; r < R; r++) {
                        const int64_t ih = oh * SH + r * DH - PT;
                        if (ih < 0 || ih >= H)
                            continue;
                        for (int64_t s = 0; s < S; s++) {
                            const int64_t iw = ow * SW + s * DW - PL;
                            if (iw < 0 || iw >= W)
                                continue;
                            const float *xp = x + ((n * H + ih) * W + iw) * XS + g * C;
                            const float *wp = w + (r * S + s) * C * YS + g * K;
                            float *restrict yg = yp + g * K;
                            for (int64_t c = 0; c < C; c++) {
                                const float xv = xp[c];
                                const float *restrict wr = wp + c * YS;
                                for (int64_t k = 0; k < K; k++)
                                    yg[k] += xv * wr[k];
                            }
                        }
                    }
                }
                if (fuse)
                    for (int64_t k = 0; k < YS; k++)
                        yp[k] = ttile_epilogue1(ep, yp[k], pixel + k, k);
            }
        }
    }
}
