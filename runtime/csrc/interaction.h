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

/* Forward tile rows (FR accumulators + 2 fit the registers of either vector width); backward tile. VL, vf and the
   vector loads are vec.h's. */
static const int FR = 12, BR = 6, BV = 4;

/* fn(args..., n) with n a compile-time constant in each case (register tiles of n rows or vectors). */
#define SWITCH_4(n, fn, ...)                                                                                   \
    switch (n) {                                                                                               \
        case 1: fn(__VA_ARGS__, 1); break;                                                                     \
        case 2: fn(__VA_ARGS__, 2); break;                                                                     \
        case 3: fn(__VA_ARGS__, 3); break;                                                                     \
        case 4: fn(__VA_ARGS__, 4); break;                                                                     \
    }
#define SWITCH_12(n, fn, ...)                                                                                  \
    switch (n) {                                                                                               \
        case 5: fn(__VA_ARGS__, 5); break;                                                                     \
        case 6: fn(__VA_ARGS__, 6); break;                                                                     \
        case 7: fn(__VA_ARGS__, 7); break;                                                                     \
        case 8: fn(__VA_ARGS__, 8); break;                                                                     \
        case 9: fn(__VA_ARGS__, 9); break;                                                                     \
        case 10: fn(__VA_ARGS__, 10); break;                                                                   \
        case 11: fn(__VA_ARGS__, 11); break;                                                                   \
        case 12: fn(__VA_ARGS__, 12); break;                                                                   \
        default: SWITCH_4(n, fn, __VA_ARGS__)                                                                  \
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

/* pack_<S>(feat, stride, F, b, D, xt, FP): xt[d * FP + f] = feature f's row b at d in fp32, the transposed tile of
   one sample, VL x VL blocks at a time: VL row loads, one vtranspose in registers, VL stores (instead of one
   strided store per element); features past F give zero columns. */
#define DEFINE_PACK(S, T)                                                                                      \
static void pack_##S(const int64_t *feat, const int64_t *stride, int64_t F, int64_t b, int64_t D, float *xt,   \
                     int64_t FP) {                                                                             \
    for (int64_t f0 = 0; f0 < F; f0 += VL)                                                                     \
        for (int64_t d0 = 0; d0 < D; d0 += VL) {                                                               \
            const int nd = D - d0 < VL ? (int)(D - d0) : VL;                                                   \
            vf r[VL];                                                                                          \
            for (int i = 0; i < VL; i++)                                                                       \
                r[i] = f0 + i < F ? vload_n_##S((const T *)feat[f0 + i] + b * stride[f0 + i] + d0, nd)         \
                                  : (vf){0};                                                                   \
            vtranspose(r);                                                                                     \
            for (int k = 0; k < nd; k++) *(vf *)(xt + (d0 + k) * FP + f0) = r[k];                              \
        }                                                                                                      \
}
DEFINE_PACK(f32, float)
DEFINE_PACK(f16, _Float16)
DEFINE_PACK(bf16, bf16_t)

#define DEFINE_DOT_KERNELS(S, T)                                                                               \
/* One register tile: rows[0..N) against the columns [c0, c0 + VL), acc[i] = sum_d xt[d, rows[i]] *            \
   xt[d, c0 : c0 + VL] (one broadcast FMA per row and d); each row's wanted columns are written at their place \
   in the output row o. N is a constant at every call (gram_tile_any), so acc stays in registers. */           \
