"""Lowering of the serving ops: HSTU attention over a paged KV cache (runtime/paged_attention.py), the Triton
kernel on accelerators, the native C++ kernel on CPU (keys read through the page table tile by tile), the torch
CPU kernel (the new rows against each user's gathered pages), else the reference."""
from recompile.lowering.registry import Impl, has_triton, native_on_cpu, on_cpu, reference, register_lowering
from recompile.runtime import jagged_attention_native

register_lowering(
    "recompile::hstu_paged_attention",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.paged_attention (query tiles, keys read through "
                                         "the page table)"),
    Impl("native", "cpu_kernel", native_on_cpu(jagged_attention_native.available),
         "runtime/csrc/paged_attention.h: OpenMP over (user, head, query block), pages read in place"),
    Impl("cpu", "cpu_kernel", on_cpu, "recompile.runtime.paged_attention (cpu: new rows against each user's gathered pages)"),
    reference("recompile.runtime.paged_attention (the whole sequence through hstu_attention's reference)"),
)
