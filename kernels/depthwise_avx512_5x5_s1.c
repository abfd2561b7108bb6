/* The AVX-512 depthwise convolution's fast-path blocks for 5x5 filters at stride 1
 * (depthwise_avx512.inc). */
#define DW_KIND_HERE(X) X(5, 1)
#include "depthwise_avx512.inc"
