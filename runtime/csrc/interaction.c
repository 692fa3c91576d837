/* CPU kernels of the feature-interaction ops (runtime/interaction.py), plain C + OpenMP.
 *
 * Features are given as F row pointers with a row stride each (elements), so a [B, F, D] tensor, F separate
 * [B, D] tensors or any mix are read in place (no stack). Every kernel is generated for float, _Float16 and
 * bfloat16 storage (suffixes f32 / f16 / bf16) and accumulates in float; samples are split across threads,
 * the feature dimension D is the vectorised inner loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;

enum { VL = 16, NB = 8 }; /* D tile (one AVX-512 vector of float), pairs per run */
typedef float vf __attribute__((vector_size(VL * sizeof(float)))); /* GCC lowers it to the machine's vectors */

static inline float hsum(vf v) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
#endif
}

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float v) { *p = v; }
static inline float load_f16(const _Float16 *p) { return (float)*p; }
static inline void store_f16(_Float16 *p, float v) { *p = (_Float16)v; }
static inline float load_bf16(const bf16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}
static inline void store_bf16(bf16_t *p, float v) { /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    *p = (bf16_t)(bits >> 16);
}

#define DEFINE_LOADV(S, T)                                                                                     \
static inline vf loadv_##S(const T *p) {                                                                       \
    float t[VL];                                                                                               \
    for (int i = 0; i < VL; i++) t[i] = load_##S(p + i);                                                       \
    vf v;                                                                                                      \
    memcpy(&v, t, sizeof v);                                                                                   \
    return v;                                                                                                  \
}
DEFINE_LOADV(f32, float)
DEFINE_LOADV(f16, _Float16)
DEFINE_LOADV(bf16, bf16_t)

#define DEFINE_KERNELS(S, T)                                                                                   \
/* out[b] = [prefix[b] (K values) | <f_rows[p], f_cols[p]> for p < P]; out is [B, K + P] contiguous.         \
   Runs of up to NB pairs sharing a row are computed together, D in VL-wide tiles: NB independent vector        \
   accumulators, one horizontal sum per pair. */                                                               \
