/* CPU kernels of recompile::lstm (runtime/recurrent.py): a unidirectional multi-layer LSTM, forward and BPTT
 * backward, as torch.lstm computes it (gates i, f, g, o in PyTorch's row order of weight_ih / weight_hh):
 *     a = x W_ih^T + b_ih + h W_hh^T + b_hh = [a_i, a_f, a_g, a_o]
 *     i = sigmoid(a_i)  f = sigmoid(a_f)  g = tanh(a_g)  o = sigmoid(a_o)      c' = f * c + i * g   h' = o * tanh(c')
 * Included by ops.cpp after gru.h, whose helpers it shares (step views, the sequence layout, a layer's weights,
 * the vector math). Per layer, the input projections of every step are one GEMM; each step one GEMM of the hidden
 * state and one pass over the gates. With ``save`` the forward keeps, per step, i, f, g, o and c' ([.., 5H]) and
 * each layer's output but the last: the backward reads them (tanh(c') is recomputed). The backward runs the steps
 * in reverse (the gates' gradients and the cell state's, then one GEMM for the hidden state's), then per layer
 * three GEMMs for the input's and the weights' gradients over all steps (both biases take the gates' gradient). */

namespace lstm {

using at::Tensor;
using gru::affine;
using gru::affine_out;
using gru::initial_state;
using gru::layer_weights;
using gru::narrow_mm;
using gru::Layout;
using gru::Rows;
using gru::rows;
using gru::sigmoid;
using gru::Weights;
using gru::vf;
using gru::vfu;
using gru::VL;

/* Row b of a step's saved gates from gate ``k`` on (k = 4: the saved cell state). */
template <class T>
Rows<T> slot(Rows<T> g, int64_t k, int64_t H) {
    return {g.data ? g.data + k * H : nullptr, g.stride};
}

/* One step: gi, gh the projections (biases in), c the previous cell state -> y (h'), c_out (c'; may be c) and,
 * with g, the saved i, f, g, o, c'. Lanes [j0, H). */
template <class T, class A>
void step_forward(Rows<const T> gi, Rows<const T> gh, Rows<const T> c, Rows<T> y, Rows<T> c_out, Rows<T> g,
                  int64_t B, int64_t H, int64_t j0 = 0) {
    for (int64_t b = 0; b < B; b++) {
        const T *xi = gi.row(b), *hh = gh.row(b), *cp = c.row(b);
        T *out = y.row(b), *co = c_out.row(b), *gs = g.data ? g.row(b) : nullptr;
        for (int64_t j = j0; j < H; j++) {
            const A i = sigmoid<A>(A(xi[j]) + A(hh[j]));
            const A f = sigmoid<A>(A(xi[H + j]) + A(hh[H + j]));
            const A gg = std::tanh(A(xi[2 * H + j]) + A(hh[2 * H + j]));
            const A o = sigmoid<A>(A(xi[3 * H + j]) + A(hh[3 * H + j]));
            const A cn = f * A(cp[j]) + i * gg;
            out[j] = T(o * std::tanh(cn));
            co[j] = T(cn);
            if (gs) gs[j] = T(i), gs[H + j] = T(f), gs[2 * H + j] = T(gg), gs[3 * H + j] = T(o);
        }
    }
}

/* One step back: dh (the state's gradient, dy of the step added), dc (the cell state's, updated in place to the
 * previous cell state's) -> dg, the gates' pre-activation gradients (the same for the input's and the hidden
 * state's projections). c the previous cell state. Lanes [j0, H). */
template <class T, class A>
void step_backward(Rows<const T> dh, Rows<const T> dy, Rows<T> dc, Rows<const T> g, Rows<const T> c, Rows<T> dg,
                   int64_t B, int64_t H, int64_t j0 = 0) {
    for (int64_t b = 0; b < B; b++) {
        const T *d = dh.row(b), *dyb = dy.data ? dy.row(b) : nullptr, *gs = g.row(b), *cp = c.row(b);
        T *dcb = dc.row(b), *dgb = dg.row(b);
        for (int64_t j = j0; j < H; j++) {
            const A i = A(gs[j]), f = A(gs[H + j]), gg = A(gs[2 * H + j]), o = A(gs[3 * H + j]);
            const A tc = std::tanh(A(gs[4 * H + j]));
            const A grad = A(d[j]) + (dyb ? A(dyb[j]) : A(0));
            const A dct = A(dcb[j]) + grad * o * (A(1) - tc * tc);
            dgb[j] = T(dct * gg * i * (A(1) - i));
            dgb[H + j] = T(dct * A(cp[j]) * f * (A(1) - f));
            dgb[2 * H + j] = T(dct * i * (A(1) - gg * gg));
            dgb[3 * H + j] = T(grad * tc * o * (A(1) - o));
            dcb[j] = T(dct * f);
        }
    }
}

/* float32 steps over VL lanes, lanes [0, j) of each row; the scalar step does the rest. */
GRU_CLONES int64_t step_forward_f32(Rows<const float> gi, Rows<const float> gh, Rows<const float> c, Rows<float> y,
                                    Rows<float> c_out, Rows<float> g, int64_t B, int64_t H) {
    const int64_t J = H / VL * VL;
    for (int64_t b = 0; b < B; b++) {
        const float *xi = gi.row(b), *hh = gh.row(b), *cp = c.row(b);
        float *out = y.row(b), *co = c_out.row(b), *gs = g.data ? g.row(b) : nullptr;
        for (int64_t j = 0; j < J; j += VL) {
            const vf i = gru::vsig(*(const vfu *)(xi + j) + *(const vfu *)(hh + j));
            const vf f = gru::vsig(*(const vfu *)(xi + H + j) + *(const vfu *)(hh + H + j));
            const vf gg = gru::vtanh(*(const vfu *)(xi + 2 * H + j) + *(const vfu *)(hh + 2 * H + j));
            const vf o = gru::vsig(*(const vfu *)(xi + 3 * H + j) + *(const vfu *)(hh + 3 * H + j));
            const vf cn = f * *(const vfu *)(cp + j) + i * gg;
            *(vfu *)(out + j) = o * gru::vtanh(cn);
            *(vfu *)(co + j) = cn;
            if (gs) *(vfu *)(gs + j) = i, *(vfu *)(gs + H + j) = f, *(vfu *)(gs + 2 * H + j) = gg, *(vfu *)(gs + 3 * H + j) = o;
        }
    }
    return J;
}

GRU_CLONES int64_t step_backward_f32(Rows<const float> dh, Rows<const float> dy, Rows<float> dc, Rows<const float> g,
                                     Rows<const float> c, Rows<float> dg, int64_t B, int64_t H) {
    const int64_t J = H / VL * VL;
    for (int64_t b = 0; b < B; b++) {
        const float *d = dh.row(b), *dyb = dy.data ? dy.row(b) : nullptr, *gs = g.row(b), *cp = c.row(b);
        float *dcb = dc.row(b), *dgb = dg.row(b);
        for (int64_t j = 0; j < J; j += VL) {
            const vf i = *(const vfu *)(gs + j), f = *(const vfu *)(gs + H + j), gg = *(const vfu *)(gs + 2 * H + j),
                     o = *(const vfu *)(gs + 3 * H + j);
            const vf tc = gru::vtanh(*(const vfu *)(gs + 4 * H + j));
            const vf grad = *(const vfu *)(d + j) + (dyb ? *(const vfu *)(dyb + j) : gru::splat(0.0f));
            const vf dct = *(const vfu *)(dcb + j) + grad * o * (1.0f - tc * tc);
            *(vfu *)(dgb + j) = dct * gg * i * (1.0f - i);
            *(vfu *)(dgb + H + j) = dct * *(const vfu *)(cp + j) * f * (1.0f - f);
            *(vfu *)(dgb + 2 * H + j) = dct * i * (1.0f - gg * gg);
            *(vfu *)(dgb + 3 * H + j) = grad * tc * o * (1.0f - o);
            *(vfu *)(dcb + j) = dct * f;
        }
    }
    return J;
}

/* Runs the float32 vector step first where T is float, then the scalar one over the lanes left. */
template <class T, class A, class Vector, class Scalar, class... Args>
void run_step(Vector vector, Scalar scalar, Args... args) {
    int64_t j0 = 0;
    if constexpr (std::is_same_v<T, float>) j0 = vector(args...);
    scalar(args..., j0);
}

/* The cell state step t reads: c0's rows at step 0, else the one step t - 1 saved in ``g``. */
template <class T>
Rows<const T> prev_cell(const Layout &lay, const Tensor &g, const Tensor &c0, int64_t t, int64_t H) {
    const Rows<T> c = t ? slot(rows<T>(lay.step(g, t - 1)), 4, H) : rows<T>(c0);
    return {c.data, c.stride};
}

/* Forward of one layer over ``x``: returns (its output, c_n); the gates into ``g`` if defined. */
template <class T, class A>
std::pair<Tensor, Tensor> layer_forward(const Layout &lay, const Tensor &x, const Tensor &h0, const Tensor &c0,
                                        const Weights &w, const Tensor &g) {
    const int64_t T_ = lay.steps(x), B = h0.size(0), H = h0.size(1);
    const Tensor gi = affine(w.b_ih, lay.flat(x), w.w_ih.t()).view({x.size(0), x.size(1), 4 * H});
    const Tensor w_hh_t = w.w_hh.t();
    Tensor y = lay.empty(x, T_, B, H), gh = at::empty({B, 4 * H}, x.options());
    const Tensor cbuf = g.defined() ? Tensor() : c0.clone(at::MemoryFormat::Contiguous);  // updated in place
    Tensor h = h0;
    for (int64_t t = 0; t < T_; t++) {
        affine_out(gh, w.b_hh, h, w_hh_t);
        const Tensor yt = lay.step(y, t);
        const Rows<T> gt = g.defined() ? rows<T>(lay.step(g, t)) : Rows<T>{nullptr, 0};
        run_step<T, A>(step_forward_f32, step_forward<T, A>, rows<const T>(lay.step(gi, t)), rows<const T>(gh),
                       g.defined() ? prev_cell<T>(lay, g, c0, t, H) : rows<const T>(cbuf), rows<T>(yt),
                       g.defined() ? slot(gt, 4, H) : rows<T>(cbuf), gt, B, H);
        h = yt;
    }
    const Tensor c_n = g.defined() ? lay.step(g, T_ - 1).narrow(1, 4 * H, H) : cbuf;
    return {y, c_n};
}

/* (output, h_n, c_n, saved): saved = each layer's output but the last, then each layer's gates (empty without
 * save). */
template <class T, class A>
std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> forward(const Tensor &input, const std::optional<Tensor> &hx,
                                                                const std::optional<Tensor> &cx,
                                                                at::TensorList weights, bool has_biases, int64_t L,
                                                                bool batch_first, bool save) {
    const Layout lay{batch_first};
    const int64_t T_ = lay.steps(input), B = input.size(batch_first ? 0 : 1), H = weights[1].size(1);
    TORCH_CHECK(T_ > 0, "recompile_native.lstm: input has no steps (sequence length 0)");
    const Tensor h0 = initial_state(hx, L, B, H, input), c0 = initial_state(cx, L, B, H, input);
    std::vector<Tensor> outputs, gates, last_h, last_c;
    Tensor x = input.contiguous();
    for (int64_t l = 0; l < L; l++) {
        const Tensor g = save ? lay.empty(input, T_, B, 5 * H) : Tensor();
        auto [y, c_n] = layer_forward<T, A>(lay, x, h0[l], c0[l], layer_weights(weights, has_biases, l), g);
        x = y;
        if (save && l + 1 < L) outputs.push_back(x);
        if (save) gates.push_back(g);
        last_h.push_back(lay.step(x, T_ - 1));
        last_c.push_back(c_n);
    }
    outputs.insert(outputs.end(), gates.begin(), gates.end());
    return {x, at::stack(last_h), at::stack(last_c), outputs};
}

/* A final state's gradient for layer l: grad_n[l] copied (it is updated in place), or zeros. */
inline Tensor final_grad(const std::optional<Tensor> &grad_n, int64_t l, int64_t B, int64_t H, const Tensor &like) {
    return grad_n && grad_n->defined() ? (*grad_n)[l].clone(at::MemoryFormat::Contiguous)
                                       : at::zeros({B, H}, like.options());
}

/* (grad_input, grad_hx, grad_cx, grad_weights) of forward(..., save=true). */
template <class T, class A>
std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> backward(
    const std::optional<Tensor> &grad_output, const std::optional<Tensor> &grad_hn,
    const std::optional<Tensor> &grad_cn, const Tensor &input, const std::optional<Tensor> &hx,
    const std::optional<Tensor> &cx, at::TensorList weights, const Tensor &output, at::TensorList saved,
    bool has_biases, int64_t L, bool batch_first) {
    const Layout lay{batch_first};
    const int64_t T_ = lay.steps(input), B = input.size(batch_first ? 0 : 1), H = weights[1].size(1);
    TORCH_CHECK((int64_t)saved.size() == 2 * L - 1,
                "recompile.lstm: differentiated after a forward that saved nothing (save=False)");
    const Tensor h0 = initial_state(hx, L, B, H, input), c0 = initial_state(cx, L, B, H, input);
    std::vector<Tensor> grad_weights(weights.size()), grad_h0(L), grad_c0(L);
    Tensor dy = grad_output && grad_output->defined() ? grad_output->contiguous() : Tensor();
    for (int64_t l = L - 1; l >= 0; l--) {
        const Weights w = layer_weights(weights, has_biases, l);
        const Tensor x = (l ? saved[l - 1] : input).contiguous(), y = (l + 1 < L ? saved[l] : output).contiguous();
        const Tensor g = saved[L - 1 + l].contiguous(), c0l = c0[l].contiguous();
        Tensor dg = lay.empty(input, T_, B, 4 * H);
        Tensor dh = final_grad(grad_hn, l, B, H, input), dc = final_grad(grad_cn, l, B, H, input);
        for (int64_t t = T_ - 1; t >= 0; t--) {
            const Tensor dg_t = lay.step(dg, t);
            run_step<T, A>(step_backward_f32, step_backward<T, A>, rows<const T>(dh),
                           dy.defined() ? rows<const T>(lay.step(dy, t)) : Rows<const T>{nullptr, 0}, rows<T>(dc),
                           rows<const T>(lay.step(g, t)), prev_cell<T>(lay, g, c0l, t, H), rows<T>(dg_t), B, H);
            at::mm_out(dh, dg_t, w.w_hh);
        }
        grad_h0[l] = dh;
        grad_c0[l] = dc;
        const Tensor dg2 = lay.flat(dg);
        const Tensor prev = at::cat({h0[l].unsqueeze(lay.time_dim()), y.narrow(lay.time_dim(), 0, T_ - 1)},
                                    lay.time_dim());
        const int64_t k = has_biases ? 4 : 2;
        grad_weights[l * k] = narrow_mm(dg2.t(), lay.flat(x));
        grad_weights[l * k + 1] = narrow_mm(dg2.t(), lay.flat(prev));
        if (has_biases) grad_weights[l * k + 2] = dg2.sum(0), grad_weights[l * k + 3] = grad_weights[l * k + 2].clone();
        dy = narrow_mm(dg2, w.w_ih).view({x.size(0), x.size(1), x.size(2)});  // the layer input's gradient
    }
    return {dy, at::stack(grad_h0), at::stack(grad_c0), grad_weights};
}

}  // namespace lstm
