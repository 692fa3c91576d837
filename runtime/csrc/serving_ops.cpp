/* The serving kernels as torch operators (TORCH_LIBRARY_FRAGMENT of recompile_native, CPU dispatch key):
 * hstu_paged_attention (paged_attention.h) and item_topk (item_topk.h). Thin entry points as ops.cpp's: checks of
 * what the kernel reads, data pointers, the call into the table of the instruction set the runtime's kernels run. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>

#include "kernels.h"
#include "serving_kernels.h"

namespace recompile_native {

extern const ServingKernels generic_serving_kernels;
#if defined(__x86_64__)
extern const ServingKernels avx2_serving_kernels, avx512_serving_kernels;
#endif

const ServingKernels &serving_kernels() {
    const char *isa = kernels().isa;
#if defined(__x86_64__)
    if (!strcmp(isa, "avx512")) return avx512_serving_kernels;
    if (!strcmp(isa, "avx2")) return avx2_serving_kernels;
#endif
    return generic_serving_kernels;
}

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

template <class T = void>
T *opt_ptr(const OptTensor &t) {
    return t && t->defined() ? static_cast<T *>(t->data_ptr()) : nullptr;
}

void need(const Tensor &t, const char *op, const char *name, at::ScalarType dtype) {
    TORCH_CHECK(t.device().is_cpu(), "recompile_native.", op, ": ", name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, "recompile_native.", op, ": ", name, " must be ", dtype, ", got ",
                     t.scalar_type());
}
void need(const OptTensor &t, const char *op, const char *name, at::ScalarType dtype) {
    if (t && t->defined()) need(*t, op, name, dtype);
}
void need_contiguous(const Tensor &t, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.is_contiguous(), "recompile_native.", op, ": ", name, " must be contiguous");
}

/* ---------------------------------------------------------------------------------- paged attention */

Tensor hstu_paged_attention(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &offsets,
                            const Tensor &k_cache, const Tensor &v_cache, const Tensor &page_table,
                            const Tensor &cached_lengths, int64_t max_seq_len, double alpha,
                            const OptTensor &num_targets, const OptTensor &rel_bias, const OptTensor &timestamps,
                            const OptTensor &ts_cache, const OptTensor &time_bias, const OptTensor &bucket_bounds) {
    const char *op = "hstu_paged_attention";
    const auto dtype = q.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "recompile_native.", op,
                     ": q has dtype ", dtype, ", which the kernel is not built for");
    for (auto *t : {&q, &k, &v, &k_cache, &v_cache}) need(*t, op, "q, k, v and the caches", dtype);
    for (auto *t : {&q, &k, &v})
        TORCH_CHECK_VALUE(t->dim() == 3 && t->stride(2) == 1 && t->size(1) == q.size(1) && t->size(0) == q.size(0),
                          "recompile_native.", op, ": q, k and v must be [T, H, D] with unit stride in D");
    TORCH_CHECK_VALUE(k.size(2) == q.size(2) && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                          k_cache.size(2) == q.size(1) && k_cache.size(3) == q.size(2) &&
                          v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) && v_cache.size(3) == v.size(2),
                      "recompile_native.", op, ": k_cache must be [P, S, H, D] and v_cache [P, S, H, Dv]");
    need_contiguous(k_cache, op, "k_cache"), need_contiguous(v_cache, op, "v_cache");
    for (auto *t : {&offsets, &page_table, &cached_lengths}) need(*t, op, "offsets, page_table, cached_lengths", at::kLong);
    for (auto *t : {&offsets, &page_table, &cached_lengths}) need_contiguous(*t, op, "offsets, page_table, cached_lengths");
    need(num_targets, op, "num_targets", at::kLong);
    need(timestamps, op, "timestamps", at::kLong);
    need(ts_cache, op, "ts_cache", at::kLong);
    for (auto *t : {&rel_bias, &time_bias, &bucket_bounds}) need(*t, op, "the biases", at::kFloat);
    const int64_t batch = offsets.numel() - 1, pages = k_cache.size(0), page_size = k_cache.size(1);
    TORCH_CHECK_VALUE(batch >= 0 && page_table.dim() == 2 && page_table.size(0) == batch &&
                          cached_lengths.numel() == batch && (!num_targets || num_targets->numel() == batch),
                      "recompile_native.", op, ": page_table [B, pages], cached_lengths [B], num_targets [B] with B = ",
                      batch);
    TORCH_CHECK_VALUE(!time_bias == !bucket_bounds && !time_bias == !timestamps && !time_bias == !ts_cache,
                      "recompile_native.", op, ": timestamps, ts_cache, time_bias and bucket_bounds come together");
    const int64_t *off = offsets.data_ptr<int64_t>(), *cached = cached_lengths.data_ptr<int64_t>();
    const int64_t *table = page_table.data_ptr<int64_t>(), *targets = opt_ptr<int64_t>(num_targets);
    TORCH_CHECK_VALUE(batch == 0 || (off[0] == 0 && off[batch] == q.size(0)), "recompile_native.", op,
                      ": offsets must run from 0 to the new rows' count");
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = off[b + 1] - off[b], c = cached[b];
        TORCH_CHECK_VALUE(n >= 0 && (!targets || (targets[b] >= 0 && targets[b] <= n)), "recompile_native.", op,
                          ": offsets must be non-decreasing and num_targets within each user's new rows");
        TORCH_CHECK_VALUE(c >= 0 && c <= page_table.size(1) * page_size, "recompile_native.", op, ": user ", b,
                          "'s cached length ", c, " is beyond its page table");
        TORCH_CHECK_VALUE(!rel_bias || c + n <= max_seq_len, "recompile_native.", op, ": user ", b, "'s sequence of ",
                          c + n, " (cached + new) is longer than max_seq_len=", max_seq_len,
                          ", beyond the relative position bias");
        for (int64_t i = 0; i < (c + page_size - 1) / page_size; i++)
            TORCH_CHECK_VALUE(table[b * page_table.size(1) + i] >= 0 && table[b * page_table.size(1) + i] < pages,
                              "recompile_native.", op, ": page_table[", b, ", ", i, "] is not a page of the pool");
    }
    if (timestamps) TORCH_CHECK_VALUE(timestamps->numel() == q.size(0) && timestamps->is_contiguous(),
                                      "recompile_native.", op, ": timestamps must be [T] contiguous");
    if (ts_cache) TORCH_CHECK_VALUE(ts_cache->numel() == pages * page_size && ts_cache->is_contiguous(),
                                    "recompile_native.", op, ": ts_cache must be [P, S] contiguous");
    if (rel_bias) TORCH_CHECK_VALUE(rel_bias->numel() == 2 * max_seq_len - 1 + 16, "recompile_native.", op,
                                    ": rel_bias must be zero-padded by 16 to 2 * max_seq_len + 15");
    Tensor out = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
    paged_problem p{};
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.k_cache = k_cache.data_ptr();
    p.v_cache = v_cache.data_ptr();
    p.q_stride[0] = q.stride(0), p.q_stride[1] = q.stride(1), p.k_stride[0] = k.stride(0);
    p.k_stride[1] = k.stride(1), p.v_stride[0] = v.stride(0), p.v_stride[1] = v.stride(1);
    p.offsets = off, p.page_table = table, p.cached_lengths = cached, p.num_targets = targets;
    p.batch = batch, p.heads = q.size(1), p.dim = q.size(2), p.dim_v = v.size(2), p.max_pages = page_table.size(1);
    p.page_size = page_size, p.max_seq_len = max_seq_len, p.alpha = (float)alpha;
    p.rel_bias = opt_ptr<float>(rel_bias), p.timestamps = opt_ptr<int64_t>(timestamps);
    p.ts_cache = opt_ptr<int64_t>(ts_cache), p.time_bias = opt_ptr<float>(time_bias);
    p.bucket_bounds = opt_ptr<float>(bucket_bounds);
    p.num_buckets = time_bias ? time_bias->numel() - 1 : 0;
    p.dtype = dtype == at::kFloat ? 0 : dtype == at::kHalf ? 1 : 2, p.threads = at::get_num_threads();
    p.out = out.data_ptr();
    TORCH_CHECK(serving_kernels().hstu_paged_attention_fwd(&p) == 0, "recompile_native.", op,
                ": out of memory for the per-thread tiles");
    return out;
}

