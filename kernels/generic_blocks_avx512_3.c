/* Register blocks of the AVX-512F generic convolution: 1 vector, 24 to 13 pixels wide
 * (generic_blocks.inc). */
#include "generic_avx512.h"
#define G_BLOCKS_HERE(X) WIDTHS_24_13(X, 1)
#include "generic_blocks.inc"
