/* CPU kernels of hkv.HashTable: probe the bucketed key array (the layout of hkv/table.py).
 *
 * A key hashes (fmix64) to bucket (h & (num_buckets - 1)) and home position ((h >> 40) & (B - 1));
 * it sits at the first slot of the linear probe from its home (wrapping in the bucket) holding it,
 * and the probe stops at an EMPTY slot. Loops over keys run in parallel with OpenMP.
 */
#include <stdint.h>
#include <string.h>

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

/* slots[i]: the slot holding keys[i], or -1. */
void hkv_locate(const int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, const int64_t *keys, int64_t n,
                int64_t *slots) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) slots[i] = probe(table_keys, num_buckets, bucket_size, keys[i]);
}

/* out[i] = values[slot of keys[i]] (row_bytes each), zero where absent; found[i] = present. */
void hkv_find(const int64_t *table_keys, int64_t num_buckets, int64_t bucket_size, const char *values,
              int64_t row_bytes, const int64_t *keys, int64_t n, char *out, uint8_t *found, int64_t *slots) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        int64_t s = probe(table_keys, num_buckets, bucket_size, keys[i]);
        slots[i] = s;
        found[i] = s >= 0;
        if (s >= 0)
            memcpy(out + i * row_bytes, values + s * row_bytes, (size_t)row_bytes);
        else
            memset(out + i * row_bytes, 0, (size_t)row_bytes);
    }
}

/* Store new keys (unique, absent from the table): each takes the first free (EMPTY or erased) slot of
 * its probe, claimed by compare-and-swap so parallel claimers never share a slot; slots[i] = -1 when
 * the bucket is full (the caller evicts). */
void hkv_claim(int64_t *table_keys, int64_t *table_scores, int64_t num_buckets, int64_t bucket_size,
               const int64_t *keys, const int64_t *scores, int64_t n, int64_t *slots) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        uint64_t h = mix64((uint64_t)keys[i]);
        int64_t base = (int64_t)(h & (uint64_t)(num_buckets - 1)) * bucket_size;
        int64_t pos = (int64_t)(h >> 40) & (bucket_size - 1);
        int64_t slot = -1;
        for (int64_t r = 0; r < bucket_size && slot < 0; ++r) {
            int64_t s = base + ((pos + r) & (bucket_size - 1));
            int64_t cur = __atomic_load_n(&table_keys[s], __ATOMIC_RELAXED);
            while ((cur == EMPTY_KEY || cur == RECLAIM_KEY) && slot < 0)
                if (__atomic_compare_exchange_n(&table_keys[s], &cur, keys[i], 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                    slot = s;
        }
        if (slot >= 0) table_scores[slot] = scores[i];
        slots[i] = slot;
    }
}
