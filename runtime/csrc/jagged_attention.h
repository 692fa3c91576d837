/* CPU kernels of recompile.hstu_attention (runtime/jagged_attention.py), plain C + OpenMP.
 *
 * HSTU's pointwise attention on jagged q, k [T, H, D], v [T, H, Dv]: for each sequence and head,
 * out_i = sum_j silu(alpha q_i.k_j + bias_ij) * valid_ij / N * v_j, with bias_ij = rel[N - 1 + j - i]
 * + time_bias[bucket(|ts_i - ts_j|)] and HSTU's valid mask (causal, targets, contextual prefix).
 *
 * Nothing is computed on padding: each sequence's q, k, v (per head) are packed once into float rows
 * (converting f16 / bf16), then tiles of BM query rows x BN keys are computed in cache: the scores, the
 * mask and bias tile (built once for every head), SiLU, and the products. A query block visits only the
 * keys its rows may see (causal: up to its last row, in 16-key steps).
 * - forward: work items are runs of query blocks of one sequence (long sequences split into several),
 *   largest first, over OpenMP threads;
 * - backward: one item per sequence (it owns the sequence's dq, dk, dv): every tile recomputes its
 *   scores and adds to dv, dk and dq; bias gradients are per-thread arrays summed at the end.
 * Products are C += A.B with B's rows vectorised (VL floats): register tiles of MR rows x NR vectors.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

typedef uint16_t bf16_t;

/* Register tiles of MR rows x NR vectors: MR * NR accumulators, NR vectors of B and one broadcast of A fit the
   register file (AVX-512: 16 + 4 + 1 of 32; AVX2: 12 + 3 + 1 of 16, where 4 x 4 spilled and ran 1.3x slower). */
enum { BM = 32, BN = 64, MR = 4, NR = VL == 16 ? 4 : 3, SPREAD = 8 };
typedef int64_t vl __attribute__((vector_size(VL * sizeof(int64_t))));

enum { DTYPE_F32 = 0, DTYPE_F16 = 1, DTYPE_BF16 = 2 };
enum { HSTU_NO_MEMORY = -1, HSTU_BAD_OFFSETS = -2, HSTU_TOO_LONG = -3 }; /* entry points return 0 or these */

