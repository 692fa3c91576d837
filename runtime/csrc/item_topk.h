/* CPU kernel of recompile_native.item_topk (models/retrieval_serving.py QuantizedItems): the best k items of a
 * corpus for each query, exactly, without a score matrix and reading mostly a quarter of the corpus.
 *
 * Each item n has int8 codes c_n and a scale s_n with |x_n - s_n c_n| <= s_n / 2 elementwise, so
 * q.x_n <= s_n (q.c_n + |q|_1 (1/2 + 1e-3)) (the 1e-3 covers float rounding of the int8 dot). Threads take
 * ranges of 16-item blocks; for a block, the bounds of its 16 items for every query come from the codes laid out
 * dimension-major (one int8 -> float conversion serves every query); an item whose bound reaches the thread's
 * current k-th best exact score of that query is re-scored exactly from its float row and kept in the thread's
 * min-heap of k. The threads' heaps are merged and sorted at the end: the result is the exact top k of the float
 * scores (equal values by index). */

enum { TOPK_BLOCK = 16, HALVES = TOPK_BLOCK / VL }; /* a block is HALVES vectors of VL items */

typedef struct {
    float value;
    int64_t index;
} scored;

/* a before b in the result: higher value, then lower index */
static inline int scored_before(scored a, scored b) { return a.value > b.value || (a.value == b.value && a.index < b.index); }

/* Min-heap of the k best (the worst at the root). */
static void heap_push(scored *heap, int64_t *size, int64_t k, scored x) {
    int64_t i;
    if (*size < k) {
        i = (*size)++;
        while (i > 0 && scored_before(heap[(i - 1) / 2], x)) heap[i] = heap[(i - 1) / 2], i = (i - 1) / 2;
        heap[i] = x;
        return;
    }
    if (!scored_before(x, heap[0])) return;
    i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= k) break;
        if (c + 1 < k && scored_before(heap[c], heap[c + 1])) c++;
        if (!scored_before(x, heap[c])) break;
        heap[i] = heap[c], i = c;
    }
    heap[i] = x;
}

static int scored_compare(const void *a, const void *b) {
    const scored x = *(const scored *)a, y = *(const scored *)b;
    return scored_before(x, y) ? -1 : scored_before(y, x);
}

static float dot_f32(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* VL int8 codes as floats (GCC scalarises the vector conversion: the ISA's sign extension instead). */
static inline vf load_codes(const int8_t *codes) {
#if RECOMPILE_AVX512
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
#elif RECOMPILE_AVX2
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
#else
    vf out;
    for (int l = 0; l < VL; l++) out[l] = codes[l];
    return out;
#endif
}

/* Bit l set where v[l] >= x. */
static inline uint32_t lanes_at_least(vf v, float x) {
#if RECOMPILE_AVX512
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(x), _CMP_GE_OQ);
#elif RECOMPILE_AVX2
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(x), _CMP_GE_OQ));
#else
    uint32_t mask = 0;
    for (int l = 0; l < VL; l++) mask |= (uint32_t)(v[l] >= x) << l;
    return mask;
#endif
}

/* out[q * HALVES + h] = queries[q] . codes of one block's items (vector h), for NQ queries: the accumulators
   stay in registers, A independent chains per (query, vector) hide the FMA latency. */
template <int NQ>
static void block_dots(const int8_t *codes, const float *queries, int64_t d, vf *out) {
    enum { A = NQ * HALVES >= 4 ? 1 : 4 / (NQ * HALVES) };
    vf acc[NQ][HALVES][A];
    _Pragma("GCC unroll 8") for (int q = 0; q < NQ; q++)
        _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++)
            _Pragma("GCC unroll 4") for (int a = 0; a < A; a++) acc[q][h][a] = (vf){0};
    int64_t i = 0;
    for (; i + A <= d; i += A) {
        _Pragma("GCC unroll 4") for (int a = 0; a < A; a++) {
            _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++) {
                const vf x = load_codes(codes + (i + a) * TOPK_BLOCK + h * VL);
                _Pragma("GCC unroll 8") for (int q = 0; q < NQ; q++) acc[q][h][a] += queries[q * d + i + a] * x;
            }
        }
    }
    for (; i < d; i++)
        for (int h = 0; h < HALVES; h++) {
            const vf x = load_codes(codes + i * TOPK_BLOCK + h * VL);
            for (int q = 0; q < NQ; q++) acc[q][h][0] += queries[q * d + i] * x;
        }
    _Pragma("GCC unroll 8") for (int q = 0; q < NQ; q++)
        _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++) {
            out[q * HALVES + h] = acc[q][h][0];
            _Pragma("GCC unroll 4") for (int a = 1; a < A; a++) out[q * HALVES + h] += acc[q][h][a];
        }
}

