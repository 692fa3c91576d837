/* hkv's CPU kernels (probe.h) as torch operators: torch.ops.hkv_native.* (TORCH_LIBRARY, CPU dispatch key),
 * called by hkv/cpu.py. Each checks what the kernel reads (CPU, int64 keys and scores, contiguous rows),
 * allocates the outputs and calls the kernel with the tensors' data pointers. Tables are updated in place (the
 * schemas mark them). Hash probing is bound by memory latency, not arithmetic: one build; only dequantizing a
 * quantized row as it is copied out has per-ISA paths (dequantize.h), chosen here once per call. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hkv_native {
namespace kernels {
#include "probe.h"
}
namespace {

using at::Tensor;

void check(const Tensor &t, const char *op, const char *name, at::ScalarType dtype) {
    TORCH_CHECK(t.device().is_cpu(), "hkv_native.", op, ": ", name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, "hkv_native.", op, ": ", name, " must be ", dtype, ", got ",
                     t.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous(), "hkv_native.", op, ": ", name, " must be contiguous");
}

void check_rows(const Tensor &t, const char *op, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), "hkv_native.", op, ": ", name,
                " must be a contiguous [rows, dim] CPU tensor");
}

int threads() { return at::get_num_threads(); }

/* kernels::ISA_* of ``name``, or NUM_ISAS where it is none of them. */
int isa_index(const std::string &name) {
    int i = 0;
    while (i < kernels::NUM_ISAS && name != kernels::ISA_NAMES[i]) ++i;
    return i;
}

int checked_isa(const std::string &name, const char *why) {
    const int i = isa_index(name);
    TORCH_CHECK_VALUE(i < kernels::NUM_ISAS, why, name, ": not one of generic, avx2, avx512");
    TORCH_CHECK_VALUE(kernels::cpu_has_isa(i), why, name, ": this CPU lacks it");
    return i;
}

/* The instruction set dequantizing runs: RECOMPILE_ISA's (as the runtime's kernels, runtime/native.py), else the
 * best this CPU has, until set_isa switches. */
std::atomic<int> current_isa{-1};

int isa_now() {
    int i = current_isa.load(std::memory_order_acquire);
    if (i < 0) {
        const char *forced = getenv("RECOMPILE_ISA");
        if (forced && *forced) {
            i = checked_isa(forced, "hkv_native: RECOMPILE_ISA=");
        } else {
            i = kernels::NUM_ISAS - 1;
            while (!kernels::cpu_has_isa(i)) --i;
        }
        current_isa.store(i, std::memory_order_release);
    }
    return i;
}

std::string isa() { return kernels::ISA_NAMES[isa_now()]; }

/* Switch to ``name``; returns the one before (tests and benchmarks run each path in one process). */
std::string set_isa(const std::string &name) {
    const std::string before = isa();
    current_isa.store(checked_isa(name, "hkv_native.set_isa: "), std::memory_order_release);
    return before;
}

bool isa_available(const std::string &name) {
    const int i = isa_index(name);
    return i < kernels::NUM_ISAS && kernels::cpu_has_isa(i);
}

/* How ``values``' rows are read out (probe.h ROW_*): as stored, or dequantized from packed rows of width ``dim``. */
kernels::row_format format_of(const Tensor &values, int64_t kind, int64_t dim, const char *op) {
    const int64_t stored = values.size(1) * values.element_size();
    if (kind == kernels::ROW_RAW) return {kernels::ROW_RAW, stored, stored, values.size(1)};
    TORCH_CHECK_VALUE(kind == kernels::ROW_INT8 || kind == kernels::ROW_INT4, "hkv_native.", op,
                      ": row_format must be ", kernels::ROW_RAW, ", ", kernels::ROW_INT8, " or ", kernels::ROW_INT4,
                      ", got ", kind);
    TORCH_CHECK_TYPE(values.scalar_type() == at::kByte, "hkv_native.", op, ": quantized rows must be uint8, got ",
                     values.scalar_type());
    const int64_t packed = kind == kernels::ROW_INT8 ? dim + 8 : dim / 2 + 4;
    TORCH_CHECK_VALUE(dim > 0 && (kind == kernels::ROW_INT8 || dim % 2 == 0) && stored == packed, "hkv_native.", op,
                      ": rows of ", stored, " bytes are not ", kind == kernels::ROW_INT8 ? "int8" : "int4",
                      " rows of dim ", dim);
    return {static_cast<int>(kind), stored, dim * 4, dim, kernels::DEQUANTIZERS[kind - 1][isa_now()]};
}

