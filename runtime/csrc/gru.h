/* CPU kernels of recompile::gru (runtime/recurrent.py): a unidirectional multi-layer GRU, forward and BPTT
 * backward, as torch.gru computes it (gates r, z, n in PyTorch's row order of weight_ih / weight_hh):
 *     r = sigmoid(x W_ir^T + b_ir + h W_hr^T + b_hr)      z = sigmoid(x W_iz^T + b_iz + h W_hz^T + b_hz)
 *     n = tanh(x W_in^T + b_in + r * hn),  hn = h W_hn^T + b_hn      h' = (1 - z) * n + z * h
 * Included by ops.cpp (after kernels.h). The batch runs in chunks of rows (chunk_rows), each through every layer
 * and step, forward and backward, so that a chunk's sequences and gates stay in the caches. Per chunk and layer,
 * the input projections of every step are one GEMM (at::addmm, as ATen does); each step is one GEMM of the hidden
 * state (at::addmm_out into a buffer) and one pass over the gates. A sequence tensor keeps the layout of the op's
 * input ([T, B, C], or [B, T, C] with batch_first): a step is a [B, C] view with a row stride, so no transpose is
 * copied. With ``save`` the forward keeps, per step, r, z, n and hn ([.., 4H]) and each layer's output but the last
 * (the op's output): the backward reads them and recomputes nothing. The backward runs a chunk's steps in reverse
 * (the gates' gradients, then one GEMM for the hidden state's), then per layer three GEMMs for the input's and the
 * weights' gradients over the chunk's steps, the weights' summed over the chunks.
 * Gate arithmetic is in float for float32, bfloat16 and float16 storage (double for float64). */
#include <ATen/OpMathType.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

