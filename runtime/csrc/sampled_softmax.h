/* CPU kernels of recompile::sampled_softmax_loss (runtime/sampled_softmax.py), plain C + OpenMP.
 *
 * Row n: logits scale * [pos[n], neg[n, 0..K)], without the negatives whose id equals the row's target id (the
 * accidental hits); loss[n] = logsumexp(logits) - scale * pos[n]. The hits of a row are found by binary search
 * in the negative ids sorted once per call (sorted[j] = ids[order[j]]), so a row costs O(K + log K) whatever the
 * ids. Rows are split across threads; a row (K floats) stays in cache between its passes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

typedef sampled_softmax_problem problem; /* kernels.h */

/* [first, last) of the positions in ``sorted`` equal to ``target``. */
static void hits(const problem *p, int64_t n, int64_t *first, int64_t *last) {
    *first = *last = 0;
    if (!p->sorted) return;
    int64_t lo = 0, hi = p->k, target = p->targets[n];
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (p->sorted[mid] < target) lo = mid + 1; else hi = mid;
    }
    *first = *last = lo;
    while (*last < p->k && p->sorted[*last] == target) (*last)++;
}

/* row * scale into buf, the hits -inf; returns the row's largest logit (pos included). */
static float scaled_row(const problem *p, int64_t n, float *buf) {
    const float *row = p->neg + n * p->k;
    int64_t first, last, k = 0;
    for (; k + VL <= p->k; k += VL) *(vfu *)(buf + k) = *(const vfu *)(row + k) * p->scale;
    for (; k < p->k; k++) buf[k] = row[k] * p->scale;
    hits(p, n, &first, &last);
    for (int64_t j = first; j < last; j++) buf[p->order[j]] = -INFINITY;
    vf vm = splat(-INFINITY);
    for (k = 0; k + VL <= p->k; k += VL) {
        vf v = *(const vfu *)(buf + k);
        vm = vselect(v > vm, v, vm);
    }
    float m = p->pos[n] * p->scale;
    for (int l = 0; l < VL; l++) m = fmaxf(m, vm[l]);
    for (; k < p->k; k++) m = fmaxf(m, buf[k]);
    return m;
}

/* sum over the row of exp(buf - m), -inf (hits) counting 0 */
static float exp_sum(const float *buf, int64_t k_total, float m) {
    vf acc = splat(0.0f);
    int64_t k = 0;
    for (; k + VL <= k_total; k += VL) {
        vf v = *(const vfu *)(buf + k);
        acc += vselect(v == splat(-INFINITY), splat(0.0f), vexp(v - m));
    }
    float sum = 0.0f;
    for (int l = 0; l < VL; l++) sum += acc[l];
    for (; k < k_total; k++) sum += expf(buf[k] - m);
    return sum;
}

int sampled_softmax_fwd(problem p, float *loss, float *lse, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc((size_t)(p.k ? p.k : 1) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < p.rows; n++) {
            if (!buf) continue;
            float m = scaled_row(&p, n, buf), s = p.pos[n] * p.scale;
            float total = expf(s - m) + exp_sum(buf, p.k, m);
            lse[n] = m + logf(total);
            loss[n] = lse[n] - s;
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* grad_neg[n, k] = grad[n] * scale * exp(scale * neg[n, k] - lse[n]) (0 at hits), grad_pos[n] = grad[n] * scale *
 * (exp(scale * pos[n] - lse[n]) - 1). */
void sampled_softmax_bwd(problem p, const float *grad, const float *lse, float *grad_pos, float *grad_neg,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < p.rows; n++) {
        const float *row = p.neg + n * p.k;
        float *out = grad_neg + n * p.k, g = grad[n] * p.scale, l = lse[n];
        int64_t k = 0, first, last;
        for (; k + VL <= p.k; k += VL) *(vfu *)(out + k) = vexp(*(const vfu *)(row + k) * p.scale - l) * g;
        for (; k < p.k; k++) out[k] = expf(row[k] * p.scale - l) * g;
        hits(&p, n, &first, &last);
        for (int64_t j = first; j < last; j++) out[p.order[j]] = 0.0f;
        grad_pos[n] = (expf(p.pos[n] * p.scale - l) - 1.0f) * g;
    }
}
