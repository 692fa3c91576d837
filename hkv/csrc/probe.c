/* CPU kernels of hkv.HashTable: probe the bucketed key array (the layout of hkv/table.py).
 *
 * A key hashes (fmix64) to bucket (h & (num_buckets - 1)) and home position ((h >> 40) & (B - 1));
 * it sits at the first slot of the linear probe from its home (wrapping in the bucket) holding it,
 * and the probe stops at an EMPTY slot. Loops over keys are split over ``threads`` pthreads (not
 * OpenMP: a second OpenMP runtime next to torch's leaves spinning workers that slow every torch op).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64
#define GRAIN 16384 /* keys per thread at least */

typedef void (*range_fn)(void *args, int64_t begin, int64_t end);

struct range_task {
    range_fn fn;
    void *args;
    int64_t begin, end;
};

static void *run_range(void *p) {
    struct range_task *t = (struct range_task *)p;
    t->fn(t->args, t->begin, t->end);
    return NULL;
}

/* fn(args, begin, end) over [0, n) in up to ``threads`` contiguous chunks; the caller runs the first. */
static void parallel_for(int64_t n, int threads, range_fn fn, void *args) {
    int64_t chunks = n / GRAIN;
    if (chunks > threads) chunks = threads;
    if (chunks > MAX_THREADS) chunks = MAX_THREADS;
    if (chunks <= 1) {
        fn(args, 0, n);
        return;
    }
    struct range_task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t c = 0; c < chunks; ++c) {
        tasks[c] = (struct range_task){fn, args, n * c / chunks, n * (c + 1) / chunks};
        if (c > 0) started[c] = pthread_create(&ids[c], NULL, run_range, &tasks[c]) == 0;
    }
    run_range(&tasks[0]);
    for (int64_t c = 1; c < chunks; ++c) {
        if (started[c])
            pthread_join(ids[c], NULL);
        else
            run_range(&tasks[c]);
    }
}

#define EMPTY_KEY ((int64_t)-1)
#define RECLAIM_KEY ((int64_t)-2)

static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
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
    int64_t row_bytes;
    const int64_t *keys, *scores;
    char *out;
    uint8_t *found;
    int64_t *slots;
};

static void locate_range(void *p, int64_t begin, int64_t end) {
    struct probe_args *a = (struct probe_args *)p;
    for (int64_t i = begin; i < end; ++i) a->slots[i] = probe(a->table_keys, a->num_buckets, a->bucket_size, a->keys[i]);
}

/* slots[i]: the slot holding keys[i], or -1. */
void hkv_locate(int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, const int64_t *keys, int64_t n,
                int64_t *slots, int threads) {
    struct probe_args a = {table_keys, NULL, num_buckets, bucket_size, NULL, 0, keys, NULL, NULL, NULL, slots};
    parallel_for(n, threads, locate_range, &a);
}

static void find_range(void *p, int64_t begin, int64_t end) {
    struct probe_args *a = (struct probe_args *)p;
    for (int64_t i = begin; i < end; ++i) {
        int64_t s = probe(a->table_keys, a->num_buckets, a->bucket_size, a->keys[i]);
        a->slots[i] = s;
        a->found[i] = s >= 0;
        if (s >= 0)
            memcpy(a->out + i * a->row_bytes, a->values + s * a->row_bytes, (size_t)a->row_bytes);
        else
            memset(a->out + i * a->row_bytes, 0, (size_t)a->row_bytes);
    }
}

/* out[i] = values[slot of keys[i]] (row_bytes each), zero where absent; found[i] = present. */
void hkv_find(int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, const char *values, int64_t row_bytes,
              const int64_t *keys, int64_t n, char *out, uint8_t *found, int64_t *slots, int threads) {
    struct probe_args a = {table_keys, NULL, num_buckets, bucket_size, values, row_bytes, keys, NULL, out, found, slots};
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
    struct probe_args a = {table_keys, table_scores, num_buckets, bucket_size, NULL, 0, keys, scores, NULL, NULL, slots};
    parallel_for(n, threads, claim_range, &a);
}