static inline __attribute__((always_inline)) void gram_tile_##S(                                               \
    const float *xt, int64_t FP, int64_t D, int64_t c0, const int32_t *rows, const int32_t *lo,                \
    const int32_t *hi, const int32_t *off, T *o, const int N) {                                                \
    vf acc[FR];                                                                                                \
    for (int i = 0; i < N; i++) acc[i] = (vf){0};                                                              \
    for (int64_t d = 0; d < D; d++) {                                                                          \
        const float *x = xt + d * FP;                                                                          \
        const vf v = *(const vf *)(x + c0);                                                                    \
        for (int i = 0; i < N; i++) acc[i] += x[rows[i]] * v;                                                  \
    }                                                                                                          \
    for (int i = 0; i < N; i++) {                                                                              \
        const int32_t r = rows[i];                                                                             \
        const int64_t a = lo[r] > c0 ? lo[r] : c0, e = hi[r] < c0 + VL ? hi[r] : c0 + VL;                      \
        for (int64_t c = a; c < e; c++) store_##S(o + off[r] + c - lo[r], acc[i][c - c0]);                     \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
static void gram_tile_any_##S(const float *xt, int64_t FP, int64_t D, int64_t c0, const int32_t *rows,         \
                              int n, const int32_t *lo, const int32_t *hi, const int32_t *off, T *o) {         \
    SWITCH_12(n, gram_tile_##S, xt, FP, D, c0, rows, lo, hi, off, o);                                          \
}                                                                                                              \
                                                                                                               \
/* out[b] = [prefix[b] (K values) | the P pairs], out [B, K + P] contiguous. Row r's pairs are the             \
   columns [lo[r], hi[r]) at out[b, K + off[r] ...] (each of the four triangle orders has this form). Per      \
   sample the F features are packed once, transposed, into an fp32 [D, FP] tile (FP: F rounded up to VL,       \
   zero padded); the Gram matrix is computed in register tiles of up to FR rows x VL columns, only the tiles   \
   that hold wanted pairs, every FMA a full vector (a blocked GEMM with no horizontal sums). */                \
void dot_interaction_fwd_##S(const int64_t *feat, const int64_t *stride, int64_t F, int64_t B, int64_t D,      \
                             const T *prefix, int64_t prefix_stride, int64_t K, const int32_t *lo,             \
                             const int32_t *hi, const int32_t *off, int64_t P, T *out, int threads) {          \
    const int64_t FP = (F + VL - 1) / VL * VL, tiles = FP / VL;                                                \
    int32_t *tile_rows = (int32_t *)malloc(sizeof(int32_t) * (tiles * F + tiles));                                        \
    int32_t *tile_count = tile_rows + tiles * F;                                                               \
    for (int64_t t = 0; t < tiles; t++) {                                                                      \
        int32_t n = 0;                                                                                         \
        for (int32_t r = 0; r < F; r++)                                                                        \
            if (lo[r] < hi[r] && hi[r] > t * VL && lo[r] < (t + 1) * VL) tile_rows[t * F + n++] = r;           \
        tile_count[t] = n;                                                                                     \
    }                                                                                                          \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *xt = (float *)aligned_alloc(64, (sizeof(float) * D * FP + 63) / 64 * 64);                                \
        memset(xt, 0, sizeof(float) * D * FP);                                                                 \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            pack_##S(feat, stride, F, b, D, xt, FP);                                                           \
            T *o = out + b * (K + P);                                                                          \
            for (int64_t k = 0; k < K; k++) o[k] = prefix[b * prefix_stride + k];                              \
            for (int64_t t = 0; t < tiles; t++) {                                                              \
                const int32_t n = tile_count[t], groups = (n + FR - 1) / FR;                                   \
                for (int32_t g = 0, i0 = 0; g < groups; g++) { /* groups of near-equal size */                 \
                    const int32_t m = (n - i0) / (groups - g);                                                 \
                    gram_tile_any_##S(xt, FP, D, t * VL, tile_rows + t * F + i0, m, lo, hi, off, o + K);       \
                    i0 += m;                                                                                   \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        free(xt);                                                                                              \
    }                                                                                                          \
    free(tile_rows);                                                                                           \
}                                                                                                              \
                                                                                                               \
/* grad rows f0 .. f0 + BR (clamped to F - 1: duplicates recompute the last row) x NV vectors of D from d0:    \
   acc[i][v] = sum_g s[f_i, g] * y_g[d0 + v VL ...]. */                                                        \
static inline __attribute__((always_inline)) void pair_grad_tile_##S(                                          \
    const float *s, int64_t F, const T **y, int64_t f0, int64_t d0, T *const *o, const int NV) {               \
    vf acc[BR][BV];                                                                                            \
    const float *sr[BR];                                                                                       \
    for (int i = 0; i < BR; i++) {                                                                             \
        sr[i] = s + (f0 + i < F ? f0 + i : F - 1) * F;                                                         \
        for (int v = 0; v < NV; v++) acc[i][v] = (vf){0};                                                      \
    }                                                                                                          \
    for (int64_t g = 0; g < F; g++) {                                                                          \
        vf yv[BV];                                                                                             \
        for (int v = 0; v < NV; v++) yv[v] = vload_##S(y[g] + d0 + v * VL);                                    \
        for (int i = 0; i < BR; i++)                                                                           \
            for (int v = 0; v < NV; v++) acc[i][v] += sr[i][g] * yv[v];                                        \
    }                                                                                                          \
    for (int i = 0; i < BR && f0 + i < F; i++)                                                                 \
        for (int v = 0; v < NV; v++)                                                                           \
            for (int l = 0; l < VL; l++) store_##S(o[f0 + i] + d0 + v * VL + l, acc[i][v][l]);                 \
}                                                                                                              \
                                                                                                               \
/* grad_f = sum_g S[f, g] f_g with S = G + G^T, G the pair grads placed at (r, c): per sample S (fp32          \
   [F, F]) is built from the row ranges, then [F, F] x [F, D] runs in register tiles of BR rows x BV           \
   vectors. */                                                                                                 \
void dot_interaction_bwd_##S(const T *grad, int64_t grad_stride, const int64_t *feat, const int64_t *stride,   \
                             const int64_t *out, const int64_t *out_stride, int64_t F, int64_t B, int64_t D,   \
                             const int32_t *lo, const int32_t *hi, const int32_t *off, int threads) {          \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *s = (float *)malloc(sizeof(float) * F * F);                                                              \
        const T **y = (const T **)malloc(sizeof(T *) * F);                                                                 \
        T **o = (T **)malloc(sizeof(T *) * F);                                                                       \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            memset(s, 0, sizeof(float) * F * F);                                                               \
            const T *g = grad + b * grad_stride;                                                               \
            for (int64_t r = 0; r < F; r++)                                                                    \
                for (int64_t c = lo[r]; c < hi[r]; c++) {                                                      \
                    const float v = load_##S(g + off[r] + c - lo[r]);                                          \
                    s[r * F + c] += v;                                                                         \
                    s[c * F + r] += v;                                                                         \
                }                                                                                              \
            for (int64_t f = 0; f < F; f++) {                                                                  \
                y[f] = (const T *)feat[f] + b * stride[f];                                                     \
                o[f] = (T *)out[f] + b * out_stride[f];                                                        \
            }                                                                                                  \
            const int64_t full = D / VL * VL;                                                                  \
            for (int64_t f0 = 0; f0 < F; f0 += BR)                                                             \
                for (int64_t d0 = 0; d0 < full; d0 += BV * VL) {                                               \
                    const int64_t nv = (full - d0) / VL < BV ? (full - d0) / VL : BV;                          \
                    SWITCH_4(nv, pair_grad_tile_##S, s, F, y, f0, d0, o);                                      \
                }                                                                                              \
            for (int64_t f = 0; f < F; f++) /* the last D % VL columns */                                      \
                for (int64_t d = full; d < D; d++) {                                                           \
                    float a = 0.f;                                                                             \
                    for (int64_t h = 0; h < F; h++) a += s[f * F + h] * load_##S(y[h] + d);                    \
                    store_##S(o[f] + d, a);                                                                    \
                }                                                                                              \
        }                                                                                                      \
        free(s);                                                                                               \
        free(y);                                                                                               \
        free(o);                                                                                               \
    }                                                                                                          \
}

