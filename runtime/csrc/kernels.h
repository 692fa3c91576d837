/* The native CPU kernels' interface: every entry point of the kernel bodies (dropout.h, embedding.h,
 * interaction.h, jagged_attention.h, padded_attention.h, quantized.h, sampled_softmax.h), and the table of them one instruction set offers.
 *
 * The bodies are compiled once per instruction set (isa_generic.cpp, isa_avx2.cpp, isa_avx512.cpp: the same
 * source under a different `#pragma GCC target`), each into its own namespace; ops.cpp picks one table when the
 * library loads (isa.cpp) and its torch operators call through it. Nothing here includes torch headers: the
 * kernel translation units are compiled for instruction sets the operators' code must not assume. */
#ifndef RECOMPILE_KERNELS_H
#define RECOMPILE_KERNELS_H

#include <stdint.h>

namespace recompile_native {

typedef uint16_t bf16_t;

/* One hstu_attention call (jagged_attention.h). Strides are in elements: [token, head]; the last dimension is
 * contiguous. Optional pointers are NULL when absent. */
typedef struct {
    const void *q, *k, *v, *grad;
    int64_t q_stride[2], k_stride[2], v_stride[2], grad_stride[2];
    const int64_t *offsets; /* [batch + 1], within [0, total] */
    int64_t total, batch, heads, dim, dim_v, max_seq_len;
    float alpha;
    int32_t causal;
    int64_t contextual;
    const int64_t *num_targets; /* [batch] */
    const float *rel_bias;      /* [2 * max_seq_len - 1 + VL], zero-padded */
    const int64_t *timestamps;  /* [total + VL] */
    const float *time_bias;     /* [num_buckets + 1] */
    const float *bucket_bounds; /* [num_buckets + 2]: -inf, the float gap where each bucket >= 1 starts, inf */
    int64_t num_buckets;
    int32_t dtype, threads;
    void *out;           /* forward: [T, H, Dv] contiguous */
    void *dq, *dk, *dv;  /* backward: contiguous, q's storage type */
    float *drel, *dtime; /* backward: [2 * max_seq_len - 1], [num_buckets + 1], zeroed */
} hstu_problem;

/* One padded_softmax_attention call (padded_attention.h): q [B, H, nq, dim], k [B, H, n, dim], v and grad
 * [B, H, n | nq, dim_v] in one storage type, strides in elements over [batch, head, row] (the last dimension
 * contiguous); the additive float mask's strides over [batch, head, query row, key] (0 where broadcast). */
typedef struct {
    const void *q, *k, *v, *grad;
    int64_t q_stride[3], k_stride[3], v_stride[3], grad_stride[3];
    const float *mask;
    int64_t mask_stride[4], mask_heads; /* mask_heads: 1 or heads */
    float dropped;                      /* a mask value at or below it drops its key: -1e4 in the mask's dtype */
    const int64_t *rows;                /* [batch], the read rows, or NULL for every row */
    int64_t batch, heads, nq, n, dim, dim_v;
    float scale;
    int32_t dtype, threads;
    void *out;          /* forward: [B, H, nq, dim_v] contiguous */
    void *dq, *dk, *dv; /* backward: contiguous */
} padded_attention_problem;

/* One sampled_softmax_loss call (sampled_softmax.h). */
typedef struct {
    const float *pos, *neg;                  /* [N], [N, K] rows of K */
    const int64_t *sorted, *order, *targets; /* NULL without ids */
    int64_t rows, k;
    float scale;
} sampled_softmax_problem;

namespace api { /* prototypes only: the entry points' types */
void dropout_f32(const float *x, float *out, int64_t n, uint32_t s0, uint32_t s1, uint32_t threshold, float scale,
                 int threads);
void geb_forward_pooled(int64_t T, const int64_t *meta, int64_t B, void *out, int64_t out_stride, int64_t *err,
                        int stream, int threads);
void geb_forward_sequence(int64_t T, const int64_t *meta, void *out, int64_t out_stride, int64_t *err, int threads);
void geb_backward(int64_t T, const int64_t *meta, int64_t B, const void *grad, int64_t grad_stride,
                  const int64_t *table_out, const int64_t *dense, const int64_t *psw_out, int64_t *err, int threads);
void geb_optimizer_step(int64_t T, const int64_t *meta, int64_t B, const float *grad, int64_t grad_stride, int kind,
                        const double *hyper, const int64_t *state, const double *step_size, float *sums_all,
                        int64_t *touched_all, int32_t *slots_all, int64_t *err, int threads);
void qeb_forward_pooled(int64_t T, const int64_t *meta, int64_t B, float *out, int64_t out_stride, int64_t *err,
                        int stream, int threads);
int sampled_softmax_fwd(sampled_softmax_problem p, float *loss, float *lse, int threads);
void sampled_softmax_bwd(sampled_softmax_problem p, const float *grad, const float *lse, float *grad_pos,
                         float *grad_neg, int threads);
int hstu_attention_fwd(const hstu_problem *p);
int hstu_attention_bwd(const hstu_problem *p);
int padded_attention_fwd(const padded_attention_problem *p);
int padded_attention_bwd(const padded_attention_problem *p);
#define RECOMPILE_INTERACTION_API(S, T)                                                                        \
    void dot_interaction_fwd_##S(const int64_t *feat, const int64_t *stride, int64_t F, int64_t B, int64_t D,  \
                                 const T *prefix, int64_t prefix_stride, int64_t K, const int32_t *lo,         \
                                 const int32_t *hi, const int32_t *off, int64_t P, T *out, int threads);       \
    void dot_interaction_bwd_##S(const T *grad, int64_t grad_stride, const int64_t *feat, const int64_t *stride, \
                                 const int64_t *out, const int64_t *out_stride, int64_t F, int64_t B, int64_t D, \
                                 const int32_t *lo, const int32_t *hi, const int32_t *off, int threads);       \
    void cross_epilogue_fwd_##S(const T *x0, const T *x, const T *h, const T *bias, T *out, T *hb_out, int64_t B, \
                                int64_t D, int threads);                                                       \
    void cross_epilogue_bwd_##S(const T *grad, const T *x0, const T *h, const T *bias, T *grad_h, T *grad_x0,  \
                                float *grad_bias, int64_t B, int64_t D, int threads);                          \
    void fm_second_order_fwd_##S(const T *v, int64_t B, int64_t F, int64_t D, int reduce, T *out, int threads); \
    void fm_second_order_bwd_##S(const T *grad, const T *v, int64_t B, int64_t F, int64_t D, int reduce, T *out, \
                                 int threads);                                                                 \
    void vector_cross_fwd_##S(const T *x0, const T *x, const float *W, const float *bias, int64_t L,           \
                              int64_t Dp, T *out, int64_t B, int64_t D, int threads);                        \
    void vector_cross_bwd_##S(const T *grad, const T *x0, const T *x, const float *W, const float *bias,       \
                              int64_t L, int64_t Dp, T *grad_x0, T *grad_x, float *grad_W, float *grad_bias, \
                              int64_t B, int64_t D, int threads);                                             \
    void cross_stack_fwd_##S(const T *x0, const T *x, const float *Ut, const float *V, const float *bias,       \
                             int64_t L, int64_t K, int64_t Dp, T *out, T *const *hbs, T *const *inputs,        \
                             int64_t B, int64_t D, int threads);                                             \
    void cross_mixture_fwd_##S(const T *x0, const T *x, const float *V, const float *G, const float *C,          \
                               int64_t Cs, const float *Ut, int64_t E, int64_t rank, int64_t K, int relu,        \
                               int64_t Dp, T *out, int64_t B, int64_t D, int threads);
