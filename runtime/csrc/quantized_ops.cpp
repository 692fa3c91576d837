/* The quantized grouped lookup's native kernel as a torch operator: torch.ops.recompile_native.qeb_forward_pooled
 * (a fragment of ops.cpp's library; the kernel body is csrc/quantized.h, called through kernels.h's table), and
 * advise_huge_pages, the quantized tables' storage hint. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>

#include "kernels.h"

namespace recompile_native {
namespace {

void qeb_forward_pooled(int64_t tables, const at::Tensor &meta, int64_t batch, const at::Tensor &out,
                        int64_t out_stride, const at::Tensor &err, bool stream, int64_t nthreads) {
    for (const at::Tensor *t : {&meta, &out, &err})
        TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "recompile_native.qeb_forward_pooled: CPU tensors");
    TORCH_CHECK_TYPE(meta.scalar_type() == at::kLong && err.scalar_type() == at::kLong,
                     "recompile_native.qeb_forward_pooled: meta and err must be int64");
    TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "recompile_native.qeb_forward_pooled: out must be float32");
    TORCH_CHECK_VALUE(meta.numel() >= tables && err.numel() >= tables && out.numel() >= batch * out_stride,
                      "recompile_native.qeb_forward_pooled: meta, err or out is too small");
    kernels().qeb_forward_pooled(tables, meta.data_ptr<int64_t>(), batch, out.data_ptr<float>(), out_stride,
                                 err.data_ptr<int64_t>(), stream, (int)nthreads);
}

/* Put the whole 2 MiB pages of ``t``'s bytes on transparent huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE: Linux
 * 6.1+ collapses them now, compacting memory if it must, where a fault would take small pages on a fragmented
 * machine): a lookup reads a table's rows at random, and on 4 KiB pages nearly every row of a large table costs a
 * TLB miss (a walk of the page tables); on 2 MiB pages the TLB covers the tables. A hint: where the kernel has no
 * transparent huge pages, or none are free, it does nothing. */
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
void advise_huge_pages(const at::Tensor &t) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "recompile_native.advise_huge_pages: a contiguous CPU tensor");
    const uintptr_t huge = uintptr_t(2) << 20, start = reinterpret_cast<uintptr_t>(t.data_ptr());
    /* the pages past the last byte too, where the storage holds them (runtime/quantized.py's row_storage does) */
    const uintptr_t storage_end = reinterpret_cast<uintptr_t>(t.storage().data()) + t.storage().nbytes();
    const uintptr_t begin = (start + huge - 1) & ~(huge - 1),
                    end = std::min((start + t.nbytes() + huge - 1) & ~(huge - 1), storage_end & ~(huge - 1));
    if (end <= begin) return;
    madvise(reinterpret_cast<void *>(begin), end - begin, MADV_HUGEPAGE);
    madvise(reinterpret_cast<void *>(begin), end - begin, MADV_COLLAPSE);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(recompile_native, m) {
    m.def("qeb_forward_pooled(int tables, Tensor meta, int batch, Tensor(a!) out, int out_stride, Tensor(b!) err, "
          "bool stream, int threads) -> ()");
    m.def("advise_huge_pages(Tensor t) -> ()");
}

TORCH_LIBRARY_IMPL(recompile_native, CPU, m) {
    m.impl("qeb_forward_pooled", &qeb_forward_pooled);
    m.impl("advise_huge_pages", &advise_huge_pages);
}

}  // namespace recompile_native
