/* CPU kernel of recompile.hstu_paged_attention (runtime/paged_attention.py): HSTU attention of each user's new
 * rows (new actions, then num_targets candidates) over its cached prefix, whose keys and values are read from
 * the pages of the pools through the page table, tile by tile: no contiguous copy of a user's prefix is made.
 *
 * Row i (position cached + r of its user) sees keys j <= i while it is history, and the whole history (cached
 * prefix and new actions) plus itself when it is a candidate; weights silu(alpha q_i.k_j + bias_ij) / N, biases
 * as hstu_attention (rel_bias[N - 1 + j - i], time_bias[bucket(|ts_i - ts_j|)]).
 *
 * Work items are (user, block of up to PBM query rows, group of heads), blocks never straddling the history /
 * candidate boundary, largest first over OpenMP threads. An item packs its query rows once per head, then for
 * each tile of BN keys packs the keys (transposed) and values of its heads from pages or new rows, builds the
 * mask and bias once (shared by its heads: the time buckets cost as much as a head's GEMMs at small head dims)
 * and runs jagged_attention.h's register-tiled GEMMs per head: scores, SiLU, weights times values. Packing a
 * tile costs as much as the GEMMs of a few dozen rows, so blocks are as tall as the thread count allows (32 to
 * PBM rows), and heads are split into groups only when blocks are fewer than two per thread. A candidate's own key
 * is one more term. Included by serving_isa.inc after jagged_attention.h (whose helpers it uses). */

static const int64_t PBM = 128; /* the tallest block of query rows */

typedef struct {
    int64_t user, h0, h1, r0, m, key_end, cost; /* heads [h0, h1), new rows [r0, r0 + m) of user; keys [0, key_end) */
    int32_t candidates;
} paged_item;

static int paged_by_cost_desc(const void *a, const void *b) {
    int64_t x = ((const paged_item *)a)->cost, y = ((const paged_item *)b)->cost;
    return (x < y) - (x > y);
}

typedef struct {
    float *q, *kt, *v, *o;    /* per head: [PBM, D], [D, BN], [BN, Dvp], [PBM, Dvp] */
    float *s, *scale, *bias;  /* [PBM, BN] */
    float *own;               /* [PBM]: the bias of each row's own key (candidates) */
    float *time_row;          /* [BN]: the time bias of the current row's timestamp */
    int64_t *ts;              /* [BN + VL]: the tile's key timestamps */
} paged_space;

static int paged_space_init(const paged_problem *p, paged_space *w) {
    const int64_t H = p->heads, D = p->dim, Dvp = round_up(p->dim_v, VL);
    w->q = alloc(H * PBM * D), w->kt = alloc(H * D * BN), w->v = alloc(H * BN * Dvp), w->o = alloc(H * PBM * Dvp);
    w->s = alloc(PBM * BN), w->scale = alloc(PBM * BN), w->bias = alloc(PBM * BN), w->own = alloc(PBM);
    w->ts = alloc(2 * (BN + VL)), w->time_row = alloc(BN);
    return w->q && w->kt && w->v && w->o && w->s && w->scale && w->bias && w->own && w->ts && w->time_row;
}

static void paged_space_free(paged_space *w) {
    free(w->q), free(w->kt), free(w->v), free(w->o), free(w->s), free(w->scale), free(w->bias), free(w->own);
    free(w->ts), free(w->time_row);
}

static int64_t paged_row_bytes(const paged_problem *p) { return element_size(p->dtype); }

/* Key or value row j of a user (position j of its whole sequence), head h: from the pool below `cached`, else
   from the new rows starting at token `start`. */
static const char *paged_key_row(const paged_problem *p, const int64_t *pages, int64_t cached, int64_t start,
                                 int64_t j, int64_t h, const void *pool, int64_t width, const void *fresh,
                                 const int64_t *stride) {
    if (j < cached) {
        const int64_t slot = pages[j / p->page_size] * p->page_size + j % p->page_size;
        return (const char *)pool + ((slot * p->heads + h) * width) * paged_row_bytes(p);
    }
    return row_ptr(fresh, stride, p->dtype, start + j - cached, h);
}

static int64_t paged_timestamp(const paged_problem *p, const int64_t *pages, int64_t cached, int64_t start, int64_t j) {
    if (j < cached) return p->ts_cache[pages[j / p->page_size] * p->page_size + j % p->page_size];
    return p->timestamps[start + j - cached];
}

