/* The instruction set the operators run (kernels.h kernels()): the best this CPU has, or RECOMPILE_ISA's, until
 * use_isa() switches (tests and benchmarks run each path in one process). */
#include <stdlib.h>
#include <string.h>

#include <atomic>
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

static const Kernels &checked(const char *isa, const char *why) {
    const Kernels *k = by_name(isa);
    if (!k) throw std::invalid_argument(std::string(why) + isa + ": not one of generic, avx2, avx512");
    if (!cpu_has(isa)) throw std::invalid_argument(std::string(why) + isa + ": this CPU lacks it");
    return *k;
}

static const Kernels &choose() {
    const char *forced = getenv("RECOMPILE_ISA");
    if (forced && *forced) return checked(forced, "RECOMPILE_ISA=");
    for (const char *isa : {"avx512", "avx2"})
        if (by_name(isa) && cpu_has(isa)) return *by_name(isa);
    return generic_kernels;
}

static std::atomic<const Kernels *> current{nullptr};

const Kernels &kernels() {
    const Kernels *k = current.load(std::memory_order_acquire);
    if (!k) {
        k = &choose();
        current.store(k, std::memory_order_release);
    }
    return *k;
}

const char *use_isa(const char *isa) {
    const char *before = kernels().isa;
    current.store(&checked(isa, "use_isa: "), std::memory_order_release);
    return before;
}

bool has_isa(const char *isa) { return by_name(isa) && cpu_has(isa); }

}  // namespace recompile_native
