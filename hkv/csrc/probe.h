/* CPU kernels of hkv.HashTable: probe the bucketed key array (the layout of hkv/table.py).
 *
 * A key hashes (fmix64) to bucket (h & (num_buckets - 1)) and home position ((h >> 40) & (B - 1));
 * it sits at the first slot of the linear probe from its home (wrapping in the bucket) holding it,
 * and the probe stops at an EMPTY slot. Loops over keys are split over ``threads`` pthreads (not
 * OpenMP: a second OpenMP runtime next to torch's leaves spinning workers that slow every torch op).
 *
 * ``hkv_upsert`` does a whole insert_or_assign / find_or_insert / assign in one pass: probe, claim a
 * free slot for a new key, update the score by strategy, write the value row (or copy the stored one
 * out). Threads own disjoint ranges of buckets, so every bucket is changed by one thread, in batch
 * order: duplicates in a batch behave as if the batch were applied key by key.
 * ``hkv_unique`` deduplicates ids with an open-addressing set (first-occurrence order, O(n)) and can
 * order the unique ids by table bucket: the host-side half of a partially offloaded lookup.
 * ``hkv_pool_backward`` sums pooled gradients per unique row (the backward of hkv.ops.pool).
 * Rows read out (``hkv_find``, ``hkv_upsert``'s copy-out) go through ``read_row``: copied as stored, or, for a
 * table of row-wise quantized rows (hkv/rowwise.py), dequantized into fp32 on the way (dequantize.h: AVX-512,
 * AVX2 or portable loops).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64
#define GRAIN 16384 /* keys per thread at least */

typedef void (*team_fn)(void *args, int64_t t, int64_t T);

struct team_task {
    team_fn fn;
    void *args;
    int64_t t, T;
};

static void *run_member(void *p) {
    struct team_task *task = (struct team_task *)p;
    task->fn(task->args, task->t, task->T);
    return NULL;
}

/* fn(args, t, T) for t in [0, T) on T threads; the caller runs t = 0 (and any thread that failed to start). */
static void run_team(int64_t T, team_fn fn, void *args) {
    struct team_task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < T; ++t) {
        tasks[t] = (struct team_task){fn, args, t, T};
        if (t > 0) started[t] = pthread_create(&ids[t], NULL, run_member, &tasks[t]) == 0;
    }
    run_member(&tasks[0]);
    for (int64_t t = 1; t < T; ++t) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_member(&tasks[t]);
    }
}

/* Threads for n keys: at most ``threads``, each with GRAIN keys at least. */
static int64_t team_size(int64_t n, int threads) {
    int64_t T = n / GRAIN;
    if (T > threads) T = threads;
    if (T > MAX_THREADS) T = MAX_THREADS;
    return T < 1 ? 1 : T;
}

typedef void (*range_fn)(void *args, int64_t begin, int64_t end);

struct range_args {
    range_fn fn;
    void *args;
    int64_t n;
};

static void run_chunk(void *p, int64_t t, int64_t T) {
    struct range_args *r = (struct range_args *)p;
    r->fn(r->args, r->n * t / T, r->n * (t + 1) / T);
}

/* fn(args, begin, end) over [0, n) in contiguous chunks, one per thread. */
static void parallel_for(int64_t n, int threads, range_fn fn, void *args) {
    struct range_args r = {fn, args, n};
    run_team(team_size(n, threads), run_chunk, &r);
}

#define EMPTY_KEY ((int64_t)-1)
#define RECLAIM_KEY ((int64_t)-2)

#include "dequantize.h"

/* How a stored row is read out (hkv.cpu.ROW_FORMATS): ROW_RAW copied as it is; ROW_INT8 / ROW_INT4 packed in
 * FBGEMM's fused layouts (hkv/rowwise.py) and written as ``dim`` fp32 values by ``dequantize`` (dequantize.h: the
 * instruction set's path, chosen once per call). */
enum { ROW_RAW = 0, ROW_INT8 = 1, ROW_INT4 = 2 };

