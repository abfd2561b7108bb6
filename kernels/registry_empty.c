/* The registry of a build without the shipped tuned kernels (-C
 * cmake.define.TTILE_SHIPPED_KERNELS=OFF): no entry, so every call is served by the
 * hand-written kernels or tuned at run time. kernels/gen/registry.c is the shipped one. */
#include <stddef.h>
#include "ttile_registry.h"

const ttile_tuned_kernel ttile_tuned_kernels[1] = {{0}};
const int ttile_tuned_kernel_count = 0;
