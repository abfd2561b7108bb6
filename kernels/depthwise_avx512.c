/* The AVX-512 depthwise convolution's driver and general blocks (depthwise_avx512.inc);
 * the fast path's blocks are in depthwise_avx512_<S>x<S>_s<stride>.c. */
#define DW_DRIVER 1
#include "depthwise_avx512.inc"