/* ------------------------------------------------------------------------------------------- top-k */

std::tuple<Tensor, Tensor> item_topk(const Tensor &queries, const Tensor &items, const Tensor &codes,
                                     const Tensor &scales, int64_t k) {
    const char *op = "item_topk";
    need(queries, op, "queries", at::kFloat), need(items, op, "items", at::kFloat);
    need(codes, op, "codes", at::kChar), need(scales, op, "scales", at::kFloat);
    for (auto *t : {&queries, &items, &codes, &scales}) need_contiguous(*t, op, "queries, items, codes and scales");
    const int64_t n = items.size(0), d = items.dim() == 2 ? items.size(1) : -1, blocks = (n + 15) / 16;
    TORCH_CHECK_VALUE(queries.dim() == 2 && queries.size(1) == d, "recompile_native.", op,
                      ": queries must be [B, d] and items [N, d]");
    TORCH_CHECK_VALUE(codes.dim() == 3 && codes.size(0) == blocks && codes.size(1) == d && codes.size(2) == 16 &&
                          scales.numel() == blocks * 16,
                      "recompile_native.", op, ": codes must be [ceil(N / 16), d, 16] and scales [ceil(N / 16) * 16]");
    TORCH_CHECK_VALUE(k >= 1 && k <= n, "recompile_native.", op, ": k must be in [1, N=", n, "], got ", k);
    Tensor values = at::empty({queries.size(0), k}, queries.options());
    Tensor indices = at::empty({queries.size(0), k}, queries.options().dtype(at::kLong));
    topk_problem p{queries.data_ptr<float>(), items.data_ptr<float>(), scales.data_ptr<float>(),
                   codes.data_ptr<int8_t>(), queries.size(0), n, d, k, at::get_num_threads(),
                   values.data_ptr<float>(), indices.data_ptr<int64_t>()};
    TORCH_CHECK(serving_kernels().item_topk(&p) == 0, "recompile_native.", op, ": out of memory");
    return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(recompile_native, m) {
    m.def("hstu_paged_attention(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor k_cache, Tensor v_cache, "
          "Tensor page_table, Tensor cached_lengths, int max_seq_len, float alpha, Tensor? num_targets, "
          "Tensor? rel_bias, Tensor? timestamps, Tensor? ts_cache, Tensor? time_bias, Tensor? bucket_bounds) -> Tensor");
    m.def("item_topk(Tensor queries, Tensor items, Tensor codes, Tensor scales, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(recompile_native, CPU, m) {
    m.impl("hstu_paged_attention", &hstu_paged_attention);
    m.impl("item_topk", &item_topk);
}

}  // namespace recompile_native
