/* CPU kernels of recompile::grouped_embedding_bag (runtime/embedding_native.py): every table of a group
 * in one call, fp32 tables read in place through their data pointers (never packed).
 *
 * A group is described by ``meta``, an int64 [T, META] array (one row per table, columns below); ids
 * and offsets are int32 or int64 (FLAGS). Bag b of table t holds ids [start, end): with offsets,
 * start = offsets[b] and end = offsets[b + 1] (or N for the last bag when offsets has B entries);
 * without, ids are a [B, L] block (L = N_OFFS). NONE pooling ("sequence" layout) has one row per id.
 *
 * Checks: offsets that do not start at 0, decrease, or overrun the ids mark their table with
 * ERR_OFFSETS in ``err`` (the table is skipped: its output rows are zero); an id outside its table
 * marks ERR_IDS and reads row 0 instead. Python raises (or warns) with the feature's name from those marks.
 *
 * Loops run on torch's OpenMP runtime (the library links the same libgomp soname torch loaded):
 * forward over (tile of bags, table), backward and optimizer steps over tables (each table's rows
 * are written by one thread, in id order, so results do not depend on the thread count).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { W_PTR, ROWS, DIM, W_STRIDE, IDS, N_IDS, OFFS, N_OFFS, PSW, POOLING, PAD, OUT_AT, FLAGS, META };
enum { SUM, MEAN, NONE };
enum { IDS_I64 = 1, OFFS_I64 = 2, LAST_OFFSET = 4 };
enum { ERR_OFFSETS = 1, ERR_IDS = 2 };
enum { SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM };

typedef struct {
    const float *w;
    int64_t rows, dim, stride, n, n_offs, pad, at, pooling;
    const void *ids, *offs;
    const float *psw;
    int ids64, offs64, last;
} table_t;

static table_t table_of(const int64_t *m) {
    table_t t = {(const float *)m[W_PTR], m[ROWS], m[DIM], m[W_STRIDE], m[N_IDS], m[N_OFFS], m[PAD], m[OUT_AT],
                 m[POOLING], (const void *)m[IDS], (const void *)m[OFFS], (const float *)m[PSW],
                 (m[FLAGS] & IDS_I64) != 0, (m[FLAGS] & OFFS_I64) != 0, (m[FLAGS] & LAST_OFFSET) != 0};
    return t;
}

static inline int64_t at(const void *p, int64_t i, int is64) {
    return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

static inline void bag_range(const table_t *t, int64_t b, int64_t *start, int64_t *end) {
    if (t->offs == NULL) {
        *start = b * t->n_offs;
        *end = *start + t->n_offs;
        return;
    }
    *start = at(t->offs, b, t->offs64);
    *end = b + 1 < t->n_offs ? at(t->offs, b + 1, t->offs64) : t->n;
}

/* The row an id reads: itself, or row 0 (marked) when outside the table. */
static inline int64_t row_of(const table_t *t, int64_t j, int64_t *err) {
    int64_t id = at(t->ids, j, t->ids64);
    if (id < 0 || id >= t->rows) {
        __atomic_fetch_or(err, ERR_IDS, __ATOMIC_RELAXED);
        return 0;
    }
    return id;
}

static int offsets_ok(const table_t *t) {
    if (t->offs == NULL || t->n_offs == 0) return t->offs == NULL || (t->n == 0 && !t->last);
    int64_t prev = at(t->offs, 0, t->offs64);
    if (prev != 0) return 0;
    for (int64_t b = 1; b < t->n_offs; b++) {
        int64_t o = at(t->offs, b, t->offs64);
        if (o < prev) return 0;
        prev = o;
    }
    return t->last ? prev == t->n : prev <= t->n;
}

/* Each id's factor in its bag's pooled row: 1, its sample weight, 0 for padding. */
static inline float id_scale(const table_t *t, int64_t j, int64_t row) {
    if (row == t->pad) return 0.f;
    return t->psw ? t->psw[j] : 1.f;
}

/* What MEAN pooling divides a bag's sum by: its ids other than padding (1 for an empty bag, and for SUM). */
static float bag_divisor(const table_t *t, int64_t start, int64_t end, int64_t *err) {
    if (t->pooling != MEAN) return 1.f;
    int64_t count = 0;
    for (int64_t j = start; j < end; j++) count += row_of(t, j, err) != t->pad;
    return count > 0 ? (float)count : 1.f;
}

static inline void axpy(float *restrict y, const float *restrict x, float a, int64_t d) {
    for (int64_t k = 0; k < d; k++) y[k] += a * x[k];
}

static inline void add(float *restrict y, const float *restrict x, int64_t d) {
    for (int64_t k = 0; k < d; k++) y[k] += x[k];
}