struct row_format {
    int kind;
    int64_t stored_bytes, out_bytes, dim; /* out_bytes: stored_bytes (raw) or 4 * dim */
    dequantize_fn dequantize;             /* NULL for ROW_RAW */
};

static inline void read_row(const struct row_format *f, char *dst, const char *src) {
    if (f->kind == ROW_RAW)
        memcpy(dst, src, (size_t)f->stored_bytes);
    else
        f->dequantize((const uint8_t *)src, f->dim, (float *)dst);
}

static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

/* Keys ahead of the current one whose home slot is prefetched: probes of a batch miss the cache
 * independently, so their loads can overlap. */
#define PREFETCH_AHEAD 8

static inline int64_t home_slot(int64_t num_buckets, int64_t bucket_size, int64_t key) {
    uint64_t h = mix64((uint64_t)key);
    return (int64_t)(h & (uint64_t)(num_buckets - 1)) * bucket_size + ((int64_t)(h >> 40) & (bucket_size - 1));
}

static inline void prefetch_home(const int64_t *table_keys, int64_t num_buckets, int64_t bucket_size,
                                 const int64_t *keys, int64_t i, int64_t end) {
    if (i + PREFETCH_AHEAD < end)
        __builtin_prefetch(table_keys + home_slot(num_buckets, bucket_size, keys[i + PREFETCH_AHEAD]));
}

static inline int64_t probe(const int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, int64_t key) {
    uint64_t h = mix64((uint64_t)key);
    const int64_t *bucket = table_keys + (int64_t)(h & (uint64_t)(num_buckets - 1)) * bucket_size;
    int64_t pos = (int64_t)(h >> 40) & (bucket_size - 1);
    for (int64_t r = 0; r < bucket_size; ++r) {
        int64_t p = (pos + r) & (bucket_size - 1);
        int64_t k = bucket[p];
        if (k == key) return (bucket - table_keys) + p;
        if (k == EMPTY_KEY) return -1;
    }
    return -1;
}

struct probe_args {
    int64_t *table_keys, *table_scores;
    int64_t num_buckets, bucket_size;
    const char *values;
    struct row_format fmt;
    const int64_t *keys, *scores;
    char *out;
    uint8_t *found;
    int64_t *slots;
};

static void locate_range(void *p, int64_t begin, int64_t end) {
    struct probe_args *a = (struct probe_args *)p;
    for (int64_t i = begin; i < end; ++i) {
        prefetch_home(a->table_keys, a->num_buckets, a->bucket_size, a->keys, i, end);
        a->slots[i] = probe(a->table_keys, a->num_buckets, a->bucket_size, a->keys[i]);
    }
}

/* slots[i]: the slot holding keys[i], or -1. */
void hkv_locate(int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, const int64_t *keys, int64_t n,
                int64_t *slots, int threads) {
    struct probe_args a = {table_keys, NULL, num_buckets, bucket_size, NULL, {}, keys, NULL, NULL, NULL, slots};
    parallel_for(n, threads, locate_range, &a);
}

static void find_range(void *p, int64_t begin, int64_t end) {
    struct probe_args *a = (struct probe_args *)p;
    for (int64_t i = begin; i < end; ++i) {
        prefetch_home(a->table_keys, a->num_buckets, a->bucket_size, a->keys, i, end);
        int64_t s = probe(a->table_keys, a->num_buckets, a->bucket_size, a->keys[i]);
        a->slots[i] = s;
        a->found[i] = s >= 0;
        char *dst = a->out + i * a->fmt.out_bytes;
        if (s >= 0)
            read_row(&a->fmt, dst, a->values + s * a->fmt.stored_bytes);
        else
            memset(dst, 0, (size_t)a->fmt.out_bytes);
    }
}

/* out[i] = values[slot of keys[i]] read out by ``fmt``, zero where absent; found[i] = present. */
void hkv_find(int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, const char *values,
              struct row_format fmt, const int64_t *keys, int64_t n, char *out, uint8_t *found, int64_t *slots,
              int threads) {
    struct probe_args a = {table_keys, NULL, num_buckets, bucket_size, values, fmt, keys, NULL, out, found, slots};
    parallel_for(n, threads, find_range, &a);
}

