/* The native CPU kernels as torch operators: torch.ops.recompile_native.* (TORCH_LIBRARY, CPU dispatch key).
 *
 * Each operator is a thin entry point: it checks what the kernel reads (CPU tensors of the dtypes it is built
 * for, unit stride where it reads rows), takes the data pointers and calls the kernel of the instruction set
 * chosen when the library loaded (kernels.h). The ops are called by runtime's *_native.py modules, dropout.py and
 * sampled_softmax.py, whose Python custom ops (torch.ops.recompile.*) keep their references and fakes; the custom
 * ops' native kernels also run here below autograd, and grouped_embedding_bag, fm_second_order and
 * sampled_softmax_loss have their CPU autograd here (the end of this file). ``dropout`` and the functional ops here
 * also stand alone (torch.export keeps them as torch.ops.recompile_native.*, callable from C++ once this library
 * is loaded). The grouped embedding ops read tables of data pointers built by their Python callers;
 * dot_interaction builds its tables here, from its lists. */
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_sparse_coo_tensor_unsafe.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#include <algorithm>

#include "kernels.h"
#include "gru.h"
#include "lstm.h"

namespace recompile_native {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

template <class T = void>
T *ptr(const Tensor &t) {
    return static_cast<T *>(t.data_ptr());
}
template <class T = void>
T *ptr(const OptTensor &t) {
    return t && t->defined() ? static_cast<T *>(t->data_ptr()) : nullptr;
}

int threads() { return at::get_num_threads(); }

void check(const Tensor &t, const char *op, const char *name, std::initializer_list<at::ScalarType> dtypes) {
    TORCH_CHECK(t.device().is_cpu(), "recompile_native.", op, ": ", name, " must be a CPU tensor, got ", t.device());
    bool ok = false;
    for (auto d : dtypes) ok = ok || t.scalar_type() == d;
    TORCH_CHECK_TYPE(ok, "recompile_native.", op, ": ", name, " has dtype ", t.scalar_type(),
                     ", which the kernel is not built for");
}
void check(const OptTensor &t, const char *op, const char *name, std::initializer_list<at::ScalarType> dtypes) {
    if (t && t->defined()) check(*t, op, name, dtypes);
}

constexpr auto F32 = at::kFloat, F16 = at::kHalf, BF16 = at::kBFloat16, I64 = at::kLong, I32 = at::kInt,
               F64 = at::kDouble;
#define FLOATS {F32, F16, BF16}

/* ---------------------------------------------------------------------------------------------- dropout */

Tensor dropout(const Tensor &x_, const Tensor &seed, double p) {
    check(x_, "dropout", "x", {F32});
    check(seed, "dropout", "seed", {I64});
    TORCH_CHECK_VALUE(seed.numel() == 2, "recompile_native.dropout: seed must hold 2 values, got ", seed.numel());
    TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "recompile_native.dropout: p must be in [0, 1), got ", p);
    const Tensor x = x_.contiguous();
    Tensor out = at::empty(x.sizes(), x.options());
    const int64_t *s = ptr<int64_t>(seed.contiguous());
    const double t = p * 4294967296.0;
    const uint32_t threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
    kernels().dropout_f32(ptr<float>(x), ptr<float>(out), x.numel(), (uint32_t)s[0], (uint32_t)s[1], threshold,
                          (float)(1.0 / (1.0 - p)), threads());
    return out;
}

/* ---------------------------------------------------------------------------- grouped embedding (meta) */

void geb_forward_pooled(int64_t tables, const Tensor &meta, int64_t batch, const Tensor &out, int64_t out_stride,
                        const Tensor &err, bool stream, int64_t nthreads) {
    check(meta, "geb_forward_pooled", "meta", {I64});
    check(err, "geb_forward_pooled", "err", {I64});
    kernels().geb_forward_pooled(tables, ptr<int64_t>(meta), batch, ptr(out), out_stride, ptr<int64_t>(err), stream,
                                 (int)nthreads);
}

void geb_forward_sequence(int64_t tables, const Tensor &meta, const Tensor &out, int64_t out_stride, const Tensor &err,
                          int64_t nthreads) {
    check(meta, "geb_forward_sequence", "meta", {I64});
    check(err, "geb_forward_sequence", "err", {I64});
    kernels().geb_forward_sequence(tables, ptr<int64_t>(meta), ptr(out), out_stride, ptr<int64_t>(err), (int)nthreads);
}

void geb_backward(int64_t tables, const Tensor &meta, int64_t batch, const Tensor &grad, int64_t grad_stride,
                  const Tensor &table_out, const Tensor &dense, const Tensor &psw_out, const Tensor &err) {
    for (auto *t : {&meta, &table_out, &dense, &psw_out, &err}) check(*t, "geb_backward", "a pointer table", {I64});
    check(grad, "geb_backward", "grad", FLOATS);
    kernels().geb_backward(tables, ptr<int64_t>(meta), batch, ptr(grad), grad_stride, ptr<int64_t>(table_out),
                           ptr<int64_t>(dense), ptr<int64_t>(psw_out), ptr<int64_t>(err), threads());
}

void geb_optimizer_step(int64_t tables, const Tensor &meta, int64_t batch, const Tensor &grad, int64_t grad_stride,
                        int64_t kind, const Tensor &hyper, const Tensor &state, const Tensor &step_size,
                        const Tensor &sums, const Tensor &touched, const Tensor &slots, const Tensor &err) {
    check(grad, "geb_optimizer_step", "grad", {F32});
    check(sums, "geb_optimizer_step", "sums", {F32});
    check(hyper, "geb_optimizer_step", "hyper", {F64});
    check(step_size, "geb_optimizer_step", "step_size", {F64});
    check(slots, "geb_optimizer_step", "slots", {I32});
    for (auto *t : {&meta, &state, &touched, &err}) check(*t, "geb_optimizer_step", "an index table", {I64});
    kernels().geb_optimizer_step(tables, ptr<int64_t>(meta), batch, ptr<float>(grad), grad_stride, (int)kind,
                                 ptr<double>(hyper), ptr<int64_t>(state), ptr<double>(step_size), ptr<float>(sums),
                                 ptr<int64_t>(touched), ptr<int32_t>(slots), ptr<int64_t>(err), threads());
}

/* ------------------------------------------------------------------------------------------ interaction */