/* Ask for transparent huge pages on the whole 2 MiB pages of a fresh buffer: an output or gradient this large
 * is new memory every step, and faulting it in 2 MiB pages instead of 4 KiB ones is most of its cost. */
static void advise_huge(void *p, size_t bytes) {
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > begin) madvise((void *)begin, end - begin, MADV_HUGEPAGE);
}

/* 16 floats, loaded and stored at any float alignment (AVX-512 registers, or pairs/quads of narrower ones). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define LANES 16
#define BLOCK (4 * LANES) /* columns pooled in registers at once */
#define TILE 512 /* bags per work item of the pooled forward */
#define PREFETCH 16 /* ids ahead whose rows are prefetched */

/* Prefetch the first cache lines of id j's row (a prefetch never faults, a bad id is harmless here). */
static inline void prefetch_row(const float *w, int64_t stride, int64_t dim, const void *ids, int ids64,
                                int64_t n, int64_t j) {
    if (j >= n) return;
    int64_t id = at(ids, j, ids64);
    for (int64_t k = 0; k < dim && k < 2 * BLOCK; k += LANES) __builtin_prefetch(w + id * stride + k);
}

/* o[0:BLOCK] = sum over the bag's ids of scale * row[c:c + BLOCK] (over ``divisor``), accumulated in registers;
 * ``stream``: written past the caches. */
static inline void pool_block(const table_t *t, int64_t start, int64_t end, int64_t c, float divisor, float *o,
                              int64_t *err, int stream) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    const float *w = t->w;
    const void *ids = t->ids;
    int64_t stride = t->stride, dim = t->dim, n = t->n;
    for (int64_t j = start; j < end; j++) {
        if (c == 0) prefetch_row(w, stride, dim, ids, t->ids64, n, j + PREFETCH);
        int64_t row = row_of(t, j, err);
        if (row == t->pad) continue;
        const v16 *r = (const v16 *)(t->w + row * t->stride + c);
        float s = t->psw ? t->psw[j] : 1.f;
        a0 += s * r[0];
        a1 += s * r[1];
        a2 += s * r[2];
        a3 += s * r[3];
    }
    if (divisor != 1.f) {
        a0 /= divisor;
        a1 /= divisor;
        a2 /= divisor;
        a3 /= divisor;
    }
#ifndef __AVX512F__
    (void)stream;
#else
    if (stream && ((uintptr_t)o & 63) == 0) { /* an output larger than the caches: no read for ownership */
        _mm512_stream_ps(o, (__m512)a0);
        _mm512_stream_ps(o + LANES, (__m512)a1);
        _mm512_stream_ps(o + 2 * LANES, (__m512)a2);
        _mm512_stream_ps(o + 3 * LANES, (__m512)a3);
        return;
    }
#endif
    v16 *out = (v16 *)o;
    out[0] = a0;
    out[1] = a1;
    out[2] = a2;
    out[3] = a3;
}

/* Columns past the last full block, accumulated in the output. */
static void pool_tail(const table_t *t, int64_t start, int64_t end, int64_t c, float divisor, float *restrict o,
                      int64_t *err) {
    memset(o, 0, (t->dim - c) * sizeof(float));
    for (int64_t j = start; j < end; j++) {
        int64_t row = row_of(t, j, err);
        if (row != t->pad) axpy(o, t->w + row * t->stride + c, t->psw ? t->psw[j] : 1.f, t->dim - c);
    }
    if (divisor != 1.f)
        for (int64_t k = 0; k < t->dim - c; k++) o[k] /= divisor;
}

/* Pooled forward: out[b, OUT_AT + k] (row stride ``out_stride``) = the pooled row of table t's bag b. */
void geb_forward_pooled(int64_t T, const int64_t *meta, int64_t B, float *out, int64_t out_stride, int64_t *err,
                        int stream, int threads) {
    memset(err, 0, T * sizeof *err);
    if (stream) advise_huge(out, B * out_stride * sizeof(float));
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            table_t tab = table_of(meta + t * META);
            if (!offsets_ok(&tab)) err[t] |= ERR_OFFSETS;
        }
        /* Work items: (table, tile of TILE bags), table-major: a table's rows stay in the caches while its bags are
         * pooled (tile-major ordering reads all tables at once and is ~1.3x slower at batch 2048). */
        int64_t tiles = (B + TILE - 1) / TILE;
