/* Register blocks of the AVX2 + FMA generic convolution: 1 vector (generic_blocks.inc). */
#include "generic_avx2.h"
#define G_BLOCKS_HERE(X) WIDTHS_12(X, 1)
#include "generic_blocks.inc"