static void claim_range(void *p, int64_t begin, int64_t end) {
    struct probe_args *a = (struct probe_args *)p;
    int64_t B = a->bucket_size;
    for (int64_t i = begin; i < end; ++i) {
        uint64_t h = mix64((uint64_t)a->keys[i]);
        int64_t base = (int64_t)(h & (uint64_t)(a->num_buckets - 1)) * B;
        int64_t pos = (int64_t)(h >> 40) & (B - 1);
        int64_t slot = -1;
        for (int64_t r = 0; r < B && slot < 0; ++r) {
            int64_t s = base + ((pos + r) & (B - 1));
            int64_t cur = __atomic_load_n(&a->table_keys[s], __ATOMIC_RELAXED);
            while ((cur == EMPTY_KEY || cur == RECLAIM_KEY) && slot < 0)
                if (__atomic_compare_exchange_n(&a->table_keys[s], &cur, a->keys[i], 0, __ATOMIC_ACQ_REL,
                                                __ATOMIC_RELAXED))
                    slot = s;
        }
        if (slot >= 0) a->table_scores[slot] = a->scores[i];
        a->slots[i] = slot;
    }
}

/* Store new keys (unique, absent from the table): each takes the first free (EMPTY or erased) slot of
 * its probe, claimed by compare-and-swap so parallel claimers never share a slot; slots[i] = -1 when
 * the bucket is full (the caller evicts). */
void hkv_claim(int64_t *table_keys, int64_t *table_scores, int64_t num_buckets, int64_t bucket_size,
               const int64_t *keys, const int64_t *scores, int64_t n, int64_t *slots, int threads) {
    struct probe_args a = {table_keys, table_scores, num_buckets, bucket_size, NULL, {}, keys, scores, NULL, NULL,
                           slots};
    parallel_for(n, threads, claim_range, &a);
}

/* Score strategies (hkv.table.EvictStrategy) as the kernel numbers them. */
enum { SCORE_CLOCK = 0, SCORE_LFU = 1, SCORE_EPOCH_LFU = 2, SCORE_GIVEN = 3 };
/* Per-key outcome of hkv_upsert (hkv.cpu.Upsert). */
enum { UPSERT_FOUND, UPSERT_INSERTED, UPSERT_FULL, UPSERT_ABSENT, UPSERT_FOUND_NEW, UPSERT_OUTCOMES };
#define LOW32 0xFFFFFFFFLL

struct upsert_args {
    int64_t *table_keys, *table_scores;
    int64_t num_buckets, bucket_size;
    char *values;
    struct row_format fmt; /* in_values rows are stored_bytes each, out rows out_bytes */
    const int64_t *keys;
    int64_t n;
    const char *in_values; /* n rows to write, or NULL */
    const int64_t *given;  /* n score inputs */
    int strategy, insert;
    int64_t clock_score, epoch;
    char *out;     /* n rows: the stored row of found keys, or NULL */
    int grouped;   /* keys grouped by bucket: a thread takes a contiguous run of whole buckets */
    uint8_t *fresh; /* one byte per slot: claimed by this call */
    int64_t *slots;
    int8_t *status;
    int64_t *counts; /* keys per UPSERT_* outcome, summed over threads */
};

static inline int64_t new_score(const struct upsert_args *a, int64_t old, int64_t given, int existed) {
    switch (a->strategy) {
    case SCORE_CLOCK: return a->clock_score;
    case SCORE_LFU: return existed ? old + given : given;
    case SCORE_EPOCH_LFU: {
        int64_t freq = existed ? (old & LOW32) + given : given;
        return (a->epoch << 32) | (freq > LOW32 ? LOW32 : freq);
    }
    default: return given;
    }
}

static inline int64_t bucket_of(const struct upsert_args *a, int64_t i) {
    return (int64_t)(mix64((uint64_t)a->keys[i]) & (uint64_t)(a->num_buckets - 1));
}

