/* The serving kernels' interface (paged_attention.h, item_topk.h): HSTU attention of new rows over a paged KV
 * cache, and top-k over an int8-quantized item corpus. Compiled once per instruction set like kernels.h's bodies
 * (serving_isa_<set>.cpp include serving_isa.inc), picked by the instruction set the runtime's kernels run
 * (kernels().isa), so that RECOMPILE_ISA and use_isa switch these too. No torch headers. */
#ifndef RECOMPILE_SERVING_KERNELS_H
#define RECOMPILE_SERVING_KERNELS_H

#include <stdint.h>

namespace recompile_native {

/* One hstu_paged_attention call. New rows q, k, v [T, H, *] with strides in elements ([token, head], the last
 * dimension contiguous); the pools k_cache [P, S, H, D], v_cache [P, S, H, Dv] contiguous in q's dtype. */
typedef struct {
    const void *q, *k, *v, *k_cache, *v_cache;
    int64_t q_stride[2], k_stride[2], v_stride[2];
    const int64_t *offsets;        /* [B + 1] new rows per user */
    const int64_t *page_table;     /* [B, max_pages] */
    const int64_t *cached_lengths; /* [B] */
    const int64_t *num_targets;    /* [B] or NULL */
    int64_t batch, heads, dim, dim_v, max_pages, page_size, max_seq_len;
    float alpha;
    const float *rel_bias;      /* [2 * max_seq_len - 1 + 16], zero-padded; NULL without */
    const int64_t *timestamps;  /* [T] new rows' timestamps; NULL without time bias */
    const int64_t *ts_cache;    /* [P, S] */
    const float *time_bias;     /* [num_buckets + 1] */
    const float *bucket_bounds; /* [num_buckets + 2] (jagged_attention.h time_buckets) */
    int64_t num_buckets;
    int32_t dtype, threads;
    void *out; /* [T, H, Dv] contiguous, q's dtype */
} paged_problem;

/* One item_topk call: the best k of N items for each of B queries [B, d] (f32), items scored by an upper bound
 * from int8 codes [ceil(N / 16), d, 16] (16 items a block, dimension-major) and per-item scales [ceil(N/16) * 16],
 * survivors re-scored exactly from the float rows items [N, d]. */
typedef struct {
    const float *queries, *items, *scales;
    const int8_t *codes;
    int64_t batch, num_items, dim, k;
    int32_t threads;
    float *values;    /* [B, k], descending; equal values by index ascending */
    int64_t *indices; /* [B, k] */
} topk_problem;

namespace serving_api {
int hstu_paged_attention_fwd(const paged_problem *p);
int item_topk(const topk_problem *p);
}  // namespace serving_api

struct ServingKernels {
    const char *isa;
    decltype(&serving_api::hstu_paged_attention_fwd) hstu_paged_attention_fwd;
    decltype(&serving_api::item_topk) item_topk;
};

/* The table of the instruction set kernels() runs. */
const ServingKernels &serving_kernels();

}  // namespace recompile_native

#endif
