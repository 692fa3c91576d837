/* Dequantize one packed row (hkv/rowwise.py: FBGEMM's fused layouts) into ``dim`` fp32 values code * scale + bias,
 * per instruction set: the portable loops, AVX2 + FMA and AVX-512 (x86-64; each compiled for its set by a target
 * attribute and run only where the CPU has it). int8: ``dim`` codes, then fp32 scale and bias; int4: ``dim / 2``
 * bytes of two codes each (low nibble first), then fp16 scale and bias.
 *
 * The vector paths widen 8 (AVX2) or 16 (AVX-512) codes at a time from bytes to int32 to float, multiply and add
 * (not fused: the values equal hkv.rowwise.dequantize_rows bit for bit, as the portable loop's do). The columns
 * past the last full vector go through the portable loop.
 *
 * ``dequantizer(kind, isa)`` picks one; ``hkv_isa`` / ``hkv_set_isa`` (ops.cpp) say which set runs: the best this
 * CPU has, or the one RECOMPILE_ISA names (the runtime's setting, runtime/native.py: ``avx2`` measures the AVX2
 * path on an AVX-512 machine). */

typedef void (*dequantize_fn)(const uint8_t *row, int64_t dim, float *out);

static inline void scale_bias_int8(const uint8_t *row, int64_t dim, float *scale, float *bias) {
    memcpy(scale, row + dim, sizeof *scale);
    memcpy(bias, row + dim + sizeof *scale, sizeof *bias);
}

static inline void scale_bias_int4(const uint8_t *row, int64_t dim, float *scale, float *bias) {
    _Float16 sb[2];
    memcpy(sb, row + dim / 2, sizeof sb);
    *scale = (float)sb[0];
    *bias = (float)sb[1];
}

/* Columns [from, dim) one at a time. */
static inline void int8_columns(const uint8_t *row, int64_t from, int64_t dim, float scale, float bias, float *out) {
    for (int64_t d = from; d < dim; ++d) out[d] = (float)row[d] * scale + bias;
}

static inline void int4_columns(const uint8_t *row, int64_t from, int64_t dim, float scale, float bias, float *out) {
    for (int64_t d = from / 2; d < dim / 2; ++d) { /* from and dim even */
        out[2 * d] = (float)(row[d] & 15) * scale + bias;
        out[2 * d + 1] = (float)(row[d] >> 4) * scale + bias;
    }
}

static void dequantize_int8_generic(const uint8_t *row, int64_t dim, float *out) {
    float scale, bias;
    scale_bias_int8(row, dim, &scale, &bias);
    int8_columns(row, 0, dim, scale, bias, out);
}

static void dequantize_int4_generic(const uint8_t *row, int64_t dim, float *out) {
    float scale, bias;
    scale_bias_int4(row, dim, &scale, &bias);
    int4_columns(row, 0, dim, scale, bias, out);
}

enum { ISA_GENERIC, ISA_AVX2, ISA_AVX512, NUM_ISAS };
static const char *const ISA_NAMES[NUM_ISAS] = {"generic", "avx2", "avx512"};

#if defined(__x86_64__)
/* Compiled for instruction set ``isa``; multiplies and adds stay two roundings (the build contracts them). */
#define HKV_TARGET(isa) __attribute__((target(isa), optimize("fp-contract=off")))
/* The codes of columns [d, d + 8) (AVX2) or [d, d + 16) (AVX-512) as floats: bytes widened to int32, converted;
 * int4's 8 packed bytes first spread into 16 code bytes in column order (low nibbles interleaved with high ones).
 * AVX-512 uses the maskz forms: GCC 12 warns of the plain forms' undefined pass-through operand. */
HKV_TARGET("avx2,f16c") static inline __m128i spread_nibbles(const uint8_t *p) {
    __m128i packed = _mm_loadl_epi64((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low));
}
HKV_TARGET("avx2,f16c") static inline __m256 int8_codes_avx2(const uint8_t *row, int64_t d) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
}
HKV_TARGET("avx2,f16c") static inline __m256 int4_codes_avx2(const uint8_t *row, int64_t d) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(spread_nibbles(row + d / 2))); /* 8 of its 16 codes */
}
HKV_TARGET("avx512f,f16c") static inline __m512 widen16(__m128i codes) {
    return _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepu8_epi32(0xFFFF, codes));
}
HKV_TARGET("avx512f,f16c") static inline __m512 int8_codes_avx512(const uint8_t *row, int64_t d) {
    return widen16(_mm_loadu_si128((const __m128i *)(row + d)));
}
HKV_TARGET("avx512f,f16c") static inline __m512 int4_codes_avx512(const uint8_t *row, int64_t d) {
    return widen16(spread_nibbles(row + d / 2));
}

/* dequantize_<kind>_<set>: W columns a step in vectors of the set (``p`` its intrinsics' prefix, ``v`` its type),
 * the rest by the portable loop. Every load stays inside the row (int4 reads 8 packed bytes for 8 or 16 codes; the
 * scale and bias follow the codes). */
#define HKV_DEQUANTIZE(kind, set, isa, W, v, p)                                                                    \
    HKV_TARGET(isa) static void dequantize_##kind##_##set(const uint8_t *row, int64_t dim, float *out) {          \
        float scale, bias;                                                                                         \
        scale_bias_##kind(row, dim, &scale, &bias);                                                                \
        const v s = p##_set1_ps(scale), b = p##_set1_ps(bias);                                                     \
        int64_t d = 0;                                                                                             \
        for (; d + W <= dim; d += W)                                                                               \
            p##_storeu_ps(out + d, p##_add_ps(p##_mul_ps(kind##_codes_##set(row, d), s), b));                      \
        kind##_columns(row, d, dim, scale, bias, out);                                                             \
    }
HKV_DEQUANTIZE(int8, avx2, "avx2,f16c", 8, __m256, _mm256)
HKV_DEQUANTIZE(int4, avx2, "avx2,f16c", 8, __m256, _mm256)
HKV_DEQUANTIZE(int8, avx512, "avx512f,f16c", 16, __m512, _mm512)
HKV_DEQUANTIZE(int4, avx512, "avx512f,f16c", 16, __m512, _mm512)
#undef HKV_DEQUANTIZE
#undef HKV_TARGET

/* Whether this CPU runs instruction set ``isa`` (ISA_*): AVX-512 as the runtime's kernels take it (F, BW, VL, DQ),
 * so that RECOMPILE_ISA means the same for both libraries. */
static inline int cpu_has_isa(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return isa == ISA_GENERIC;
}

/* [kind - 1][isa]: kind ROW_INT8 = 1, ROW_INT4 = 2 (probe.h). */
static const dequantize_fn DEQUANTIZERS[2][NUM_ISAS] = {
    {dequantize_int8_generic, dequantize_int8_avx2, dequantize_int8_avx512},
    {dequantize_int4_generic, dequantize_int4_avx2, dequantize_int4_avx512},
};
#else
static inline int cpu_has_isa(int isa) { return isa == ISA_GENERIC; }

static const dequantize_fn DEQUANTIZERS[2][NUM_ISAS] = {
    {dequantize_int8_generic, NULL, NULL},
    {dequantize_int4_generic, NULL, NULL},
};
#endif
