/* CPU kernels of recompile::grouped_embedding_bag (runtime/embedding_native.py): every table of a group
 * in one call, tables read in place through their data pointers (never packed).
 *
 * A group is described by ``meta``, an int64 [T, META] array (one row per table, columns below); ids
 * and offsets are int32 or int64, tables fp32, fp16 or bf16 (FLAGS: one element type for the tables, the
 * sample weights, the output and its gradient; sums are accumulated in fp32). Bag b of table t holds ids [start, end): with offsets,
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

enum { W_PTR, ROWS, DIM, W_STRIDE, IDS, N_IDS, OFFS, N_OFFS, PSW, POOLING, PAD, OUT_AT, FLAGS, META };
enum { SUM, MEAN, NONE };
enum { IDS_I64 = 1, OFFS_I64 = 2, LAST_OFFSET = 4, DTYPE_SHIFT = 3 };
enum { F32, F16, BF16 }; /* element types (FLAGS >> DTYPE_SHIFT) */
enum { ERR_OFFSETS = 1, ERR_IDS = 2 };
enum { SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM };

typedef struct {
    const void *w;
    int64_t rows, dim, stride, n, n_offs, pad, at, pooling;
    const void *ids, *offs, *psw;
    int ids64, offs64, last, dt;
} table_t;

static table_t table_of(const int64_t *m) {
    table_t t = {(const void *)m[W_PTR], m[ROWS], m[DIM], m[W_STRIDE], m[N_IDS], m[N_OFFS], m[PAD], m[OUT_AT],
                 m[POOLING], (const void *)m[IDS], (const void *)m[OFFS], (const void *)m[PSW],
                 (m[FLAGS] & IDS_I64) != 0, (m[FLAGS] & OFFS_I64) != 0, (m[FLAGS] & LAST_OFFSET) != 0,
                 (int)(m[FLAGS] >> DTYPE_SHIFT)};
    return t;
}

