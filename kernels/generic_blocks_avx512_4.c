/* Register blocks of the AVX-512F generic convolution: 1 vector, 12 pixels wide or less
 * (generic_blocks.inc). */
#include "generic_avx512.h"
#define G_BLOCKS_HERE(X) WIDTHS_12(X, 1)
#include "generic_blocks.inc"
