/* CPU kernels of recompile.padded_softmax_attention (runtime/padded_attention.py): softmax attention over padded
 * histories with an additive mask, out = softmax(q k^T * scale + mask) v, fused per (sequence, head). Included
 * after jagged_attention.h, whose storage helpers (load_row, store_row, alloc) and register-tiled gemm it uses.
 *
 * First the mask is read once: for every query row of every (sequence, mask head), how many leading keys it can
 * weigh (one past the last key it attends to, mask above padded_attention.py's DROPPED: a key after it adds exp(-1e4 + ...) = 0; every
 * key where it attends to none, which is the padded formula spreading the row), and with read rows the query cut
 * Lq[b] of each sequence (padded_attention.py's query_cuts). Then one work item per (sequence, head) over OpenMP
 * threads: its q, k (transposed) and v are converted into float buffers of the keys its rows weigh, the scores are
 * one gemm, the masked softmax runs on them in the cache, the output a second gemm; rows at or past Lq[b] are 0.
 * Backward recomputes the weights the same way, then dP = G V^T, dS = P (dP - rowsum(P dP)) scale, dq = dS K,
 * dk = dS^T Q, dv = P^T G, all in the item's buffers: no padding key or padded query row costs a flop. */

/* ------------------------------------------------------------------------------------------------ */
/* the mask */

static const float *mask_row(const padded_attention_problem *p, int64_t b, int64_t h, int64_t i) {
    return p->mask + b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2];
}

/* One past the last key row m attends to, or n where it attends to none. */
static int32_t weighed_keys(const float *m, int64_t step, int64_t n, float dropped) {
    for (int64_t j = n - 1; j >= 0; j--)
        if (m[j * step] > dropped) return (int32_t)(j + 1);
    return (int32_t)n;
}

/* keys[(b * mask_heads + h) * nq + i] for every row; with rows, cuts[b] = Lq[b]: the smallest length past the read
   row whose queries weigh no key at or past it (reach: the most keys any row up to i weighs, over the heads). */
static void read_mask(const padded_attention_problem *p, int64_t b, int32_t *keys, int32_t *reach, int64_t *cuts) {
    const int64_t n = p->n, nq = p->nq, mh = p->mask_heads;
    for (int64_t h = 0; h < mh; h++)
        for (int64_t i = 0; i < nq; i++)
            keys[(b * mh + h) * nq + i] = weighed_keys(mask_row(p, b, h, i), p->mask_stride[3], n, p->dropped);
    if (!p->rows) return;
    int32_t most = 0;
    for (int64_t i = 0; i < nq; i++) {
        for (int64_t h = 0; h < mh; h++) most = keys[(b * mh + h) * nq + i] > most ? keys[(b * mh + h) * nq + i] : most;
        reach[i] = (int32_t)min64(most, nq);
    }
    int64_t cut = min64(max64(p->rows[b] + 1, 0), nq);
    while (cut > 0 && reach[cut - 1] > cut) cut = reach[cut - 1];
    cuts[b] = cut;
}

/* ------------------------------------------------------------------------------------------------ */
/* one (sequence, head) */

typedef struct {
    float *q, *kt, *k, *v, *vt, *s, *ds, *g, *out, *dk, *dv;
} item_buffers;

typedef struct {
    int64_t b, h, rows, keys; /* rows: the query rows computed (Lq[b] or nq); keys: the most any of them weighs */
    int64_t ldk, ldd, ldv;    /* row lengths of the buffers: keys, dim and dim_v rounded up to VL */
    const int32_t *row_keys;  /* [rows] */
} attention_item;

static const char *element_at(const padded_attention_problem *p, const void *base, const int64_t *stride, int64_t b, int64_t h,
                      int64_t i) {
    return (const char *)base + (b * stride[0] + h * stride[1] + i * stride[2]) * element_size(p->dtype);
}

