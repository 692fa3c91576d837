/* The kernels for AVX2 + FMA (+ F16C): GCC's 16-float vectors become pairs of 256-bit registers. */
#if defined(__x86_64__)
#include "prelude.h"
#pragma GCC target("avx2,fma,f16c")
#define RECOMPILE_ISA avx2
#define RECOMPILE_AVX2 1
#include "isa_kernels.inc"
#endif