/* One row r of the cross epilogue; BIAS and KEEP_HB are constants, so that the vector loop has no branch. */
#define CROSS_EPILOGUE_ROW(S, BIAS, KEEP_HB)                                                                   \
    {                                                                                                          \
        _Pragma("omp simd")                                                                                    \
        for (int64_t d = 0; d < D; d++) {                                                                      \
            float hb = load_##S(h + r + d) + ((BIAS) ? load_##S(bias + d) : 0.f);                              \
            float xv = load_##S(x + r + d);                                                                    \
            if (KEEP_HB) store_##S(hb_out + r + d, hb);                                                        \
            store_##S(out + r + d, load_##S(x0 + r + d) * hb + xv);                                            \
        }                                                                                                      \
    }

#define DEFINE_KERNELS(S, T)                                                                                   \
/* out = x0 * (h + bias) + x, all [B, D] contiguous; bias may be NULL; h + bias also into hb unless NULL.      \
   Each element is read before it is written: out and hb may be h or x (in place). */                          \
void cross_epilogue_fwd_##S(const T *x0, const T *x, const T *h, const T *bias, T *out, T *hb_out, int64_t B,   \
                            int64_t D, int threads) {                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                          \
    for (int64_t b = 0; b < B; b++) {                                                                          \
        const int64_t r = b * D;                                                                               \
        if (bias && hb_out) CROSS_EPILOGUE_ROW(S, 1, 1)                                                        \
        else if (bias) CROSS_EPILOGUE_ROW(S, 1, 0)                                                             \
        else if (hb_out) CROSS_EPILOGUE_ROW(S, 0, 1)                                                           \
        else CROSS_EPILOGUE_ROW(S, 0, 0)                                                                       \
    }                                                                                                          \
}                                                                                                              \
                                                                                                               \
/* grad_h = grad * x0, grad_x0 = grad * (h + bias), grad_bias = column sums of grad_h (float, [D]). */         \
void cross_epilogue_bwd_##S(const T *grad, const T *x0, const T *h, const T *bias, T *grad_h, T *grad_x0,      \
                            float *grad_bias, int64_t B, int64_t D, int threads) {                             \
    if (grad_bias) memset(grad_bias, 0, sizeof(float) * D);                                                    \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *part = grad_bias ? (float *)calloc(D, sizeof(float)) : NULL;                                             \
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
}

#define DEFINE_FM_KERNELS(S, T)                                                                               \
/* out[b] = 0.5 * ((sum_f v_f)^2 - sum_f v_f^2) per d ([B, D]), or summed over d ([B, 1]) when reduce: VL columns\
   of a sample at a time in registers (masked loads of the last ones: no scalar loop over a narrow D), each sum in\
   feature order, the reduction over d in column order. */                                                    \
