/* CPU kernel of recompile::dropout (runtime/dropout.py), plain C + OpenMP.
 *
 * Element i (of the tensor in row-major order) is kept when h(i) >= threshold, with
 *     h(i) = mix32(mix32(lo32(i) ^ s0) ^ (hi32(i) + s1))
 * and mix32 a 32-bit integer hash (xorshift-multiply, full avalanche): a counter-based generator, so the mask
 * depends only on the seed (s0, s1) and the index, not on threads or blocking, and the backward regenerates it
 * instead of storing it. runtime/dropout.py computes the same h with torch integer ops (the reference).
 */
#include <stdint.h>

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* out[i] = x[i] * scale where element i is kept, else x[i] * 0 (NaN and inf stay NaN, as in eager; out may be x). */
void dropout_f32(const float *x, float *out, int64_t n, uint32_t s0, uint32_t s1, uint32_t threshold, float scale,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = mix32(mix32((uint32_t)i ^ s0) ^ ((uint32_t)(i >> 32) + s1));
        out[i] = x[i] * (h >= threshold ? scale : 0.0f);
    }
}
