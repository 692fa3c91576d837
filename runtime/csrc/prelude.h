/* The system headers of the kernel bodies, included before any `#pragma GCC target` (isa_kernels.inc). */
#ifndef RECOMPILE_PRELUDE_H
#define RECOMPILE_PRELUDE_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "kernels.h"
#define restrict __restrict__ /* C's restrict, as the bodies spell it */
#endif