static const size_t ELEMENT_SIZE[] = {4, 2, 2};

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* Element i of an array of element type dt, as fp32; and its store (rounded to nearest even). */
static inline __attribute__((always_inline)) float load1(const void *p, int64_t i, int dt) {
    if (dt == F16) return (float)((const _Float16 *)p)[i];
    if (dt == BF16) return bf16_to_float(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store1(void *p, int64_t i, float v, int dt) {
    if (dt == F16) ((_Float16 *)p)[i] = (_Float16)v;
    else if (dt == BF16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
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

/* An id's sample weight (1 without). */
static inline __attribute__((always_inline)) float sample_weight(const table_t *t, int64_t j, int dt) {
    return t->psw ? load1(t->psw, j, dt) : 1.f;
}

/* Each id's factor in its bag's pooled row: 1, its sample weight, 0 for padding. */
static inline float id_scale(const table_t *t, int64_t j, int64_t row) {
    return row == t->pad ? 0.f : sample_weight(t, j, t->dt);
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

/* The n (<= LANES) elements from element i as fp32, the rest zero; and their store: one masked load or store of fp32
 * where the instruction set has masks (a pooled bag's columns past the last full block: RecBole's token sequence
 * fields, D = 8, pool in one vector instead of a scalar loop over the runtime width). */
static inline __attribute__((always_inline)) v16 load_n(const void *p, int64_t i, int n, int dt) {
#if RECOMPILE_AVX512
    if (dt == F32) return (v16)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), (const float *)p + i);
#endif
    v16 v = {0};
    for (int k = 0; k < n; k++) v[k] = load1(p, i + k, dt);
    return v;
}

static inline __attribute__((always_inline)) void store_n(void *p, int64_t i, v16 v, int n, int dt) {
#if RECOMPILE_AVX512
    if (dt == F32) {
        _mm512_mask_storeu_ps((float *)p + i, (__mmask16)((1u << n) - 1), (__m512)v);
        return;
    }
#endif
    for (int k = 0; k < n; k++) store1(p, i + k, v[k], dt);
}

/* 16 consecutive elements of type dt from element i, as fp32 (fp32: one unaligned load). */
static inline __attribute__((always_inline)) v16 load16(const void *p, int64_t i, int dt) {
    if (dt == F32) return *(const v16 *)((const float *)p + i);
    v16 v;
    for (int k = 0; k < LANES; k++) v[k] = load1(p, i + k, dt);
    return v;
}

static inline __attribute__((always_inline)) void store16(void *p, int64_t i, v16 v, int dt) {
    if (dt == F32) {
        *(v16 *)((float *)p + i) = v;
        return;
    }
    for (int k = 0; k < LANES; k++) store1(p, i + k, v[k], dt);
}

#if RECOMPILE_AVX512
static inline void stream16(float *f, v16 v) { _mm512_stream_ps(f, (__m512)v); } /* f 64-byte aligned */
#elif RECOMPILE_AVX2
static inline void stream16(float *f, v16 v) {
    __m256 h[2];
    memcpy(h, &v, sizeof h);
    _mm256_stream_ps(f, h[0]);
    _mm256_stream_ps(f + 8, h[1]);
}
#endif

/* Prefetch the first cache lines of id j's row (a prefetch never faults, a bad id is harmless here). */
static inline void prefetch_row(const char *w, int64_t row_bytes, int64_t bytes, const void *ids, int ids64,
                                int64_t n, int64_t j) {
    if (j >= n) return;
    const char *row = w + at(ids, j, ids64) * row_bytes;
    for (int64_t k = 0; k < bytes && k < 512; k += 64) __builtin_prefetch(row + k);
}

/* out[o:o + BLOCK] = sum over the bag's ids of scale * row[c:c + BLOCK] (over ``divisor``), accumulated in fp32
 * registers; ``stream``: written past the caches (fp32). ``dt`` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void pool_block(const table_t *t, int64_t start, int64_t end, int64_t c,
                                                            float divisor, void *out, int64_t o, int64_t *err,
                                                            int stream, int dt) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    const void *w = t->w, *ids = t->ids;
    const int64_t stride = t->stride, n = t->n, pad = t->pad, size = ELEMENT_SIZE[dt];
    const int ids64 = t->ids64;
    for (int64_t j = start; j < end; j++) {
        if (c == 0) prefetch_row((const char *)w, stride * size, t->dim * size, ids, ids64, n, j + PREFETCH);
        int64_t row = row_of(t, j, err);
        if (row == pad) continue;
        int64_t r = row * stride + c;
        float s = sample_weight(t, j, dt);
        a0 += s * load16(w, r, dt);
        a1 += s * load16(w, r + LANES, dt);
        a2 += s * load16(w, r + 2 * LANES, dt);
        a3 += s * load16(w, r + 3 * LANES, dt);
    }
    if (divisor != 1.f) {
        a0 /= divisor;
        a1 /= divisor;
        a2 /= divisor;
        a3 /= divisor;
    }
#if RECOMPILE_AVX512 || RECOMPILE_AVX2
    float *f = (float *)out + o;
    if (dt == F32 && stream && ((uintptr_t)f & 63) == 0) { /* an output larger than the caches: no read for ownership */
        stream16(f, a0);
        stream16(f + LANES, a1);
        stream16(f + 2 * LANES, a2);
        stream16(f + 3 * LANES, a3);
        return;
    }
#else
    (void)stream;
#endif
    store16(out, o, a0, dt);
    store16(out, o + LANES, a1, dt);
    store16(out, o + 2 * LANES, a2, dt);
    store16(out, o + 3 * LANES, a3, dt);
}

/* Columns past the last full block (fewer than BLOCK), accumulated in fp32, LANES at a time. */
static void pool_tail(const table_t *t, int64_t start, int64_t end, int64_t c, float divisor, void *out, int64_t o,
                      int64_t *err) {
    for (; c < t->dim; c += LANES, o += LANES) {
        const int n = t->dim - c < LANES ? (int)(t->dim - c) : LANES;
        v16 acc = {0};
        for (int64_t j = start; j < end; j++) {
            int64_t row = row_of(t, j, err);
            if (row == t->pad) continue;
            acc += sample_weight(t, j, t->dt) * load_n(t->w, row * t->stride + c, n, t->dt);
        }
        store_n(out, o, acc / divisor, n, t->dt);
    }
}

/* Bags [first, last) of table t, bag b into out[b * out_stride + OUT_AT:][:D]; ``dt`` a constant where this is
 * inlined (one specialisation per element type). */
static inline __attribute__((always_inline)) void pool_bags(const table_t *t, int64_t first, int64_t last, void *out,
                                                           int64_t out_stride, int64_t *err, int stream, int dt) {
    if (t->offs == NULL && t->n_offs == 1) { /* bags of one id (a field's lookup): its row times its weight */
        const int64_t size = ELEMENT_SIZE[dt];
        for (int64_t b = first; b < last; b++) {
            prefetch_row((const char *)t->w, t->stride * size, t->dim * size, t->ids, t->ids64, t->n, b + PREFETCH);
            int64_t row = row_of(t, b, err), o = b * out_stride + t->at, r = row * t->stride;
            float s = sample_weight(t, b, dt);
            for (int64_t k = 0; k < t->dim; k++) store1(out, o + k, row == t->pad ? 0.f : s * load1(t->w, r + k, dt), dt);
        }
        return;
    }
    for (int64_t b = first; b < last; b++) {
        int64_t start = 0, end = 0, c = 0, o = b * out_stride + t->at;
        if (!(*err & ERR_OFFSETS)) bag_range(t, b, &start, &end);
        float divisor = bag_divisor(t, start, end, err);
        for (; c + BLOCK <= t->dim; c += BLOCK) pool_block(t, start, end, c, divisor, out, o + c, err, stream, dt);
        if (c < t->dim) pool_tail(t, start, end, c, divisor, out, o + c, err);
    }
}

/* The pooled forwards' driver (this one's and quantized.h's): table t's offsets checked (bad ones mark ERR_OFFSETS),
 * then ``pool(t, first, last, err + t)`` for each work item, a tile of TILE bags of one table, table-major: a
 * table's rows stay in the caches while its bags are pooled (tile-major ordering reads all tables at once and is
 * ~1.3x slower at batch 2048). ``out_bytes``: the output's size, streamed when ``stream``. */
template <class Pool>
static inline void forward_pooled(int64_t T, const int64_t *meta, int64_t B, void *out, size_t out_bytes,
                                  int64_t *err, int stream, int threads, Pool pool) {
    memset(err, 0, T * sizeof *err);
    if (stream) advise_huge(out, out_bytes);
#pragma omp parallel num_threads(threads) if (threads > 1) /* one thread: no team to start */
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            table_t tab = table_of(meta + t * META);
            if (!offsets_ok(&tab)) err[t] |= ERR_OFFSETS;
        }
        int64_t tiles = (B + TILE - 1) / TILE;
#pragma omp for schedule(dynamic, 1) /* a descheduled thread (a busy machine) holds up one work item only */
        for (int64_t w = 0; w < tiles * T; w++) {
            int64_t ti = w / tiles, first = w % tiles * TILE, last = first + TILE < B ? first + TILE : B;
            table_t t = table_of(meta + ti * META);
            pool(&t, first, last, err + ti);
        }
#if RECOMPILE_AVX512 || RECOMPILE_AVX2
        _mm_sfence(); /* the streamed rows are visible before the region ends */
#endif
    }
}

