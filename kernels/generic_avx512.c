/* The generic convolution's driver for AVX-512F (generic_conv.inc with the vectors of
 * generic_avx512.h); its register blocks are in generic_blocks_avx512_*.c. */
#include "generic_avx512.h"
#include "generic_conv.inc"
