"""Lowering of recompile::complete_cumsum (lengths -> offsets)."""
from recompile.lowering.registry import Impl, has_fbgemm, has_triton, on_cpu, reference, register_lowering

register_lowering(
    "recompile::complete_cumsum",
    Impl("fbgemm", "library", has_fbgemm("asynchronous_complete_cumsum"),
         "torch.ops.fbgemm.asynchronous_complete_cumsum"),
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.offsets"),
    Impl("cpu", "cpu_kernel", on_cpu, "torch.cumsum + pad"),
    reference("recompile.runtime.offsets.complete_cumsum_reference"),
)
