/* The generic convolution's driver for AVX2 + FMA (generic_conv.inc with the vectors of
 * generic_avx2.h); its register blocks are in generic_blocks_avx2_*.c. */
#include "generic_avx2.h"
#include "generic_conv.inc"