RECOMPILE_INTERACTION_API(f32, float)
RECOMPILE_INTERACTION_API(f16, _Float16)
RECOMPILE_INTERACTION_API(bf16, bf16_t)
}  // namespace api

/* X(body namespace, entry point) for every entry point. */
#define RECOMPILE_INTERACTION_ENTRIES(X, S)                                                                    \
    X(interaction, dot_interaction_fwd_##S) X(interaction, dot_interaction_bwd_##S)                            \
    X(interaction, cross_epilogue_fwd_##S) X(interaction, cross_epilogue_bwd_##S)                              \
    X(interaction, fm_second_order_fwd_##S) X(interaction, fm_second_order_bwd_##S)                            \
    X(interaction, vector_cross_fwd_##S) X(interaction, vector_cross_bwd_##S)                                  \
    X(interaction, cross_stack_fwd_##S) X(interaction, cross_mixture_fwd_##S)
#define RECOMPILE_ENTRIES(X)                                                                                   \
    X(dropout, dropout_f32)                                                                                    \
    X(embedding, geb_forward_pooled) X(embedding, geb_forward_sequence) X(embedding, geb_backward)             \
    X(embedding, geb_optimizer_step) X(embedding, qeb_forward_pooled)                                          \
    X(sampled_softmax, sampled_softmax_fwd) X(sampled_softmax, sampled_softmax_bwd)                            \
    X(jagged_attention, hstu_attention_fwd) X(jagged_attention, hstu_attention_bwd)                            \
    X(jagged_attention, padded_attention_fwd) X(jagged_attention, padded_attention_bwd)                        \
    RECOMPILE_INTERACTION_ENTRIES(X, f32) RECOMPILE_INTERACTION_ENTRIES(X, f16)                                \
    RECOMPILE_INTERACTION_ENTRIES(X, bf16)

/* The entry points one instruction set's build offers. */
struct Kernels {
    const char *isa;
#define RECOMPILE_MEMBER(ns, f) decltype(&api::f) f;
    RECOMPILE_ENTRIES(RECOMPILE_MEMBER)
#undef RECOMPILE_MEMBER
};

extern const Kernels generic_kernels;
#if defined(__x86_64__)
extern const Kernels avx2_kernels, avx512_kernels;
#endif

/* The table the operators call: AVX-512 where the CPU has it, else AVX2, else the generic build; the environment
 * variable RECOMPILE_ISA (generic, avx2, avx512) forces one (an error if this CPU lacks it). */
const Kernels &kernels();
/* Switch to ``isa`` (an error if unknown or this CPU lacks it); returns the one before. */
const char *use_isa(const char *isa);
/* Whether this build and CPU can run ``isa``. */
bool has_isa(const char *isa);

}  // namespace recompile_native

#endif