/* rows [0, m) of (b, h) of x [B, H, rows, width] as floats: dst[r * ld + c], or transposed dst[c * ld + r] */
static void pack_rows(const padded_attention_problem *p, const void *x, const int64_t *stride, const attention_item *it,
                      int64_t m, int64_t width, int transposed, float *dst, int64_t ld) {
    for (int64_t r = 0; r < m; r++)
        load_row(p->dtype, element_at(p, x, stride, it->b, it->h, r), transposed ? dst + r : dst + r * ld, transposed ? ld : 1,
                 width);
}

/* rows [0, m) of src (floats, rows of ld) into (b, h) of the contiguous [B, H, total, width] out; rows [m, total) 0 */
static void store_rows(const padded_attention_problem *p, const float *src, int64_t ld, int64_t m, int64_t total,
                       int64_t width, const attention_item *it, void *out) {
    const int64_t es = element_size(p->dtype);
    char *base = (char *)out + (it->b * p->heads + it->h) * total * width * es;
    for (int64_t r = 0; r < m; r++) store_row(p->dtype, src + r * ld, 1, 1.0f, base + r * width * es, width);
    memset(base + m * width * es, 0, (size_t)((total - m) * width * es));
}

/* s[i, :] = softmax(q_i k^T * scale + mask_i) over the keys row i weighs, 0 past them up to it->keys */
static void weights(const padded_attention_problem *p, const attention_item *it, const item_buffers *w) {
    pack_rows(p, p->q, p->q_stride, it, it->rows, p->dim, 0, w->q, it->ldd);
    for (int64_t j = 0; j < it->keys; j++)
        load_row(p->dtype, element_at(p, p->k, p->k_stride, it->b, it->h, j), w->kt + j, it->ldk, p->dim);
    gemm(it->rows, it->ldk, p->dim, w->q, it->ldd, 1, w->kt, it->ldk, w->s, it->ldk, 0);
    const int64_t step = p->mask_stride[3], mh = p->mask_heads > 1 ? it->h : 0;
    for (int64_t i = 0; i < it->rows; i++) {
        float *s = w->s + i * it->ldk;
        const float *m = mask_row(p, it->b, mh, i);
        const int64_t keys = it->row_keys[i];
        float top = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < keys; j++) {
            s[j] = s[j] * p->scale + m[j * step];
            top = s[j] > top ? s[j] : top;
        }
        for (int64_t j = 0; j < keys; j += VL) *(vf *)(s + j) = vexp(*(vf *)(s + j) - top);
        for (int64_t j = 0; j < keys; j++) sum += s[j];
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < keys; j++) s[j] *= inv;
        for (int64_t j = keys; j < it->keys; j++) s[j] = 0.0f;
    }
}

static void forward_item(const padded_attention_problem *p, const attention_item *it, const item_buffers *w) {
    weights(p, it, w);
    pack_rows(p, p->v, p->v_stride, it, it->keys, p->dim_v, 0, w->v, it->ldv);
    gemm(it->rows, it->ldv, it->keys, w->s, it->ldk, 1, w->v, it->ldv, w->out, it->ldv, 0);
    store_rows(p, w->out, it->ldv, it->rows, p->nq, p->dim_v, it, p->out);
}

static void backward_item(const padded_attention_problem *p, const attention_item *it, const item_buffers *w) {
    const int64_t rows = it->rows, keys = it->keys, ldk = it->ldk, ldd = it->ldd, ldv = it->ldv;
    weights(p, it, w);
    pack_rows(p, p->grad, p->grad_stride, it, rows, p->dim_v, 0, w->g, ldv);
    pack_rows(p, p->v, p->v_stride, it, keys, p->dim_v, 1, w->vt, ldk);
    pack_rows(p, p->k, p->k_stride, it, keys, p->dim, 0, w->k, ldd);
    gemm(rows, ldk, p->dim_v, w->g, ldv, 1, w->vt, ldk, w->ds, ldk, 0); /* dP = G V^T */
    for (int64_t i = 0; i < rows; i++) {                                  /* dS = P (dP - rowsum(P dP)) scale */
        const float *s = w->s + i * ldk;
        float *ds = w->ds + i * ldk, dot = 0.0f;
        for (int64_t j = 0; j < keys; j++) dot += s[j] * ds[j];
        for (int64_t j = 0; j < keys; j++) ds[j] = s[j] * (ds[j] - dot) * p->scale;
    }
    gemm(rows, ldd, keys, w->ds, ldk, 1, w->k, ldd, w->out, ldd, 0); /* dq = dS K */
    store_rows(p, w->out, ldd, rows, p->nq, p->dim, it, p->dq);
    gemm(keys, ldd, rows, w->ds, 1, ldk, w->q, ldd, w->dk, ldd, 0); /* dk = dS^T Q */
    store_rows(p, w->dk, ldd, keys, p->n, p->dim, it, p->dk);
    gemm(keys, ldv, rows, w->s, 1, ldk, w->g, ldv, w->dv, ldv, 0); /* dv = P^T G */
    store_rows(p, w->dv, ldv, keys, p->n, p->dim_v, it, p->dv);
}

