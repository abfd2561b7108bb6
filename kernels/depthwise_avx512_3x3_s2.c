/* The AVX-512 depthwise convolution's fast-path blocks for 3x3 filters at stride 2
 * (depthwise_avx512.inc). */
#define DW_KIND_HERE(X) X(3, 2)
#include "depthwise_avx512.inc"