#pragma omp for schedule(dynamic, 1) /* a descheduled thread (a busy machine) holds up one work item only */
        for (int64_t w = 0; w < tiles * T; w++) {
            int64_t ti = w / tiles, first = w % tiles * TILE, last = first + TILE < B ? first + TILE : B;
            table_t t = table_of(meta + ti * META);
            for (int64_t b = first; b < last; b++) {
                int64_t start = 0, end = 0, c = 0;
                float *restrict o = out + b * out_stride + t.at;
                if (!(err[ti] & ERR_OFFSETS)) bag_range(&t, b, &start, &end);
                float divisor = bag_divisor(&t, start, end, err + ti);
                for (; c + BLOCK <= t.dim; c += BLOCK) pool_block(&t, start, end, c, divisor, o + c, err + ti, stream);
                if (c < t.dim) pool_tail(&t, start, end, c, divisor, o + c, err + ti);
            }
        }
#ifdef __AVX512F__
        _mm_sfence(); /* the streamed rows are visible before the region ends */
#endif
    }
}

/* Unpooled forward ("sequence" layout): out[OUT_AT + j] = table t's row of id j. */
void geb_forward_sequence(int64_t T, const int64_t *meta, float *out, int64_t out_stride, int64_t *err, int threads) {
    memset(err, 0, T * sizeof *err);
#pragma omp parallel num_threads(threads)
    for (int64_t ti = 0; ti < T; ti++) {
        table_t t = table_of(meta + ti * META);
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < t.n; j++)
            memcpy(out + (t.at + j) * out_stride, t.w + row_of(&t, j, err + ti) * t.stride, t.dim * sizeof(float));
    }
}

/* The gradient of the output row that bag b (pooled) or id j (sequence) of table t wrote. */
static inline const float *grad_row(const table_t *t, const float *grad, int64_t grad_stride, int64_t b) {
    return t->pooling == NONE ? grad + (t->at + b) * grad_stride : grad + b * grad_stride + t->at;
}

/* Calls visit(row, scale, j, g) for every id j of table t: g is the gradient of the output it went into, scale
 * its factor there (0 for padding). Bags are walked in order, so each row's contributions add up in id order. */