/* n rows as ``fmt`` reads them out: the stored dtype and width, or fp32 ``dim``. */
Tensor out_rows(const Tensor &values, const kernels::row_format &fmt, int64_t n) {
    if (fmt.kind == kernels::ROW_RAW) return at::empty({n, values.size(1)}, values.options());
    return at::empty({n, fmt.dim}, values.options().dtype(at::kFloat));
}

template <class T>
T *ptr(const Tensor &t) {
    return static_cast<T *>(t.data_ptr());
}

Tensor locate(const Tensor &table_keys, int64_t num_buckets, int64_t bucket_size, const Tensor &keys_) {
    check(table_keys, "locate", "table_keys", at::kLong);
    const Tensor keys = keys_.contiguous();
    check(keys, "locate", "keys", at::kLong);
    Tensor slots = at::empty_like(keys);
    kernels::hkv_locate(ptr<int64_t>(table_keys), num_buckets, bucket_size, ptr<int64_t>(keys), keys.numel(),
                        ptr<int64_t>(slots), threads());
    return slots;
}

std::tuple<Tensor, Tensor, Tensor> find(const Tensor &table_keys, int64_t num_buckets, int64_t bucket_size,
                                        const Tensor &values, const Tensor &keys_, int64_t row_format, int64_t dim) {
    check(table_keys, "find", "table_keys", at::kLong);
    check_rows(values, "find", "values");
    const kernels::row_format fmt = format_of(values, row_format, dim, "find");
    const Tensor keys = keys_.contiguous();
    check(keys, "find", "keys", at::kLong);
    const int64_t n = keys.numel();
    Tensor out = out_rows(values, fmt, n), found = at::empty({n}, keys.options().dtype(at::kBool));
    Tensor slots = at::empty_like(keys);
    kernels::hkv_find(ptr<int64_t>(table_keys), num_buckets, bucket_size, ptr<const char>(values), fmt,
                      ptr<int64_t>(keys), n, ptr<char>(out), ptr<uint8_t>(found), ptr<int64_t>(slots), threads());
    return {out, found, slots};
}

Tensor claim(const Tensor &table_keys, const Tensor &table_scores, int64_t num_buckets, int64_t bucket_size,
             const Tensor &keys_, const Tensor &scores_) {
    check(table_keys, "claim", "table_keys", at::kLong);
    check(table_scores, "claim", "table_scores", at::kLong);
    const Tensor keys = keys_.contiguous(), scores = scores_.contiguous();
    check(keys, "claim", "keys", at::kLong);
    check(scores, "claim", "scores", at::kLong);
    Tensor slots = at::empty_like(keys);
    kernels::hkv_claim(ptr<int64_t>(table_keys), ptr<int64_t>(table_scores), num_buckets, bucket_size,
                       ptr<int64_t>(keys), ptr<int64_t>(scores), keys.numel(), ptr<int64_t>(slots), threads());
    return slots;
}

/* (slots, status, counts [6], out): out the stored rows of found keys read out by ``row_format`` when copy_out,
 * else empty; new_values are stored rows. */
std::tuple<Tensor, Tensor, Tensor, Tensor> upsert(const Tensor &table_keys, const Tensor &table_scores,
                                                  int64_t num_buckets, int64_t bucket_size, const Tensor &values,
                                                  const Tensor &keys_, const std::optional<Tensor> &new_values_,
                                                  const Tensor &given_, int64_t strategy, bool insert,
                                                  int64_t clock_score, int64_t epoch, bool copy_out, bool grouped,
                                                  const Tensor &fresh, int64_t row_format, int64_t dim) {
    check(table_keys, "upsert", "table_keys", at::kLong);
    check(table_scores, "upsert", "table_scores", at::kLong);
    check_rows(values, "upsert", "values");
    const kernels::row_format fmt = format_of(values, row_format, dim, "upsert");
    check(fresh, "upsert", "fresh", at::kByte);
    const Tensor keys = keys_.contiguous(), given = given_.contiguous();
    check(keys, "upsert", "keys", at::kLong);
    check(given, "upsert", "given", at::kLong);
    const Tensor new_values = new_values_ && new_values_->defined() ? new_values_->contiguous() : Tensor();
    if (new_values.defined()) {
        TORCH_CHECK_TYPE(new_values.scalar_type() == values.scalar_type(), "hkv_native.upsert: new_values must be ",
                         values.scalar_type());
        TORCH_CHECK_VALUE(new_values.numel() == keys.numel() * values.size(1), "hkv_native.upsert: new_values must "
                          "hold one row per key");
    }
    const int64_t n = keys.numel();
    Tensor out = out_rows(values, fmt, copy_out ? n : 0);
    Tensor slots = at::empty_like(keys), status = at::empty({n}, keys.options().dtype(at::kChar));
    Tensor counts = at::zeros({6}, keys.options());
    kernels::hkv_upsert(ptr<int64_t>(table_keys), ptr<int64_t>(table_scores), num_buckets, bucket_size,
                        ptr<char>(values), fmt, ptr<int64_t>(keys), n,
                        new_values.defined() ? ptr<const char>(new_values) : nullptr, ptr<int64_t>(given),
                        (int)strategy, insert, clock_score, epoch, copy_out ? ptr<char>(out) : nullptr, grouped,
                        ptr<uint8_t>(fresh), ptr<int64_t>(slots), ptr<int8_t>(status), ptr<int64_t>(counts),
                        threads());
    return {slots, status, counts, out};
}

