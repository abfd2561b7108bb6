/* Register blocks of the AVX-512F generic convolution: 2 vectors (generic_blocks.inc). */
#include "generic_avx512.h"
#define G_BLOCKS_HERE(X) WIDTHS_12(X, 2)
#include "generic_blocks.inc"
