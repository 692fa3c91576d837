/* Vector types and math the native kernels share (runtime/csrc/*.h): GCC vector extensions of VL floats, one
 * machine register: 16 with AVX-512, 8 with AVX2 and the generic build (so that a kernel's register tiles fit the
 * 16 registers AVX2 has as they fit AVX-512's 32). */
#ifndef RECOMPILE_VEC_H
#define RECOMPILE_VEC_H

#include <stdint.h>

#if RECOMPILE_AVX512
enum { VL = 16 };
#else
enum { VL = 8 };
#endif
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef float vfu __attribute__((vector_size(VL * sizeof(float)), aligned(4))); /* unaligned access */
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* exp(x), Cephes' single-precision polynomial after x = n ln2 + r (about 1 ulp); inputs clamped to [-87, 88] */
static inline vf vexp(vf x) {
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    x = vselect(x > splat(88.0f), splat(88.0f), x);
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

#endif
