/* The serving kernels at the compiler's baseline instruction set. */
#include "prelude.h"
#define RECOMPILE_ISA generic
#include "serving_isa.inc"
