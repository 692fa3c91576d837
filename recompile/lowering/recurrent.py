"""Lowering of recompile::gru: the native CPU kernel, and the reference (the step formulas in torch) anywhere."""
from recompile.lowering.registry import Impl, native_on_cpu, reference, register_lowering
from recompile.runtime import recurrent

register_lowering(
    "recompile::gru",
    Impl("native", "cpu_kernel", native_on_cpu(recurrent.available),
         "runtime/csrc/gru.h: all steps' input projections in one GEMM, per step a GEMM and one fused gate pass; "
         "backward through time over the saved gates"),
    reference("recompile.runtime.recurrent.gru_reference (the step formulas in torch, a loop over steps)"),
)