/* The bucket of each gap |ts_i - ts[0:VL]| into the time bias, added to bias[0:VL]. */
static void add_time_bias(const paged_problem *p, int64_t ts_i, const int64_t *ts, float *bias) {
    const vi b = time_buckets(ts_i, ts, p->bucket_bounds, (int32_t)p->num_buckets);
    *(vf *)bias += gather(p->time_bias, b);
}

static void paged_item_run(const paged_problem *p, const paged_item *it, paged_space *w) {
    const int64_t D = p->dim, Dv = p->dim_v, Dvp = round_up(Dv, VL), N = p->max_seq_len;
    const int64_t *pages = p->page_table + it->user * p->max_pages;
    const int64_t cached = p->cached_lengths[it->user], start = p->offsets[it->user], m = it->m;
    const int64_t i0 = cached + it->r0; /* the block's first position */
    const int64_t hist_end = cached + (p->offsets[it->user + 1] - start) -
                             (p->num_targets ? p->num_targets[it->user] : 0);
    const float inv_n = 1.0f / (float)N;
    const int64_t out_stride[2] = {p->heads * Dv, Dv};
    for (int64_t h = it->h0; h < it->h1; h++) { /* head h's buffers at slot g = h - h0 */
        pack(p->dtype, p->q, p->q_stride, start + it->r0, m, h, D, 0, w->q + (h - it->h0) * PBM * D, D);
        memset(w->o + (h - it->h0) * PBM * Dvp, 0, sizeof(float) * m * Dvp);
    }
    vi lane;
    for (int l = 0; l < VL; l++) lane[l] = l;
    for (int64_t j0 = 0; j0 < it->key_end; j0 += BN) {
        const int64_t nc = min64(BN, it->key_end - j0), ncp = round_up(nc, VL);
        for (int64_t h = it->h0; h < it->h1; h++) {
            float *kt = w->kt + (h - it->h0) * D * BN, *v = w->v + (h - it->h0) * BN * Dvp;
            for (int64_t c = 0; c < nc; c++) {
                const int64_t j = j0 + c;
                load_row(p->dtype, paged_key_row(p, pages, cached, start, j, h, p->k_cache, D, p->k, p->k_stride),
                         kt + c, BN, D);
                load_row(p->dtype, paged_key_row(p, pages, cached, start, j, h, p->v_cache, Dv, p->v, p->v_stride),
                         v + c * Dvp, 1, Dv);
            }
            for (int64_t d = 0; d < D; d++) memset(kt + d * BN + nc, 0, (ncp - nc) * sizeof(float));
        }
        if (p->time_bias) {
            for (int64_t c = 0; c < nc; c++) w->ts[c] = paged_timestamp(p, pages, cached, start, j0 + c);
            for (int64_t c = nc; c < ncp; c++) w->ts[c] = 0;
        }
        for (int64_t r = 0; r < m; r++) { /* mask (as scale) and bias of row i */
            const int64_t i = i0 + r, limit = it->candidates ? hist_end : i + 1;
            for (int64_t c = 0; c < ncp; c += VL) {
                const vi valid = (lane + (int32_t)(j0 + c)) < (int32_t)min64(limit, j0 + nc);
                *(vf *)(w->scale + r * ncp + c) = vselect(valid, splat(inv_n), splat(0.0f));
            }
            float *bias = w->bias + r * ncp;
            if (p->rel_bias) memcpy(bias, p->rel_bias + N - 1 + j0 - i, ncp * sizeof(float));
            else memset(bias, 0, ncp * sizeof(float));
            if (p->time_bias) { /* rows of one timestamp (a request's candidates) share the time bias row */
                const int64_t ts_i = p->timestamps[start + it->r0 + r];
                if (r == 0 || ts_i != p->timestamps[start + it->r0 + r - 1]) {
                    memset(w->time_row, 0, ncp * sizeof(float));
                    for (int64_t c = 0; c < ncp; c += VL) add_time_bias(p, ts_i, w->ts + c, w->time_row + c);
                }
                for (int64_t c = 0; c < ncp; c += VL) *(vf *)(bias + c) += *(const vf *)(w->time_row + c);
            }
        }
        for (int64_t h = it->h0; h < it->h1; h++) {
            const int64_t g = h - it->h0;
            gemm(m, ncp, D, w->q + g * PBM * D, D, 1, w->kt + g * D * BN, BN, w->s, ncp, 0);
            for (int64_t at = 0; at < m * ncp; at += VL) {
                const vf x = *(vf *)(w->s + at) * p->alpha + *(vf *)(w->bias + at);
                *(vf *)(w->s + at) = x * vsigmoid(x) * *(vf *)(w->scale + at);
            }
            gemm(m, Dvp, nc, w->s, ncp, 1, w->v + g * BN * Dvp, Dvp, w->o + g * PBM * Dvp, Dvp, 1);
        }
    }
    if (it->candidates) /* the bias of each candidate's own key: position gap 0, time gap 0 */
        for (int64_t r = 0; r < m; r++) {
            float own[VL] __attribute__((aligned(64))) = {0};
            if (p->time_bias) {
                for (int l = 0; l < VL; l++) w->ts[l] = p->timestamps[start + it->r0 + r];
                add_time_bias(p, w->ts[0], w->ts, own);
            }
            w->own[r] = own[0] + (p->rel_bias ? p->rel_bias[N - 1] : 0.0f);
        }
    for (int64_t h = it->h0; h < it->h1; h++) {
        const int64_t g = h - it->h0;
        for (int64_t r = 0; r < m; r++) {
            float *o = w->o + (g * PBM + r) * Dvp;
            const int64_t t = start + it->r0 + r;
            if (it->candidates) { /* the candidate's own key */
                load_row(p->dtype, row_ptr(p->k, p->k_stride, p->dtype, t, h), w->kt, 1, D);
                load_row(p->dtype, row_ptr(p->v, p->v_stride, p->dtype, t, h), w->v, 1, Dv);
                float x = 0.0f;
                for (int64_t d = 0; d < D; d++) x += w->q[(g * PBM + r) * D + d] * w->kt[d];
                x = x * p->alpha + w->own[r];
                const float weight = x / (1.0f + expf(-x)) * inv_n;
                for (int64_t d = 0; d < Dv; d++) o[d] += weight * w->v[d];
            }
            store_row(p->dtype, o, 1, 1.0f, row_ptr(p->out, out_stride, p->dtype, t, h), Dv);
        }
    }
}

