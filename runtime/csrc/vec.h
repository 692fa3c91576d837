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
/* max(x, lo), min(x, hi): one instruction each on AVX2 / AVX-512; NaN stays NaN */
static inline vf vclamp(vf x, float lo, float hi) {
#if RECOMPILE_AVX512
    return (vf)_mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), (__m512)x));
#elif RECOMPILE_AVX2
    return (vf)_mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), (__m256)x));
#else
    x = vselect(x < splat(lo), splat(lo), x);
    return vselect(x > splat(hi), splat(hi), x);
#endif
}

/* exp(x), Cephes' single-precision polynomial after x = n ln2 + r (about 1 ulp); inputs clamped to [-87, 88] */
static inline vf vexp(vf x) {
    x = vclamp(x, -87.0f, 88.0f);
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
