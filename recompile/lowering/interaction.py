"""Lowering of the feature-interaction ops: Triton on accelerators, CPU kernels, references."""
from recompile.lowering.registry import Impl, has_triton, on_cpu, reference, register_lowering

register_lowering(
    "recompile::dot_interaction",
    Impl("triton", "triton", has_triton, "runtime.triton_kernels.interaction.dot_interaction"),
    Impl("cpu", "cpu_kernel", on_cpu, "bmm + index_select of the pairs"),
    reference("runtime.interaction.dot_interaction_reference"),
)
register_lowering(
    "recompile::cross_layer",
    Impl("triton", "triton", has_triton, "runtime.triton_kernels.interaction.cross_layer (tl.dot, fused epilogue)"),
    Impl("cpu", "cpu_kernel", on_cpu, "addmm + addcmul"),
    reference("runtime.interaction.cross_layer_reference"),
)
register_lowering(
    "recompile::fm_second_order",
    Impl("triton", "triton", has_triton, "runtime.triton_kernels.interaction.fm_second_order"),
    Impl("cpu", "cpu_kernel", on_cpu, "fp32 sum and sum of squares, combined in place"),
    reference("runtime.interaction.fm_second_order_reference"),
)