/* kernels().<name>_<f32|f16|bf16> for dtype, called with the element pointers as that type. */
#define BY_DTYPE(dtype, name, T, ...)                                                                          \
    do {                                                                                                       \
        switch (dtype) {                                                                                       \
            case at::kFloat: { using T = float; kernels().name##_f32(__VA_ARGS__); break; }                    \
            case at::kHalf: { using T = _Float16; kernels().name##_f16(__VA_ARGS__); break; }                  \
            case at::kBFloat16: { using T = bf16_t; kernels().name##_bf16(__VA_ARGS__); break; }               \
            default: TORCH_CHECK_TYPE(false, "recompile_native." #name ": no kernel for ", dtype);             \
        }                                                                                                      \
    } while (0)

/* dot_interaction's argument tables, built here per call (no Python list or tensor per call): each feature's
 * first-row pointer and row stride (a [B, n, D] item is n features), and the pair ranges of the output order
 * (row r's pairs are columns [lo[r], hi[r]) written from off[r] on, for triu_indices(F, F, 1) (upper) or
 * tril_indices(F, F, -1), the diagonal too with self_interaction). */
bool plain_cpu(const Tensor &t, std::initializer_list<at::ScalarType> dtypes);

struct FeatureRows {
    std::vector<int64_t> pointer, stride;
    std::vector<Tensor> alive;  // unit-stride copies the pointers point into

    void add(Tensor t) {
        if (t.stride(-1) != 1 && t.size(-1) > 1) t = t.contiguous();
        const int64_t size = t.element_size();
        const auto base = reinterpret_cast<int64_t>(t.data_ptr());
        for (int64_t f = 0; f < (t.dim() == 2 ? 1 : t.size(1)); f++) {
            pointer.push_back(base + (t.dim() == 2 ? 0 : f * t.stride(1) * size));
            stride.push_back(t.stride(0));
        }
        alive.push_back(std::move(t));
    }
};

std::vector<int32_t> pair_ranges(int64_t F, bool upper, bool self_interaction) {
    std::vector<int32_t> r(3 * F);
    int32_t off = 0;
    for (int64_t i = 0; i < F; i++) {
        const int32_t lo = upper ? i + !self_interaction : 0, hi = upper ? F : i + self_interaction;
        r[i] = lo, r[F + i] = hi, r[2 * F + i] = off;
        off += std::max(hi - lo, 0);
    }
    return r;
}

int64_t num_pairs(int64_t F, bool self_interaction) { return F * (F + (self_interaction ? 1 : -1)) / 2; }

/* The features' rows; ``plain``: false for anything but plain CPU tensors of one kernel dtype, [B, D] or
 * [B, n, D], of one B and D (the below-autograd entry then leaves the call to the Python op), else such
 * tensors are required. */
bool dot_features(at::ArrayRef<Tensor> items, FeatureRows &rows, bool plain) {
    TORCH_CHECK_VALUE(plain || !items.empty(), "recompile_native.dot_interaction: no features");
    if (items.empty()) return false;
    const Tensor &first = items[0];
    for (const Tensor &t : items) {
        const bool ok = (plain ? plain_cpu(t, FLOATS) : t.device().is_cpu()) && t.scalar_type() == first.scalar_type() &&
                        (t.dim() == 2 || t.dim() == 3) && t.size(0) == first.size(0) && t.size(-1) == first.size(-1);
        if (plain && !ok) return false;
        TORCH_CHECK_VALUE(ok, "recompile_native.dot_interaction: features must be CPU [B, D] or [B, n, D] tensors of "
                              "one B, D and dtype");
        rows.add(t);
    }
    if (!plain) check(first, "dot_interaction", "features", FLOATS);
    return true;
}

/* The needed pairs of the features (runtime.interaction.dot_interaction), after the prefix. */
Tensor dot_interaction(at::ArrayRef<Tensor> items, const OptTensor &prefix_, bool upper, bool self_interaction) {
    FeatureRows rows;
    dot_features(items, rows, false);
    const Tensor &first = rows.alive[0];
    const int64_t B = first.size(0), D = first.size(-1), F = rows.pointer.size();
    OptTensor prefix = prefix_ && prefix_->defined() ? prefix_ : std::nullopt;
    if (prefix) {
        check(*prefix, "dot_interaction", "prefix", {first.scalar_type()});
        TORCH_CHECK_VALUE(prefix->dim() == 2 && prefix->size(0) == B, "recompile_native.dot_interaction: prefix must "
                          "be [B, K] with B = ", B);
        if (prefix->stride(-1) != 1 && prefix->size(1) > 1) prefix = prefix->contiguous();
    }
    const int64_t k = prefix ? prefix->size(1) : 0, pairs = num_pairs(F, self_interaction);
    const std::vector<int32_t> r = pair_ranges(F, upper, self_interaction);
    Tensor out = at::empty({B, k + pairs}, first.options());
    BY_DTYPE(first.scalar_type(), dot_interaction_fwd, T, rows.pointer.data(), rows.stride.data(), F, B, D,
             ptr<const T>(prefix), prefix ? prefix->stride(0) : 0, k, r.data(), r.data() + F, r.data() + 2 * F, pairs,
             ptr<T>(out), threads());
    return out;
}

/* The features' gradients (contiguous, one per item) from ``grad`` [B, k + P]. */
std::vector<Tensor> dot_interaction_backward(const Tensor &grad, at::ArrayRef<Tensor> items, int64_t k, bool upper,
                                             bool self_interaction) {
    FeatureRows rows, grads;
    dot_features(items, rows, false);
    const Tensor &first = rows.alive[0];
    const int64_t B = first.size(0), D = first.size(-1), F = rows.pointer.size();
    check(grad, "dot_interaction_backward", "grad", {first.scalar_type()});
    TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == B && grad.size(1) == k + num_pairs(F, self_interaction),
                      "recompile_native.dot_interaction_backward: grad must be [B, k + pairs]");
    Tensor pair_grads = grad.slice(1, k);
    if (pair_grads.stride(-1) != 1 && pair_grads.size(1) > 1) pair_grads = pair_grads.contiguous();
    std::vector<Tensor> out;
    for (const Tensor &t : rows.alive) {
        out.push_back(at::empty(t.sizes(), t.options()));
        grads.add(out.back());
    }
    const std::vector<int32_t> r = pair_ranges(F, upper, self_interaction);
    BY_DTYPE(first.scalar_type(), dot_interaction_bwd, T, ptr<const T>(pair_grads), pair_grads.stride(0),
             rows.pointer.data(), rows.stride.data(), grads.pointer.data(), grads.stride.data(), F, B, D, r.data(),
             r.data() + F, r.data() + 2 * F, threads());
    return out;
}

void cross_epilogue_fwd(const Tensor &x0, const Tensor &x, const Tensor &h, const OptTensor &bias, const Tensor &out,
                        const OptTensor &hb) {
    check(x, "cross_epilogue_fwd", "x", FLOATS);
    for (auto *t : {&x0, &h, &out}) check(*t, "cross_epilogue_fwd", "x0, h and out", {x.scalar_type()});
    check(bias, "cross_epilogue_fwd", "bias", {x.scalar_type()});
    check(hb, "cross_epilogue_fwd", "hb", {x.scalar_type()});
    BY_DTYPE(x.scalar_type(), cross_epilogue_fwd, T, ptr<const T>(x0), ptr<const T>(x), ptr<const T>(h),
             ptr<const T>(bias), ptr<T>(out), ptr<T>(hb), x.size(0), x.size(1), threads());
}

void cross_epilogue_bwd(const Tensor &grad, const Tensor &x0, const Tensor &h, const OptTensor &bias,
                        const Tensor &grad_h, const Tensor &grad_x0, const OptTensor &grad_bias) {
    check(grad, "cross_epilogue_bwd", "grad", FLOATS);
    for (auto *t : {&x0, &h, &grad_h, &grad_x0}) check(*t, "cross_epilogue_bwd", "x0, h and the gradients", {grad.scalar_type()});
    check(bias, "cross_epilogue_bwd", "bias", {grad.scalar_type()});
    check(grad_bias, "cross_epilogue_bwd", "grad_bias", {F32});
    BY_DTYPE(grad.scalar_type(), cross_epilogue_bwd, T, ptr<const T>(grad), ptr<const T>(x0), ptr<const T>(h),
             ptr<const T>(bias), ptr<T>(grad_h), ptr<T>(grad_x0), ptr<float>(grad_bias), grad.size(0), grad.size(1),
             threads());
}

/* W, bias: float [L, Dp] (bias optional), Dp a multiple of 16 >= D, zero-padded; x0, x, grad and the outputs
   [B, D] contiguous of one dtype. */
void check_vector_cross(const char *op, const Tensor &x, const Tensor &W, const OptTensor &bias,
                        std::initializer_list<const Tensor *> rows) {
    check(x, op, "x", FLOATS);
    check(W, op, "W", {F32});
    check(bias, op, "bias", {F32});
    TORCH_CHECK_VALUE(x.dim() == 2 && W.dim() == 2 && W.size(1) % 16 == 0 && W.size(1) >= x.size(1) &&
                          W.size(1) < x.size(1) + 16 && x.is_contiguous() && W.is_contiguous(),
                      "recompile_native.", op, ": expected x [B, D] and W [L, Dp] contiguous (Dp: D padded to a "
                      "multiple of 16), got ", x.sizes(), " and ", W.sizes());
    TORCH_CHECK_VALUE(!bias || !bias->defined() || (bias->sizes() == W.sizes() && bias->is_contiguous()),
                      "recompile_native.", op, ": bias must be contiguous ", W.sizes());
    for (auto *t : rows) {
        check(*t, op, "x0, grad and the outputs", {x.scalar_type()});
        TORCH_CHECK_VALUE(t->sizes() == x.sizes() && t->is_contiguous(), "recompile_native.", op,
                          ": x0, grad and the outputs must be contiguous ", x.sizes(), ", got ", t->sizes());
    }
}

void vector_cross_fwd(const Tensor &x0, const Tensor &x, const Tensor &W, const OptTensor &bias, const Tensor &out) {
    check_vector_cross("vector_cross_fwd", x, W, bias, {&x0, &out});
    BY_DTYPE(x.scalar_type(), vector_cross_fwd, T, ptr<const T>(x0), ptr<const T>(x), ptr<const float>(W),
             ptr<const float>(bias), W.size(0), W.size(1), ptr<T>(out), x.size(0), x.size(1), threads());
}

void vector_cross_bwd(const Tensor &grad, const Tensor &x0, const Tensor &x, const Tensor &W, const OptTensor &bias,
                      const Tensor &grad_x0, const Tensor &grad_x, const Tensor &grad_W, const OptTensor &grad_bias) {
    check_vector_cross("vector_cross_bwd", x, W, bias, {&grad, &x0, &grad_x0, &grad_x});
    check(grad_W, "vector_cross_bwd", "grad_W", {F32});
    check(grad_bias, "vector_cross_bwd", "grad_bias", {F32});
    const bool has_bias = bias && bias->defined();
    TORCH_CHECK_VALUE(grad_W.sizes() == W.sizes() && grad_W.is_contiguous() &&
                          has_bias == (grad_bias && grad_bias->defined()) &&
                          (!has_bias || (grad_bias->sizes() == W.sizes() && grad_bias->is_contiguous())),
                      "recompile_native.vector_cross_bwd: grad_W (and grad_bias, given with bias) must be contiguous ",
                      W.sizes());
    BY_DTYPE(x.scalar_type(), vector_cross_bwd, T, ptr<const T>(grad), ptr<const T>(x0), ptr<const T>(x),
             ptr<const float>(W), ptr<const float>(bias), W.size(0), W.size(1), ptr<T>(grad_x0), ptr<T>(grad_x),
             ptr<float>(grad_W), ptr<float>(grad_bias), x.size(0), x.size(1), threads());
}

Tensor fm_second_order_fwd(const Tensor &v_, bool reduce) {
    check(v_, "fm_second_order_fwd", "v", FLOATS);
    TORCH_CHECK_VALUE(v_.dim() == 3, "recompile_native.fm_second_order_fwd: v must be [B, F, D], got ", v_.sizes());
    const Tensor v = v_.contiguous();
    const int64_t B = v.size(0), F = v.size(1), D = v.size(2);
    Tensor out = at::empty({B, reduce ? 1 : D}, v.options());
    BY_DTYPE(v.scalar_type(), fm_second_order_fwd, T, ptr<const T>(v), B, F, D, (int)reduce, ptr<T>(out), threads());
    return out;
}

Tensor fm_second_order_bwd(const Tensor &grad_, const Tensor &v_, bool reduce) {
    check(v_, "fm_second_order_bwd", "v", FLOATS);
    check(grad_, "fm_second_order_bwd", "grad", {v_.scalar_type()});
    TORCH_CHECK_VALUE(v_.dim() == 3 && grad_.dim() == 2 && grad_.size(0) == v_.size(0) &&
                          grad_.size(1) == (reduce ? 1 : v_.size(2)),
                      "recompile_native.fm_second_order_bwd: v must be [B, F, D] and grad [B, ", reduce ? "1" : "D",
                      "], got ", v_.sizes(), " and ", grad_.sizes());
    const Tensor v = v_.contiguous(), grad = grad_.contiguous();
    Tensor out = at::empty(v.sizes(), v.options());
    BY_DTYPE(v.scalar_type(), fm_second_order_bwd, T, ptr<const T>(grad), ptr<const T>(v), v.size(0), v.size(1),
             v.size(2), (int)reduce, ptr<T>(out), threads());
    return out;
}

/* ------------------------------------------------------------------------------------- hstu attention */

constexpr int64_t VECTOR_PAD = 16; /* rel_bias's zero padding, one vector */

int32_t hstu_dtype(at::ScalarType t) { return t == F32 ? 0 : t == F16 ? 1 : 2; }

/* The problem of a call: q, k, v (rows of unit stride, any row and head strides), int64 offsets, num_targets and
 * timestamps, float biases (rel_bias and timestamps zero-padded by the vector width, as the kernel reads them). */
hstu_problem hstu(const char *op, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &offsets,
                  int64_t max_seq_len, double alpha, bool causal, const OptTensor &num_targets, int64_t contextual,
                  const OptTensor &rel_bias, const OptTensor &timestamps, const OptTensor &time_bias,
                  const OptTensor &bucket_bounds) {
    check(q, op, "q", FLOATS);
    for (auto *t : {&k, &v}) check(*t, op, "k and v", {q.scalar_type()});
    for (auto *t : {&q, &k, &v})
        TORCH_CHECK_VALUE(t->dim() == 3 && t->stride(2) == 1, "recompile_native.", op,
                          ": q, k and v must be [T, H, D] with unit stride in D");
    check(offsets, op, "offsets", {I64});
    check(num_targets, op, "num_targets", {I64});
    check(timestamps, op, "timestamps", {I64});
    for (auto *t : {&rel_bias, &time_bias, &bucket_bounds}) check(*t, op, "the biases", {F32});
    TORCH_CHECK_VALUE(!time_bias == !bucket_bounds, "recompile_native.", op, ": time_bias needs bucket_bounds");
    hstu_problem p{};
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.q_stride[0] = q.stride(0), p.q_stride[1] = q.stride(1);
    p.k_stride[0] = k.stride(0), p.k_stride[1] = k.stride(1);
    p.v_stride[0] = v.stride(0), p.v_stride[1] = v.stride(1);
    p.offsets = ptr<int64_t>(offsets);
    p.total = q.size(0), p.batch = offsets.numel() - 1, p.heads = q.size(1), p.dim = q.size(2), p.dim_v = v.size(2);
    p.max_seq_len = max_seq_len, p.alpha = (float)alpha, p.causal = causal, p.contextual = contextual;
    p.num_targets = ptr<int64_t>(num_targets), p.rel_bias = ptr<float>(rel_bias);
    p.timestamps = ptr<int64_t>(timestamps), p.time_bias = ptr<float>(time_bias);
    p.bucket_bounds = ptr<float>(bucket_bounds);
    p.num_buckets = time_bias && time_bias->defined() ? time_bias->numel() - 1 : 0;
    p.dtype = hstu_dtype(q.scalar_type()), p.threads = threads();
    return p;
}

void hstu_status(const char *op, int status) {
    TORCH_CHECK(status != -1, "recompile_native.", op, ": out of memory for the per-thread tiles");
    TORCH_CHECK_VALUE(status != -2, "recompile_native.", op, ": offsets must be non-decreasing within [0, total]");
    TORCH_CHECK_VALUE(status != -3, "recompile_native.", op,
                      ": a sequence is longer than max_seq_len, beyond the relative position bias");
}

Tensor hstu_attention_fwd(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &offsets, int64_t max_seq_len,
                          double alpha, bool causal, const OptTensor &num_targets, int64_t contextual,
                          const OptTensor &rel_bias, const OptTensor &timestamps, const OptTensor &time_bias,
                          const OptTensor &bucket_bounds) {
    hstu_problem p = hstu("hstu_attention_fwd", q, k, v, offsets, max_seq_len, alpha, causal, num_targets,
                          contextual, rel_bias, timestamps, time_bias, bucket_bounds);
    Tensor out = at::empty(v.sizes(), v.options());
    p.out = out.data_ptr();
    hstu_status("hstu_attention_fwd", kernels().hstu_attention_fwd(&p));
    return out;
}

/* (dq, dk, dv, drel, dtime): the bias gradients float32 of the padded biases' unpadded sizes, empty when absent. */
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_attention_bwd(
    const Tensor &grad, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &offsets, int64_t max_seq_len,
    double alpha, bool causal, const OptTensor &num_targets, int64_t contextual, const OptTensor &rel_bias,
    const OptTensor &timestamps, const OptTensor &time_bias, const OptTensor &bucket_bounds) {
    hstu_problem p = hstu("hstu_attention_bwd", q, k, v, offsets, max_seq_len, alpha, causal, num_targets,
                          contextual, rel_bias, timestamps, time_bias, bucket_bounds);
    check(grad, "hstu_attention_bwd", "grad", {q.scalar_type()});
    TORCH_CHECK_VALUE(grad.dim() == 3 && grad.stride(2) == 1, "recompile_native.hstu_attention_bwd: grad must be "
                      "[T, H, Dv] with unit stride in Dv");
    p.grad = grad.data_ptr(), p.grad_stride[0] = grad.stride(0), p.grad_stride[1] = grad.stride(1);
    Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), q.options()),
           dv = at::empty(v.sizes(), q.options());
    const auto f32 = q.options().dtype(F32);
    Tensor drel = rel_bias ? at::zeros({rel_bias->numel() - VECTOR_PAD}, f32) : at::empty({0}, f32);
    Tensor dtime = time_bias ? at::zeros({time_bias->numel()}, f32) : at::empty({0}, f32);
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    p.drel = rel_bias ? ptr<float>(drel) : nullptr, p.dtime = time_bias ? ptr<float>(dtime) : nullptr;
    hstu_status("hstu_attention_bwd", kernels().hstu_attention_bwd(&p));
    return {dq, dk, dv, drel, dtime};
}

/* ---------------------------------------------------------------------------- padded softmax attention */

/* Why the kernel cannot take these (nullptr: it can): q [B, H, nq, D], k [B, H, n, D], v [B, H, n, Dv] of one
 * float dtype, an additive float mask [B|1, H|1, nq|1, n], integer rows [B] of a self-attention (nq = n). */
const char *padded_attention_fault(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &mask,
                                   const OptTensor &rows) {
    if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return "q, k and v must be [B, H, N, D]";
    if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || k.size(1) != q.size(1) || v.size(1) != q.size(1) ||
        k.size(2) != v.size(2) || k.size(3) != q.size(3))
        return "k must be [B, H, N, D] and v [B, H, N, Dv] with q's B, H and D";
    if (mask.dim() != 4 || !mask.is_floating_point() || mask.size(3) != k.size(2))
        return "the mask must be an additive float [B|1, H|1, Nq|1, N] tensor";
    for (int d = 0; d < 3; d++)
        if (mask.size(d) != 1 && mask.size(d) != q.size(d)) return "the mask must broadcast to [B, H, Nq, N]";
    if (rows && rows->defined() &&
        (rows->dim() != 1 || rows->numel() != q.size(0) || rows->is_floating_point() || q.size(2) != k.size(2)))
        return "rows must be integer [B] read rows of a self-attention (Nq = N)";
    return nullptr;
}

/* The problem of a call, and the tensors it reads (q, k, v, grad with unit stride rows, the mask float32, rows
 * int64), kept alive with it. */
struct PaddedAttention {
    Tensor q, k, v, grad, mask, rows;
    padded_attention_problem p{};

    PaddedAttention(const char *op, const Tensor &q_, const Tensor &k_, const Tensor &v_, const Tensor &mask_,
                    double scale, const OptTensor &rows_, const OptTensor &grad_ = std::nullopt) {
        check(q_, op, "q", FLOATS);
        for (auto *t : {&k_, &v_}) check(*t, op, "k and v", {q_.scalar_type()});
        check(grad_, op, "grad", {q_.scalar_type()});
        check(mask_, op, "mask", FLOATS);
        const char *fault = padded_attention_fault(q_, k_, v_, mask_, rows_);
        TORCH_CHECK_VALUE(!fault, "recompile_native.", op, ": ", fault, "; got q ", q_.sizes(), ", k ", k_.sizes(),
                          ", v ", v_.sizes(), ", mask ", mask_.sizes());
        q = unit_rows(q_), k = unit_rows(k_), v = unit_rows(v_), mask = mask_.to(F32);
        const int64_t B = q.size(0), H = q.size(1);
        for (int d = 0; d < 3; d++) {
            p.q_stride[d] = q.stride(d), p.k_stride[d] = k.stride(d), p.v_stride[d] = v.stride(d);
            p.mask_stride[d] = mask.size(d) == 1 ? 0 : mask.stride(d);
        }
        p.mask_stride[3] = mask.stride(3);
        if (grad_) {
            TORCH_CHECK_VALUE(grad_->sizes() == at::IntArrayRef({B, H, q.size(2), v.size(3)}), "recompile_native.",
                              op, ": grad must be [B, H, Nq, Dv] = ", at::IntArrayRef({B, H, q.size(2), v.size(3)}),
                              ", got ", grad_->sizes());
            grad = unit_rows(*grad_);
            for (int d = 0; d < 3; d++) p.grad_stride[d] = grad.stride(d);
            p.grad = grad.data_ptr();
        }
        if (rows_ && rows_->defined()) rows = rows_->to(I64).contiguous();
        p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.mask = ptr<float>(mask);
        p.mask_heads = mask.size(1), p.rows = rows.defined() ? ptr<int64_t>(rows) : nullptr;
        p.dropped = mask_.scalar_type() == BF16 ? (float)c10::BFloat16(-1e4f)  // -9984: as the op compares
                    : mask_.scalar_type() == F16 ? (float)c10::Half(-1e4f) : -1e4f;
        p.batch = B, p.heads = H, p.nq = q.size(2), p.n = k.size(2), p.dim = q.size(3), p.dim_v = v.size(3);
        p.scale = (float)scale, p.dtype = hstu_dtype(q.scalar_type()), p.threads = threads();
    }