void fm_second_order_fwd_##S(const T *v, int64_t B, int64_t F, int64_t D, int reduce, T *out, int threads) {  \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                        \
    for (int64_t b = 0; b < B; b++) {                                                                         \
        const T *row = v + b * F * D;                                                                         \
        float total = 0.f;                                                                                    \
        for (int64_t d = 0; d < D; d += VL) {                                                                 \
            const int n = D - d < VL ? (int)(D - d) : VL;                                                     \
            vf sum = {0}, sq = {0};                                                                           \
            for (int64_t f = 0; f < F; f++) {                                                                 \
                const vf e = vc_vload_##S(row + f * D + d, n);                                                \
                sum += e;                                                                                     \
                sq += e * e;                                                                                  \
            }                                                                                                 \
            const vf o = 0.5f * (sum * sum - sq);                                                             \
            if (!reduce) vc_vstore_##S(out + b * D + d, o, n);                                                \
            else for (int k = 0; k < n; k++) total += o[k];                                                   \
        }                                                                                                     \
        if (reduce) store_##S(out + b, total);                                                                \
    }                                                                                                         \
}                                                                                                             \
/* grad_v[b, f, d] = g[b, d] * (sum_f v[b, f, d] - v[b, f, d]); g is [B, D], or [B, 1] when reduce. */        \
void fm_second_order_bwd_##S(const T *grad, const T *v, int64_t B, int64_t F, int64_t D, int reduce, T *out,  \
                             int threads) {                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                        \
    for (int64_t b = 0; b < B; b++) {                                                                         \
        const T *row = v + b * F * D;                                                                         \
        T *grad_row = out + b * F * D;                                                                        \
        for (int64_t d = 0; d < D; d += VL) {                                                                 \
            const int n = D - d < VL ? (int)(D - d) : VL;                                                     \
            vf sum = {0};                                                                                     \
            for (int64_t f = 0; f < F; f++) sum += vc_vload_##S(row + f * D + d, n);                          \
            const vf g = reduce ? splat(load_##S(grad + b)) : vc_vload_##S(grad + b * D + d, n);              \
            for (int64_t f = 0; f < F; f++)                                                                   \
                vc_vstore_##S(grad_row + f * D + d, g * (sum - vc_vload_##S(row + f * D + d, n)), n);         \
        }                                                                                                     \
    }                                                                                                         \
}


/* The DCN-v1 vector cross (runtime/interaction.py vector_cross): L layers x_{l+1} = x0 * (x_l . w_l) + b_l + x_l
 * per sample. Tiles of up to VC_ROWS samples are kept in float scratch rows (L1) across the layers, so x and x0 are
 * read once and the output written once; the tile's dot products run side by side (independent accumulators:
 * one sample's dot is a chain of dependent FMAs and a horizontal sum). W and bias are float [L, Dp], rows
 * zero-padded to Dp (a multiple of 16 >= D; bias may be NULL); x0, x, grad and the outputs [B, D] contiguous. */
enum { VC_ROWS = 8 };

static inline float vc_hsum(vf v) { /* a tree of shuffles where the instruction set has them */
#if RECOMPILE_AVX512
    return _mm512_reduce_add_ps((__m512)v);
#elif RECOMPILE_AVX2
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
#endif
}

#define VC_AT(p) (*(vfu *)(p))

/* The tile's R rows xl (stride Dp) through the L layers; with xs, each layer's input rows are kept in
   xs + l * R * Dp and its scalars in s[r * L + l]. */
static inline __attribute__((always_inline)) void vc_forward_tile(float *xl, const float *x0, const float *W,
                                                                  const float *bias, int64_t L, int64_t Dp,
                                                                  float *xs, float *s, const int R) {
    for (int64_t l = 0; l < L; l++) {
        const float *w = W + l * Dp, *bl = bias ? bias + l * Dp : NULL;
        if (xs) memcpy(xs + l * R * Dp, xl, sizeof(float) * R * Dp);
        vf acc[VC_ROWS];
        for (int r = 0; r < R; r++) acc[r] = (vf){0};
        for (int64_t d = 0; d < Dp; d += VL) {
            const vf wv = VC_AT(w + d);
            for (int r = 0; r < R; r++) acc[r] += VC_AT(xl + r * Dp + d) * wv;
        }
        float sl[VC_ROWS];
        for (int r = 0; r < R; r++) {
            sl[r] = vc_hsum(acc[r]);
            if (s) s[r * L + l] = sl[r];
        }
        for (int64_t d = 0; d < Dp; d += VL) {
            const vf bv = bl ? VC_AT(bl + d) : (vf){0};
            for (int r = 0; r < R; r++) VC_AT(xl + r * Dp + d) += VC_AT(x0 + r * Dp + d) * sl[r] + bv;
        }
    }
}

/* Last layer first, for the tile's R rows: ds = g . x0, grad_x0 += g s_l, part_w_l += ds x_l, part_b_l += g,
   g += ds w_l (g ends as grad_x). */
static inline __attribute__((always_inline)) void vc_backward_tile(float *g, float *gx0, const float *x0,
                                                                   const float *xs, const float *s, const float *W,
                                                                   float *part_w, float *part_b, int64_t L,
                                                                   int64_t Dp, const int R) {
    for (int64_t l = L - 1; l >= 0; l--) {
        const float *w = W + l * Dp, *xl = xs + l * R * Dp;
        float *pw = part_w + l * Dp, *pb = part_b ? part_b + l * Dp : NULL;
        vf acc[VC_ROWS];
        for (int r = 0; r < R; r++) acc[r] = (vf){0};
        for (int64_t d = 0; d < Dp; d += VL)
            for (int r = 0; r < R; r++) acc[r] += VC_AT(g + r * Dp + d) * VC_AT(x0 + r * Dp + d);
        float ds[VC_ROWS], sl[VC_ROWS];
        for (int r = 0; r < R; r++) {
            ds[r] = vc_hsum(acc[r]);
            sl[r] = s[r * L + l];
        }
        for (int64_t d = 0; d < Dp; d += VL) {
            const vf wv = VC_AT(w + d);
            vf pwv = VC_AT(pw + d), pbv = pb ? VC_AT(pb + d) : (vf){0};
            for (int r = 0; r < R; r++) {
                const vf gv = VC_AT(g + r * Dp + d);
                pbv += gv;
                VC_AT(gx0 + r * Dp + d) += gv * sl[r];
                pwv += VC_AT(xl + r * Dp + d) * ds[r];
                VC_AT(g + r * Dp + d) = gv + wv * ds[r];
            }
            VC_AT(pw + d) = pwv;
            if (pb) VC_AT(pb + d) = pbv;
        }
    }
}

/* fn(args..., R) for the tile's row count R in 1..VC_ROWS, a compile-time constant in each case. */
#define VC_SWITCH(R, fn, ...)                                                                                  \
    switch (R) {                                                                                               \
        case 8: fn(__VA_ARGS__, 8); break;                                                                     \
        case 7: fn(__VA_ARGS__, 7); break;                                                                     \
        case 6: fn(__VA_ARGS__, 6); break;                                                                     \
        case 5: fn(__VA_ARGS__, 5); break;                                                                     \
        case 4: fn(__VA_ARGS__, 4); break;                                                                     \
        case 3: fn(__VA_ARGS__, 3); break;                                                                     \
        case 2: fn(__VA_ARGS__, 2); break;                                                                     \
        default: fn(__VA_ARGS__, 1); break;                                                                    \
    }

/* The rows of tile t of a batch of B: its first sample's offset b * D (r0) and its row count (returned). */
static inline int vc_tile(int64_t t, int64_t B, int64_t D, int64_t *r0) {
    *r0 = t * VC_ROWS * D;
    return B - t * VC_ROWS < VC_ROWS ? (int)(B - t * VC_ROWS) : VC_ROWS;
}

/* vc_vload_<S>(p, n): the first n (0..VL) elements at p as floats, the rest zero; vc_vstore_<S>(p, v, n): v's first n
   lanes to p. Masked loads and stores where the instruction set has them (vload_n copies through a buffer: its
   store-to-load forwarding stall took most of a row's time at D = 40). */
#if RECOMPILE_AVX512
static inline __mmask16 vc_mask(int n) { return (__mmask16)((1u << n) - 1); }
static inline vf vc_vload_f32(const float *p, int n) { return (vf)_mm512_maskz_loadu_ps(vc_mask(n), p); }
static inline vf vc_vload_f16(const _Float16 *p, int n) {
    return (vf)_mm512_maskz_cvtph_ps(0xFFFF, _mm256_maskz_loadu_epi16(vc_mask(n), p));
}
static inline vf vc_vload_bf16(const bf16_t *p, int n) {
    const __m512i h = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_maskz_loadu_epi16(vc_mask(n), p));
    return (vf)_mm512_maskz_slli_epi32(0xFFFF, h, 16);
}
static inline void vc_vstore_f32(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, vc_mask(n), (__m512)v); }
static inline void vc_vstore_f16(_Float16 *p, vf v, int n) {
    _mm256_mask_storeu_epi16(p, vc_mask(n), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void vc_vstore_bf16(bf16_t *p, vf v, int n) { /* round to nearest even, as store_bf16 */
    const vi bits = (vi)v, rounded = (vi)(((__v16su)bits + 0x7fffu + (((__v16su)bits >> 16) & 1u)) >> 16);
    _mm256_mask_storeu_epi16(p, vc_mask(n), _mm512_cvtepi32_epi16((__m512i)rounded));
}
#else
#if RECOMPILE_AVX2
static inline __m256i vc_mask(int n) { return (__m256i)((vi){0, 1, 2, 3, 4, 5, 6, 7} < n); }
static inline vf vc_vload_f32(const float *p, int n) { return (vf)_mm256_maskload_ps(p, vc_mask(n)); }
static inline void vc_vstore_f32(float *p, vf v, int n) { _mm256_maskstore_ps(p, vc_mask(n), (__m256)v); }
#define VC_F32_MASKED 1
#endif
#define VC_BUFFERED(S, T)                                                                                      \
static inline vf vc_vload_##S(const T *p, int n) { return vload_n_##S(p, n); }                                 \
static inline void vc_vstore_##S(T *p, vf v, int n) {                                                          \
    for (int i = 0; i < n; i++) store_##S(p + i, v[i]);                                                        \
}
#ifndef VC_F32_MASKED
VC_BUFFERED(f32, float)
#endif
VC_BUFFERED(f16, _Float16)
VC_BUFFERED(bf16, bf16_t)
#undef VC_BUFFERED
#undef VC_F32_MASKED
#endif

/* vc_load_<S>: R rows of src (stride D) into float rows of stride Dp (a multiple of VL), zero-padded, whole
   vectors at a time; vc_store_<S>: back. */
#define DEFINE_VC_ROWS(S, T)                                                                                   \
static inline void vc_load_##S(float *dst, const T *src, int R, int64_t D, int64_t Dp) {                       \
    for (int r = 0; r < R; r++)                                                                                \
        for (int64_t d = 0; d < Dp; d += VL) {                                                                 \
            const int n = D - d <= 0 ? 0 : D - d < VL ? (int)(D - d) : VL;                                     \
            VC_AT(dst + r * Dp + d) = vc_vload_##S(src + r * D + d, n);                                        \
        }                                                                                                      \
}                                                                                                              \
static inline void vc_store_##S(T *dst, const float *src, int R, int64_t D, int64_t Dp) {                      \
    for (int r = 0; r < R; r++)                                                                                \
        for (int64_t d = 0; d < D; d += VL)                                                                    \
            vc_vstore_##S(dst + r * D + d, VC_AT(src + r * Dp + d), D - d < VL ? (int)(D - d) : VL);          \
}