/* The items of every user: blocks of up to bm history rows, then blocks of candidates, each over its heads in
   groups of hg. */
static int64_t paged_items(const paged_problem *p, int64_t bm, int64_t hg, paged_item *items) {
    int64_t count = 0;
    for (int64_t b = 0; b < p->batch; b++) {
        const int64_t n = p->offsets[b + 1] - p->offsets[b], cached = p->cached_lengths[b];
        const int64_t history = n - (p->num_targets ? p->num_targets[b] : 0);
        for (int64_t r0 = 0; r0 < n;) {
            const int32_t candidates = r0 >= history;
            const int64_t m = min64(bm, (candidates ? n : history) - r0);
            const int64_t key_end = candidates ? cached + history : cached + r0 + m;
            for (int64_t h = 0; h < p->heads; h += hg) {
                const int64_t h1 = min64(h + hg, p->heads);
                items[count++] = (paged_item){b, h, h1, r0, m, key_end, m * key_end * (h1 - h), candidates};
            }
            r0 += m;
        }
    }
    qsort(items, count, sizeof(paged_item), paged_by_cost_desc);
    return count;
}

int hstu_paged_attention_fwd(const paged_problem *p) {
    const int64_t rows = p->offsets[p->batch] - p->offsets[0], threads = max64(p->threads, 1);
    const int64_t bm = min64(PBM, max64(BM, round_up((rows + threads - 1) / threads, MR)));
    int64_t blocks = 0; /* of history rows and of candidates, per user */
    for (int64_t b = 0; b < p->batch; b++) {
        const int64_t n = p->offsets[b + 1] - p->offsets[b], targets = p->num_targets ? p->num_targets[b] : 0;
        blocks += (n - targets + bm - 1) / bm + (targets + bm - 1) / bm;
    }
    /* heads per item: all of them, unless the blocks are fewer than two per thread (one thread: all) */
    const int64_t want = threads > 1 ? 2 * threads : 1;
    const int64_t groups = min64(p->heads, max64(1, (want + blocks - 1) / max64(blocks, 1)));
    const int64_t hg = (p->heads + groups - 1) / groups;
    paged_item *items = (paged_item *)malloc(sizeof(paged_item) * max64(blocks * p->heads, 1));
    if (!items) return HSTU_NO_MEMORY;
    const int64_t count = paged_items(p, bm, hg, items);
    int failed = 0;
#pragma omp parallel num_threads(max64(min64(p->threads, count), 1)) reduction(| : failed)
    {
        paged_space w;
        failed = !paged_space_init(p, &w);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++)
            if (!failed) paged_item_run(p, &items[i], &w);
        paged_space_free(&w);
    }
    free(items);
    return failed ? HSTU_NO_MEMORY : 0;
}