/* hstu_problem: the problem of one call, in kernels.h (the entry points' interface). */

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* A fresh buffer, converted to the pointer type it is assigned to (C's implicit void * conversion). */
struct buffer {
    void *p;
    template <class T> operator T *() const { return (T *)p; }
};

static buffer alloc(int64_t floats) { /* 64-byte aligned, zeroed; 4-byte elements */
    size_t bytes = (size_t)round_up(max64(floats, 1) * 4, 64);
    void *p = aligned_alloc(64, bytes);
    if (p) memset(p, 0, bytes);
    return buffer{p};
}

/* ------------------------------------------------------------------------------------------------ */
/* storage types */

static int64_t element_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

static float bf16_to_float(bf16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static bf16_t float_to_bf16(float v) { /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (bf16_t)(bits >> 16);
}

/* dst[0:n * step : step] = src[0:n] as float */
static void load_row(int dtype, const void *src, float *dst, int64_t step, int64_t n) {
    if (dtype == DTYPE_F32) {
        for (int64_t i = 0; i < n; i++) dst[i * step] = ((const float *)src)[i];
    } else if (dtype == DTYPE_F16) {
        for (int64_t i = 0; i < n; i++) dst[i * step] = (float)((const _Float16 *)src)[i];
    } else {
        for (int64_t i = 0; i < n; i++) dst[i * step] = bf16_to_float(((const bf16_t *)src)[i]);
    }
}

/* dst[0:n] = scale * src[0:n * step : step] in the storage type */
static void store_row(int dtype, const float *src, int64_t step, float scale, void *dst, int64_t n) {
    if (dtype == DTYPE_F32) {
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = scale * src[i * step];
    } else if (dtype == DTYPE_F16) {
        for (int64_t i = 0; i < n; i++) ((_Float16 *)dst)[i] = (_Float16)(scale * src[i * step]);
    } else {
        for (int64_t i = 0; i < n; i++) ((bf16_t *)dst)[i] = float_to_bf16(scale * src[i * step]);
    }
}

static char *row_ptr(const void *base, const int64_t *stride, int dtype, int64_t t, int64_t h) {
    return (char *)base + (t * stride[0] + h * stride[1]) * element_size(dtype);
}

/* Rows [t0, t0 + m) of head h of x as floats: dst[r * ld + d] for d < width, or transposed
   (dst[d * ld + r]); what lies past the rows and columns written stays as it is. */
static void pack(int dtype, const void *x, const int64_t *stride, int64_t t0, int64_t m, int64_t h, int64_t width,
                 int transposed, float *dst, int64_t ld) {
    for (int64_t r = 0; r < m; r++)
        load_row(dtype, row_ptr(x, stride, dtype, t0 + r, h), transposed ? dst + r : dst + r * ld,
                 transposed ? ld : 1, width);
}

/* ------------------------------------------------------------------------------------------------ */
/* vector math */

static inline vf gather(const float *table, vi index) {
#if RECOMPILE_AVX512
    return (vf)_mm512_i32gather_ps((__m512i)index, table, 4);
#elif RECOMPILE_AVX2
    return (vf)_mm256_i32gather_ps(table, (__m256i)index, 4);
#else
    vf out;
    for (int l = 0; l < VL; l++) out[l] = table[index[l]];
    return out;
#endif
}

static inline vf reciprocal(vf x) { /* one Newton step after the hardware's 14-bit (AVX2: 12-bit) estimate */
#if RECOMPILE_AVX512
    vf r = (vf)_mm512_rcp14_ps((__m512)x);
    return r * (2.0f - x * r);
#elif RECOMPILE_AVX2
    vf r = (vf)_mm256_rcp_ps((__m256)x);
    return r * (2.0f - x * r);
#else
    return 1.0f / x;
#endif
}

static inline vf vsigmoid(vf s) { return reciprocal(1.0f + vexp(-s)); }

/* ------------------------------------------------------------------------------------------------ */
/* C[M, N] (+)= A[M, K] B[K, N]: A read as scalars A[m * sam + k * sak], B rows of N floats (N a multiple of
   VL, 64-byte aligned rows), C rows of N floats (aligned). Register tiles of up to MR rows x NR vectors. */

template <int ROWS, int VECS>
static void micro(int64_t K, const float *A, int64_t sam, int64_t sak, const float *B, int64_t ldb, float *C,
                  int64_t ldc, int accumulate) {
    vf acc[ROWS][VECS];
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)
        _Pragma("GCC unroll 8") for (int v = 0; v < VECS; v++)
            acc[r][v] = accumulate ? *(const vf *)(C + r * ldc + v * VL) : (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf b[VECS];
        _Pragma("GCC unroll 8") for (int v = 0; v < VECS; v++) b[v] = *(const vf *)(B + k * ldb + v * VL);
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {
            const float a = A[r * sam + k * sak];
            _Pragma("GCC unroll 8") for (int v = 0; v < VECS; v++) acc[r][v] += a * b[v];
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)
        _Pragma("GCC unroll 8") for (int v = 0; v < VECS; v++) *(vf *)(C + r * ldc + v * VL) = acc[r][v];
}

typedef void (*micro_fn)(int64_t, const float *, int64_t, int64_t, const float *, int64_t, float *, int64_t, int);
static const micro_fn MICRO[2][4] = { /* [a full MR-row tile or one row][vectors - 1], up to NR vectors */
    {micro<1, 1>, micro<1, 2>, micro<1, 3>, micro<1, 4>},
    {micro<MR, 1>, micro<MR, 2>, micro<MR, 3>, micro<MR, 4>},
};

static void gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam, int64_t sak, const float *B,
                 int64_t ldb, float *C, int64_t ldc, int accumulate) {
    const int64_t vectors = N / VL, passes = (vectors + NR - 1) / NR;
    for (int64_t pass = 0, v0 = 0; pass < passes; pass++) { /* even passes: 4 vectors as 2 + 2, not 3 + 1 */
        const int nv = (int)((vectors - v0) / (passes - pass));
        const int64_t n0 = v0 * VL;
        v0 += nv;
        int64_t m0 = 0;
        for (; m0 + MR <= M; m0 += MR)
            MICRO[1][nv - 1](K, A + m0 * sam, sam, sak, B + n0, ldb, C + m0 * ldc + n0, ldc, accumulate);
        for (; m0 < M; m0++)
            MICRO[0][nv - 1](K, A + m0 * sam, sam, sak, B + n0, ldb, C + m0 * ldc + n0, ldc, accumulate);
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* one sequence: HSTU's position ids, and the mask and bias of a tile */

typedef struct {
    int64_t start, n, max_id;
    int32_t *ids; /* [n + VL]: HSTU's position ids (contextual prefix at 0, targets clamped at max_id) */
} sequence;

static void sequence_init(const hstu_problem *p, int64_t b, sequence *s, int32_t *ids) {
    s->start = p->offsets[b];
    s->n = p->offsets[b + 1] - s->start;
    s->ids = ids;
    const int64_t c = p->contextual;
    s->max_id = s->n - (c > 0 ? c - 1 : 0) - (p->num_targets ? p->num_targets[b] : 0);
    for (int64_t i = 0; i < s->n; i++) {
        int64_t id = c > 0 ? max64(i - c + 1, 0) : i;
        ids[i] = (int32_t)(p->num_targets ? min64(id, s->max_id) : id);
    }
}

/* One past the last key the query rows [i0, i0 + m) may see. */
static int64_t key_end(const hstu_problem *p, const sequence *s, int64_t i0, int64_t m) {
    if (!p->causal || (p->contextual > 0 && s->ids[i0] == 0)) return s->n; /* the prefix sees the history */
    return i0 + m;
}

/* HSTU's log bucket of the time gaps |ts_i - ts_j[0:VL]|, exactly: an estimate within one bucket from the
   float's exponent and a linear log2 of its mantissa, corrected against the float bucket bounds (HSTU buckets
   the gap's float, so those bounds are exact). */
static inline vi time_buckets(int64_t ts_i, const int64_t *ts_j, const float *bounds, int32_t num_buckets) {
    vl gap;
    memcpy(&gap, ts_j, sizeof gap);
    gap = ts_i - gap;
    const vl sign = gap >> 63;
    gap = (gap ^ sign) - sign;
    gap += (gap < 1) & (1 - gap);
    const vf f = __builtin_convertvector(gap, vf);
    const vi bits = (vi)f;
    const vf mantissa = (vf)((bits & 0x7fffff) | 0x3f800000);
    const vf log2f = __builtin_convertvector((bits >> 23) - 127, vf) + (mantissa - 1.0f);
    vi b = __builtin_convertvector(log2f * (0.69314718f / 0.301f), vi);
    const vi over = b > num_buckets;
    b = (b & ~over) | (num_buckets & over);
    b -= (vi)(f >= gather(bounds, b + 1));
    b += (vi)(f < gather(bounds, b));
    return b;
}

typedef struct {
    float *scale;   /* [BM, BN]: valid / N */
    float *bias;    /* [BM, BN], NULL without bias */
    int32_t *bucket; /* [BM, BN], NULL when not kept */
} tile;

/* The tile of query rows [i0, i0 + m) x keys [j0, j0 + nc), padded with zero scale to ncp columns. */
static void build_tile(const hstu_problem *p, const sequence *s, int64_t i0, int64_t m, int64_t j0, int64_t nc,
                       int64_t ncp, const tile *t) {
    const float inv_n = 1.0f / (float)p->max_seq_len;
    const int64_t N = p->max_seq_len;
    const int32_t ctx = p->contextual > 0, causal = p->causal, max_id = (int32_t)s->max_id;
    vi lane;
    for (int l = 0; l < VL; l++) lane[l] = l;
    for (int64_t r = 0; r < m; r++) {
        const int64_t i = i0 + r;
        const int32_t id_i = s->ids[i], prefix = ctx && id_i == 0; /* the prefix sees the non-target history */
        for (int64_t c = 0; c < ncp; c += VL) {
            const vi col = lane + (int32_t)(j0 + c);
            vi id_j;
            memcpy(&id_j, s->ids + j0 + c, sizeof id_j);
            vi valid = (col == (int32_t)i) | (causal ? id_j < id_i : id_j != id_i);
            if (prefix) valid |= id_j < max_id;
            valid &= col < (int32_t)(j0 + nc);
            *(vf *)(t->scale + r * ncp + c) = vselect(valid, splat(inv_n), splat(0.0f));
        }
        if (!t->bias) continue;
        float *bias = t->bias + r * ncp;
        if (p->rel_bias) {
            memcpy(bias, p->rel_bias + N - 1 + j0 - i, ncp * sizeof(float));
        } else {
            memset(bias, 0, ncp * sizeof(float));
        }
        if (!p->timestamps) continue;
        const int64_t *ts = p->timestamps + s->start;
        for (int64_t c = 0; c < ncp; c += VL) {
            const vi b = time_buckets(ts[i], ts + j0 + c, p->bucket_bounds, (int32_t)p->num_buckets);
            *(vf *)(bias + c) += gather(p->time_bias, b);
            if (t->bucket) *(vi *)(t->bucket + r * ncp + c) = b;
        }
    }
}

static int has_bias(const hstu_problem *p) { return p->rel_bias || p->timestamps; }

/* ------------------------------------------------------------------------------------------------ */
/* work split, checks */

static int64_t length(const hstu_problem *p, int64_t b) { return p->offsets[b + 1] - p->offsets[b]; }

static int64_t max_length(const hstu_problem *p) {
    int64_t n = 0;
    for (int64_t b = 0; b < p->batch; b++) n = max64(n, length(p, b));
    return n;
}

static int check_problem(const hstu_problem *p) {
    if (p->offsets[0] < 0 || p->offsets[p->batch] > p->total) return HSTU_BAD_OFFSETS;
    for (int64_t b = 0; b < p->batch; b++) {
        if (length(p, b) < 0) return HSTU_BAD_OFFSETS;
        if (p->rel_bias && length(p, b) > p->max_seq_len) return HSTU_TOO_LONG;
    }
    return 0;
}

/* Zeros in the rows of x [total, row] that no sequence covers. */
static void zero_uncovered(const hstu_problem *p, void *x, int64_t row) {
    const int64_t bytes = element_size(p->dtype) * row;
    memset(x, 0, p->offsets[0] * bytes);
    memset((char *)x + p->offsets[p->batch] * bytes, 0, (p->total - p->offsets[p->batch]) * bytes);
}

typedef struct {
    int64_t seq, i0, i1, cost; /* query rows [i0, i1) of sequence seq */
} work_item;

static int by_cost_desc(const void *a, const void *b) {
    int64_t x = ((const work_item *)a)->cost, y = ((const work_item *)b)->cost;
    return (x < y) - (x > y);
}

/* Score entries of query rows [i0, i0 + m) (causal: the keys up to the last row). */
static int64_t block_cost(const hstu_problem *p, int64_t n, int64_t i0, int64_t m) {
    return m * (p->causal ? i0 + m : n);
}

/* Runs of query blocks, each sequence cut into runs of about a quarter of a thread's share (or whole), largest
   first. Returns the count; items has room for one per query block. */
static int64_t forward_items(const hstu_problem *p, work_item *items) {
    int64_t total = 0, count = 0;
    for (int64_t b = 0; b < p->batch; b++)
        for (int64_t i0 = 0; i0 < length(p, b); i0 += BM) total += block_cost(p, length(p, b), i0, min64(BM, length(p, b) - i0));
    const int64_t share = max64(total / (4 * max64(p->threads, 1)), 1);
    for (int64_t b = 0; b < p->batch; b++) {
        const int64_t n = length(p, b);
        for (int64_t i0 = 0; i0 < n;) {
            work_item item = {b, i0, i0, 0};
            while (item.i1 < n && item.cost < share) {
                item.cost += block_cost(p, n, item.i1, min64(BM, n - item.i1));
                item.i1 = min64(item.i1 + BM, n);
            }
            items[count++] = item;
            i0 = item.i1;
        }
    }
    qsort(items, count, sizeof(work_item), by_cost_desc);
    return count;
}

/* ------------------------------------------------------------------------------------------------ */
/* forward */

typedef struct {
    int32_t *ids;
    float *kt, *v; /* the item's keys per head: [H, D, nmax_p] transposed, [H, nmax, Dvp] */
    float *q, *o;  /* a query block per head: [H, BM, D], [H, BM, Dvp] */
    float *s;      /* [BM, BN] */
    tile t;
} forward_space;

static int forward_space_init(const hstu_problem *p, int64_t nmax, forward_space *w) {
    const int64_t H = p->heads, D = p->dim, Dvp = round_up(p->dim_v, VL), np = round_up(nmax, VL);
    w->ids = alloc(nmax + VL);
    w->kt = alloc(H * D * np), w->v = alloc(H * nmax * Dvp), w->q = alloc(H * BM * D), w->o = alloc(H * BM * Dvp);
    w->s = alloc(BM * BN), w->t.scale = alloc(BM * BN), w->t.bias = has_bias(p) ? alloc(BM * BN) : buffer{NULL};
    w->t.bucket = NULL;
    return w->ids && w->kt && w->v && w->q && w->o && w->s && w->t.scale && (w->t.bias || !has_bias(p));
}

static void forward_space_free(forward_space *w) {
    free(w->ids), free(w->kt), free(w->v), free(w->q), free(w->o), free(w->s), free(w->t.scale), free(w->t.bias);
}

static void forward_item(const hstu_problem *p, const work_item *item, forward_space *w) {
    const int64_t H = p->heads, D = p->dim, Dv = p->dim_v, Dvp = round_up(Dv, VL);
    const int64_t out_stride[2] = {H * Dv, Dv};
    sequence s;
    sequence_init(p, item->seq, &s, w->ids);
    int64_t keys = 0;
    for (int64_t i0 = item->i0; i0 < item->i1; i0 += BM) keys = max64(keys, key_end(p, &s, i0, min64(BM, item->i1 - i0)));
    const int64_t kp = round_up(keys, VL);
    for (int64_t h = 0; h < H; h++) {
        float *kt = w->kt + h * D * kp;
        for (int64_t d = 0; d < D; d++) memset(kt + d * kp + keys, 0, (kp - keys) * sizeof(float));
        pack(p->dtype, p->k, p->k_stride, s.start, keys, h, D, 1, kt, kp);
        pack(p->dtype, p->v, p->v_stride, s.start, keys, h, Dv, 0, w->v + h * keys * Dvp, Dvp);
    }
    for (int64_t i0 = item->i0; i0 < item->i1; i0 += BM) {
        const int64_t m = min64(BM, item->i1 - i0), kend = key_end(p, &s, i0, m);
        for (int64_t h = 0; h < H; h++) pack(p->dtype, p->q, p->q_stride, s.start + i0, m, h, D, 0, w->q + h * BM * D, D);
        memset(w->o, 0, sizeof(float) * H * BM * Dvp);
        for (int64_t j0 = 0; j0 < kend; j0 += BN) {
            const int64_t nc = min64(BN, kend - j0), ncp = round_up(nc, VL);
            build_tile(p, &s, i0, m, j0, nc, ncp, &w->t);
            for (int64_t h = 0; h < H; h++) {
                gemm(m, ncp, D, w->q + h * BM * D, D, 1, w->kt + h * D * kp + j0, kp, w->s, ncp, 0);
                for (int64_t at = 0; at < m * ncp; at += VL) {
                    vf x = *(vf *)(w->s + at) * p->alpha;
                    if (w->t.bias) x += *(vf *)(w->t.bias + at);
                    *(vf *)(w->s + at) = x * vsigmoid(x) * *(vf *)(w->t.scale + at);
                }
                gemm(m, Dvp, nc, w->s, ncp, 1, w->v + (h * keys + j0) * Dvp, Dvp, w->o + h * BM * Dvp, Dvp, 1);
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t h = 0; h < H; h++)
                store_row(p->dtype, w->o + (h * BM + r) * Dvp, 1, 1.0f, row_ptr(p->out, out_stride, p->dtype, s.start + i0 + r, h), Dv);
    }
}

int hstu_attention_fwd(const hstu_problem *p) {
    const int bad = check_problem(p);
    if (bad) return bad;
    zero_uncovered(p, p->out, p->heads * p->dim_v);
    const int64_t nmax = max_length(p);
    int64_t blocks = 0;
    for (int64_t b = 0; b < p->batch; b++) blocks += (length(p, b) + BM - 1) / BM;
    work_item *items = (work_item *)malloc(sizeof(work_item) * max64(blocks, 1));
    if (!items) return HSTU_NO_MEMORY;
    const int64_t count = forward_items(p, items);
    int failed = 0;
#pragma omp parallel num_threads(max64(p->threads, 1)) reduction(| : failed)
    {
        forward_space w;
        failed = !forward_space_init(p, nmax, &w);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++)
            if (!failed) forward_item(p, &items[i], &w);
        forward_space_free(&w);
    }
    free(items);
    return failed ? HSTU_NO_MEMORY : 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* backward */

typedef struct {
    int32_t *ids;
    /* the sequence per head: q and grad rows, k transposed and as rows, v transposed */
    float *q, *g, *kt, *k, *vt;  /* [H, nmax, D], [H, nmax, Dvp], [H, D, np], [H, nmax, Dp], [H, Dv, np] */
    float *dq, *dkt, *dvt;       /* its gradients: [H, nmax, Dp], [H, D, np], [H, Dv, np] */
    float *s, *dp, *ds_sum;      /* [BM, BN]: weights, score gradients, and those summed over heads */
    tile t;
    float *drel, *dtime;         /* this thread's bias gradients; dtime in SPREAD copies of time_size */
    int64_t time_size;
} backward_space;

static int backward_space_init(const hstu_problem *p, int64_t nmax, backward_space *w, float *drel, float *dtime,
                               int64_t time_size) {
    const int64_t H = p->heads, D = p->dim, Dv = p->dim_v, Dp = round_up(D, VL), Dvp = round_up(Dv, VL);
    const int64_t np = round_up(nmax, VL);
    const int bias = has_bias(p);
    w->ids = alloc(nmax + VL);
    w->q = alloc(H * nmax * D), w->g = alloc(H * nmax * Dvp), w->kt = alloc(H * D * np), w->k = alloc(H * nmax * Dp);
    w->vt = alloc(H * Dv * np), w->dq = alloc(H * nmax * Dp), w->dkt = alloc(H * D * np), w->dvt = alloc(H * Dv * np);
    w->s = alloc(BM * BN), w->dp = alloc(BM * BN), w->ds_sum = bias ? alloc(BM * BN) : buffer{NULL};
    w->t.scale = alloc(BM * BN), w->t.bias = bias ? alloc(BM * BN) : buffer{NULL};
    w->t.bucket = p->timestamps ? alloc(BM * BN) : buffer{NULL};
    w->drel = drel, w->dtime = dtime, w->time_size = time_size;
    return w->ids && w->q && w->g && w->kt && w->k && w->vt && w->dq && w->dkt && w->dvt && w->s && w->dp &&
           w->t.scale && (!bias || (w->ds_sum && w->t.bias)) && (!p->timestamps || w->t.bucket);
}

static void backward_space_free(backward_space *w) {
    free(w->ids), free(w->q), free(w->g), free(w->kt), free(w->k), free(w->vt), free(w->dq), free(w->dkt);
    free(w->dvt), free(w->s), free(w->dp), free(w->ds_sum), free(w->t.scale), free(w->t.bias), free(w->t.bucket);
}

/* The tile's weights into s and score gradients (d loss / d pre-activation score) into dp, for head h. */
static void backward_tile_head(const hstu_problem *p, backward_space *w, int64_t n, int64_t h, int64_t i0,
                               int64_t m, int64_t j0, int64_t ncp) {
    const int64_t D = p->dim, Dv = p->dim_v, Dvp = round_up(Dv, VL), np = round_up(n, VL);
    gemm(m, ncp, D, w->q + (h * n + i0) * D, D, 1, w->kt + h * D * np + j0, np, w->s, ncp, 0);
    gemm(m, ncp, Dv, w->g + (h * n + i0) * Dvp, Dvp, 1, w->vt + h * Dv * np + j0, np, w->dp, ncp, 0);
    for (int64_t at = 0; at < m * ncp; at += VL) {
        vf x = *(vf *)(w->s + at) * p->alpha;
        if (w->t.bias) x += *(vf *)(w->t.bias + at);
        const vf sig = vsigmoid(x), scale = *(vf *)(w->t.scale + at);
        *(vf *)(w->s + at) = x * sig * scale;
        const vf ds = *(vf *)(w->dp + at) * scale * sig * (1.0f + x * (1.0f - sig));
        *(vf *)(w->dp + at) = ds;
        if (w->ds_sum) *(vf *)(w->ds_sum + at) += ds;
    }
}

/* The bias gradients of a tile, from its score gradients summed over heads. */
static void bias_gradients(const hstu_problem *p, backward_space *w, int64_t i0, int64_t m, int64_t j0,
                           int64_t nc, int64_t ncp) {
    for (int64_t r = 0; r < m; r++) {
        const float *ds = w->ds_sum + r * ncp;
        if (w->drel) {
            float *dst = w->drel + p->max_seq_len - 1 + j0 - (i0 + r);
            for (int64_t c = 0; c < ncp; c += VL) *(vfu *)(dst + c) += *(const vf *)(ds + c);
        }
        if (w->dtime) { /* SPREAD interleaved copies: runs of one bucket add in parallel, not in a chain */
            const int32_t *bucket = w->t.bucket + r * ncp;
            for (int64_t c = 0; c < nc; c++) w->dtime[(c % SPREAD) * w->time_size + bucket[c]] += ds[c];
        }
    }
}

static void backward_sequence(const hstu_problem *p, int64_t b, backward_space *w) {
    const int64_t H = p->heads, D = p->dim, Dv = p->dim_v, Dp = round_up(D, VL), Dvp = round_up(Dv, VL);
    sequence s;
    sequence_init(p, b, &s, w->ids);
    const int64_t n = s.n, np = round_up(n, VL);
    const int64_t q_stride[2] = {H * D, D}, v_stride[2] = {H * Dv, Dv};
    for (int64_t h = 0; h < H; h++) {
        float *kt = w->kt + h * D * np, *vt = w->vt + h * Dv * np;
        for (int64_t d = 0; d < D; d++) memset(kt + d * np + n, 0, (np - n) * sizeof(float));
        for (int64_t d = 0; d < Dv; d++) memset(vt + d * np + n, 0, (np - n) * sizeof(float));
        pack(p->dtype, p->q, p->q_stride, s.start, n, h, D, 0, w->q + h * n * D, D);
        pack(p->dtype, p->grad, p->grad_stride, s.start, n, h, Dv, 0, w->g + h * n * Dvp, Dvp);
        pack(p->dtype, p->k, p->k_stride, s.start, n, h, D, 1, kt, np);
        pack(p->dtype, p->k, p->k_stride, s.start, n, h, D, 0, w->k + h * n * Dp, Dp);
        pack(p->dtype, p->v, p->v_stride, s.start, n, h, Dv, 1, vt, np);
    }
    memset(w->dq, 0, sizeof(float) * H * n * Dp);
    memset(w->dkt, 0, sizeof(float) * H * D * np);
    memset(w->dvt, 0, sizeof(float) * H * Dv * np);
    for (int64_t i0 = 0; i0 < n; i0 += BM) {
        const int64_t m = min64(BM, n - i0), kend = key_end(p, &s, i0, m);
        for (int64_t j0 = 0; j0 < kend; j0 += BN) {
            const int64_t nc = min64(BN, kend - j0), ncp = round_up(nc, VL);
            build_tile(p, &s, i0, m, j0, nc, ncp, &w->t);
            if (w->ds_sum) memset(w->ds_sum, 0, sizeof(float) * m * ncp);
            for (int64_t h = 0; h < H; h++) {
                backward_tile_head(p, w, n, h, i0, m, j0, ncp);
                const float *q = w->q + (h * n + i0) * D, *g = w->g + (h * n + i0) * Dvp;
                /* dv^T += g^T P, dk^T += q^T dS, dq += dS k */
                gemm(Dv, ncp, m, g, 1, Dvp, w->s, ncp, w->dvt + h * Dv * np + j0, np, 1);
                gemm(D, ncp, m, q, 1, D, w->dp, ncp, w->dkt + h * D * np + j0, np, 1);
                gemm(m, Dp, nc, w->dp, ncp, 1, w->k + (h * n + j0) * Dp, Dp, w->dq + (h * n + i0) * Dp, Dp, 1);
            }
            if (w->ds_sum) bias_gradients(p, w, i0, m, j0, nc, ncp);
        }
    }
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t t = s.start + i;
            store_row(p->dtype, w->dq + (h * n + i) * Dp, 1, p->alpha, row_ptr(p->dq, q_stride, p->dtype, t, h), D);
            store_row(p->dtype, w->dkt + h * D * np + i, np, p->alpha, row_ptr(p->dk, q_stride, p->dtype, t, h), D);
            store_row(p->dtype, w->dvt + h * Dv * np + i, np, 1.0f, row_ptr(p->dv, v_stride, p->dtype, t, h), Dv);
        }
    }
}

static int by_length_desc(const void *a, const void *b) {
    int64_t x = ((const int64_t *)a)[1], y = ((const int64_t *)b)[1];
    return (x < y) - (x > y);
}

int hstu_attention_bwd(const hstu_problem *p) {
    const int bad = check_problem(p);
    if (bad) return bad;
    zero_uncovered(p, p->dq, p->heads * p->dim);
    zero_uncovered(p, p->dk, p->heads * p->dim);
    zero_uncovered(p, p->dv, p->heads * p->dim_v);
    const int64_t nmax = max_length(p), threads = max64(p->threads, 1);
    const int64_t rel_size = round_up(2 * p->max_seq_len - 1 + VL, VL), time_size = round_up(p->num_buckets + 1, VL);
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * 2 * max64(p->batch, 1)); /* (sequence, length), longest first */
    float *drel = p->drel ? alloc(threads * rel_size) : buffer{NULL};
    float *dtime = p->dtime ? alloc(threads * SPREAD * time_size) : buffer{NULL};
    if (!order || (p->drel && !drel) || (p->dtime && !dtime)) {
        free(order), free(drel), free(dtime);
        return HSTU_NO_MEMORY;
    }
    for (int64_t b = 0; b < p->batch; b++) order[2 * b] = b, order[2 * b + 1] = length(p, b);
    qsort(order, p->batch, 2 * sizeof(int64_t), by_length_desc);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num();
        backward_space w;
        failed = !backward_space_init(p, nmax, &w, drel ? drel + t * rel_size : NULL,
                                      dtime ? dtime + t * SPREAD * time_size : NULL, time_size);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < p->batch; i++)
            if (!failed && order[2 * i + 1] > 0) backward_sequence(p, order[2 * i], &w);
        backward_space_free(&w);
    }
    for (int64_t t = 0; !failed && drel && t < threads; t++)
        for (int64_t x = 0; x < 2 * p->max_seq_len - 1; x++) p->drel[x] += drel[t * rel_size + x];
    for (int64_t copy = 0; !failed && dtime && copy < threads * SPREAD; copy++)
        for (int64_t x = 0; x <= p->num_buckets; x++) p->dtime[x] += dtime[copy * time_size + x];
    free(order), free(drel), free(dtime);
    return failed ? HSTU_NO_MEMORY : 0;
}
