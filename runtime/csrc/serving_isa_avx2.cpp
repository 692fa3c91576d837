/* The serving kernels for AVX2 + FMA (+ F16C). */
#if defined(__x86_64__)
#include "prelude.h"
#pragma GCC target("avx2,fma,f16c")
#define RECOMPILE_ISA avx2
#define RECOMPILE_AVX2 1
#include "serving_isa.inc"
#endif
