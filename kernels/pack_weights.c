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

int ttile_packed_matches(const void *w, int64_t rsc, int64_t k, int64_t panel,
                         const void *packed, int nthreads, int isa)
{
    /* Whether RSCK weights (rsc rows of k floats) hold, bit for bit, what their panels
     * (as ttile_pack_weights wrote them) hold: a per-call conv2d's check that the packed
     * weights it keeps are still those of the caller's array (weight_cache.py). The same
     * blocks of 16 rows per task as the packing: reading only, no copy of the weights
     * kept beside the panels. Compared as 32-bit words, so a NaN matches the same NaN
     * and -0.0 differs from 0.0; the tail panel's zero fill is not compared. isa: AVX-512
     * or AVX2 tiles (TTILE_LAYOUT_*; the caller checked the CPU; the baseline loop below,
     * 16 bytes at a time, took 2.2x the time of a memcmp of as many bytes on a Zen 4). */
    const uint32_t *src = (const uint32_t *)w, *out = (const uint32_t *)packed;
    const int64_t panels = (k + panel - 1) / panel, blocks = (rsc + 15) / 16;
    int differ = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1) \
    reduction(| : differ)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i1 = b * 16 + 16 < rsc ? b * 16 + 16 : rsc;
        uint32_t acc = 0;
        for (int64_t p = 0; p < panels; p++) {
            if (isa == TTILE_LAYOUT_AVX512 || isa == TTILE_LAYOUT_AVX2) {
                const float *rows = (const float *)packed + p * rsc * panel;
                acc |= (uint32_t)(isa == TTILE_LAYOUT_AVX512
                    ? ttile_packed_rows_differ_avx512((const float *)w, k, panel, p,
                                                      b * 16, i1, rows)
                    : ttile_packed_rows_differ_avx2((const float *)w, k, panel, p,
                                                    b * 16, i1, rows));
                continue;
            }
            const int64_t valid = k - p * panel < panel ? k - p * panel : panel;
            for (int64_t i = b * 16; i < i1; i++) {
                const uint32_t *a = src + i * k + p * panel;
                const uint32_t *q = out + (p * rsc + i) * panel;
                for (int64_t j = 0; j < valid; j++)
                    acc |= a[j] ^ q[j];
            }
        }
        differ |= acc != 0;
    }
    return !differ;
}