/* Pooled forward: out[b, OUT_AT + k] (row stride ``out_stride`` elements) = the pooled row of table t's bag b. */
void geb_forward_pooled(int64_t T, const int64_t *meta, int64_t B, void *out, int64_t out_stride, int64_t *err,
                        int stream, int threads) {
    forward_pooled(T, meta, B, out, B * out_stride * ELEMENT_SIZE[table_of(meta).dt], err, stream, threads,
                   [=](const table_t *t, int64_t first, int64_t last, int64_t *e) {
                       if (t->dt == F16) pool_bags(t, first, last, out, out_stride, e, stream, F16);
                       else if (t->dt == BF16) pool_bags(t, first, last, out, out_stride, e, stream, BF16);
                       else pool_bags(t, first, last, out, out_stride, e, stream, F32);
                   });
}

/* Unpooled forward ("sequence" layout): out[OUT_AT + j] = table t's row of id j. */
void geb_forward_sequence(int64_t T, const int64_t *meta, void *out, int64_t out_stride, int64_t *err, int threads) {
    memset(err, 0, T * sizeof *err);
#pragma omp parallel num_threads(threads)
    for (int64_t ti = 0; ti < T; ti++) {
        table_t t = table_of(meta + ti * META);
        size_t size = ELEMENT_SIZE[t.dt];
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < t.n; j++)
            memcpy((char *)out + (t.at + j) * out_stride * size,
                   (const char *)t.w + row_of(&t, j, err + ti) * t.stride * size, t.dim * size);
    }
}

/* Where the gradient of the output row that bag b (pooled) or id j (sequence) of table t wrote starts (elements). */
static inline int64_t grad_at(const table_t *t, int64_t grad_stride, int64_t b) {
    return t->pooling == NONE ? (t->at + b) * grad_stride : b * grad_stride + t->at;
}

