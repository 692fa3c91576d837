/* The kernels at the compiler's baseline instruction set (x86-64: SSE2), for CPUs without AVX2. */
#include "prelude.h"
#define RECOMPILE_ISA generic
#include "isa_kernels.inc"
