/* The serving kernels for AVX-512 (F, BW, VL, DQ). */
#if defined(__x86_64__)
#include "prelude.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define RECOMPILE_ISA avx512
#define RECOMPILE_AVX512 1
#include "serving_isa.inc"
#endif