    static Tensor unit_rows(const Tensor &t) { return t.stride(-1) == 1 || t.size(-1) <= 1 ? t : t.contiguous(); }
};

void padded_attention_status(const char *op, int status) {
    TORCH_CHECK(status == 0, "recompile_native.", op, ": out of memory for the per-thread buffers");
}

Tensor padded_attention_fwd(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &mask, double scale,
                            const OptTensor &rows) {
    PaddedAttention a("padded_attention_fwd", q, k, v, mask, scale, rows);
    Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
    a.p.out = out.data_ptr();
    padded_attention_status("padded_attention_fwd", kernels().padded_attention_fwd(&a.p));
    return out;
}

std::tuple<Tensor, Tensor, Tensor> padded_attention_bwd(const Tensor &grad, const Tensor &q, const Tensor &k,
                                                        const Tensor &v, const Tensor &mask, double scale,
                                                        const OptTensor &rows) {
    PaddedAttention a("padded_attention_bwd", q, k, v, mask, scale, rows, grad);
    Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), q.options()),
           dv = at::empty(v.sizes(), q.options());
    a.p.dq = dq.data_ptr(), a.p.dk = dk.data_ptr(), a.p.dv = dv.data_ptr();
    padded_attention_status("padded_attention_bwd", kernels().padded_attention_bwd(&a.p));
    return {dq, dk, dv};
}

/* ------------------------------------------------------------------------------------ sampled softmax */

sampled_softmax_problem softmax_problem(const char *op, const Tensor &pos, const Tensor &neg, const OptTensor &sorted,
                                        const OptTensor &order, const OptTensor &targets, double scale) {
    for (auto *t : {&pos, &neg}) check(*t, op, "pos and neg", {F32});
    TORCH_CHECK_VALUE(neg.dim() == 2 && pos.numel() == neg.size(0) && pos.is_contiguous() && neg.is_contiguous(),
                      "recompile_native.", op, ": pos [N, 1] and neg [N, K], contiguous");
    for (auto *t : {&sorted, &order, &targets}) check(*t, op, "the ids", {I64});
    TORCH_CHECK_VALUE(!sorted == !order && !sorted == !targets, "recompile_native.", op,
                      ": sorted, order and targets come together");
    return {ptr<float>(pos), ptr<float>(neg), ptr<int64_t>(sorted), ptr<int64_t>(order), ptr<int64_t>(targets),
            neg.size(0), neg.size(1), (float)scale};
}

std::tuple<Tensor, Tensor> sampled_softmax_fwd(const Tensor &pos, const Tensor &neg, const OptTensor &sorted,
                                               const OptTensor &order, const OptTensor &targets, double scale) {
    auto p = softmax_problem("sampled_softmax_fwd", pos, neg, sorted, order, targets, scale);
    Tensor loss = at::empty({neg.size(0)}, neg.options()), lse = at::empty({neg.size(0)}, neg.options());
    TORCH_CHECK(!kernels().sampled_softmax_fwd(p, ptr<float>(loss), ptr<float>(lse), threads()),
                "recompile_native.sampled_softmax_fwd: out of memory for a row buffer");
    return {loss, lse};
}

std::tuple<Tensor, Tensor> sampled_softmax_bwd(const Tensor &grad, const Tensor &pos, const Tensor &neg,
                                               const OptTensor &sorted, const OptTensor &order,
                                               const OptTensor &targets, const Tensor &lse, double scale) {
    auto p = softmax_problem("sampled_softmax_bwd", pos, neg, sorted, order, targets, scale);
    for (auto *t : {&grad, &lse}) check(*t, "sampled_softmax_bwd", "grad and lse", {F32});
    const Tensor g = grad.contiguous(), l = lse.contiguous();
    Tensor grad_pos = at::empty(pos.sizes(), pos.options()), grad_neg = at::empty(neg.sizes(), neg.options());
    kernels().sampled_softmax_bwd(p, ptr<float>(g), ptr<float>(l), ptr<float>(grad_pos), ptr<float>(grad_neg),
                                  threads());
    return {grad_pos, grad_neg};
}

/* ------------------------------------------------------------------ the custom ops' native kernel, below autograd
 *
 * The Python custom ops of runtime/ (torch.ops.recompile.*) whose ``native`` kernel is one operator here also get
 * that kernel below autograd (the ADInplaceOrView key): with impl "native" and plain CPU tensors of the kernel's
 * dtypes it runs here, else (other kernels, other dtypes, fake, functional or batched tensors) the call goes on to
 * the op's Python implementation, which raises on bad input. Calls from compiled graphs then skip the Python
 * layers under autograd. */
const c10::DispatchKeySet WRAPPED({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                   c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                   c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});

bool plain_cpu(const Tensor &t, std::initializer_list<at::ScalarType> dtypes) {
    bool dtype_ok = false;
    for (auto d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
    return t.defined() && dtype_ok && t.device().is_cpu() && t.layout() == at::kStrided && !t.key_set().has_any(WRAPPED);
}

/* Replace the N arguments on the stack by the results. */
template <class... Results>
bool returned(torch::jit::Stack *stack, size_t n, Results &&...results) {
    torch::jit::drop(*stack, n);
    (torch::jit::push(*stack, std::forward<Results>(results)), ...);
    return true;
}

/* recompile::dropout(Tensor x, float p, Tensor seed, str impl) -> Tensor */
bool dropout_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 4);
    const double p = a[1].toDouble();
    if (a[3].toStringRef() != "native" || !plain_cpu(a[0].toTensor(), {F32}) || !plain_cpu(a[2].toTensor(), {I64}) ||
        a[2].toTensor().numel() != 2 || !(p >= 0.0 && p < 1.0))
        return false;
    return returned(stack, 4, dropout(a[0].toTensor(), a[2].toTensor(), p));
}

/* recompile::fm_second_order(Tensor v, bool reduce, str impl) -> Tensor */
bool fm_second_order_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 3);
    if (a[2].toStringRef() != "native" || !plain_cpu(a[0].toTensor(), FLOATS) || a[0].toTensor().dim() != 3)
        return false;
    return returned(stack, 3, fm_second_order_fwd(a[0].toTensor(), a[1].toBool()));
}

/* recompile::fm_second_order_backward(Tensor grad, Tensor v, bool reduce, str impl) -> Tensor */
bool fm_second_order_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 4);
    const Tensor grad = a[0].toTensor(), v = a[1].toTensor();
    if (a[3].toStringRef() != "native" || !plain_cpu(v, FLOATS) || !plain_cpu(grad, {v.scalar_type()}) ||
        v.dim() != 3 || grad.dim() != 2 || grad.size(0) != v.size(0) || grad.size(1) != (a[2].toBool() ? 1 : v.size(2)))
        return false;
    return returned(stack, 4, fm_second_order_bwd(grad, v, a[2].toBool()));
}

/* recompile::padded_softmax_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, str impl,
 * Tensor? rows) -> Tensor */
bool padded_attention_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 7);
    const Tensor q = a[0].toTensor(), k = a[1].toTensor(), v = a[2].toTensor(), mask = a[3].toTensor();
    const OptTensor rows = a[6].isNone() ? OptTensor() : a[6].toTensor();
    if (a[5].toStringRef() != "native" || !plain_cpu(q, FLOATS) || !plain_cpu(k, {q.scalar_type()}) ||
        !plain_cpu(v, {q.scalar_type()}) || !plain_cpu(mask, FLOATS) || (rows && !plain_cpu(*rows, {I64, I32})) ||
        padded_attention_fault(q, k, v, mask, rows))
        return false;
    return returned(stack, 7, padded_attention_fwd(q, k, v, mask, a[4].toDouble(), rows));
}

/* recompile::padded_softmax_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor mask, float scale,
 * str impl, Tensor? rows) -> (Tensor, Tensor, Tensor) */
bool padded_attention_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 8);
    const Tensor grad = a[0].toTensor(), q = a[1].toTensor(), k = a[2].toTensor(), v = a[3].toTensor(),
                 mask = a[4].toTensor();
    const OptTensor rows = a[7].isNone() ? OptTensor() : a[7].toTensor();
    if (a[6].toStringRef() != "native" || !plain_cpu(q, FLOATS) || !plain_cpu(k, {q.scalar_type()}) ||
        !plain_cpu(v, {q.scalar_type()}) || !plain_cpu(grad, {q.scalar_type()}) || !plain_cpu(mask, FLOATS) ||
        (rows && !plain_cpu(*rows, {I64, I32})) || padded_attention_fault(q, k, v, mask, rows) ||
        grad.sizes() != at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}))
        return false;
    auto [dq, dk, dv] = padded_attention_bwd(grad, q, k, v, mask, a[5].toDouble(), rows);
    return returned(stack, 8, dq, dk, dv);
}

/* The kernel's view of sampled_softmax_loss's (pos, neg, neg_ids, target_ids), as runtime/sampled_softmax.py's
 * _problem makes it: pos [N, 1] and neg [N, K] float32, contiguous; the negative ids sorted (with their order) and
 * the targets int64, or none of them. False for anything else (the Python op takes it). */
struct SoftmaxInputs {
    Tensor pos, neg;
    OptTensor sorted, order, targets;

    bool read(const c10::IValue &pos_, const c10::IValue &neg_, const c10::IValue &neg_ids, const c10::IValue &target_ids) {
        pos = pos_.toTensor(), neg = neg_.toTensor();
        if (!plain_cpu(pos, {F32}) || !plain_cpu(neg, {F32}) || neg.dim() != 2 || pos.dim() != 2 ||
            pos.size(0) != neg.size(0) || pos.size(1) != 1 || neg_ids.isNone() != target_ids.isNone())
            return false;
        pos = pos.contiguous(), neg = neg.contiguous();
        if (neg_ids.isNone()) return true;
        const Tensor ids = neg_ids.toTensor(), target = target_ids.toTensor();
        if (!plain_cpu(ids, {I64, I32}) || !plain_cpu(target, {I64, I32}) || ids.dim() != 1 || ids.size(0) != neg.size(1) ||
            target.dim() != 1 || target.size(0) != neg.size(0))
            return false;
        auto [s, o] = ids.to(I64).sort();
        sorted = s, order = o, targets = target.to(I64).contiguous();
        return true;
    }
};

/* recompile::sampled_softmax_loss(Tensor pos, Tensor neg, Tensor? neg_ids, Tensor? target_ids, float scale,
 * str impl) -> (Tensor, Tensor) */
bool sampled_softmax_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 6);
    SoftmaxInputs in;
    if (a[5].toStringRef() != "native" || !in.read(a[0], a[1], a[2], a[3])) return false;
    auto [loss, lse] = sampled_softmax_fwd(in.pos, in.neg, in.sorted, in.order, in.targets, a[4].toDouble());
    return returned(stack, 6, loss, lse);
}

/* recompile::sampled_softmax_loss_backward(Tensor grad, Tensor pos, Tensor neg, Tensor? neg_ids,
 * Tensor? target_ids, Tensor lse, float scale, str impl) -> (Tensor, Tensor) */
bool sampled_softmax_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 8);
    SoftmaxInputs in;
    if (a[7].toStringRef() != "native" || !in.read(a[1], a[2], a[3], a[4])) return false;
    const Tensor grad = a[0].toTensor(), lse = a[5].toTensor();
    const int64_t N = in.neg.size(0);
    if (!plain_cpu(grad, {F32}) || !plain_cpu(lse, {F32}) || grad.dim() != 1 || grad.size(0) != N || lse.dim() != 1 ||
        lse.size(0) != N)
        return false;
    auto [grad_pos, grad_neg] =
        sampled_softmax_bwd(grad, in.pos, in.neg, in.sorted, in.order, in.targets, lse, a[6].toDouble());
    return returned(stack, 8, grad_pos, grad_neg);
}

/* The layers' [D] vectors of one dtype (weights or biases of recompile::vector_cross: [D], [1, D] or [D, 1]) as
   float [L, Dp], rows zero-padded to a multiple of 16; an undefined tensor when they do not fit. Written by one
   loop per layer (no ATen op per layer: at batch 1 those were most of the call). */
Tensor vector_rows(const std::vector<Tensor> &params, int64_t D, at::ScalarType dtype) {
    const int64_t L = (int64_t)params.size(), Dp = (D + 15) / 16 * 16;
    for (const Tensor &p : params)
        if (!plain_cpu(p, {dtype}) || p.dim() > 2 || p.numel() != D) return Tensor();
    Tensor rows = at::empty({L, Dp}, at::TensorOptions().dtype(F32));
    float *out = ptr<float>(rows);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "vector_rows", [&] {
        for (int64_t l = 0; l < L; l++) {
            const Tensor c = params[l].contiguous();
            const scalar_t *p = ptr<const scalar_t>(c);
            float *row = out + l * Dp;
            for (int64_t d = 0; d < D; d++) row[d] = static_cast<float>(p[d]);
            std::fill(row + D, row + Dp, 0.f);
        }
    });
    return rows;
}

/* Fresh tensors shaped like params (in their dtype) from the first D columns of the float rows. */
std::vector<Tensor> vector_grads(const Tensor &rows, const std::vector<Tensor> &params, int64_t D) {
    std::vector<Tensor> out;
    const float *in = ptr<const float>(rows);
    for (size_t l = 0; l < params.size(); l++) {
        Tensor g = at::empty(params[l].sizes(), params[l].options());
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "vector_grads", [&] {
            scalar_t *o = ptr<scalar_t>(g);
            for (int64_t d = 0; d < D; d++) o[d] = static_cast<scalar_t>(in[l * rows.size(1) + d]);
        });
        out.push_back(std::move(g));
    }
    return out;
}

/* (W, bias, B, D) of a recompile::vector_cross call the native kernel takes (x0, x and the rows given plain CPU
   tensors of one dtype, x [B, D], L weights and L or no biases of D elements); W undefined when it does not. */
std::tuple<Tensor, OptTensor> vector_cross_args(std::initializer_list<const Tensor *> rows,
                                                const std::vector<Tensor> &weights, const std::vector<Tensor> &biases) {
    const Tensor &x = **rows.begin();
    bool ok = plain_cpu(x, FLOATS) && x.dim() == 2 && !weights.empty() &&
              (biases.empty() || biases.size() == weights.size());
    for (auto *t : rows) ok = ok && plain_cpu(*t, {x.scalar_type()}) && t->sizes() == x.sizes();
    if (!ok) return {Tensor(), std::nullopt};
    Tensor W = vector_rows(weights, x.size(1), x.scalar_type());
    OptTensor bias;
    if (!biases.empty()) bias = vector_rows(biases, x.size(1), x.scalar_type());
    if (bias && !bias->defined()) W = Tensor();
    return {W, bias};
}