typedef void (*block_dots_fn)(const int8_t *, const float *, int64_t, vf *);
static const block_dots_fn BLOCK_DOTS[8] = {block_dots<1>, block_dots<2>, block_dots<3>, block_dots<4>,
                                            block_dots<5>, block_dots<6>, block_dots<7>, block_dots<8>};

/* Blocks [b0, b1) into the heaps (one per query, k each) of one thread, 8 queries at a time. */
static void topk_range(const topk_problem *p, int64_t b0, int64_t b1, scored *heaps, int64_t *sizes, float *slack) {
    const int64_t B = p->batch, d = p->dim, k = p->k;
    vf dots[8 * HALVES];
    for (int64_t q0 = 0; q0 < B; q0 += 8) {
        const int64_t nq = min64(8, B - q0);
        for (int64_t blk = b0; blk < b1; blk++) {
            BLOCK_DOTS[nq - 1](p->codes + blk * d * TOPK_BLOCK, p->queries + q0 * d, d, dots);
            for (int64_t q = 0; q < nq; q++) {
                scored *heap = heaps + (q0 + q) * k;
                int64_t *size = sizes + q0 + q;
                for (int h = 0; h < HALVES; h++) {
                    const float threshold = *size < k ? -INFINITY : heap[0].value;
                    const vf scale = *(const vfu *)(p->scales + blk * TOPK_BLOCK + h * VL);
                    const vf bound = (dots[q * HALVES + h] + slack[q0 + q]) * scale;
                    for (uint32_t m = lanes_at_least(bound, threshold); m; m &= m - 1) {
                        const int64_t n = blk * TOPK_BLOCK + h * VL + __builtin_ctz(m);
                        if (n >= p->num_items) break;
                        const scored x = {dot_f32(p->queries + (q0 + q) * d, p->items + n * d, d), n};
                        heap_push(heap, size, k, x);
                    }
                }
            }
        }
    }
}

int item_topk(const topk_problem *p) {
    const int64_t B = p->batch, k = p->k, blocks = (p->num_items + TOPK_BLOCK - 1) / TOPK_BLOCK;
    const int64_t threads = max64(min64(p->threads, blocks / 64), 1);
    scored *heaps = (scored *)malloc(sizeof(scored) * max64(threads * B * k, 1));
    int64_t *sizes = (int64_t *)calloc(max64(threads * B, 1), sizeof(int64_t));
    float *slack = (float *)malloc(sizeof(float) * max64(B, 1));
    if (!heaps || !sizes || !slack) {
        free(heaps), free(sizes), free(slack);
        return HSTU_NO_MEMORY;
    }
    for (int64_t q = 0; q < B; q++) {
        float l1 = 0.0f;
        for (int64_t i = 0; i < p->dim; i++) l1 += fabsf(p->queries[q * p->dim + i]);
        slack[q] = l1 * (0.5f + 1e-3f);
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), per = (blocks + threads - 1) / threads;
        topk_range(p, min64(t * per, blocks), min64((t + 1) * per, blocks), heaps + t * B * k, sizes + t * B, slack);
    }
    /* merge: each query's kept items of every thread, sorted, the first k */
    for (int64_t q = 0; q < B; q++) {
        int64_t n = 0;
        scored *all = (scored *)malloc(sizeof(scored) * max64(threads * k, 1));
        if (!all) {
            free(heaps), free(sizes), free(slack);
            return HSTU_NO_MEMORY;
        }
        for (int64_t t = 0; t < threads; t++)
            for (int64_t i = 0; i < sizes[t * B + q]; i++) all[n++] = heaps[(t * B + q) * k + i];
        qsort(all, n, sizeof(scored), scored_compare);
        for (int64_t i = 0; i < k; i++) {
            p->values[q * k + i] = i < n ? all[i].value : -INFINITY;
            p->indices[q * k + i] = i < n ? all[i].index : -1;
        }
        free(all);
    }
    free(heaps), free(sizes), free(slack);
    return 0;
}
