"""Lowering of the feature-interaction ops: Triton on accelerators, native CPU kernels, torch CPU kernels, references."""
from recompile.lowering.registry import Impl, has_triton, native_on_cpu, on_cpu, reference, register_lowering
from recompile.runtime import interaction_native

native_runs = native_on_cpu(interaction_native.available)  # runtime/csrc/interaction.h


register_lowering(
    "recompile::dot_interaction",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.interaction.dot_interaction (backward: the pair "
                                         "gradients scattered, one bmm, in torch)"),
    Impl("native", "cpu_kernel", native_runs, "csrc/interaction.h: blocked GEMM of the needed pairs, features read in "
                                              "place (backward too)"),
    Impl("cpu", "cpu_kernel", on_cpu, "bmm + index_select of the pairs (backward: scatter + bmm)"),
    reference("recompile.runtime.interaction.dot_interaction_reference"),
)
register_lowering(
    "recompile::cross_layer",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.interaction.cross_layer (tl.dot, fused epilogue)"),
    Impl("native", "cpu_kernel", native_runs, "mm (MKL) + csrc/interaction.h epilogue x0 * (h + b) + x, one pass"),
    Impl("cpu", "cpu_kernel", on_cpu, "addmm + addcmul"),
    reference("recompile.runtime.interaction.cross_layer_reference"),
)
register_lowering(
    "recompile::fm_second_order",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.interaction.fm_second_order"),
    Impl("native", "cpu_kernel", native_runs, "csrc/interaction.h: sum and sum of squares in one pass"),
    Impl("cpu", "cpu_kernel", on_cpu, "fp32 sum and sum of squares, combined in place"),
    reference("recompile.runtime.interaction.fm_second_order_reference"),
)
register_lowering(
    "recompile::cross_stack",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.interaction.cross_stack (per layer tl.dot + epilogue)"),
    Impl("native", "cpu_kernel", native_runs, "csrc/interaction.h: all layers per tile of rows in one pass where the "
         "weights stay in cache (else per layer mm (MKL), then h + b and x0 * (h + b) + x in one pass)"),
    Impl("cpu", "cpu_kernel", on_cpu, "per layer addmm (MKL) into the saved h + b, then one addcmul pass"),
    reference("recompile.runtime.interaction.cross_stack_reference"),
)
register_lowering(
    "recompile::cross_mixture",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.interaction.cross_mixture"),
    Impl("native", "cpu_kernel", native_runs, "csrc/interaction.h: inference per tile of rows, the gate, every "
         "expert and x0 * y + x in one pass where the weights stay in cache (training: the cpu kernel)"),
    Impl("cpu", "cpu_kernel", on_cpu, "all experts in three matmuls (concatenated V, one bmm of C, gate-scaled U)"),
    reference("recompile.runtime.interaction.cross_mixture_reference"),
)
register_lowering(
    "recompile::vector_cross",
    Impl("native", "cpu_kernel", native_runs, "csrc/interaction.h: per sample all layers over one row in L1, "
         "x and x0 read once; backward recomputes the layers per row"),
    Impl("cpu", "cpu_kernel", on_cpu, "two [B, D] x [D, L] matmuls, the layers' scalars, one addcmul pass"),
    reference("recompile.runtime.interaction.vector_cross_reference"),
)