/* ------------------------------------------------------------------------------------------------ */
/* entry points: 0, or -1 out of memory */

static int run(const padded_attention_problem *p, int backward) {
    if (dense_problem(p)) return dense_run(p, backward); /* field_attention.h */
    const int64_t B = p->batch, H = p->heads, nq = p->nq, n = p->n, mh = p->mask_heads;
    const int64_t ldk = round_up(max64(n, 1), VL), ldd = round_up(p->dim, VL), ldv = round_up(p->dim_v, VL),
                  ldo = max64(ldd, ldv), rows_max = max64(nq, 1), keys_max = max64(n, 1);
    int32_t *keys = alloc(B * mh * nq);
    int64_t *cuts = (int64_t *)alloc(2 * max64(B, 1)); /* 4-byte units */
    if (!keys || !cuts) return free(keys), free(cuts), -1;
    int failed = 0;
#pragma omp parallel num_threads(max64(min64(p->threads, B * H), 1)) reduction(| : failed) /* no idle thread */
    {
        int32_t *reach = alloc(rows_max);
        item_buffers w;
        w.q = alloc(rows_max * ldd), w.kt = alloc(p->dim * ldk), w.s = alloc(rows_max * ldk);
        w.v = alloc(keys_max * ldv), w.out = alloc(rows_max * ldo);
        const int64_t extra = backward ? 1 : 0; /* the backward's buffers */
        w.k = alloc(extra * keys_max * ldd), w.vt = alloc(extra * p->dim_v * ldk), w.ds = alloc(extra * rows_max * ldk);
        w.g = alloc(extra * rows_max * ldv), w.dk = alloc(extra * keys_max * ldd), w.dv = alloc(extra * keys_max * ldv);
        failed = !reach || !w.q || !w.kt || !w.s || !w.v || !w.out || !w.k || !w.vt || !w.ds || !w.g || !w.dk || !w.dv;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            if (reach) read_mask(p, b, keys, reach, cuts);
#pragma omp for schedule(dynamic, 4)
        for (int64_t bh = 0; bh < B * H; bh++) {
            if (failed) continue;
            attention_item it;
            it.b = bh / H, it.h = bh % H, it.rows = p->rows ? cuts[it.b] : nq;
            it.row_keys = keys + (it.b * mh + (mh > 1 ? it.h : 0)) * nq;
            it.keys = 0;
            for (int64_t i = 0; i < it.rows; i++) it.keys = max64(it.keys, it.row_keys[i]);
            it.ldk = round_up(max64(it.keys, 1), VL), it.ldd = ldd, it.ldv = ldv;
            if (backward)
                backward_item(p, &it, &w);
            else
                forward_item(p, &it, &w);
        }
        free(reach);
        float *buffers[] = {w.q, w.kt, w.s, w.v, w.out, w.k, w.vt, w.ds, w.g, w.dk, w.dv};
        for (float *b : buffers) free(b);
    }
    free(keys), free(cuts);
    return failed ? -1 : 0;
}

int padded_attention_fwd(const padded_attention_problem *p) { return run(p, 0); }
int padded_attention_bwd(const padded_attention_problem *p) { return run(p, 1); }
