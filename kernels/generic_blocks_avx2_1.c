/* Register blocks of the AVX2 + FMA generic convolution: 3 vectors, and 2
 * (generic_blocks.inc). */
#include "generic_avx2.h"
#define G_BLOCKS_HERE(X) WIDTHS_4(X, 3) WIDTHS_6(X, 2)
#include "generic_blocks.inc"