/* recompile::vector_cross(Tensor x0, Tensor x, Tensor[] weights, Tensor[] biases, str impl) -> Tensor */
bool vector_cross_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 5);
    if (a[4].toStringRef() != "native") return false;
    const Tensor x0 = a[0].toTensor(), x = a[1].toTensor();
    auto [W, bias] = vector_cross_args({&x, &x0}, a[2].toTensorVector(), a[3].toTensorVector());
    if (!W.defined()) return false;
    Tensor out = at::empty(x.sizes(), x.options());
    vector_cross_fwd(x0.contiguous(), x.contiguous(), W, bias, out);
    return returned(stack, 5, out);
}

/* recompile::vector_cross_backward(Tensor grad, Tensor x0, Tensor x, Tensor[] weights, Tensor[] biases, str impl)
 * -> (Tensor, Tensor, Tensor[], Tensor[]) */
bool vector_cross_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 6);
    if (a[5].toStringRef() != "native") return false;
    const Tensor grad = a[0].toTensor(), x0 = a[1].toTensor(), x = a[2].toTensor();
    const std::vector<Tensor> weights = a[3].toTensorVector(), biases = a[4].toTensorVector();
    auto [W, bias] = vector_cross_args({&x, &x0, &grad}, weights, biases);
    if (!W.defined()) return false;
    Tensor grad_x0 = at::empty(x.sizes(), x.options()), grad_x = at::empty(x.sizes(), x.options());
    Tensor grad_W = at::empty(W.sizes(), W.options());
    OptTensor grad_bias;
    if (bias) grad_bias = at::empty(W.sizes(), W.options());
    vector_cross_bwd(grad.contiguous(), x0.contiguous(), x.contiguous(), W, bias, grad_x0, grad_x, grad_W, grad_bias);
    const int64_t D = x.size(1);
    return returned(stack, 6, grad_x0, grad_x, vector_grads(grad_W, weights, D),
                    bias ? vector_grads(*grad_bias, biases, D) : std::vector<Tensor>());
}

/* Layer l's matrix as float rows [K, Dp] of a [L, K, Dp] tensor (zero-padded, Dp: D padded to a multiple of 16):
   p_l[k, d] (downs, [K, D]) or, ``transposed``, p_l[d, k] (weights, [D, K]), read through their strides; undefined
   when one is not a plain CPU tensor of that shape and ``dtype``. */
Tensor cross_rows(const std::vector<Tensor> &params, bool transposed, int64_t K, int64_t D, at::ScalarType dtype) {
    const int64_t L = (int64_t)params.size(), Dp = (D + 15) / 16 * 16;
    for (const Tensor &p : params)
        if (!plain_cpu(p, {dtype}) || p.dim() != 2 || p.size(0) != (transposed ? D : K) ||
            p.size(1) != (transposed ? K : D))
            return Tensor();
    Tensor rows = at::zeros({L, K, Dp}, at::TensorOptions().dtype(F32));
    float *out = ptr<float>(rows);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "cross_rows", [&] {
        for (int64_t l = 0; l < L; l++) {
            const scalar_t *p = ptr<const scalar_t>(params[l]);
            const int64_t sk = params[l].stride(transposed ? 1 : 0), sd = params[l].stride(transposed ? 0 : 1);
            for (int64_t k = 0; k < K; k++)
                for (int64_t d = 0; d < D; d++) out[(l * K + k) * Dp + d] = static_cast<float>(p[k * sk + d * sd]);
        }
    });
    return rows;
}

/* The fused cross stack (interaction.h cross_stack_fwd) takes layers of up to CROSS_FUSED_FLOATS weight floats
   (K * Dp: they stay in L2 across the row tiles); larger ones run as GEMMs (runtime/interaction_native.py). */
constexpr int64_t CROSS_FUSED_FLOATS = 16384;
bool cross_stack_fused(int64_t K, int64_t D) { return K > 0 && K * ((D + 15) / 16 * 16) <= CROSS_FUSED_FLOATS; }

/* (x_L, saved) of recompile::cross_stack in one fused pass; x_L undefined when the arguments are not plain CPU
   tensors of one float dtype the kernel reads: x0, x [B, D], L weights [D, K], L or no biases [D], L or no downs
   [K, D] (K = D without), K * Dp within CROSS_FUSED_FLOATS. ``saved`` as runtime/interaction.py's stack_saved reads
   it: h_l + b_l for every layer, then x_1 .. x_{L-1}. */
std::tuple<Tensor, std::vector<Tensor>> cross_stack_try(const Tensor &x0, const Tensor &x,
                                                        const std::vector<Tensor> &weights,
                                                        const std::vector<Tensor> &biases,
                                                        const std::vector<Tensor> &downs, bool save) {
    const int64_t L = (int64_t)weights.size();
    if (!plain_cpu(x, FLOATS) || x.dim() != 2 || !plain_cpu(x0, {x.scalar_type()}) || x0.sizes() != x.sizes() ||
        L == 0 || (!biases.empty() && (int64_t)biases.size() != L) || (!downs.empty() && (int64_t)downs.size() != L))
        return {};
    const at::ScalarType dtype = x.scalar_type();
    const int64_t B = x.size(0), D = x.size(1), Dp = (D + 15) / 16 * 16;
    const int64_t K = downs.empty() ? D : downs[0].dim() == 2 ? downs[0].size(0) : 0;
    if (!cross_stack_fused(K, D)) return {};
    for (const Tensor &b : biases)
        if (b.dim() != 1) return {};
    const Tensor Ut = cross_rows(weights, true, K, D, dtype);
    const OptTensor V = downs.empty() ? OptTensor() : OptTensor(cross_rows(downs, false, K, D, dtype));
    const OptTensor bias = biases.empty() ? OptTensor() : OptTensor(vector_rows(biases, D, dtype));
    if (!Ut.defined() || (V && !V->defined()) || (bias && !bias->defined())) return {};
    const Tensor xc = x.contiguous(), x0c = x0.contiguous();
    Tensor out = at::empty({B, D}, x.options());
    std::vector<Tensor> saved;
    std::vector<void *> rows;  /* the saved tensors' data: h_l + b_l, then the inputs */
    for (int64_t i = 0; save && i < 2 * L - 1; i++) {
        saved.push_back(at::empty({B, D}, x.options()));
        rows.push_back(saved.back().data_ptr());
    }
    BY_DTYPE(dtype, cross_stack_fwd, T, ptr<const T>(x0c), ptr<const T>(xc), ptr<const float>(Ut),
             ptr<const float>(V), ptr<const float>(bias), L, K, Dp, ptr<T>(out),
             save ? (T *const *)rows.data() : nullptr, save ? (T *const *)rows.data() + L : nullptr, B, D, threads());
    return {out, saved};
}

std::tuple<Tensor, std::vector<Tensor>> cross_stack_fwd(const Tensor &x0, const Tensor &x,
                                                        const std::vector<Tensor> &weights,
                                                        const std::vector<Tensor> &biases,
                                                        const std::vector<Tensor> &downs, bool save) {
    auto result = cross_stack_try(x0, x, weights, biases, downs, save);
    TORCH_CHECK_VALUE(std::get<0>(result).defined(), "recompile_native.cross_stack_fwd: expected CPU tensors of one "
                      "float dtype: x0, x [B, D], L weights [D, K], L or no biases [D], L or no downs [K, D] (K = D "
                      "without), K * D within ", CROSS_FUSED_FLOATS, " (cross_stack_fused); got x ", x.sizes(), " ",
                      x.scalar_type(), ", ", weights.size(), " weights, ", biases.size(), " biases, ", downs.size(),
                      " downs");
    return result;
}

/* recompile::cross_stack_backward(Tensor grad, Tensor x0, Tensor x, Tensor[] weights, Tensor[] downs,
 * Tensor[] saved, bool has_bias) -> (Tensor, Tensor, Tensor[], Tensor[], Tensor[]): runtime/interaction.py's
 * cross_stack_backward, the same ATen calls made from C++ (no Python per call), for plain CPU tensors of one float
 * dtype; anything else goes on to the Python op. */
bool cross_stack_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 7);
    const Tensor grad = a[0].toTensor(), x0 = a[1].toTensor(), x = a[2].toTensor();
    const std::vector<Tensor> weights = a[3].toTensorVector(), downs = a[4].toTensorVector(),
                              saved = a[5].toTensorVector();
    const bool has_bias = a[6].toBool();
    const int64_t L = (int64_t)weights.size();
    bool ok = plain_cpu(grad, FLOATS) && L > 0 && (int64_t)saved.size() == 2 * L - 1 &&
              (downs.empty() || (int64_t)downs.size() == L);
    for (const auto *list : {&weights, &downs, &saved})
        for (const Tensor &t : *list) ok = ok && plain_cpu(t, {grad.scalar_type()});
    if (!ok || !plain_cpu(x0, {grad.scalar_type()}) || !plain_cpu(x, {grad.scalar_type()})) return false;
    Tensor grad_x0, g = grad;
    std::vector<Tensor> grad_weights(L), grad_biases(has_bias ? L : 0), grad_downs(downs.size());
    for (int64_t l = L - 1; l >= 0; l--) {
        const Tensor &x_in = l == 0 ? x : saved[L + l - 1], &hb = saved[l];
        Tensor grad_hb = g.mul(x0);
        grad_x0 = grad_x0.defined() ? grad_x0.addcmul_(g, hb) : g.mul(hb);
        grad_weights[l] = at::mm(grad_hb.t(), downs.empty() ? x_in : at::mm(x_in, downs[l].t()));
        if (has_bias) grad_biases[l] = grad_hb.sum(0);
        Tensor weight = weights[l];
        if (!downs.empty()) {
            const Tensor grad_z = at::mm(grad_hb, weights[l]);
            grad_downs[l] = at::mm(grad_z.t(), x_in);
            grad_hb = grad_z, weight = downs[l];
        }
        g = g.is_same(grad) ? at::addmm(g, grad_hb, weight) : g.addmm_(grad_hb, weight);  // g is ours after one
    }
    return returned(stack, 7, grad_x0, g.is_same(grad) ? g.clone() : g, grad_weights, grad_biases, grad_downs);
}

/* recompile::cross_stack(Tensor x0, Tensor x, Tensor[] weights, Tensor[] biases, Tensor[] downs, bool save,
 * str impl) -> (Tensor, Tensor[]) */
bool cross_stack_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 7);
    if (a[6].toStringRef() != "native") return false;
    auto [out, saved] = cross_stack_try(a[0].toTensor(), a[1].toTensor(), a[2].toTensorVector(),
                                        a[3].toTensorVector(), a[4].toTensorVector(), a[5].toBool());
    if (!out.defined()) return false;
    return returned(stack, 7, out, saved);
}

/* The output of recompile::cross_mixture's inference (save false) in one fused pass (interaction.h
   cross_mixture_fwd); undefined when the arguments are not plain CPU tensors of one float dtype the kernel reads:
   x0, x [B, D], gate [E, D], E downs [r, D], E or no mids [r, r], E ups [D, r], E or no biases [D], activation
   relu or identity, (E r + E) x Dp within CROSS_FUSED_FLOATS. */
Tensor cross_mixture_try(const Tensor &x0, const Tensor &x, const Tensor &gate, const std::vector<Tensor> &downs,
                         const std::vector<Tensor> &mids, const std::vector<Tensor> &ups,
                         const std::vector<Tensor> &biases, const std::string &activation, bool save) {
    const int64_t E = (int64_t)downs.size();
    if (save || (activation != "relu" && activation != "identity") || !plain_cpu(x, FLOATS) || x.dim() != 2 ||
        !plain_cpu(x0, {x.scalar_type()}) || x0.sizes() != x.sizes() || E == 0 || (int64_t)ups.size() != E ||
        (!mids.empty() && (int64_t)mids.size() != E) || (!biases.empty() && (int64_t)biases.size() != E) ||
        downs[0].dim() != 2)
        return Tensor();
    const at::ScalarType dtype = x.scalar_type();
    const int64_t B = x.size(0), D = x.size(1), Dp = (D + 15) / 16 * 16, rank = downs[0].size(0);
    const int64_t K = E * rank + (biases.empty() ? 0 : E);
    if (!cross_stack_fused(E * rank + E, D)) return Tensor();
    for (const Tensor &b : biases)
        if (b.dim() != 1) return Tensor();
    const Tensor V = cross_rows(downs, false, rank, D, dtype), G = cross_rows({gate}, false, E, D, dtype);
    const OptTensor C = mids.empty() ? OptTensor() : OptTensor(cross_rows(mids, false, rank, rank, dtype));
    Tensor Ut = cross_rows(ups, true, rank, D, dtype);
    const Tensor bias = biases.empty() ? Tensor() : vector_rows(biases, D, dtype);
    if (!V.defined() || !G.defined() || !Ut.defined() || (C && !C->defined()) || (!biases.empty() && !bias.defined()))
        return Tensor();
    if (bias.defined()) Ut = at::cat({Ut.view({E * rank, Dp}), bias});
    const Tensor xc = x.contiguous(), x0c = x0.contiguous();
    Tensor out = at::empty({B, D}, x.options());
    BY_DTYPE(dtype, cross_mixture_fwd, T, ptr<const T>(x0c), ptr<const T>(xc), ptr<const float>(V),
             ptr<const float>(G), ptr<const float>(C), C ? C->size(2) : 0, ptr<const float>(Ut), E, rank, K,
             activation == "relu", Dp, ptr<T>(out), B, D, threads());
    return out;
}

Tensor cross_mixture_fwd(const Tensor &x0, const Tensor &x, const Tensor &gate, const std::vector<Tensor> &downs,
                         const std::vector<Tensor> &mids, const std::vector<Tensor> &ups,
                         const std::vector<Tensor> &biases, const std::string &activation) {
    Tensor out = cross_mixture_try(x0, x, gate, downs, mids, ups, biases, activation, false);
    TORCH_CHECK_VALUE(out.defined(), "recompile_native.cross_mixture_fwd: expected CPU tensors of one float dtype: "
                      "x0, x [B, D], gate [E, D], E downs [r, D], E or no mids [r, r], E ups [D, r], E or no biases "
                      "[D], activation relu or identity, (E r + E) x D within ", CROSS_FUSED_FLOATS,
                      " (cross_stack_fused); got x ", x.sizes(), " ", x.scalar_type(), ", gate ", gate.sizes(), ", ",
                      downs.size(), " downs, ", mids.size(), " mids, ", ups.size(), " ups, ", biases.size(),
                      " biases, ", activation);
    return out;
}

