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

/* vload_<S>(p): VL floats from VL elements of float, _Float16 or bfloat16 storage (unaligned); vload_n_<S>(p, n):
   the first n of them (0 <= n <= VL), the rest zero, read through a zeroed buffer. vtranspose(r): r[k] <- column k
   of the VL x VL matrix whose rows are r[0..VL), in registers where the instruction set has the shuffles. */
#if RECOMPILE_AVX512 || RECOMPILE_AVX2
#if RECOMPILE_AVX512
typedef __m512 vreg;
#define VREG(op) _mm512_##op
#else
typedef __m256 vreg;
#define VREG(op) _mm256_##op
#endif
/* Within each 128-bit lane: r[4j .. 4j + 4) <- the 4 x 4 transposes of their lanes (the first two stages of
   vtranspose, the same shuffles at either width). */
static inline void vtranspose_lanes(vreg *r) {
    vreg t[VL];
    for (int i = 0; i < VL; i += 2) {
        t[i] = VREG(unpacklo_ps)(r[i], r[i + 1]);
        t[i + 1] = VREG(unpackhi_ps)(r[i], r[i + 1]);
    }
    for (int i = 0; i < VL; i += 4) {
        r[i] = VREG(shuffle_ps)(t[i], t[i + 2], 0x44);
        r[i + 1] = VREG(shuffle_ps)(t[i], t[i + 2], 0xEE);
        r[i + 2] = VREG(shuffle_ps)(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = VREG(shuffle_ps)(t[i + 1], t[i + 3], 0xEE);
    }
}
#undef VREG
#endif
#if RECOMPILE_AVX512
static inline vf vload_f32(const float *p) { return (vf)_mm512_loadu_ps(p); }
/* the maskz forms: GCC 12 warns of the plain forms' undefined pass-through operand */
static inline vf vload_f16(const _Float16 *p) {
    return (vf)_mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256((const __m256i *)p));
}
static inline vf vload_bf16(const bf16_t *p) {
    const __m512i h = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_maskz_slli_epi32(0xFFFF, h, 16);
}
static inline void vtranspose(vf r_[VL]) { /* 64 shuffles: the lanes', then 128-bit blocks across registers */
    __m512 *r = (__m512 *)r_, t[16];
    vtranspose_lanes(r);
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}
#elif RECOMPILE_AVX2
static inline vf vload_f32(const float *p) { return (vf)_mm256_loadu_ps(p); }
static inline vf vload_f16(const _Float16 *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vload_bf16(const bf16_t *p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
static inline void vtranspose(vf r_[VL]) { /* 24 shuffles: the lanes', then the halves across registers */
    __m256 *r = (__m256 *)r_;
    vtranspose_lanes(r);
    for (int i = 0; i < 4; i++) {
        const __m256 lo = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        const __m256 hi = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
        r[i] = lo;
        r[i + 4] = hi;
    }
}
#else
static inline vf vload_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline vf vload_f16(const _Float16 *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = (float)p[i];
    return v;
}
static inline vf vload_bf16(const bf16_t *p) {
    vi bits;
    for (int i = 0; i < VL; i++) bits[i] = (int32_t)((uint32_t)p[i] << 16);
    return (vf)bits;
}
static inline void vtranspose(vf r[VL]) {
    vf t[VL];
    for (int i = 0; i < VL; i++)
        for (int k = 0; k < VL; k++) t[k][i] = r[i][k];
    memcpy(r, t, sizeof t);
}
#endif
#define RECOMPILE_VLOAD_N(S, T)                                                                                \
    static inline vf vload_n_##S(const T *p, int n) {                                                          \
        if (n == VL) return vload_##S(p);                                                                      \
        T t[VL] = {0};                                                                                         \
        if (n > 0) memcpy(t, p, sizeof(T) * n);                                                                \
        return vload_##S(t);                                                                                   \
    }
RECOMPILE_VLOAD_N(f32, float)
RECOMPILE_VLOAD_N(f16, _Float16)
RECOMPILE_VLOAD_N(bf16, bf16_t)
#undef RECOMPILE_VLOAD_N

#endif