/* The tiles of a batch of B rows of D, OpenMP over tiles: per tile of R rows (r0: its first element) x and x0
   loaded into the float rows xl and x0f (stride Dp), the body (the last arguments) run, xl stored to out; each
   thread has `scratch` more floats after its x0f. */
#define VC_FOR_TILES(S, scratch, ...)                                                                          \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *xl = (float *)malloc(sizeof(float) * (2 * VC_ROWS * Dp + (scratch))), *x0f = xl + VC_ROWS * Dp; \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t t = 0; t < (B + VC_ROWS - 1) / VC_ROWS; t++) {                                            \
            int64_t r0;                                                                                        \
            const int R = vc_tile(t, B, D, &r0);                                                               \
            vc_load_##S(xl, x + r0, R, D, Dp);                                                                 \
            vc_load_##S(x0f, x0 + r0, R, D, Dp);                                                               \
            __VA_ARGS__                                                                                        \
            vc_store_##S(out + r0, xl, R, D, Dp);                                                              \
        }                                                                                                      \
        free(xl);                                                                                              \
    }

#define DEFINE_VECTOR_CROSS_KERNELS(S, T)                                                                      \
DEFINE_VC_ROWS(S, T)                                                                                           \
void vector_cross_fwd_##S(const T *x0, const T *x, const float *W, const float *bias, int64_t L, int64_t Dp,    \
                          T *out, int64_t B, int64_t D, int threads) {                                         \
    VC_FOR_TILES(S, 0, VC_SWITCH(R, vc_forward_tile, xl, x0f, W, bias, L, Dp, NULL, NULL))                     \
}                                                                                                              \
                                                                                                               \