/* The gradient rows of later bags are a strided walk through a gradient larger than the caches: fetched ahead. */
#define GRAD_AHEAD 8
#define ROWS_AHEAD 8 /* touched rows the optimizer step fetches ahead */

static inline void prefetch_grad(const void *grad, int64_t g, int64_t dim, int dt) {
    const char *row = (const char *)grad + g * (int64_t)ELEMENT_SIZE[dt];
    for (int64_t k = 0; k < dim * (int64_t)ELEMENT_SIZE[dt]; k += 64) __builtin_prefetch(row + k);
}

/* Runs BODY for every id j of table t, with ``row`` its row, ``g`` where the gradient of the output it went into
 * starts (elements), ``scale`` its factor there (0 for padding). Bags are walked in order, so each row's
 * contributions add up in id order. */
#define FOR_EACH_ID(t, grad, grad_stride, B, err, BODY)                                         \
    do {                                                                                         \
        int64_t bags_ = (t).pooling == NONE ? (t).n : (B);                                       \
        for (int64_t b_ = 0; b_ < bags_; b_++) {                                                 \
            int64_t start_ = b_, end_ = b_ + 1;                                                  \
            if ((t).pooling != NONE) bag_range(&(t), b_, &start_, &end_);                        \
            float divisor_ = bag_divisor(&(t), start_, end_, (err));                             \
            int64_t g = grad_at(&(t), (grad_stride), b_);                                        \
            if (b_ + GRAD_AHEAD < bags_)                                                         \
                prefetch_grad((grad), grad_at(&(t), (grad_stride), b_ + GRAD_AHEAD), (t).dim, (t).dt); \
            for (int64_t j = start_; j < end_; j++) {                                            \
                int64_t row = row_of(&(t), j, (err));                                            \
                float scale = id_scale(&(t), j, row);                                            \
                if (divisor_ != 1.f) scale /= divisor_;                                          \
                BODY                                                                             \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* out[o:o + d] (+)= scale * grad[g:g + d] in fp32 (``accumulate``: added to what is there), out of type odt, grad of
 * type dt. */
static void scaled_row(void *out, int64_t o, const void *grad, int64_t g, float scale, int64_t d, int accumulate,
                       int odt, int dt) {
    if (odt == F32 && dt == F32) {
        float *restrict y = (float *)out + o;
        const float *restrict x = (const float *)grad + g;
        if (!accumulate) memset(y, 0, d * sizeof(float));
        if (scale == 1.f) add(y, x, d);
        else axpy(y, x, scale, d);
        return;
    }
    for (int64_t k = 0; k < d; k++)
        store1(out, o + k, (accumulate ? load1(out, o + k, odt) : 0.f) + scale * load1(grad, g + k, dt), odt);
}

/* The dense gradient of a table whose bags are one id each (a field's lookup): every id's gradient row times its
 * factor added to its row of out (type odt), in id order, as FOR_EACH_ID adds them without its per-bag work; ``dt``
 * (the gradient's and the sample weights' type) a constant where this is inlined. */
static inline __attribute__((always_inline)) void add_id_rows(const table_t *t, void *out, int odt, const void *grad,
                                                             int64_t grad_stride, int64_t *err, int dt) {
    for (int64_t j = 0; j < t->n; j++) {
        int64_t row = row_of(t, j, err), o = row * t->dim, g = j * grad_stride + t->at;
        float scale = row == t->pad ? 0.f : sample_weight(t, j, dt);
        if (scale == 0.f) continue;
        for (int64_t k = 0; k < t->dim; k++)
            store1(out, o + k, load1(out, o + k, odt) + scale * load1(grad, g + k, dt), odt);
    }
}

/* Backward: per table, the dense gradient [rows, D] (dense[t] != 0), else the gradient of every id's row
 * [N, D]; and where psw_out[t] != 0, the gradient of every per-sample weight (dot(g, row), 0 for padding).
 * Gradients have the tables' element type; products are summed in fp32. */
void geb_backward(int64_t T, const int64_t *meta, int64_t B, const void *grad, int64_t grad_stride,
                  const int64_t *table_out, const int64_t *dense, const int64_t *psw_out, int64_t *err, int threads) {
    memset(err, 0, T * sizeof *err);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t ti = 0; ti < T; ti++) {
        table_t t = table_of(meta + ti * META);
        void *out = (void *)table_out[ti], *dpsw = (void *)psw_out[ti];
        if (dense[ti]) {
            size_t bytes = t.rows * t.dim * ELEMENT_SIZE[t.dt];
            advise_huge(out, bytes);
            memset(out, 0, bytes);
        }
        if (!offsets_ok(&t)) {
            err[ti] |= ERR_OFFSETS;
            continue;
        }
        /* A half-precision table's dense gradient is summed in fp32 and rounded once (where rounding every add
         * loses a few percent on a row many ids touch); in place, rounding every add, if that memory is short. */
        float *acc = dense[ti] && t.dt != F32 ? (float *)calloc((size_t)(t.rows * t.dim), sizeof(float)) : NULL;
        void *sum = acc ? (void *)acc : out;
        int sdt = acc ? F32 : t.dt;
        if (t.offs == NULL && t.n_offs == 1 && t.pooling != NONE && dense[ti] && !dpsw) {
            if (t.dt == F16) add_id_rows(&t, sum, sdt, grad, grad_stride, err + ti, F16);
            else if (t.dt == BF16) add_id_rows(&t, sum, sdt, grad, grad_stride, err + ti, BF16);
            else add_id_rows(&t, sum, sdt, grad, grad_stride, err + ti, F32);
        } else {
            FOR_EACH_ID(t, grad, grad_stride, B, err + ti, {
                if (!dense[ti]) scaled_row(out, j * t.dim, grad, g, scale, t.dim, 0, t.dt, t.dt);
                else if (scale != 0.f) scaled_row(sum, row * t.dim, grad, g, scale, t.dim, 1, sdt, t.dt);
                if (dpsw) {
                    float dot = 0.f;
                    for (int64_t k = 0; k < t.dim; k++)
                        dot += load1(grad, g + k, t.dt) * load1(t.w, row * t.stride + k, t.dt);
                    store1(dpsw, j, row == t.pad ? 0.f : dot, t.dt);
                }
            });
        }
        if (acc) {
            for (int64_t i = 0; i < t.rows * t.dim; i++) store1(out, i, acc[i], t.dt);
            free(acc);
        }
    }
}

/* Fused optimizer step (runtime/embedding_optimizer.py has the formulas): per table, the ids' gradients summed
 * per touched row (in id order; a padding id touches its row with a zero gradient), then each touched row
 * updated in place; fp32 tables (the others step in runtime/embedding_optimizer.py's torch kernels). ``state`` is
 * int64 [T, 2] of fp32 state pointers (Adagrad: sum [rows, D] or [rows];
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
    int64_t *at = (int64_t *)malloc(3 * (T + 1) * sizeof(int64_t)); /* each table's place in the three scratch buffers */
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
            const float *gr = grad + g;
            if (slot[row] == 0) {
                touched[count] = row;
                slot[row] = (int32_t)++count;
                memset(sums + (count - 1) * t.dim, 0, t.dim * sizeof(float));
            }
            float *o = sums + (slot[row] - 1) * t.dim;
            if (scale == 1.f) add(o, gr, t.dim);
            else for (int64_t k = 0; k < t.dim; k++) o[k] += gr[k] * scale;
        });
        float *s0 = (float *)state[2 * ti], *s1 = (float *)state[2 * ti + 1];
        int64_t state_dim = kind == ROWWISE_ADAGRAD ? 1 : t.dim;
        for (int64_t i = 0; i < count; i++) {
            int64_t row = touched[i];
            if (i + ROWS_AHEAD < count) { /* the touched rows are scattered over the table: fetched ahead */
                int64_t next = touched[i + ROWS_AHEAD];
                for (int64_t k = 0; k < t.dim; k += LANES) __builtin_prefetch((const float *)t.w + next * t.stride + k, 1);
                for (int64_t k = 0; s0 && k < state_dim; k += LANES) __builtin_prefetch(s0 + next * state_dim + k, 1);
                for (int64_t k = 0; s1 && k < state_dim; k += LANES) __builtin_prefetch(s1 + next * state_dim + k, 1);
            }
            update_row(kind, (float *)t.w + row * t.stride, sums + i * t.dim, s0 ? s0 + row * state_dim : NULL,
                       s1 ? s1 + row * state_dim : NULL, t.dim, hyper, step_size[ti]);
            slot[row] = 0;
        }
    }
    free(at);
}

#pragma GCC pop_options