static int8_t upsert_one(struct upsert_args *a, int64_t i, int64_t bucket) {
    int64_t B = a->bucket_size, key = a->keys[i];
    int64_t *bk = a->table_keys + bucket * B;
    int64_t pos = (int64_t)(mix64((uint64_t)key) >> 40) & (B - 1);
    int64_t free_slot = -1, slot = -1;
    for (int64_t r = 0; r < B; ++r) {
        int64_t p = (pos + r) & (B - 1), k = bk[p];
        if (k == key) {
            slot = bucket * B + p;
            break;
        }
        if ((k == RECLAIM_KEY || k == EMPTY_KEY) && free_slot < 0) free_slot = bucket * B + p;
        if (k == EMPTY_KEY) break;
    }
    int8_t status;
    if (slot >= 0) {
        status = a->fresh[slot] ? UPSERT_FOUND_NEW : UPSERT_FOUND;
        a->table_scores[slot] = new_score(a, a->table_scores[slot], a->given[i], 1);
    } else if (!a->insert) {
        status = UPSERT_ABSENT;
    } else if (free_slot < 0) {
        status = UPSERT_FULL;
    } else {
        slot = free_slot;
        status = UPSERT_INSERTED;
        a->table_keys[slot] = key;
        a->table_scores[slot] = new_score(a, 0, a->given[i], 0);
        a->fresh[slot] = 1;
    }
    a->slots[i] = slot;
    a->status[i] = status;
    int64_t rb = a->fmt.stored_bytes;
    if (slot >= 0 && a->in_values) memcpy(a->values + slot * rb, a->in_values + i * rb, (size_t)rb);
    if (a->out) {
        char *dst = a->out + i * a->fmt.out_bytes;
        if (status == UPSERT_FOUND)
            read_row(&a->fmt, dst, a->values + slot * rb);
        else
            memset(dst, 0, (size_t)a->fmt.out_bytes);
    }
    return status;
}

/* Thread t of T: keys grouped by bucket split into runs of whole buckets (each boundary moved forward
 * to the next bucket change); otherwise every thread scans all keys and takes those of its buckets. */
static void upsert_part(void *p, int64_t t, int64_t T) {
    struct upsert_args *a = (struct upsert_args *)p;
    int64_t counts[UPSERT_OUTCOMES] = {0};
    if (a->grouped) {
        int64_t begin = a->n * t / T, end = a->n * (t + 1) / T;
        while (begin > 0 && begin < a->n && bucket_of(a, begin) == bucket_of(a, begin - 1)) ++begin;
        while (end < a->n && end > 0 && bucket_of(a, end) == bucket_of(a, end - 1)) ++end;
        for (int64_t i = begin; i < end; ++i) {
            prefetch_home(a->table_keys, a->num_buckets, a->bucket_size, a->keys, i, end);
            ++counts[upsert_one(a, i, bucket_of(a, i))];
        }
    } else {
        int64_t lo = a->num_buckets * t / T, hi = a->num_buckets * (t + 1) / T;
        for (int64_t i = 0; i < a->n; ++i) {
            if (T == 1) prefetch_home(a->table_keys, a->num_buckets, a->bucket_size, a->keys, i, a->n);
            int64_t b = bucket_of(a, i);
            if (b >= lo && b < hi) ++counts[upsert_one(a, i, b)];
        }
    }
    for (int c = 0; c < UPSERT_OUTCOMES; ++c) __atomic_add_fetch(&a->counts[c], counts[c], __ATOMIC_RELAXED);
}

/* Insert or assign ``keys`` (``insert`` 0: assign only), writing ``in_values`` rows (or NULL, stored as they
 * are) and reading the stored rows of keys found out to ``out`` by ``fmt`` (or NULL); status[i]: UPSERT_*,
 * slots[i]: the slot or -1, counts[c]: keys with status c. ``fresh``: zeroed scratch of one byte per slot, zeroed
 * again on return. */
