"""Lowering of recompile::gru and recompile::lstm: the native CPU kernels, and the reference (the step formulas in
torch) anywhere."""
from recompile.lowering.registry import Impl, native_on_cpu, reference, register_lowering
from recompile.runtime import recurrent

for _kind in ("gru", "lstm"):
    register_lowering(
        f"recompile::{_kind}",
        Impl("native", "cpu_kernel", native_on_cpu(recurrent.available),
             f"runtime/csrc/{_kind}.h: all steps' input projections in one GEMM, per step a GEMM and one fused gate "
             "pass; backward through time over the saved gates"),
        reference("recompile.runtime.recurrent.recurrent_reference (the step formulas in torch, a loop over steps)"),
    )
