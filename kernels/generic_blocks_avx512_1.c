/* Register blocks of the AVX-512F generic convolution: 4 vectors, and 3
 * (generic_blocks.inc). */
#include "generic_avx512.h"
#define G_BLOCKS_HERE(X) WIDTHS_6(X, 4) WIDTHS_8(X, 3)
#include "generic_blocks.inc"