void hkv_upsert(int64_t *table_keys, int64_t *table_scores, int64_t num_buckets, int64_t bucket_size, char *values,
                struct row_format fmt, const int64_t *keys, int64_t n, const char *in_values, const int64_t *given,
                int strategy, int insert, int64_t clock_score, int64_t epoch, char *out, int grouped,
                uint8_t *fresh, int64_t *slots, int8_t *status, int64_t *counts, int threads) {
    struct upsert_args a = {table_keys, table_scores, num_buckets, bucket_size, values,  fmt,       keys,
                            n,          in_values,    given,       strategy,    insert,  clock_score,
                            epoch,      out,          grouped,     fresh,       slots,   status, counts};
    for (int c = 0; c < UPSERT_OUTCOMES; ++c) counts[c] = 0;
    for (int64_t i = 1; a.grouped && i < n; ++i) /* not grouped after all: threads would share buckets */
        if (bucket_of(&a, i) < bucket_of(&a, i - 1)) a.grouped = 0;
    run_team(team_size(n, threads), upsert_part, &a);
    if (counts[UPSERT_INSERTED])
        for (int64_t i = 0; i < n; ++i)
            if (status[i] == UPSERT_INSERTED) fresh[slots[i]] = 0;
}

/* Deduplicate ids[0..n): uniq (first-occurrence order, or grouped by bucket when num_buckets > 0:
 * ascending bucket h & (num_buckets - 1), first occurrence within one), inverse[i] = index of ids[i]
 * in uniq; returns the number of unique ids. ``work``: pow2(2n) + 2 * n + num_buckets + 1 int64s. */
int64_t hkv_unique(const int64_t *ids, int64_t n, int64_t num_buckets, int64_t *uniq, int64_t *inverse,
                   int64_t *work) {
    int64_t cap = 2;
    while (cap < 2 * n) cap <<= 1;
    int64_t *set = work, *first = work + cap, *rank = first + n;
    for (int64_t c = 0; c < cap; ++c) set[c] = -1;
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t key = ids[i];
        int64_t c = (int64_t)(mix64((uint64_t)key) & (uint64_t)(cap - 1));
        while (set[c] >= 0 && first[set[c]] != key) c = (c + 1) & (cap - 1);
        if (set[c] < 0) {
            set[c] = m;
            first[m++] = key;
        }
        inverse[i] = set[c];
    }
    if (num_buckets <= 0) {
        memcpy(uniq, first, (size_t)m * sizeof(int64_t));
        return m;
    }
    /* Counting sort of the unique ids by bucket (stable). */
    int64_t *count = rank + n;
    for (int64_t b = 0; b <= num_buckets; ++b) count[b] = 0;
    for (int64_t u = 0; u < m; ++u) ++count[(mix64((uint64_t)first[u]) & (uint64_t)(num_buckets - 1)) + 1];
    for (int64_t b = 0; b < num_buckets; ++b) count[b + 1] += count[b];
    for (int64_t u = 0; u < m; ++u) {
        int64_t b = (int64_t)(mix64((uint64_t)first[u]) & (uint64_t)(num_buckets - 1));
        rank[u] = count[b]++;
        uniq[rank[u]] = first[u];
    }
    for (int64_t i = 0; i < n; ++i) inverse[i] = rank[inverse[i]];
    return m;
}

/* The gradient of pooling unique rows into bags (hkv.ops.pool, float32): rows_grad[inverse[i]] +=
 * grad[bag of i] (divided by the bag's length for a mean), rows_grad zeroed first; offsets: bag starts. */
void hkv_pool_backward(const float *grad, const int64_t *offsets, int64_t num_bags, const int64_t *inverse,
                       int64_t n, int64_t dim, int mean, float *rows_grad, int64_t num_rows) {
    memset(rows_grad, 0, (size_t)(num_rows * dim) * sizeof(float));
    for (int64_t b = 0; b < num_bags; ++b) {
        int64_t begin = offsets[b], end = b + 1 < num_bags ? offsets[b + 1] : n;
        float scale = mean && end > begin ? 1.0f / (float)(end - begin) : 1.0f;
        const float *g = grad + b * dim;
        for (int64_t i = begin; i < end; ++i) {
            float *r = rows_grad + inverse[i] * dim;
            for (int64_t d = 0; d < dim; ++d) r[d] += scale * g[d];
        }
    }
}