#define FOR_EACH_ID(t, grad, grad_stride, B, err, BODY)                                         \
    do {                                                                                         \
        int64_t bags_ = (t).pooling == NONE ? (t).n : (B);                                       \
        for (int64_t b_ = 0; b_ < bags_; b_++) {                                                 \
            int64_t start_ = b_, end_ = b_ + 1;                                                  \
            if ((t).pooling != NONE) bag_range(&(t), b_, &start_, &end_);                        \
            float divisor_ = bag_divisor(&(t), start_, end_, (err));                             \
            const float *g = grad_row(&(t), (grad), (grad_stride), b_);                          \
            for (int64_t j = start_; j < end_; j++) {                                            \
                int64_t row = row_of(&(t), j, (err));                                            \
                float scale = id_scale(&(t), j, row);                                            \
                if (divisor_ != 1.f) scale /= divisor_;                                          \
                BODY                                                                             \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* Backward: per table, the dense gradient [rows, D] (dense[t] != 0), else the gradient of every id's row
 * [N, D]; and where psw_out[t] != 0, the gradient of every per-sample weight (dot(g, row), 0 for padding). */
void geb_backward(int64_t T, const int64_t *meta, int64_t B, const float *grad, int64_t grad_stride,
                  const int64_t *table_out, const int64_t *dense, const int64_t *psw_out, int64_t *err, int threads) {
    memset(err, 0, T * sizeof *err);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t ti = 0; ti < T; ti++) {
        table_t t = table_of(meta + ti * META);
        float *restrict out = (float *)table_out[ti];
        float *restrict dpsw = (float *)psw_out[ti];
        if (dense[ti]) {
            advise_huge(out, t.rows * t.dim * sizeof(float));
            memset(out, 0, t.rows * t.dim * sizeof(float));
        }
        if (!offsets_ok(&t)) {
            err[ti] |= ERR_OFFSETS;
            continue;
        }
        FOR_EACH_ID(t, grad, grad_stride, B, err + ti, {
            float *o = dense[ti] ? out + row * t.dim : out + j * t.dim;
            if (!dense[ti]) memset(o, 0, t.dim * sizeof(float));
            if (scale == 1.f) add(o, g, t.dim);
            else if (scale != 0.f || !dense[ti]) axpy(o, g, scale, t.dim);
            if (dpsw) {
                float dot = 0.f;
                const float *w = t.w + row * t.stride;
                for (int64_t k = 0; k < t.dim; k++) dot += g[k] * w[k];
                dpsw[j] = row == t.pad ? 0.f : dot;
            }
        });
    }
}

/* Fused optimizer step (runtime/embedding_optimizer.py has the formulas): per table, the ids' gradients summed
 * per touched row (in id order; a padding id touches its row with a zero gradient), then each touched row
 * updated in place. ``state`` is int64 [T, 2] of fp32 state pointers (Adagrad: sum [rows, D] or [rows];
 * Adam: exp_avg, exp_avg_sq [rows, D]); ``step_size`` is Adam's bias-corrected lr per table. Compiled without
 * contraction into fused multiply-adds, so the rounding is that of the torch formulas. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

static void update_row(int kind, float *restrict w, const float *restrict g, float *restrict s0, float *restrict s1,
                       int64_t d, const double *hp, double step_size) {
    /* The complements in double, as torch's alpha/value arguments get them. */
    float lr = (float)hp[0], eps = (float)hp[1], b1 = (float)hp[2], b2 = (float)hp[3];
    float c1 = (float)(1.0 - hp[2]), c2 = (float)(1.0 - hp[3]);
    switch (kind) {
    case SGD:
        for (int64_t k = 0; k < d; k++) w[k] += g[k] * -lr;
        break;
    case ADAGRAD:
        for (int64_t k = 0; k < d; k++) {
            s0[k] += g[k] * g[k];
            w[k] += g[k] / (sqrtf(s0[k]) + eps) * -lr;
        }
        break;
    case ROWWISE_ADAGRAD: {
        float sq = 0.f;
        for (int64_t k = 0; k < d; k++) sq += g[k] * g[k];
        *s0 += sq / (float)d;
        float denom = sqrtf(*s0) + eps;
        for (int64_t k = 0; k < d; k++) w[k] += g[k] / denom * -lr;
        break;
    }
    case ADAM: {
        float step = (float)step_size;
        for (int64_t k = 0; k < d; k++) {
            s0[k] = s0[k] * b1 + g[k] * c1;
            s1[k] = s1[k] * b2 + g[k] * g[k] * c2;
            w[k] += s0[k] / (sqrtf(s1[k]) + eps) * -step;
        }
        break;
    }
    }
}

/* ``scratch``: float [sum N_t * D_t] for the summed gradients, int64 [sum N_t] for the touched rows, and int32
 * [sum rows_t] of zeros mapping a row to 1 + its place among the touched rows (left zero again on return):
 * buffers the caller keeps across steps, since fresh ones would be faulted in page by page every step. */
void geb_optimizer_step(int64_t T, const int64_t *meta, int64_t B, const float *grad, int64_t grad_stride, int kind,
                        const double *hyper, const int64_t *state, const double *step_size, float *sums_all,
                        int64_t *touched_all, int32_t *slots_all, int64_t *err, int threads) {
    memset(err, 0, T * sizeof *err);
    int64_t *at = malloc(3 * (T + 1) * sizeof(int64_t)); /* each table's place in the three scratch buffers */
    at[0] = at[T + 1] = at[2 * (T + 1)] = 0;
    for (int64_t ti = 0; ti < T; ti++) {
        const int64_t *m = meta + ti * META;
        at[ti + 1] = at[ti] + m[N_IDS] * m[DIM];
        at[T + 1 + ti + 1] = at[T + 1 + ti] + m[N_IDS];
        at[2 * (T + 1) + ti + 1] = at[2 * (T + 1) + ti] + m[ROWS];
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t ti = 0; ti < T; ti++) {
        table_t t = table_of(meta + ti * META);
        if (t.n == 0) continue;
        if (!offsets_ok(&t)) {
            err[ti] |= ERR_OFFSETS;
            continue;
        }
        float *sums = sums_all + at[ti];
        int64_t *touched = touched_all + at[T + 1 + ti];
        int32_t *slot = slots_all + at[2 * (T + 1) + ti];
        int64_t count = 0;
        FOR_EACH_ID(t, grad, grad_stride, B, err + ti, {
            if (slot[row] == 0) {
                touched[count] = row;
                slot[row] = (int32_t)++count;
                memset(sums + (count - 1) * t.dim, 0, t.dim * sizeof(float));
            }
            float *o = sums + (slot[row] - 1) * t.dim;
            if (scale == 1.f) add(o, g, t.dim);
            else for (int64_t k = 0; k < t.dim; k++) o[k] += g[k] * scale;
        });
        float *s0 = (float *)state[2 * ti], *s1 = (float *)state[2 * ti + 1];
        int64_t state_dim = kind == ROWWISE_ADAGRAD ? 1 : t.dim;
        for (int64_t i = 0; i < count; i++) {
            int64_t row = touched[i];
            update_row(kind, (float *)t.w + row * t.stride, sums + i * t.dim, s0 ? s0 + row * state_dim : NULL,
                       s1 ? s1 + row * state_dim : NULL, t.dim, hyper, step_size[ti]);
            slot[row] = 0;
        }
    }
    free(at);
}

#pragma GCC pop_options
