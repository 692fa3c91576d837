/* CPU kernel of recompile::dropout (runtime/dropout.py), plain C + OpenMP.
 *
 * Element i (of the tensor in row-major order) is kept when h(i) >= threshold, with
 *     h(i) = mix32(mix32(lo32(i) ^ s0) ^ (hi32(i) + s1))
 * and mix32 a 32-bit integer hash (xorshift-multiply, full avalanche): a counter-based generator, so the mask
 * depends only on the seed (s0, s1) and the index, not on threads or blocking, and the backward regenerates it
 * instead of storing it. runtime/dropout.py computes the same h with torch integer ops (the reference).
 * The hash runs on VL 32-bit lanes: a vector's VL indices share hi32 (VL divides 2^32), so no 64-bit lane
 * arithmetic (which AVX2 lacks) is needed.
 */
#include <stdint.h>

#include "vec.h"

typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));

template <class T> static inline T mix32(T x) { /* one uint32_t or a vector of them */
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t hash(int64_t i, uint32_t s0, uint32_t s1) {
    return mix32(mix32((uint32_t)i ^ s0) ^ ((uint32_t)(i >> 32) + s1));
}

/* out[i] = x[i] * scale where element i is kept, else x[i] * 0 (NaN and inf stay NaN, as in eager; out may be x). */
void dropout_f32(const float *x, float *out, int64_t n, uint32_t s0, uint32_t s1, uint32_t threshold, float scale,
                 int threads) {
    vu lane;
    for (int l = 0; l < VL; l++) lane[l] = l;
    const int64_t vectors = n / VL;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 65536)
    for (int64_t b = 0; b < vectors; b++) {
        const int64_t i = b * VL;
        const vu h = mix32(mix32(((uint32_t)i + lane) ^ s0) ^ ((uint32_t)(i >> 32) + s1));
        *(vfu *)(out + i) = *(const vfu *)(x + i) * vselect((vi)(h >= threshold), splat(scale), splat(0.0f));
    }
    for (int64_t i = vectors * VL; i < n; i++) out[i] = x[i] * (hash(i, s0, s1) >= threshold ? scale : 0.0f);
}