/* recompile::cross_mixture(Tensor x0, Tensor x, Tensor gate, Tensor[] downs, Tensor[] mids, Tensor[] ups,
 * Tensor[] biases, str activation, bool save, str impl) -> (Tensor, Tensor[]): inference calls; a saving one
 * (training: the backward reads the batched torch forward's intermediates) goes on to the Python op. */
bool cross_mixture_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 10);
    if (a[9].toStringRef() != "native") return false;
    Tensor out = cross_mixture_try(a[0].toTensor(), a[1].toTensor(), a[2].toTensor(), a[3].toTensorVector(),
                                   a[4].toTensorVector(), a[5].toTensorVector(), a[6].toTensorVector(),
                                   a[7].toStringRef(), a[8].toBool());
    if (!out.defined()) return false;
    return returned(stack, 10, out, std::vector<Tensor>());
}

/* recompile::dot_interaction(Tensor[] features, Tensor? prefix, bool upper, bool self_interaction, str impl) */
bool dot_interaction_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 5);
    const std::vector<Tensor> items = a[0].toTensorVector();
    FeatureRows rows;
    if (a[4].toStringRef() != "native" || !dot_features(items, rows, true)) return false;
    OptTensor prefix = a[1].isNone() ? std::nullopt : OptTensor(a[1].toTensor());
    if (prefix && (!plain_cpu(*prefix, {items[0].scalar_type()}) || prefix->dim() != 2 ||
                   prefix->size(0) != items[0].size(0)))
        return false;
    return returned(stack, 5, dot_interaction(items, prefix, a[2].toBool(), a[3].toBool()));
}

/* recompile::dot_interaction_backward(Tensor grad, Tensor[] features, int k, bool upper, bool self_interaction,
 * str impl) -> Tensor[] */
bool dot_interaction_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 6);
    const std::vector<Tensor> items = a[1].toTensorVector();
    FeatureRows rows;
    if (a[5].toStringRef() != "native" || !dot_features(items, rows, true)) return false;
    const Tensor grad = a[0].toTensor();
    const int64_t k = a[2].toInt(), pairs = num_pairs(rows.pointer.size(), a[4].toBool());
    if (!plain_cpu(grad, {items[0].scalar_type()}) || grad.dim() != 2 || grad.size(0) != items[0].size(0) ||
        grad.size(1) != k + pairs)
        return false;
    return returned(stack, 6, dot_interaction_backward(grad, items, k, a[3].toBool(), a[4].toBool()));
}

enum Meta { W_PTR, ROWS, DIM, W_STRIDE, IDS, N_IDS, OFFS, N_OFFS, PSW, POOLING, PAD, OUT_AT, FLAGS, META };
constexpr int64_t IDS_I64 = 1, OFFS_I64 = 2, LAST_OFFSET = 4, DTYPE_SHIFT = 3, NONE_POOLING = 2, GRAIN = 2048,
                  STREAM_BYTES = 4 << 20, ERR_OFFSETS = 1;

/* A grouped lookup as the kernels read it: embedding.h's meta rows (as runtime/embedding_native.py's _Plan writes
 * them), the output's rows (bags, or ids for "sequence"), the ids looked up and the "concat" width. */
struct GebPlan {
    std::vector<int64_t> meta;
    at::ScalarType dtype;
    int64_t tables = 0, rows = -1, looked_up = 0, width = 0, dim = 0;
    bool sequence = false, stacked = false;

    int64_t stride() const { return stacked ? tables * dim : sequence ? dim : width; }
};

/* The plan of a lookup's arguments (LOOKUP_SCHEMA: weights, indices, offsets, per_sample_weights, pooling,
 * padding_idx, include_last_offset) for ``layout``; false where they are not plain CPU tensors the kernels read as
 * given. */
bool geb_plan(c10::ArrayRef<c10::IValue> a, const std::string &layout, GebPlan &plan) {
    const auto weights = a[0].toListRef(), indices = a[1].toListRef(), offsets = a[2].toListRef(),
               psws = a[3].toListRef(), pooling = a[4].toListRef(), padding = a[5].toListRef(), last = a[6].toListRef();
    const size_t n = weights.size();
    if (n == 0 || indices.size() != n || offsets.size() != n || psws.size() != n || pooling.size() != n ||
        padding.size() != n || last.size() != n)
        return false;
    const Tensor &first = weights[0].toTensor();
    const at::ScalarType dtype = first.scalar_type();
    const int64_t type_flags = (dtype == F32 ? 0 : dtype == F16 ? 1 : 2) << DTYPE_SHIFT;
    const bool sequence = layout == "sequence", stacked = layout == "stack";
    if (!sequence && !stacked && layout != "concat") return false;
    std::vector<int64_t> meta(META * n, 0);
    int64_t batch = -1, looked_up = 0, width = 0;
    for (size_t t = 0; t < n; t++) {
        const Tensor &w = weights[t].toTensor(), &ids = indices[t].toTensor(), &psw = psws[t].toTensor();
        const int64_t mode = pooling[t].toInt();
        const bool with_last = last[t].toBool();
        if (!plain_cpu(w, FLOATS) || w.scalar_type() != dtype || w.dim() != 2 || w.stride(1) != 1 ||
            !plain_cpu(ids, {I64, I32}) || !ids.is_contiguous() || (layout != "concat" && w.size(1) != first.size(1)))
            return false;
        int64_t *row = meta.data() + META * t, bags, flags = ids.scalar_type() == I64 ? IDS_I64 : 0;
        if (offsets[t].isNone()) {
            if (ids.dim() == 2) bags = ids.size(0), row[N_OFFS] = ids.size(1);
            else if (ids.dim() == 1 && mode == NONE_POOLING) bags = ids.size(0), row[N_OFFS] = 1;
            else return false;
        } else {
            const Tensor &offs = offsets[t].toTensor();
            if (!plain_cpu(offs, {I64, I32}) || ids.dim() != 1 || offs.dim() != 1 || !offs.is_contiguous() ||
                (offs.numel() == 0 && (with_last || ids.numel())))
                return false;
            bags = offs.size(0) - with_last;
            row[OFFS] = reinterpret_cast<int64_t>(offs.data_ptr()), row[N_OFFS] = offs.size(0);
            flags |= (offs.scalar_type() == I64 ? OFFS_I64 : 0) | (with_last ? LAST_OFFSET : 0);
        }
        if (batch >= 0 && bags != batch && !sequence) return false;
        batch = bags;
        if (psw.numel()) {
            if (!plain_cpu(psw, {dtype}) || psw.sizes() != ids.sizes() || !psw.is_contiguous()) return false;
            row[PSW] = reinterpret_cast<int64_t>(psw.data_ptr());
        }
        row[W_PTR] = reinterpret_cast<int64_t>(w.data_ptr()), row[ROWS] = w.size(0), row[DIM] = w.size(1);
        row[W_STRIDE] = w.stride(0), row[POOLING] = mode, row[PAD] = padding[t].toInt();
        row[IDS] = reinterpret_cast<int64_t>(ids.data_ptr()), row[N_IDS] = ids.numel(), row[FLAGS] = flags | type_flags;
        row[OUT_AT] = sequence ? looked_up : stacked ? t * w.size(1) : width;
        looked_up += ids.numel(), width += w.size(1);
    }
    if (batch < 0) return false;
    plan = {std::move(meta), dtype, (int64_t)n, sequence ? looked_up : batch, looked_up, width, first.size(1), sequence,
            stacked};
    return true;
}

/* recompile::grouped_embedding_bag(Tensor[] weights, Tensor[] indices, Tensor?[] offsets, Tensor[] per_sample_weights,
 * int[] pooling, int[] padding_idx, bool[] include_last_offset, bool[] sparse, str layout, str names,
 * str bounds_check, str impl) -> Tensor: the "native" forward with its plan built here. Anything but plain CPU
 * tensors the kernels read as given, and any id or offset the kernel marks, goes on to the Python op (its checks
 * raise or warn, naming the feature; it makes what it can read as given). */
bool grouped_embedding_bag_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 12);
    GebPlan plan;
    if (a[11].toStringRef() != "native" || !geb_plan(a.slice(0, 7), a[8].toStringRef(), plan)) return false;
    const auto options = a[0].toListRef()[0].toTensor().options();
    Tensor out = plan.stacked ? at::empty({plan.rows, plan.tables, plan.dim}, options)
                              : at::empty({plan.rows, plan.sequence ? plan.dim : plan.width}, options);
    std::vector<int64_t> err(plan.tables, 0);
    const int nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(threads(), plan.looked_up / GRAIN));
    if (plan.sequence)
        kernels().geb_forward_sequence(plan.tables, plan.meta.data(), ptr(out), plan.stride(), err.data(), nthreads);
    else
        kernels().geb_forward_pooled(plan.tables, plan.meta.data(), plan.rows, ptr(out), plan.stride(), err.data(),
                                     out.numel() * out.element_size() > STREAM_BYTES, nthreads);
    for (int64_t e : err)
        if (e) return false;  // the Python op runs the checks: they raise or warn naming the feature
    return returned(stack, 12, out);
}

/* recompile::grouped_embedding_bag_backward(Tensor grad, <the lookup>, bool[] sparse, bool[] psw_grad, str layout,
 * str names, str bounds_check, str impl) -> Tensor[]: the "native" backward (runtime/embedding_native.py's
 * backward): per table its dense gradient, or where sparse every id's row gradient; then each sample weight's
 * gradient (empty where not wanted). The gradient is read in place where its rows are dense (a slice of a larger
 * one), else copied. An id out of its table reads row 0 (what the forward looked up unless fatal, when it raised);
 * offsets the kernel rejects go on to the Python op, which raises. */
bool grouped_embedding_bag_backward_native(torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 14);
    GebPlan plan;
    if (a[13].toStringRef() != "native" || !geb_plan(a.slice(1, 7), a[10].toStringRef(), plan)) return false;
    Tensor grad = a[0].toTensor();
    const int64_t cols = plan.stride();  // the output's row width, which the gradient has
    if (!plain_cpu(grad, {plan.dtype}) || grad.dim() != 2 + plan.stacked || grad.size(0) != plan.rows ||
        (plan.stacked ? grad.size(1) != plan.tables || grad.size(2) != plan.dim : grad.size(1) != cols))
        return false;
    const bool dense_rows = grad.stride(-1) == 1 && (!plan.stacked || grad.stride(1) == plan.dim);
    if (!dense_rows || grad.stride(0) < cols) grad = grad.contiguous();
    const auto weights = a[1].toListRef(), psws = a[4].toListRef(), sparse = a[8].toListRef(),
               psw_grad = a[9].toListRef();
    std::vector<Tensor> out(2 * plan.tables);
    std::vector<int64_t> table_out(plan.tables), dense(plan.tables), psw_out(plan.tables), err(plan.tables, 0);
    for (int64_t t = 0; t < plan.tables; t++) {
        const Tensor &w = weights[t].toTensor(), &psw = psws[t].toTensor();
        dense[t] = !sparse[t].toBool();
        out[t] = dense[t] ? at::empty(w.sizes(), w.options())
                          : at::empty({plan.meta[META * t + N_IDS], w.size(1)}, w.options());
        out[plan.tables + t] = psw_grad[t].toBool() ? at::empty(psw.sizes(), psw.options())
                                                    : at::empty({0}, grad.options());
        table_out[t] = reinterpret_cast<int64_t>(out[t].data_ptr());
        psw_out[t] = psw_grad[t].toBool() ? reinterpret_cast<int64_t>(out[plan.tables + t].data_ptr()) : 0;
    }
    kernels().geb_backward(plan.tables, plan.meta.data(), plan.rows, ptr(grad), grad.stride(0), table_out.data(),
                           dense.data(), psw_out.data(), err.data(), threads());
    for (int64_t e : err)
        if (e & ERR_OFFSETS) return false;
    return returned(stack, 14, out);
}

template <bool (*native)(torch::jit::Stack *)>
void below_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    /* a dispatch mode (Python), functionalization or vmap in the keys: the Python implementation */
    if (keys.has_any(WRAPPED) || !native(stack)) op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

/* ------------------------------------------------------------------------ the custom ops' autograd, in C++
 *
 * recompile::grouped_embedding_bag, fm_second_order, cross_stack, cross_mixture, vector_cross and
 * sampled_softmax_loss have their autograd here, for the AutogradCPU key: it comes before the Python formula that
 * runtime/ registers for the Autograd alias (which stays for other devices), so that a CPU call runs no Python (an
 * inference call too: the Python formula's check that there is no gradient to record cost as much as the native
 * cross stack at batch 1). Without a gradient to record the call goes below autograd (the native forward, else the
 * op's Python implementation); with one, a torch::autograd::Function records a node whose backward calls the op's
 * backward op (recompile::<op>_backward, through the dispatcher: its native kernel below autograd too, or the
 * Python op; a compiled graph's backward shows that op). The backward ops are not differentiable
 * (not_differentiable: their AutogradCPU kernel, in C++ too). */

/* The call on ``stack``, below autograd: what a Function's forward runs. */
template <bool (*native)(torch::jit::Stack *)>
struct BelowAutograd {
    const c10::OperatorHandle &op;
    c10::DispatchKeySet keys;
    torch::jit::Stack *stack;

    void operator()() const {
        at::AutoDispatchBelowADInplaceOrView guard;
        below_autograd<native>(op, keys, stack);
    }
};

bool requires_grad(const c10::IValue &tensors) {
    const auto list = tensors.toListRef();
    return std::any_of(list.begin(), list.end(), [](const c10::IValue &t) { return t.toTensor().requires_grad(); });
}

/* The results of ``op`` (a backward op) on ``arguments``. */
std::vector<c10::IValue> call(const c10::OperatorHandle &op, torch::jit::Stack arguments) {
    op.callBoxed(&arguments);
    return arguments;
}

