"""Lowering of recompile::beam_decode_attention: the Triton kernel on accelerators, the CPU kernel (the shared
context scored by all beams in one batched matmul, no per-beam copy), the reference (per-beam copies) anywhere."""
from recompile.lowering.registry import Impl, has_triton, on_cpu, reference, register_lowering

register_lowering(
    "recompile::beam_decode_attention",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.beam_decode_attention (online softmax over "
                                         "context tiles per beam tile, then each beam's own keys)"),
    Impl("cpu", "cpu_kernel", on_cpu, "recompile.runtime.beam_decode_attention (shared-context batched matmul + per-beam "
                                      "suffix, one softmax)"),
    reference("recompile.runtime.beam_decode_attention.beam_decode_attention_reference (context copied per beam)"),
)