/* The layers recomputed per tile (inputs and scalars kept), then vc_backward_tile; grad_W and grad_bias       \
   (float [L, Dp], grad_bias NULL without bias) are summed over per-thread parts. */                           \
void vector_cross_bwd_##S(const T *grad, const T *x0, const T *x, const float *W, const float *bias, int64_t L, \
                          int64_t Dp, T *grad_x0, T *grad_x, float *grad_W, float *grad_bias, int64_t B,        \
                          int64_t D, int threads) {                                                            \
    const int64_t tiles = (B + VC_ROWS - 1) / VC_ROWS, rows = VC_ROWS * Dp;                                    \
    memset(grad_W, 0, sizeof(float) * L * Dp);                                                                 \
    if (grad_bias) memset(grad_bias, 0, sizeof(float) * L * Dp);                                               \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        float *xs = (float *)malloc(sizeof(float) * ((L + 4) * rows + VC_ROWS * L));                           \
        float *xl = xs + L * rows, *x0f = xl + rows, *g = x0f + rows, *gx0 = g + rows, *s = gx0 + rows;        \
        float *part = (float *)calloc((grad_bias ? 2 : 1) * L * Dp, sizeof(float));                            \
        float *part_b = grad_bias ? part + L * Dp : NULL;                                                      \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t t = 0; t < tiles; t++) {                                                                  \
            int64_t r0;                                                                                        \
            const int R = vc_tile(t, B, D, &r0);                                                               \
            vc_load_##S(xl, x + r0, R, D, Dp);                                                                 \
            vc_load_##S(x0f, x0 + r0, R, D, Dp);                                                               \
            vc_load_##S(g, grad + r0, R, D, Dp);                                                               \
            memset(gx0, 0, sizeof(float) * rows);                                                              \
            VC_SWITCH(R, vc_forward_tile, xl, x0f, W, bias, L, Dp, xs, s)                                      \
            VC_SWITCH(R, vc_backward_tile, g, gx0, x0f, xs, s, W, part, part_b, L, Dp)                         \
            vc_store_##S(grad_x0 + r0, gx0, R, D, Dp);                                                         \
            vc_store_##S(grad_x + r0, g, R, D, Dp);                                                            \
        }                                                                                                      \
        _Pragma("omp critical")                                                                                \
        {                                                                                                      \
            for (int64_t i = 0; i < L * Dp; i++) grad_W[i] += part[i];                                         \
            if (part_b)                                                                                        \
                for (int64_t i = 0; i < L * Dp; i++) grad_bias[i] += part_b[i];                                \
        }                                                                                                      \
        free(part);                                                                                            \
        free(xs);                                                                                              \
    }                                                                                                          \
}


/* The DCN-v2 cross stack (runtime/interaction.py cross_stack): L layers x_{l+1} = x0 * (z_l U_l^T + b_l) + x_l, z_l
 * = x_l V_l^T (low rank) or x_l (full rank, U_l = W_l), per tile of VC_ROWS samples (vc_tile) kept in float rows
 * (L1) across the layers: x and x0 read once, the output written once (and, saving for the backward, h_l + b_l and
 * the inputs x_1 .. x_{L-1}), where the GEMM path makes a GEMM, an epilogue pass and their [B, D] intermediates per
 * layer. For weights that stay in cache (the caller decides). Ut: float [L, K, Dp] (U_l^T; K the rank, or D at full
 * rank), V: float [L, K, Dp] (NULL at full rank), bias: float [L, Dp] (NULL without); rows zero-padded to Dp, a
 * multiple of VL >= D. */