c10::OperatorHandle schema(const char *name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

/* A backward op's AutogradCPU kernel: the call below autograd (the native kernel, else the Python op); where it
 * would be recorded (create_graph), its results (in lists too) get a node that raises naming the op when
 * differentiated, as PyTorch's autogradNotImplementedFallback does (which skips the ADInplaceOrView kernel, so the
 * native one). */
template <bool (*native)(torch::jit::Stack *)>
void not_differentiable(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto &schema = op.schema();
    std::vector<Tensor> inputs;
    if (at::GradMode::is_enabled())
        for (const c10::IValue &a : torch::jit::last(*stack, schema.arguments().size())) {
            std::vector<Tensor> tensors = a.isTensorList() ? a.toTensorVector() : std::vector<Tensor>();
            if (a.isTensor()) tensors.push_back(a.toTensor());
            for (const Tensor &t : tensors)
                if (t.requires_grad()) inputs.push_back(t);
        }
    BelowAutograd<native>{op, keys, stack}();
    if (inputs.empty()) return;
    auto node = c10::make_intrusive<torch::autograd::NotImplemented>(schema.name());
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    for (const c10::IValue &out : torch::jit::last(*stack, schema.returns().size())) {
        std::vector<Tensor> results = out.isTensorList() ? out.toTensorVector() : std::vector<Tensor>();
        if (out.isTensor()) results.push_back(out.toTensor());
        for (Tensor &t : results)
            if (t.defined() && torch::autograd::isDifferentiableType(t.scalar_type())) torch::autograd::set_history(t, node);
    }
}

/* grouped_embedding_bag: the differentiable inputs are the tables and the sample weights; the node's backward
 * builds the tables' and sample weights' gradients as runtime/embedding.py's _backward does. */
enum GebArgument { WEIGHTS, INDICES, OFFSETS, PSWS, POOLING_ARG, PADDING_IDX, LAST_OFFSETS, SPARSE, LAYOUT, NAMES,
                   BOUNDS_CHECK, IMPL, GEB_ARGS };
/* The arguments the backward takes again, by their schema names. */
constexpr std::pair<GebArgument, const char *> GEB_SAVED[] = {
    {POOLING_ARG, "pooling"}, {PADDING_IDX, "padding_idx"}, {LAST_OFFSETS, "include_last_offset"}, {SPARSE, "sparse"},
    {LAYOUT, "layout"}, {NAMES, "names"}, {BOUNDS_CHECK, "bounds_check"}, {IMPL, "impl"}};

struct GroupedEmbeddingBag : torch::autograd::Function<GroupedEmbeddingBag> {
    /* The call itself is on ``below``'s stack. */
    static Tensor forward(torch::autograd::AutogradContext *ctx, at::TensorList weights, at::TensorList psws,
                          const BelowAutograd<&grouped_embedding_bag_native> &below) {
        const auto a = torch::jit::last(*below.stack, GEB_ARGS);
        std::vector<Tensor> saved(weights.begin(), weights.end());
        for (const Tensor &ids : a[INDICES].toTensorVector()) saved.push_back(ids);
        for (const c10::IValue &offs : a[OFFSETS].toListRef()) saved.push_back(offs.isNone() ? Tensor() : offs.toTensor());
        saved.insert(saved.end(), psws.begin(), psws.end());
        ctx->save_for_backward(saved);
        for (const auto &[i, name] : GEB_SAVED) ctx->saved_data[name] = a[i];
        below();
        return below.stack->back().toTensor();
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const size_t n = saved.size() / 4;
        const std::vector<Tensor> weights(saved.begin(), saved.begin() + n), indices(saved.begin() + n, saved.begin() + 2 * n),
            psws(saved.begin() + 3 * n, saved.end());
        c10::List<std::optional<Tensor>> offsets;
        for (size_t t = 0; t < n; t++) offsets.push_back(saved[2 * n + t].defined() ? OptTensor(saved[2 * n + t]) : std::nullopt);
        c10::List<bool> psw_grad;
        for (size_t t = 0; t < n; t++) psw_grad.push_back(psws[t].sym_numel() != 0 && ctx->needs_input_grad(n + t));
        auto &d = ctx->saved_data;
        static const auto op = schema("recompile::grouped_embedding_bag_backward");
        const std::vector<Tensor> out =
            call(op,
                 {grads[0], weights, indices, offsets, psws, d["pooling"], d["padding_idx"], d["include_last_offset"],
                  d["sparse"], psw_grad, d["layout"], d["names"], d["bounds_check"], d["impl"]})[0]
                .toTensorVector();
        const c10::List<bool> sparse = d["sparse"].toBoolList();
        const bool fatal = d["bounds_check"].toStringRef() == "fatal";
        torch::autograd::variable_list result(2 * n + 1);  // the tables', the sample weights', none for ``below``
        for (size_t t = 0; t < n; t++) {
            result[t] = out[t];
            if (!sparse[t]) continue;
            Tensor ids = indices[t].reshape(-1);  // the ids the forward looked up (bad ones read row 0 unless fatal)
            if (!fatal) ids = ids.masked_fill(ids.lt(0).logical_or(ids.ge(weights[t].sym_size(0))), 0);
            result[t] = at::_sparse_coo_tensor_unsafe_symint(ids.to(I64).unsqueeze(0), out[t], weights[t].sym_sizes());
        }
        for (size_t t = 0; t < n; t++)  // an empty tensor is "no weights", yet gets its (empty) gradient when asked
            result[n + t] = psw_grad[t] ? out[n + t] : ctx->needs_input_grad(n + t) ? at::zeros_like(psws[t]) : Tensor();
        return result;
    }
};

void grouped_embedding_bag_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, GEB_ARGS);
    const BelowAutograd<&grouped_embedding_bag_native> below{op, keys, stack};
    if (!at::GradMode::is_enabled() || !(requires_grad(a[WEIGHTS]) || requires_grad(a[PSWS]))) return below();
    const std::vector<Tensor> weights = a[WEIGHTS].toTensorVector(), psws = a[PSWS].toTensorVector();
    Tensor out = GroupedEmbeddingBag::apply(at::TensorList(weights), at::TensorList(psws), below);
    stack->back() = std::move(out);
}

/* fm_second_order(Tensor v, bool reduce, str impl): d out / d v = grad * (sum_f v - v), by the backward op (as
 * runtime/interaction.py's _fm_backward). */
struct FmSecondOrder : torch::autograd::Function<FmSecondOrder> {
    static Tensor forward(torch::autograd::AutogradContext *ctx, const Tensor &v,
                          const BelowAutograd<&fm_second_order_native> &below) {
        const auto a = torch::jit::last(*below.stack, 3);
        ctx->save_for_backward({v});
        ctx->saved_data["reduce"] = a[1], ctx->saved_data["impl"] = a[2];
        below();
        return below.stack->back().toTensor();
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        auto &d = ctx->saved_data;
        static const auto op = schema("recompile::fm_second_order_backward");
        const Tensor grad_v = call(op,
                                   {grads[0], ctx->get_saved_variables()[0], d["reduce"], d["impl"]})[0].toTensor();
        return {grad_v, Tensor()};
    }
};

void fm_second_order_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const BelowAutograd<&fm_second_order_native> below{op, keys, stack};
    const Tensor v = torch::jit::peek(*stack, 0, 3).toTensor();
    if (!at::GradMode::is_enabled() || !v.requires_grad()) return below();
    Tensor out = FmSecondOrder::apply(v, below);
    stack->back() = std::move(out);
}

/* The call on ``below``'s stack for an op returning (Tensor out, Tensor[] saved), in a Function's forward: the
 * saved results are not differentiable (the backward op reads them); saves ``kept`` (the inputs the backward reads)
 * followed by them and returns out followed by them (``push_saved`` puts that back as the op's two results). */
template <bool (*native)(torch::jit::Stack *)>
torch::autograd::variable_list forward_saving(torch::autograd::AutogradContext *ctx, std::vector<Tensor> kept,
                                              const BelowAutograd<native> &below) {
    below();
    const std::vector<Tensor> saved = below.stack->back().toTensorVector();
    ctx->mark_non_differentiable(saved);
    ctx->set_materialize_grads(false);
    kept.insert(kept.end(), saved.begin(), saved.end());
    ctx->save_for_backward(kept);
    torch::autograd::variable_list out{torch::jit::peek(*below.stack, 0, 2).toTensor()};
    out.insert(out.end(), saved.begin(), saved.end());
    return out;
}

void push_saved(torch::jit::Stack *stack, const torch::autograd::variable_list &out) {
    torch::jit::drop(*stack, 2);
    torch::jit::push(*stack, out[0], std::vector<Tensor>(out.begin() + 1, out.end()));
}

/* cross_stack(Tensor x0, Tensor x, Tensor[] weights, Tensor[] biases, Tensor[] downs, bool save, str impl) ->
 * (x_L, saved): x_L differentiable, the saved results not (the backward op reads them), as runtime/interaction.py's
 * _cross_stack_setup and _cross_stack_backward. */
struct CrossStack : torch::autograd::Function<CrossStack> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const Tensor &x0,
                                                  const Tensor &x, at::TensorList weights, at::TensorList biases,
                                                  at::TensorList downs,
                                                  const BelowAutograd<&cross_stack_native> &below) {
        ctx->saved_data["layers"] = (int64_t)weights.size();
        ctx->saved_data["has_bias"] = !biases.empty(), ctx->saved_data["low_rank"] = !downs.empty();
        std::vector<Tensor> kept{x0, x};
        kept.insert(kept.end(), weights.begin(), weights.end());
        kept.insert(kept.end(), downs.begin(), downs.end());
        return forward_saving(ctx, std::move(kept), below);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const int64_t L = ctx->saved_data["layers"].toInt();
        const bool has_bias = ctx->saved_data["has_bias"].toBool(), low_rank = ctx->saved_data["low_rank"].toBool();
        torch::autograd::variable_list result(2 + L * (1 + has_bias + low_rank) + 1);  // the last: ``below``'s
        if (!grads[0].defined()) return result;  // x_L unused
        const auto s = ctx->get_saved_variables();
        const auto range = [&](int64_t from, int64_t n) {
            return std::vector<Tensor>(s.begin() + from, s.begin() + from + n);
        };
        const int64_t kept = 2 + L * (1 + low_rank);  // x0, x, the weights and downs: the saved results follow
        const std::vector<Tensor> weights = range(2, L), downs = range(2 + L, low_rank ? L : 0),
                                  saved = range(kept, (int64_t)s.size() - kept);
        TORCH_CHECK((int64_t)saved.size() == 2 * L - 1,
                    "recompile.cross_stack: called with save=False (an inference graph), then differentiated");
        static const auto op = schema("recompile::cross_stack_backward");
        const auto out = call(op, {grads[0], s[0], s[1], weights, downs, saved, has_bias});
        result[0] = out[0].toTensor(), result[1] = out[1].toTensor();
        int64_t i = 2;
        for (int k = 2; k < 5; k++)
            for (const Tensor &g : out[k].toTensorVector()) result[i++] = g;
        return result;
    }
};

void cross_stack_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 7);
    const BelowAutograd<&cross_stack_native> below{op, keys, stack};
    if (!at::GradMode::is_enabled() || !(a[0].toTensor().requires_grad() || a[1].toTensor().requires_grad() ||
                                         requires_grad(a[2]) || requires_grad(a[3]) || requires_grad(a[4])))
        return below();
    const Tensor x0 = a[0].toTensor(), x = a[1].toTensor();
    const std::vector<Tensor> weights = a[2].toTensorVector(), biases = a[3].toTensorVector(),
                              downs = a[4].toTensorVector();
    push_saved(stack, CrossStack::apply(x0, x, at::TensorList(weights), at::TensorList(biases), at::TensorList(downs),
                                        below));
}

/* cross_mixture(Tensor x0, Tensor x, Tensor gate, Tensor[] downs, Tensor[] mids, Tensor[] ups, Tensor[] biases,
 * str activation, bool save, str impl) -> (out, saved): out differentiable, the saved intermediates not (the backward
 * op reads them), as runtime/interaction.py's _cross_mixture_setup and _cross_mixture_backward. */
struct CrossMixture : torch::autograd::Function<CrossMixture> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const Tensor &x0,
                                                  const Tensor &x, const Tensor &gate, at::TensorList downs,
                                                  at::TensorList mids, at::TensorList ups, at::TensorList biases,
                                                  const BelowAutograd<&cross_mixture_native> &below) {
        ctx->saved_data["activation"] = torch::jit::peek(*below.stack, 7, 10);
        ctx->saved_data["sizes"] = std::vector<int64_t>{(int64_t)downs.size(), (int64_t)mids.size(),
                                                        (int64_t)biases.size()};
        std::vector<Tensor> kept{x0, x, gate};
        for (at::TensorList params : {downs, mids, ups, biases}) kept.insert(kept.end(), params.begin(), params.end());
        return forward_saving(ctx, std::move(kept), below);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto sizes = ctx->saved_data["sizes"].toIntVector();
        const int64_t E = sizes[0], M = sizes[1], NB = sizes[2], params = 2 * E + M + NB;
        torch::autograd::variable_list result(3 + params + 1);  // the last: ``below``'s
        if (!grads[0].defined()) return result;  // the output unused
        const auto s = ctx->get_saved_variables();
        const auto range = [&](int64_t from, int64_t n) {
            return std::vector<Tensor>(s.begin() + from, s.begin() + from + n);
        };
        const std::vector<Tensor> saved = range(3 + params, (int64_t)s.size() - 3 - params);
        TORCH_CHECK((int64_t)saved.size() == (M ? 4 : 3),
                    "recompile.cross_mixture: called with save=False (an inference graph), then differentiated");
        static const auto op = schema("recompile::cross_mixture_backward");
        const auto out = call(op, {grads[0], s[0], s[1], s[2], range(3, E), range(3 + E, M), range(3 + E + M, E),
                                   range(3 + 2 * E + M, NB), ctx->saved_data["activation"], saved})[0]
                             .toTensorVector();
        std::copy(out.begin(), out.end(), result.begin());
        return result;
    }
};

void cross_mixture_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 10);
    const BelowAutograd<&cross_mixture_native> below{op, keys, stack};
    bool needed = false;
    for (int i = 0; i < 7; i++) needed = needed || (i < 3 ? a[i].toTensor().requires_grad() : requires_grad(a[i]));
    if (!at::GradMode::is_enabled() || !needed) return below();
    const Tensor x0 = a[0].toTensor(), x = a[1].toTensor(), gate = a[2].toTensor();
    const std::vector<Tensor> downs = a[3].toTensorVector(), mids = a[4].toTensorVector(), ups = a[5].toTensorVector(),
                              biases = a[6].toTensorVector();
    push_saved(stack, CrossMixture::apply(x0, x, gate, at::TensorList(downs), at::TensorList(mids),
                                          at::TensorList(ups), at::TensorList(biases), below));
}

/* vector_cross(Tensor x0, Tensor x, Tensor[] weights, Tensor[] biases, str impl): the backward op recomputes the
 * layers from the inputs (as runtime/interaction.py's _vector_cross_backward). */
