/* CPU kernels of recompile::gru (runtime/recurrent.py): a unidirectional multi-layer GRU, forward and BPTT
 * backward, as torch.gru computes it (gates r, z, n in PyTorch's row order of weight_ih / weight_hh):
 *     r = sigmoid(x W_ir^T + b_ir + h W_hr^T + b_hr)      z = sigmoid(x W_iz^T + b_iz + h W_hz^T + b_hz)
 *     n = tanh(x W_in^T + b_in + r * hn),  hn = h W_hn^T + b_hn      h' = (1 - z) * n + z * h
 * Included by ops.cpp (after kernels.h). Per layer, the input projections of every step are
 * one GEMM (at::addmm, as ATen does); each step is one GEMM of the hidden state (at::addmm_out into a buffer) and
 * one pass over the gates. A sequence tensor keeps the layout of the op's input ([T, B, C], or [B, T, C] with
 * batch_first): a step is a [B, C] view with a row stride, so no transpose is copied. With ``save`` the forward
 * keeps, per step, r, z, n and hn ([.., 4H]) and each layer's output but the last (the op's output): the backward
 * reads them and recomputes nothing. The backward runs the steps in reverse (the gates' gradients, then one GEMM
 * for the hidden state's), then per layer three GEMMs for the input's and the weights' gradients over all steps.
 * Gate arithmetic is in float for float32, bfloat16 and float16 storage (double for float64). */
#include <ATen/OpMathType.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

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
    Tensor step(const Tensor &seq, int64_t t) const { return seq.select(time_dim(), t); }
    int64_t steps(const Tensor &seq) const { return seq.size(time_dim()); }
    Tensor flat(const Tensor &seq) const { return seq.view({-1, seq.size(2)}); }  // every step's rows, contiguous
    Tensor empty(const Tensor &like, int64_t T, int64_t B, int64_t C) const {
        return at::empty(batch_first ? at::IntArrayRef{B, T, C} : at::IntArrayRef{T, B, C}, like.options());
    }
};

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
 * baseline, the one this CPU runs picked at load (GCC target_clones; ops.cpp is not built per instruction set). */
static inline vf vsig(vf x) { return 1.0f / (1.0f + vexp(-x)); }
static inline vf vtanh(vf x) { return 1.0f - 2.0f / (vexp(x + x) + 1.0f); }
#define GRU_CLONES __attribute__((target_clones("avx2,fma", "default")))

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

/* Forward of one layer over ``x`` (a sequence in ``lay``): returns its output; the gates into ``g`` if defined. */
template <class T, class A>
Tensor layer_forward(const Layout &lay, const Tensor &x, const Tensor &h0, const Weights &w, const Tensor &g) {
    const int64_t T_ = lay.steps(x), B = h0.size(0), H = h0.size(1);
    const Tensor gi = affine(w.b_ih, lay.flat(x), w.w_ih.t()).view({x.size(0), x.size(1), 3 * H});
    const Tensor w_hh_t = w.w_hh.t();
    Tensor y = lay.empty(x, T_, B, H), gh = at::empty({B, 3 * H}, x.options());
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
    return y;
}

/* The layers' initial states: hx [L, B, H], or zeros. */
inline Tensor initial_state(const std::optional<Tensor> &hx, int64_t L, int64_t B, int64_t H, const Tensor &like) {
    return hx && hx->defined() ? hx->contiguous() : at::zeros({L, B, H}, like.options());
}

/* (output, h_n, saved): saved = each layer's output but the last, then each layer's gates (empty without save). */
template <class T, class A>
std::tuple<Tensor, Tensor, std::vector<Tensor>> forward(const Tensor &input, const std::optional<Tensor> &hx,
                                                        at::TensorList weights, bool has_biases, int64_t L,
                                                        bool batch_first, bool save) {
    const Layout lay{batch_first};
    const int64_t T_ = lay.steps(input), B = input.size(batch_first ? 0 : 1), H = weights[1].size(1);
    const Tensor h0 = initial_state(hx, L, B, H, input);
    std::vector<Tensor> outputs, gates, last;
    Tensor x = input.contiguous();
    for (int64_t l = 0; l < L; l++) {
        const Tensor g = save ? lay.empty(input, T_, B, 4 * H) : Tensor();
        x = layer_forward<T, A>(lay, x, h0[l], layer_weights(weights, has_biases, l), g);
        if (save && l + 1 < L) outputs.push_back(x);
        if (save) gates.push_back(g);
        last.push_back(T_ ? lay.step(x, T_ - 1) : h0[l]);
    }
    outputs.insert(outputs.end(), gates.begin(), gates.end());
    return {x, at::stack(last), outputs};
}

/* (grad_input, grad_hx, grad_weights) of forward(..., save=true). */
template <class T, class A>
std::tuple<Tensor, Tensor, std::vector<Tensor>> backward(const std::optional<Tensor> &grad_output,
                                                         const std::optional<Tensor> &grad_hn, const Tensor &input,
                                                         const std::optional<Tensor> &hx, at::TensorList weights,
                                                         const Tensor &output, at::TensorList saved, bool has_biases,
                                                         int64_t L, bool batch_first) {
    const Layout lay{batch_first};
    const int64_t T_ = lay.steps(input), B = input.size(batch_first ? 0 : 1), H = weights[1].size(1);
    TORCH_CHECK((int64_t)saved.size() == 2 * L - 1,
                "recompile.gru: differentiated after a forward that saved nothing (save=False)");
    const Tensor h0 = initial_state(hx, L, B, H, input);
    std::vector<Tensor> grad_weights(weights.size()), grad_h0(L);
    Tensor dy = grad_output && grad_output->defined() ? grad_output->contiguous() : Tensor();
    Tensor dh_next = at::empty({B, H}, input.options()), direct = at::empty({B, H}, input.options());
    for (int64_t l = L - 1; l >= 0; l--) {
        const Weights w = layer_weights(weights, has_biases, l);
        const Tensor x = (l ? saved[l - 1] : input).contiguous(), y = (l + 1 < L ? saved[l] : output).contiguous();
        const Tensor g = saved[L - 1 + l].contiguous();
        Tensor dgi = lay.empty(input, T_, B, 3 * H), dgh = lay.empty(input, T_, B, 3 * H);
        Tensor dh = grad_hn && grad_hn->defined() ? (*grad_hn)[l].clone(at::MemoryFormat::Contiguous) : at::zeros({B, H}, input.options());
        for (int64_t t = T_ - 1; t >= 0; t--) {
            const Tensor h = t ? lay.step(y, t - 1) : h0[l], dgh_t = lay.step(dgh, t);
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
        grad_h0[l] = dh.clone();
        const Tensor dgi2 = lay.flat(dgi), dgh2 = lay.flat(dgh);
        const Tensor prev = T_ ? at::cat({h0[l].unsqueeze(lay.time_dim()), y.narrow(lay.time_dim(), 0, T_ - 1)},
                                         lay.time_dim())
                               : y;
        const int64_t k = has_biases ? 4 : 2;
        grad_weights[l * k] = narrow_mm(dgi2.t(), lay.flat(x));
        grad_weights[l * k + 1] = narrow_mm(dgh2.t(), lay.flat(prev));
        if (has_biases) grad_weights[l * k + 2] = dgi2.sum(0), grad_weights[l * k + 3] = dgh2.sum(0);
        dy = narrow_mm(dgi2, w.w_ih).view({x.size(0), x.size(1), x.size(2)});  // the layer input's gradient
    }
    return {dy, at::stack(grad_h0), grad_weights};
}

}  // namespace gru