namespace gru {

using at::Tensor;
using recompile_native::bf16_t;
#include "vec.h"

/* A [B, C] step view: data, row stride in elements. */
template <class T>
struct Rows {
    T *data;
    int64_t stride;
    T *row(int64_t b) const { return data + b * stride; }
};

template <class T>
Rows<T> rows(const Tensor &step) {
    return {static_cast<T *>(step.data_ptr()), step.stride(0)};
}

template <class A>
inline A sigmoid(A x) {
    return A(1) / (A(1) + std::exp(-x));
}

/* The layout of the op's sequences: step t of a [T, B, C] (or [B, T, C]) tensor, and its size. */
struct Layout {
    bool batch_first;
    int64_t time_dim() const { return batch_first ? 1 : 0; }
    int64_t batch_dim() const { return batch_first ? 0 : 1; }
    Tensor step(const Tensor &seq, int64_t t) const { return seq.select(time_dim(), t); }
    int64_t steps(const Tensor &seq) const { return seq.size(time_dim()); }
    Tensor rows(const Tensor &seq, int64_t b0, int64_t n) const { return seq.narrow(batch_dim(), b0, n); }
    // every step's rows as one matrix (a copy for a chunk of a [T, B, C] sequence, a view otherwise)
    Tensor flat(const Tensor &seq) const { return seq.reshape({-1, seq.size(2)}); }
    Tensor empty(const Tensor &like, int64_t T, int64_t B, int64_t C) const {
        return at::empty(batch_first ? at::IntArrayRef{B, T, C} : at::IntArrayRef{T, B, C}, like.options());
    }
};

/* Rows of the batch the op runs through all its steps and layers at a time (about T (13 H + 2 C) elements a row in
 * the backward: sequences, gates, their gradients): a chunk's stay in the caches from one step to the next, where
 * the whole batch's would stream through memory once a step. GRU4Rec at batch 2048 (T 12, H 16, C 8): chunks of 64
 * to 750 rows timed, 230-370 (2.5-4 MB by this count) the fastest, the forward and backward 1.4x faster than
 * unchunked. At least MIN_ROWS, so that each step's GEMM has rows enough to amortise its call. */
constexpr int64_t CHUNK_BYTES = 3 << 20, MIN_ROWS = 64;

inline int64_t chunk_rows(int64_t B, int64_t T, int64_t C, int64_t H, int64_t element) {
    const int64_t row = std::max<int64_t>(1, T * (13 * H + 2 * C) * element);
    return std::max<int64_t>(1, std::min(B, std::max(MIN_ROWS, CHUNK_BYTES / row)));
}

/* One step: gi (the input projections, biases in), gh (the hidden ones, biases in), h the previous state -> y
 * (and, with g, the saved r, z, n, hn). */
template <class T, class A>
void step_forward(Rows<const T> gi, Rows<const T> gh, Rows<const T> h, Rows<T> y, Rows<T> g, int64_t B, int64_t H,
                  int64_t j0 = 0) {
    for (int64_t b = 0; b < B; b++) {
        const T *xi = gi.row(b), *hh = gh.row(b), *hp = h.row(b);
        T *out = y.row(b), *gs = g.data ? g.row(b) : nullptr;
        for (int64_t j = j0; j < H; j++) {
            const A r = sigmoid<A>(A(xi[j]) + A(hh[j]));
            const A z = sigmoid<A>(A(xi[H + j]) + A(hh[H + j]));
            const A hn = A(hh[2 * H + j]);
            const A n = std::tanh(A(xi[2 * H + j]) + r * hn);
            out[j] = T((A(1) - z) * n + z * A(hp[j]));
            if (gs) gs[j] = T(r), gs[H + j] = T(z), gs[2 * H + j] = T(n), gs[3 * H + j] = T(hn);
        }
    }
}

/* One step back: dh (the state's gradient, dy of the step added) -> the gates' gradients (dgi: dr, dz, dn of the
 * pre-activations; dgh: dr, dz, d hn) and direct = dh * z, the part of the previous state's gradient that skips
 * the GEMM. */
template <class T, class A>
void step_backward(Rows<const T> dh, Rows<const T> dy, Rows<const T> g, Rows<const T> h, Rows<T> dgi, Rows<T> dgh,
                   Rows<T> direct, int64_t B, int64_t H, int64_t j0 = 0) {
    for (int64_t b = 0; b < B; b++) {
        const T *d = dh.row(b), *dyb = dy.data ? dy.row(b) : nullptr, *gs = g.row(b), *hp = h.row(b);
        T *di = dgi.row(b), *dg = dgh.row(b), *dd = direct.row(b);
        for (int64_t j = j0; j < H; j++) {
            const A r = A(gs[j]), z = A(gs[H + j]), n = A(gs[2 * H + j]), hn = A(gs[3 * H + j]);
            const A grad = A(d[j]) + (dyb ? A(dyb[j]) : A(0));
            const A dn = grad * (A(1) - z) * (A(1) - n * n);
            const A dr = dn * hn * r * (A(1) - r);
            const A dz = grad * (A(hp[j]) - n) * z * (A(1) - z);
            di[j] = dg[j] = T(dr);
            di[H + j] = dg[H + j] = T(dz);
            di[2 * H + j] = T(dn);
            dg[2 * H + j] = T(dn * r);
            dd[j] = T(grad * z);
        }
    }
}

/* float32 steps over VL lanes (vec.h's vexp; tanh(x) = 1 - 2 / (exp(2x) + 1)), built for AVX2 + FMA and for the
 * baseline (x86-64-v3: AVX2 and FMA; "avx2,fma" made two clones, the one picked without FMA), the one this CPU
 * runs picked at load (GCC target_clones; ops.cpp is not built per instruction set). */
static inline vf vsig(vf x) { return 1.0f / (1.0f + vexp(-x)); }
static inline vf vtanh(vf x) { return 1.0f - 2.0f / (vexp(x + x) + 1.0f); }
#define GRU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))  // AVX2 with FMA

/* Lanes [0, j) of each row by vectors; the scalar step does the rest. */
GRU_CLONES int64_t step_forward_f32(Rows<const float> gi, Rows<const float> gh, Rows<const float> h, Rows<float> y,
                                    Rows<float> g, int64_t B, int64_t H) {
    const int64_t J = H / VL * VL;
    for (int64_t b = 0; b < B; b++) {
        const float *xi = gi.row(b), *hh = gh.row(b), *hp = h.row(b);
        float *out = y.row(b), *gs = g.data ? g.row(b) : nullptr;
        for (int64_t j = 0; j < J; j += VL) {
            const vf r = vsig(*(const vfu *)(xi + j) + *(const vfu *)(hh + j));
            const vf z = vsig(*(const vfu *)(xi + H + j) + *(const vfu *)(hh + H + j));
            const vf hn = *(const vfu *)(hh + 2 * H + j);
            const vf n = vtanh(*(const vfu *)(xi + 2 * H + j) + r * hn);
            *(vfu *)(out + j) = (1.0f - z) * n + z * *(const vfu *)(hp + j);
            if (gs) *(vfu *)(gs + j) = r, *(vfu *)(gs + H + j) = z, *(vfu *)(gs + 2 * H + j) = n, *(vfu *)(gs + 3 * H + j) = hn;
        }
    }
    return J;
}

GRU_CLONES int64_t step_backward_f32(Rows<const float> dh, Rows<const float> dy, Rows<const float> g,
                                     Rows<const float> h, Rows<float> dgi, Rows<float> dgh, Rows<float> direct,
                                     int64_t B, int64_t H) {
    const int64_t J = H / VL * VL;
    for (int64_t b = 0; b < B; b++) {
        const float *d = dh.row(b), *dyb = dy.data ? dy.row(b) : nullptr, *gs = g.row(b), *hp = h.row(b);
        float *di = dgi.row(b), *dg = dgh.row(b), *dd = direct.row(b);
        for (int64_t j = 0; j < J; j += VL) {
            const vf r = *(const vfu *)(gs + j), z = *(const vfu *)(gs + H + j), n = *(const vfu *)(gs + 2 * H + j),
                     hn = *(const vfu *)(gs + 3 * H + j);
            const vf grad = *(const vfu *)(d + j) + (dyb ? *(const vfu *)(dyb + j) : splat(0.0f));
            const vf dn = grad * (1.0f - z) * (1.0f - n * n);
            const vf dr = dn * hn * r * (1.0f - r);
            const vf dz = grad * (*(const vfu *)(hp + j) - n) * z * (1.0f - z);
            *(vfu *)(di + j) = dr, *(vfu *)(dg + j) = dr;
            *(vfu *)(di + H + j) = dz, *(vfu *)(dg + H + j) = dz;
            *(vfu *)(di + 2 * H + j) = dn, *(vfu *)(dg + 2 * H + j) = dn * r;
            *(vfu *)(dd + j) = grad * z;
        }
    }
    return J;
}

/* A layer's weights from the flat list [w_ih, w_hh, (b_ih, b_hh)] per layer. */
struct Weights {
    Tensor w_ih, w_hh, b_ih, b_hh;
};

inline Weights layer_weights(at::TensorList weights, bool has_biases, int64_t l) {
    const int64_t k = has_biases ? 4 : 2, i = l * k;
    return {weights[i], weights[i + 1], has_biases ? weights[i + 2] : Tensor(), has_biases ? weights[i + 3] : Tensor()};
}

/* a b, contiguous. A float32 product of 2-15 columns is computed as (b^T a^T)^T: MKL's SGEMM is several times slower
 * on such an output than on its transpose (recompile/narrow_gemm.py: the same rule in Inductor's graphs). */
inline Tensor narrow_mm(const Tensor &a, const Tensor &b) {
    const int64_t n = b.size(1);
    if (a.scalar_type() != at::kFloat || n < 2 || n >= 16 || a.size(0) <= n) return at::mm(a, b);
    return at::mm(b.t(), a.t()).t().contiguous();
}

inline Tensor affine(const Tensor &bias, const Tensor &x, const Tensor &w_t) {
    return bias.defined() ? at::addmm(bias, x, w_t) : at::mm(x, w_t);
}

/* The hidden GEMM of a step into ``out``: h W^T + b. */
inline void affine_out(Tensor &out, const Tensor &bias, const Tensor &h, const Tensor &w_t) {
    if (bias.defined())
        at::addmm_out(out, bias, h, w_t);
    else
        at::mm_out(out, h, w_t);
}

/* Forward of one layer over ``x`` (a chunk's sequences in ``lay``) into ``y``; the gates into ``g`` if defined;
 * ``gh`` a [B, 3H] buffer. */
template <class T, class A>
void layer_forward(const Layout &lay, const Tensor &x, const Tensor &h0, const Weights &w, const Tensor &y,
                   const Tensor &g, Tensor gh) {
    const int64_t T_ = lay.steps(x), B = h0.size(0), H = h0.size(1);
    const Tensor gi = affine(w.b_ih, lay.flat(x), w.w_ih.t()).view({x.size(0), x.size(1), 3 * H});
    const Tensor w_hh_t = w.w_hh.t();
    Tensor h = h0;
    for (int64_t t = 0; t < T_; t++) {
        affine_out(gh, w.b_hh, h, w_hh_t);
        const Tensor yt = lay.step(y, t);
        const auto args = std::make_tuple(rows<const T>(lay.step(gi, t)), rows<const T>(gh), rows<const T>(h),
                                          rows<T>(yt), g.defined() ? rows<T>(lay.step(g, t)) : Rows<T>{nullptr, 0}, B, H);
        int64_t j0 = 0;
        if constexpr (std::is_same_v<T, float>) j0 = std::apply(step_forward_f32, args);
        std::apply(step_forward<T, A>, std::tuple_cat(args, std::make_tuple(j0)));
        h = yt;
    }
}

/* The layers' initial states: hx [L, B, H], or zeros. */
inline Tensor initial_state(const std::optional<Tensor> &hx, int64_t L, int64_t B, int64_t H, const Tensor &like) {
    return hx && hx->defined() ? hx->contiguous() : at::zeros({L, B, H}, like.options());
}

/* (output, h_n, saved): saved = each layer's output but the last, then each layer's gates (empty without save).
 * The batch runs in chunks of rows (chunk_rows), each through every step and layer. */
template <class T, class A>
std::tuple<Tensor, Tensor, std::vector<Tensor>> forward(const Tensor &input, const std::optional<Tensor> &hx,
                                                        at::TensorList weights, bool has_biases, int64_t L,
                                                        bool batch_first, bool save) {
    const Layout lay{batch_first};
    const int64_t T_ = lay.steps(input), B = input.size(lay.batch_dim()), H = weights[1].size(1);
    const Tensor h0 = initial_state(hx, L, B, H, input), x = input.contiguous();
    std::vector<Tensor> ys, gates, last;
    for (int64_t l = 0; l < L; l++) {
        ys.push_back(lay.empty(input, T_, B, H));
        if (save) gates.push_back(lay.empty(input, T_, B, 4 * H));
    }
    const int64_t rows = chunk_rows(B, T_, input.size(2), H, input.element_size());
    const Tensor gh = at::empty({std::min(B, rows), 3 * H}, input.options());
    for (int64_t b0 = 0; b0 < B; b0 += rows) {
        const int64_t n = std::min(rows, B - b0);
        Tensor xl = lay.rows(x, b0, n);
        for (int64_t l = 0; l < L; l++) {
            const Tensor y = lay.rows(ys[l], b0, n);
            layer_forward<T, A>(lay, xl, h0[l].narrow(0, b0, n), layer_weights(weights, has_biases, l), y,
                                save ? lay.rows(gates[l], b0, n) : Tensor(), gh.narrow(0, 0, n));
            xl = y;
        }
    }
    for (int64_t l = 0; l < L; l++) last.push_back(T_ ? lay.step(ys[l], T_ - 1) : h0[l]);
    std::vector<Tensor> saved;
    if (save) {
        saved.assign(ys.begin(), ys.end() - 1);
        saved.insert(saved.end(), gates.begin(), gates.end());
    }
    return {ys.back(), at::stack(last), saved};
}

/* acc += v (acc undefined: v). */
inline void accumulate(Tensor &acc, const Tensor &v) {
    if (acc.defined())
        acc.add_(v);
    else
        acc = v;
}

/* One layer's backward over a chunk: ``dy`` its output's gradient (undefined: none), ``dh`` its final state's
 * (overwritten: the initial state's on return), ``x`` / ``y`` / ``g`` / ``h0`` the chunk's input, output, gates
 * and initial state; ``dgi`` / ``dgh`` buffers of the chunk's gates' size. Adds the weights' gradients into
 * ``grad_weights[i..]`` and returns the input's gradient. */
template <class T, class A>
Tensor layer_backward(const Layout &lay, const Tensor &dy, Tensor &dh, const Tensor &x, const Tensor &y,
                      const Tensor &g, const Tensor &h0, const Weights &w, const Tensor &dgi, const Tensor &dgh,
                      Tensor *grad_weights) {
    const int64_t T_ = lay.steps(x), B = h0.size(0), H = h0.size(1);
    Tensor dh_next = at::empty_like(dh), direct = at::empty_like(dh);
    for (int64_t t = T_ - 1; t >= 0; t--) {
        const Tensor h = t ? lay.step(y, t - 1) : h0, dgh_t = lay.step(dgh, t);
        const auto args = std::make_tuple(
            rows<const T>(dh), dy.defined() ? rows<const T>(lay.step(dy, t)) : Rows<const T>{nullptr, 0},
            rows<const T>(lay.step(g, t)), rows<const T>(h), rows<T>(lay.step(dgi, t)), rows<T>(dgh_t),
            rows<T>(direct), B, H);
        int64_t j0 = 0;
        if constexpr (std::is_same_v<T, float>) j0 = std::apply(step_backward_f32, args);
        std::apply(step_backward<T, A>, std::tuple_cat(args, std::make_tuple(j0)));
        at::addmm_out(dh_next, direct, dgh_t, w.w_hh);
        std::swap(dh, dh_next);
    }
    const Tensor dgi2 = lay.flat(dgi), dgh2 = lay.flat(dgh);
    const Tensor prev =
        T_ ? at::cat({h0.unsqueeze(lay.time_dim()), y.narrow(lay.time_dim(), 0, T_ - 1)}, lay.time_dim()) : y;
    accumulate(grad_weights[0], narrow_mm(dgi2.t(), lay.flat(x)));
    accumulate(grad_weights[1], narrow_mm(dgh2.t(), lay.flat(prev)));
    if (w.b_ih.defined()) accumulate(grad_weights[2], dgi2.sum(0)), accumulate(grad_weights[3], dgh2.sum(0));
    return narrow_mm(dgi2, w.w_ih).view({x.size(0), x.size(1), x.size(2)});
}

/* (grad_input, grad_hx, grad_weights) of forward(..., save=true), over the same chunks of rows. */
template <class T, class A>
std::tuple<Tensor, Tensor, std::vector<Tensor>> backward(const std::optional<Tensor> &grad_output,
                                                         const std::optional<Tensor> &grad_hn, const Tensor &input,
                                                         const std::optional<Tensor> &hx, at::TensorList weights,
                                                         const Tensor &output, at::TensorList saved, bool has_biases,
                                                         int64_t L, bool batch_first) {
    const Layout lay{batch_first};
    const int64_t T_ = lay.steps(input), B = input.size(lay.batch_dim()), H = weights[1].size(1);
    TORCH_CHECK((int64_t)saved.size() == 2 * L - 1,
                "recompile.gru: differentiated after a forward that saved nothing (save=False)");
    const Tensor h0 = initial_state(hx, L, B, H, input);
    std::vector<Tensor> xs, ys, gs, grad_weights(weights.size());
    for (int64_t l = 0; l < L; l++) {
        xs.push_back((l ? saved[l - 1] : input).contiguous());
        ys.push_back((l + 1 < L ? saved[l] : output).contiguous());
        gs.push_back(saved[L - 1 + l].contiguous());
    }
    const Tensor dout = grad_output && grad_output->defined() ? grad_output->contiguous() : Tensor();
    Tensor grad_input = lay.empty(input, T_, B, input.size(2)), grad_hx = at::empty({L, B, H}, input.options());
    const int64_t rows = chunk_rows(B, T_, input.size(2), H, input.element_size()), k = has_biases ? 4 : 2;
    const Tensor dgi = lay.empty(input, T_, std::min(B, rows), 3 * H), dgh = at::empty_like(dgi);
    for (int64_t b0 = 0; b0 < B; b0 += rows) {
        const int64_t n = std::min(rows, B - b0);
        Tensor dy = dout.defined() ? lay.rows(dout, b0, n) : Tensor();
        for (int64_t l = L - 1; l >= 0; l--) {
            Tensor dh = grad_hn && grad_hn->defined()
                            ? (*grad_hn)[l].narrow(0, b0, n).clone(at::MemoryFormat::Contiguous)
                            : at::zeros({n, H}, input.options());
            dy = layer_backward<T, A>(lay, dy, dh, lay.rows(xs[l], b0, n), lay.rows(ys[l], b0, n),
                                      lay.rows(gs[l], b0, n), h0[l].narrow(0, b0, n),
                                      layer_weights(weights, has_biases, l), lay.rows(dgi, 0, n), lay.rows(dgh, 0, n),
                                      grad_weights.data() + l * k);
            grad_hx[l].narrow(0, b0, n).copy_(dh);
        }
        lay.rows(grad_input, b0, n).copy_(dy);
    }
    for (size_t i = 0; i < weights.size(); i++)
        if (!grad_weights[i].defined()) grad_weights[i] = at::zeros_like(weights[i]);  // batch 0
    return {grad_input, grad_hx, grad_weights};
}

}  // namespace gru