struct VectorCross : torch::autograd::Function<VectorCross> {
    static Tensor forward(torch::autograd::AutogradContext *ctx, const Tensor &x0, const Tensor &x,
                          at::TensorList weights, at::TensorList biases,
                          const BelowAutograd<&vector_cross_native> &below) {
        std::vector<Tensor> kept{x0, x};
        kept.insert(kept.end(), weights.begin(), weights.end());
        kept.insert(kept.end(), biases.begin(), biases.end());
        ctx->save_for_backward(kept);
        ctx->saved_data["layers"] = (int64_t)weights.size();
        ctx->saved_data["impl"] = torch::jit::peek(*below.stack, 4, 5);
        below();
        return below.stack->back().toTensor();
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto s = ctx->get_saved_variables();
        const int64_t L = ctx->saved_data["layers"].toInt();
        const std::vector<Tensor> weights(s.begin() + 2, s.begin() + 2 + L), biases(s.begin() + 2 + L, s.end());
        static const auto op = schema("recompile::vector_cross_backward");
        const auto out = call(op, {grads[0], s[0], s[1], weights, biases, ctx->saved_data["impl"]});
        torch::autograd::variable_list result{out[0].toTensor(), out[1].toTensor()};
        for (int k = 2; k < 4; k++)
            for (const Tensor &g : out[k].toTensorVector()) result.push_back(g);
        result.emplace_back();  // ``below``'s
        return result;
    }
};

void vector_cross_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 5);
    const BelowAutograd<&vector_cross_native> below{op, keys, stack};
    if (!at::GradMode::is_enabled() || !(a[0].toTensor().requires_grad() || a[1].toTensor().requires_grad() ||
                                         requires_grad(a[2]) || requires_grad(a[3])))
        return below();
    const Tensor x0 = a[0].toTensor(), x = a[1].toTensor();
    const std::vector<Tensor> weights = a[2].toTensorVector(), biases = a[3].toTensorVector();
    Tensor out = VectorCross::apply(x0, x, at::TensorList(weights), at::TensorList(biases), below);
    stack->back() = std::move(out);
}

/* sampled_softmax_loss(Tensor pos, Tensor neg, Tensor? neg_ids, Tensor? target_ids, float scale, str impl) ->
 * (loss, lse): pos and neg differentiable, lse not (the backward reads it), as runtime/sampled_softmax.py's
 * _backward. */
struct SampledSoftmax : torch::autograd::Function<SampledSoftmax> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const Tensor &pos,
                                                  const Tensor &neg,
                                                  const BelowAutograd<&sampled_softmax_native> &below) {
        const auto a = torch::jit::last(*below.stack, 6);
        const Tensor neg_ids = a[2].isNone() ? Tensor() : a[2].toTensor(),
                     target_ids = a[3].isNone() ? Tensor() : a[3].toTensor();
        ctx->saved_data["scale"] = a[4], ctx->saved_data["impl"] = a[5];
        below();
        const Tensor loss = torch::jit::peek(*below.stack, 0, 2).toTensor(), lse = below.stack->back().toTensor();
        ctx->mark_non_differentiable({lse});
        ctx->save_for_backward({pos, neg, neg_ids, target_ids, lse});
        return {loss, lse};
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto s = ctx->get_saved_variables();
        static const auto op = schema("recompile::sampled_softmax_loss_backward");
        auto optional = [](const Tensor &t) { return t.defined() ? c10::IValue(t) : c10::IValue(); };
        const auto out = call(op,
                              {grads[0], s[0], s[1], optional(s[2]), optional(s[3]), s[4], ctx->saved_data["scale"],
                               ctx->saved_data["impl"]});
        return {out[0].toTensor(), out[1].toTensor(), Tensor()};
    }
};

void sampled_softmax_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const BelowAutograd<&sampled_softmax_native> below{op, keys, stack};
    const Tensor pos = torch::jit::peek(*stack, 0, 6).toTensor(), neg = torch::jit::peek(*stack, 1, 6).toTensor();
    if (!at::GradMode::is_enabled() || !(pos.requires_grad() || neg.requires_grad())) return below();
    auto out = SampledSoftmax::apply(pos, neg, below);
    torch::jit::drop(*stack, 2);
    torch::jit::push(*stack, std::move(out[0]), std::move(out[1]));
}

std::string isa() { return kernels().isa; }
std::string set_isa(const std::string &name) {
    TORCH_CHECK_VALUE(has_isa(name.c_str()), "recompile_native.set_isa: ", name,
                      " is not an instruction set this build and CPU run (generic, avx2, avx512)");
    return use_isa(name.c_str());
}
bool isa_available(const std::string &name) { return has_isa(name.c_str()); }

/* ------------------------------------------------------------------------ recompile::gru / lstm (gru.h, lstm.h)
 * gru_fwd / gru_bwd, lstm_fwd / lstm_bwd: runtime/recurrent.py's native kernels of recompile::gru, recompile::lstm
 * and their backward ops; the ops' boxed native kernels (below autograd) and their autograd (Recurrent, for the
 * AutogradCPU key, as the other ops' above: no Python per call). S, the states: 1 (a GRU's h), 2 (an LSTM's h, c). */

#define RECURRENT_DISPATCH(input, call)                                                                            \
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, (input).scalar_type(), "recompile_native.recurrent", \
                                    [&] { return call<scalar_t, at::opmath_type<scalar_t>>; })

void recurrent_check(const char *op, const Tensor &input, at::TensorList weights, bool has_biases,
                     int64_t num_layers) {
    TORCH_CHECK(input.dim() == 3, "recompile_native.", op, ": input must be 3-D, got ", input.dim(), "-D");
    TORCH_CHECK((int64_t)weights.size() == num_layers * (has_biases ? 4 : 2), "recompile_native.", op, ": ",
                weights.size(), " weights for ", num_layers, " layers", has_biases ? " with biases" : "");
    for (const Tensor &w : weights)
        TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == input.scalar_type(), "recompile_native.", op,
                    ": every weight must be a CPU tensor of the input's dtype ", input.scalar_type());
}

std::tuple<Tensor, Tensor, std::vector<Tensor>> gru_fwd(const Tensor &input, const OptTensor &hx, at::TensorList weights,
                                                        bool has_biases, int64_t num_layers, bool batch_first,
                                                        bool save) {
    recurrent_check("gru", input, weights, has_biases, num_layers);
    at::AutoDispatchBelowADInplaceOrView guard;  // the GEMMs inside record no autograd
    return RECURRENT_DISPATCH(input, gru::forward)(input, hx, weights, has_biases, num_layers, batch_first, save);
}

std::tuple<Tensor, Tensor, std::vector<Tensor>> gru_bwd(const OptTensor &grad_output, const OptTensor &grad_hn,
                                                        const Tensor &input, const OptTensor &hx, at::TensorList weights,
                                                        const Tensor &output, at::TensorList saved, bool has_biases,
                                                        int64_t num_layers, bool batch_first) {
    recurrent_check("gru", input, weights, has_biases, num_layers);
    at::AutoDispatchBelowADInplaceOrView guard;
    return RECURRENT_DISPATCH(input, gru::backward)(grad_output, grad_hn, input, hx, weights, output, saved,
                                                    has_biases, num_layers, batch_first);
}

std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> lstm_fwd(const Tensor &input, const OptTensor &hx,
                                                                 const OptTensor &cx, at::TensorList weights,
                                                                 bool has_biases, int64_t num_layers,
                                                                 bool batch_first, bool save) {
    recurrent_check("lstm", input, weights, has_biases, num_layers);
    at::AutoDispatchBelowADInplaceOrView guard;
    return RECURRENT_DISPATCH(input, lstm::forward)(input, hx, cx, weights, has_biases, num_layers, batch_first, save);
}

std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> lstm_bwd(const OptTensor &grad_output,
                                                                 const OptTensor &grad_hn, const OptTensor &grad_cn,
                                                                 const Tensor &input, const OptTensor &hx,
                                                                 const OptTensor &cx, at::TensorList weights,
                                                                 const Tensor &output, at::TensorList saved,
                                                                 bool has_biases, int64_t num_layers,
                                                                 bool batch_first) {
    recurrent_check("lstm", input, weights, has_biases, num_layers);
    at::AutoDispatchBelowADInplaceOrView guard;
    return RECURRENT_DISPATCH(input, lstm::backward)(grad_output, grad_hn, grad_cn, input, hx, cx, weights, output,
                                                     saved, has_biases, num_layers, batch_first);
}

Tensor optional_tensor(const c10::IValue &v) { return v.isNone() ? Tensor() : v.toTensor(); }

/* Whether the native kernels read a call: plain CPU tensors of the input's float dtype, a 3-D input with steps,
 * each layer's weights (gates x H rows) and the states ([L, B, H], or undefined) of the sizes runtime/recurrent.py's
 * _check states; else the Python op runs (and raises naming the argument at fault). */
bool recurrent_plain(const Tensor &input, const std::vector<Tensor> &states, const std::vector<Tensor> &weights,
                     bool has_biases, int64_t L, bool batch_first, int64_t gates) {
    const int64_t k = has_biases ? 4 : 2;
    if (!plain_cpu(input, {F32, F64, F16, BF16}) || input.dim() != 3 || L < 1 || (int64_t)weights.size() != L * k ||
        weights[1].dim() != 2 || input.size(batch_first ? 1 : 0) == 0)
        return false;
    const auto dtype = input.scalar_type();
    const int64_t B = input.size(batch_first ? 0 : 1), H = weights[1].size(1);
    for (int64_t l = 0; l < L; l++)
        for (int64_t j = 0; j < k; j++) {
            const Tensor &w = weights[l * k + j];
            const std::vector<int64_t> want = j == 0 ? std::vector<int64_t>{gates * H, l ? H : input.size(2)}
                                              : j == 1 ? std::vector<int64_t>{gates * H, H}
                                                       : std::vector<int64_t>{gates * H};
            if (!plain_cpu(w, {dtype}) || w.sizes() != at::IntArrayRef(want)) return false;
        }
    for (const Tensor &s : states)
        if (s.defined() && (!plain_cpu(s, {dtype}) || s.sizes() != at::IntArrayRef({L, B, H}))) return false;
    return true;
}

/* recompile::gru(Tensor input, Tensor? hx, Tensor[] weights, bool has_biases, int num_layers, bool batch_first,
 * bool save, str impl) -> (Tensor, Tensor, Tensor[]); recompile::lstm(Tensor input, Tensor? hx, Tensor? cx, ...)
 * -> (Tensor, Tensor, Tensor, Tensor[]) */
template <int S>
bool recurrent_native(torch::jit::Stack *stack) {
    constexpr size_t N = 7 + S;
    const auto a = torch::jit::last(*stack, N);
    if (a[N - 1].toStringRef() != "native") return false;
    const Tensor input = a[0].toTensor(), hx = optional_tensor(a[1]), cx = S == 2 ? optional_tensor(a[2]) : Tensor();
    const std::vector<Tensor> weights = a[S + 1].toTensorVector();
    const bool has_biases = a[S + 2].toBool(), batch_first = a[S + 4].toBool(), save = a[S + 5].toBool();
    const int64_t L = a[S + 3].toInt();
    if (!recurrent_plain(input, {hx, cx}, weights, has_biases, L, batch_first, S == 1 ? 3 : 4)) return false;
    if constexpr (S == 1) {
        auto [out, hn, saved] = gru_fwd(input, hx, weights, has_biases, L, batch_first, save);
        return returned(stack, N, out, hn, saved);
    } else {
        auto [out, hn, cn, saved] = lstm_fwd(input, hx, cx, weights, has_biases, L, batch_first, save);
        return returned(stack, N, out, hn, cn, saved);
    }
}

/* recompile::gru_backward(Tensor? grad_output, Tensor? grad_hn, Tensor input, Tensor? hx, Tensor[] weights,
 * Tensor output, Tensor[] saved, bool has_biases, int num_layers, bool batch_first, str impl)
 * -> (Tensor, Tensor, Tensor[]); recompile::lstm_backward(Tensor? grad_output, Tensor? grad_hn, Tensor? grad_cn,
 * Tensor input, Tensor? hx, Tensor? cx, ...) -> (Tensor, Tensor, Tensor, Tensor[]) */
template <int S>
bool recurrent_backward_native(torch::jit::Stack *stack) {
    constexpr size_t N = 2 * S + 9;
    const auto a = torch::jit::last(*stack, N);
    if (a[N - 1].toStringRef() != "native") return false;
    const Tensor input = a[S + 1].toTensor(), hx = optional_tensor(a[S + 2]);
    const Tensor cx = S == 2 ? optional_tensor(a[S + 3]) : Tensor(), output = a[2 * S + 3].toTensor();
    const std::vector<Tensor> weights = a[2 * S + 2].toTensorVector(), saved = a[2 * S + 4].toTensorVector();
    const bool has_biases = a[2 * S + 5].toBool(), batch_first = a[2 * S + 7].toBool();
    const int64_t L = a[2 * S + 6].toInt();
    std::vector<Tensor> grads;
    for (int i = 0; i <= S; i++) grads.push_back(optional_tensor(a[i]));
    if (!recurrent_plain(input, {hx, cx}, weights, has_biases, L, batch_first, S == 1 ? 3 : 4)) return false;
    const auto dtype = input.scalar_type();
    const int64_t H = weights[1].size(1), B = input.size(batch_first ? 0 : 1);
    const std::vector<int64_t> sequence{input.size(0), input.size(1), H}, gates{input.size(0), input.size(1), (S + 3) * H};
    const auto fits = [&](const Tensor &t, const std::vector<int64_t> &sizes) {
        return plain_cpu(t, {dtype}) && t.sizes() == at::IntArrayRef(sizes);
    };
    if (!fits(output, sequence) || (grads[0].defined() && !fits(grads[0], sequence)) ||
        (int64_t)saved.size() != 2 * L - 1)
        return false;
    for (int i = 1; i <= S; i++)
        if (grads[i].defined() && !fits(grads[i], {L, B, H})) return false;
    for (int64_t i = 0; i < 2 * L - 1; i++)
        if (!fits(saved[i], i < L - 1 ? sequence : gates)) return false;
    if constexpr (S == 1) {
        auto [grad_input, grad_hx, grad_weights] = gru_bwd(grads[0], grads[1], input, hx, weights, output, saved,
                                                           has_biases, L, batch_first);
        return returned(stack, N, grad_input, grad_hx, grad_weights);
    } else {
        auto [grad_input, grad_hx, grad_cx, grad_weights] = lstm_bwd(grads[0], grads[1], grads[2], input, hx, cx,
                                                                     weights, output, saved, has_biases, L, batch_first);
        return returned(stack, N, grad_input, grad_hx, grad_cx, grad_weights);
    }
}

/* gru / lstm: output and the final states differentiable, the saved gates not (the backward op reads them), as
 * runtime/recurrent.py's _autograd. The inputs: input, hx, cx (none for a GRU, or where not given), the weights;
 * the op's other arguments are read from ``below``'s stack. */
