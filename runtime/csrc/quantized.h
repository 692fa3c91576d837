/* CPU kernel of recompile::grouped_embedding_bag_quantized (runtime/quantized.py): pooled lookups of row-wise
 * quantized tables in FBGEMM's fused layouts, every table of a group in one call, rows dequantized in registers
 * and summed in fp32.
 *
 * Included after embedding.h in the same namespace: a group is the same ``meta`` array (one row per table), with
 * W_PTR the packed uint8 rows, W_STRIDE the packed row's bytes, DIM the dequantized width, FLAGS >> DTYPE_SHIFT
 * one of QINT8 / QINT4 below, and fp32 sample weights and output. Row layouts:
 *   QINT8: D codes, then fp32 scale and fp32 bias (fbgemm FloatToFused8BitRowwiseQuantized);
 *   QINT4: D / 2 bytes of two codes each (low nibble first), then fp16 scale and fp16 bias
 *          (fbgemm FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf, bit_rate 4).
 * A value is code * scale + bias; a bag's pooled row is sum_j w_j scale_j codes_j + sum_j w_j bias_j, so the
 * bias costs one scalar add per id, not a vector one (as FBGEMM's EmbeddingSpMDM).
 *
 * Checks as embedding.h: bad offsets mark ERR_OFFSETS (the table's rows are zero), a bad id ERR_IDS (row 0
 * read instead); Python raises naming the feature. */
enum { QINT8 = 3, QINT4 = 4 };
/* Ids ahead whose rows are prefetched, both cache lines a row can straddle (the scale and bias are in the last):
 * packed rows are short, so more are kept in flight than embedding.h's PREFETCH (cold tables, 8 ids a bag, on an
 * EPYC: int8 1.4x faster at 64 ids than at 16; int4 3x faster with its last line prefetched too). */
#define QPREFETCH 64

/* The 16 codes of columns [c, c + 16) as floats (QINT4: c even; two codes a byte, low nibble first). With AVX2 /
 * AVX-512 the codes are put one a byte in an SSE register, zero-extended to int32 and converted (GCC's generic
 * __builtin_convertvector from bytes is scalarised). */
