/* The instruction set the operators run (kernels.h kernels()): the best this CPU has, or RECOMPILE_ISA's. */
#include <stdlib.h>
#include <string.h>

#include <stdexcept>
#include <string>

#include "kernels.h"

namespace recompile_native {

static bool cpu_has(const char *isa) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!strcmp(isa, "avx512"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (!strcmp(isa, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return !strcmp(isa, "generic");
}

static const Kernels *by_name(const char *isa) {
#if defined(__x86_64__)
    if (!strcmp(isa, "avx512")) return &avx512_kernels;
    if (!strcmp(isa, "avx2")) return &avx2_kernels;
#endif
    return !strcmp(isa, "generic") ? &generic_kernels : nullptr;
}

static const Kernels &choose() {
    const char *forced = getenv("RECOMPILE_ISA");
    if (forced && *forced) {
        const Kernels *k = by_name(forced);
        if (!k) throw std::invalid_argument(std::string("RECOMPILE_ISA=") + forced + ": not one of generic, avx2, avx512");
        if (!cpu_has(forced)) throw std::invalid_argument(std::string("RECOMPILE_ISA=") + forced + ": this CPU lacks it");
        return *k;
    }
    for (const char *isa : {"avx512", "avx2"})
        if (by_name(isa) && cpu_has(isa)) return *by_name(isa);
    return generic_kernels;
}

const Kernels &kernels() {
    static const Kernels &chosen = choose();
    return chosen;
}

}  // namespace recompile_native