template <int S>
struct Recurrent : torch::autograd::Function<Recurrent<S>> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const Tensor &input,
                                                  const OptTensor &hx, const OptTensor &cx, at::TensorList weights,
                                                  const BelowAutograd<&recurrent_native<S>> &below) {
        const auto a = torch::jit::last(*below.stack, 7 + S);
        const char *names[] = {"has_biases", "num_layers", "batch_first", "save", "impl"};
        for (int i = 0; i < 5; i++) ctx->saved_data[names[i]] = a[S + 2 + i];
        ctx->saved_data["weights"] = (int64_t)weights.size();
        below();
        const auto r = torch::jit::last(*below.stack, S + 2);  // output, the final states, saved
        const std::vector<Tensor> saved = r[S + 1].toTensorVector();
        ctx->mark_non_differentiable(saved);
        ctx->set_materialize_grads(false);
        std::vector<Tensor> kept{input, hx.value_or(Tensor()), cx.value_or(Tensor()), r[0].toTensor()};
        kept.insert(kept.end(), weights.begin(), weights.end());
        kept.insert(kept.end(), saved.begin(), saved.end());
        ctx->save_for_backward(kept);
        torch::autograd::variable_list out;
        for (int i = 0; i <= S; i++) out.push_back(r[i].toTensor());
        out.insert(out.end(), saved.begin(), saved.end());
        return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const int64_t n = ctx->saved_data["weights"].toInt();
        torch::autograd::variable_list result(3 + n + 1);  // input, hx, cx, the weights, ``below``
        if (std::none_of(grads.begin(), grads.begin() + S + 1, [](const Tensor &g) { return g.defined(); }))
            return result;
        TORCH_CHECK(ctx->saved_data["save"].toBool(), "recompile.", S == 1 ? "gru" : "lstm",
                    ": differentiated after a forward that saved nothing (save=False)");
        const auto s = ctx->get_saved_variables();
        const auto optional = [](const Tensor &t) { return t.defined() ? c10::IValue(t) : c10::IValue(); };
        torch::jit::Stack arguments;
        for (int i = 0; i <= S; i++) arguments.push_back(optional(grads[i]));
        arguments.push_back(s[0]);
        for (int i = 1; i <= S; i++) arguments.push_back(optional(s[i]));
        arguments.emplace_back(std::vector<Tensor>(s.begin() + 4, s.begin() + 4 + n));
        arguments.push_back(s[3]);
        arguments.emplace_back(std::vector<Tensor>(s.begin() + 4 + n, s.end()));
        for (const char *name : {"has_biases", "num_layers", "batch_first", "impl"})
            arguments.push_back(ctx->saved_data[name]);
        static const auto op = schema(S == 1 ? "recompile::gru_backward" : "recompile::lstm_backward");
        const auto out = call(op, std::move(arguments));  // grad_input, the states' gradients, grad_weights
        result[0] = out[0].toTensor();
        for (int i = 1; i <= S; i++)
            if (s[i].defined()) result[i] = out[i].toTensor();
        const std::vector<Tensor> grad_weights = out[S + 1].toTensorVector();
        std::copy(grad_weights.begin(), grad_weights.end(), result.begin() + 3);
        return result;
    }
};

template <int S>
void recurrent_autograd(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
    const auto a = torch::jit::last(*stack, 7 + S);
    const BelowAutograd<&recurrent_native<S>> below{op, keys, stack};
    const Tensor input = a[0].toTensor(), hx = optional_tensor(a[1]), cx = S == 2 ? optional_tensor(a[2]) : Tensor();
    const auto grad = [](const Tensor &t) { return t.defined() && t.requires_grad(); };
    if (!at::GradMode::is_enabled() || !(grad(input) || grad(hx) || grad(cx) || requires_grad(a[S + 1])))
        return below();
    const std::vector<Tensor> weights = a[S + 1].toTensorVector();
    const auto given = [](const Tensor &t) { return t.defined() ? OptTensor(t) : OptTensor(); };
    const auto out = Recurrent<S>::apply(input, given(hx), given(cx), at::TensorList(weights), below);
    torch::jit::drop(*stack, S + 2);
    for (int i = 0; i <= S; i++) torch::jit::push(*stack, out[i]);
    torch::jit::push(*stack, std::vector<Tensor>(out.begin() + S + 1, out.end()));
}

}  // namespace

TORCH_LIBRARY(recompile_native, m) {
    m.def("isa() -> str");
    m.def("set_isa(str isa) -> str");
    m.def("isa_available(str isa) -> bool");
    m.def("dropout(Tensor x, Tensor seed, float p) -> Tensor");
    m.def("geb_forward_pooled(int tables, Tensor meta, int batch, Tensor(a!) out, int out_stride, Tensor(b!) err, "
          "bool stream, int threads) -> ()");
    m.def("geb_forward_sequence(int tables, Tensor meta, Tensor(a!) out, int out_stride, Tensor(b!) err, "
          "int threads) -> ()");
    m.def("geb_backward(int tables, Tensor meta, int batch, Tensor grad, int grad_stride, Tensor table_out, "
          "Tensor dense, Tensor psw_out, Tensor(a!) err) -> ()");
    m.def("geb_optimizer_step(int tables, Tensor meta, int batch, Tensor grad, int grad_stride, int kind, "
          "Tensor hyper, Tensor state, Tensor step_size, Tensor(a!) sums, Tensor(b!) touched, Tensor(c!) slots, "
          "Tensor(d!) err) -> ()");
    m.def("dot_interaction(Tensor[] features, Tensor? prefix, bool upper, bool self_interaction) -> Tensor");
    m.def("dot_interaction_backward(Tensor grad, Tensor[] features, int k, bool upper, bool self_interaction) "
          "-> Tensor[]");
    m.def("cross_epilogue_fwd(Tensor x0, Tensor x, Tensor h, Tensor? bias, Tensor(a!) out, Tensor(b!)? hb) -> ()");
    m.def("cross_epilogue_bwd(Tensor grad, Tensor x0, Tensor h, Tensor? bias, Tensor(a!) grad_h, "
          "Tensor(b!) grad_x0, Tensor(c!)? grad_bias) -> ()");
    m.def("vector_cross_fwd(Tensor x0, Tensor x, Tensor W, Tensor? bias, Tensor(a!) out) -> ()");
    m.def("vector_cross_bwd(Tensor grad, Tensor x0, Tensor x, Tensor W, Tensor? bias, Tensor(a!) grad_x0, "
          "Tensor(b!) grad_x, Tensor(c!) grad_W, Tensor(d!)? grad_bias) -> ()");
    m.def("cross_stack_fwd(Tensor x0, Tensor x, Tensor[] weights, Tensor[] biases, Tensor[] downs, bool save) "
          "-> (Tensor, Tensor[])");
    m.def("cross_stack_fused(int rank, int dim) -> bool");
    m.def("cross_mixture_fwd(Tensor x0, Tensor x, Tensor gate, Tensor[] downs, Tensor[] mids, Tensor[] ups, "
          "Tensor[] biases, str activation) -> Tensor");
    m.def("fm_second_order_fwd(Tensor v, bool reduce) -> Tensor");
    m.def("fm_second_order_bwd(Tensor grad, Tensor v, bool reduce) -> Tensor");
    m.def("hstu_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor offsets, int max_seq_len, float alpha, "
          "bool causal, Tensor? num_targets, int contextual, Tensor? rel_bias, Tensor? timestamps, "
          "Tensor? time_bias, Tensor? bucket_bounds) -> Tensor");
    m.def("hstu_attention_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor offsets, int max_seq_len, "
          "float alpha, bool causal, Tensor? num_targets, int contextual, Tensor? rel_bias, Tensor? timestamps, "
          "Tensor? time_bias, Tensor? bucket_bounds) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
    m.def("padded_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? rows) -> Tensor");
    m.def("padded_attention_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? rows) "
          "-> (Tensor, Tensor, Tensor)");
    m.def("sampled_softmax_fwd(Tensor pos, Tensor neg, Tensor? sorted, Tensor? order, Tensor? targets, "
          "float scale) -> (Tensor, Tensor)");
    m.def("sampled_softmax_bwd(Tensor grad, Tensor pos, Tensor neg, Tensor? sorted, Tensor? order, "
          "Tensor? targets, Tensor lse, float scale) -> (Tensor, Tensor)");
    m.def("gru_fwd(Tensor input, Tensor? hx, Tensor[] weights, bool has_biases, int num_layers, bool batch_first, "
          "bool save) -> (Tensor, Tensor, Tensor[])");
    m.def("gru_bwd(Tensor? grad_output, Tensor? grad_hn, Tensor input, Tensor? hx, Tensor[] weights, Tensor output, "
          "Tensor[] saved, bool has_biases, int num_layers, bool batch_first) -> (Tensor, Tensor, Tensor[])");
    m.def("lstm_fwd(Tensor input, Tensor? hx, Tensor? cx, Tensor[] weights, bool has_biases, int num_layers, "
          "bool batch_first, bool save) -> (Tensor, Tensor, Tensor, Tensor[])");
    m.def("lstm_bwd(Tensor? grad_output, Tensor? grad_hn, Tensor? grad_cn, Tensor input, Tensor? hx, Tensor? cx, "
          "Tensor[] weights, Tensor output, Tensor[] saved, bool has_biases, int num_layers, bool batch_first) "
          "-> (Tensor, Tensor, Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(recompile_native, CPU, m) {
    m.impl("dropout", &dropout);
    m.impl("geb_forward_pooled", &geb_forward_pooled);
    m.impl("geb_forward_sequence", &geb_forward_sequence);
    m.impl("geb_backward", &geb_backward);
    m.impl("geb_optimizer_step", &geb_optimizer_step);
    m.impl("dot_interaction", &dot_interaction);
    m.impl("dot_interaction_backward", &dot_interaction_backward);
    m.impl("cross_epilogue_fwd", &cross_epilogue_fwd);
    m.impl("cross_epilogue_bwd", &cross_epilogue_bwd);
    m.impl("vector_cross_fwd", &vector_cross_fwd);
    m.impl("vector_cross_bwd", &vector_cross_bwd);
    m.impl("cross_stack_fwd", &cross_stack_fwd);
    m.impl("cross_mixture_fwd", &cross_mixture_fwd);
    m.impl("fm_second_order_fwd", &fm_second_order_fwd);
    m.impl("fm_second_order_bwd", &fm_second_order_bwd);
    m.impl("hstu_attention_fwd", &hstu_attention_fwd);
    m.impl("hstu_attention_bwd", &hstu_attention_bwd);
    m.impl("padded_attention_fwd", &padded_attention_fwd);
    m.impl("padded_attention_bwd", &padded_attention_bwd);
    m.impl("sampled_softmax_fwd", &sampled_softmax_fwd);
    m.impl("sampled_softmax_bwd", &sampled_softmax_bwd);
    m.impl("gru_fwd", &gru_fwd);
    m.impl("gru_bwd", &gru_bwd);
    m.impl("lstm_fwd", &lstm_fwd);
    m.impl("lstm_bwd", &lstm_bwd);
}

TORCH_LIBRARY_IMPL(recompile, ADInplaceOrView, m) {
    m.impl("dropout", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&dropout_native>>());
    m.impl("fm_second_order", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&fm_second_order_native>>());
    m.impl("vector_cross", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&vector_cross_native>>());
    m.impl("cross_stack", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&cross_stack_native>>());
    m.impl("cross_mixture", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&cross_mixture_native>>());
    m.impl("cross_stack_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&cross_stack_backward_native>>());
    m.impl("vector_cross_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&vector_cross_backward_native>>());
    m.impl("dot_interaction", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&dot_interaction_native>>());
    m.impl("grouped_embedding_bag",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&grouped_embedding_bag_native>>());
    m.impl("grouped_embedding_bag_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&grouped_embedding_bag_backward_native>>());
    m.impl("dot_interaction_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&dot_interaction_backward_native>>());
    m.impl("sampled_softmax_loss",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&sampled_softmax_native>>());
    m.impl("fm_second_order_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&fm_second_order_backward_native>>());
    m.impl("sampled_softmax_loss_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&sampled_softmax_backward_native>>());
    m.impl("padded_softmax_attention",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&padded_attention_native>>());
    m.impl("padded_softmax_attention_backward",
           torch::CppFunction::makeFromBoxedFunction<&below_autograd<&padded_attention_backward_native>>());
    m.impl("gru", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&recurrent_native<1>>>());
    m.impl("lstm", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&recurrent_native<2>>>());
    m.impl("gru_backward", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&recurrent_backward_native<1>>>());
    m.impl("lstm_backward", torch::CppFunction::makeFromBoxedFunction<&below_autograd<&recurrent_backward_native<2>>>());
}

TORCH_LIBRARY_IMPL(recompile, AutogradCPU, m) {
    m.impl("grouped_embedding_bag", torch::CppFunction::makeFromBoxedFunction<&grouped_embedding_bag_autograd>());
    m.impl("grouped_embedding_bag_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&grouped_embedding_bag_backward_native>>());
    m.impl("fm_second_order", torch::CppFunction::makeFromBoxedFunction<&fm_second_order_autograd>());
    m.impl("cross_stack", torch::CppFunction::makeFromBoxedFunction<&cross_stack_autograd>());
    m.impl("cross_mixture", torch::CppFunction::makeFromBoxedFunction<&cross_mixture_autograd>());
    m.impl("cross_stack_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&cross_stack_backward_native>>());
    m.impl("vector_cross", torch::CppFunction::makeFromBoxedFunction<&vector_cross_autograd>());
    m.impl("vector_cross_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&vector_cross_backward_native>>());
    m.impl("sampled_softmax_loss", torch::CppFunction::makeFromBoxedFunction<&sampled_softmax_autograd>());
    m.impl("fm_second_order_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&fm_second_order_backward_native>>());
    m.impl("sampled_softmax_loss_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&sampled_softmax_backward_native>>());
    m.impl("gru", torch::CppFunction::makeFromBoxedFunction<&recurrent_autograd<1>>());
    m.impl("lstm", torch::CppFunction::makeFromBoxedFunction<&recurrent_autograd<2>>());
    m.impl("gru_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&recurrent_backward_native<1>>>());
    m.impl("lstm_backward",
           torch::CppFunction::makeFromBoxedFunction<&not_differentiable<&recurrent_backward_native<2>>>());
}

/* The ops that take no tensor (the instruction set, cross_stack_fused): registered for every key. */
TORCH_LIBRARY_IMPL(recompile_native, CompositeExplicitAutograd, m) {
    m.impl("isa", &isa);
    m.impl("set_isa", &set_isa);
    m.impl("isa_available", &isa_available);
    m.impl("cross_stack_fused", &cross_stack_fused);
}

}  // namespace recompile_native
