/* Dense attention over a few keys (the fields of a CTR model: AutoInt's nn.MultiheadAttention over F fields), the
 * path padded_attention.h's run() takes when the mask is the same key row for every sequence and query (a
 * [1, H|1, 1, n] mask: no padding to find, no row to cut) and the keys are few (n <= DENSE_KEYS). Included after
 * jagged_attention.h (storage helpers, alloc) and before padded_attention.h.
 *
 * Why not the padded path: with 7 keys of 4 dims its per (sequence, head) packing and register-tiled gemms on
 * VL-padded tiles cost most of the work. Here the query rows are the vector lanes (blocks of VL rows) and the keys a
 * scalar loop, so the scores, the softmax over the keys (max, exp, sum), and the product with v are all vertical:
 * S^T[j] = sum_d k[j, d] Q^T[d], P^T[j] = exp(S^T[j] - max_j) / sum_j, O^T[d] = sum_j v[j, d] P^T[j]; backward
 * dP^T[j] = sum_d v[j, d] G^T[d], dS^T[j] = P^T[j] (dP^T[j] - sum_j P^T dP^T) scale, dQ^T[d] = sum_j k[j, d] dS^T[j];
 * the key-side sums dk[j, :] = sum_i dS[i, j] q[i, :] and dv[j, :] = sum_i P[i, j] g[i, :] take the lanes one by one
 * as scalars against q's and g's rows (vectors over the dims), so nothing reduces across lanes.
 * Padded lanes (rows past nq in the last block) read zeros and are never stored. */

enum { DENSE_KEYS = 64 };

static int dense_problem(const padded_attention_problem *p) {
    return !p->rows && p->n <= DENSE_KEYS && p->mask_stride[0] == 0 && p->mask_stride[2] == 0;
}

typedef struct {
    float *k, *v;                /* [n, dim], [n, dim_v] */
    vf *qt, *gt, *ot, *p, *ds;   /* [dim], [dim_v], [max(dim, dim_v)], [n], [n] vectors over the block's rows */
    vf *qr, *gr, *dk, *dv;       /* backward, rows of ldd = dim and ldv = dim_v rounded up to VL: [VL], [VL], [n], [n] */
    int64_t ldd, ldv;
} dense_buffers;

static const char *dense_row(const padded_attention_problem *p, const void *x, const int64_t *stride, int64_t b,
                             int64_t h, int64_t i) {
    return (const char *)x + (b * stride[0] + h * stride[1] + i * stride[2]) * element_size(p->dtype);
}

static char *dense_out_row(const padded_attention_problem *p, void *x, int64_t rows, int64_t width, int64_t b,
                           int64_t h, int64_t i) {
    return (char *)x + ((b * p->heads + h) * rows + i) * width * element_size(p->dtype);
}

/* rows [i0, i0 + m) of (b, h) of x transposed into t[c][r] (c < width), lanes past m zero */
static void dense_pack_t(const padded_attention_problem *p, const void *x, const int64_t *stride, int64_t b, int64_t h,
                         int64_t i0, int64_t m, int64_t width, vf *t) {
    memset(t, 0, sizeof(vf) * width);
    for (int64_t r = 0; r < m; r++) load_row(p->dtype, dense_row(p, x, stride, b, h, i0 + r), (float *)t + r, VL, width);
}

/* P^T of the block's rows: softmax over the n keys of q k^T * scale + mask, per lane */
static void dense_weights(const padded_attention_problem *p, int64_t h, const dense_buffers *w) {
    const int64_t n = p->n, D = p->dim;
    const float *m = p->mask + (p->mask_heads > 1 ? h * p->mask_stride[1] : 0);
    vf top = splat(-INFINITY), sum = splat(0.0f);
    for (int64_t j = 0; j < n; j++) {
        vf s = splat(0.0f);
        for (int64_t d = 0; d < D; d++) s += w->k[j * D + d] * w->qt[d];
        w->p[j] = s * p->scale + m[j * p->mask_stride[3]];
        top = vselect(w->p[j] > top, w->p[j], top);
    }
    for (int64_t j = 0; j < n; j++) sum += w->p[j] = vexp(w->p[j] - top);
    const vf inv = 1.0f / sum;
    for (int64_t j = 0; j < n; j++) w->p[j] *= inv;
}

/* rows [i0, i0 + m) of the contiguous [B, H, rows, width] out from t[c][r] */
static void dense_store_t(const padded_attention_problem *p, const vf *t, int64_t m, int64_t width, void *out,
                          int64_t rows, int64_t b, int64_t h, int64_t i0) {
    for (int64_t r = 0; r < m; r++)
        store_row(p->dtype, (const float *)t + r, VL, 1.0f, dense_out_row(p, out, rows, width, b, h, i0 + r), width);
}

