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
 * dk = dS^T Q, dv = P^T G, all in the item's buffers: no padding key or padded query row costs a flop. With at most
 * VL query rows, keys and dims (RecBole's SASRec: 12 rows and keys, 8 dims) an item takes the few-rows path below
 * instead: the rows are the vector lanes, no buffers, no gemm. */

/* ------------------------------------------------------------------------------------------------ */
/* the mask */

static const float *mask_row(const padded_attention_problem *p, int64_t b, int64_t h, int64_t i) {
    return p->mask + b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2];
}

static inline vi lane_ids(void) {
    vi lanes;
    for (int i = 0; i < VL; i++) lanes[i] = i;
    return lanes;
}

/* the first m floats at x, the other lanes 0 */
static inline vf vload_first(const float *x, int64_t m) {
#if RECOMPILE_AVX512
    return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), x);
#elif RECOMPILE_AVX2
    return (vf)_mm256_maskload_ps(x, (__m256i)(lane_ids() < (int)m));
#else
    vf v = splat(0.0f);
    for (int64_t i = 0; i < m; i++) v[i] = x[i];
    return v;
#endif
}

/* One past the last key row m attends to, or n where it attends to none. */
static int32_t weighed_keys(const float *m, int64_t step, int64_t n, float dropped) {
#if RECOMPILE_AVX512
    if (step == 1 && n <= VL) { /* one compare */
        const unsigned kept =
            _mm512_cmp_ps_mask((__m512)vload_first(m, n), _mm512_set1_ps(dropped), _CMP_GT_OQ) & ((1u << n) - 1);
        return kept ? 32 - __builtin_clz(kept) : (int32_t)n;
    }
#endif
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
/* few rows and keys: nq, n, dim and dim_v at most VL (RecBole's SASRec: 12 of each, 8 dims). The query rows are the
 * vector lanes, so that the scores, the softmax and the products are vertical (no reduction across lanes, every
 * row's chain in flight at once): with q^T, g^T the transposed rows (columns over the rows i) and the mask^T's
 * column j, S^T[j] = sum_d k[j, d] q^T[d] * scale + mask^T[j], P^T[j] = exp(S^T[j] - max_j) / sum_j over the keys
 * each row weighs (0 past them, and at rows past the cut), out^T[c] = sum_j v[j, c] P^T[j], transposed back to rows.
 * Backward: dP^T[j] = sum_c v[j, c] g^T[c], dS^T[j] = P^T[j] (dP^T[j] - sum_j P^T dP^T) scale, dq^T[d] =
 * sum_j k[j, d] dS^T[j]; dk[j] = sum_i dS[i, j] q_i and dv[j] = sum_i P[i, j] g_i on the rows. The general path's
 * per-row softmax (a chain of reductions per row) and its gemms on VL-padded tiles take about 3x this here. */

static int few_keys(const padded_attention_problem *p) {
    return p->nq <= VL && p->n <= VL && p->dim <= VL && p->dim_v <= VL;
}

/* m elements of storage at x as floats, the other lanes 0; and back (the first m lanes) */
static inline vf load_vec(int dtype, const void *x, int64_t m) {
    if (dtype == DTYPE_F32) return vload_first((const float *)x, m);
    vf t = splat(0.0f);
    load_row(dtype, x, (float *)&t, 1, m);
    return t;
}

static inline void store_vec(int dtype, vf x, void *dst, int64_t m) {
#if RECOMPILE_AVX512
    if (dtype == DTYPE_F32) return _mm512_mask_storeu_ps(dst, (__mmask16)((1u << m) - 1), (__m512)x);
#endif
    store_row(dtype, (const float *)&x, 1, 1.0f, dst, m);
}

/* rows[i] = row i of (b, h) of x (width lanes) for i < m, 0 past m; t (if any) = their transpose */
static void few_rows(const padded_attention_problem *p, const void *x, const int64_t *stride, int64_t b, int64_t h,
                     int64_t m, int64_t width, vf *rows, vf *t) {
    for (int64_t i = 0; i < VL; i++)
        rows[i] = i < m ? load_vec(p->dtype, element_at(p, x, stride, b, h, i), width) : splat(0.0f);
    if (!t) return;
    memcpy(t, rows, sizeof(vf) * VL);
    vtranspose(t);
}

/* P^T[j] (j < n) of (b, h): the weights of the rows before `rows`, each over its first keys[i] keys */
static void few_weights(const padded_attention_problem *p, int64_t b, int64_t h, int64_t rows, const int32_t *keys,
                        const vf *qt, const vf *k, vf *P) {
    const int64_t n = p->n, nq = p->nq, mh = p->mask_heads > 1 ? h : 0;
    vf mt[VL];
    for (int64_t i = 0; i < VL; i++) {
        const float *m = i < nq ? mask_row(p, b, mh, i) : NULL;
        if (!m)
            mt[i] = splat(0.0f);
        else if (p->mask_stride[3] == 1)
            mt[i] = vload_first(m, n);
        else
            for (int64_t j = 0; j < VL; j++) mt[i][j] = j < n ? m[j * p->mask_stride[3]] : 0.0f;
    }
    vtranspose(mt);
    vi reach;
    for (int64_t i = 0; i < VL; i++) reach[i] = i < rows ? keys[i] : 0;
    vf top = splat(-INFINITY), sum = splat(0.0f);
    for (int64_t j = 0; j < n; j++) {
        const float *kj = (const float *)(k + j);
        vf s = splat(0.0f);
        for (int64_t d = 0; d < p->dim; d++) s += kj[d] * qt[d];
        P[j] = vselect(reach > (int)j, s * p->scale + mt[j], splat(-INFINITY));
        top = vselect(P[j] > top, P[j], top);
    }
    for (int64_t j = 0; j < n; j++) sum += P[j] = vselect(reach > (int)j, vexp(P[j] - top), splat(0.0f));
    const vf inv = vselect(sum > 0.0f, 1.0f / sum, splat(0.0f));
    for (int64_t j = 0; j < n; j++) P[j] *= inv;
}

/* rows i < nq of out's contiguous (b, h) [nq, width] from x^T[c] = sum_j a[j, c] y^T[j] (y^T's lanes: the rows) */
static void few_store_product(const padded_attention_problem *p, const vf *a, const vf *yt, int64_t width, void *out,
                              int64_t b, int64_t h) {
    vf xt[VL];
    for (int64_t c = 0; c < VL; c++) {
        vf x = splat(0.0f);
        if (c < width)
            for (int64_t j = 0; j < p->n; j++) x += ((const float *)(a + j))[c] * yt[j];
        xt[c] = x;
    }
    vtranspose(xt);
    char *base = (char *)out + (b * p->heads + h) * p->nq * width * element_size(p->dtype);
    for (int64_t i = 0; i < p->nq; i++) store_vec(p->dtype, xt[i], base + i * width * element_size(p->dtype), width);
}

static void few_item(const padded_attention_problem *p, const attention_item *it, int backward) {
    const int64_t b = it->b, h = it->h, n = p->n, nq = p->nq, D = p->dim, Dv = p->dim_v;
    vf q[VL], qt[VL], k[VL], v[VL], P[VL];
    few_rows(p, p->q, p->q_stride, b, h, nq, D, q, qt);
    few_rows(p, p->k, p->k_stride, b, h, n, D, k, NULL);
    few_rows(p, p->v, p->v_stride, b, h, n, Dv, v, NULL);
    few_weights(p, b, h, it->rows, it->row_keys, qt, k, P);
    if (!backward) return few_store_product(p, v, P, Dv, p->out, b, h);
    vf g[VL], gt[VL], dS[VL], dot = splat(0.0f);
    few_rows(p, p->grad, p->grad_stride, b, h, nq, Dv, g, gt);
    for (int64_t j = 0; j < n; j++) {
        const float *vj = (const float *)(v + j);
        vf dp = splat(0.0f);
        for (int64_t c = 0; c < Dv; c++) dp += vj[c] * gt[c];
        dot += P[j] * (dS[j] = dp);
    }
    for (int64_t j = 0; j < n; j++) dS[j] = P[j] * (dS[j] - dot) * p->scale;
    few_store_product(p, k, dS, D, p->dq, b, h);
    for (int64_t j = 0; j < n; j++) { /* dk[j] = sum_i dS[i, j] q_i, dv[j] = sum_i P[i, j] g_i */
        const float *sj = (const float *)(dS + j), *pj = (const float *)(P + j);
        vf dk = splat(0.0f), dv = splat(0.0f);
        for (int64_t i = 0; i < it->rows; i++) dk += sj[i] * q[i], dv += pj[i] * g[i];
        const int64_t row = (b * p->heads + h) * n + j, es = element_size(p->dtype);
        store_vec(p->dtype, dk, (char *)p->dk + row * D * es, D);
        store_vec(p->dtype, dv, (char *)p->dv + row * Dv * es, Dv);
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* entry points: 0, or -1 out of memory */

static int run(const padded_attention_problem *p, int backward) {
    if (dense_problem(p)) return dense_run(p, backward); /* field_attention.h */
    const int64_t B = p->batch, H = p->heads, nq = p->nq, n = p->n, mh = p->mask_heads;
    const int few = few_keys(p);
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
            if (few)
                few_item(p, &it, backward);
            else if (backward)
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