#if RECOMPILE_AVX512 || RECOMPILE_AVX2
static inline __attribute__((always_inline)) v16 codes16(const uint8_t *row, int64_t c, int q) {
    __m128i bytes;
    if (q == QINT8) {
        bytes = _mm_loadu_si128((const __m128i *)(row + c));
    } else {
        __m128i packed = _mm_loadl_epi64((const __m128i *)(row + c / 2)), mask = _mm_set1_epi8(15);
        bytes = _mm_unpacklo_epi8(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
    }
#if RECOMPILE_AVX512
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
#else
    __m256 h[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
    v16 v;
    memcpy(&v, h, sizeof v);
    return v;
#endif
}
#else
static inline v16 codes16(const uint8_t *row, int64_t c, int q) {
    v16 v;
    for (int k = 0; k < LANES; k++) v[k] = q == QINT8 ? row[c + k] : (row[(c + k) / 2] >> (4 * (k & 1))) & 15;
    return v;
}
#endif

static inline __attribute__((always_inline)) float code1(const uint8_t *row, int64_t c, int q) {
    return q == QINT8 ? (float)row[c] : (float)((row[c / 2] >> (4 * (c & 1))) & 15);
}

static inline __attribute__((always_inline)) void scale_bias(const uint8_t *row, int64_t dim, int q, float *sb) {
    if (q == QINT8) {
        memcpy(sb, row + dim, 2 * sizeof(float));
        return;
    }
    _Float16 h[2];
    memcpy(h, row + dim / 2, sizeof h);
    sb[0] = (float)h[0];
    sb[1] = (float)h[1];
}

/* out[c:c + 16 * nb] (over ``divisor``) of the bag [start, end) of table t; ``nb`` and ``q`` constants where this
 * is inlined; ``stream``: written past the caches where 64-byte aligned (an output larger than the caches). */
static inline __attribute__((always_inline)) void qpool_block(const table_t *t, int64_t start, int64_t end, int64_t c,
                                                             int nb, float divisor, float *out, int64_t *err,
                                                             int stream, int q) {
    v16 acc[4] = {{0}, {0}, {0}, {0}};
    float bias_sum = 0.f;
    const float *psw = (const float *)t->psw;
    for (int64_t j = start; j < end; j++) {
        if (c == 0 && j + QPREFETCH < t->n) { /* the first and last cache lines of a later id's row */
            const char *ahead = (const char *)t->w + at(t->ids, j + QPREFETCH, t->ids64) * t->stride;
            __builtin_prefetch(ahead);
            __builtin_prefetch(ahead + t->stride - 1);
        }
        int64_t id = row_of(t, j, err);
        if (id == t->pad) continue;
        const uint8_t *row = (const uint8_t *)t->w + id * t->stride;
        float sb[2], w = psw ? psw[j] : 1.f;
        scale_bias(row, t->dim, q, sb);
        float s = w * sb[0];
        bias_sum += w * sb[1];
        for (int k = 0; k < nb; k++) acc[k] += s * codes16(row, c + k * LANES, q);
    }
    float inverse = divisor == 1.f ? 1.f : 1.f / divisor;
    for (int k = 0; k < nb; k++) acc[k] = (acc[k] + bias_sum) * inverse;
#if RECOMPILE_AVX512 || RECOMPILE_AVX2
    if (stream && nb == 4 && ((uintptr_t)(out + c) & 63) == 0) {
        for (int k = 0; k < nb; k++) stream16(out + c + k * LANES, acc[k]);
        return;
    }
#else
    (void)stream;
#endif
    for (int k = 0; k < nb; k++) *(v16 *)(out + c + k * LANES) = acc[k];
}

/* Columns past the last full 16 (fewer than 16). */
static void qpool_tail(const table_t *t, int64_t start, int64_t end, int64_t c, float divisor, float *out,
                       int64_t *err, int q) {
    float acc[LANES] = {0}, bias_sum = 0.f;
    const float *psw = (const float *)t->psw;
    for (int64_t j = start; j < end; j++) {
        int64_t id = row_of(t, j, err);
        if (id == t->pad) continue;
        const uint8_t *row = (const uint8_t *)t->w + id * t->stride;
        float sb[2], w = psw ? psw[j] : 1.f;
        scale_bias(row, t->dim, q, sb);
        bias_sum += w * sb[1];
        for (int64_t k = c; k < t->dim; k++) acc[k - c] += w * sb[0] * code1(row, k, q);
    }
    for (int64_t k = c; k < t->dim; k++) out[k] = (acc[k - c] + bias_sum) / divisor;
}

static inline __attribute__((always_inline)) void qpool_bags(const table_t *t, int64_t first, int64_t last, float *out,
                                                            int64_t out_stride, int64_t *err, int stream, int q) {
    for (int64_t b = first; b < last; b++) {
        int64_t start = 0, end = 0, c = 0;
        float *o = out + b * out_stride + t->at;
        if (!(*err & ERR_OFFSETS)) bag_range(t, b, &start, &end);
        float divisor = bag_divisor(t, start, end, err);
        for (; c + 4 * LANES <= t->dim; c += 4 * LANES) qpool_block(t, start, end, c, 4, divisor, o, err, stream, q);
        for (; c + LANES <= t->dim; c += LANES) qpool_block(t, start, end, c, 1, divisor, o, err, 0, q);
        if (c < t->dim) qpool_tail(t, start, end, c, divisor, o, err, q);
    }
}

/* out[b, OUT_AT:OUT_AT + D] (row stride ``out_stride`` floats) = the pooled row of table t's bag b. */
void qeb_forward_pooled(int64_t T, const int64_t *meta, int64_t B, float *out, int64_t out_stride, int64_t *err,
                        int stream, int threads) {
    forward_pooled(T, meta, B, out, B * out_stride * sizeof *out, err, stream, threads,
                   [=](const table_t *t, int64_t first, int64_t last, int64_t *e) {
                       if (t->dt == QINT4) qpool_bags(t, first, last, out, out_stride, e, stream, QINT4);
                       else qpool_bags(t, first, last, out, out_stride, e, stream, QINT8);
                   });
}