std::tuple<Tensor, Tensor> unique(const Tensor &ids_, int64_t num_buckets) {
    TORCH_CHECK(ids_.device().is_cpu(), "hkv_native.unique: ids must be a CPU tensor");
    const Tensor ids = ids_.contiguous().to(at::kLong);
    const int64_t n = ids.numel();
    Tensor uniq = at::empty_like(ids), inverse = at::empty_like(ids);
    /* a set of pow2(2n) <= 4n + 2 entries, and the bucket counts */
    Tensor work = at::empty({6 * n + std::max<int64_t>(num_buckets, 0) + 3}, ids.options());
    const int64_t m = kernels::hkv_unique(ptr<int64_t>(ids), n, num_buckets, ptr<int64_t>(uniq),
                                          ptr<int64_t>(inverse), ptr<int64_t>(work));
    return {uniq.narrow(0, 0, m), inverse};
}

Tensor pool_backward(const Tensor &grad_, const Tensor &offsets_, const Tensor &inverse_, bool mean,
                     int64_t num_rows) {
    const Tensor grad = grad_.contiguous(), offsets = offsets_.contiguous().to(at::kLong), inverse = inverse_.contiguous();
    check(grad, "pool_backward", "grad", at::kFloat);
    check(inverse, "pool_backward", "inverse", at::kLong);
    TORCH_CHECK_VALUE(grad.dim() == 2, "hkv_native.pool_backward: grad must be [bags, dim]");
    Tensor out = at::empty({num_rows, grad.size(1)}, grad.options());
    kernels::hkv_pool_backward(ptr<float>(grad), ptr<int64_t>(offsets), offsets.numel(), ptr<int64_t>(inverse),
                               inverse.numel(), grad.size(1), mean, ptr<float>(out), num_rows);
    return out;
}

}  // namespace

TORCH_LIBRARY(hkv_native, m) {
    m.def("locate(Tensor table_keys, int num_buckets, int bucket_size, Tensor keys) -> Tensor");
    m.def("find(Tensor table_keys, int num_buckets, int bucket_size, Tensor values, Tensor keys, int row_format=0, "
          "int dim=0) -> (Tensor, Tensor, Tensor)");
    m.def("claim(Tensor(a!) table_keys, Tensor(b!) table_scores, int num_buckets, int bucket_size, Tensor keys, "
          "Tensor scores) -> Tensor");
    m.def("upsert(Tensor(a!) table_keys, Tensor(b!) table_scores, int num_buckets, int bucket_size, "
          "Tensor(c!) values, Tensor keys, Tensor? new_values, Tensor given, int strategy, bool insert, "
          "int clock_score, int epoch, bool copy_out, bool grouped, Tensor(d!) fresh, int row_format=0, int dim=0) "
          "-> (Tensor, Tensor, Tensor, Tensor)");
    m.def("unique(Tensor ids, int num_buckets) -> (Tensor, Tensor)");
    m.def("pool_backward(Tensor grad, Tensor offsets, Tensor inverse, bool mean, int num_rows) -> Tensor");
    m.def("isa() -> str", &isa);
    m.def("set_isa(str isa) -> str", &set_isa);
    m.def("isa_available(str isa) -> bool", &isa_available);
}

TORCH_LIBRARY_IMPL(hkv_native, CPU, m) {
    m.impl("locate", &locate);
    m.impl("find", &find);
    m.impl("claim", &claim);
    m.impl("upsert", &upsert);
    m.impl("unique", &unique);
    m.impl("pool_backward", &pool_backward);
}

}  // namespace hkv_native