void dot_interaction_fwd_##S(const int64_t *feat, const int64_t *stride, int64_t F, int64_t B, int64_t D,      \
                             const T *prefix, int64_t prefix_stride, int64_t K, const int32_t *rows,           \
                             const int32_t *cols, int64_t P, T *out, int threads) {                            \
    (void)F;                                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                          \
    for (int64_t b = 0; b < B; b++) {                                                                          \
        T *o = out + b * (K + P);                                                                              \
        for (int64_t k = 0; k < K; k++) o[k] = prefix[b * prefix_stride + k];                                 \
        for (int64_t p0 = 0; p0 < P;) {                                                                        \
            int64_t n = 1;                                                                                     \
            while (n < NB && p0 + n < P && rows[p0 + n] == rows[p0]) n++;                                      \
            const T *x = (const T *)feat[rows[p0]] + b * stride[rows[p0]];                                     \
            const T *y[NB];                                                                                    \
            for (int64_t j = 0; j < NB; j++) {                                                                 \
                int32_t c = cols[p0 + (j < n ? j : 0)];                                                        \
                y[j] = (const T *)feat[c] + b * stride[c];                                                     \
            }                                                                                                  \
            vf acc[NB];                                                                                        \
            _Pragma("GCC unroll 8")                                                                            \
            for (int j = 0; j < NB; j++) acc[j] = (vf){0};                                                     \
            int64_t d0 = 0;                                                                                    \
            for (; d0 + VL <= D; d0 += VL) {                                                                   \
                const vf xv = loadv_##S(x + d0);                                                               \
                _Pragma("GCC unroll 8")                                                                        \
                for (int j = 0; j < NB; j++) acc[j] += xv * loadv_##S(y[j] + d0);                              \
            }                                                                                                  \
            for (int64_t j = 0; j < n; j++) {                                                                  \
                float sum = hsum(acc[j]);                                                                      \
                for (int64_t d = d0; d < D; d++) sum += load_##S(x + d) * load_##S(y[j] + d);                  \
                store_##S(o + K + p0 + j, sum);                                                                \
            }                                                                                                  \
            p0 += n;                                                                                           \
        }                                                                                                      \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
/* grad_f = sum_g S[f, g] f_g with S = G + G^T, G the pair grads placed at (rows[p], cols[p]). */              \
void dot_interaction_bwd_##S(const T *grad, int64_t grad_stride, const int64_t *feat, const int64_t *stride,   \
                             const int64_t *out, const int64_t *out_stride, int64_t F, int64_t B, int64_t D,   \
                             const int32_t *rows, const int32_t *cols, int64_t P, int threads) {               \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *s = malloc(sizeof(float) * F * F);                                                              \
        const T **y = malloc(sizeof(T *) * F);                                                                 \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            memset(s, 0, sizeof(float) * F * F);                                                               \
            const T *g = grad + b * grad_stride;                                                               \
            for (int64_t p = 0; p < P; p++) {                                                                  \
                float v = load_##S(g + p);                                                                     \
                s[rows[p] * F + cols[p]] += v;                                                                 \
                s[cols[p] * F + rows[p]] += v;                                                                 \
            }                                                                                                  \
            for (int64_t h = 0; h < F; h++) y[h] = (const T *)feat[h] + b * stride[h];                          \
            for (int64_t f = 0; f < F; f++) {                                                                  \
                T *o = (T *)out[f] + b * out_stride[f];                                                        \
                const float *sf = s + f * F;                                                                   \
                int64_t d0 = 0;                                                                                \
                for (; d0 + VL <= D; d0 += VL) {                                                               \
                    vf a = {0};                                                                                \
                    for (int64_t h = 0; h < F; h++) a += sf[h] * loadv_##S(y[h] + d0);                         \
                    for (int v = 0; v < VL; v++) store_##S(o + d0 + v, a[v]);                                  \
                }                                                                                              \
                for (int64_t d = d0; d < D; d++) {                                                             \
                    float a = 0.f;                                                                             \
                    for (int64_t h = 0; h < F; h++) a += sf[h] * load_##S(y[h] + d);                           \
                    store_##S(o + d, a);                                                                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        free(s);                                                                                               \
        free(y);                                                                                               \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
/* out = x0 * (h + bias) + x, all [B, D] contiguous; bias may be NULL. */                                      \
void cross_epilogue_fwd_##S(const T *x0, const T *x, const T *h, const T *bias, T *out, int64_t B, int64_t D,   \
                            int threads) {                                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                          \
    for (int64_t b = 0; b < B; b++) {                                                                          \
        const int64_t r = b * D;                                                                               \
        _Pragma("omp simd")                                                                                    \
        for (int64_t d = 0; d < D; d++) {                                                                      \
            float hb = load_##S(h + r + d) + (bias ? load_##S(bias + d) : 0.f);                                \
            store_##S(out + r + d, load_##S(x0 + r + d) * hb + load_##S(x + r + d));                           \
        }                                                                                                      \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
/* grad_h = grad * x0, grad_x0 = grad * (h + bias), grad_bias = column sums of grad_h (float, [D]). */         \
void cross_epilogue_bwd_##S(const T *grad, const T *x0, const T *h, const T *bias, T *grad_h, T *grad_x0,      \
                            float *grad_bias, int64_t B, int64_t D, int threads) {                             \
    if (grad_bias) memset(grad_bias, 0, sizeof(float) * D);                                                    \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *part = grad_bias ? calloc(D, sizeof(float)) : NULL;                                             \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            const int64_t r = b * D;                                                                           \
            _Pragma("omp simd")                                                                                \
            for (int64_t d = 0; d < D; d++) {                                                                  \
                float g = load_##S(grad + r + d);                                                              \
                float gh = g * load_##S(x0 + r + d);                                                           \
                store_##S(grad_h + r + d, gh);                                                                 \
                store_##S(grad_x0 + r + d, g * (load_##S(h + r + d) + (bias ? load_##S(bias + d) : 0.f)));    \
                if (part) part[d] += gh;                                                                       \
            }                                                                                                  \
        }                                                                                                      \
        if (part) {                                                                                            \
            _Pragma("omp critical")                                                                            \
            for (int64_t d = 0; d < D; d++) grad_bias[d] += part[d];                                           \
            free(part);                                                                                        \
        }                                                                                                      \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
/* out[b] = 0.5 * ((sum_f v_f)^2 - sum_f v_f^2) per d ([B, D]), or summed over d ([B, 1]) when reduce. */      \
void fm_second_order_fwd_##S(const T *v, int64_t B, int64_t F, int64_t D, int reduce, T *out, int threads) {    \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *sum = malloc(sizeof(float) * 2 * D);                                                            \
        float *sq = sum + D;                                                                                   \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            const T *row = v + b * F * D;                                                                      \
            for (int64_t d = 0; d < D; d++) sum[d] = sq[d] = 0.f;                                              \
            for (int64_t f = 0; f < F; f++) {                                                                  \
                _Pragma("omp simd")                                                                            \
                for (int64_t d = 0; d < D; d++) {                                                              \
                    float e = load_##S(row + f * D + d);                                                       \
                    sum[d] += e;                                                                               \
                    sq[d] += e * e;                                                                            \
                }                                                                                              \
            }                                                                                                  \
            float total = 0.f;                                                                                 \
            for (int64_t d = 0; d < D; d++) {                                                                  \
                float o = 0.5f * (sum[d] * sum[d] - sq[d]);                                                    \
                if (reduce) total += o; else store_##S(out + b * D + d, o);                                    \
            }                                                                                                  \
            if (reduce) store_##S(out + b, total);                                                             \
        }                                                                                                      \
        free(sum);                                                                                             \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
/* grad_v[b, f, d] = g[b, d] * (sum_f v[b, f, d] - v[b, f, d]); g is [B, D], or [B, 1] when reduce. */         \
void fm_second_order_bwd_##S(const T *grad, const T *v, int64_t B, int64_t F, int64_t D, int reduce, T *out,   \
                             int threads) {                                                                    \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *sum = malloc(sizeof(float) * D);                                                                \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            const T *row = v + b * F * D;                                                                      \
            for (int64_t d = 0; d < D; d++) sum[d] = 0.f;                                                      \
            for (int64_t f = 0; f < F; f++)                                                                    \
                for (int64_t d = 0; d < D; d++) sum[d] += load_##S(row + f * D + d);                           \
            for (int64_t f = 0; f < F; f++) {                                                                  \
                _Pragma("omp simd")                                                                            \
                for (int64_t d = 0; d < D; d++) {                                                              \
                    float g = load_##S(grad + (reduce ? b : b * D + d));                                       \
                    store_##S(out + b * F * D + f * D + d, g * (sum[d] - load_##S(row + f * D + d)));          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        free(sum);                                                                                             \
    }                                                                                                          \
}

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(f16, _Float16)
DEFINE_KERNELS(bf16, bf16_t)
