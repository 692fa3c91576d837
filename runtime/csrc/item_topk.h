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

enum { TOPK_BLOCK = 16 };
typedef float v16f __attribute__((vector_size(TOPK_BLOCK * sizeof(float))));
typedef int8_t v16b __attribute__((vector_size(TOPK_BLOCK)));

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

/* Blocks [b0, b1) into the heaps (one per query, k each) of one thread. */
static void topk_range(const topk_problem *p, int64_t b0, int64_t b1, scored *heaps, int64_t *sizes, float *slack) {
    const int64_t B = p->batch, d = p->dim, k = p->k;
    v16f acc[8];
    for (int64_t q0 = 0; q0 < B; q0 += 8) {
        const int64_t nq = min64(8, B - q0);
        for (int64_t blk = b0; blk < b1; blk++) {
            const int8_t *codes = p->codes + blk * d * TOPK_BLOCK;
            for (int64_t q = 0; q < nq; q++) acc[q] = (v16f){0};
            for (int64_t i = 0; i < d; i++) {
                v16b c;
                memcpy(&c, codes + i * TOPK_BLOCK, sizeof c);
                const v16f x = __builtin_convertvector(c, v16f);
                for (int64_t q = 0; q < nq; q++) acc[q] += p->queries[(q0 + q) * d + i] * x;
            }
            v16f scale;
            memcpy(&scale, p->scales + blk * TOPK_BLOCK, sizeof scale);
            for (int64_t q = 0; q < nq; q++) {
                scored *heap = heaps + (q0 + q) * k;
                int64_t *size = sizes + q0 + q;
                const v16f bound = (acc[q] + slack[q0 + q]) * scale;
                const float threshold = *size < k ? -INFINITY : heap[0].value;
                for (int l = 0; l < TOPK_BLOCK; l++) {
                    const int64_t n = blk * TOPK_BLOCK + l;
                    if (bound[l] < threshold || n >= p->num_items) continue;
                    const scored x = {dot_f32(p->queries + (q0 + q) * d, p->items + n * d, d), n};
                    heap_push(heap, size, k, x);
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