static void dense_item(const padded_attention_problem *p, int64_t b, int64_t h, int backward, const dense_buffers *w) {
    const int64_t n = p->n, nq = p->nq, D = p->dim, Dv = p->dim_v;
    for (int64_t j = 0; j < n; j++) {
        load_row(p->dtype, dense_row(p, p->k, p->k_stride, b, h, j), w->k + j * D, 1, D);
        load_row(p->dtype, dense_row(p, p->v, p->v_stride, b, h, j), w->v + j * Dv, 1, Dv);
    }
    const int64_t cd = w->ldd / VL, cv = w->ldv / VL; /* vectors per row of dk, dv */
    if (backward) memset(w->dk, 0, sizeof(vf) * n * cd), memset(w->dv, 0, sizeof(vf) * n * cv);
    for (int64_t i0 = 0; i0 < nq; i0 += VL) {
        const int64_t m = min64(VL, nq - i0);
        dense_pack_t(p, p->q, p->q_stride, b, h, i0, m, D, w->qt);
        dense_weights(p, h, w);
        if (!backward) {
            for (int64_t d = 0; d < Dv; d++) {
                vf o = splat(0.0f);
                for (int64_t j = 0; j < n; j++) o += w->v[j * Dv + d] * w->p[j];
                w->ot[d] = o;
            }
            dense_store_t(p, w->ot, m, Dv, p->out, nq, b, h, i0);
            continue;
        }
        dense_pack_t(p, p->grad, p->grad_stride, b, h, i0, m, Dv, w->gt);
        for (int64_t r = 0; r < m; r++) {
            load_row(p->dtype, dense_row(p, p->q, p->q_stride, b, h, i0 + r), (float *)(w->qr + r * cd), 1, D);
            load_row(p->dtype, dense_row(p, p->grad, p->grad_stride, b, h, i0 + r), (float *)(w->gr + r * cv), 1, Dv);
        }
        vf dot = splat(0.0f);
        for (int64_t j = 0; j < n; j++) { /* dP^T, then dS^T in place */
            vf dp = splat(0.0f);
            for (int64_t d = 0; d < Dv; d++) dp += w->v[j * Dv + d] * w->gt[d];
            w->ds[j] = dp;
            dot += w->p[j] * dp;
        }
        for (int64_t j = 0; j < n; j++) {
            w->ds[j] = w->p[j] * (w->ds[j] - dot) * p->scale;
            for (int64_t r = 0; r < m; r++) {
                const float ds = w->ds[j][r], pr = w->p[j][r];
                for (int64_t c = 0; c < cd; c++) w->dk[j * cd + c] += ds * w->qr[r * cd + c];
                for (int64_t c = 0; c < cv; c++) w->dv[j * cv + c] += pr * w->gr[r * cv + c];
            }
        }
        for (int64_t d = 0; d < D; d++) {
            vf dq = splat(0.0f);
            for (int64_t j = 0; j < n; j++) dq += w->k[j * D + d] * w->ds[j];
            w->ot[d] = dq;
        }
        dense_store_t(p, w->ot, m, D, p->dq, nq, b, h, i0);
    }
    if (!backward) return;
    for (int64_t j = 0; j < n; j++) {
        store_row(p->dtype, (const float *)(w->dk + j * cd), 1, 1.0f, dense_out_row(p, p->dk, n, D, b, h, j), D);
        store_row(p->dtype, (const float *)(w->dv + j * cv), 1, 1.0f, dense_out_row(p, p->dv, n, Dv, b, h, j), Dv);
    }
}

/* 0, or -1 out of memory */
static int dense_run(const padded_attention_problem *p, int backward) {
    const int64_t B = p->batch, H = p->heads, n = max64(p->n, 1), D = p->dim, Dv = p->dim_v;
    int failed = 0;
#pragma omp parallel num_threads(max64(min64(p->threads, B * H), 1)) reduction(| : failed)
    {
        dense_buffers w;
        w.ldd = round_up(D, VL), w.ldv = round_up(Dv, VL);
        w.k = alloc(n * D), w.v = alloc(n * Dv), w.dk = alloc(n * w.ldd), w.dv = alloc(n * w.ldv);
        w.qt = alloc(D * VL), w.gt = alloc(Dv * VL), w.ot = alloc(max64(D, Dv) * VL);
        w.p = alloc(n * VL), w.ds = alloc(n * VL), w.qr = alloc(VL * w.ldd), w.gr = alloc(VL * w.ldv);
        failed = !w.k || !w.v || !w.dk || !w.dv || !w.qt || !w.gt || !w.ot || !w.p || !w.ds || !w.qr || !w.gr;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++)
            if (!failed) dense_item(p, bh / H, bh % H, backward, &w);
        void *buffers[] = {w.k, w.v, w.dk, w.dv, w.qt, w.gt, w.ot, w.p, w.ds, w.qr, w.gr};
        for (void *x : buffers) free(x);
    }
    return failed ? -1 : 0;
}