static const int CS_COLS = VL == 16 ? 3 : 1; /* register tile: VC_ROWS rows x CS_COLS vectors */

/* Columns [c0, c0 + N VL) of the tile's R rows: acc = b + sum_k z[r, k] Ut[k] (register tile, each weight vector
   read once for the R rows), kept in hb (when given), then xl[r] += x0[r] * acc. */
static inline __attribute__((always_inline)) void cs_block(float *xl, const float *x0, const float *z, int64_t zs,
                                                           const float *Ut, const float *b, int64_t K, int64_t Dp,
                                                           int64_t c0, float *hb, const int R, const int N) {
    vf acc[VC_ROWS][CS_COLS];
    for (int c = 0; c < N; c++) {
        const vf bv = b ? VC_AT(b + c0 + c * VL) : (vf){0};
        for (int r = 0; r < R; r++) acc[r][c] = bv;
    }
    for (int64_t k = 0; k < K; k++) {
        vf u[CS_COLS];
        for (int c = 0; c < N; c++) u[c] = VC_AT(Ut + k * Dp + c0 + c * VL);
        for (int r = 0; r < R; r++) {
            const float zr = z[r * zs + k];
            for (int c = 0; c < N; c++) acc[r][c] += zr * u[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < N; c++) {
            const int64_t at = r * Dp + c0 + c * VL;
            if (hb) VC_AT(hb + at) = acc[r][c];
            VC_AT(xl + at) += VC_AT(x0 + at) * acc[r][c];
        }
}

#define CS_BLOCK(N, R, ...) cs_block(__VA_ARGS__, R, N)

/* xl[r] += x0[r] * (b + z[r] Ut) for the tile's R rows, in column blocks of up to CS_COLS vectors (cs_block). */
static inline __attribute__((always_inline)) void cs_up(float *xl, const float *x0, const float *z, int64_t zs,
                                                        const float *Ut, const float *b, int64_t K, int64_t Dp,
                                                        float *hb, const int R) {
    for (int64_t c0 = 0; c0 < Dp; c0 += CS_COLS * VL) {
        const int n = (Dp - c0) / VL < CS_COLS ? (int)((Dp - c0) / VL) : CS_COLS;
        switch (n) {
#if RECOMPILE_AVX512
            case 3: CS_BLOCK(3, R, xl, x0, z, zs, Ut, b, K, Dp, c0, hb); break;
            case 2: CS_BLOCK(2, R, xl, x0, z, zs, Ut, b, K, Dp, c0, hb); break;
#endif
            default: CS_BLOCK(1, R, xl, x0, z, zs, Ut, b, K, Dp, c0, hb); break;
        }
    }
}

/* z[r * zs + k] = x_l[r] . P[k] for the tile's R rows and the n rows of P (stride Dp), the rows side by side. */
static inline __attribute__((always_inline)) void cs_dots(const float *xl, const float *P, int64_t n, int64_t Dp,
                                                          float *z, int64_t zs, const int R) {
    for (int64_t k = 0; k < n; k++) {
        vf acc[VC_ROWS];
        for (int r = 0; r < R; r++) acc[r] = (vf){0};
        for (int64_t d = 0; d < Dp; d += VL) {
            const vf v = VC_AT(P + k * Dp + d);
            for (int r = 0; r < R; r++) acc[r] += VC_AT(xl + r * Dp + d) * v;
        }
        for (int r = 0; r < R; r++) z[r * zs + k] = vc_hsum(acc[r]);
    }
}

/* One layer over the tile's R rows (z: scratch of R * max(K, Dp) floats). */
static inline __attribute__((always_inline)) void cs_layer(float *xl, const float *x0, float *z, const float *Ut,
                                                           const float *V, const float *b, int64_t K, int64_t D,
                                                           int64_t Dp, float *hb, const int R) {
    if (V) {
        cs_dots(xl, V, K, Dp, z, K, R);
        cs_up(xl, x0, z, K, Ut, b, K, Dp, hb, R);
    } else {
        memcpy(z, xl, sizeof(float) * R * Dp);
        cs_up(xl, x0, z, Dp, Ut, b, D, Dp, hb, R);
    }
}

/* One row of a DCN-Mix layer between its dot products and its up-projection: from ``dots`` (the experts' E * rank
   pre-activations a, then the E gate logits), the gates g = softmax(logits) and z[e * rank + k] = g_e act(C_e
   act(a_e))_k (act(a_e) without C), then z[E * rank + e] = g_e when K has room (the biases' weights). scratch:
   rank + E floats. */
static inline void cm_row(const float *dots, const float *C, int64_t Cs, int64_t E, int64_t rank, int64_t K,
                          int relu, float *scratch, float *z) {
    const float *logits = dots + E * rank;
    float *c = scratch, *g = scratch + rank, top = logits[0], total = 0.f;
    for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
    for (int64_t e = 0; e < E; e++) total += g[e] = expf(logits[e] - top);
    for (int64_t e = 0; e < E; e++) {
        const float ge = g[e] / total, *a = dots + e * rank;
        float *ze = z + e * rank;
        if (C) {
            for (int64_t k = 0; k < rank; k++) c[k] = relu && a[k] < 0.f ? 0.f : a[k];
            for (int64_t k = 0; k < rank; k++) {
                float v = 0.f;
                for (int64_t m = 0; m < rank; m++) v += C[(e * rank + k) * Cs + m] * c[m];
                ze[k] = ge * (relu && v < 0.f ? 0.f : v);
            }
        } else {
            for (int64_t k = 0; k < rank; k++) ze[k] = ge * (relu && a[k] < 0.f ? 0.f : a[k]);
        }
        if (K > E * rank) z[E * rank + e] = ge;
    }
}

/* hbs: L row pointers [B, D] for h_l + b_l and inputs: L - 1 for x_1 .. x_{L-1} (both NULL when not saving). */
#define DEFINE_CROSS_STACK_KERNELS(S, T)                                                                       \
void cross_stack_fwd_##S(const T *x0, const T *x, const float *Ut, const float *V, const float *bias, int64_t L, \
                         int64_t K, int64_t Dp, T *out, T *const *hbs, T *const *inputs, int64_t B, int64_t D,   \
                         int threads) {                                                                        \
    const int64_t rows = VC_ROWS * Dp;                                                                         \
    VC_FOR_TILES(S, rows + VC_ROWS * (K > Dp ? K : Dp), {                                                      \
        float *hb = x0f + rows, *z = hb + rows;                                                                \
        for (int64_t l = 0; l < L; l++) {                                                                      \
            if (inputs && l) vc_store_##S(inputs[l - 1] + r0, xl, R, D, Dp);                                   \
            VC_SWITCH(R, cs_layer, xl, x0f, z, Ut + l * K * Dp, V ? V + l * K * Dp : NULL,                     \
                      bias ? bias + l * Dp : NULL, K, D, Dp, hbs ? hb : NULL)                                  \
            if (hbs) vc_store_##S(hbs[l] + r0, hb, R, D, Dp);                                                  \
        }                                                                                                      \
    })                                                                                                         \
}

/* The DCN-Mix layer (runtime/interaction.py cross_mixture), inference: per tile of rows, the gate logits and every
 * expert's down-projection as dot products (cs_dots), softmax, act, the mids (r x r, scalar), then the gate-scaled
 * ranks (and the gates, for the biases) through one up-projection and x0 * y + x (cs_up). V: float [E * rank, Dp]
 * (the downs' rows), G: float [E, Dp] (the gate), C: float [E, rank, Cs] (the mids' rows, NULL without), Ut: float
 * [K, Dp] (the ups' columns, then the biases when K = E * rank + E). */
#define DEFINE_CROSS_MIXTURE_KERNELS(S, T)                                                                     \
void cross_mixture_fwd_##S(const T *x0, const T *x, const float *V, const float *G, const float *C, int64_t Cs, \
                           const float *Ut, int64_t E, int64_t rank, int64_t K, int relu, int64_t Dp, T *out,   \
                           int64_t B, int64_t D, int threads) {                                                \
    const int64_t nd = E * rank + E;                                                                           \
    VC_FOR_TILES(S, VC_ROWS * (nd + K) + rank + E, {                                                           \
        float *dots = x0f + VC_ROWS * Dp, *z = dots + VC_ROWS * nd, *c = z + VC_ROWS * K;                      \
        VC_SWITCH(R, cs_dots, xl, V, E * rank, Dp, dots, nd)                                                   \
        VC_SWITCH(R, cs_dots, xl, G, E, Dp, dots + E * rank, nd)                                               \
        for (int r = 0; r < R; r++) cm_row(dots + r * nd, C, Cs, E, rank, K, relu, c, z + r * K);              \
        VC_SWITCH(R, cs_up, xl, x0f, z, K, Ut, NULL, K, Dp, NULL)                                              \
    })                                                                                                         \
}

DEFINE_DOT_KERNELS(f32, float)
DEFINE_KERNELS(f32, float)
DEFINE_FM_KERNELS(f32, float)
DEFINE_VECTOR_CROSS_KERNELS(f32, float)
DEFINE_CROSS_STACK_KERNELS(f32, float)
DEFINE_CROSS_MIXTURE_KERNELS(f32, float)
DEFINE_DOT_KERNELS(f16, _Float16)
DEFINE_KERNELS(f16, _Float16)
DEFINE_FM_KERNELS(f16, _Float16)
DEFINE_VECTOR_CROSS_KERNELS(f16, _Float16)
DEFINE_CROSS_STACK_KERNELS(f16, _Float16)
DEFINE_CROSS_MIXTURE_KERNELS(f16, _Float16)
DEFINE_DOT_KERNELS(bf16, bf16_t)
DEFINE_KERNELS(bf16, bf16_t)
DEFINE_FM_KERNELS(bf16, bf16_t)
DEFINE_VECTOR_CROSS_KERNELS(bf16, bf16_t)
DEFINE_CROSS_STACK_KERNELS(bf16, bf16_t)
DEFINE_CROSS_MIXTURE_KERNELS(bf16, bf16_t)
